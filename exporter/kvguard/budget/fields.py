"""The startup profile's measured fields, once: the flag that sets each, its kind, its help, and the
words it is printed and asked for in.

``kvguard budget`` generates its options from this table, parses them into a ``Profile`` and prints
the profile with its words; ``log_profile`` and ``kvguard check`` name what a log lacks with its
phrases. Which fields an era's formula reads is the estimator's (``required_fields``,
``formula_inputs``); the table only says what each field is. Pure data: no click, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

# A field's kind: a size in bytes (units accepted on the command line), a size that may be negative
# (vLLM logs "non_torch_memory takes -0.51GiB"; consumed memory can drop), or a plain number.
KINDS = ("size", "signed_size", "float")


@dataclass(frozen=True)
class ProfileField:
    name: str  # the Profile attribute (and the profile file's key)
    flag: str | None  # kvguard budget's option; None where only a file or a log sets it
    kind: str  # one of KINDS
    help: str  # the option's help
    word: str  # in a printed profile: "weights 14.25 GiB"
    phrase: str  # in "states ... but not ..." messages: "the weights"
    hint: str = ""  # after the flag in "missing" messages
    # The eras whose formula adds the absolute non-torch memory (non_torch "positive") take this field
    # under another flag and name.
    absolute_flag: str | None = None
    absolute_help: str = ""
    absolute_word: str = ""

    def flag_for(self, absolute: bool = False) -> str | None:
        return self.absolute_flag if absolute and self.absolute_flag else self.flag

    def word_for(self, absolute: bool = False) -> str:
        return self.absolute_word if absolute and self.absolute_word else self.word


# In the Profile's own order (estimator.Profile, whose byte and signed fields come from here).
PROFILE_FIELDS: tuple[ProfileField, ...] = (
    ProfileField(
        "total_memory_bytes",
        "--total-memory",
        "size",
        "Device memory vLLM saw at startup (mem_get_info total).",
        "total",
        "the device's total memory",
    ),
    ProfileField(
        "gpu_memory_utilization",
        "--gpu-memory-utilization",
        "float",
        "vLLM's --gpu-memory-utilization, in (0, 1] (default: the era's resolved default).",
        "utilization",
        "gpu_memory_utilization",
    ),
    ProfileField("weights_bytes", "--weights", "size", "Model weights memory.", "weights", "the weights"),
    ProfileField(
        "peak_allocated_increase_bytes",
        "--peak-allocated-increase",
        "size",
        "Increase of allocated_bytes.all.peak during the profile run.",
        "allocated peak increase",
        "the profile run's allocated peak",
    ),
    ProfileField(
        "peak_reserved_increase_bytes",
        "--peak-reserved-increase",
        "size",
        "Increase of memory_reserved() during the profile run.",
        "reserved increase",
        "the profile run's reserved peak increase",
    ),
    ProfileField(
        "non_torch_increase_bytes",
        "--non-torch-increase",
        "signed_size",
        "Increase of non-torch memory since the init snapshot (vLLM's non_torch_increase); the eras "
        "that add the absolute non-torch memory take --non-torch-memory instead.",
        "non-torch increase",
        "the non-torch increase",
        absolute_flag="--non-torch-memory",
        absolute_help="vLLM V0, V1 0.8.5-0.9.0 and vllm-ascend <= 0.14: the absolute non-torch memory after "
        "the profile's empty_cache (total - free - torch allocated), which their formula adds "
        "when positive (vllm_ascend/worker/worker_v1.py 0.11.0:245-251).",
        absolute_word="non-torch memory",
    ),
    ProfileField(
        "total_consumed_bytes",
        "--total-consumed",
        "signed_size",
        "0.27+: free device memory at the init snapshot minus after the profile run.",
        "total consumed",
        "the total consumed",
    ),
    ProfileField(
        "transient_peak_headroom_bytes",
        "--transient-peak-headroom",
        "size",
        "0.27+: allocated peak minus allocated after the profile run.",
        "transient peak",
        "the transient peak",
    ),
    ProfileField(
        "reserved_transient_peak_bytes",
        "--reserved-transient-peak",
        "size",
        "0.27+: reserved peak minus reserved after the profile run (kvguard's).",
        "reserved transient peak",
        "the profile run's reserved transient peak",
    ),
    ProfileField(
        "cudagraph_memory_bytes",
        "--cudagraph-memory",
        "size",
        "0.18+: the CUDA-graph memory estimate vLLM subtracted (0 when disabled).",
        "CUDA graphs",
        "the CUDA-graph estimate",
        hint=" (the CUDA-graph estimate it subtracts; 0 if VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0)",
    ),
    ProfileField(
        "kv_cache_memory_bytes",
        None,
        "size",
        "vLLM's --kv-cache-memory-bytes (from a profile file or a log).",
        "--kv-cache-memory-bytes",
        "--kv-cache-memory-bytes",
    ),
    ProfileField(
        "init_free_memory_bytes",
        "--init-free-memory",
        "size",
        "0.34 extensible KV cache: free device memory at the init snapshot.",
        "free at init",
        "the free memory at the init snapshot",
    ),
    ProfileField(
        "free_after_warmup_bytes",
        "--free-after-warmup",
        "size",
        "0.34 extensible KV cache: free device memory after warm-up.",
        "free after warm-up",
        "the free memory after warm-up",
    ),
    ProfileField(
        "kv_committed_bytes",
        "--kv-committed",
        "size",
        "0.34 extensible KV cache: KV pages committed at the measurement.",
        "KV committed",
        "the KV pages committed after warm-up",
    ),
    ProfileField(
        "kv_transient_peak_bytes",
        "--kv-transient-peak",
        "size",
        "0.34 extensible KV cache: the transient peak it keeps free.",
        "KV transient peak",
        "the transient peak the KV cache keeps free",
    ),
    ProfileField(
        "torch_reserve_growth_bytes",
        "--torch-reserve-growth",
        "size",
        "0.34 extensible KV cache: torch's reserved growth over the sizing steps.",
        "torch reserve growth",
        "torch's reserved growth",
    ),
    ProfileField(
        "non_torch_cleared_bytes",
        "--non-torch-cleared",
        "signed_size",
        "vllm-ascend 0.15-0.17 and 310P: non-torch memory read inside the profile before empty_cache "
        "(total - free - memory_reserved()) less the non-torch increase: in effect the non-torch memory "
        "already there at startup (ACL context, HCCL), whatever empty_cache freed "
        "(vllm_ascend/worker/worker.py 0.17.0rc1:344-363).",
        "non-torch cleared",
        "the non-torch memory present at startup",
        hint=" (the non-torch memory present at startup, which it also subtracts)",
    ),
    ProfileField(
        "unprofiled_sampler_bytes",
        None,
        "size",
        "vllm-ascend V1 (from a profile file or the plugin): the activation peak of sampling a full batch with "
        "top-k and top-p, which its profile run leaves out (it computes the logits and runs no sampler, "
        "vllm_ascend/worker/model_runner_v1.py 0.23.0.post1:3666-3682). Not in the budget; the guard projects it "
        "(the plugin works it out from the model and scheduler config, kvguard.budget.sampler).",
        "unprofiled sampler peak",
        "the sampler peak the profile run left out",
    ),
)

_BY_NAME = {row.name: row for row in PROFILE_FIELDS}
# The fields kvguard budget has a flag for, in the order its --help lists them.
FLAGGED: tuple[ProfileField, ...] = tuple(row for row in PROFILE_FIELDS if row.flag)


def field(name: str) -> ProfileField:
    """The table row of a profile field; KeyError for a name that is not one."""
    return _BY_NAME[name]


def phrase(name: str) -> str:
    """How a message names a field (its own name for anything that is not one)."""
    return _BY_NAME[name].phrase if name in _BY_NAME else name
