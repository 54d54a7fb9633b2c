"""The Python code passes the project's lint rules (pyproject.toml [tool.ruff]: pycodestyle
errors and warnings, pyflakes). ruff comes from requirements.txt."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    pytest.importorskip("ruff")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_csrc_is_clang_formatted():
    """csrc/ as .clang-format lays it out (clang-format from requirements.txt; a string that
    clang-format would leave split in two adjacent literals is written as one)."""
    clang_format = pytest.importorskip("clang_format")
    binary = pathlib.Path(clang_format.get_executable("clang-format"))
    files = sorted(str(p) for p in (ROOT / "csrc").glob("*") if p.suffix in (".cpp", ".h"))
    assert files
    done = subprocess.run([str(binary), "--dry-run", "-Werror", *files], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[:4000]
