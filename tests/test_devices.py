"""natsl.devices.triton_interpreted: TRITON_INTERPRET read as Triton reads it, and the backend check built on it."""

import os

import pytest
import torch

from natsl.devices import triton_interpreted
from natsl.errors import NatslError
from natsl.ops import resolve_backend

SPELLINGS = ["1", "true", "TRUE", "on", "yes", "Y", "0", "false", "2", "", " 1 "]


@pytest.mark.parametrize("value", SPELLINGS)
def test_triton_interpreted_agrees_with_tritons_own_knob(monkeypatch, value):
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreted() == knobs.runtime.interpret


def test_unset_means_compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_interpreted()


def test_the_fast_backend_on_cpu_follows_the_same_reading(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert resolve_backend("fast", cpu) == "fast"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(NatslError, match="TRITON_INTERPRET"):
        resolve_backend("fast", cpu)


def test_the_fast_backend_without_triton_is_one_line(monkeypatch):
    monkeypatch.setattr("natsl.ops.triton_available", lambda: False)
    with pytest.raises(NatslError, match=r"pip install 'natsl\[fast\]'"):
        resolve_backend("fast", torch.device("cpu"))
    with pytest.raises(NatslError, match="needs triton"):
        resolve_backend(None, torch.device("cuda"))  # the default on CUDA is fast
    assert resolve_backend("chunked", torch.device("cpu")) == "chunked"


# Triton is the optional extra natsl[fast]: everything on the CPU must run without it. The child blocks the
# import (None in sys.modules makes `import triton` raise ImportError) before natsl is imported.
_WITHOUT_TRITON = r"""
import sys
sys.modules["triton"] = None
import torch
torch.set_num_threads(1)
from typer.testing import CliRunner
import natsl
from natsl.cli.main import app
from natsl.training.loss import linear_cross_entropy

torch.manual_seed(0)
model = natsl.build_model(natsl.load_recipe("tiny_hybrid"))
for layer in model.modules():
    if hasattr(layer, "backend"):
        layer.backend = "chunked"
ids = torch.randint(0, 1024, (1, 130))
hidden = model.hidden_states(ids[:, :-1])
loss = linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten(), chunk_size=64)
loss.backward()
assert torch.isfinite(loss) and model.lm_head.weight.grad is not None
runner = CliRunner()
for args, code in [(["info", "tiny_hybrid"], 0),
                   (["bench-latency", "--recipe", "tiny_hybrid", "--max-len", "128", "--device", "cpu",
                     "--decode-tokens", "2", "--out", sys.argv[1]], 0),
                   (["info", "tiny_hybrid", "--backend", "fast"], 2)]:
    result = runner.invoke(app, args)
    assert result.exit_code == code, (args, result.output, result.exception)
assert "needs triton" in result.output, result.output
print("ok")
"""


def test_the_cpu_paths_run_without_triton(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON, str(tmp_path / "bench")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_each_test_process_runs_on_one_thread():
    """conftest's torch.set_num_threads(1) holds in every pytest-xdist worker too (each imports conftest)."""
    assert torch.get_num_threads() == 1
