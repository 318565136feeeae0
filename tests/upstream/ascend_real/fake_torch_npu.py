"""A fake ``torch_npu``: the NPU memory calls on tests/upstream/vllm_real's fake device, every other name a stub.

Runs inside an engine release's environment (envs.py), never in kvguard's own venv. The real
``torch-npu`` wheel installs from PyPI but does not import without CANN (libhccl.so, libascendcl.so).
What the engines' memory path calls is backed by :class:`vllm_real.fake_device.FakeDevice`:

  torch.npu / torch_npu.npu   mem_get_info, memory_stats, memory_reserved / memory_allocated and their
                              max_*, reset_peak_memory_stats, empty_cache, synchronize, set_device, ...
  torch.accelerator           the same calls, as vLLM 0.18+'s platform-neutral helpers make them

"npu" is made torch's PrivateUse1 backend name, as torch_npu does (torch.utils.rename_privateuse1_backend),
so ``torch.device("npu:0")`` is real; tensors created on it become meta tensors (no memory, nothing
charged). Every other ``torch_npu`` name (ops, ATB extensions, the profiler, HCCL) is a permissive stub:
importable, callable, off the memory path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pathlib
import sys
import types

import torch

# Ascend 910B1 (vllm_ascend/utils.py init_ascend_soc_version: 220-225 is A2).
SOC_VERSION = 220
DEVICE_NAME = "Ascend910B1"
# The chips a scenario's "soc" names: torch_npu's SocVersion (torch_npu/csrc/core/npu/NpuVariables.h:
# Ascend310P1 = 200, Ascend310P3 = 202, Ascend910B1 = 220) and the device type a vllm-ascend build for it
# writes to _build_info.py (setup.py 0.23.0.post1:153-193 gen_build_info: ascend310p3 -> "_310P").
SOCS = {"910B1": (220, "Ascend910B1", "A2"), "310P3": (202, "Ascend310P3", "_310P")}


def use_soc(soc: str) -> str:
    """Make the fake chip ``soc`` (a SOCS key); returns the device type its vllm-ascend build has."""
    global SOC_VERSION, DEVICE_NAME
    SOC_VERSION, DEVICE_NAME, device_type = SOCS[soc]
    return device_type


class Stub:
    """Any name torch_npu has that the memory path does not use: callable, indexable, falsy, a base class."""

    def __init__(self, name: str = "torch_npu"):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return Stub(f"{self._name}()")

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __getitem__(self, key):
        return Stub(f"{self._name}[]")

    def __or__(self, other):  # in annotations: torch_npu.X | None
        return self

    __ror__ = __or__

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return f"<stub {self._name}>"


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package: its submodules are stubs too
    module.__file__ = f"<fake {name}>"
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def missing(attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Stub(f"{name}.{attr}")

    module.__getattr__ = missing
    return module


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of any torch_npu submodule (torch_npu.op_plugin.atb._atb_ops, torch_npu.profiler, ...)."""

    # torchair (the graph-mode compiler) ships inside the torch-npu wheel (torch_npu/dynamo/torchair).
    # acl: CANN's pyACL (camem.py imports acl.rt.memcpy for sleep mode, off the memory path).
    # torchvision, torchaudio: vllm-ascend 0.17+'s model patches import vLLM's multimodal models and
    # processors, which import them; PyPI's builds link CUDA and do not load on this CPU torch.
    PACKAGES = ("torch_npu", "torchair", "acl", "torchvision", "torchaudio")
    VERSIONS = {"torchvision": "0.28.0", "torchaudio": "2.13.0"}  # the releases that go with torch 2.13

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def find_distributions(self, context=None):
        """Metadata of the stubbed torchvision / torchaudio (transformers reads a version before importing)."""
        import importlib.metadata as metadata

        name = getattr(context, "name", None)
        wanted = [n for n in self.VERSIONS if name in (None, n)]

        class Stubbed(metadata.Distribution):
            def __init__(self, project):
                self.project = project

            def read_text(self, filename):
                if filename != "METADATA":
                    return None
                return f"Metadata-Version: 2.1\nName: {self.project}\nVersion: {_StubFinder.VERSIONS[self.project]}\n"

            def locate_file(self, path):
                return pathlib.Path(path)

        return iter([Stubbed(n) for n in wanted])

    def create_module(self, spec):
        return sys.modules.get(spec.name) or _stub_module(spec.name)

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def memory_functions(device) -> dict[str, object]:
    """The torch.npu memory calls, counted on the fake device (names as torch_npu.npu has them)."""
    from fake_device import device_functions  # tests/upstream/vllm_real: the CUDA names, same semantics

    cuda = device_functions(device, name=DEVICE_NAME, capability=(9, 0))
    table = {attr.rsplit(".", 1)[-1]: fn for attr, fn in cuda.items() if attr.startswith("torch.cuda.")}

    def counted(label, fn):
        def call(*args, **kwargs):
            device.calls[label] += 1
            return fn(*args, **kwargs)

        return call

    table["get_soc_version"] = counted("torch.npu.get_soc_version", lambda *a, **k: SOC_VERSION)
    table["get_device_name"] = counted("torch.npu.get_device_name", lambda *a, **k: DEVICE_NAME)
    table["current_stream"] = lambda *a, **k: Stub("torch.npu.current_stream()")
    table["is_bf16_supported"] = lambda *a, **k: True
    accel = {attr.rsplit(".", 1)[-1]: fn for attr, fn in cuda.items() if attr.startswith("torch.accelerator.")}
    return {"npu": table, "accelerator": accel}


_installed = None


def install(device) -> None:
    """Make ``import torch_npu`` and ``torch.npu`` work, backed by ``device``; idempotent."""
    global _installed
    if _installed is not None:
        return
    functions = memory_functions(device)
    sys.meta_path.insert(0, _StubFinder())
    package = _stub_module("torch_npu")
    package.__version__ = "2.9.0.fake"
    sys.modules["torch_npu"] = package
    npu = _stub_module("torch_npu.npu")
    for attr, fn in functions["npu"].items():
        setattr(npu, attr, fn)
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    package.npu = npu
    sys.modules["torch_npu.npu"] = npu
    # What torch_npu's import does: "npu" is the PrivateUse1 backend, and torch.npu is its module.
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", npu)
    # torchair's own import loads these (vllm-ascend 0.18+ reloads them after patching ValuePack).
    importlib.import_module("torchair.fx_summary")
    importlib.import_module("torchair.npu_fx_compiler")
    # torch_npu adds HCCL's query to torch.distributed; there is no HCCL here (gloo stands in).
    torch.distributed.is_hccl_available = lambda: False
    # vLLM 0.18+ asks torch.accelerator: the same fake device.
    for attr, fn in functions["accelerator"].items():
        setattr(torch.accelerator, attr, fn)
    from fake_device import TensorsOnMeta  # tests/upstream/vllm_real: the same mode, for "npu"

    _installed = TensorsOnMeta("npu")
    _installed.__enter__()
