"""The linter configured in pyproject.toml ([tool.ruff]) passes over the whole tree."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ruff")

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_catches_an_unused_import(tmp_path):
    """The configuration is live: a planted unused import fails the check."""
    (tmp_path / "planted.py").write_text("import os\n")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                             str(ROOT / "pyproject.toml"), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "F401" in result.stdout
