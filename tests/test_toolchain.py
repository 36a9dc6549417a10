"""natsl/fast/toolchain.py: natsl.fast pins TRITON_PTXAS_PATH to PyTorch's ptxas unless the user set it."""

import os
import subprocess
import sys
from pathlib import Path

from natsl.fast import toolchain

ROOT = Path(__file__).resolve().parent.parent


def test_pin_sets_torch_ptxas_only_where_unset(tmp_path, monkeypatch):
    ptxas = tmp_path / "ptxas"
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(toolchain, "torch_ptxas", lambda: str(ptxas))
    env = {}
    assert toolchain.pin_ptxas(env) == str(ptxas) and env == {"TRITON_PTXAS_PATH": str(ptxas)}
    mine = {"TRITON_PTXAS_PATH": "/opt/my/ptxas"}
    assert toolchain.pin_ptxas(mine) == "/opt/my/ptxas" and mine == {"TRITON_PTXAS_PATH": "/opt/my/ptxas"}
    empty = {"TRITON_PTXAS_PATH": ""}  # set but empty: as unset
    assert toolchain.pin_ptxas(empty) == str(ptxas)
    monkeypatch.setattr(toolchain, "torch_ptxas", lambda: None)  # a wheel without ptxas (CPU): Triton's own
    none = {}
    assert toolchain.pin_ptxas(none) is None and none == {}


def test_torch_ptxas_is_torchs_bundled_executable_or_none():
    import torch

    found = toolchain.torch_ptxas()
    expected = Path(torch.__file__).parent / "bin" / "ptxas"
    if expected.is_file() and os.access(expected, os.X_OK):
        assert found == str(expected)
    else:
        assert found is None


def test_importing_natsl_fast_pins_it_in_a_fresh_process(tmp_path):
    """The pin happens on import of natsl.fast (before any kernel compiles), and a user's value stays."""
    code = "import os, natsl.fast, natsl.fast.toolchain as t; print(os.environ.get('TRITON_PTXAS_PATH'), t.torch_ptxas())"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_PTXAS_PATH"}
    env["PYTHONPATH"] = str(ROOT)
    seen, torchs = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  check=True).stdout.split()
    assert seen == torchs  # both 'None' on a wheel without ptxas
    env["TRITON_PTXAS_PATH"] = "/opt/my/ptxas"
    seen, _ = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
    assert seen == "/opt/my/ptxas"
