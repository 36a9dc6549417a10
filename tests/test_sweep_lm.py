"""The sweep's language-model mode: a task that is a `natsl tokenize` folder trains each recipe at its own
context, step size and width, is evaluated by its validation loss, and the summary ranks each system's
learning rates by the lowest final validation loss (recipes/mini/sweep_cpu.yaml end to end on the CPU;
the ranking with fake results)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import natsl.training.sweep as S
from natsl.training.sweep_lm import best_lm_points, validation_of

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the router keeps a block when its mixing weight says the softmax memory is worth the bytes "
         "gated delta rules forget what the gate lets go and write what the key brings in").split()


def _text_folder(folder: Path, docs: int = 24) -> Path:
    """A few KB of plain text, one document a file, deterministic."""
    folder.mkdir(parents=True)
    for d in range(docs):
        words = [WORDS[(d * 7 + i * (d % 5 + 1)) % len(WORDS)] for i in range(60)]
        (folder / f"doc{d:02d}.txt").write_text(" ".join(words) + ".\n")
    return folder


def _tokenize(texts: Path, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "natsl.cli.main", "tokenize", str(texts), "--out", str(out),
                           "--train-tokenizer", "--vocab-size", "300", "--val-fraction", "0.25", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=3000)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _cpu_spec(tmp_path: Path) -> Path:
    """recipes/mini/sweep_cpu.yaml with its recipes named as shipped recipes (mini/gdn, ...)."""
    data = yaml.safe_load((ROOT / "recipes/mini/sweep_cpu.yaml").read_text())
    for name, value in data["systems"].items():
        if isinstance(value, dict):
            value["recipe"] = f"mini/{Path(value['recipe']).stem}"
        else:
            data["systems"][name] = f"mini/{Path(value).stem}"
    spec = tmp_path / "sweep_cpu.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> Path:
    """A `natsl tokenize` folder of the toy text, 300-token BPE."""
    root = tmp_path_factory.mktemp("toy")
    _tokenize(_text_folder(root / "texts"), root / "toy_lm")
    return root / "toy_lm"


def test_lm_sweep_trains_ranks_by_validation_loss_and_plots(tmp_path, toy_data):
    """2 systems x 2 learning rates, 4 steps each, on a tokenized toy corpus: every run records its final
    validation loss (at its last step), perplexity, tokens and steps; the best rate of each system is the
    one with the lowest loss; summary.json and summary.png are written."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "toy_lm").symlink_to(toy_data)
    spec = _cpu_spec(tmp_path)
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "natsl.training.sweep", str(spec), "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, cwd=tmp_path,  # data/toy_lm: from the working folder
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 4 and {r["status"] for r in summary["runs"]} == {"done"}
    for run in summary["runs"]:
        result = json.loads((out / "runs" / run["id"] / "result.json").read_text())
        records = [json.loads(line) for line in (out / "runs" / run["id"] / "train" / "metrics.jsonl").open()]
        evaluated = [r for r in records if "val_loss" in r]
        assert evaluated[-1]["step"] == 4  # the final evaluation, at the run's last step
        assert result["steps"] == 4 and result["tokens"] == 4 * 256
        assert result["val_loss"] == evaluated[-1]["val_loss"] and math.isfinite(result["val_loss"])
        assert result["perplexity"] == pytest.approx(math.exp(result["val_loss"]))
        assert result["val_curve"][-1] == [4 * 256, result["val_loss"]]
        assert result["train_s"] >= 0 and "recall_accuracy" not in result
        assert not (out / "runs" / run["id"] / "eval").exists()  # no eval-recall
        run_recipe = json.loads((out / "runs" / run["id"] / "run.json").read_text())
        # the spec's own step size only (the runner adds none for a language-model task)
        assert run_recipe["kind"] == "lm" and sum(o.startswith("train.tokens_per_step=") for o in run_recipe["overrides"]) == 1
    assert summary["best"] == [] and {p["system"] for p in summary["best_lm"]} == {"gdn", "natsl_hybrid"}
    for point in summary["best_lm"]:
        mine = {r["lr"]: r["val_loss"] for r in summary["runs"] if r["system"] == point["system"]}
        assert len(mine) == 2 and point["best_lr"] == min(mine, key=mine.get)
        assert point["val_loss"] == min(mine.values()) and point["width"] == 32
        assert [q["lr"] for q in point["ranking"]] == sorted(mine, key=mine.get)
    assert (out / "summary.png").stat().st_size > 1000


def _record(system, lr, loss, seed=0, status="done", task="t", width=256):
    return {"id": f"{task}-{system}-d{width}-lr{lr:g}" + (f"-s{seed}" if seed else ""), "task": task, "system": system,
            "width": width, "lr": lr, "seed": seed, "status": status, "val_loss": loss, "short": False,
            "steps": 10, "kind": "lm", "val_curve": [[100, loss + 1], [200, loss]] if loss is not None else []}


def test_ranking_takes_the_lowest_mean_validation_loss_over_seeds():
    """Lower loss wins; the mean over seeds decides, not one lucky seed; each system apart."""
    records = [_record("a", 1e-3, 3.0), _record("a", 1e-3, 3.0, seed=1),
               _record("a", 4e-3, 2.0), _record("a", 4e-3, 4.2, seed=1),  # mean 3.1: worse than 3.0
               _record("b", 1e-3, 5.0), _record("b", 2e-3, 4.0), _record("b", 8e-3, 4.5)]
    points = {p["system"]: p for p in best_lm_points(records)}
    assert points["a"]["best_lr"] == 1e-3 and points["a"]["val_loss"] == 3.0
    assert points["a"]["val_loss_min"] == points["a"]["val_loss_max"] == 3.0 and points["a"]["seeds_total"] == 2
    assert [q["lr"] for q in points["a"]["ranking"]] == [1e-3, 4e-3]
    assert points["a"]["ranking"][1]["val_loss"] == pytest.approx(3.1)
    assert points["b"]["best_lr"] == 2e-3 and [q["lr"] for q in points["b"]["ranking"]] == [2e-3, 8e-3, 1e-3]
    assert points["b"]["perplexity"] == pytest.approx(math.exp(4.0))
    assert points["b"]["val_curve"] == [[100, 5.0], [200, 4.0]]


def test_ranking_prefers_finished_runs_and_skips_missing_and_nonfinite_losses():
    """A rate whose runs finished ranks before one known only from a cut-off run's last evaluation; a seed
    with no loss is left out of the mean, not counted; a rate with no finite loss is not ranked."""
    records = [_record("a", 1e-3, 3.0), _record("a", 2e-3, 1.0, status="cut off"),
               _record("a", 4e-3, 2.5), _record("a", 4e-3, None, seed=1, status="not run"),
               _record("a", 8e-3, float("nan"))]
    point = best_lm_points(records)[0]
    assert point["best_lr"] == 4e-3 and point["val_loss"] == 2.5 and point["seeds_finished"] == 1
    assert [(q["lr"], q["loss_from"]) for q in point["ranking"]] == [
        (4e-3, "final"), (1e-3, "final"), (2e-3, "last evaluation")]
    assert best_lm_points([_record("a", 1e-3, None, status="not run")]) == []


def test_ranking_ties_go_to_the_rate_listed_first():
    records = [_record("a", 4e-3, 2.0), _record("a", 1e-3, 2.0)]
    assert best_lm_points(records)[0]["best_lr"] == 4e-3


def test_validation_of_reads_the_last_loss_and_the_curve():
    records = [{"step": 1, "loss": 6.0}, {"step": 2, "val_loss": 5.5}, {"step": 4, "val_loss": 5.0},
               {"step": 4, "val_loss": float("inf")}]
    got = validation_of(records, 256)
    assert got["val_loss"] == 5.0 and got["val_curve"] == [[512, 5.5], [1024, 5.0]]
    assert got["perplexity"] == pytest.approx(math.exp(5.0))
    assert validation_of([{"step": 1, "loss": 6.0}], 256) == {"val_loss": None, "perplexity": None, "val_curve": []}


def test_lm_runs_keep_their_recipe_and_the_budget_counts_tokens(tmp_path):
    """A language-model task: the recipe's own seq_len, tokens_per_step and micro-batch (accumulation as it
    says), its own width when `widths` is left out; budget.max_tokens sets max_steps and the schedule's end."""
    from natsl.config import apply_overrides, load_recipe

    spec = tmp_path / "s.yaml"
    spec.write_text("systems: {gdn: mini/gdn, hybrid: mini/natsl_hybrid}\nlrs: {gdn: [0.001, 0.002], hybrid: [0.004]}\n"
                    "tasks: {mini: data/mini}\nbudget: {max_tokens: 20000000}\nset: [train.micro_batch_size=8]\n")
    sweep = S.load_spec(spec, tmp_path / "out", device="cpu")
    assert [r.id for r in sweep.runs] == ["mini-gdn-d256-lr0.001", "mini-hybrid-d256-lr0.004", "mini-gdn-d256-lr0.002"]
    assert sweep.match == "steps"
    for run in sweep.runs:
        recipe = apply_overrides(load_recipe(run.recipe), run.overrides)
        assert run.kind == "lm" and run.max_steps == 20_000_000 // 65536 and run.eval == {}
        assert recipe.train.seq_len == 2048 and recipe.train.tokens_per_step == 65536
        assert recipe.train.micro_batch_size == 8 and recipe.train.accumulation() == 4
        assert recipe.train.total_tokens == 65536 * run.max_steps and recipe.model.hidden_size == 256
        assert recipe.data.path == "data/mini" and recipe.optim.lr == run.lr
    # the shipped GPU spec: 24 runs, all at once, 20M tokens each
    mini = S.load_spec(ROOT / "recipes/mini/sweep.yaml", tmp_path / "mini", device="cpu")
    assert len(mini.runs) == 24 == mini.max_parallel and {r.max_steps for r in mini.runs} == {305}
    assert {r.system for r in mini.runs} == {"gdn", "mamba2", "transformer", "gdn_hybrid", "natsl", "natsl_hybrid"}


def test_lm_summary_writes_the_figure_from_fake_results(tmp_path, monkeypatch):
    """write_summary on result.json files written here: best_lm in summary.json, and summary.png."""
    spec = tmp_path / "s.yaml"
    spec.write_text("systems: {gdn: mini/gdn, hybrid: mini/natsl_hybrid}\nlrs: [0.001, 0.004]\n"
                    "tasks: {mini: data/mini}\nbudget: {max_steps: 10}\n")
    sweep = S.load_spec(spec, tmp_path / "out", device="cpu")
    losses = {"mini-gdn-d256-lr0.001": 4.0, "mini-gdn-d256-lr0.004": 3.5, "mini-hybrid-d256-lr0.001": 3.0,
              "mini-hybrid-d256-lr0.004": 3.2}
    for run in sweep.runs:
        loss = losses[run.id]
        S._write_json(Path(run.out) / "result.json", {"status": "done", "steps": 10, "val_loss": loss,
                                                      "val_curve": [[65536 * 5, loss + 1], [65536 * 10, loss]]})
    summary = S.write_summary(sweep)
    assert {p["system"]: p["best_lr"] for p in summary["best_lm"]} == {"gdn": 0.004, "hybrid": 0.001}
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["best_lm"] == json.loads(
        json.dumps(summary["best_lm"]))
    assert (tmp_path / "out" / "summary.png").stat().st_size > 1000


def test_an_lm_run_stopped_early_is_not_done_and_resumes(tmp_path, toy_data, monkeypatch):
    """Matched in steps, a language-model run that its budget stops before max_steps is not `done` (the same
    sweep again starts it), and its next worker resumes from the checkpoint it stopped with, ending with
    the final evaluation at max_steps."""
    from dataclasses import asdict

    from natsl.cli.sweep import run_worker

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "toy_lm").symlink_to(toy_data)
    run = S.load_spec(_cpu_spec(tmp_path), tmp_path / "out").runs[0]
    run_file = tmp_path / "run.json"
    run.run_s = 1e-9  # stops after its first step, whatever the machine's speed
    S._write_json(run_file, asdict(run))
    assert run_worker(str(run_file)) == 0
    first = json.loads((Path(run.out) / "result.json").read_text())
    assert first["steps"] == 1 < run.max_steps and first["status"] != "done" and not S._finished(run)
    run.run_s = 1e9
    S._write_json(run_file, asdict(run))
    assert run_worker(str(run_file)) == 0
    second = json.loads((Path(run.out) / "result.json").read_text())
    assert second["status"] == "done" and second["steps"] == run.max_steps and S._finished(run)
    records = [json.loads(line) for line in (Path(run.out) / "train" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # resumed at step 2, not retrained
    assert second["val_curve"][-1][0] == run.max_steps * run.tokens_per_step
