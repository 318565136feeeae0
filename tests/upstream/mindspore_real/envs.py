"""The environment holding the real vllm-mindspore release, for tests/upstream/mindspore_real.

Standard library only: dev.sh runs it with the system python3 before kvguard's venv exists.
It builds on tests/upstream/vllm_real/envs.py (imported, not copied): the same cache root, wheel cache,
base torch env, marker rule and setup loop.

Layout, under the cache root (KVGUARD_CACHE, default ~/.cache/kvguard):
  wheels/                             vllm-mindspore's and MindSpore's wheels beside vLLM's, downloaded once
  mindspore-envs/vllm-mindspore-Y     one venv: `pip install --no-deps` of the release and of its pinned list
                                      requirements/vllm-mindspore-Y.txt (transformers 4.57.1, numpy<2 for
                                      MindSpore, ...), in front of tests/upstream/vllm_real's vLLM env and base torch,
                                      reached through a .pth file; and MindSpore (CPU) unpacked from its wheel
                                      without its GPU and Ascend backends and graph-kernel compiler (2.1 GB of
                                      the wheel's 2.55 GB unpacked), which a CPU machine cannot load and the
                                      fake NPU never needs. About 0.86 GB in all; built in about 90-130 s.
msadapter (vllm-mindspore's torch-on-MindSpore layer, r0.3.0, not on PyPI) is not installed: engine_main.py
stands it in by CPU torch (standins/msadapter.py).

    python3 tests/upstream/mindspore_real/envs.py setup [vllm-mindspore:Y ...]   build (or check) the env
    python3 tests/upstream/mindspore_real/envs.py python vllm-mindspore:Y        print the env's python, if ready
    python3 tests/upstream/mindspore_real/envs.py strip SITE_PACKAGES            the same backends out of an installed
    MindSpore
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from vllm_real import envs as vllm_envs  # noqa: E402 (after the sys.path entry above)

REQUIREMENTS = HERE / "requirements"
MARKER = vllm_envs.MARKER
MINDSPORE = "2.7.1"  # the MindSpore vllm-mindspore 0.5.1 runs on (its release notes: MindSpore 2.7.1)

# The vllm-mindspore era row's release -> the vLLM release it runs on (vllm_mindspore/v1/core/sched/
# scheduler.py:52 @ 0.5.1 "Based on v0.11.0"), whose env tests/upstream/vllm_real builds.
RELEASES: dict[str, str] = {
    "vllm-mindspore:0.5.1": "0.11.0",
}

# What of MindSpore's wheel is left out: the GPU and Ascend backends and static archives (lib/plugin/gpu*,
# lib/plugin/ascend/, libmindspore_gpu*, libmindspore_ops_ascend.so, *.a), and the CPU backend's graph-kernel
# compiler (lib/plugin/cpu/libakg.so, loaded only with graph kernel fusion on). The CPU backend stays.
_MINDSPORE_SKIP = (
    "mindspore/lib/plugin/gpu",
    "mindspore/lib/plugin/ascend/",
    "mindspore/lib/plugin/libmindspore_gpu",
    "mindspore/lib/plugin/libmindspore_ops_ascend",
    "mindspore/lib/plugin/libmindspore_ascend",
    "mindspore/lib/plugin/cpu/libakg",
)


def envs_dir() -> pathlib.Path:
    return vllm_envs.cache_root() / "mindspore-envs"


def _name(release: str) -> str:
    return release.replace(":", "-")


def env_dir(release: str) -> pathlib.Path:
    return envs_dir() / _name(release)


def env_python(release: str) -> pathlib.Path | None:
    return vllm_envs.ready_python(env_dir(release))


def _pinned(release: str) -> list[str]:
    return vllm_envs.pinned_list(REQUIREMENTS / f"{_name(release)}.txt")


def _any_wheel(project: str, version: str) -> pathlib.Path:
    """A pure-Python or platform wheel of project==version from the wheel cache, downloaded once
    (vllm-mindspore's wheels are tagged cp311-none-any, which vllm_envs._wheel's --only-binary finds too)."""
    return vllm_envs._wheel(project, version)


def _unpack_mindspore(wheel: pathlib.Path, env: pathlib.Path) -> None:
    """MindSpore's wheel unpacked into the env's site-packages, less its GPU and Ascend backends."""
    site = vllm_envs._site_packages(env)
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            if name.startswith(_MINDSPORE_SKIP) or name.endswith(".a") or info.is_dir():
                continue
            target = site / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode)


def strip_installed(site: pathlib.Path) -> int:
    """An installed MindSpore (kvguard's venv, pip-installed for tests/sources/test_sources_mindspore.py) less what
    _unpack_mindspore leaves out: 2.0 of MindSpore 2.10.0's 2.5 GB, which only an NPU or GPU loads; bytes freed."""
    freed = 0
    package = site / "mindspore"
    if not package.is_dir():
        return 0
    for path in sorted(package.rglob("*"), reverse=True):
        name = path.relative_to(site).as_posix()
        if path.is_dir() and not path.is_symlink():
            if name.startswith(_MINDSPORE_SKIP) and not any(path.iterdir()):
                path.rmdir()
        elif name.startswith(_MINDSPORE_SKIP) or name.endswith(".a"):
            freed += path.lstat().st_size
            path.unlink()
    return freed


def setup(release: str) -> tuple[pathlib.Path, bool]:
    """Build the release's env if its inputs changed; return (env, built)."""
    if release not in RELEASES:
        raise SystemExit(f"unknown engine release {release!r} (known: {', '.join(RELEASES)})")
    vllm_env, _ = vllm_envs.setup(RELEASES[release])
    base = vllm_envs._base()
    project, version = release.split(":")
    package = _any_wheel(project, version)
    mindspore = vllm_envs._wheel("mindspore", MINDSPORE)
    pinned = _pinned(release)
    env = env_dir(release)
    want = vllm_envs._digest(
        package.name, mindspore.name, *pinned, (vllm_env / MARKER).read_text(), repr(_MINDSPORE_SKIP)
    )
    if (env / MARKER).is_file() and (env / MARKER).read_text() == want:
        return env, False
    shutil.rmtree(env, ignore_errors=True)
    vllm_envs._run([sys.executable, "-m", "venv", "--without-pip", env])
    # vLLM 0.11.0, then torch (and pip), from tests/upstream/vllm_real's envs: this env's own packages come first.
    (vllm_envs._site_packages(env) / "_kvguard_base.pth").write_text(
        f"{vllm_envs._site_packages(vllm_env)}\n{vllm_envs._site_packages(base)}\n"
    )
    python = env / "bin" / "python"
    wheels = vllm_envs.wheels_dir()
    install = vllm_envs._pip(python, "install", "--no-deps", "--no-index", "--find-links", wheels, package, *pinned)
    if subprocess.run([str(c) for c in install], capture_output=True, check=False).returncode != 0:
        vllm_envs._run(vllm_envs._pip(python, "download", "--no-deps", "--only-binary", ":all:", "-d", wheels, *pinned))
        vllm_envs._run(install)
    _unpack_mindspore(vllm_envs._wheel("mindspore", MINDSPORE, fetch=True), env)
    (env / MARKER).write_text(want)
    return env, True


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "python":
        return vllm_envs.print_python(env_python(argv[2]), argv[2])
    if len(argv) == 3 and argv[1] == "strip":
        freed = strip_installed(pathlib.Path(argv[2]))
        print(f"MindSpore in {argv[2]}: {freed / 1e9:.1f} GB of GPU and Ascend backends removed", flush=True)
        return 0
    if len(argv) >= 2 and argv[1] == "setup":
        return vllm_envs.setup_each(argv[2:] or list(RELEASES), setup, "{}", "vllm-mindspore environments")
    print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
