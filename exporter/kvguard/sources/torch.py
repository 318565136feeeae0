"""PyTorch's caching allocator: ``torch.cuda`` or ``torch.npu`` (torch_npu) counters.

``memory_stats()`` is flattened with ``.`` separators (``allocated_bytes.all.current``);
torch_npu keeps the same keys. ``mem_get_info()`` is the device-wide ``(free, total)``.
:func:`device_memory_from_stats` is the one reader of those keys: the simulator's
counters go through it too.

Nothing here imports torch until a source is built, and a source never initialises a
device runtime that the host process has not initialised itself unless told to
(``initialize=True``, the default for the CLI): ``mem_get_info`` on a fresh device creates
a context of several hundred MiB.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from typing import Any, Mapping

from kvguard.records import DeviceMemory, identity_text
from kvguard.sources import SourceError, SourceUnavailable, count, free_total_used
from kvguard.text import install_hint, one_line

# DeviceMemory field <- memory_stats key (PyTorch's names, torch/csrc/cuda/Module.cpp).
STATS_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "active_bytes": "active_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}

BACKENDS = ("auto", "cuda", "npu")
# CUDA's 16-byte device UUID as torch prints it (``str(props.uuid)``, 8-4-4-4-12 hex digits); NVML
# and dcgm-exporter write the same bytes with a ``GPU-`` prefix.
_BARE_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")


def device_memory_from_stats(
    stats: Mapping[str, Any],
    device: str,
    source: str = "torch",
    *,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
) -> DeviceMemory:
    """A ``memory_stats()`` dict as a DeviceMemory; a key the dict lacks stays None.

    An empty dict is what torch returns before the allocator is initialised: every
    allocator field is then None, not 0.
    """
    if not isinstance(stats, Mapping):
        raise SourceError(f"memory_stats() returned {type(stats).__name__}, not a dict")
    values = {field: count(stats.get(key)) for field, key in STATS_KEYS.items()}
    return DeviceMemory(device=device, source=source, **free_total_used(free_bytes, total_bytes), **values)


class TorchSource:
    """The caching allocator of this process's current (or a given) device.

    ``backend``: ``cuda``, ``npu`` (torch_npu), or ``auto`` (npu when torch_npu is loaded).
    ``device``: an index, ``None`` for the current device, or ``"all"`` for every visible one.
    ``initialize``: whether sampling may initialise the device runtime; with False a process
    that has not touched the device yet gets an empty sample.
    """

    name = "torch"

    def __init__(
        self, backend: str = "auto", device: int | str | None = None, initialize: bool = True, torch_module: Any = None
    ):
        if backend not in BACKENDS:
            raise SourceError(f"unknown torch backend {backend!r} (choose from {', '.join(BACKENDS)})")
        if (
            device is not None
            and device != "all"
            and (isinstance(device, bool) or not isinstance(device, int) or device < 0)
        ):
            raise SourceError(f"torch device must be an index, 'all' or unset, got {device!r}")
        self._backend = backend
        self._device = device
        self._initialize = initialize
        self._torch = torch_module
        self._identities: dict[tuple[str, int], tuple[str, str]] = {}

    def _accelerator(self) -> tuple[str, Any]:
        torch = self._torch
        if torch is None:
            try:
                import torch  # noqa: PLC0415 - imported only when this source is used
            except ImportError:
                raise SourceUnavailable(f"torch is not installed ({install_hint('torch')})") from None
            except Exception as exc:  # noqa: BLE001 - a broken install must not raise its own type
                raise SourceUnavailable(f"torch failed to import: {one_line(exc)}") from None
            self._torch = torch
        backend = self._backend
        if backend == "auto":
            backend = "npu" if ("torch_npu" in sys.modules or hasattr(torch, "npu")) else "cuda"
        module = getattr(torch, backend, None)
        if module is None:
            hint = " (import torch_npu first)" if backend == "npu" else ""
            raise SourceUnavailable(f"torch.{backend} is not present{hint}")
        return backend, module

    def sample(self) -> list[DeviceMemory]:
        backend, module = self._accelerator()
        try:
            if not self._initialize and not _is_initialized(module):
                return []
            if not module.is_available():
                raise SourceUnavailable(f"torch.{backend} is not available (no device or no {backend} build)")
            if self._device == "all":
                indices = list(range(module.device_count()))
            elif self._device is None:
                indices = [module.current_device()]
            else:
                indices = [self._device]
            return [self._read(backend, module, index) for index in indices]
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/AssertionError alike
            raise SourceError(f"torch.{backend}: {one_line(exc)}") from None

    def _read(self, backend: str, module: Any, index: int) -> DeviceMemory:
        # mem_get_info first: on a device not yet touched it initialises the allocator,
        # and memory_stats() of an uninitialised allocator is an empty dict.
        free, total = module.mem_get_info(index)
        stats = module.memory_stats(index)
        record = device_memory_from_stats(stats, f"{backend}:{index}", self.name, free_bytes=free, total_bytes=total)
        key = (backend, index)
        if key not in self._identities:  # fixed for the device's life: asked once
            self._identities[key] = device_identity(backend, module, index)
        uuid, pci_bus_id = self._identities[key]
        return replace(record, device_uuid=uuid, pci_bus_id=pci_bus_id)


def device_identity(backend: str, module: Any, index: int) -> tuple[str, str]:
    """(UUID, PCI bus id) from ``get_device_properties(index)``; "" for what this release lacks.

    ``uuid``: torch.cuda's ``_CudaDeviceProperties.uuid`` (a ``_CUuuid``; ``str()`` is the bare
    8-4-4-4-12 form, given NVML's ``GPU-`` prefix here so it equals dcgm-exporter's ``UUID``; inside
    a MIG instance CUDA reports the MIG device's UUID, which NVML writes ``MIG-…`` and torch cannot
    tell apart: it gets ``GPU-`` too, see docs/metrics.md); torch_npu's properties have no UUID in the releases we know
    and are read only if a later one adds the attribute. PCI: ``pci_domain_id``, ``pci_bus_id``,
    ``pci_device_id`` where the torch release has them, written as NVML writes ``busId``
    (``%08X:%02X:%02X.0``).
    """
    try:
        props = module.get_device_properties(index)
    except Exception:  # noqa: BLE001 - identity is an extra; the counters still count
        return "", ""
    uuid = getattr(props, "uuid", None)
    uuid_text = "" if uuid is None else identity_text(str(uuid))
    if backend == "cuda" and _BARE_UUID.match(uuid_text):
        uuid_text = f"GPU-{uuid_text}"
    pci = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    pci_text = ""
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32 for v in pci):
        pci_text = f"{pci[0]:08X}:{pci[1]:02X}:{pci[2]:02X}.0"
    return uuid_text, pci_text


def _is_initialized(module: Any) -> bool:
    check = getattr(module, "is_initialized", None)
    if not callable(check):
        return False
    try:
        return bool(check())
    except Exception:  # noqa: BLE001
        return False
