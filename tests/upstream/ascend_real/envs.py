"""Small per-release environments holding the real vllm-ascend releases, for tests/upstream/ascend_real.

Standard library only: dev.sh runs it with the system python3 before kvguard's venv exists.
It builds on tests/upstream/vllm_real/envs.py (imported, not copied): the same cache root, wheel cache,
base torch env and marker rule.

Layout, under the cache root (KVGUARD_CACHE, default ~/.cache/kvguard):
  ascend-wheels/                 the engines' own wheels (and vllm-ascend's source archives)
  ascend-envs/vllm-X             a vLLM base that tests/upstream/vllm_real has no env for (pinned list
                                 requirements/vllm-X.txt here), built as vllm_real builds its own
  ascend-envs/ENGINE-Y           one venv per engine release: `pip install --no-deps` of the release
                                 (a source archive builds with COMPILE_CUSTOM_KERNELS=0), its pinned
                                 list requirements/ENGINE-Y.txt; torch and vLLM come from the base
                                 envs through a .pth file, so each is installed once.

    python3 tests/upstream/ascend_real/envs.py setup [vllm-ascend:Y ...]   build (or check) the envs
    python3 tests/upstream/ascend_real/envs.py python vllm-ascend:Y        print the env's python, if ready
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from vllm_real import envs as vllm_envs  # noqa: E402  (the shared cache, base torch and helpers)

REQUIREMENTS = HERE / "requirements"
MARKER = vllm_envs.MARKER

# One release per vllm-ascend era row (kvguard.vllm.eras), -> the vLLM release it runs on. 0.11.0 checks
# the 0.9.1-0.14.0 row on tests/upstream/vllm_real's vLLM 0.11.0 env; 0.19.1rc1 (the only 0.19 on PyPI) the 0.19 row.
# (vllm-mindspore 0.5.1, on the same vLLM, is tests/upstream/mindspore_real's.)
RELEASES: dict[str, str] = {
    "vllm-ascend:0.7.3.post1": "0.7.3",
    "vllm-ascend:0.11.0": "0.11.0",
    "vllm-ascend:0.17.0rc1": "0.17.0",
    "vllm-ascend:0.18.0": "0.18.0",
    "vllm-ascend:0.19.1rc1": "0.19.1",
    "vllm-ascend:0.23.0.post1": "0.23.0",
}
# Releases only tests/upstream/test_ascend_310p_real.py runs (on a fake 310P): the vllm-ascend-310p 0.14.0 row's, on
# tests/upstream/vllm_real's vLLM 0.14.0 env; no A2 row uses it.
RELEASES_310P: dict[str, str] = {
    "vllm-ascend:0.14.0rc1": "0.14.0",
}
# The releases that run vLLM's V0 engine (engine_v0.py): NPUWorker.determine_num_available_blocks decides a block
# count, no byte budget, and the plugin has no worker hook to record a profile in. 0.7.3.post1 checks the 0.7.3 row
# (its worker.py is 0.7.3's, line for line).
V0_RELEASES = ("vllm-ascend:0.7.3.post1",)


def envs_dir() -> pathlib.Path:
    return vllm_envs.cache_root() / "ascend-envs"


def wheels_dir() -> pathlib.Path:
    return vllm_envs.cache_root() / "ascend-wheels"


def _name(release: str) -> str:
    return release.replace(":", "-")


def env_dir(release: str) -> pathlib.Path:
    return envs_dir() / _name(release)


def env_python(release: str) -> pathlib.Path | None:
    return vllm_envs.ready_python(env_dir(release))


def _pinned(path: pathlib.Path) -> list[str]:
    return vllm_envs.pinned_list(path) if path.is_file() else []


def _vllm_base(version: str) -> pathlib.Path:
    """The vLLM release's env: tests/upstream/vllm_real's where it has one, else one built here alike."""
    if (REQUIREMENTS.parent.parent / "vllm_real" / "requirements" / f"vllm-{version}.txt").is_file():
        env, _ = vllm_envs.setup(version)
        return env
    base = vllm_envs._base()
    wheel = vllm_envs._wheel("vllm", version)
    pinned = _pinned(REQUIREMENTS / f"vllm-{version}.txt")
    env = envs_dir() / f"vllm-{version}"
    want = vllm_envs._digest(wheel.name, *pinned, (base / MARKER).read_text())
    if (env / MARKER).is_file() and (env / MARKER).read_text() == want:
        return env
    shutil.rmtree(env, ignore_errors=True)
    vllm_envs._run([sys.executable, "-m", "venv", "--without-pip", env])
    (vllm_envs._site_packages(env) / "_kvguard_base.pth").write_text(f"{vllm_envs._site_packages(base)}\n")
    python = env / "bin" / "python"
    wheel = vllm_envs._wheel("vllm", version, fetch=True)
    wheels = vllm_envs.wheels_dir()
    install = vllm_envs._pip(python, "install", "--no-deps", "--no-index", "--find-links", wheels, wheel, *pinned)
    if subprocess.run([str(c) for c in install], capture_output=True).returncode != 0:
        vllm_envs._run(vllm_envs._pip(python, "download", "--no-deps", "--only-binary", ":all:", "-d", wheels, *pinned))
        vllm_envs._run(install)
    vllm_envs.prune(env)  # vLLM's CUDA extensions, as tests/upstream/vllm_real prunes its own envs
    (env / MARKER).write_text(want)
    return env


def _engine_package(release: str) -> pathlib.Path:
    """The engine's wheel (or source archive) from ascend-wheels, downloaded once."""
    project, version = release.split(":")
    stem = f"{project.replace('-', '_')}-{version}"
    wheels = wheels_dir()
    found = sorted(wheels.glob(f"{stem}-*.whl")) + sorted(wheels.glob(f"{stem}.tar.gz"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        # A source archive's metadata build asks npu-smi for the chip unless SOC_VERSION is set, and
        # compiles kernels unless COMPILE_CUSTOM_KERNELS=0: neither is wanted to fetch the file.
        env = {**os.environ, "COMPILE_CUSTOM_KERNELS": "0", "SOC_VERSION": "ascend910b1"}
        # The metadata build of a source archive imports setuptools_scm (setup.py 0.23.0.post1:32); without
        # build isolation it must be importable here, so it is put on the path from the cache, not installed.
        tools = vllm_envs.cache_root() / "build-tools"
        if not (tools / "setuptools_scm").is_dir():
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--target", tools, "setuptools_scm"], capture_output=True
            )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tools), env.get("PYTHONPATH")]))
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-d",
                wheels,
                f"{project}=={version}",
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        found = sorted(wheels.glob(f"{stem}-*.whl")) + sorted(wheels.glob(f"{stem}.tar.gz"))
        if not found:
            why = [line for line in fetched.stderr.splitlines() if line.strip() and "Location" not in line][-3:]
            raise SystemExit(
                f"no wheel or source archive for {project}=={version} in {wheels}: "
                + " | ".join(line.strip() for line in why)
            )
    return found[0]


def _install_source(python: pathlib.Path, archive: pathlib.Path, env: pathlib.Path) -> None:
    """A source archive (vllm-ascend 0.23.0.post1): its Python package copied in as built with
    COMPILE_CUSTOM_KERNELS=0, i.e. without the compiled kernels (vllm_ascend_C), which the memory path
    never runs; plus a dist-info so importlib.metadata knows the release."""
    import tarfile

    site = vllm_envs._site_packages(env)
    project_version = archive.name[: -len(".tar.gz")]
    package, version = project_version.split("-", 1)
    entry_points = None
    with tarfile.open(archive) as tar:
        prefix = f"{project_version}/{package}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for member in members:
            target = site / member.name[len(project_version) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src:
                target.write_bytes(src.read())
        # The archive's own entry points where it ships them (0.7.3.post1: vllm_ascend.egg-info, setup.py:372-376).
        with contextlib.suppress(KeyError):
            with tar.extractfile(f"{project_version}/{package}.egg-info/entry_points.txt") as src:
                entry_points = src.read().decode()
    # setup.py writes vllm_ascend/_build_info.py at build time: gen_build_info() for SOC_VERSION=ascend910b1
    # (setup.py 0.23.0.post1:153-193) writes the device type A2.
    build_info = site / package / "_build_info.py"
    if not build_info.exists():
        build_info.write_text("# Auto-generated file\n__device_type__ = 'A2'\n")
    dist = site / f"{package}-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n")
    if version == "0.23.0.post1":
        # As its env was first built and checked: the platform plugin and the KV connector only (the archive's
        # egg-info adds register_model, register_model_loader, register_service_profiling).
        entry_points = (
            "[vllm.platform_plugins]\nascend = vllm_ascend:register\n\n"
            "[vllm.general_plugins]\nascend_kv_connector = vllm_ascend:register_connector\n"
        )
    (dist / "entry_points.txt").write_text(entry_points or "[vllm.platform_plugins]\nascend = vllm_ascend:register\n")


def setup(release: str) -> tuple[pathlib.Path, bool]:
    """Build the engine release's env if its inputs changed; return (env, built)."""
    known = {**RELEASES, **RELEASES_310P}
    if release not in known:
        raise SystemExit(f"unknown engine release {release!r} (known: {', '.join(known)})")
    vllm_env = _vllm_base(known[release])
    base = vllm_envs._base()
    package = _engine_package(release)
    pinned = _pinned(REQUIREMENTS / f"{_name(release)}.txt")
    env = env_dir(release)
    want = vllm_envs._digest(package.name, *pinned, (vllm_env / MARKER).read_text(), "v2")
    if (env / MARKER).is_file() and (env / MARKER).read_text() == want:
        return env, False
    shutil.rmtree(env, ignore_errors=True)
    vllm_envs._run([sys.executable, "-m", "venv", "--without-pip", env])
    # vLLM, then torch (and pip), from the base envs: each installed once on this machine.
    (vllm_envs._site_packages(env) / "_kvguard_base.pth").write_text(
        f"{vllm_envs._site_packages(vllm_env)}\n{vllm_envs._site_packages(base)}\n"
    )
    python = env / "bin" / "python"
    wheels = [vllm_envs.wheels_dir(), wheels_dir()]
    links = [arg for w in wheels for arg in ("--find-links", w)]
    if package.name.endswith(".tar.gz"):
        _install_source(python, package, env)
        packages = [*pinned]
    else:
        packages = [package, *pinned]
    if packages:
        install = vllm_envs._pip(python, "install", "--no-deps", "--no-index", *links, *packages)
        if subprocess.run([str(c) for c in install], capture_output=True).returncode != 0:
            if pinned:
                vllm_envs._run(
                    vllm_envs._pip(
                        python, "download", "--no-deps", "--only-binary", ":all:", "-d", vllm_envs.wheels_dir(), *pinned
                    )
                )
            vllm_envs._run(install)
    (env / MARKER).write_text(want)
    return env, True


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[1] == "python":
        return vllm_envs.print_python(env_python(argv[2]), argv[2])
    if len(argv) >= 2 and argv[1] == "setup":
        return vllm_envs.setup_each(argv[2:] or [*RELEASES, *RELEASES_310P], setup, "{}", "Ascend engine environments")
    print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
