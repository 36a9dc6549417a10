"""`natsl compare` on tiny checkpoints of each family (random weights: the machinery, not the numbers)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli.main import app
from natsl.config import Recipe
from natsl.eval.compare import pareto, variants

from cli_checks import assert_one_line_error

RECIPES = Path(__file__).resolve().parent.parent / "natsl" / "recipes"
TASK = "task:mqar?vocab=128&seq_len=64&pairs=4"
FAMILIES = {
    "natsl_hybrid": {},
    "transformer": {"base_layer": "attention", "natsl_layers": []},
    "gdn_swa": {"natsl_layers": [], "attention_layers": [1, 3], "attn_window": 16},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml")
    folders = []
    for name, changes in FAMILIES.items():
        model_config = dataclasses.replace(base.model, vocab_size=128, block_size=16, max_seq_len=512, **changes)
        recipe = Recipe(name=name, model=model_config, optim=base.optim, train=base.train,
                        data=dataclasses.replace(base.data, path=TASK))
        torch.manual_seed(0)
        folders.append(str(save_model_folder(root / name, natsl.build_model(model_config), recipe, None)))
    return folders


def test_compare_writes_json_png_and_table(checkpoints, tmp_path):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", *checkpoints, "--budgets", "0.25,1", "--methods", "snapkv,adakv",
                                      "--context", "48", "--samples", "4", "--batch-size", "4", "--decode-tokens", "2",
                                      "--repeats", "1", "--out", str(out), "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output + str(result.exception)
    report = json.loads((out / "compare.json").read_text())
    got = {(e["name"], e["label"]) for e in report["entries"]}
    assert got == {("natsl_hybrid", "router"), ("natsl_hybrid", "keep 0.25"), ("natsl_hybrid", "keep 1"),
                   ("transformer", "full"), ("transformer", "snapkv 0.25"), ("transformer", "adakv 0.25"),
                   ("gdn_swa", "window 16")}
    by = {(e["name"], e["label"]): e for e in report["entries"]}
    for e in report["entries"]:
        assert 0.0 <= e["recall_accuracy"] <= 1.0 and e["prefill_s"] > 0 and e["decode_ms"] > 0
    # KV bytes are measured from the cache after a 48-token prefill: fp32, 4 heads of 16 (K and V)
    entry = 2 * 16 * 4
    assert by[("transformer", "full")]["kv_bytes"] == 4 * 48 * 4 * entry
    assert by[("transformer", "snapkv 0.25")]["kv_bytes"] == 4 * 12 * 4 * entry
    assert by[("gdn_swa", "window 16")]["kv_bytes"] == 2 * 16 * 4 * entry
    assert by[("natsl_hybrid", "keep 0.25")]["kv_bytes"] < by[("natsl_hybrid", "keep 1")]["kv_bytes"]
    assert by[("natsl_hybrid", "keep 1")]["keep_fraction"] == 1.0
    assert (out / "compare.png").stat().st_size > 1000 and "snapkv 0.25" in (out / "compare.md").read_text()


@pytest.mark.parametrize("args, fragment", [
    (["--budgets", "0.5,2"], "--budgets: 2 is not a fraction in (0, 1]"),
    (["--budgets", "half"], "not a comma-separated list of numbers"),
    (["--methods", "h2o"], "unknown KV-eviction method 'h2o'"),
    (["--context", "4096"], "beyond transformer's max_seq_len 512"),
    (["--no-recall"], "nothing measures quality"),
])
def test_compare_bad_input_is_one_line(checkpoints, tmp_path, args, fragment):
    result = CliRunner().invoke(app, ["compare", checkpoints[1], *args, "--out", str(tmp_path / "o"),
                                      "--device", "cpu", "--no-progress"])
    assert_one_line_error(result, fragment)


def test_variants_and_pareto():
    gdn = natsl.load_recipe("800m_gdn").model
    assert [v.method for v in variants(gdn, [0.5], ["snapkv"])] == ["none"]
    hybrid = natsl.load_recipe("800m_gdn_hybrid").model
    assert [v.label for v in variants(hybrid, [0.5, 1], ["snapkv", "pyramidkv"])] == ["full", "snapkv 0.5", "pyramidkv 0.5"]
    # Mamba2 is a fixed-size memory as GDN is; NAtS-L on a Mamba2 state (alone or beside Mamba2 layers)
    # gets the kept-fraction budgets.
    mamba2 = natsl.load_recipe("800m_mamba2").model
    assert [(v.label, v.family, v.method) for v in variants(mamba2, [0.5], ["snapkv"])] == [("mamba2", "mamba2", "none")]
    for name in ("800m_natsl_mamba2", "800m_hybrid_mamba2"):
        got = [(v.label, v.method, v.budget) for v in variants(natsl.load_recipe(name).model, [0.25, 1], ["snapkv"])]
        assert got == [("router", "router", None), ("keep 0.25", "keep_fraction", 0.25), ("keep 1", "keep_fraction", 1)]
    assert pareto([(1, 0.2), (2, 0.1), (3, 0.5), (4, 0.5)], True) == [(1, 0.2), (3, 0.5)]
    assert pareto([(1, 9.0), (2, 5.0), (3, 6.0)], False) == [(1, 9.0), (2, 5.0)]
