"""The layer registry (natsl.models.registry) changes no number: every tiny model of
tests/registry_golden.py builds the same parameters (bit for bit), gives the same logits (full forward,
prefill and decode), caches, FLOP counts, RoPE tables, MLP layout, `natsl info` lines, kernel table and
authors' tensor names as the code from before the registry, whose values tests/registry_golden.json holds."""

from __future__ import annotations

import json
import math

import pytest

import registry_golden as golden

EXPECTED = json.loads(golden.GOLDEN.read_text())


def close(got: list[float], want: list[float]) -> bool:
    # fp32 CPU kernels may order sums differently on another CPU; on one machine these are equal
    return len(got) == len(want) and all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6) for g, w in zip(got, want))


@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_model_numbers_unchanged(name):
    got, want = golden.measure(name), EXPECTED["cases"][name]
    assert got["params"] == want["params"], "parameters differ from the pre-registry build"
    for key in ("n_params", "mlp", "rope_dims", "flops", "prefill_flops", "state_flops", "cache", "cache_error"):
        assert json.loads(json.dumps(got.get(key))) == want.get(key), key
    for key in ("logits", "cached_logits"):
        assert (key in got) == (key in want), key
        if key in want:
            assert close(got[key], want[key]), (key, got[key][:4], want[key][:4])


def test_authors_names_unchanged():
    assert golden.measure_hf_names() == EXPECTED["hf_names"]


@pytest.mark.parametrize("name", sorted(golden.CASES))
def test_info_and_kernels_unchanged(name, tmp_path):
    assert golden.measure_info(name, tmp_path) == EXPECTED["info"][name]
    assert golden.measure_kernels(name) == EXPECTED["kernels"][name]
