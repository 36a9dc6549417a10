"""`natsl eval-ppl`: perplexity curves that match training's cross-entropy, and one-line errors."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import natsl
from natsl.cli import convert, eval_ppl, eval_ruler, inspect_routing  # noqa: F401  (register the commands)
from natsl.cli.app import app
from natsl.eval.haystack import essay_text
from natsl.eval.smoke import save_tiny_checkpoint

from cli_checks import assert_one_line_error


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    ckpt = save_tiny_checkpoint(root / "ckpt", steps=20, seed=0)
    text = root / "heldout.txt"
    text.write_text(essay_text(90, seed=7), encoding="utf-8")
    return root, ckpt, text


def direct_loss(ckpt, text, max_len):
    """Training-style mean cross-entropy over the same consecutive windows, computed plainly."""
    model, tok = natsl.load_checkpoint(ckpt)
    model.set_backend("chunked")
    ids = tok.encode(text.read_text(encoding="utf-8"))
    total, count, nbytes = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(ids), max_len):
            chunk = torch.tensor(ids[start:start + max_len])[None]
            if chunk.shape[1] < 2:
                continue
            logits = model(chunk)
            loss = F.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
            total += float(loss)
            count += chunk.shape[1] - 1
            nbytes += len(tok.decode(chunk[0, 1:].tolist()).encode("utf-8"))
    return total / count, count, nbytes


def test_ppl_matches_training_cross_entropy(trained, tmp_path):
    root, ckpt, text = trained
    # On the CPU in fp32, as direct_loss computes it: on a GPU host eval-ppl's default is bf16 (0.1% apart).
    result = run("eval-ppl", ckpt, "--data", text, "--max-len", 256, "--bucket", 64, "--windows", 0,
                 "--device", "cpu", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "ppl.json").read_text())
    assert (tmp_path / "out" / "ppl.png").stat().st_size > 1000
    (res,) = report["checkpoints"]
    loss, count, nbytes = direct_loss(ckpt, text, 256)
    assert res["tokens"] == count
    assert math.isfinite(res["ppl"]) and res["ppl"] < 512  # better than uniform over the 512-token vocabulary
    assert res["loss"] == pytest.approx(loss, rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert res["bytes"] == nbytes
    assert res["bits_per_byte"] == pytest.approx(loss * count / math.log(2) / nbytes, rel=1e-5)
    buckets = res["buckets"]
    assert [b["start"] for b in buckets] == [0, 64, 128, 192]
    assert sum(b["tokens"] for b in buckets) == count
    assert sum(b["loss"] * b["tokens"] for b in buckets) / count == pytest.approx(loss, rel=1e-6)


def test_several_checkpoints_share_one_plot(trained, tmp_path):
    root, ckpt, text = trained
    other = root / "untrained"
    if not other.exists():
        recipe = natsl.load_recipe("tiny_hybrid")
        torch.manual_seed(1)
        _, tok = natsl.load_checkpoint(ckpt)
        natsl.checkpoint.save_model_folder(other, natsl.build_model(recipe), recipe, tok)
    result = run("eval-ppl", ckpt, other, "--data", text, "--max-len", 128, "--bucket", 32, "--windows", 2,
                 "--out", tmp_path / "two")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "two" / "ppl.json").read_text())
    names = [r["name"] for r in report["checkpoints"]]
    assert names == ["ckpt", "untrained"]
    trained_ppl, untrained_ppl = (r["ppl"] for r in report["checkpoints"])
    assert trained_ppl < untrained_ppl  # a few dozen steps already beat random weights
    assert all(r["windows"] == 2 and r["tokens"] == 2 * 127 for r in report["checkpoints"])
    assert (tmp_path / "two" / "ppl.png").is_file()


def test_jsonl_documents_are_windowed_separately(trained, tmp_path):
    root, ckpt, _ = trained
    data = tmp_path / "docs.jsonl"
    docs = [essay_text(3, seed=s) for s in range(4)]
    data.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n", encoding="utf-8")
    _, tok = natsl.load_checkpoint(ckpt)
    result = run("eval-ppl", ckpt, "--data", data, "--max-len", 4096, "--bucket", 4096, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    (res,) = json.loads((tmp_path / "o" / "ppl.json").read_text())["checkpoints"]
    assert res["windows"] == 4
    assert res["tokens"] == sum(len(tok.encode(d)) - 1 for d in docs)


def test_errors_are_one_line(trained, tmp_path):
    root, ckpt, text = trained
    assert_one_line_error(run("eval-ppl", tmp_path / "absent", "--data", text, "--out", tmp_path / "o"),
                          "does not exist")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert_one_line_error(run("eval-ppl", hf, "--data", text, "--out", tmp_path / "o"), "another model type")
    # Token shards whose meta.json names another tokenizer.
    shards = tmp_path / "tokens"
    shards.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(shards / "shard_00000.bin")
    (shards / "meta.json").write_text(json.dumps({"dtype": "uint16", "tokenizer_sha256": "0" * 64}))
    assert_one_line_error(run("eval-ppl", ckpt, "--data", shards, "--out", tmp_path / "o"), "different tokenizer")
    assert_one_line_error(run("eval-ppl", ckpt, "--data", tmp_path / "nothing.txt", "--out", tmp_path / "o"),
                          "does not exist")


def tokenize_folder(out, docs, **settings):
    from natsl.data.sources import MemorySource
    from natsl.data.tokenize import TokenizeSettings, tokenize_corpus

    tokenize_corpus(MemorySource(docs, {"name": "test"}), out, TokenizeSettings(**settings), progress=False,
                    log=lambda *_: None)
    return out


def test_natsl_tokenize_folders(trained, tmp_path):
    root, ckpt, _ = trained
    docs = [essay_text(12, seed=40 + i) for i in range(5)]
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": d}) for d in docs), encoding="utf-8")
    same = tokenize_folder(tmp_path / "same", docs, tokenizer=str(ckpt / "tokenizer.json"), val_fraction=0.0)
    a = run("eval-ppl", ckpt, "--data", same, "--max-len", 256, "--windows", 0, "--out", tmp_path / "a")
    b = run("eval-ppl", ckpt, "--data", data, "--max-len", 256, "--windows", 0, "--out", tmp_path / "b")
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    ra = json.loads((tmp_path / "a" / "ppl.json").read_text())["checkpoints"][0]
    rb = json.loads((tmp_path / "b" / "ppl.json").read_text())["checkpoints"][0]
    # Shards are cut back into their documents at EOS: the same windows as the raw text.
    assert ra["windows"] == rb["windows"] and ra["tokens"] == rb["tokens"]
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)
    other = tokenize_folder(tmp_path / "other", docs, train_tokenizer=True, vocab_size=300, val_fraction=0.0)
    assert_one_line_error(run("eval-ppl", ckpt, "--data", other, "--out", tmp_path / "o"), "different tokenizer")


def test_lengths_buckets_defaults_and_nan_weights(trained, tmp_path):
    import os
    import stat

    root, ckpt, text = trained
    out = tmp_path / "o"
    assert_one_line_error(run("eval-ppl", ckpt, "--data", text, "--max-len", 200000, "--out", out),
                          "--max-len 200000 is beyond the max_seq_len 131072")
    # A bucket wider than the windows is one bucket of the window length, and says so.
    result = run("eval-ppl", ckpt, "--data", text, "--max-len", 256, "--bucket", 1024, "--windows", 2,
                 "--device", "cpu", "--out", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert "note: --bucket 1024 is wider than --max-len 256" in result.stderr
    report = json.loads((out / "ppl.json").read_text())
    assert report["bucket"] == 256
    assert [(b["start"], b["end"]) for b in report["checkpoints"][0]["buckets"]] == [(0, 256)]
    assert "tokens      0-256 " in result.stdout
    # Defaults on the CPU: 4x the training length (tiny_hybrid: 256), 32 buckets; an estimate first.
    old = os.umask(0o022)
    try:
        result = run("eval-ppl", ckpt, "--data", text, "--windows", 2, "--device", "cpu", "--out", out, "--no-progress")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "ppl.json").read_text())
    assert (report["max_len"], report["bucket"]) == (1024, 32)
    assert "eval-ppl: 1 checkpoint(s) x 2 windows of up to 1024 tokens" in result.stderr
    assert stat.S_IMODE(os.stat(out / "ppl.json").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(out / "ppl.png").st_mode) == 0o644
    # NaN weights: refused with one line naming the checkpoint, not "ppl nan" and exit 0.
    model, tokenizer = natsl.load_checkpoint(ckpt)
    with torch.no_grad():
        model.embed.weight[0, 0] = float("nan")
        model.lm_head.weight.fill_(float("nan"))
    from natsl.checkpoint import save_model_folder

    nan_ckpt = save_model_folder(tmp_path / "nan", model, model.recipe, tokenizer)
    assert_one_line_error(run("eval-ppl", nan_ckpt, "--data", text, "--max-len", 128, "--windows", 1, "--out", out,
                              "--no-progress"), str(nan_ckpt), "non-finite losses")
