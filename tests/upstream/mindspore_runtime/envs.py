"""MindSpore's real runtime, one release per environment, for tests/upstream/test_probe_mindspore_runtime.py.

Standard library only: dev.sh runs it with the system python3. It builds on tests/upstream/vllm_real/envs.py and
tests/upstream/mindspore_real/envs.py (imported, not copied): the same cache root, wheel cache, marker rule and
MindSpore unpacking (the CPU backend kept; the GPU and Ascend backends left out).

The releases are those of MindSpore's compiled-pool oracle (tests/upstream/oracles/mindspore/build.py RELEASES).
Layout, under the cache root (KVGUARD_CACHE, default ~/.cache/kvguard), independent of any kvguard venv:
  mindspore-runtime-envs/base          a venv holding MindSpore's own dependencies, pinned (requirements.txt)
  mindspore-runtime-envs/mindspore-X   a venv (no pip) holding MindSpore X unpacked from its wheel, in front of
                                       the base's site-packages, reached through a .pth file.
kvguard itself comes from the checkout (the test puts exporter/ on PYTHONPATH).

    python3 tests/upstream/mindspore_runtime/envs.py setup [X ...]   build (or check) the envs
    python3 tests/upstream/mindspore_runtime/envs.py python X        print the python that runs X, if ready
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from mindspore_real import envs as mindspore_envs  # noqa: E402
from vllm_real import envs as vllm_envs  # noqa: E402

MARKER = vllm_envs.MARKER


def _oracle_releases() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location(
        "_ms_oracle_build", HERE.parent / "oracles" / "mindspore" / "build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.RELEASES)


RELEASES = _oracle_releases()


def envs_dir() -> pathlib.Path:
    return vllm_envs.cache_root() / "mindspore-runtime-envs"


def env_dir(release: str) -> pathlib.Path:
    return envs_dir() / f"mindspore-{release}"


def _base() -> pathlib.Path:
    """The venv with MindSpore's pinned dependencies, built once."""
    base = envs_dir() / "base"
    pinned = vllm_envs.pinned_list(HERE / "requirements.txt")
    want = vllm_envs._digest(*pinned, sys.version)
    if (base / MARKER).is_file() and (base / MARKER).read_text() == want:
        return base
    shutil.rmtree(base, ignore_errors=True)
    vllm_envs._run([sys.executable, "-m", "venv", base])
    vllm_envs._run(vllm_envs._pip(base / "bin" / "python", "install", "--only-binary", ":all:", *pinned))
    (base / MARKER).write_text(want)
    return base


def python_for(release: str) -> pathlib.Path | None:
    """The python that runs MindSpore ``release`` once its env is built; None before."""
    return vllm_envs.ready_python(env_dir(release))


def setup(release: str) -> tuple[pathlib.Path, bool]:
    """Build the release's env if its inputs changed; return (python, built)."""
    if release not in RELEASES:
        raise SystemExit(f"unknown MindSpore release {release!r} (known: {', '.join(RELEASES)})")
    base_site = vllm_envs._site_packages(_base())
    wheel = vllm_envs._wheel("mindspore", release)
    env = env_dir(release)
    want = vllm_envs._digest(
        wheel.name, str(base_site), (envs_dir() / "base" / MARKER).read_text(), repr(mindspore_envs._MINDSPORE_SKIP)
    )
    if (env / MARKER).is_file() and (env / MARKER).read_text() == want:
        return env / "bin" / "python", False
    wheel = vllm_envs._wheel("mindspore", release, fetch=True)
    shutil.rmtree(env, ignore_errors=True)
    vllm_envs._run([sys.executable, "-m", "venv", "--without-pip", env])
    (vllm_envs._site_packages(env) / "_kvguard_base.pth").write_text(f"{base_site}\n")
    mindspore_envs._unpack_mindspore(wheel, env)
    python = env / "bin" / "python"
    check = subprocess.run(
        [str(python), "-c", "import mindspore; print(mindspore.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if check.returncode != 0 or check.stdout.strip() != release:
        raise SystemExit(
            f"MindSpore {release} in {env} does not import: {(check.stderr or check.stdout).strip()[-300:]}"
        )
    (env / MARKER).write_text(want)
    return python, True


def main(argv: list[str]) -> int:
    if argv and argv[0] == "setup":
        for release in argv[1:] or RELEASES:
            python, built = setup(release)
            print(f"mindspore {release}: {'built' if built else 'ready'} ({python})", flush=True)
        return 0
    if len(argv) == 2 and argv[0] == "python":
        python = python_for(argv[1])
        if python is None:
            return 1
        print(python)
        return 0
    print("usage: envs.py setup [X ...] | envs.py python X", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
