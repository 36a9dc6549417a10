"""`natsl miniature` (natsl.miniature.pipeline): the specs its sweep and train stages write, the checkpoints it
hands to the evaluations, its one-line errors, and the corpus -> sweep -> train stages end to end on the CPU
with a tiny model (the evaluations and the report: tests/test_miniature_eval.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import natsl.miniature.pipeline as P
import natsl.training.sweep as S
from natsl.config import apply_overrides, load_recipe
from natsl.errors import NatslError

ROOT = Path(__file__).resolve().parent.parent
TINY = ("model.vocab_size=300", "model.hidden_size=32", "model.intermediate_size=64", "model.head_k_dim=16",
        "model.head_v_dim=32", "model.attn_head_dim=16", "model.mamba2_head_dim=16", "model.mamba2_state_size=8",
        "train.seq_len=128", "train.tokens_per_step=256", "train.eval_tokens=512", "train.dtype=fp32")


def _runs(spec: dict, folder: Path) -> list:
    """The runs natsl sweep would start for `spec` (written beside the copied recipes, loaded as the CLI does)."""
    path = P._write_spec(folder / "specs" / "s.yaml", spec)
    return S.load_spec(path, folder / "out", device="cpu").runs


def test_sweep_spec_sweeps_every_system_and_ablation_at_every_rate(tmp_path):
    opts = P.MiniatureOptions(out=tmp_path, lrs=(0.001, 0.002), sweep_tokens=655360)
    P.copy_recipes(opts, tmp_path / "specs")
    runs = _runs(P.sweep_spec(opts), tmp_path)
    assert len(runs) == (len(P.SWEPT) + len(P.ABLATIONS)) * 2
    assert {r.system for r in runs} == set(P.SWEPT) | set(P.ABLATIONS) and "gdn_swa" not in {r.system for r in runs}
    for run in runs:
        recipe = apply_overrides(load_recipe(run.recipe), run.overrides)
        assert run.max_steps == 10 and recipe.train.total_tokens == 655360 and recipe.optim.lr == run.lr
        assert recipe.train.micro_batch_size == 8 and recipe.train.tokens_per_step == 65536 and not recipe.train.compile
    ablation = {r.system: apply_overrides(load_recipe(r.recipe), r.overrides).model for r in runs}
    assert ablation["natsl_hybrid_mix_x"].mix_input == "x" and ablation["natsl_hybrid"].mix_input == "q"
    assert ablation["natsl_hybrid_chunk128"].block_size == 128
    assert ablation["natsl_hybrid_chunk128"].backend == ablation["natsl_hybrid"].backend  # the fast kernels on a GPU
    assert ablation["natsl_hybrid_no_intra_softmax"].intra_block_output == "gdn"


def test_train_spec_trains_the_ladder_at_the_best_rates_and_the_hybrid_over_seeds(tmp_path):
    opts = P.MiniatureOptions(out=tmp_path, train_tokens=65536 * 20, seeds=(0, 1, 2))
    P.copy_recipes(opts, tmp_path / "specs")
    rates = {"gdn": 0.002, "mamba2": 0.004, "transformer": 0.004, "gdn_hybrid": 0.001, "natsl": 0.002,
             "natsl_hybrid": 0.002, "natsl_hybrid_mix_x": 0.004}
    runs = _runs(P.train_spec(opts, rates), tmp_path)
    got = sorted((r.system, r.lr, r.seed) for r in runs)
    assert got == sorted([(s, rates[s], 0) for s in P.SWEPT] + [("gdn_swa", 0.001, 0), ("natsl_hybrid", 0.002, 1),
                                                                   ("natsl_hybrid", 0.002, 2)])
    assert all(r.max_steps == 20 for r in runs)
    with pytest.raises(NatslError, match="the sweep has no validation loss for mamba2"):
        P.train_spec(opts, {k: v for k, v in rates.items() if k != "mamba2"})


def test_a_subset_of_systems_sweeps_and_trains_only_what_it_needs(tmp_path):
    opts = P.MiniatureOptions(out=tmp_path, lrs=(0.001,), sweep_tokens=655360, train_tokens=65536 * 20,
                              seeds=(1, 2), systems=("gdn_swa", "transformer"))
    P.copy_recipes(opts, tmp_path / "specs")
    swept = {r.system for r in _runs(P.sweep_spec(opts), tmp_path)}
    assert swept == {"gdn_hybrid", "transformer"}  # GDN + SWA trains at the GDN Hybrid's rate; no ablations
    rates = {"gdn_hybrid": 0.001, "transformer": 0.004}
    got = sorted((r.system, r.lr, r.seed) for r in _runs(P.train_spec(opts, rates), tmp_path))
    assert got == [("gdn_swa", 0.001, 0), ("transformer", 0.004, 0)]
    assert P.estimate_tokens(opts) == {"sweep": 2 * 655360.0, "train": 2 * 65536 * 20.0, "total": 2 * 655360.0 + 2 * 65536 * 20.0}
    hybrid = P.MiniatureOptions(out=tmp_path, train_tokens=65536 * 20, seeds=(1, 2), systems=("natsl_hybrid",))
    assert sorted((r.system, r.seed) for r in _runs(P.train_spec(hybrid, {"natsl_hybrid": 0.002}), tmp_path)) == \
        [("natsl_hybrid", 1), ("natsl_hybrid", 2)]
    assert {r.system for r in _runs(P.sweep_spec(hybrid), tmp_path)} == {"natsl_hybrid", *P.ABLATIONS}
    assert "1 systems (NAtS-L Hybrid x 2 seeds)" in P.describe(hybrid)


def test_seed_systems_train_every_named_system_over_the_seeds(tmp_path):
    """--seed-systems: the baselines over --seeds too (their spread measured as the NAtS-L Hybrid's), counted in
    the estimate and said in the plan; a train stage grown by seeds keeps its runs, one that drops seeds is refused."""
    from dataclasses import replace

    opts = P.MiniatureOptions(out=tmp_path / "m", train_tokens=65536 * 20, seeds=(0, 1),
                              seed_systems=("gdn_hybrid", "natsl_hybrid"), systems=("gdn_hybrid", "natsl_hybrid", "gdn"))
    P.copy_recipes(opts, tmp_path / "m" / "specs")
    rates = {"gdn": 0.002, "gdn_hybrid": 0.001, "natsl_hybrid": 0.002}
    got = sorted((r.system, r.seed) for r in _runs(P.train_spec(opts, rates), tmp_path / "m"))
    assert got == [("gdn", 0), ("gdn_hybrid", 0), ("gdn_hybrid", 1), ("natsl_hybrid", 0), ("natsl_hybrid", 1)]
    assert P.estimate_tokens(replace(opts, stages=("train",)))["train"] == 5 * 65536 * 20
    assert "3 systems (2 of them x 2 seeds) x" in P.describe(opts)
    assert "seeds)" not in P.describe(replace(opts, seeds=(0,)))
    folder = tmp_path / "m" / "train"
    folder.mkdir(parents=True)
    before = P.train_spec(replace(opts, seed_systems=("natsl_hybrid",)), rates)
    (folder / "sweep.json").write_text(json.dumps({"name": "mini_train", "spec": before, "runs": []}))
    assert P._grows(folder, P.train_spec(opts, rates)) is None  # gdn_hybrid: one seed -> two
    assert P._grows(folder, P.train_spec(replace(opts, seeds=(0, 1, 2)), rates)) is None
    assert P._grows(folder, P.train_spec(replace(opts, seeds=(1, 2)), rates)) == "system 'gdn_hybrid' differs"
    assert P._grows(folder, P.train_spec(replace(opts, seed_systems=()), rates)) == "system 'natsl_hybrid' differs"


def test_the_estimate_leaves_out_what_the_stage_folders_trained_already(tmp_path):
    """A grown or resumed stage trains the rest only: done runs of this spec count whole, runs cut short by what
    they trained, failed runs and runs of other rates or systems not at all."""
    opts = P.MiniatureOptions(out=tmp_path, lrs=(0.001, 0.002), sweep_tokens=100, train_tokens=1000,
                              seeds=(0, 1), systems=("natsl_hybrid", "transformer"))
    whole = P.estimate_tokens(opts)
    assert whole["sweep"] == (1 + 1 + len(P.ABLATIONS)) * 2 * 100 and whole["train"] == 3 * 1000
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "summary.json").write_text(json.dumps({"runs": [
        {"system": "transformer", "lr": 0.001, "status": "done", "tokens": 99},  # done: its whole budget
        {"system": "transformer", "lr": 0.002, "status": "not run", "failed": "exit code 1", "tokens": 50},
        {"system": "natsl_hybrid", "lr": 0.004, "status": "done"},  # a rate this spec does not run
        {"system": "gdn", "lr": 0.001, "status": "done"}]}))  # a system it does not sweep
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "summary.json").write_text(json.dumps({"runs": [
        {"system": "natsl_hybrid", "seed": 1, "status": "unknown", "tokens": 400},  # cut short by a deadline
        {"system": "natsl_hybrid", "seed": 2, "status": "done"}]}))  # a seed this spec does not train
    left = P.estimate_tokens(opts)
    assert left["sweep"] == whole["sweep"] - 100 and left["train"] == whole["train"] - 400
    assert left["total"] == left["sweep"] + left["train"]
    assert "tokens left to train" in P.describe(opts)
    for stage in ("sweep", "train"):  # a summary no parser can read counts nothing (the stage says why when it runs)
        (tmp_path / stage / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    assert P.estimate_tokens(opts) == whole


def test_the_estimate_counts_only_the_chosen_stages_at_the_measured_rates(tmp_path):
    """--stages train (the rates given) trains no sweep, and --compile estimates at the compiled workers' rate."""
    from dataclasses import replace

    opts = P.MiniatureOptions(out=tmp_path, stages=("corpus", "train", "eval", "report"))
    tokens = P.estimate_tokens(opts)
    assert tokens["sweep"] == 0 and tokens["train"] == (len(P.LADDER) + 2) * opts.train_tokens
    assert P.estimate_tokens(replace(opts, stages=("eval", "report")))["total"] == 0

    def minutes(o):
        return float(P.describe(o).split("takes about ")[1].split(" min")[0])

    assert minutes(opts) == round(tokens["train"] / P.H100_TOKENS_PER_S["train"] / 60)
    assert minutes(replace(opts, compile=True)) == round(tokens["train"] / P.H100_TOKENS_PER_S_COMPILED["train"] / 60)
    assert "(compiled)" in P.describe(replace(opts, compile=True))
    assert "rates x" not in P.describe(opts) and "systems (NAtS-L Hybrid x 3 seeds) x 100M tokens" in P.describe(opts)
    assert "no training stage: 0.00B tokens" in P.describe(replace(opts, stages=("eval",)))


def test_the_whole_ladder_by_default_writes_the_same_specs_as_before_systems_existed(tmp_path):
    # a miniature folder from before --systems (its specs/*.yaml) must still be taken as the same spec
    opts = P.MiniatureOptions(out=tmp_path)
    assert list(P.sweep_spec(opts)["systems"]) == list(P.SWEPT) + list(P.ABLATIONS)
    assert list(P.train_spec(opts, {s: 0.002 for s in P.SWEPT})["systems"]) == list(P.LADDER)


def test_best_rates_and_checkpoint_folders_from_the_summaries(tmp_path):
    def summary(folder, runs, best=()):
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"runs": runs, "best_lm": list(best)}))

    summary(tmp_path / "sweep", [], [{"system": "gdn", "best_lr": 0.002, "run": "mini-gdn-d256-lr0.002"},
                                     {"system": "natsl_hybrid_mix_x", "best_lr": 0.004,
                                      "run": "mini-natsl_hybrid_mix_x-d256-lr0.004"}])
    summary(tmp_path / "train", [{"id": "a", "system": "gdn", "seed": 0, "status": "done"},
                                 {"id": "b", "system": "natsl_hybrid", "seed": 2, "status": "done"},
                                 {"id": "c", "system": "natsl", "seed": 0, "status": "not run"},
                                 {"id": "d", "system": "mamba2", "seed": 0, "status": "stopped early"},
                                 {"id": "e", "system": "transformer", "seed": 0, "status": "done"}])
    for folder in ("train/runs/a", "train/runs/b", "train/runs/d",  # d: a deadline's checkpoint; e: done, no weights
                   "sweep/runs/mini-natsl_hybrid_mix_x-d256-lr0.004"):
        (tmp_path / folder / "train" / "checkpoints").mkdir(parents=True)
    assert P.best_rates(json.loads((tmp_path / "sweep" / "summary.json").read_text())) == {
        "gdn": 0.002, "natsl_hybrid_mix_x": 0.004}
    found = P.checkpoint_folders(tmp_path)
    assert found == {"gdn": str(tmp_path / "train/runs/a/train"), "natsl_hybrid_s2": str(tmp_path / "train/runs/b/train"),
                     "mamba2": str(tmp_path / "train/runs/d/train"),
                     "natsl_hybrid_mix_x": str(tmp_path / "sweep/runs/mini-natsl_hybrid_mix_x-d256-lr0.004/train")}
    assert P.finished_runs({"runs": [{"status": "done"}, {"status": "not run", "failed": "x"}, {"status": "cut off"}]}) \
        == (2, 3)


def test_the_corpus_command_is_the_documented_one():
    argv = P.corpus_command(P.MiniatureOptions())
    text = " ".join(argv)
    docs = (ROOT / "docs" / "training.md").read_text()
    for flag in ("--skip-bad-files", "--dedup", "--val-texts", "--train-tokenizer", "--include *.py", "/usr/include",
                 "--out data/mini", "--vocab-size 32000"):
        assert flag in text
    assert "--val-fraction 0.005" in text and "--val-fraction 0.005" in docs


def test_a_given_tokenizer_builds_the_same_corpus_as_the_trained_bpe(tmp_path, monkeypatch):
    """--tokenizer: the corpus stage tokenizes with an earlier build's tokenizer.json instead of training a BPE,
    and writes the same tokens."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    base = P.MiniatureOptions(out=Path("m"), data=Path("data/a"), corpus_inputs=(str(ROOT / "docs"),),
                              corpus_patterns=("*.md",), vocab_size=300, val_fraction=0.2, tokenizer_train_docs=None,
                              device="cpu", stages=("corpus",))
    assert P.run_miniature(base, log=lambda line: None)["stages"]["corpus"] == "done"
    from dataclasses import replace

    given = replace(base, out=Path("m2"), data=Path("data/b"), tokenizer=Path("data/a/tokenizer.json"))
    argv = P.corpus_command(given)
    assert "--train-tokenizer" not in argv and argv[argv.index("--tokenizer") + 1] == "data/a/tokenizer.json"
    assert P.run_miniature(given, log=lambda line: None)["stages"]["corpus"] == "done"
    trained, reused = (json.loads((tmp_path / "data" / x / "meta.json").read_text()) for x in "ab")
    assert reused["total_tokens"] == trained["total_tokens"] > 0
    shards = sorted(p.name for p in (tmp_path / "data/a").glob("*.bin"))
    assert shards  # train_00000.bin, validation_00000.bin
    for name in shards:
        assert (tmp_path / "data/b" / name).read_bytes() == (tmp_path / "data/a" / name).read_bytes(), name


@pytest.mark.parametrize("args, message", [
    (["--lrs", "0.1,abc"], "--lrs '0.1,abc' is not a comma-separated list of numbers; pass e.g. 0.001,0.002,0.004"),
    (["--seeds", "0,x"], "--seeds '0,x' is not a comma-separated list of whole numbers; pass e.g. 0,1,2"),
    (["--lrs", "2"], "give learning rates between 0 and 1"),
    (["--seeds", "0,0"], "give distinct seeds from 0"),
    (["--stages", "train,fly"], "unknown stage 'fly'"),
    (["--sweep-tokens", "0"], "--sweep-tokens 0: give a positive whole number"),
    (["--sweep-micro-batch", "0"], "--sweep-micro-batch 0: give a positive whole number"),
    (["--max-parallel", "0"], "--max-parallel 0: give a positive whole number"),
    (["--deadline", "-5"], "--deadline -5.0: give a positive number of seconds"),
    (["--device", "tpu"], "--device 'tpu': give cpu or cuda"),
    (["--systems", "gdn,llama"], "--systems 'gdn,llama': unknown system 'llama'; give distinct names from gdn,"),
    (["--systems", "gdn,gdn"], "--systems 'gdn,gdn': give distinct names from gdn,"),
    (["--evals", "ppl,mmlu"], "--evals 'ppl,mmlu': unknown evaluation 'mmlu'; choose from ppl,compare,latency,"),
    (["--eval-reserve", "60"], "--eval-reserve 60.0: give it with --deadline"),
    (["--seed-systems", "gdn,llama"], "--seed-systems 'gdn,llama': unknown system 'llama'; give all or distinct names"),
    (["--tokenizer", "data/mini/tokenizer.json"], "lies inside --data 'data/mini', which the corpus stage writes; copy it out first"),
    (["--tokenizer", "no/such/tokenizer.json"], "--tokenizer 'no/such/tokenizer.json' does not exist; pass a tokenizer.json"),
    (["--rates", "gdn=0.002,llama=0.001"], "'llama=0.001' is not SYSTEM=RATE with a rate between 0 and 1"),
    (["--rates", "gdn=2"], "'gdn=2' is not SYSTEM=RATE"),
    (["--rates", "gdn=0.002,gdn=0.004"], "'gdn=0.004' is not SYSTEM=RATE with a rate between 0 and 1 and a system named once"),
    (["--rates", "gdn"], "'gdn' is not SYSTEM=RATE"),
    (["--rates", ","], "give SYSTEM=RATE items"),
    (["--eval-reserve", "600", "--deadline", "500"], "a number of seconds between 0 and the deadline"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "natsl.cli.main", "miniature", "--out", str(tmp_path / "m"), *args],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_rates_given_train_without_a_sweep_and_override_the_sweeps(tmp_path, monkeypatch):
    """--rates: the train stage takes them in place of the sweep's best rates; with every needed system's rate it
    needs no sweep folder, and with some it takes the rest from the sweep."""
    specs = []
    monkeypatch.setattr(P, "_sweep_stage", lambda name, spec, *rest: specs.append(spec))
    given = {"gdn": 0.002, "mamba2": 0.004, "transformer": 0.004, "gdn_hybrid": 0.001, "natsl": 0.002,
             "natsl_hybrid": 0.003}
    opts = P.MiniatureOptions(out=tmp_path / "m", rates=given, seeds=(0, 1))
    P._stage_train(opts, None, lambda line: None, {})
    assert specs[-1]["lrs"] == {**{s: [r] for s, r in given.items()}, "gdn_swa": [0.001]}
    partial = P.MiniatureOptions(out=tmp_path / "m", rates={"gdn": 0.001}, systems=("gdn", "transformer"))
    with pytest.raises(NatslError, match="holds no sweep; run the sweep stage first, or give the rates of transformer"):
        P._stage_train(partial, None, lambda line: None, {})
    (tmp_path / "m" / "sweep").mkdir(parents=True)
    (tmp_path / "m" / "sweep" / "summary.json").write_text(json.dumps({"best_lm": [
        {"system": "gdn", "best_lr": 0.004}, {"system": "transformer", "best_lr": 0.002}]}))
    lines = []
    P._stage_train(partial, None, lines.append, {})
    assert specs[-1]["lrs"] == {"gdn": [0.001], "transformer": [0.002]}
    assert lines == ["  learning rates: gdn 0.001 (--rates), transformer 0.002 (sweep)"]


def test_training_before_a_sweep_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "natsl.cli.main", "miniature", "--out", "m", "--stages", "train",
                           "--device", "cpu"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and "holds no sweep; run the sweep stage first" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_corpus_sweep_and_train_end_to_end_and_again_does_nothing(tmp_path, monkeypatch):
    """The three training stages on a corpus of this repository's docs and model code, a tiny model, one rate;
    the same command again keeps everything. Each stage is the natsl command it names, in a subprocess."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    opts = P.MiniatureOptions(out=Path("m"), data=Path("data/mini"), corpus_inputs=(str(ROOT / "docs"),
                              str(ROOT / "natsl" / "models")), corpus_patterns=("*.md", "*.py"), vocab_size=300,
                              val_fraction=0.2, tokenizer_train_docs=None, lrs=(0.004,), sweep_tokens=256,
                              train_tokens=512, seeds=(0, 1), micro_batch=2, max_parallel=2, device="cpu",
                              stages=("corpus", "sweep", "train"), sets=TINY)
    lines: list[str] = []
    result = P.run_miniature(opts, log=lines.append)
    assert result["stages"] == {"corpus": "done", "sweep": "done", "train": "done", "eval": "skipped",
                                "report": "skipped"}, lines
    assert (tmp_path / "data/mini/meta.json").is_file() and (tmp_path / "m/specs/recipes/natsl_hybrid.yaml").is_file()
    sweep = json.loads((tmp_path / "m/sweep/summary.json").read_text())
    assert P.finished_runs(sweep) == (len(P.SWEPT) + len(P.ABLATIONS),) * 2
    assert set(result["checkpoints"]) == set(P.LADDER) | {"natsl_hybrid_s1"} | set(P.ABLATIONS)
    for name, folder in result["checkpoints"].items():
        assert (tmp_path / folder / "checkpoints").is_dir(), name
    again: list[str] = []
    assert P.run_miniature(opts, log=again.append)["stages"]["train"] == "done"
    assert any("holds a corpus (meta.json): kept" in line for line in again)
    assert sum("runs done: kept" in line for line in again) == 2, again
    from dataclasses import replace  # another spec on the same folder: refused, not taken for this one's runs

    with pytest.raises(NatslError, match="holds runs of another spec"):
        P.run_miniature(replace(opts, sweep_tokens=512), log=again.append)
    grown: list[str] = []  # a baseline's seeds added later: only the new run trains
    result = P.run_miniature(replace(opts, stages=("train",), seed_systems=("natsl_hybrid", "gdn")), log=grown.append)
    assert result["stages"]["train"] == "done" and "gdn_s1" in result["checkpoints"], grown
    assert any("the spec adds learning rates, systems or seeds; its finished runs are kept" in line
               for line in grown), grown


def test_more_rates_grow_the_sweep_stage_and_other_changes_are_refused(tmp_path):
    """The sweep stage's folder is taken by a spec that adds learning rates (its finished runs kept; natsl sweep
    checks each run's settings too), and refused for any other change, with what differs."""
    from dataclasses import replace

    opts = P.MiniatureOptions(out=tmp_path / "m", lrs=(0.002, 0.004))
    folder = tmp_path / "m" / "sweep"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"name": "mini_sweep", "spec": P.sweep_spec(opts), "runs": []}))
    assert P._grows(folder, P.sweep_spec(replace(opts, lrs=(0.001, 0.002, 0.004)))) is None
    assert P._grows(folder, P.sweep_spec(replace(opts, sweep_tokens=512))) == "'budget' differs"
    assert P._grows(folder, P.sweep_spec(replace(opts, micro_batch=16))) == "'set' differs"
    # the train stage at another micro-batch, the sweep at the kept runs' own: still the same sweep
    faster = replace(opts, lrs=(0.001, 0.002, 0.004), micro_batch=16, sweep_micro_batch=8)
    assert P._grows(folder, P.sweep_spec(faster)) is None
    assert "train.micro_batch_size=16" in P.train_spec(faster, {n: 0.002 for n in P.SWEPT})["set"]
    assert P._grows(tmp_path, P.sweep_spec(opts)) == "no readable sweep.json"
    (folder / "sweep.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past the parser's recursion
    assert P._grows(folder, P.sweep_spec(opts)) == "no readable sweep.json"


def test_a_failed_run_is_final_within_a_command_and_tried_again_by_the_next(monkeypatch, tmp_path):
    """A stage folder whose runs are done but one failed (the first GPU run's block-128 ablation) runs natsl
    sweep again, which reruns what is not done; within that command the failure is final: the stage goes on."""
    opts = P.MiniatureOptions(out=tmp_path / "m", device="cpu")
    spec = P.sweep_spec(opts)
    folder = tmp_path / "m" / "sweep"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"name": "mini_sweep", "spec": spec, "runs": []}))
    summary = {"runs": [{"id": "a", "status": "done"}, {"id": "b", "status": "failed", "failed": "exit code 1"}]}
    (folder / "summary.json").write_text(json.dumps(summary))
    calls: list[list[str]] = []

    def fake_run(argv, log_path, log):
        calls.append(argv)
        return 1  # natsl sweep's exit code when a run failed again

    monkeypatch.setattr(P, "_run", fake_run)
    lines: list[str] = []
    assert P._sweep_stage("sweep", spec, opts, None, lines.append) == summary  # failed again: final, no Stopped
    assert len(calls) == 1 and calls[0][2:5] == ["natsl.cli.main", "sweep", str(tmp_path / "m/specs/sweep.yaml")], calls
    assert any("1 failed run(s) of an earlier command: trying them again" in line for line in lines), lines
    assert P.finished_runs(summary) == (2, 2) and P.finished_runs(summary, failed_final=False) == (1, 2)
    summary["runs"][1] = {"id": "b", "status": "done"}
    (folder / "summary.json").write_text(json.dumps(summary))
    assert P._sweep_stage("sweep", spec, opts, None, lines.append) == summary and len(calls) == 1  # all done: kept


def test_an_eval_reserve_evaluates_training_cut_short(monkeypatch, tmp_path):
    """--deadline with --eval-reserve: training stops the reserve before the deadline, then the evaluations and
    the report run on the runs as they are; without a reserve a stopped stage ends the command."""
    seen = {}

    def stage(name, stop=False):
        def run(opts, remaining, log, result):
            seen[name] = remaining
            if stop:
                raise P.Stopped(f"{name}: 3 of 7 runs done")
        return run

    monkeypatch.setattr(P, "STAGE_RUNNERS", {"train": stage("train", stop=True), "eval": stage("eval"),
                                             "report": stage("report")})
    opts = P.MiniatureOptions(out=tmp_path / "m", stages=("train", "eval", "report"), deadline_s=1000.0,
                              eval_reserve_s=300.0, device="cpu")
    lines: list[str] = []
    result = P.run_miniature(opts, log=lines.append)
    assert result["stages"] == {"corpus": "skipped", "sweep": "skipped", "train": "stopped", "eval": "done",
                                "report": "done"}, lines
    assert 690 < seen["train"] <= 700 and 960 < seen["eval"] <= 1000 - P.REPORT_RESERVE_S and seen["report"] > 900
    assert any("evaluating the runs as they are" in line for line in lines)
    seen.clear()
    result = P.run_miniature(P.MiniatureOptions(out=tmp_path / "m", stages=("train", "eval", "report"),
                                                deadline_s=1000.0, device="cpu"), log=lines.append)
    assert result["stages"]["train"] == "stopped" and list(seen) == ["train"] and 990 < seen["train"] <= 1000


def test_evals_runs_only_the_chosen_families_of_eval_jobs(monkeypatch, tmp_path):
    import natsl.miniature.evaluate as E

    names = ["ppl", "compare", "latency", "routing_natsl_hybrid", "ruler_natsl_hybrid", "ruler_gdn_hybrid",
             "lm_eval_natsl_hybrid", "lm_eval_transformer"]
    monkeypatch.setattr(E, "eval_jobs", lambda *a, **k: [E.EvalJob(n, [], tmp_path, tmp_path / "x.json", tmp_path)
                                                         for n in names])
    ran = []
    monkeypatch.setattr(E, "run_jobs", lambda jobs, **k: ran.extend(j.name for j in jobs) or {j.name: "done" for j in jobs})
    monkeypatch.setattr(P, "checkpoint_folders", lambda root: {})
    P._stage_eval(P.MiniatureOptions(out=tmp_path, evals=("ppl", "lm_eval", "latency"), device="cpu"), None,
                  lambda line: None, {})
    assert ran == ["ppl", "latency", "lm_eval_natsl_hybrid", "lm_eval_transformer"]
    assert [P.eval_family(n) for n in names] == ["ppl", "compare", "latency", "routing", "ruler", "ruler", "lm_eval",
                                                 "lm_eval"]


def test_a_set_item_that_fits_no_recipe_is_refused_before_the_corpus_stage(tmp_path):
    """--set is checked against the ladder's recipes first, not after minutes of tokenizing the corpus."""
    opts = P.MiniatureOptions(out=tmp_path / "m", data=tmp_path / "data", stages=("corpus",), sets=("model.bogus=1",))
    with pytest.raises(NatslError, match="--set does not fit the .* recipe: .*bogus"):
        P.run_miniature(opts, log=lambda line: None)
    assert not (tmp_path / "data").exists() and not (tmp_path / "m").exists()
    P.check_sets(P.MiniatureOptions(out=tmp_path / "m", sets=("train.log_every=5",)))  # one that fits every recipe
