"""natsl.devices.triton_interpreted: TRITON_INTERPRET read as Triton reads it, and the backend check built on it."""

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
