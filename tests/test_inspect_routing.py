"""`natsl inspect-routing`: fractions equal a direct count of `last_keep`, memory as the cache holds it."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli import convert, eval_ppl, eval_ruler, inspect_routing  # noqa: F401  (register the commands)
from natsl.cli.app import app
from natsl.config import apply_overrides
from natsl.eval.haystack import essay_text
from natsl.eval.routing import time_bins
from natsl.tokenizer import train_bpe

SEQ = 300  # 4 complete blocks of 64 and a current block of 44 tokens


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(3)  # random weights route blocks both ways, so the counts below are not trivial
    model = natsl.build_model(recipe)
    tok = train_bpe([essay_text(200)], vocab_size=512)
    ckpt = save_model_folder(root / "ckpt", model, recipe, tok)
    text = root / "essays.txt"
    text.write_text(essay_text(150, seed=4), encoding="utf-8")
    jsonl = root / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": essay_text(30, seed=20 + i)}) for i in range(6)), encoding="utf-8")
    return root, ckpt, text, jsonl


def direct_keeps(ckpt, windows):
    model, _ = natsl.load_checkpoint(ckpt)
    model.set_backend("chunked")
    keeps = {i: [] for i in model.natsl_layers()}
    with torch.no_grad():
        for w in windows:
            model(torch.tensor(w)[None])
            for i, layer in model.natsl_layers().items():
                keeps[i].append(layer.last_keep[0].numpy())
    return {i: np.stack(v) for i, v in keeps.items()}  # [N, NB, H]


def test_fractions_equal_a_direct_count(setup, tmp_path):
    root, ckpt, text, jsonl = setup
    result = run("inspect-routing", ckpt, text, jsonl, "--seq-len", SEQ, "--samples", 3, "--bins", 5,
                 "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "routing.json").read_text())
    for name in ("routing_groups.png", "routing_time.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
    assert report["natsl_layers"] == [1, 3] and [d["name"] for d in report["datasets"]] == ["essays", "docs"]
    _, tok = natsl.load_checkpoint(ckpt)
    ids = tok.encode(text.read_text(encoding="utf-8"))
    windows = [ids[i * SEQ:(i + 1) * SEQ] for i in range(3)]
    keeps = direct_keeps(ckpt, windows)
    ds = report["datasets"][0]
    assert ds["windows"] == 3
    cfg = natsl.load_recipe("tiny_hybrid").model
    per_token_group = (cfg.head_k_dim + cfg.head_v_dim) * 2  # bf16 cache
    for layer in ds["layers"]:
        keep = keeps[layer["layer"]]
        assert keep.shape == (3, 5, 2)
        assert np.allclose(layer["group_keep_fraction"], keep.mean(axis=(0, 1)))
        assert layer["keep_fraction"] == pytest.approx(float(keep.mean()))
        assert all(0.0 <= v <= 1.0 for v in layer["group_keep_fraction"])
        # One bin per block here: the over-time view is the per-block mean over windows.
        assert np.allclose(np.asarray(layer["keep_over_time"]), keep.mean(axis=0).T)
        # Cache after 300 tokens: kept complete blocks (4 of them are complete) + the 44 current tokens.
        kv_tokens = keep[:, :4, :].sum(axis=1) * 64 + 44
        assert layer["memory"]["kv_bytes"] == pytest.approx(float((kv_tokens * per_token_group).sum(axis=1).mean()))
        assert layer["memory"]["transformer_kv_bytes"] == SEQ * cfg.num_heads * per_token_group
        assert 0 < layer["memory"]["kv_ratio"] <= 1
    assert ds["time_bins"] == [[0, 64], [64, 128], [128, 192], [192, 256], [256, 300]]
    assert 0 <= report["datasets"][1]["keep_fraction"] <= 1


def test_embedded_corpus_and_random_tokens_when_no_data_and_refusals(setup, tmp_path):
    root, ckpt, _, _ = setup
    result = run("inspect-routing", ckpt, "--seq-len", 128, "--samples", 2, "--out", tmp_path / "rand")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "rand" / "routing.json").read_text())
    assert [d["name"] for d in report["datasets"]] == ["builtin corpus", "random tokens"]
    assert all(d["windows"] == 2 for d in report["datasets"])
    # A model without NAtS-L layers has nothing to inspect.
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), ["model.natsl_layers=[]"])
    gdn_only = save_model_folder(tmp_path / "gdn", natsl.build_model(recipe), recipe)
    bad = run("inspect-routing", gdn_only, "--seq-len", 64, "--samples", 1, "--out", tmp_path / "x")
    assert bad.exit_code == 2 and "no NAtS-L layers" in bad.stderr and "Traceback" not in bad.output
    short = run("inspect-routing", ckpt, root / "docs.jsonl", "--seq-len", 100000, "--samples", 1, "--out", tmp_path / "x")
    assert short.exit_code == 2 and "lower --seq-len" in short.stderr


def test_time_bins_cover_every_block_once():
    for blocks in (1, 5, 64, 1000):
        for bins in (1, 3, 32):
            ranges = time_bins(blocks, bins)
            assert ranges[0][0] == 0 and ranges[-1][1] == blocks
            assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
            assert len(ranges) == min(blocks, bins)


def test_seed_length_and_cpu_defaults(setup, tmp_path):
    from cli_checks import assert_one_line_error

    root, ckpt, _, _ = setup
    out = tmp_path / "o"
    assert_one_line_error(run("inspect-routing", ckpt, "--seed", -1, "--out", out), "--seed must be an integer")
    assert_one_line_error(run("inspect-routing", ckpt, "--seq-len", 200000, "--out", out),
                          "--seq-len 200000 is beyond the max_seq_len 131072")
    result = run("inspect-routing", ckpt, "--device", "cpu", "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "routing.json").read_text())
    assert (report["seq_len"], report["samples"]) == (256, 2)  # tiny_hybrid trains at 256
    assert "inspect-routing: 4 windows of 256 tokens (2 dataset(s))" in result.stderr
