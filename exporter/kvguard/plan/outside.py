"""Device memory outside the allocator that a release's budget subtracts: collective-communication buffers.

HCCL (Ascend): every communicator holds 2 x ``HCCL_BUFFSIZE`` MB (send and receive), 200 MB by default,
exclusively (CANN environment-variable reference, ``HCCL_BUFFSIZE``:
https://www.hiascend.com/document/detail/en/canncommercial/850/commlib/hcclug/hcclug_000076.html, "Each
communicator occupies 2 x HCCL_BUFFSIZE memory"; MB read as MiB, as HCCL allocates it).

Whether the budget sees it depends on where the release takes its baseline snapshot:

- vLLM V0 (``vllm/worker/worker.py`` 0.7.3:161 ``baseline_snapshot = MemorySnapshot()``, then :166
  ``init_worker_distributed_environment``), the worker vllm-mindspore 0.2.0 runs: the communicators are
  created after the baseline, so their buffers are ``non_torch_increase`` and come off the KV budget.
- vLLM V1 (``vllm/v1/worker/gpu_worker.py`` 0.11.0 ``init_device``: distributed init, then ``init_snapshot``):
  they are in the baseline and only lower the free memory the startup check reads. Not counted here.

Communicators per rank: one per parallel group of more than one rank that vLLM creates in
``init_worker_distributed_environment`` (``vllm/distributed/parallel_state.py`` 0.7.3: the world group, the
tensor-parallel group, the pipeline-parallel group). A held-out rule, written before the seed's DeepSeek-V3
figures were compared: nothing here is fitted to them.

NCCL (CUDA) buffers are not modelled: no V1-era budget subtracts them (above), and the V0 eras plan does
not predict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MIB = 1 << 20
HCCL_BUFFSIZE_DEFAULT_MB = 200
HCCL_CITE = (
    "CANN environment-variable reference, HCCL_BUFFSIZE (default 200 MB; each communicator occupies 2 x HCCL_BUFFSIZE)"
)
BASELINE_BEFORE_DISTRIBUTED_CITE = (
    "vllm/worker/worker.py 0.7.3:161,166 (baseline_snapshot before init_worker_distributed_environment)"
)


@dataclass(frozen=True)
class CollectiveBuffers:
    """Collective buffers per rank, and whether the release's budget subtracts them."""

    communicators: int
    bytes_per_communicator: int
    counted_in_budget: bool
    source: str

    @property
    def total_bytes(self) -> int:
        return self.communicators * self.bytes_per_communicator

    def to_dict(self) -> dict:
        return {
            "communicators": self.communicators,
            "bytes_per_communicator": self.bytes_per_communicator,
            "total_bytes": self.total_bytes,
            "counted_in_budget": self.counted_in_budget,
            "source": self.source,
        }


def communicators(tensor_parallel_size: int, pipeline_parallel_size: int = 1, model_tp_groups: int = 0) -> int:
    """Groups of more than one rank a rank belongs to: world, tensor-parallel, pipeline-parallel, and
    ``model_tp_groups`` tensor-parallel groups of the model's own (MindFormers': kvguard.sim.mindformers)."""
    world = tensor_parallel_size * pipeline_parallel_size
    vllm = sum(1 for size in (world, tensor_parallel_size, pipeline_parallel_size) if size > 1)
    return vllm + (model_tp_groups if tensor_parallel_size > 1 else 0)


def hccl_buffsize_bytes(env: Mapping[str, str]) -> int:
    """2 x HCCL_BUFFSIZE (MB; 200 unless the command's environment sets it) per communicator."""
    text = env.get("HCCL_BUFFSIZE")
    try:
        megabytes = int(text) if text is not None else HCCL_BUFFSIZE_DEFAULT_MB
    except ValueError:
        raise ValueError(f"HCCL_BUFFSIZE={text[:20]!r} is not an integer (MB)") from None
    if megabytes < 1:
        raise ValueError(f"HCCL_BUFFSIZE must be at least 1 (MB), got {megabytes}")
    return 2 * megabytes * MIB


def collective_buffers(
    platform: str,
    baseline_before_distributed: bool,
    tensor_parallel_size: int,
    env: Mapping[str, str],
    pipeline_parallel_size: int = 1,
    model_tp_groups: int = 0,
) -> CollectiveBuffers | None:
    """HCCL's buffers for one rank on Ascend; None on CUDA (not modelled). ``model_tp_groups``: tensor-parallel
    groups the model's network creates itself, after the baseline as vLLM's are (MindFormers' DeepSeek-V3 on
    vllm-mindspore 0.2.0: kvguard.sim.mindformers)."""
    if platform != "ascend":
        return None
    count = communicators(tensor_parallel_size, pipeline_parallel_size, model_tp_groups)
    where = (
        (
            "created after the baseline snapshot: non-torch increase, off the KV budget ("
            + BASELINE_BEFORE_DISTRIBUTED_CITE
            + ")"
        )
        if baseline_before_distributed
        else "created before the baseline snapshot: not in the budget's non-torch increase"
    )
    setting = "HCCL_BUFFSIZE from the command" if "HCCL_BUFFSIZE" in env else "HCCL_BUFFSIZE default 200 MB"
    own = ", and the model network's own TP group" if model_tp_groups and tensor_parallel_size > 1 else ""
    return CollectiveBuffers(
        count,
        hccl_buffsize_bytes(env),
        baseline_before_distributed,
        f"{count} HCCL communicator(s) (world, TP, PP groups of more than one rank{own}) x 2 x "
        f"{setting} [{HCCL_CITE}]; {where}",
    )
