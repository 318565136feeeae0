"""The kvguard image (Dockerfile at the repository root).

No Docker engine runs here, so the image is tested in two halves: the Dockerfile is parsed for
what must hold (stages, non-root user, port, entrypoint, build context), and the build itself is
replayed: the files its build stage copies are laid out in a temporary folder, the wheel is built
from them, installed into a clean virtualenv, and `kvguard` runs from there.
"""

from __future__ import annotations

import fnmatch
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass

import pytest
from conftest import ROOT
from monitoring import documented_serve_port

DOCKERFILE = os.path.join(ROOT, "Dockerfile")
DOCKERIGNORE = os.path.join(ROOT, ".dockerignore")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[str]:
        return [i.arguments for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions per build stage; continuation lines joined, comments and parser directives dropped."""
    logical, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, arguments = line.partition(" ")
        keyword, arguments = keyword.upper(), arguments.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", arguments, re.IGNORECASE)
            assert match, f"cannot read FROM {arguments}"
            stages.append(Stage(match.group(1), match.group(2), []))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword, arguments))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    with open(DOCKERFILE) as handle:
        return parse_dockerfile(handle.read())


def _copy_sources(stage: Stage) -> list[str]:
    """Source paths of the stage's COPY instructions that read the build context."""
    sources = []
    for arguments in stage.all("COPY"):
        words = [w for w in shlex.split(arguments) if not w.startswith("--")]
        if "--from=" not in arguments:
            sources += words[:-1]
    return sources


def test_dockerfile_builds_in_one_stage_and_runs_from_another(stages):
    assert len(stages) >= 2
    build, runtime = stages[0], stages[-1]
    assert build.name and runtime.name != build.name
    assert any(
        re.search(rf"--from={build.name}\b|from={build.name}\b", arguments)
        for arguments in runtime.all("COPY") + runtime.all("RUN")
    )
    assert any("pip wheel" in run for run in build.all("RUN"))
    # The runtime stage never sees the source tree, only the wheels.
    assert _copy_sources(runtime) == []


def test_dockerfile_starts_from_a_slim_python_base(stages):
    with open(DOCKERFILE) as handle:
        args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", handle.read(), re.MULTILINE))
    for stage in stages:
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage.base)
        assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), base


def test_dockerfile_runs_as_a_non_root_user(stages):
    users = stages[-1].all("USER")
    assert users, "the runtime stage sets no USER"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0")
    # A numeric uid lets Kubernetes check runAsNonRoot without reading /etc/passwd.
    assert user.isdigit()


def test_dockerfile_exposes_the_documented_serve_port(stages):
    documented = documented_serve_port()
    assert stages[-1].all("EXPOSE") == [documented]


def test_dockerfile_entrypoint_is_kvguard_in_exec_form(stages):
    assert stages[-1].all("ENTRYPOINT") == ['["kvguard"]']


def test_dockerfile_keeps_bytecode_writes_off_the_read_only_root(stages):
    env = " ".join(stages[-1].all("ENV"))
    assert re.search(r"PYTHONDONTWRITEBYTECODE=1", env)


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes; a match on a parent counts."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern[1:] if negate else pattern
        pattern = pattern.strip("/").replace("**/", "*/") if pattern != "**" else "*"
        if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
            ignored = not negate
    return ignored


def _dockerignore_patterns() -> list[str]:
    with open(DOCKERIGNORE) as handle:
        return [line.strip() for line in handle if line.strip() and not line.startswith("#")]


def test_build_context_has_what_the_build_stage_copies(stages):
    patterns = _dockerignore_patterns()
    for source in _copy_sources(stages[0]):
        assert os.path.exists(os.path.join(ROOT, source)), source
        assert not _dockerignored(source, patterns), f"{source} is excluded by .dockerignore"


def test_build_context_leaves_out_virtualenvs_tools_and_git():
    patterns = _dockerignore_patterns()
    for path in (
        ".venv/bin/python",
        ".tools/helm",
        ".git/HEAD",
        "tests/deploy/test_image.py",
        "helm/kvguard/Chart.yaml",
        "exporter/kvguard/__pycache__/cli.cpython-311.pyc",
    ):
        assert _dockerignored(path, patterns), path


# ------------------------------------------------------------------- wheel replay


@pytest.fixture(scope="module")
def installed(stages, tmp_path_factory):
    """The build stage replayed: its COPY sources only, one wheel build, a clean venv."""
    context = tmp_path_factory.mktemp("context")
    patterns = _dockerignore_patterns()

    def left_out(folder, names):
        relative = os.path.relpath(folder, ROOT)
        return [name for name in names if _dockerignored(os.path.join(relative, name), patterns)]

    for source in _copy_sources(stages[0]):
        origin = os.path.join(ROOT, source)
        if os.path.isdir(origin):
            shutil.copytree(origin, context / source, ignore=left_out)
        else:
            shutil.copy(origin, context / source)
    wheels = tmp_path_factory.mktemp("wheels")
    # The build stage's `pip wheel`; without build isolation so no setuptools download is needed.
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(wheels),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("kvguard-*.whl")
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # Not the source tree conftest puts on PYTHONPATH: pip would take kvguard as already installed.
    clean = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"kvguard[nvml] @ {wheel.as_uri()}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return env_dir


def test_wheel_installs_into_a_clean_venv_and_kvguard_help_runs(installed, tmp_path):
    result = subprocess.run(
        [str(installed / "bin" / "kvguard"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: kvguard")


def test_installed_wheel_is_the_one_kvguard_imports(installed, tmp_path):
    code = "import kvguard, sys; print(kvguard.__file__)"
    result = subprocess.run(
        [str(installed / "bin" / "python"), "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(installed))


def test_installed_wheel_registers_the_vllm_plugin(installed, tmp_path):
    # `pip install kvguard` in a serving image is what makes vLLM start the probe.
    code = (
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'kvguard'])"
    )
    result = subprocess.run(
        [str(installed / "bin" / "python"), "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['kvguard.plugin:register']"


# ------------------------------------------------- the plugin, copied by the chart


def _plugin_copy_command() -> list[str]:
    """The chart's kvguard-plugin init container command (helm/kvguard/templates/_helpers.tpl)."""
    from test_helm_chart import pod_spec, render

    (init,) = [c for c in pod_spec(render())["initContainers"] if c["name"] == "kvguard-plugin"]
    return init["command"]


@pytest.fixture(scope="module")
def plugin_dir(installed, tmp_path_factory):
    """What the init container leaves in the shared volume, run by the image's python (the wheel's venv)."""
    dest = tmp_path_factory.mktemp("kvguard-plugin")
    command = _plugin_copy_command()
    assert command[:2] == ["python", "-c"]
    result = subprocess.run(
        [str(installed / "bin" / "python"), *command[1:-1], str(dest)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "copied to" in result.stdout
    return dest


def test_the_chart_copies_the_package_and_its_dist_info_only(plugin_dir):
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["kvguard", f"kvguard-{_version()}.dist-info"]
    assert (plugin_dir / "kvguard" / "plugin" / "__init__.py").is_file()


def _version() -> str:
    from kvguard import __version__

    return __version__


def _vllm_python() -> pathlib.Path:
    from vllm_real import envs

    python = envs.env_python("0.11.0")
    if python is None:
        pytest.fail(
            "the vLLM 0.11.0 environment is not set up: ./dev.sh test builds it (tests/upstream/vllm_real/envs.py)"
        )
    return python


def _load_general_plugins(plugin_dir, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    # vLLM's own loader (vllm/plugins/__init__.py 0.11.0:59-72): entry points of group
    # vllm.general_plugins, filtered by VLLM_PLUGINS when set. kvguard is not installed in this env:
    # only the copied folder on PYTHONPATH can provide it.
    code = (
        "import sys; from vllm.plugins import load_general_plugins; load_general_plugins(); "
        "print('kvguard.plugin' in sys.modules)"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(plugin_dir), "HOME": str(plugin_dir.parent), **extra_env}
    return subprocess.run([str(_vllm_python()), "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_vllms_own_loader_finds_the_copied_plugin_on_pythonpath(plugin_dir):
    result = _load_general_plugins(plugin_dir, {})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "True"


def test_vllm_plugins_without_kvguard_leaves_the_plugin_out(plugin_dir):
    # The pitfall docs/kubernetes.md names, and the chart refuses: VLLM_PLUGINS lists the only ones loaded.
    result = _load_general_plugins(plugin_dir, {"VLLM_PLUGINS": "some_other_plugin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"
    result = _load_general_plugins(plugin_dir, {"VLLM_PLUGINS": "some_other_plugin,kvguard"})
    assert result.stdout.strip().splitlines()[-1] == "True", result.stderr[-2000:]
