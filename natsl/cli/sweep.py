"""`natsl sweep SPEC --out OUT`: small-model sweeps in parallel processes (natsl.training.sweep), and
the worker one run is (`python -m natsl.cli.sweep RUN.json`): train, then evaluate recall (an MQAR task)
or record the trainer's validation loss (a language-model task: a natsl tokenize folder)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

import typer

from natsl.cli.app import command


@command("sweep")
def sweep(
    spec: str = typer.Argument(..., help="Sweep spec YAML (e.g. recipes/recall/sweep_h200.yaml)."),
    out: str = typer.Option(..., help="Folder for runs/, summary.json and summary.png."),
    max_parallel: Optional[int] = typer.Option(None, help="Worker processes at once (default: the spec's)."),
    deadline: Optional[float] = typer.Option(None, help="Seconds for the whole sweep (default: the spec's "
                                                        "budget.deadline_s); at it every worker is killed."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: the spec's, else cuda when there is one)."),
    mps: bool = typer.Option(False, help="Start the CUDA MPS daemon (nvidia-cuda-mps-control -d) while several "
                                         "workers share a GPU."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Train many small models (systems x widths x learning rates x tasks) in parallel; summary JSON + PNG."""
    from natsl.outputs import check_output
    from natsl.training.sweep import exit_code, load_spec, run_sweep

    check_output(out, [spec], "--out")
    code = exit_code(run_sweep(load_spec(spec, out, max_parallel, deadline, device), progress=progress, mps=mps))
    if code:
        raise typer.Exit(code)  # a run failed (1), or stopped by a signal (128 + its number), as the module entry point


def run_worker(run_file: str) -> int:
    """One run: train its recipe within its budget, write result.json, evaluate recall, write it again. A
    language-model run (`kind: lm`) is done after training: result.json holds its final validation loss
    (the trainer evaluates at its last step), perplexity, tokens trained, steps and wall time.
    SIGTERM / SIGINT (the runner stopping it) end training after the current step with a checkpoint and
    skip the evaluation; during the evaluation they end the worker at once. The evaluation starts no grid
    point after the sweep's deadline (`complete: false` then; such a run is ranked by validation accuracy)."""
    from natsl.cli.eval_recall import run_eval_recall
    from natsl.config import apply_overrides, load_recipe
    from natsl.provenance import provenance
    from natsl.training.sweep import _write_json
    from natsl.training.trainer import TrainOptions, train

    run = json.loads(Path(run_file).read_text(encoding="utf-8"))
    folder = Path(run["out"])
    recipe = apply_overrides(load_recipe(run["recipe"]), run["overrides"])
    started = time.time()
    stop_at = started + run["run_s"]
    if run.get("train_deadline"):
        stop_at = min(stop_at, run["train_deadline"])
    asked = {"stop": False, "signal": None}

    def on_step(record: dict) -> bool:
        # True: the trainer ends the run after this step with a checkpoint
        asked["stop"] = asked["stop"] or time.time() > stop_at
        return asked["stop"]

    def on_signal(name: str) -> None:
        asked["signal"] = asked["signal"] or name

    try:
        outcome = train(recipe, TrainOptions(out_dir=str(folder / "train"), device=run.get("device"),
                                             compile=run["compile"], max_steps=run["max_steps"], progress=False,
                                             on_step=on_step, on_signal=on_signal))
        steps, loss = outcome.step, outcome.loss
    except KeyboardInterrupt:  # stopped at the wall-clock budget or by a signal, checkpoint written
        steps, loss = None, None
    train_s = time.time() - started
    from natsl.files import read_json_records

    records = read_json_records(folder / "train" / "metrics.jsonl")
    step_records = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_accuracy" in r]
    from natsl.models import build_model

    result = {"status": "trained", "steps": steps or (step_records[-1]["step"] if step_records else 0),
              "max_steps": run["max_steps"], "stopped_by_budget": asked["stop"], "train_s": train_s,
              "loss": loss if loss is not None else (step_records[-1]["loss"] if step_records else None),
              "val_accuracy": evals[-1]["val_accuracy"] if evals else None,
              "parameters": build_model(recipe.model, device="meta").num_parameters(),
              "keep_groups_last_step": step_records[-1].get("keep_groups") if step_records else None,
              "recall_accuracy": None, "keep_fraction": None, "provenance": provenance()}
    lm = run.get("kind") == "lm"
    if lm:  # a language model: its evaluation is the trainer's validation loss (at its last step, too)
        from natsl.training.sweep_lm import validation_of

        result.update(validation_of(records, recipe.train.tokens_per_step),
                      tokens=result["steps"] * recipe.train.tokens_per_step)
        for key in ("recall_accuracy", "keep_fraction", "val_accuracy"):  # recall's, not measured here
            del result[key]
    if asked["signal"]:  # told to stop: no evaluation
        result["stopped_by_signal"] = asked["signal"]
        _write_json(folder / "result.json", result)
        print(f"{asked['signal']}: {run['id']} stopped after {result['steps']} steps, not evaluated")
        return 128 + signal.Signals[asked["signal"]]
    if lm:  # no export: an LR sweep's models are not evaluated further (the checkpoint stays in RUN/train)
        # matched in steps, a run its budget or the deadline stopped early is not done: the same sweep again
        # resumes it from the checkpoint it stopped with (its final evaluation comes at max_steps)
        early = run.get("match", "steps") == "steps" and result["steps"] < run["max_steps"]
        result.update(status="stopped early (run the sweep again to resume)" if early else "done",
                      total_s=time.time() - started)
        _write_json(folder / "result.json", result)
        print(f"{result['status']}: {run['id']} validation loss {result['val_loss']} after {result['steps']} steps")
        return 0
    _write_json(folder / "result.json", result)
    export_model(folder)
    for sig in (signal.SIGTERM, signal.SIGINT):  # from here on a stop request ends the worker at once
        signal.signal(sig, signal.SIG_DFL)
    ev = run["eval"]
    deadline = run.get("deadline")
    report = run_eval_recall(str(folder / "train"), None, ev.get("lengths"), ev.get("pairs"), int(ev["samples"]),
                             int(ev["batch_size"]), int(ev.get("seed", 0)), ev.get("vocab"), None,
                             str(folder / "eval"), run.get("device"), progress=False, quiet=True,
                             deadline=deadline - EVAL_MARGIN_S if deadline else None)
    points = [{k: p[k] for k in ("seq_len", "count", "accuracy")} for p in report["points"]]
    if report["complete"]:
        result.update(status="done", recall_accuracy=report["mean_accuracy"],
                      keep_fraction=report["mean_keep_fraction"])
    else:  # a mean over part of the grid would not compare with the others'
        result.update(status="evaluation cut off (deadline)", partial_recall_accuracy=report["mean_accuracy"])
    result.update(recall_points=points, total_s=time.time() - started)
    _write_json(folder / "result.json", result)
    print(f"{result['status']}: {run['id']} recall accuracy {report['mean_accuracy']} after {result['steps']} steps")
    return 0


def export_model(folder: Path) -> None:
    """The trained run as a bf16 inference folder, `RUN/model` (weights, config; a few MB at the recall
    widths), which `natsl compare` and every eval command read: the training checkpoint beside it holds
    fp32 weights and the optimizer state, ~6x the bytes, too much to copy off a GPU machine by the
    dozen. Before the evaluation, so a run whose evaluation the deadline cuts still leaves its model."""
    import torch

    from natsl.eval.convert import convert_checkpoint

    convert_checkpoint(folder / "train", folder / "model", torch.bfloat16)


EVAL_MARGIN_S = 3.0  # the evaluation starts no point this close to the deadline: result.json is written first


def watch(run_file: str) -> None:
    """End this worker and everything it started (its process group) once the sweep's deadline has passed,
    or as soon as the runner that started it is gone: an orphan must not keep the GPU. Only for a worker
    that leads its own process group, as the runner starts it."""
    deadline = json.loads(Path(run_file).read_text(encoding="utf-8")).get("deadline")
    parent = os.getppid()
    if os.getpgid(0) != os.getpid():
        return

    def loop() -> None:
        while os.getppid() == parent and (deadline is None or time.time() < deadline):
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=loop, name="sweep-watchdog", daemon=True).start()

def _record_failure(run_file: str, error: BaseException) -> None:
    """Keep what the run had (result.json of its training, if any) and say why it stopped."""
    from natsl.training.sweep import _read_json, _write_json

    folder = Path(json.loads(Path(run_file).read_text(encoding="utf-8"))["out"])
    result = _read_json(folder / "result.json") or {}
    result.update(status="failed", error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    _write_json(folder / "result.json", result)


if __name__ == "__main__":
    try:
        watch(sys.argv[1])
        sys.exit(run_worker(sys.argv[1]))
    except Exception as err:
        traceback.print_exc()
        _record_failure(sys.argv[1], err)
        sys.exit(1)
