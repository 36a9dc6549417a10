"""`natsl train RECIPE`: train (or continue training) the model a recipe describes.

Runs on one device, or on several under torchrun (`torchrun --nproc_per_node 8 -m natsl.cli.main
train RECIPE`). Checkpoints go to OUT/checkpoints/step_NNNNNN, metrics to OUT/metrics.jsonl and
OUT/metrics.png; see docs/training.md.
"""

from __future__ import annotations

import os
from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option
from natsl.cli.jobs import force_option


@command("train", stop_soon=True)
def train(
    recipe: str = typer.Argument(..., help="Recipe YAML file or the name of a shipped recipe (e.g. tiny_hybrid, recall/gdn)."),
    more: Optional[List[str]] = typer.Argument(None, metavar="[KEY=VALUE]...",
                                               help="More overrides, so that `--set a=1 b=2` works."),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="SECTION.KEY=VALUE",
                                             help="Override a recipe value, e.g. --set optim.lr=1e-3 (repeatable)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Stop at this (absolute) step."),
    resume: str = typer.Option("auto", "--resume",
                               help="auto: continue from the newest complete checkpoint in OUT; never: start "
                                    "fresh (refused if OUT has checkpoints); or a step folder to continue from."),
    out: Optional[str] = typer.Option(None, "--out", help="Output folder (default: train.out_dir, runs/{name})."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda if there is one)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on CPU)."),
    compile_: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the model "
                                            "(default: train.compile; on one GPU a small model, natsl.training.trainer.auto_compile, "
                                            "compiles with CUDA-graphed steps unless the recipe sets either)."),
    threads: Optional[int] = threads_option(),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
    force: bool = force_option(),
) -> None:
    """Train from a recipe: AdamW, warmup + cosine, checkpoints you can resume, metrics.jsonl + metrics.png.

    A run the estimate calls long or large says so first; one the device's memory cannot hold is refused
    (--force starts it anyway). The first Ctrl-C stops within about two seconds: after the step in
    progress with its checkpoint when that step ends in time, else at once keeping the newest checkpoint
    (exit code 130)."""
    from natsl.runtime import pick_backend, pick_device
    from natsl.config import apply_overrides, load_recipe
    from natsl.errors import NatslError
    from natsl.training import TrainOptions, train as run_training
    from natsl.training.trainer import check_before_work
    from natsl.training.distributed import launched_by_torchrun
    from natsl.cli.jobs import check_training
    from pathlib import Path

    from natsl.data.tasks import is_task
    from natsl.training.trainer import missing_data

    overrides = list(set_ or [])
    for item in more or []:
        if "=" not in item:
            raise NatslError(f"unexpected argument {item!r}: overrides look like section.key=value")
        overrides.append(item)
    given: dict[str, str] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if given.setdefault(key.strip(), value) != value:
            raise NatslError(f"override '{key.strip()}' is given twice with different values; give it once")
    if max_steps is not None and max_steps < 1:  # before the estimate's lines, as every bad input
        raise NatslError(f"--max-steps must be at least 1, got {max_steps}")
    rec = load_recipe(recipe, require=("model", "train"))  # no silent 800M defaults
    if overrides:
        rec = apply_overrides(rec, overrides)
    pick_backend(backend, pick_device(device))  # reject a bad --device / --backend before any work
    if resume not in ("auto", "never") and not resume.strip():
        raise NatslError("--resume takes auto, never or a checkpoint folder")
    if not (is_task(rec.data.path) or rec.data.path == "builtin" or Path(rec.data.path).exists()):
        raise missing_data(rec)  # bad input before the estimate's lines
    options = TrainOptions(out_dir=out, resume=resume, device=device, backend=backend, compile=compile_,
                           max_steps=max_steps, threads=threads, progress=progress)
    check_before_work(rec, options, recipe if Path(recipe).is_file() else None)  # its one line alone, before the estimate's
    check_training(rec, device=device, backend=backend, threads=threads, max_steps=max_steps, force=force)
    result = run_training(rec, options)
    if launched_by_torchrun() and int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 reports
    loss = f"{result.loss:.4f}" if result.loss is not None else "n/a"
    val = f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else ""
    skipped = f", {result.skipped_steps} skipped step(s)" if result.skipped_steps else ""
    metrics = " and ".join(str(p) for p in (result.out_dir / "metrics.jsonl", result.out_dir / "metrics.png")
                           if p.is_file())
    print(f"done: step {result.step}/{result.end_step}, loss {loss}{val}{skipped}"
          f"{f'; checkpoint {result.checkpoint}' if result.checkpoint else ''}{f'; metrics {metrics}' if metrics else ''}")
