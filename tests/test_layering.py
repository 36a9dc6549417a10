"""Imports run one way down: cli -> (training, eval, inference) -> models -> ops -> fast -> reference,
and models reach kernels only through natsl.ops (the import-linter contracts in pyproject.toml), where
the choice of every kernel is made (an AST check of natsl/models)."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    pytest.importorskip("importlinter")
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module, line, broken", [
    ("natsl/models/_upward.py", "from natsl.inference import generate\n", "natsl.models is not allowed to import natsl.inference"),
    ("natsl/models/_kernel.py", "from natsl.fast import cached\n", "Models reach kernels only through natsl.ops"),
    ("natsl/training/_cli.py", "def f():\n    from natsl.cli import app\n", "natsl.training is not allowed to import natsl.cli"),
])
def test_a_new_upward_import_breaks_a_contract(tmp_path, module, line, broken):
    pytest.importorskip("importlinter")
    shutil.copytree(ROOT / "natsl", tmp_path / "natsl", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / module).write_text(line)
    result = lint(tmp_path)
    assert result.returncode != 0 and broken in result.stdout, result.stdout + result.stderr


# -- the models leave every choice of kernel to natsl.ops ----------------------------------------------

MODELS = ROOT / "natsl" / "models"
# What a model would ask to choose a kernel itself: whether the fused kernels, the decode attention,
# the fast decode step or the GEMV kernel apply (natsl.ops.fused, cached, gemv, mix).
CHOICES = {"enabled", "decode_attention_enabled", "use_fast", "applies", "fused_applies"}
FLAGS = {"fused", "fast", "use_fast"}


def ops_names(tree: ast.Module) -> set[str]:
    """The local names a module binds to natsl.ops, its modules or their functions."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("natsl"):
            for alias in node.names:
                if node.module.startswith("natsl.ops") or alias.name == "ops":
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.startswith("natsl.ops"))
    return names


def kernel_choices(path: Path) -> list[str]:
    """Where the model module at `path` chooses a kernel itself (see the test below)."""
    tree = ast.parse(path.read_text())
    via_ops = ops_names(tree)
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names] \
                if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(m == "natsl.ops.fused" or m.startswith(("natsl.fast", "natsl.ops.fused.")) for m in modules):
                found.append(f"{where} imports {modules[-1]}")
        elif isinstance(node, ast.Call):
            func = node.func
            root = func
            while isinstance(root, ast.Attribute):
                root = root.value
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in CHOICES and isinstance(root, ast.Name) and root.id in via_ops:
                found.append(f"{where} calls {name}")
            found += [f"{where} passes {kw.arg}=" for kw in node.keywords
                      if kw.arg in FLAGS]
        elif isinstance(node, ast.arg) and node.arg in FLAGS:
            found.append(f"{where} takes a parameter {node.arg}")
        elif isinstance(node, ast.Attribute) and node.attr == "fused":
            found.append(f"{where} reads .fused")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("natsl.fast"):
            found.append(f"{where} names {node.value}")
    return found


def test_models_leave_the_choice_of_kernels_to_natsl_ops():
    """natsl.ops is the only door from models to kernels: a layer gets a kernel set
    (natsl.ops.kernel_set.pick) or calls a door (natsl.ops.gemv.linear, short_conv, mix, cached) and
    never asks itself whether a fast kernel applies, passes a fused / fast flag, or names natsl.fast."""
    files = sorted(MODELS.glob("*.py"))
    assert len(files) > 10
    found = [choice for path in files for choice in kernel_choices(path)]
    assert found == []


@pytest.mark.parametrize("source, expected", [
    ("from natsl.ops import fused\nfused.enabled(None, x.device)\n", ["imports natsl.ops.fused", "calls enabled"]),
    ("from natsl.ops import gemv\ngemv.applies(x, w)\n", ["calls applies"]),
    ("from natsl.ops.cached import use_fast\nuse_fast(b, d)\n", ["calls use_fast"]),
    ("def f(x, fused=False):\n    return g(x, fast=fused)\n", ["takes a parameter fused", "passes fast="]),
    ("def f(kernels):\n    return kernels.fused\n", ["reads .fused"]),
    ("import importlib\nimportlib.import_module('natsl.fast.cached')\n", ["names natsl.fast.cached"]),
    ("from natsl.models import overlap\noverlap.enabled()\n", []),  # not a kernel: the prefill's streams
])
def test_the_kernel_choice_check_finds_each_kind(tmp_path, source, expected):
    path = tmp_path / "layer.py"
    path.write_text(source)
    found = kernel_choices(path)
    assert len(found) == len(expected) and all(any(e in f for f in found) for e in expected), found
