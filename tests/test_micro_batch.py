"""`train.micro_batch_size: auto` (natsl.training.micro_batch): the largest micro-batch that fits, the step's
tokens kept by accumulation, activation checkpointing when not even one sequence fits, the one-line refusal,
and the same data and losses as a fixed micro-batch. Device memory is a stand-in probe, so nothing here
depends on the machine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import natsl
from natsl.config import apply_overrides, recipe_from_dict, recipe_names
from natsl.errors import NatslError
from natsl.training import micro_batch as M
from natsl.training.distributed import DistInfo
from tests.cli_checks import assert_one_line_error

GIB = 2**30
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class FakeProbe:
    """A card of `total_bytes` whose step at micro-batch m peaks at base + m x per_sample (per_sample_ckpt
    with activation checkpointing; None: that mode never fits); above the card it runs out of memory."""

    per_sample: float
    per_sample_ckpt: float | None = None
    base: int = 10 * GIB
    total_bytes: int = 80 * GIB
    limit_bytes: int = 72 * GIB
    tried: list = field(default_factory=list)

    def peak_bytes(self, micro_batch: int, checkpointing: bool):
        self.tried.append((micro_batch, checkpointing))
        per = self.per_sample_ckpt if checkpointing else self.per_sample
        if per is None:
            return None
        peak = int(self.base + micro_batch * per)
        return peak if peak <= self.total_bytes else None


def fits_up_to(top: int, ckpt_top: int | None = None) -> FakeProbe:
    """A probe on which micro-batches up to `top` fit (`ckpt_top` with checkpointing); 0: not even one."""
    per = 62 * GIB / (top + 0.5) if top else None
    per_ckpt = 62 * GIB / (ckpt_top + 0.5) if ckpt_top else None
    return FakeProbe(per if per is not None else 1000 * GIB, per_ckpt)


# ----------------------------------------------------------------------------- the search

@pytest.mark.parametrize("count", [128, 96, 12, 7, 1])
def test_the_search_finds_the_largest_divisor_that_fits_for_every_limit(count):
    candidates = M.divisors(count)
    assert candidates == sorted((d for d in range(1, count + 1) if count % d == 0), reverse=True)
    for limit in range(0, count + 2):
        tried = []
        found = M.largest_fitting(candidates, lambda m: tried.append(m) or m <= limit)
        assert found == max((d for d in candidates if d <= limit), default=None)
        assert len(tried) == len(set(tried)) and len(tried) <= 2 * len(candidates).bit_length() + 2


@pytest.mark.parametrize("per_rank, top, micro", [(128, 13, 8), (128, 128, 128), (96, 40, 32), (12, 5, 4),
                                                  (7, 5, 1), (1, 3, 1)])
def test_auto_picks_the_largest_micro_batch_that_fits_and_keeps_the_step(per_rank, top, micro):
    probe = fits_up_to(top)
    choice = M.choose(per_rank, 4096, probe, "auto", device="H100")
    assert (choice.micro_batch, choice.checkpointing) == (micro, False)
    assert choice.micro_batch * choice.accumulation == per_rank  # tokens_per_step exactly
    assert choice.peak_bytes == probe.base + int(micro * probe.per_sample) <= probe.limit_bytes
    assert all(not ckpt for _, ckpt in probe.tried)
    line = choice.describe()
    assert "\n" not in line and f"auto: {micro} x 4096 tokens, {per_rank // micro} accumulation" in line
    assert f"{choice.peak_bytes / GIB:.1f} GiB measured" in line and "H100's 80.0 GiB" in line


def test_a_measured_peak_over_the_limit_does_not_fit_though_it_ran():
    probe = FakeProbe(per_sample=7 * GIB)  # 8 peaks at 66 GiB (fits), 16 at 122 (out of memory)
    assert M.choose(64, 4096, probe, "auto").micro_batch == 8
    probe = FakeProbe(per_sample=7.9 * GIB)  # 8 peaks at 73.2 GiB: ran, but above the 72 GiB limit
    assert M.choose(64, 4096, probe, "auto").micro_batch == 4


def test_activation_checkpointing_turns_on_when_not_even_one_sequence_fits():
    said = []
    probe = fits_up_to(0, ckpt_top=2)
    choice = M.choose(16, 4096, probe, "auto", device="H100", log=said.append)
    assert (choice.micro_batch, choice.accumulation, choice.checkpointing) == (2, 8, True)
    assert len(said) == 1 and said[0].startswith("activation checkpointing on") and "H100" in said[0]
    assert "activation checkpointing on" in choice.describe()
    assert (1, False) in probe.tried and probe.tried[-1][1]


def test_activation_checkpointing_true_probes_with_it_from_the_start():
    probe = fits_up_to(0, ckpt_top=4)
    choice = M.choose(16, 4096, probe, True)
    assert (choice.micro_batch, choice.checkpointing) == (4, True) and all(c for _, c in probe.tried)


@pytest.mark.parametrize("checkpointing, refused, fragment", [
    ("auto", "", "even with activation checkpointing"),
    (False, "", "train.activation_checkpointing is false"),
    ("auto", "model.router_keep_target is set", "activation checkpointing stays off: model.router_keep_target"),
    (True, "", "with activation checkpointing"),
])
def test_no_fit_at_all_is_one_line_naming_the_fixes(checkpointing, refused, fragment):
    said = []
    with pytest.raises(NatslError) as err:
        M.choose(16, 4096, fits_up_to(0), checkpointing, checkpointing_refused=refused, device="H100",
                 log=said.append)
    message = str(err.value)
    assert "\n" not in message and message.startswith("micro-batch 1 x 4096 tokens")
    for part in (fragment, "72.0 GiB usable on H100", "lower train.seq_len", "smaller model",
                 "GPU with more memory"):
        assert part in message
    assert bool(said) == (checkpointing == "auto" and not refused)


def test_a_resumed_run_keeps_its_checkpoints_micro_batch_where_it_fits():
    probe = fits_up_to(16)
    kept = M.choose(64, 4096, probe, "auto", prefer=4)
    assert (kept.micro_batch, kept.accumulation) == (4, 16) and probe.tried == [(4, False)]
    assert "the checkpoint's micro-batch" in kept.describe()
    assert M.choose(64, 4096, fits_up_to(2), "auto", prefer=4).micro_batch == 2  # no longer fits: searched
    assert M.choose(64, 4096, fits_up_to(16), "auto", prefer=3).micro_batch == 16  # not a divisor: ignored


@pytest.mark.parametrize("per_rank, micro", [(128, 8), (16, 8), (12, 6), (7, 7), (5, 5), (11, 1)])
def test_on_the_cpu_auto_measures_nothing_and_says_what_it_picked(per_rank, micro):
    choice = M.choose(per_rank, 128, None, "auto")
    assert (choice.micro_batch, choice.accumulation, choice.checkpointing) == (micro, per_rank // micro, False)
    assert "nothing measured on cpu" in choice.describe()
    assert M.choose(per_rank, 128, None, "auto", prefer=1).micro_batch == 1


def test_ranks_agree_on_the_smallest_pick_and_on_checkpointing_where_any_needs_it():
    assert M.agree([(8, False), (4, False), (8, False)]) == (4, False)
    assert M.agree([(8, False), (2, True)]) == (2, True)


def test_a_checkpoints_micro_batch_counts_only_from_as_many_ranks():
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    choice = M.pick(16, 64, fits_up_to(4), "auto", info, checkpoint_state={"micro_batch_size": 2, "world_size": 1})
    assert choice.micro_batch == 2  # the checkpoint's, run on as many ranks
    choice = M.pick(16, 64, fits_up_to(4), "auto", info, checkpoint_state={"micro_batch_size": 2, "world_size": 2})
    assert choice.micro_batch == 4  # another rank count: its micro-batch says nothing here


# ----------------------------------------------------------------------------- the real probe's step

def tiny_model(**model):
    from natsl.models import build_model

    recipe = recipe_from_dict({"model": {**natsl.load_recipe("tiny_hybrid").to_dict()["model"], **model}})
    torch.manual_seed(0)
    net = build_model(recipe, device="cpu")
    net.set_backend("chunked")
    return net.train()


def eager_loss(model):
    from natsl.training.trainer import HiddenStates, LanguageModelLoss

    return LanguageModelLoss(model, HiddenStates(model), False, 64)


def test_the_probe_step_leaves_weights_buffers_gradients_and_random_state_as_it_found_them():
    """A training forward draws router noise and moves the keep bias: neither may show after the probe."""
    model = tiny_model(router_noise=0.5, router_keep_target=0.3, router_bias_rate=0.1)
    probe = M.StepProbe(eager_loss(model), model, 64, 1024, torch.device("cpu"), memory=(80 * GIB, 80 * GIB))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert probe.run_step(2, checkpointing=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters()) and model.activation_checkpointing is False
    # the same forward outside the probe does move the bias and the generator (so the checks above can fail)
    tokens = torch.randint(0, 1024, (2, 65), generator=torch.Generator().manual_seed(0))
    eager_loss(model)(tokens[:, :-1], tokens[:, 1:])
    moved = model.state_dict()
    assert any(not torch.equal(before[k], moved[k]) for k in before if "bias" in k)
    assert not torch.equal(rng, torch.get_rng_state())
    assert probe.extra_bytes == 2 * 4 * sum(p.numel() for p in model.parameters())
    assert probe.limit_bytes == int(80 * GIB - M.MEMORY_MARGIN * 80 * GIB)


class OutOfMemoryAbove(torch.nn.Module):
    """The eager loss, out of memory for micro-batches above `top` (after allocating a little)."""

    def __init__(self, loss, top: int, error=torch.OutOfMemoryError):
        super().__init__()
        self.loss, self.top, self.error = loss, top, error

    def forward(self, inputs, targets):
        value = self.loss(inputs, targets)
        if inputs.shape[0] > self.top:
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return value


def test_the_probe_step_turns_out_of_memory_into_no_fit_and_cleans_up():
    model = tiny_model()
    probe = M.StepProbe(OutOfMemoryAbove(eager_loss(model), 2), model, 64, 1024, torch.device("cpu"),
                        memory=(80 * GIB, 80 * GIB))
    assert probe.run_step(2, checkpointing=True) and not probe.run_step(4, checkpointing=True)
    assert all(p.grad is None for p in model.parameters()) and model.activation_checkpointing is False
    assert probe.peak_bytes(1, False) == probe.extra_bytes  # on the CPU nothing else is measured
    assert M.choose(4, 64, probe, "auto").micro_batch == 2
    for text, oom in (("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate", True), ("shape mismatch", False)):
        assert M.is_out_of_memory(RuntimeError(text)) == oom
    other = M.StepProbe(OutOfMemoryAbove(eager_loss(model), 0, ValueError), model, 64, 1024, torch.device("cpu"),
                        memory=(80 * GIB, 80 * GIB))
    with pytest.raises(ValueError):  # a bug is not "does not fit"
        other.run_step(1, checkpointing=False)


def test_checkpointed_blocks_recompute_and_give_the_same_gradients_in_fp32():
    grads, calls = {}, []
    for checkpointing in (False, True):
        model = tiny_model()
        model.activation_checkpointing = checkpointing
        hook = model.layers[0].register_forward_pre_hook(lambda *_: calls.append(checkpointing))
        tokens = torch.randint(0, 1024, (2, 129), generator=torch.Generator().manual_seed(1))
        eager_loss(model)(tokens[:, :-1], tokens[:, 1:]).backward()
        hook.remove()
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert calls.count(False) == 1 and calls.count(True) == 2  # the checkpointed block ran again in the backward
    assert grads[False].keys() == grads[True].keys() and len(grads[False]) > 10
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-6, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- the recipe key

@pytest.mark.parametrize("value, accepted", [("auto", True), (4, True), ("8", True), ("Auto", False),
                                             ("abc", False), (0, False), (-2, False), (2.5, False), (True, False),
                                             (None, False), ([4], False)])
def test_micro_batch_size_takes_a_count_or_auto(value, accepted):
    data = {"model": {}, "train": {"micro_batch_size": value}}
    if accepted:
        assert recipe_from_dict(data).train.micro_batch_size in ("auto", 4, 8)
    else:
        with pytest.raises(NatslError, match="train.micro_batch_size.*(auto|at least 1)"):
            recipe_from_dict(data)


@pytest.mark.parametrize("value, accepted", [("auto", True), (True, True), (False, True), ("on", False),
                                             (1, False), (None, False)])
def test_activation_checkpointing_takes_true_false_or_auto(value, accepted):
    data = {"model": {}, "train": {"activation_checkpointing": value}}
    if accepted:
        assert recipe_from_dict(data).train.activation_checkpointing == value
    else:
        with pytest.raises(NatslError, match="train.activation_checkpointing.*'auto'"):
            recipe_from_dict(data)


def test_auto_still_needs_the_ranks_to_share_the_step():
    train = recipe_from_dict({"model": {}, "train": {"micro_batch_size": "auto", "seq_len": 64,
                                                     "tokens_per_step": 192}}).train
    assert train.accumulation(1) is None and train.accumulation(3) is None and train.accumulation(1, 3) == 1
    with pytest.raises(NatslError, match="not a multiple of seq_len x ranks = 64 x 2"):
        train.accumulation(2)


def test_the_recipes_that_train_at_scale_pick_their_micro_batch_and_the_tiny_one_keeps_its_own():
    names = [n for n in recipe_names() if n.startswith(("380m_", "800m_"))]
    assert len(names) == 22  # ten systems and NAtS-L on a DeltaNet state, at each size
    for name in names:
        train = natsl.load_recipe(name).train
        assert train.micro_batch_size == "auto" and train.activation_checkpointing == "auto", name
    assert natsl.load_recipe("tiny_hybrid").train.micro_batch_size == 8


# ----------------------------------------------------------------------------- through the trainer

@pytest.fixture(scope="module")
def corpus(natsl_cache_dir):
    """The embedded corpus's folder, found once (naming `builtin` would scan the corpus at every run)."""
    import os

    from natsl.data.builtin import builtin_data

    before = os.environ.get("NATSL_CACHE_DIR")
    os.environ["NATSL_CACHE_DIR"] = natsl_cache_dir
    try:
        return str(builtin_data(1024, progress=False, log=lambda *_: None))
    finally:
        if before is None:
            del os.environ["NATSL_CACHE_DIR"]
        else:
            os.environ["NATSL_CACHE_DIR"] = before


def tiny_recipe(micro_batch, corpus, steps_tokens=256, save_every=1000):
    return apply_overrides(natsl.load_recipe("tiny_hybrid"), [
        "train.seq_len=64", f"train.micro_batch_size={micro_batch}", f"train.tokens_per_step={steps_tokens}",
        "train.eval_every=1000", "train.eval_tokens=64", f"train.save_every={save_every}", "optim.warmup_tokens=0",
        f"data.path={corpus}"])


def run(recipe, out, probe=None, steps=3, log=None):
    from natsl.training import TrainOptions, train

    return train(recipe, TrainOptions(out_dir=str(out), device="cpu", backend="chunked", max_steps=steps,
                                      save_final=False, progress=False, log=log or (lambda *_: None),
                                      memory_probe=probe))


def test_auto_at_two_by_two_trains_as_a_fixed_four(tmp_path, monkeypatch, corpus):
    """Same samples, same tokens per step, same losses (fp32 rounding); and a resumed auto run keeps its
    checkpoint's micro-batch, so it continues bit-identically even where more would now fit."""
    histories, samples = {}, {}
    for name, micro, probe in (("fixed", 4, None), ("auto", "auto", fits_up_to(2))):
        monkeypatch.setenv("NATSL_DEBUG_DIR", str(tmp_path / f"debug_{name}"))
        said = []
        result = run(tiny_recipe(micro, corpus), tmp_path / name, probe, log=said.append)
        histories[name] = result.history
        samples[name] = json.loads((tmp_path / f"debug_{name}" / "rank0.json").read_text())["samples"]
        if name == "auto":
            assert (result.micro_batch, result.accumulation) == (2, 2) and result.micro_batch_choice.micro_batch == 2
            assert any(line.startswith("train.micro_batch_size auto: 2 x 64 tokens, 2 accumulation") for line in said)
            assert any("(2 x 64 x 2 accum x 1 rank)" in line for line in said)
    monkeypatch.delenv("NATSL_DEBUG_DIR")
    assert samples["auto"] == samples["fixed"] and len(samples["auto"]) == 3 * 4
    fixed, auto = histories["fixed"], histories["auto"]
    assert [r["tokens"] for r in auto] == [r["tokens"] for r in fixed] == [256, 512, 768]
    assert fixed[-1]["loss"] != fixed[0]["loss"]
    for a, b in zip(fixed, auto):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # stop the auto run at step 2, then resume where 4 would fit: the checkpoint's 2 is kept
    short = run(tiny_recipe("auto", corpus, save_every=2), tmp_path / "resumed", fits_up_to(2), steps=2)
    assert short.step == 2
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["micro_batch_size"] == 2
    resumed = run(tiny_recipe("auto", corpus), tmp_path / "resumed", fits_up_to(4))
    assert resumed.micro_batch == 2 and resumed.resumed_from is not None
    assert resumed.history[0]["loss"] == auto[2]["loss"] and resumed.history[0]["grad_norm"] == auto[2]["grad_norm"]


def test_the_trainer_turns_activation_checkpointing_on_and_says_so(tmp_path, monkeypatch, corpus):
    from natsl.models.lm import CausalLM

    seen = []
    hidden = CausalLM.hidden_states
    monkeypatch.setattr(CausalLM, "hidden_states",
                        lambda self, *a, **kw: seen.append(self.activation_checkpointing) or hidden(self, *a, **kw))
    said = []
    result = run(tiny_recipe("auto", corpus), tmp_path / "run", fits_up_to(0, ckpt_top=1), steps=1, log=said.append)
    assert result.micro_batch_choice.checkpointing and (result.micro_batch, result.accumulation) == (1, 4)
    assert any(line.startswith("activation checkpointing on") for line in said)
    assert seen and all(seen)


def test_a_run_that_fits_nowhere_is_one_line_and_exit_code_2(tmp_path, monkeypatch, corpus):
    """Through the CLI, with the device's probe replaced by one on which nothing fits."""
    from typer.testing import CliRunner

    from natsl.cli.main import app

    monkeypatch.setattr(M, "device_probe", lambda *args: fits_up_to(0))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "tiny_hybrid", "--set", "train.micro_batch_size=auto",
                                      "train.seq_len=64", "train.tokens_per_step=256", f"data.path={corpus}",
                                      "--device", "cpu", "--no-progress", "--max-steps", "1", "--out", str(out)],
                                env={"NATSL_FAULT": None})
    assert_one_line_error(result, "micro-batch 1 x 64 tokens", "even with activation checkpointing",
                          "lower train.seq_len, train a smaller model, or use a GPU with more memory")
    assert not out.exists()  # made by the run, left empty: removed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_probe_bounds_the_training_steps_peak(tmp_path, corpus):
    """The real probe on a card made small: a limit just above micro-batch 2's measured peak picks 2, and
    training at 2 (eager, as probed) peaks within the margin the probe keeps above its measurement (on an
    H100 the trainer's step peaked 2% above the probe's: its optimizer state and loss bookkeeping)."""
    from natsl.models import build_model
    from natsl.training import TrainOptions, train

    recipe = apply_overrides(tiny_recipe("auto", corpus, 1024), ["train.seq_len=256"])
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = build_model(recipe, device=device).train()
    model.set_backend("fast")
    loss = eager_loss(model)
    measure = M.StepProbe(loss, model, 256, 1024, device, memory=(80 * GIB, 80 * GIB))
    measure.peak_bytes(2, False)  # the kernels' first calls (compiling, autotuning) out of the way
    two, four = measure.peak_bytes(2, False), measure.peak_bytes(4, False)
    assert two < four
    total = int((two + 2**20) / (1 - M.MEMORY_MARGIN)) + 1  # micro-batch 2 fits, 4 does not
    probe = M.StepProbe(loss, model, 256, 1024, device, memory=(total, total))
    assert M.choose(4, 256, probe, "auto").micro_batch == 2
    del model, loss, measure, probe
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    result = train(apply_overrides(recipe, ["train.micro_batch_size=2"]), TrainOptions(
        out_dir=str(tmp_path / "run"), device="cuda", backend="fast", compile=False, max_steps=2, save_final=False,
        progress=False, log=lambda *_: None))
    assert result.step == 2 and torch.cuda.max_memory_allocated() <= two + M.MEMORY_MARGIN * total


# ----------------------------------------------------------------------------- the benchmark

def test_the_training_benchmark_runs_a_fixed_micro_batch_beside_auto(tmp_path, monkeypatch, natsl_cache_dir, capsys):
    """`--micro-batch-size 4,auto`: both at the same tokens per step, each row saying what it trained at."""
    from benchmarks import training

    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)
    training.main(["--recipes", "tiny_hybrid", "--in-process", "--max-steps", "2", "--warmup-steps", "1",
                   "--seq-len", "64", "--tokens-per-step", "1024", "--micro-batch-size", "4,auto", "--device", "cpu",
                   "--backend", "chunked", "--out", str(tmp_path / "out")])
    fixed, auto = json.loads((tmp_path / "out" / "training.json").read_text())["results"]
    assert fixed["status"] == auto["status"] == "ok" and fixed["tokens_per_step"] == auto["tokens_per_step"] == 1024
    assert (fixed["micro_batch_size"], fixed["micro_batch"], fixed["accumulation"]) == (4, 4, 4)
    assert (auto["micro_batch_size"], auto["micro_batch"], auto["accumulation"]) == ("auto", 8, 2)
    assert "nothing measured on cpu" in auto["micro_batch_note"] and auto["probe_peak_gib"] is None
    assert fixed["tokens_per_s"] > 0 and auto["tokens_per_s"] > 0
    table = capsys.readouterr().out
    assert "auto 8x2" in table and (tmp_path / "out" / "training.png").is_file()


@pytest.mark.parametrize("given, entries, sequences", [
    ("8", [8], 8), ("auto", ["auto"], 8), ("16,auto", [16, "auto"], 16), (" 4 , auto ", [4, "auto"], 4),
    ("0", None, None), ("x", None, None), ("8,,auto", None, None), ("-2", None, None)])
def test_the_benchmarks_micro_batch_list(given, entries, sequences):
    import argparse

    from benchmarks import training

    if entries is None:
        with pytest.raises(argparse.ArgumentTypeError):
            training.micro_batches(given)
    else:
        assert training.micro_batches(given) == entries and training.step_sequences(entries) == sequences


def test_a_sweep_of_a_recipe_with_auto_asks_for_a_count(tmp_path):
    """A sweep's step is one micro-batch: a system whose recipe says auto needs a count in `set:`."""
    from natsl.training import sweep

    spec = tmp_path / "s.yaml"
    base = "systems: {big: 380m_gdn}\nwidths: [64]\nlrs: [0.001]\ntasks: {t: 'task:mqar?seq_len=64&pairs=4'}\n"
    spec.write_text(base)
    with pytest.raises(NatslError, match="system 'big': its recipe has train.micro_batch_size auto.*set:"):
        sweep.load_spec(spec, tmp_path / "out")
    spec.write_text(base + "set: [train.micro_batch_size=4]\n")
    (run,) = sweep.load_spec(spec, tmp_path / "out").runs
    assert "train.tokens_per_step=256" in run.overrides
