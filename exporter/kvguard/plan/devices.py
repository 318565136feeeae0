"""Named devices for ``kvguard plan --device``: memory per device, in one table.

Sizes are the vendor spec sheets' figures read as GiB (the sheets write "GB" for HBM stacks of
2^30-byte gigabytes). The runtime reports a little less as its total (an H100 80GB: 79.19-79.22 GiB in
tests/data/logs/real r01/r38; an Ascend 910B 64 GB: 60.97 GiB in r15/r16): give ``--device`` a size
(``--device 79.22GiB``) to plan against the exact figure the runtime states.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvguard.units import parse_size

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    platform: str            # "cuda" or "ascend": which releases run on it
    source: str              # the vendor's spec sheet

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_bytes": self.memory_bytes, "platform": self.platform,
                "source": self.source}


DEVICES: tuple[DeviceSpec, ...] = (
    DeviceSpec("910B4", 32 * GIB, "ascend", "Huawei Atlas 800I A2 inference server spec sheet: Ascend 910B4, 32 GB HBM"),
    DeviceSpec("910B", 64 * GIB, "ascend", "Huawei Atlas 800T A2 training server spec sheet: Ascend 910B, 64 GB HBM"),
    DeviceSpec("A100-40GB", 40 * GIB, "cuda", "NVIDIA A100 Tensor Core GPU datasheet: A100 40GB HBM2"),
    DeviceSpec("A100-80GB", 80 * GIB, "cuda", "NVIDIA A100 Tensor Core GPU datasheet: A100 80GB HBM2e"),
    DeviceSpec("L40S", 48 * GIB, "cuda", "NVIDIA L40S GPU datasheet: 48GB GDDR6"),
    DeviceSpec("H100", 80 * GIB, "cuda", "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM 80GB HBM3"),
    DeviceSpec("H200", 141 * GIB, "cuda", "NVIDIA H200 Tensor Core GPU datasheet: H200 SXM 141GB HBM3e"),
)
# Other spellings of a named device.
ALIASES = {"A100": "A100-80GB", "A100-40G": "A100-40GB", "A100-80G": "A100-80GB", "ASCEND910B": "910B",
           "ASCEND910B4": "910B4", "H100-80GB": "H100", "H200-141GB": "H200"}


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
        raise DeviceError(f"unknown --device {str(text)[:40]!r}: a named device ({names}) or a size "
                          f"such as 64GiB") from None
    if size <= 0:
        raise DeviceError(f"--device size must be positive, got {str(text)[:40]!r}")
    return DeviceSpec(f"{size} bytes", size, platform or "cuda", "given as a size")
