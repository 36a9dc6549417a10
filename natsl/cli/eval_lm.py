"""`natsl eval-lm CHECKPOINT --tasks ...`: lm-evaluation-harness tasks through natsl's `natsl` model."""

from __future__ import annotations

import math
from typing import Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads
from natsl.cli.jobs import force_option


@command("eval-lm", stop_soon=True)
def eval_lm(
    checkpoint: str = typer.Argument(..., help="A checkpoint folder (or training run folder: newest step)."),
    tasks: str = typer.Option(..., "--tasks", help="Comma-separated lm-eval task names (e.g. hellaswag,arc_easy)."),
    include_path: Optional[str] = typer.Option(None, help="A folder of extra lm-eval task YAMLs (local data)."),
    num_fewshot: Optional[int] = typer.Option(None, help="Few-shot examples per task (default: the task's own)."),
    limit: Optional[float] = typer.Option(None, help="Documents per task (an integer), or a fraction below 1."),
    batch_size: int = typer.Option(1, help="Sequences per forward (equal lengths are batched; natsl never pads)."),
    max_length: Optional[int] = typer.Option(None, help="Tokens per scored window (default: the recipe's training length, capped at max_seq_len; "
                                                               "a --to hf export declares the same)."),
    add_bos: Optional[bool] = typer.Option(None, "--add-bos/--no-add-bos",
                                           help="Prepend the tokenizer's BOS to every text (default: as the checkpoint "
                                                "trained, recorded in its config.json)."),
    out: str = typer.Option("eval_lm", help="Folder for lm_eval.json, lm_eval.md and lm_eval.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    threads: Optional[int] = threads_option(),
    force: bool = force_option(),
) -> None:
    """Score a checkpoint on lm-eval tasks (loglikelihood, rolling loglikelihood, generation) with natsl's cache.

    A forward of --batch-size windows of --max-length tokens that the device's memory cannot hold is refused
    before lm-eval starts (--force starts it anyway)."""
    from natsl.config import context_length
    from natsl.errors import NatslError
    from natsl.eval.lm_eval_run import run_tasks
    from natsl.cli.jobs import check_job
    from natsl.estimate import Work
    from natsl.outputs import check_output
    from natsl.runtime import check_length, checkpoint_recipe_of, pick_device, pick_dtype

    check_output(out, [checkpoint, include_path], "--out")
    if include_path:
        from natsl.eval.lm_eval_run import check_task_folder

        check_task_folder(include_path)
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise NatslError("--tasks names no task; pass e.g. --tasks hellaswag,arc_easy")
    if batch_size < 1:
        raise NatslError(f"--batch-size must be at least 1, got {batch_size}")
    if limit is not None:
        # lm-eval reads a limit below 1 as a fraction of each task's documents and any other as a count
        # (int(limit): 1.5 would silently be 1; 0 and negatives fail inside it)
        whole = math.isfinite(limit) and limit >= 1 and limit == int(limit)
        if not (whole or 0 < limit < 1):
            raise NatslError(f"--limit {limit:g} is neither a whole number of documents (1, 2, ...) nor a fraction "
                             "of them between 0 and 1; pass e.g. --limit 100 or --limit 0.1")
        limit = int(limit) if whole else limit
    if num_fewshot is not None and num_fewshot < 0:
        raise NatslError(f"--num-fewshot must be 0 or more examples, got {num_fewshot}")
    use_threads(threads, device)
    folder, recipe = checkpoint_recipe_of(checkpoint)  # config.json only: refuse before loading
    args = {"device": device, "dtype": dtype, "backend": backend, "add_bos": add_bos}
    if max_length is not None:
        if max_length < 1:
            raise NatslError(f"--max-length must be at least 1 token, got {max_length}")
        check_length("--max-length", max_length, recipe.model.max_seq_len, folder)
        args["max_length"] = max_length
    torch_device = pick_device(device)
    window = max_length or context_length(recipe)  # the adapter's default
    check_job(f"eval-lm: windows of up to {window:,} tokens, {batch_size} per forward", recipe.model,
              [Work("prefill", batch_size, window)], device=torch_device, dtype=pick_dtype(dtype, torch_device),
              backend=backend, force=force, fix="lower --max-length or --batch-size")
    report = run_tasks(checkpoint, names, out, include_path=include_path, num_fewshot=num_fewshot, limit=limit,
                       batch_size=batch_size, model_args=args)
    print(report["table"])
    print(f"wrote {report['json']} (and lm_eval.md, lm_eval.png)")
