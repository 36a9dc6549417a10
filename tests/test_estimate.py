"""natsl.estimate: the memory estimate against a real tiny run's peak RSS growth, the warn-or-refuse step
(with an injected memory limit), every long command's refusal and --force, and eval-ruler's estimate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import natsl
from natsl import estimate as E
from natsl.cli.app import app
from natsl.cli import main  # noqa: F401  (registers every command)
from natsl.errors import NatslError

from cli_checks import assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
RATES = E.DeviceRates(flops_per_s=1e10, bytes_per_s=1e9, call_s=1e-3)  # fixed: no measurement in the tests

# One piece of work of tiny_hybrid in a fresh interpreter: the peak resident size (VmHWM, reset through
# /proc/self/clear_refs after a short run of the same work has paid every lazy start-up cost) over the
# resident size before it.
MEASURE = """
import sys, torch
torch.set_num_threads(1)
import natsl
from natsl.training.loss import linear_cross_entropy

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key))

mode, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = natsl.load_recipe("tiny_hybrid").model
model = natsl.build_model(config)
model.set_backend("chunked")
optimizer = torch.optim.AdamW(model.parameters())

def run(batch, tokens):
    ids = torch.randint(0, config.vocab_size, (batch, tokens))
    if mode == "train":
        model.train()
        linear_cross_entropy(model.hidden_states(ids), model.lm_head.weight, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    model.eval()
    with torch.no_grad():
        if mode == "prefill":
            model.forward_cached(ids, model.new_cache(batch, max_len=tokens), last_only=True)
        else:
            model.hidden_states(ids)

run(1, 64)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
before = status("VmRSS:")
run(batch, tokens)
print(status("VmHWM:") - before)
"""


@pytest.mark.parametrize("mode, batch, tokens", [("train", 4, 256), ("forward", 1, 1024), ("prefill", 1, 1024)])
def test_memory_estimate_is_within_a_small_factor_of_a_real_runs_peak(mode, batch, tokens):
    run = subprocess.run([sys.executable, "-c", MEASURE, mode, str(batch), str(tokens)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    measured = int(run.stdout.split()[-1])
    estimated = E.estimate(natsl.load_recipe("tiny_hybrid").model, [E.Work(mode, batch, tokens)], CPU,
                           rates=RATES).peak_bytes
    assert measured > 0
    assert 1 / 2 <= estimated / measured <= 2, (estimated, measured)


def test_the_estimate_grows_with_what_the_job_holds():
    """Training holds the optimizer and the activations a forward does not; a longer prefill a larger cache;
    the dense routed attention of the CPU backends grows with the square of the length."""
    facts = E.model_facts(natsl.load_recipe("tiny_hybrid").model)

    def peak(*works, backend="chunked"):
        return E.estimate(facts, list(works), CPU, backend=backend, rates=RATES).peak_bytes

    assert peak(E.Work("train", 1, 256)) > peak(E.Work("forward", 1, 256))
    assert peak(E.Work("prefill", 1, 2048)) > peak(E.Work("prefill", 1, 1024))
    assert peak(E.Work("forward", 1, 4096)) > 3 * peak(E.Work("forward", 1, 2048))  # quadratic
    assert peak(E.Work("forward", 1, 4096), backend="fast") < peak(E.Work("forward", 1, 4096))
    one = E.estimate(facts, [E.Work("decode", 1, 512, calls=10)], CPU, rates=RATES).seconds
    assert E.estimate(facts, [E.Work("decode", 1, 512, calls=20)], CPU, rates=RATES).seconds == pytest.approx(2 * one)


def test_the_800m_recipes_on_a_cpu_are_refused_and_fit_an_80gb_card_as_measured():
    """The issue's case: 800m_hybrid at its micro-batch of 8 x 4096 cannot train in a CPU's memory; on a GPU
    (fast backend, bf16) the estimate lands near the peak the 800M table measured (78.8 GiB)."""
    recipe = natsl.load_recipe("800m_hybrid")
    work = E.Work("train", 8, recipe.train.seq_len)  # the micro-batch of that table (the recipe now says auto)
    cpu = E.estimate(recipe.model, [work], CPU, rates=RATES)
    with pytest.raises(NatslError, match="pass --force to try anyway"):
        E.check_fits("train 800m_hybrid", cpu, CPU, force=False, fix="lower it", available=64 << 30)
    gpu = E.estimate(recipe.model, [work], torch.device("cuda"), backend="fast", rates=RATES).peak_bytes
    assert 0.7 < gpu / (78.8 * 2**30) < 1.5


def test_check_fits_refuses_what_does_not_fit_unless_forced_and_says_long_jobs():
    est = E.Estimate(peak_bytes=10 << 20, seconds=1.0, parts={"weights": 10 << 20})
    lines = []
    with pytest.raises(NatslError) as err:
        E.check_fits("a job", est, CPU, force=False, fix="lower --max-len", available=1 << 20, log=lines.append)
    message = str(err.value)
    assert "a job needs about" in message and "lower --max-len" in message and "--force" in message
    assert "\n" not in message and not lines
    E.check_fits("a job", est, CPU, force=True, fix="lower --max-len", available=1 << 20, log=lines.append)
    assert len(lines) == 1 and "going on as --force asks" in lines[0]
    lines.clear()
    E.check_fits("a job", est, CPU, force=False, fix="-", available=1 << 40, log=lines.append)
    assert not lines  # short and small: nothing to say
    E.check_fits("a job", E.Estimate(1.0, 2 * E.LONG_S, {}), CPU, force=False, fix="-", available=1 << 40,
                 log=lines.append)
    assert len(lines) == 1 and "about 2.0 min" in lines[0]
    lines.clear()
    # a model loaded before the check is held already: only the rest must fit
    E.check_fits("a job", est, CPU, force=False, fix="-", available=2 << 20, held=9 << 20, log=lines.append)


def test_available_memory_reads_the_cpus():
    free = E.available_memory(CPU)
    assert free is None or free > 0


# -- every long command refuses before any work when the memory cannot hold it ---------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from natsl.eval.smoke import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("estimate") / "ckpt", steps=0)


@pytest.fixture
def no_memory(monkeypatch):
    """The device has 1 KiB available (the estimator's limit injected, not a huge model)."""
    monkeypatch.setattr(E, "available_memory", lambda device: 1024)


def commands(ckpt: Path, tmp: Path) -> dict:
    tiny = str(ROOT / "recipes" / "tiny_hybrid.yaml")
    text = tmp / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    return {
        "train": ["train", tiny, "--set", "data.path=builtin", "--max-steps", "1", "--device", "cpu", "--no-progress",
                  "--out", str(tmp / "run")],
        "bench-latency": ["bench-latency", "--recipe", tiny, "--max-len", "128", "--device", "cpu", "--no-progress",
                          "--out", str(tmp / "bench")],
        "compare": ["compare", tiny, "--no-quality", "--context", "128", "--device", "cpu", "--no-progress",
                    "--out", str(tmp / "compare")],
        "eval-ppl": ["eval-ppl", str(ckpt), "--data", str(text), "--max-len", "64", "--windows", "1",
                     "--device", "cpu", "--no-progress", "--out", str(tmp / "ppl")],
        "eval-ruler": ["eval-ruler", str(ckpt), "--lengths", "1024", "--tasks", "niah_single_1", "--samples", "1",
                       "--device", "cpu", "--no-progress", "--out", str(tmp / "ruler")],
        "eval-recall": ["eval-recall", str(ckpt), "--lengths", "64", "--pairs", "4", "--samples", "2", "--device",
                        "cpu", "--no-progress", "--out", str(tmp / "recall")],
        "eval-lm": ["eval-lm", str(ckpt), "--tasks", "lambada_openai", "--device", "cpu", "--out", str(tmp / "lm")],
        "generate": ["generate", str(ckpt), "--prompt", "Once upon a time", "--max-new-tokens", "2",
                     "--device", "cpu"],
        "warmup": ["warmup", tiny, "--lengths", "128", "--decode-tokens", "1", "--device", "cpu"],
    }


@pytest.mark.parametrize("name", ["train", "bench-latency", "compare", "eval-ppl", "eval-ruler", "eval-recall",
                                  "eval-lm", "generate", "warmup"])
def test_every_long_command_refuses_what_the_memory_cannot_hold(name, checkpoint, tmp_path, no_memory,
                                                                 natsl_cache_dir):
    args = commands(checkpoint, tmp_path)[name]
    result = CliRunner().invoke(app, args, env={"NATSL_CACHE_DIR": natsl_cache_dir})
    assert_one_line_error(result, "of memory at its peak (estimate)", "1.0 KB available", "pass --force to try anyway")
    assert not any(p.exists() for p in (tmp_path / "run" / "checkpoints", tmp_path / "bench" / "latency.json",
                                        tmp_path / "compare" / "compare.json", tmp_path / "ruler" / "ruler.json"))


def test_train_estimates_activation_checkpointing_auto_as_the_step_will_run(tmp_path, no_memory):
    """`auto` recomputes blocks only where a GPU's probe finds one sequence too many (never on the CPU): the
    estimate takes it as off, so 800m_hybrid's recipe (auto) on a CPU is estimated as `false`, above `true`."""
    import re

    def peak(setting: str) -> float:
        result = CliRunner().invoke(app, ["train", "800m_hybrid", "--set", "data.path=builtin",
                                          f"train.activation_checkpointing={setting}", "--device", "cpu",
                                          "--out", str(tmp_path / "run")])
        assert_one_line_error(result, "of memory at its peak (estimate)")
        return float(re.search(r"needs about ([0-9.]+) GB", result.stderr).group(1))

    assert peak("auto") == peak("false") > 2 * peak("true")
    assert not (tmp_path / "run").exists()


def test_force_goes_on_after_saying_so(tmp_path, no_memory):
    args = ["warmup", str(ROOT / "recipes" / "tiny_hybrid.yaml"), "--lengths", "64", "--decode-tokens", "1",
            "--device", "cpu", "--force"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + result.stderr
    assert "going on as --force asks" in result.stderr and "in all" in result.stdout


# -- eval-ruler's estimate of the whole run ------------------------------------------------------------


def test_ruler_estimate_counts_the_tokens_the_answers_take():
    """The estimate once a sample is decoded: every sample as long as that one (which stopped after a few
    tokens, or at once), bounded by all max_new_tokens each; a sample that decoded no step must not take
    its prefill's time per step (the 11.1 min said for a 77 s run)."""
    from natsl.cli.eval_ruler import ruler_estimate

    facts = E.model_facts(natsl.load_recipe("tiny_hybrid").model)
    prompts = [1000] * 48
    three = {"prefill_s": 0.1, "decode_s": 0.02, "decode_steps": 2}  # 3 new tokens, 10 ms a step
    likely, most = ruler_estimate(facts, three, 1000, prompts, 128, CPU, rates=RATES)
    assert likely == pytest.approx(48 * (0.1 + 3 * 0.01))
    assert most == pytest.approx(48 * (0.1 + 128 * 0.01))
    at_once = {"prefill_s": 0.1, "decode_s": 0.0, "decode_steps": 0}  # the first new token was EOS
    likely, most = ruler_estimate(facts, at_once, 1000, prompts, 128, CPU, rates=RATES)
    step = E.estimate(facts, [E.Work("decode", 1, 1001)], CPU, rates=RATES).seconds
    assert likely == pytest.approx(48 * (0.1 + step)) and likely < 48 * 0.1 * 2
    assert most == pytest.approx(48 * (0.1 + 128 * step))
    # a longer prompt's prefill scales as the estimate says, from the measured one
    longer, _ = ruler_estimate(facts, three, 1000, [4000] * 48, 128, CPU, rates=RATES)
    ratio = (E.estimate(facts, [E.Work("prefill", 1, 4000)], CPU, rates=RATES).seconds
             / E.estimate(facts, [E.Work("prefill", 1, 1000)], CPU, rates=RATES).seconds)
    assert longer == pytest.approx(48 * (0.1 * ratio + 3 * 0.01))


def test_ruler_says_its_estimate_once_a_warm_sample_is_decoded(checkpoint, tmp_path):
    args = ["eval-ruler", str(checkpoint), "--lengths", "512", "--tasks", "niah_single_1", "--samples", "2",
            "--max-new-tokens", "4", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "ruler")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + result.stderr
    line = [x for x in result.stderr.splitlines() if x.startswith("eval-ruler: ")]
    assert len(line) == 1 and "in all on this device (at most" in line[0], result.stderr
    assert json.loads((tmp_path / "ruler" / "ruler.json").read_text())["samples"] == 2
