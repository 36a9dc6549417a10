"""`--threads`: every command that runs a model on the CPU picks its thread count as `train` does
(--threads, else OMP_NUM_THREADS, else 1), says it, and `--threads N` sets it."""

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli.main import app
from natsl.tokenizer import train_bpe

from cli_checks import assert_one_line_error

WORDS = "the a cat dog sat on mat ran far and then slept under warm sun while birds sang songs".split()

# Each command at its smallest on the CPU; {ckpt}, {text} and {out} are filled in. eval-lm runs in
# tests/test_lm_eval.py (it needs lm-eval's task files), train in test_train_says_its_threads.
COMMANDS = {
    "info": ["info", "tiny_hybrid", "--seq-len", "16"],
    "generate": ["generate", "{ckpt}", "--prompt", "the cat", "--max-new-tokens", "2", "--device", "cpu"],
    "bench-latency": ["bench-latency", "--recipe", "tiny_hybrid", "--min-len", "32", "--max-len", "32",
                      "--decode-tokens", "1", "--repeats", "1", "--device", "cpu", "--out", "{out}", "--no-progress"],
    "warmup": ["warmup", "tiny_hybrid", "--lengths", "16", "--decode-tokens", "1", "--device", "cpu"],
    "eval-ppl": ["eval-ppl", "{ckpt}", "--data", "{text}", "--max-len", "32", "--windows", "1", "--device", "cpu",
                 "--out", "{out}", "--no-progress"],
    "eval-ruler": ["eval-ruler", "{ckpt}", "--lengths", "512", "--tasks", "niah_single_1", "--samples", "1",
                   "--max-new-tokens", "2", "--device", "cpu", "--out", "{out}", "--no-progress"],
    "eval-recall": ["eval-recall", "{ckpt}", "--task", "mqar", "--lengths", "32", "--pairs", "2", "--samples", "2",
                    "--batch-size", "2", "--device", "cpu", "--out", "{out}", "--no-progress"],
    "inspect-routing": ["inspect-routing", "{ckpt}", "--seq-len", "32", "--samples", "1", "--device", "cpu",
                        "--out", "{out}"],
    "compare": ["compare", "{ckpt}", "--no-quality", "--context", "32", "--budgets", "1", "--decode-tokens", "1",
                "--repeats", "1", "--device", "cpu", "--out", "{out}", "--no-progress"],
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny NAtS-L Hybrid with a BPE tokenizer, and a text file to evaluate it on."""
    root = tmp_path_factory.mktemp("threads")
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=gen)) for _ in range(200)]
    tokenizer = train_bpe(texts, vocab_size=320)
    recipe = natsl.load_recipe("tiny_hybrid")
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(
        recipe.model, vocab_size=tokenizer.vocab_size, block_size=8, max_seq_len=1024))
    torch.manual_seed(0)
    ckpt = save_model_folder(root / "ckpt", natsl.build_model(recipe), recipe, tokenizer)
    text = root / "text.txt"
    text.write_text("\n".join(texts), encoding="utf-8")
    return {"ckpt": str(ckpt), "text": str(text)}


@pytest.fixture
def threads_restored(monkeypatch):
    """Two threads before the command (so that setting one shows), one again after (conftest's count)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


def invoke(name, inputs, tmp_path, *extra):
    args = [a.format(out=tmp_path / "out", **inputs) for a in COMMANDS[name]]
    return CliRunner().invoke(app, [*args, *extra])


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_threads_option_sets_the_count_and_the_output_says_it(name, inputs, tmp_path, threads_restored):
    result = invoke(name, inputs, tmp_path, "--threads", "1")
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == 1
    assert "1 CPU thread of " in result.output and "(--threads)" in result.output


@pytest.mark.parametrize("name", ["generate", "bench-latency"])
def test_default_is_one_thread_or_omp_num_threads(name, inputs, tmp_path, threads_restored, monkeypatch):
    result = invoke(name, inputs, tmp_path)
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == 1
    assert "1 CPU thread of " in result.output and "(default; --threads N to change)" in result.output
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    result = invoke(name, inputs, tmp_path)
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == 3
    assert "3 CPU threads of " in result.output and "(OMP_NUM_THREADS; --threads N to change)" in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
@pytest.mark.parametrize("count, message", [("0", "--threads must be at least 1, got 0"),
                                            ("1000000", "--threads 1000000 is more than 4x the "),
                                            (str(2**31), "CPUs this process may use; pass at most ")])
def test_a_thread_count_out_of_range_is_refused(name, inputs, tmp_path, count, message):
    assert_one_line_error(invoke(name, inputs, tmp_path, "--threads", count), message)


def test_omp_num_threads_out_of_range_is_refused(inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1000000")
    assert_one_line_error(invoke("generate", inputs, tmp_path), "OMP_NUM_THREADS 1000000 is more than 4x the ",
                          "set OMP_NUM_THREADS to at most ")


def test_train_says_its_threads(tmp_path, natsl_cache_dir, threads_restored, monkeypatch):
    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)
    result = CliRunner().invoke(app, ["train", "tiny_hybrid", "--max-steps", "1", "--device", "cpu", "--threads", "1",
                                      "--out", str(tmp_path / "run"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == 1
    assert "cpu, 1 CPU thread of " in result.output
