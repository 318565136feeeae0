"""One rule, one answer (issue 22, item 1): where the plugin, ``kvguard budget`` and the simulator
each needed the KV-tensor layout or "is MindSpore's VMM on", they call one definition, so they
agree for the same inputs. Each test here failed while the copies disagreed."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
from helpers import invoke

from kvguard import plugin
from kvguard.allocators.mindspore_releases import VLLM_MINDSPORE_LAUNCHERS, parse_alloc_conf, release, vmm_enabled
from kvguard.budget.estimator import Profile
from kvguard.guard.at_budget import counters_at_budget
from kvguard.plugin import budget as plugin_budget, state as plugin_state
from kvguard.sim.scenario import ScenarioConfig
from kvguard.vllm.eras import era_for

GIB = 1 << 30

# DeepSeek-V2-Lite's attention, cut to 3 layers: one 576-wide latent per token (kv_lora_rank 512 +
# qk_rope_head_dim 64), bfloat16; vllm-mindspore's 128-token blocks (platforms/ascend.py:92-94 @ 0.5.1).
MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "num_hidden_layers": 3,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_size": 2048,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 4096,
}
BLOCK = 128
PAGE = BLOCK * 576 * 2  # MLAAttentionSpec.page_size_bytes: block_size * 1 head * 576 * 2 bytes

# A 64 GiB 910B rank measured by vllm-mindspore 0.5.1 (formula mindspore_reserved: the reserved increase).
PROFILE = Profile(
    total_memory_bytes=64 * GIB,
    gpu_memory_utilization=0.9,
    weights_bytes=30 * GIB,
    peak_allocated_increase_bytes=None,
    peak_reserved_increase_bytes=3 * GIB,
    non_torch_increase_bytes=GIB,
    formula="mindspore_reserved",
    vllm_version="vllm-mindspore:0.5.1",
)


@dataclass(frozen=True)
class MLAAttentionSpec:
    """vLLM's MLAAttentionSpec as vllm-mindspore's get_kv_cache_spec returns it for DeepSeek
    (v1/worker/gpu_model_runner.py:1048-1053 @ 0.5.1; vllm/v1/kv_cache_interface.py 0.11.0:142-150)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


class MLAWorker:
    """A vllm-mindspore worker's view the plugin reads at budget time: its per-layer specs."""

    def get_kv_cache_spec(self):
        return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(BLOCK, 1, 576) for i in range(3)}


class CountersAtBudget:
    """The device source: the counters ``kvguard budget --allocator`` derives from the same profile."""

    name = "at-budget"

    def __init__(self, enable_vmm: bool) -> None:
        self.memory = counters_at_budget(PROFILE, "mindspore", enable_vmm=enable_vmm)

    def sample(self):
        return [self.memory]


@pytest.fixture
def on_vllm_mindspore(monkeypatch):
    """The plugin inside a vllm-mindspore 0.5.1 worker: its package imported (running_release reads it)."""
    module = types.ModuleType("vllm_mindspore")
    module.__version__ = "0.5.1"
    monkeypatch.setitem(sys.modules, "vllm_mindspore", module)
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    monkeypatch.delenv("MS_ALLOC_CONF", raising=False)
    plugin.reset_for_tests()
    yield monkeypatch
    plugin.reset_for_tests()


def budget_at(tmp_path, *extra: str) -> dict:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MLA_CONFIG))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE.to_dict()))
    result = invoke(
        "budget",
        "--model-config",
        str(config),
        "--profile",
        str(profile),
        "--block-size",
        str(BLOCK),
        "--allocator",
        "mindspore",
        "--json",
        *extra,
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["at_budget"]


def test_mla_on_vllm_mindspore_the_plugin_and_budget_place_the_same_kv_tensors(on_vllm_mindspore, tmp_path):
    """vllm-mindspore allocates one tensor per MLA layer (coef 1: v1/worker/gpu_model_runner.py:613-614,
    628-642 @ 0.5.1), so the plugin's budget-time verdict is the CLI's, tensor for tensor."""
    at = budget_at(tmp_path)
    on_vllm_mindspore.setattr(plugin_state, "reader", CountersAtBudget(enable_vmm=at["enable_vmm"]))
    worker = MLAWorker()
    plugin_verdict = plugin_budget.verdict_at(worker, PROFILE, at["kv_cache_bytes"], plugin_budget.budget_model(worker))
    assert at["verdict"]["kv_tensors"] == 3
    assert plugin_verdict.to_dict() == at["verdict"]


# MS_ALLOC_CONF as an operator may write it, beside the launcher's own (None: unset).
ALLOC_CONFS = (
    None,
    "enable_vmm:false",
    "enable_vmm: True",
    "'enable_vmm:false'",
    "enable_vmm:0",
    "vmm_align_size:4MB; enable_vmm:false",
    "memory_tracker:true",
)


def simulated(**fields) -> ScenarioConfig:
    """A simulated vllm-mindspore run of the same model on a 64 GiB device."""
    return ScenarioConfig(model_config=MLA_CONFIG, device_memory_bytes=64 * GIB, allocator="mindspore", **fields)


def plugin_vmm(monkeypatch, conf: str | None) -> bool:
    if conf is None:
        monkeypatch.delenv("MS_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("MS_ALLOC_CONF", conf)
    monkeypatch.setattr(plugin_state, "reader", CountersAtBudget(enable_vmm=True))
    _, build = plugin_budget.budget_model(MLAWorker())
    return build().enable_vmm


@pytest.mark.parametrize("conf", ALLOC_CONFS)
def test_the_plugin_and_the_simulator_read_ms_alloc_conf_as_mindspore_does(on_vllm_mindspore, conf):
    """The same MS_ALLOC_CONF gives the same VMM answer in the live plugin, the simulator and MindSpore's
    own rule (vllm-mindspore's env_setup sets its string only when the variable is unset: scripts.py:55-58
    @ 0.5.1; MindSpore's parser strips quotes, takes ';' as ',', and only True/true/False/false count)."""
    launcher = "enable_vmm: true, derag_memory_step_freq: -1"  # scripts.py:52 @ 0.5.1
    mindspore = release("2.7.1")
    effective = parse_alloc_conf(launcher if conf is None else conf, mindspore, strict=False)
    expected = vmm_enabled(effective)
    assert plugin_vmm(on_vllm_mindspore, conf) is expected
    assert simulated(ms_alloc_conf=conf).enable_vmm is expected


@pytest.mark.parametrize("launcher", ("0.5.1", "0.2.0"))
def test_budget_plugin_and_simulator_take_the_same_vmm_default(on_vllm_mindspore, tmp_path, launcher):
    """Nobody set MS_ALLOC_CONF: ``kvguard budget --allocator mindspore`` for the release, the plugin in
    its worker and the simulated launcher all take the release's own default."""
    on_vllm_mindspore.setattr(sys.modules["vllm_mindspore"], "__version__", launcher)
    at = budget_at(tmp_path, "--vllm-version", f"vllm-mindspore:{launcher}")
    assert at["enable_vmm"] is plugin_vmm(on_vllm_mindspore, None)
    assert at["enable_vmm"] is simulated(vllm_mindspore_version=launcher).enable_vmm


def test_each_launchers_ms_alloc_conf_is_its_era_rows_vmm_default():
    """The launcher table keeps vllm-mindspore's literal MS_ALLOC_CONF string (scripts.py:52 @ 0.5.1; none at
    f2b96744 for 0.2.0); the era row's vmm_default, which vmm_on reads, says the same."""
    for launcher in VLLM_MINDSPORE_LAUNCHERS.values():
        conf = parse_alloc_conf(launcher.ms_alloc_conf, release(launcher.mindspore), strict=False)
        assert conf.flag("enable_vmm") == era_for(f"vllm-mindspore:{launcher.version}").vmm_default, launcher.version
