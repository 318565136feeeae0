"""Small per-release environments holding the real vLLM wheels, for tests/upstream/vllm_real.

Standard library only: dev.sh runs it with the system python3 before kvguard's venv exists.

Layout, under a cache folder outside the clone so that CI's fresh clones reuse it
(KVGUARD_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/kvguard):
  wheels/                 vllm wheels and the pinned dependencies' wheels, downloaded once
  vllm-envs/base-torch-V  one venv with the CPU torch and its own dependencies only
  vllm-envs/vllm-X        one venv per release: `pip install --no-deps vllm==X` plus the
                          pinned list requirements/vllm-X.txt (also --no-deps); it sees the
                          base's torch through a .pth file, so torch is installed once.
Each env is rebuilt only when its inputs (wheel, pinned list, base) change: a marker file holds
their digest, so a second run does nothing. A new env is pruned of vLLM's CUDA extensions (_C,
_moe_C, flash attention, ...): they link libcudart / libcuda, which a CPU machine lacks, so importing
them fails with ImportError whether or not they are there, and they are about two thirds of an env
(vLLM 0.11.0: 1.8 GB before, 0.5 GB after; its tests pass either way).

    python3 tests/upstream/vllm_real/envs.py setup [X ...]   build (or check) the envs, print timings
    python3 tests/upstream/vllm_real/envs.py prune [X ...]   prune envs built before pruning was added
    python3 tests/upstream/vllm_real/envs.py python X        print the env's python, if it is ready
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "oracles"))
from cache import cache_root, find_wheel  # noqa: E402  (tests/upstream/oracles/cache.py: the cache root the setup scripts share)

HERE = pathlib.Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements"
TORCH = "torch==2.13.0"  # the CPU build, as dev.sh installs it for kvguard's own venv
MARKER = ".kvguard-ready"


def wheels_dir() -> pathlib.Path:
    return cache_root() / "wheels"


def envs_dir() -> pathlib.Path:
    return cache_root() / "vllm-envs"


def releases() -> list[str]:
    """Every release with a pinned list, e.g. ['0.11.0', '0.34.0'] (sorted by version)."""
    names = [p.name[len("vllm-") : -len(".txt")] for p in REQUIREMENTS.glob("vllm-*.txt")]
    return sorted(names, key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))


def env_dir(version: str) -> pathlib.Path:
    return envs_dir() / f"vllm-{version}"


def env_python(version: str) -> pathlib.Path | None:
    """The release env's python, or None when that env has not been set up."""
    return ready_python(env_dir(version))


def ready_python(env: pathlib.Path) -> pathlib.Path | None:
    """An env's python once its marker says it is built (this file's, tests/upstream/ascend_real's,
    tests/upstream/mindspore_real's)."""
    python = env / "bin" / "python"
    return python if (env / MARKER).is_file() and python.exists() else None


def _site_packages(env: pathlib.Path) -> pathlib.Path:
    return env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _run(cmd: list, **kwargs) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n" + "\n".join(tail))


def _pip(python: pathlib.Path, *args) -> list:
    return [python, "-m", "pip", "-q", "--disable-pip-version-check", *args]


def _base() -> pathlib.Path:
    base = envs_dir() / f"base-{TORCH.replace('==', '-')}"
    want = _digest(TORCH, sys.version)
    if (base / MARKER).is_file() and (base / MARKER).read_text() == want:
        return base
    shutil.rmtree(base, ignore_errors=True)
    _run([sys.executable, "-m", "venv", base])
    python = base / "bin" / "python"
    # PyTorch's CPU index beside PyPI (dev.sh passes KVGUARD_TORCH_INDEX): PyPI's torch is the CUDA build.
    index = os.environ.get("KVGUARD_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    _run(_pip(python, "install", "--only-binary", ":all:", "--retries", "1", "--extra-index-url", index, TORCH))
    # Only the CPU build will do: a CUDA torch would pull nvidia-* and not import here.
    probe = subprocess.run([python, "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    if probe.stdout.strip() != "None":
        raise SystemExit(f"{TORCH} in {base} is not the CPU build (cuda={probe.stdout.strip()!r})")
    (base / MARKER).write_text(want)
    return base


def _wheel(name: str, version: str, fetch: bool = False) -> pathlib.Path:
    """The release's wheel from the wheel cache, downloaded (no dependencies) on first use. Once its env is
    built the wheel may be retired (tests/upstream/oracles/cache.py: its name kept, its bytes dropped); ``fetch``
    downloads
    it again for a build that needs the file."""
    wheels = wheels_dir()
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = find_wheel(wheels, pattern)
    if found is None or (fetch and not found.exists()):
        wheels.mkdir(parents=True, exist_ok=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                wheels,
                f"{name}=={version}",
            ]
        )
        found = find_wheel(wheels, pattern)
    if found is None or (fetch and not found.exists()):
        raise SystemExit(f"no wheel for {name}=={version} in {wheels}")
    return found


# Releases whose env runs only the KV-allocation check (tests/upstream/test_vllm_real.py), not a whole worker: their
# pinned lists are in requirements/layout/, outside releases().
LAYOUT_RELEASES = ("0.30.0",)


def _pinned(version: str) -> list[str]:
    path = REQUIREMENTS / f"vllm-{version}.txt"
    if not path.is_file():
        path = REQUIREMENTS / "layout" / f"vllm-{version}.txt"
    return pinned_list(path)


def pinned_list(path: pathlib.Path) -> list[str]:
    """A pinned requirements file's requirements, comments and blank lines left out."""
    lines = path.read_text().splitlines()
    return [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]


def setup(version: str) -> tuple[pathlib.Path, bool]:
    """Build the release env if its inputs changed; return (env, built)."""
    base = _base()
    wheel = _wheel("vllm", version)
    pinned = _pinned(version)
    env = env_dir(version)
    want = _digest(wheel.name, *pinned, (base / MARKER).read_text())
    if (env / MARKER).is_file() and (env / MARKER).read_text() == want:
        return env, False
    shutil.rmtree(env, ignore_errors=True)
    _run([sys.executable, "-m", "venv", "--without-pip", env])
    # torch (and pip, which runs in this env from there) from the base env.
    (_site_packages(env) / "_kvguard_base.pth").write_text(f"{_site_packages(base)}\n")
    python = env / "bin" / "python"
    wheel = _wheel("vllm", version, fetch=True)
    # Dependency wheels are kept in the wheel cache, so a rebuild needs no index.
    wheels = wheels_dir()
    install = _pip(python, "install", "--no-deps", "--no-index", "--find-links", wheels, wheel, *pinned)
    if subprocess.run([str(c) for c in install], capture_output=True).returncode != 0:
        _run(_pip(python, "download", "--no-deps", "--only-binary", ":all:", "-d", wheels, *pinned))
        _run(install)
    prune(env)
    (env / MARKER).write_text(want)
    return env, True


# What a CUDA extension needs that a CPU machine does not have (its dynamic section names them).
CUDA_LIBRARIES = (b"libcudart.so", b"libcuda.so")


def prune(env: pathlib.Path) -> int:
    """Remove the env's vLLM extension modules that need the CUDA runtime or driver; bytes freed."""
    freed = 0
    for path in (_site_packages(env) / "vllm").rglob("*.so"):
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cuda = any(data.find(name) >= 0 for name in CUDA_LIBRARIES)
        if cuda:
            freed += path.stat().st_size
            path.unlink()
    return freed


def setup_each(names, setup_one, label: str, what: str) -> int:
    """Set up each environment in turn, one line each (built or up to date, and the time), then a total."""
    total = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        env, built = setup_one(name)
        state = "built" if built else "up to date"
        print(f"{label.format(name)}: {state} in {time.perf_counter() - t0:.1f}s ({env})", flush=True)
    print(f"{what} ready in {time.perf_counter() - total:.1f}s", flush=True)
    return 0


def print_python(python, name: str) -> int:
    """``envs.py python NAME``: the environment's interpreter, or a one-line error when it is not set up."""
    if python is None:
        print(f"{name}: environment not set up", file=sys.stderr)
        return 1
    print(python)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "python":
        return print_python(env_python(argv[2]), f"vllm {argv[2]}")
    if len(argv) >= 2 and argv[1] == "prune":
        for version in argv[2:] or releases():
            if env_python(version) is not None:
                print(f"vllm {version}: {prune(env_dir(version)) / 1e9:.2f} GB of CUDA extensions removed", flush=True)
        return 0
    if len(argv) >= 2 and argv[1] == "setup":
        return setup_each(argv[2:] or releases() + list(LAYOUT_RELEASES), setup, "vllm {}", "vllm environments")
    print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
