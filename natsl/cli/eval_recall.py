"""`natsl eval-recall CHECKPOINT`: synthetic recall accuracy per (sequence length, pairs) and routing."""

from __future__ import annotations

from typing import Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads
from natsl.cli.jobs import force_option


def run_eval_recall(checkpoint: str, task: Optional[str] = None, lengths: Optional[str] = None,
                    pairs: Optional[str] = None, samples: int = 256, batch_size: int = 32, seed: int = 0,
                    vocab: Optional[int] = None, keep_fraction: Optional[float] = None, out: str = "eval_recall",
                    device=None, dtype=None, backend=None, progress: bool = True, quiet: bool = False,
                    deadline: Optional[float] = None, threads: Optional[int] = None, force: bool = False) -> dict:
    """The command's work (the sweep's workers call it too): returns the report written to recall.json.
    `deadline` (a time.time()): no grid point is started after it (the report's `complete` is then false).
    `force`: start even when the estimate says the device's memory cannot hold the evaluation."""
    from natsl.data.grid import check_vocab, parse_lengths, parse_pairs
    from natsl.errors import NatslError
    from natsl.atomic import write_json
    from natsl.eval.common import load_eval_model, prepare_out_dir
    from natsl.eval.recall import evaluate_recall, format_table, plot_recall, recall_grid
    from natsl.outputs import check_output
    from natsl.models.routing import force_keep_fraction
    from natsl.runtime import check_keeps_natsl, checkpoint_recipe_of
    from natsl.cli.jobs import check_job, held_bytes
    from natsl.estimate import Work
    from natsl.seeding import check_seed

    # every option before any work (the checkpoint is loaded after them)
    check_output(out, [checkpoint], "--out")
    if samples < 1 or batch_size < 1:
        raise NatslError(f"--samples and --batch-size must be at least 1, got {samples} and {batch_size}")
    if keep_fraction is not None and not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    check_seed(seed, "--seed")
    check_vocab(vocab)
    length_list = parse_lengths(lengths) if lengths else None
    count_list = parse_pairs(pairs) if pairs else None
    use_threads(threads, device, say=not quiet)
    if keep_fraction is not None:  # config.json only: refuse before loading
        folder, recipe = checkpoint_recipe_of(checkpoint)
        check_keeps_natsl(keep_fraction, recipe, folder)
    out_dir = prepare_out_dir(out)
    em = load_eval_model(checkpoint, device, dtype, backend)
    spec, points = recall_grid(em, task, length_list, count_list, vocab)
    force_keep_fraction(em.model, keep_fraction, seed)
    check_job(f"eval-recall: {len(points)} points x {samples} samples", em.recipe.model,
              [Work("forward", min(batch_size, samples), length, calls=-(-samples // batch_size)) for length, _ in points],
              device=em.device, dtype=em.dtype, backend=backend, force=force,
              fix="lower --batch-size or --lengths", held=held_bytes(em.model))
    report = evaluate_recall(em, spec, points, samples, batch_size, seed, progress=progress, deadline=deadline)
    report = {"checkpoint": str(em.folder), "name": em.name, "trained_on": em.recipe.data.path, "seed": seed,
              "forced_keep_fraction": keep_fraction, **report}
    json_path = write_json(out_dir / "recall.json", report)
    budget = f", kept fraction forced to {keep_fraction}" if keep_fraction is not None else ""
    if not report["points"]:  # the deadline came before the first point: nothing to show
        return report
    png_path = plot_recall(report, out_dir / "recall.png", f"{em.name}{budget}")
    if not quiet:
        print(format_table(report))
        print(f"mean accuracy {report['mean_accuracy']:.3f}")
        print(f"wrote {json_path} and {png_path}")
    return report


@command("eval-recall", stop_soon=True)
def eval_recall(
    checkpoint: str = typer.Argument(..., help="Checkpoint folder (or a training run folder: newest step)."),
    task: Optional[str] = typer.Option(None, help="mqar or passkey (default: the task the checkpoint trained on, else mqar)."),
    lengths: Optional[str] = typer.Option(None, help="Sequence lengths, comma separated (4k = 4096); default: "
                                                     "those of the checkpoint's training task."),
    pairs: Optional[str] = typer.Option(None, help="Key-value pairs (mqar) or digits (passkey), comma separated; "
                                                   "every fitting (length, pairs) of the grid is evaluated."),
    samples: int = typer.Option(256, help="Samples per (length, pairs) point."),
    batch_size: int = typer.Option(32, help="Samples per forward."),
    seed: int = typer.Option(0, help="Seed of the evaluation samples (same seed, same inputs)."),
    vocab: Optional[int] = typer.Option(None, help="Task vocabulary (default: the training task's, else the model's)."),
    keep_fraction: Optional[float] = typer.Option(None, help="Force NAtS-L layers to keep this fraction of blocks "
                                                             "(a fixed KV budget; default: the router decides)."),
    out: str = typer.Option("eval_recall", help="Folder for recall.json and recall.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    threads: Optional[int] = threads_option(),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
    force: bool = force_option(),
) -> None:
    """Answer accuracy on MQAR (Zoology) or passkey per (length, pairs), with the kept fraction per layer and group.

    A run the estimate calls long or large says so first; one the device's memory cannot hold is refused
    (--force starts it anyway)."""
    run_eval_recall(checkpoint, task, lengths, pairs, samples, batch_size, seed, vocab, keep_fraction, out,
                    device, dtype, backend, progress, threads=threads, force=force)
