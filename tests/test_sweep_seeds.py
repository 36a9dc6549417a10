"""The sweep runner's seeds (`seeds:`: runs, ids, the summary's mean / min / max and learning rate by the
mean), its matching of runs in steps or time (`budget.match`, `short` runs, the start line and the
crowded-GPU warning), and a system's own `set:` (`systems: {NAME: {recipe: FILE, set: [...]}}`). CPU only:
summaries are built from result.json files written here, the runner starts stand-in workers."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import natsl.training.sweep as S
from natsl.config import apply_overrides, load_recipe
from natsl.errors import NatslError

ROOT = Path(__file__).resolve().parent.parent
BASE = ("systems: {gdn: recall/gdn, natsl_hybrid: recall/natsl_hybrid}\nwidths: [64]\n"
        "tasks: {t: 'task:mqar?seq_len=64&pairs=4'}\n")


def _spec(tmp_path, text: str, name: str = "s.yaml") -> Path:
    """BASE with `text`'s top-level keys added; a key of both is `text`'s (a spec names each key once)."""
    given = {line.split(":")[0] for line in text.splitlines() if line and not line[0].isspace()}
    base = "".join(f"{line}\n" for line in BASE.splitlines() if line.split(":")[0] not in given)
    path = tmp_path / name
    path.write_text(base + text)
    return path


def test_seeds_expand_runs_ids_and_train_seed(tmp_path):
    """Every (task, system, width, lr) once per seed, seed 0's learning rates first; seed 0 keeps the id
    of a sweep without seeds (so its finished runs are found again), the others end -s1, -s2; each run's
    recipe trains with its seed, and its cosine schedule ends at budget.max_steps."""
    plain = S.load_spec(_spec(tmp_path, "lrs: [0.001, 0.003]\nbudget: {max_steps: 50}\n"), tmp_path / "out")
    assert plain.runs[0].seed == 0 and [r.id for r in plain.runs] == [
        "t-gdn-d64-lr0.001", "t-natsl_hybrid-d64-lr0.001", "t-gdn-d64-lr0.003", "t-natsl_hybrid-d64-lr0.003"]
    sweep = S.load_spec(_spec(tmp_path, "lrs: [0.001, 0.003]\nseeds: [0, 1, 2]\nbudget: {max_steps: 50}\n"
                                        "set: [train.micro_batch_size=2, train.tokens_per_step=256]\n"),
                        tmp_path / "out")
    assert len(sweep.runs) == 12
    assert [(r.seed, r.lr, r.system) for r in sweep.runs[:4]] == [
        (0, 1e-3, "gdn"), (0, 1e-3, "natsl_hybrid"), (0, 3e-3, "gdn"), (0, 3e-3, "natsl_hybrid")]
    assert [r.id for r in sweep.runs[:4]] == [r.id for r in plain.runs]
    assert [r.id for r in sweep.runs if r.system == "gdn" and r.lr == 1e-3] == [
        "t-gdn-d64-lr0.001", "t-gdn-d64-lr0.001-s1", "t-gdn-d64-lr0.001-s2"]
    assert {Path(r.out).name for r in sweep.runs} == {r.id for r in sweep.runs}
    for run in sweep.runs:
        recipe = apply_overrides(load_recipe(run.recipe), run.overrides)
        assert recipe.train.seed == run.seed and run.match == "steps" and run.max_steps == 50
        # two micro-batches a step (the set: items): the schedule still ends at step 50
        assert recipe.train.tokens_per_step == 256 and recipe.train.total_tokens == 256 * 50


@pytest.mark.parametrize("text, message", [
    ("seed: 3\n", r"'seed' is not a key; write seeds: \[3\]"),
    ("seeds: []\n", "'seeds' must be a list of integers"),
    ("seeds: 2\n", "'seeds' must be a list of integers"),
    ("seeds: [0, -1]\n", "'seeds' holds -1; each seed must be an integer from 0 to 2"),
    ("seeds: [0, true]\n", "'seeds' holds True"),
    ("seeds: [0, 1.5]\n", "'seeds' holds 1.5"),
    ("seeds: [1, 2, 1]\n", "lists seed 1 twice"),
    ("set: [train.seed=4]\n", r"the runner sets train.seed for every run; use seeds: \[0, 1, 2\]"),
    ("set: [train.total_tokens=100]\n", "use budget.max_steps"),
    ("budget: {match: wall}\n", "budget.match must be steps or time, got 'wall'"),
    ("budget: {max_step: 10}\n", "unknown budget key 'max_step'"),
    ("budget: {max_steps: 1.5}\n", "budget.max_steps must be a whole number"),
    ("budget: {max_steps: 0}\n", "budget.max_steps must be a whole number"),
    ("budget: {run_s: 0}\n", "budget.run_s must be a number of seconds, more than 0"),
    ("budget: [1]\n", "'budget' must be a mapping"),
])
def test_seed_and_budget_mistakes_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(NatslError, match=message) as err:
        S.load_spec(_spec(tmp_path, "lrs: [0.001]\n" + text), tmp_path / "out")
    assert "\n" not in str(err.value)


def test_sweep_spec_error_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "natsl.training.sweep", str(_spec(tmp_path, "lrs: [0.001]\nseeds: [x]\n")),
                           "--out", str(tmp_path / "out"), "--no-progress"], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "'seeds' holds 'x'" in proc.stderr


@pytest.mark.parametrize("budget, match", [
    ("{max_steps: 10, run_s: 60}", "steps"), ("{run_s: 60}", "time"), ("{}", "steps"),
    ("{max_steps: 10, run_s: 60, match: time}", "time"), ("{run_s: 60, match: steps}", "steps")])
def test_match_defaults_to_steps_when_the_budget_gives_max_steps(tmp_path, budget, match):
    sweep = S.load_spec(_spec(tmp_path, f"lrs: [0.001]\nbudget: {budget}\n"), tmp_path / "out")
    assert sweep.match == match and {r.match for r in sweep.runs} == {match}


def test_shipped_h200_specs_keep_their_wall_clock_runs(tmp_path):
    """The specs behind docs/recall.md's results say match: time; sweep_cpu.yaml's runs are matched in steps."""
    for name in ("sweep_h200", "sweep_h200_ablations", "sweep_h200_widths", "sweep_h200_baselines", "sweep_h200_seeds",
                 "sweep_h200_long"):
        assert S.load_spec(ROOT / f"recipes/recall/{name}.yaml", tmp_path / name).match == "time"
    assert S.load_spec(ROOT / "recipes/recall/sweep_cpu.yaml", tmp_path / "cpu").match == "steps"


def test_every_shipped_spec_loads(tmp_path):
    """Every sweep spec under recipes/recall loads, and so passes the step rule a worker would fail
    on (sweep_h200_long.yaml once set 16384 tokens a step at a micro-batch of 64 x 2048: all 8 runs failed)."""
    specs = sorted((ROOT / "recipes/recall").glob("sweep_*.yaml"))
    assert len(specs) >= 8
    systems = {}
    for spec in specs:
        runs = S.load_spec(spec, tmp_path / spec.stem).runs
        assert runs, spec.name
        for run in runs:
            assert Path(run.recipe).is_file(), (spec.name, run.id)
            systems.setdefault(run.system, set()).add(Path(run.recipe).name)
    # the variants of docs/recall.md's results keep their system names (and so their run ids), as
    # natsl_hybrid.yaml with a `set:` of their own rather than a recipe file each
    for variant in ("balance", "noise", "rope", "full", "target", "target25", "budget", "budget_sink", "budget25_sink"):
        assert systems[f"natsl_hybrid_{variant}"] == {"natsl_hybrid.yaml"}, variant


def test_a_step_that_is_no_whole_number_of_micro_batches_fails_at_load(tmp_path):
    spec = _spec(tmp_path, "lrs: [0.001]\nset: [train.tokens_per_step=192]\n")
    with pytest.raises(NatslError, match="not a multiple of micro_batch_size"):
        S.load_spec(spec, tmp_path / "out")


def _result(sweep, run_id: str, **fields) -> None:
    run = next(r for r in sweep.runs if r.id == run_id)
    S._write_json(Path(run.out) / "result.json", {"max_steps": run.max_steps, **fields})


def _done(accuracy: float, steps: int = 8, keep=None) -> dict:
    return {"status": "done", "steps": steps, "recall_accuracy": accuracy, "val_accuracy": accuracy / 2,
            "keep_fraction": keep, "parameters": 1000}


def _gpu_sh_printer() -> str:
    text = (ROOT / "benchmarks/gpu.sh").read_text()
    return re.search(r"<<'PY'\n(.*?)\nPY\n", text, re.S).group(1)


def test_summary_mean_min_max_lr_by_mean_missing_seeds_and_short(tmp_path):
    """The best learning rate per point is the one with the best MEAN over seeds (not the best single
    run); seeds not finished are missing (not zero) and counted; rates with a finished seed come before
    rates known only by validation accuracy; a point with no finished seed is ranked by validation;
    a run matched in steps that stopped before max_steps is `short` (with its steps)."""
    spec = _spec(tmp_path, "widths: [64, 128]\nlrs: [0.001, 0.003]\nseeds: [0, 1, 2]\n"
                           "budget: {max_steps: 8, run_s: 60}\n")
    sweep = S.load_spec(spec, tmp_path / "out")
    assert sweep.match == "steps"
    # gdn d64: 1e-3 has the best single run (0.9) but the worse mean (0.4); 3e-3's mean is 0.6.
    for seed, acc in zip(("", "-s1", "-s2"), (0.9, 0.1, 0.2)):
        _result(sweep, f"t-gdn-d64-lr0.001{seed}", **_done(acc))
    for seed, acc, steps in zip(("", "-s1", "-s2"), (0.5, 0.6, 0.7), (8, 5, 8)):
        _result(sweep, f"t-gdn-d64-lr0.003{seed}", **_done(acc, steps))
    # natsl_hybrid d64: at 1e-3 one seed done (0.8), one never ran, one cut off in training (validation
    # 0.0, in metrics.jsonl); at 3e-3 none finished, validation 0.95: 1e-3 wins with the mean of one seed.
    _result(sweep, "t-natsl_hybrid-d64-lr0.001", **_done(0.8, keep=0.5))
    cut = Path(next(r.out for r in sweep.runs if r.id == "t-natsl_hybrid-d64-lr0.001-s2")) / "train"
    cut.mkdir(parents=True)
    (cut / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 2.0}) + "\n"
                                       + json.dumps({"step": 3, "val_accuracy": 0.0}) + "\n")
    for seed in ("", "-s1", "-s2"):
        _result(sweep, f"t-natsl_hybrid-d64-lr0.003{seed}", status="evaluation cut off (deadline)", steps=8,
                val_accuracy=0.95, recall_accuracy=None, partial_recall_accuracy=0.9)
    # gdn d128: nothing finished anywhere: ranked by validation accuracy (seed 0 of 3e-3 only)
    _result(sweep, "t-gdn-d128-lr0.003", status="trained", steps=8, val_accuracy=0.3, recall_accuracy=None)

    summary = S.write_summary(sweep)
    assert summary["match"] == "steps" and summary["seeds"] == [0, 1, 2]
    best = {(p["system"], p["width"]): p for p in summary["best"]}
    assert set(best) == {("gdn", 64), ("natsl_hybrid", 64), ("gdn", 128)}  # natsl_hybrid d128: nothing yet

    gdn = best["gdn", 64]
    assert gdn["best_lr"] == 3e-3 and gdn["accuracy"] == pytest.approx(0.6)
    assert (gdn["accuracy_min"], gdn["accuracy_max"]) == (0.5, 0.7) and gdn["recall_accuracy"] == pytest.approx(0.6)
    assert [s["accuracy"] for s in gdn["seeds"]] == [0.5, 0.6, 0.7] and [s["seed"] for s in gdn["seeds"]] == [0, 1, 2]
    assert (gdn["seeds_finished"], gdn["seeds_total"], gdn["accuracy_from"]) == (3, 3, "recall")
    assert gdn["short"] == 1 and [(s["seed"], s["steps"]) for s in gdn["seeds"] if s["short"]] == [(1, 5)]
    assert gdn["run"] == "t-gdn-d64-lr0.003" and gdn["val_accuracy"] == pytest.approx(0.3)

    hybrid = best["natsl_hybrid", 64]
    assert hybrid["best_lr"] == 1e-3 and hybrid["accuracy"] == 0.8  # not (0.8 + 0 + 0) / 3
    assert (hybrid["seeds_finished"], hybrid["seeds_total"]) == (1, 3) and hybrid["keep_fraction"] == 0.5
    assert [(s["accuracy"], s["status"]) for s in hybrid["seeds"]] == [
        (0.8, "done"), (None, "not run"), (None, "cut off")]
    assert hybrid["short"] == 0  # the cut-off seed is short but not counted

    fallback = best["gdn", 128]
    assert fallback["accuracy_from"] == "validation" and fallback["accuracy"] == 0.3
    assert fallback["recall_accuracy"] is None and fallback["seeds_finished"] == 0 and fallback["best_lr"] == 3e-3

    runs = {r["id"]: r for r in summary["runs"]}
    assert runs["t-gdn-d64-lr0.003-s1"]["short"] and not runs["t-gdn-d64-lr0.003"]["short"]
    assert runs["t-natsl_hybrid-d64-lr0.001-s2"]["short"]  # cut off after 3 of 8 steps
    assert not runs["t-natsl_hybrid-d64-lr0.001-s1"]["short"]  # never ran: no steps to compare
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["best"] == summary["best"]
    assert (tmp_path / "out" / "summary.png").stat().st_size > 1000

    # benchmarks/gpu.sh's printer reads these fields
    printed = subprocess.run([sys.executable, "-c", _gpu_sh_printer(), str(tmp_path / "out" / "summary.json")],
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    line = next(x for x in printed.stdout.splitlines() if " gdn d=64 " in re.sub(" +", " ", x))
    assert "lr=0.003 accuracy 0.600 [0.500-0.700], 3/3 seeds finished" in line
    assert "SHORT: 1 seed(s) stopped at [5] steps" in line


def test_time_matched_runs_are_never_short(tmp_path):
    sweep = S.load_spec(_spec(tmp_path, "lrs: [0.001]\nbudget: {max_steps: 8, run_s: 60, match: time}\n"),
                        tmp_path / "out")
    _result(sweep, "t-gdn-d64-lr0.001", **_done(0.5, steps=3))
    summary = S.write_summary(sweep)
    assert not summary["runs"][0]["short"] and summary["best"][0]["short"] == 0 and summary["match"] == "time"


def _fake_runs(tmp_path, count: int, device: str) -> list:
    return [S.RunSpec(f"r{i}", "fake", "none", 32, 1e-3, "t", "task:none", [], 1, 60.0, {}, False, device,
                      str(tmp_path / "out" / "runs" / f"r{i}")) for i in range(count)]


def test_crowded_gpu_warning(tmp_path):
    """More than 16 workers at once on one GPU: a one-line warning; not for 16, nor on the CPU, nor
    spread over two GPUs, nor when --max-parallel keeps them to 16."""
    def warn(runs, parallel, match="steps"):
        return S.crowding_warning(S.Sweep("x", runs, parallel, None, 0.0, tmp_path, match=match), runs)

    message = warn(_fake_runs(tmp_path, 17, "cuda"), 28)
    assert message.startswith("warning: 17 workers share one GPU") and "\n" not in message and "short" in message
    assert "fewer steps" in warn(_fake_runs(tmp_path, 30, "cuda"), 28, "time")
    assert warn(_fake_runs(tmp_path, 16, "cuda"), 28) is None
    assert warn(_fake_runs(tmp_path, 30, "cuda"), 16) is None
    assert warn(_fake_runs(tmp_path, 30, "cpu"), 30) is None
    two = _fake_runs(tmp_path, 30, "cuda:0")
    for run in two[15:]:
        run.device = "cuda:1"
    assert warn(two, 30) is None


def test_runner_prints_the_runs_and_max_parallel_at_start(tmp_path, monkeypatch):
    """The start line counts the runs (done already, to run) and says --max-parallel and the matching."""
    worker = tmp_path / "worker.sh"
    worker.write_text('#!/bin/sh\nprintf \'{"status": "done", "steps": 1, "recall_accuracy": 0.5}\' '
                      '> "$(dirname "$1")/result.json"\n')
    monkeypatch.setattr(S, "WORKER", ["/bin/sh", str(worker)])
    runs = _fake_runs(tmp_path, 3, "cpu")
    S._write_json(Path(runs[0].out) / "result.json", {"status": "done", "steps": 1, "recall_accuracy": 0.25})
    logged = []
    summary = S.run_sweep(S.Sweep("fake", runs, 2, None, 0.0, tmp_path / "out", min_train_s=0.0), progress=False,
                          log=logged.append)
    assert logged[0] == "sweep fake: 3 runs (1 done already, 2 to run), at most 2 at once, matched in steps"
    assert not any(line.startswith("warning") for line in logged)
    assert [r["status"] for r in summary["runs"]] == ["done"] * 3


def test_gpu_sh_packs_the_chosen_models_in_tarballs_of_at_most_15_mb(tmp_path):
    """benchmarks/gpu.sh's pack_models: the RUN/model folders whose run id matches RECALL_MODELS, grouped
    into OUT/recall_models_N.tar.gz of at most ~15 MB of files each (small enough to copy off a remote machine one by one)."""
    text = (ROOT / "benchmarks/gpu.sh").read_text()
    function = re.search(r"^pack_models\(\) \{.*?^\}$", text, re.S | re.M).group(0)
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    for run in ("t-a-d128-lr0.001", "t-b-d128-lr0.001", "t-a-d128-lr0.001-s1", "t-c-d128-lr0.001"):
        model = work / "sweep_x" / "runs" / run / "model"
        model.mkdir(parents=True)
        (model / "model.safetensors").write_bytes(os.urandom(6_000_000))
    (work / "sweep_x" / "runs" / "t-d-d128-lr0.001").mkdir()  # a run that exported no model: skipped
    script = f"{function}\nOUT={out}\nRECALL_MODELS='-lr[^-]*$' pack_models {work}\n"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tarballs = sorted(out.iterdir())
    assert [p.name for p in tarballs] == ["recall_models_0.tar.gz", "recall_models_1.tar.gz"]
    members = []
    for path in tarballs:
        assert path.stat().st_size < 15_500_000
        with tarfile.open(path) as tar:
            members += [m.name for m in tar.getmembers() if m.name.endswith(".safetensors")]
    assert sorted(members) == [f"t-{s}-d128-lr0.001/model/model.safetensors" for s in "abc"]


VARIANT = ("systems:\n  natsl_hybrid: recall/natsl_hybrid\n"
           "  natsl_hybrid_target: {recipe: recall/natsl_hybrid, set: [model.router_keep_target=0.5, train.log_every=7]}\n"
           "widths: [64]\ntasks: {t: 'task:mqar?seq_len=64&pairs=4'}\nlrs: [0.001]\nbudget: {max_steps: 8}\n"
           "set: [train.log_every=3, model.router_bias_rate=0.002]\n")


def test_a_systems_own_set_comes_after_the_spec_set_and_is_recorded(tmp_path, monkeypatch):
    """`systems: {NAME: {recipe: FILE, set: [...]}}`: that system's items follow the spec's `set:` (so they win),
    reach the config the worker builds (its recipe file plus run.json's overrides), are recorded in run.json
    and sweep.json with the other overrides, and leave the run id as it was (TASK-SYSTEM-dWIDTH-lrLR)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(VARIANT)
    sweep = S.load_spec(spec, tmp_path / "out")
    plain, variant = sweep.runs
    assert (plain.id, variant.id) == ("t-natsl_hybrid-d64-lr0.001", "t-natsl_hybrid_target-d64-lr0.001")
    assert plain.recipe == variant.recipe
    spec_set = ["train.log_every=3", "model.router_bias_rate=0.002"]
    own = ["model.router_keep_target=0.5", "train.log_every=7"]
    assert variant.overrides[-2 - len(own) - len(spec_set):-2] == spec_set + own  # then the runner's last two
    assert not set(own) & set(plain.overrides) and set(spec_set) <= set(plain.overrides)

    def config(run):  # what the worker trains (natsl.cli.sweep)
        return apply_overrides(load_recipe(run.recipe), run.overrides)

    assert (config(plain).model.router_keep_target, config(plain).train.log_every) == (None, 3)
    target = config(variant)
    assert (target.model.router_keep_target, target.model.router_bias_rate, target.train.log_every) == (0.5, 0.002, 7)
    assert target.model.hidden_size == 64 and target.train.seed == 0

    worker = tmp_path / "worker.sh"
    worker.write_text('#!/bin/sh\nprintf \'{"status": "done", "steps": 8, "recall_accuracy": 0.5}\' '
                      '> "$(dirname "$1")/result.json"\n')
    monkeypatch.setattr(S, "WORKER", ["/bin/sh", str(worker)])
    sweep.min_train_s = 0.0
    S.run_sweep(sweep, progress=False, log=lambda line: None)
    recorded = json.loads((tmp_path / "out" / "runs" / variant.id / "run.json").read_text())
    assert recorded["overrides"] == variant.overrides and recorded["recipe"] == variant.recipe
    whole = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert whole["runs"][1]["overrides"] == variant.overrides
    assert whole["spec"]["systems"]["natsl_hybrid_target"]["set"] == own


@pytest.mark.parametrize("entry, message", [
    ("{recipe: recall/natsl_hybrid, sets: [model.router_keep_target=0.5]}",
     "system 'v' has unknown key 'sets'; allowed: recipe, set, env"),
    ("{recipe: recall/natsl_hybrid, env: NATSL_CHECK_OPS=1}", r"system 'v''s 'env' is 'NATSL_CHECK_OPS=1'; write a mapping"),
    ("{recipe: recall/natsl_hybrid, env: {NATSL_CHECK_OPS: [1]}}",
     r"system 'v''s env variable 'NATSL_CHECK_OPS' has no plain value; write NATSL_CHECK_OPS: 1"),
    ("{set: [model.router_keep_target=0.5]}", r"system 'v' names no recipe file; write \{recipe: natsl_hybrid.yaml"),
    ("{recipe: [recall/natsl_hybrid]}", "system 'v' names no recipe file"),
    ("3", r"system 'v' is 3; give a recipe file, or \{recipe: FILE, set:"),
    ("{recipe: recall/natsl_hybrid, set: model.router_keep_target=0.5}", "system 'v''s 'set' must be a list"),
    ("{recipe: recall/natsl_hybrid, set: [model.router_keep_target]}",
     "system 'v''s 'set' item 'model.router_keep_target' is not of the form section.key=value"),
    ("{recipe: recall/natsl_hybrid, set: [train.seed=3]}",
     r"system 'v''s 'set' item 'train.seed=3': the runner sets train.seed for every run; use seeds"),
    ("{recipe: recall/natsl_hybrid, set: [model.router_keep_targt=0.5]}",
     r"run t-v-d64-lr0.001: .*router_keep_targt.* \(in the spec's `set:` or system 'v''s `set:`\)"),
    ("{recipe: recall/natsl_hybrid, set: [train.tokens_per_step=192]}",
     r"not a multiple of micro_batch_size.* \(in the spec's `set:` or system 'v''s `set:`\)"),
])
def test_system_mapping_mistakes_are_one_line_errors(tmp_path, entry, message):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"systems: {{gdn: recall/gdn, v: {entry}}}\nwidths: [64]\nlrs: [0.001]\n"
                    "tasks: {t: 'task:mqar?seq_len=64&pairs=4'}\n")
    with pytest.raises(NatslError, match=message) as err:
        S.load_spec(spec, tmp_path / "out")
    assert "\n" not in str(err.value) and str(err.value).startswith("sweep spec ")


def test_a_systems_env_reaches_its_workers_only_and_is_recorded(tmp_path, monkeypatch):
    """`systems: {NAME: {recipe: FILE, env: {VAR: value}}}`: the variables are set in that system's workers'
    environment (over the runner's own), not in another system's, and recorded in run.json; the run id is
    unchanged."""
    spec = tmp_path / "s.yaml"
    spec.write_text("systems:\n  gdn: recall/gdn\n  checked: {recipe: recall/gdn, env: {NATSL_CHECK_OPS: 1, "
                    "NATSL_FUSED_MIX: true}}\nwidths: [64]\ntasks: {t: 'task:mqar?seq_len=64&pairs=4'}\n"
                    "lrs: [0.001]\nbudget: {max_steps: 8}\n")
    sweep = S.load_spec(spec, tmp_path / "out")
    plain, checked = sweep.runs
    assert (plain.env, checked.env) == ({}, {"NATSL_CHECK_OPS": "1", "NATSL_FUSED_MIX": "1"})
    assert checked.id == "t-checked-d64-lr0.001" and checked.overrides == plain.overrides
    worker = tmp_path / "worker.sh"  # writes what it saw of the two variables into its result
    worker.write_text('#!/bin/sh\nprintf \'{"status": "done", "steps": 8, "recall_accuracy": 0.5, '
                      '"seen": "%s/%s"}\' "${NATSL_CHECK_OPS:-unset}" "${NATSL_FUSED_MIX:-unset}" '
                      '> "$(dirname "$1")/result.json"\n')
    monkeypatch.setattr(S, "WORKER", ["/bin/sh", str(worker)])
    monkeypatch.setenv("NATSL_FUSED_MIX", "runner")
    monkeypatch.delenv("NATSL_CHECK_OPS", raising=False)
    sweep.min_train_s = 0.0
    S.run_sweep(sweep, progress=False, log=lambda line: None)
    seen = {run.id: json.loads((Path(run.out) / "result.json").read_text())["seen"] for run in sweep.runs}
    assert seen == {plain.id: "unset/runner", checked.id: "1/1"}
    recorded = json.loads((Path(checked.out) / "run.json").read_text())
    assert recorded["env"] == {"NATSL_CHECK_OPS": "1", "NATSL_FUSED_MIX": "1"}


def test_the_spec_set_is_checked_as_a_systems_is(tmp_path):
    for text, message in (("set: train.log_every=5\n", "'set' must be a list such as"),
                          ("set: [train.log_every]\n", "'set' item 'train.log_every' is not of the form")):
        with pytest.raises(NatslError, match=message):
            S.load_spec(_spec(tmp_path, "lrs: [0.001]\n" + text), tmp_path / "out")


def test_a_missing_init_from_checkpoint_stops_the_runner_before_any_worker(tmp_path):
    """train.init_from in a system's set: checked when the runner starts (not at load: a spec loads where its
    checkpoints are not), one line naming the run; a model folder that is there passes."""
    import natsl
    from natsl.checkpoint import save_model_folder

    recipe = load_recipe("recall/gdn")
    save_model_folder(tmp_path / "ck", natsl.build_model(recipe), recipe)
    text = ("systems: {gdn: {recipe: recall/gdn, set: [train.init_from=" + str(tmp_path / "ck") + "]},\n"
            "          natsl_hybrid: {recipe: recall/natsl_hybrid, set: [train.init_from=" + str(tmp_path / "gone") + "]}}\n"
            "widths: [64]\ntasks: {t: 'task:mqar?seq_len=64&pairs=4'}\nlrs: [0.001]\nbudget: {max_steps: 8}\n")
    (tmp_path / "s.yaml").write_text(text)
    sweep = S.load_spec(tmp_path / "s.yaml", tmp_path / "out")  # loads: the check is the runner's
    with pytest.raises(NatslError, match=r"^run t-natsl_hybrid-d64-lr0.001: train.init_from '.*gone' is not a "
                                         r"checkpoint \(checkpoint '.*gone' does not exist.*\); put the checkpoints"):
        S.check_initial_weights(sweep)
    assert not (tmp_path / "out" / "runs").exists()
    sweep.runs = [r for r in sweep.runs if r.system == "gdn"]
    S.check_initial_weights(sweep)  # the folder that is there passes


def test_a_system_can_have_its_own_seeds(tmp_path):
    """`systems: {NAME: {recipe: ..., seeds: [...]}}`: that system runs its own seeds (the miniature's NAtS-L
    Hybrid over three seeds beside one seed of every other system); the others keep the spec's."""
    spec = _spec(tmp_path, "systems: {gdn: recall/gdn, natsl_hybrid: {recipe: recall/natsl_hybrid, seeds: [0, 1, 2]}}\n"
                           "lrs: [0.001]\nbudget: {max_steps: 5}\n")
    sweep = S.load_spec(spec, tmp_path / "out")
    assert [r.id for r in sweep.runs] == ["t-gdn-d64-lr0.001", "t-natsl_hybrid-d64-lr0.001",
                                         "t-natsl_hybrid-d64-lr0.001-s1", "t-natsl_hybrid-d64-lr0.001-s2"]
    for run in sweep.runs:
        assert apply_overrides(load_recipe(run.recipe), run.overrides).train.seed == run.seed
    with pytest.raises(NatslError, match="system 'natsl_hybrid''s 'seeds' holds -1"):
        S.load_spec(_spec(tmp_path, "systems: {natsl_hybrid: {recipe: recall/natsl_hybrid, seeds: [-1]}}\n"
                                    "lrs: [0.001]\n"), tmp_path / "out2")
