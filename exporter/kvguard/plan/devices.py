"""Named devices for ``kvguard plan --device``: the total memory each one's runtime reports, in one table.

vLLM budgets from the total its runtime reports (``torch.cuda.mem_get_info`` / ``torch.npu.mem_get_info``:
``init_snapshot.total_memory x gpu_memory_utilization``), not from the spec sheet. A "64 GB" 910B reports
65,452,113,920 bytes (60.96 GiB): planning with 64 GiB would grant 0.9 x 3.04 GiB of budget that does not
exist. So each row plans with ``memory_bytes``, the total a real log or vendor tool printed for that device,
cited in ``source``; the spec-sheet size stays as ``label``. Where a log prints GiB to two decimals the bytes
are that figure (to 0.005 GiB); where it prints bytes they are exact. A device's total varies a little with
driver and firmware: ``--device SIZE`` (``--device 79.22GiB``) plans with the exact figure your runtime states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvguard.units import parse_size

GIB = 1 << 30


def _gib(figure: float) -> int:
    """A total printed as GiB to two decimals, in bytes."""
    return round(figure * GIB)


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int  # the total the runtime reports: what plan budgets from
    platform: str  # "cuda" or "ascend": which releases run on it
    source: str  # where memory_bytes was printed (a real log or vendor tool output)
    label: str = ""  # the spec sheet's size, a label only
    label_source: str = ""  # the spec sheet

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "platform": self.platform,
            "source": self.source,
            "label": self.label,
            "label_source": self.label_source,
        }


DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        "910B4",
        31_662_800_896,
        "ascend",
        "vllm-ascend worker_v1.py:186 on a 910B4, TP8 (Aug 2025): 'Available memory: 20467668582, total "
        "memory: 31662800896' on all 8 ranks; torch_npu device properties of an Ascend910B4: "
        "'total_memory_bytes: 31662800896'",
        "32 GB HBM",
        "Huawei Atlas 800I A2 inference server spec sheet: Ascend 910B4, 32 GB HBM",
    ),
    DeviceSpec(
        "910B",
        65_452_113_920,
        "ascend",
        "tests/data/logs/real/r39.log (vllm-ascend PR #2139, worker_v1.py:184): 'total memory: "
        "65452113920' on every rank; r47/r52 (torch_npu OOM): '60.96 GiB total capacity'",
        "64 GB HBM",
        "Huawei Atlas 800T A2 training server spec sheet: Ascend 910B, 64 GB HBM",
    ),
    DeviceSpec(
        "A100-40GB",
        _gib(39.50),
        "cuda",
        "TianheWu/CoSeR#10 (one A100 40GB, torch OOM): 'GPU 0 has a total capacity of 39.50 GiB'",
        "40 GB HBM2",
        "NVIDIA A100 Tensor Core GPU datasheet: A100 40GB HBM2",
    ),
    DeviceSpec(
        "A100-80GB",
        _gib(79.25),
        "cuda",
        "tests/data/logs/real/r43.log (ovg-project/kvcached#110, vLLM 0.9.2, A100 80GB): 'Free memory on "
        "device (67.24/79.25 GiB)'; r09 (another driver): 79.32 GiB",
        "80 GB HBM2e",
        "NVIDIA A100 Tensor Core GPU datasheet: A100 80GB HBM2e",
    ),
    DeviceSpec(
        "L40S",
        _gib(44.42),
        "cuda",
        "stepfun-ai/Step-Video-T2V#8 ('Run 8*L40S OOM', torch OOM): 'GPU has a total capacity of 44.42 GiB'; "
        "nvidia-smi states 46068MiB (44.99 GiB), the most it can report",
        "48 GB GDDR6",
        "NVIDIA L40S GPU datasheet: 48GB GDDR6",
    ),
    DeviceSpec(
        "H100",
        _gib(79.11),
        "cuda",
        "vllm-project/vllm#27508 (gpt-oss-120b on an H100, vLLM 0.11.0, torch OOM): 'GPU 0 has a total "
        "capacity of 79.11 GiB'; r01/r38 (PR #10511, an 80 GB GPU): 79.22 GiB; nvidia-smi states "
        "81559MiB (79.65 GiB) for 'NVIDIA H100 80GB HBM3' (wilicc/gpu-burn#114), more than the runtime's",
        "80 GB HBM3",
        "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 80GB HBM3",
    ),
    DeviceSpec(
        "H200",
        _gib(139.80),
        "cuda",
        "PrimeIntellect-ai/prime-rl benchmarks/results/BENCHMARKS.md, the version updated 2026-01-13 06:08 "
        "UTC (torch OOMs of its 8xH200 runs): 'GPU 5 has a total capacity of 139.80 GiB', the same on "
        "ranks 0, 1 and 7; its 8xH100 HBM3 runs state 79.21 GiB",
        "141 GB HBM3e",
        "NVIDIA H200 Tensor Core GPU datasheet: H200 SXM 141GB HBM3e",
    ),
)
# Other spellings of a named device.
ALIASES = {
    "A100": "A100-80GB",
    "A100-40G": "A100-40GB",
    "A100-80G": "A100-80GB",
    "ASCEND910B": "910B",
    "ASCEND910B4": "910B4",
    "H100-80GB": "H100",
    "H200-141GB": "H200",
}


class DeviceError(ValueError):
    """A --device that is neither a named device nor a size; the message is one line."""


def _key(text: str) -> str:
    return re.sub(r"[\s_]+", "-", text.strip()).upper()


def resolve_device(text: str, platform: str | None = None) -> DeviceSpec:
    """A named device (case-insensitive, ``A100`` = ``A100-80GB``) or a size (``64GiB``, bytes).

    A size names no platform: ``platform`` (``cuda`` / ``ascend``, from the release) is taken for it.
    """
    key = _key(str(text))
    by_name = {_key(d.name): d for d in DEVICES}
    key = _key(ALIASES.get(key, key))
    if key in by_name:
        return by_name[key]
    try:
        size = parse_size(str(text))
    except ValueError:
        names = ", ".join(d.name for d in DEVICES)
        raise DeviceError(
            f"unknown --device {str(text)[:40]!r}: a named device ({names}) or a size such as 64GiB"
        ) from None
    if size <= 0:
        raise DeviceError(f"--device size must be positive, got {str(text)[:40]!r}")
    return DeviceSpec(f"{size} bytes", size, platform or "cuda", "given as a size")
