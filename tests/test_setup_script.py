"""scripts/setup.sh does each step only when its inputs changed: a second run installs and
builds nothing (it used to recompile the C++ extension every time, minutes); a changed
csrc/ file rebuilds the extension only; a changed requirements.txt reinstalls the
dependencies only; a fresh clone does everything. Runs the real script against a fake venv
whose `pip` logs its calls."""
import os
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PIP = """#!/usr/bin/env bash
echo "$*" >> "$PIP_LOG"
if [[ " $* " == *" -e . "* ]]; then touch specdec_inductor/_C.fake.so .venv/bin/specdec; chmod +x .venv/bin/specdec; fi
"""


@pytest.fixture
def clone(tmp_path):
    """A copy of the files setup.sh reads, with a fake .venv (python is the real one)."""
    for name in ("setup.py", "pyproject.toml", "requirements.txt"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc")
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts" / "setup.sh")
    (tmp_path / "specdec_inductor").mkdir()
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (bin_dir / "pip").write_text(FAKE_PIP)
    python = bin_dir / "python"
    python.write_text('#!/usr/bin/env bash\nif [ "$1" = "-c" ] && [[ "$2" == *metadata* ]]; then '
                      'echo "torch 2.13.0"; else exec python3 "$@"; fi\n')
    for f in (bin_dir / "pip", python):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def _setup(clone):
    log = clone / "pip.log"
    log.write_text("")
    env = {**os.environ, "PIP_LOG": str(log)}
    env.pop("SPECDEC_REBUILD", None)
    subprocess.run(["bash", str(clone / "scripts" / "setup.sh")], cwd=clone, env=env, check=True,
                   capture_output=True, text=True)
    return [line for line in log.read_text().splitlines() if line]


def test_second_run_installs_and_builds_nothing(clone):
    first = _setup(clone)
    assert any("-r requirements.txt" in c for c in first)
    assert any(" -e ." in f" {c} " for c in first)  # a fresh clone builds
    assert _setup(clone) == []


def test_a_changed_source_rebuilds_only_the_extension(clone):
    _setup(clone)
    with open(clone / "csrc" / "tree.cpp", "a") as f:
        f.write("\n// changed\n")
    calls = _setup(clone)
    assert len(calls) == 1 and "-e ." in calls[0]
    assert _setup(clone) == []


def test_changed_requirements_reinstall_only_the_dependencies(clone):
    _setup(clone)
    with open(clone / "requirements.txt", "a") as f:
        f.write("tqdm\n")
    calls = _setup(clone)
    assert any("-r requirements.txt" in c for c in calls) and not any("-e ." in c for c in calls)


def test_a_missing_extension_is_rebuilt(clone):
    _setup(clone)
    os.remove(clone / "specdec_inductor" / "_C.fake.so")
    calls = _setup(clone)
    assert len(calls) == 1 and "-e ." in calls[0]
