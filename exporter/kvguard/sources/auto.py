"""Whatever is present: the framework allocator in a serving process, device-level sources elsewhere.

- In a process that has already imported MindSpore (on a device) or torch with a
  device backend, the allocator source of that framework: the probe's case.
- Otherwise every device-level source that answers (NVML, npu-smi) plus ``host``: the
  sidecar's case.

It never imports mindspore or torch itself: it looks them up in ``sys.modules``. A
framework that is imported but has not touched its device yet gives an empty sample
rather than a device-level one, so a probe never writes a snapshot for the wrong device.
"""

from __future__ import annotations

import sys
import threading

from kvguard.records import DeviceMemory
from kvguard.sources import (
    Source,
    SourceError,
    SourceUnavailable,
    close_source,
    complete_records,
    engine_thread_only,
    source_skips,
)
from kvguard.sources.host import HostSource
from kvguard.sources.mindspore import MindSporeSource
from kvguard.sources.npu_smi import NpuSmiSource
from kvguard.sources.nvml import NvmlSource
from kvguard.sources.torch import TorchSource


def framework_in_process() -> str | None:
    """``mindspore``, ``torch`` or None: the allocator this process already uses."""
    ms = sys.modules.get("mindspore")
    if ms is not None:
        try:
            if str(ms.get_context("device_target")) != "CPU":
                return "mindspore"
        except Exception:  # noqa: BLE001 - a half-imported mindspore is not a backend
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        if "torch_npu" in sys.modules:
            return "torch"
        try:
            if torch.cuda.is_available():
                return "torch"
        except Exception:  # noqa: BLE001
            pass
    return None


class AutoSource:
    name = "auto"

    def __init__(self, npu_smi_timeout: float = 10.0, nvml_mig: bool = False, device: int | None = None):
        """``device``: the framework device index to read (the vLLM plugin passes its worker's). Unset, torch's
        current device *of the sampling thread* is read, which on a thread of the probe's own is device 0:
        CUDA's and torch_npu's current device is per thread (cudaGetDevice; torch_npu NPUFunctions.cpp:196-221
        @ v26.2.0-beta.1 turns a thread with no context into device 0)."""
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise SourceError(f"device must be an index or unset, got {device!r}")
        self._device = device
        self._lock = threading.Lock()
        self._framework: Source | None = None
        # None until the first device-level sample has shown which backends are present.
        self._device_sources: list[Source] | None = None
        self._npu_smi_timeout = npu_smi_timeout
        self._nvml_mig = nvml_mig

    @property
    def timeout_seconds(self) -> float:
        """The longest a read can take by this source's own limits (npu-smi's), for the poller."""
        return self._npu_smi_timeout

    @property
    def engine_thread_only(self) -> bool:
        """True once the framework in this process is one whose reads must run on the engine's thread
        (MindSpore: kvguard.sources.mindspore); the probe then samples at the engine's step boundaries."""
        return engine_thread_only(self._framework_source())

    def complete(self, records: list[DeviceMemory]) -> list[DeviceMemory]:
        """The framework source's file reads beside its counters (MindSpore's pool dump), if it has any."""
        with self._lock:
            framework = self._framework
        return complete_records(framework, records) if framework is not None else records

    @property
    def skipped_total(self) -> int:
        """The framework source's skipped files (MindSpore's pool dumps), 0 where it has none."""
        with self._lock:
            framework = self._framework
        return source_skips(framework)

    def sample(self) -> list[DeviceMemory]:
        framework = self._framework_source()
        if framework is not None:
            return framework.sample()
        with self._lock:
            first = self._device_sources is None
            candidates = (
                [NvmlSource(mig=self._nvml_mig), NpuSmiSource(timeout=self._npu_smi_timeout), HostSource()]
                if first
                else list(self._device_sources or [])
            )
            records: list[DeviceMemory] = []
            errors: list[SourceError] = []
            present: list[Source] = []
            for source in candidates:
                try:
                    records.extend(source.sample())
                except SourceUnavailable as exc:
                    if first:  # absent here: never asked again
                        close_source(source)
                        continue
                    errors.append(exc)
                except SourceError as exc:
                    errors.append(exc)  # present but failing now: keep it, its errors are worth seeing
                present.append(source)
            if first:
                self._device_sources = present
        if not records and errors:
            raise errors[0]
        return records

    def _framework_source(self) -> Source | None:
        with self._lock:
            if self._framework is None:
                kind = framework_in_process()
                if kind == "mindspore":
                    self._framework = MindSporeSource(sys.modules["mindspore"])
                elif kind == "torch":
                    self._framework = TorchSource(
                        initialize=False, torch_module=sys.modules["torch"], device=self._device
                    )
            return self._framework

    def resolved(self) -> list[str]:
        """Names of the sources auto has resolved to so far."""
        with self._lock:
            if self._framework is not None:
                return [self._framework.name]
            return [source.name for source in self._device_sources or []]

    def close(self) -> None:
        with self._lock:
            for source in [self._framework, *(self._device_sources or [])]:
                if source is not None:
                    close_source(source)
