"""Imports run one way down: cli -> (training, eval, inference) -> models -> ops -> fast -> reference,
and models reach kernels only through natsl.ops (the import-linter contracts in pyproject.toml)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    """lint-imports over the natsl package found in `package_parent` (a fresh process, so that grimp
    reads that copy and not an installed one)."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module, line, broken", [
    ("natsl/models/_upward.py", "from natsl.inference import generate\n", "natsl.models is not allowed to import natsl.inference"),
    ("natsl/models/_kernel.py", "from natsl.fast import cached\n", "Models reach kernels only through natsl.ops"),
    ("natsl/training/_cli.py", "def f():\n    from natsl.cli import app\n", "natsl.training is not allowed to import natsl.cli"),
])
def test_a_new_upward_import_breaks_a_contract(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "natsl", tmp_path / "natsl", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / module).write_text(line)
    result = lint(tmp_path)
    assert result.returncode != 0 and broken in result.stdout, result.stdout + result.stderr
