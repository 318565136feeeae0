"""``./dev.sh run CMD`` runs CMD where the caller stands: a relative ``--plot`` lands there, not in the clone.

dev.sh's setup (a virtualenv, ``pip install -e .[plot]``) would install into the environment it
is given, so the test hands it a stand-in virtualenv: ``bin/python`` answers the ``pip install``
and runs anything else with this interpreter, ``bin/kvguard`` runs the real CLI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stand_in_venv(root) -> str:
    bin_dir = root / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2 $3" = "-m pip install" ]; then echo "pip install $*" >> "{root}/pip.log"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n')
    (bin_dir / "kvguard").write_text(f'#!/bin/sh\necho "$PWD" > "{root}/kvguard.cwd"\n'
                                     f'exec "{sys.executable}" -m kvguard "$@"\n')
    for name in ("python", "kvguard"):
        (bin_dir / name).chmod(0o755)
    return str(root / "venv")


@pytest.mark.parametrize("relative_venv", [False, True], ids=["absolute KVGUARD_VENV", "relative KVGUARD_VENV"])
def test_a_relative_plot_path_is_written_where_the_caller_stands(tmp_path, relative_venv):
    pytest.importorskip("matplotlib")
    if shutil.which("bash") is None:
        pytest.fail("bash not found")
    venv = stand_in_venv(tmp_path)
    caller = tmp_path / "caller"
    caller.mkdir()
    env = {**os.environ, "KVGUARD_VENV": os.path.relpath(venv, REPO) if relative_venv else venv}
    result = subprocess.run(["bash", os.path.join(REPO, "dev.sh"), "run", "simulate", "--requests", "2",
                             "--plot", "run.png"], cwd=caller, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "-m pip install -q -e .[plot]" in (tmp_path / "pip.log").read_text()    # setup ran, in the clone
    assert (tmp_path / "kvguard.cwd").read_text().strip() == str(caller)
    assert (caller / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not os.path.exists(os.path.join(REPO, "run.png"))
