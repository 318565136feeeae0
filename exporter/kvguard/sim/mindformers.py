"""Models vllm-mindspore serves through MindFormers, and what MindFormers' path changes in their memory.

vllm-mindspore 0.2.x registers some architectures only in its MindFormers backend (``vLLM_MODEL_BACKEND=
MindFormers``): ``vllm_mindspore/model_executor/models/registry.py`` r0.2 (4e250b5a):32-42 has
``DeepseekV3ForCausalLM`` in ``_MINDFORMERS_MODELS`` and not in the native ``_MINDSPORE_MODELS`` (Llama and Qwen2
only), so a DeepSeek-V3 served by that release runs MindFormers' network (``mf_models/deepseek_v3.py``) from the
YAML named by ``MINDFORMERS_MODEL_CONFIG`` (``mf_model_base.py`` r0.2:65-74, its ``model_parallel`` set to vLLM's
TP). The recipe is the one MindFormers publishes for it at the commit the release pins (its MindFormers
submodule, 5b25f655): ``research/deepseek3/deepseek3_671b/predict_deepseek3_671b_w8a8.yaml`` (``model_parallel:
16``, ``expert_parallel: 1``, ``vocab_emb_dp: False``, ``quant_method: 'ptq'``), the one 0.2.0's own system test
serves (its ``test_vllm_deepseek_part.py`` r0.2:64-65, DeepSeek-R1-W8A8; 910B runs no fp8).

What that path holds per rank, beside what vLLM's own model would (plan's rule:
bench/results/plan-seed-mindformers-rule-2026-12-07.md):

- the token embedding whole: ``vocab_emb_dp`` False builds ``VocabEmbedding``, not the vocab-parallel one
  (MindFormers ``research/deepseek3/deepseek3_model_infer.py`` 5b25f655:975-985), loaded without a split
  (``deepseekv3_weight_processor.py`` r0.2:401-408); the lm_head is split by rows (:416-425);
- the linear weights as golden-stick's W8A8 'ptq' stores them (``deepseek_v3.py`` r0.2:150-165
  ``create_ptq``): kvguard.sim.quantization's ``mindformers_ptq`` format;
- MindFormers' own tensor-parallel communicator, created with the network (``deepseek3_model_infer.py``
  5b25f655:1105-1114 ``initialize_model_parallel``, whose tensor-parallel group is made eagerly when TP > 1:
  ``mindformers/experimental/parallel_core/pynative/parallel_state.py`` 5b25f655:237-330); the network's
  all-reduces run on it, so the profile forward uses it. It is created in ``load_model``, after vLLM 0.7.3's
  baseline snapshot.

Left out, open in the source (docs/how-to/plan.md names each with its range): MindSpore's ``hccl_world_group``
as a communicator apart from vLLM's world group, the RoPE tables and decode masks, and MindFormers' MoE permute
buffers (the activation model is vLLM's fused MoE).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MindFormersPath:
    """One release range's MindFormers-only architectures and the published recipe they run."""

    launchers: tuple[str, ...]  # vllm-mindspore launchers (kvguard.allocators.mindspore_releases) it applies to
    architectures: tuple[str, ...]
    quant_method: str  # the recipe's quant_method: golden-stick's 'ptq' W8A8
    vocab_parallel_embedding: bool  # the recipe's vocab_emb_dp
    own_tp_communicator: bool
    cite: str
    # The model the recipe was written for (its YAML's model_config): another model of the architecture has no
    # published recipe at that commit, and is read as vLLM's model, as the checkpoint's config.json says.
    recipe_model: tuple[tuple[str, int], ...] = ()


PATHS = (
    MindFormersPath(
        launchers=("0.2.0",),
        architectures=("DeepseekV3ForCausalLM",),
        quant_method="ptq",
        vocab_parallel_embedding=False,
        own_tp_communicator=True,
        cite="vllm_mindspore registry.py r0.2:32-42; MindFormers predict_deepseek3_671b_w8a8.yaml 5b25f655",
        # predict_deepseek3_671b_w8a8.yaml 5b25f655:41-45 (num_layers 61, hidden_size 7168) and its
        # n_routed_experts 256 (DeepSeek-V3 / R1 671B).
        recipe_model=(("hidden_size", 7168), ("num_hidden_layers", 61), ("n_routed_experts", 256)),
    ),
)


def mindformers_path(launcher: str | None, config: Mapping[str, Any]) -> MindFormersPath | None:
    """The MindFormers path a model config runs on under vllm-mindspore ``launcher`` with its published recipe
    (None: read as vLLM's own model, also for a model of the architecture the recipe was not written for)."""
    if launcher is None or not isinstance(config, Mapping):
        return None
    architectures = config.get("architectures")
    if not isinstance(architectures, list):
        return None
    for path in PATHS:
        if launcher in path.launchers and any(arch in path.architectures for arch in architectures):
            if all(config.get(key) == value for key, value in path.recipe_model):
                return path
    return None
