"""`natsl compare` on tiny checkpoints and recipes of each family (random weights: the machinery, not the numbers)."""

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
from natsl.eval.compare import format_table, pareto, run_compare, variants

from cli_checks import assert_one_line_error

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
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


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """Recipe files of a tiny Transformer and a tiny GDN + SWA (the NAtS-L Hybrid is the shipped tiny_hybrid)."""
    root = tmp_path_factory.mktemp("recipes")
    base = "model:\n  vocab_size: 128\n  hidden_size: 64\n  intermediate_size: 128\n  num_layers: 4\n" \
           "  attn_num_heads: 4\n  attn_head_dim: 16\n  block_size: 16\n  max_seq_len: 512\n"
    files = {"tiny_transformer": base + "  base_layer: attention\n",
             "tiny_gdn_swa": base + "  attention_layers: [1, 3]\n  attn_window: 16\n  num_heads: 2\n"
                                    "  head_k_dim: 16\n  head_v_dim: 32\n"}
    paths = {}
    for name, text in files.items():
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(f"name: {name}\n{text}")
    return paths


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
    # the kept fraction on the recall inputs: NAtS-L's variants only (a forced 1 keeps every block)
    assert by[("natsl_hybrid", "keep 1")]["recall_keep_fraction"] == 1.0
    assert 0.0 <= by[("natsl_hybrid", "router")]["recall_keep_fraction"] <= 1.0
    assert by[("transformer", "full")]["recall_keep_fraction"] is None
    table = (out / "compare.md").read_text()
    assert " kept " in table and "what it kept on the recall inputs" in table
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
    assert [v.label for v in variants(natsl.load_recipe("800m_hybrid").model, [0.5], [], trained=False)] == ["keep 0.5"]
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


def test_recipes_at_several_contexts_latency_and_memory_only(recipes, tmp_path):
    """Recipes (a shipped name and YAML files) build random-weight models; --no-quality measures none;
    every variant at every context (given out of order), a row and a plot row each."""
    out = tmp_path / "cmp"
    result = CliRunner().invoke(app, ["compare", "tiny_hybrid", str(recipes["tiny_transformer"]),
                                      str(recipes["tiny_gdn_swa"]), "--no-quality", "--context", "64,32",
                                      "--budgets", "0.25,1", "--methods", "snapkv,pyramidkv", "--decode-tokens", "2",
                                      "--repeats", "1", "--out", str(out), "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output + str(result.exception)
    assert "note: latency and memory only (--no-quality): the quality columns are empty" in result.output
    assert "note: the presses on tiny_transformer (random weights) still evict" in result.output
    report = json.loads((out / "compare.json").read_text())
    assert report["contexts"] == [32, 64] and report["quality"] is False
    labels = {"tiny_hybrid": ["keep 0.25", "keep 1"],  # no router variant: a recipe's router is untrained
              "tiny_transformer": ["full", "snapkv 0.25", "pyramidkv 0.25"], "tiny_gdn_swa": ["window 16"]}
    assert [(e["name"], e["label"], e["context"]) for e in report["entries"]] == \
        [(name, label, c) for name, names in labels.items() for c in (32, 64) for label in names]
    by = {(e["name"], e["label"], e["context"]): e for e in report["entries"]}
    entry = 2 * 16 * 4  # fp32 K and V of a 16-wide head
    for c in (32, 64):
        assert by[("tiny_transformer", "full", c)]["kv_bytes"] == 4 * c * 4 * entry
        assert by[("tiny_transformer", "snapkv 0.25", c)]["kv_bytes"] == 4 * (c // 4) * 4 * entry
        assert by[("tiny_gdn_swa", "window 16", c)]["kv_bytes"] == 2 * 16 * 4 * entry
    # PyramidKV spreads the budget over the layers (its mean): fewer bytes than the full cache
    assert by[("tiny_transformer", "pyramidkv 0.25", 64)]["kv_bytes"] < by[("tiny_transformer", "full", 64)]["kv_bytes"]
    # NAtS-L keeps whole blocks of 64: at 64 tokens a forced fraction below 1 drops the only earlier block
    assert by[("tiny_hybrid", "keep 1", 64)]["kv_bytes"] > by[("tiny_hybrid", "keep 0.25", 64)]["kv_bytes"]
    for e in report["entries"]:
        assert e["source"] == "recipe" and e["recall_accuracy"] is None and e.get("ppl") is None
        assert "error" not in e and e["prefill_s"] > 0 and e["decode_ms"] > 0
    table = (out / "compare.md").read_text()
    assert "window 16" in table and "note: latency and memory only" in table
    assert (out / "compare.png").stat().st_size > 1000


def test_a_recipe_beside_a_checkpoint_gets_no_quality_and_says_so(checkpoints, tmp_path):
    """Quality on: the checkpoint's recall is measured, the recipe's columns stay empty, one note says why."""
    out = tmp_path / "mixed"
    result = CliRunner().invoke(app, ["compare", checkpoints[1], "tiny_hybrid", "--context", "32", "--budgets", "0.5",
                                      "--methods", "snapkv", "--samples", "4", "--batch-size", "4", "--decode-tokens", "2",
                                      "--repeats", "1", "--out", str(out), "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output + str(result.exception)
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert notes[0] == ("note: latency and memory only for tiny_hybrid: a recipe has random weights, so no quality "
                        "is measured and its quality columns are empty")
    report = json.loads((out / "compare.json").read_text())
    for e in report["entries"]:
        assert (e["recall_accuracy"] is None) == (e["source"] == "recipe"), e
    assert {e["label"] for e in report["entries"] if e["source"] == "checkpoint"} == {"full", "snapkv 0.5"}


def test_time_budget_records_skipped_points(tmp_path):
    result = run_compare(["tiny_hybrid"], budgets=[0.5, 1], methods=[], contexts=[32, 64], quality=False,
                         device="cpu", progress=False, time_budget_s=1e-9)
    assert [(e["label"], e["context"], e["error"]) for e in result["entries"]] == \
        [(label, c, "skipped: time budget spent") for c in (32, 64) for label in ("keep 0.5", "keep 1")]
    assert "skipped: time budget spent" in format_table(result)


@pytest.mark.parametrize("args, fragment", [
    (["no_such_recipe"], "'no_such_recipe' is neither a checkpoint folder nor a recipe"),
    (["tiny_hybrid", "--context", "32k,64k"], "--context '32k,64k' is not a comma-separated list of token counts"),
    (["tiny_hybrid", "--context", "32,0"], "--context must be at least 1 token, got 0"),
    (["tiny_hybrid", "--context", ","], "--context is empty"),
    (["tiny_hybrid", "--no-quality", "--data", "x.txt"], "--no-quality measures no perplexity"),
    (["tiny_hybrid", "--no-quality", "--recall"], "--no-quality measures no recall"),
    (["tiny_hybrid", "--time-budget", "0"], "--time-budget must be a positive number of seconds"),
    (["800m_nsa_hybrid", "--no-quality"], "NSA layers have no inference cache"),
])
def test_compare_bad_recipe_input_is_one_line(tmp_path, args, fragment):
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["compare", *args, "--out", str(out), "--device", "cpu", "--no-progress"])
    assert_one_line_error(result, fragment)
    assert not out.exists()  # refused before any folder is made


def test_checkpoint_labels_name_the_run(tmp_path):
    """Plot and table labels: run/step_N for a training step, the run for an exported RUN/model folder
    (all of a sweep's exports are called `model`), else the folder's own name."""
    from natsl.eval.common import checkpoint_name

    assert checkpoint_name(tmp_path / "runA" / "checkpoints" / "step_000040") == "runA/step_000040"
    assert checkpoint_name(tmp_path / "zoology-gdn-d128-lr0.0003" / "model") == "zoology-gdn-d128-lr0.0003"
    assert checkpoint_name(tmp_path / "my_export") == "my_export"


def synthetic_result(name_suffix: str = "") -> dict:
    """A compare result of two contexts: a NAtS-L model at three budgets, a Transformer with snapkv, and a
    GDN (no softmax KV bytes, on the symlog axis)."""
    entries = []
    for context in (4096, 16384):
        for keep in (0.25, 0.5, 1.0):
            entries.append({"name": f"natsl_hybrid{name_suffix}", "label": f"keep {keep}", "method": "keep_fraction",
                            "family": "natsl", "context": context, "kv_bytes": keep * context * 512,
                            "decode_ms": 5 + keep, "prefill_s": 0.1 * keep, "recall_accuracy": 0.5 + keep / 4})
        for method, keep in (("full", 1.0), ("snapkv", 0.25)):
            entries.append({"name": f"transformer{name_suffix}", "label": method, "method": method,
                            "family": "attention", "context": context, "kv_bytes": keep * context * 2048,
                            "decode_ms": 4.0, "prefill_s": 0.05, "recall_accuracy": 0.9 * keep})
        entries.append({"name": f"gdn{name_suffix}", "label": "gdn", "method": "gdn", "family": "gdn",
                        "context": context, "kv_bytes": 0, "decode_ms": 3.0, "prefill_s": 0.04,
                        "recall_accuracy": 0.2})
    return {"entries": entries, "contexts": [4096, 16384], "device": "cpu", "dtype": "float32"}


@pytest.mark.parametrize("name_suffix", ["", "_d64_lr3e-3_seed0_recall_sweep_h200_run"])
def test_compare_png_is_readable(tmp_path, monkeypatch, name_suffix):
    """compare.png was one 2484 x 500 px row of panels with 7-9 pt text: now two panels a row, at most
    1600 px wide (long legend labels included), and no text below 10 pt."""
    from matplotlib.text import Text
    from PIL import Image

    import natsl.eval.common as common
    from natsl.eval.compare import plot

    sizes = []
    save = common.save_figure

    def record(fig, path):
        sizes.extend(t.get_fontsize() for t in fig.findobj(Text) if t.get_text().strip())
        return save(fig, path)

    monkeypatch.setattr(common, "save_figure", record)
    path = plot(synthetic_result(name_suffix), tmp_path / "compare.png")
    width, height = Image.open(path).size
    assert width <= 1600 and height <= 4 * 600  # two contexts x two rows of two panels
    assert sizes and min(sizes) >= 10
