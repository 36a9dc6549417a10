"""`natsl eval-ruler CHECKPOINT`: the RULER needle-in-a-haystack subset (paper Table 2)."""

from __future__ import annotations

from typing import Optional

import typer

from natsl.cli.app import command


@command("eval-ruler")
def eval_ruler(
    checkpoint: str = typer.Argument(..., help="Checkpoint folder (or a training run folder: newest step)."),
    lengths: Optional[str] = typer.Option(None, help="Context lengths in tokens, comma separated (4k = 4096; default: "
                                                     "1x, 2x and 4x the training length, at least 1024 -- the paper's "
                                                     "4k,8k,16k for 4096 -- and at most max_seq_len)."),
    tasks: str = typer.Option("all", help="Comma-separated RULER NIAH tasks, or 'all' (the 8 of Table 2)."),
    samples: Optional[int] = typer.Option(None, help="Samples per task and length (default: 20 on CUDA, 2 on the CPU)."),
    seed: int = typer.Option(0, help="Seed of the generated samples (same seed, same prompts; 0 to 2**63-1)."),
    max_new_tokens: int = typer.Option(128, help="Tokens generated per sample (RULER: 128)."),
    essay_file: Optional[str] = typer.Option(None, help="Plain-text essays for the essay haystack (default: generated prose)."),
    keep_fraction: Optional[float] = typer.Option(None, help="Force NAtS-L layers to keep this fraction of blocks "
                                                             "(a fixed KV budget; default: the router decides)."),
    out: str = typer.Option("eval_ruler", help="Folder for ruler.json, ruler_samples.jsonl and ruler.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Generate RULER's retrieval tasks with the checkpoint's tokenizer, decode greedily, score by string match."""
    from pathlib import Path

    from natsl.atomic import write_json, write_jsonl
    from natsl.data.grid import parse_lengths
    from natsl.runtime import check_length, checkpoint_recipe_of, on_cuda
    from natsl.errors import NatslError
    from natsl.eval.common import human_count, load_eval_model, prepare_out_dir, print_estimate
    from natsl.eval.haystack import EssaySentences, split_sentences
    from natsl.eval.ruler import TASKS, format_table, plot_scores, run_ruler
    from natsl.models.routing import force_keep_fraction
    from natsl.seeding import check_seed

    if keep_fraction is not None and not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    check_seed(seed, "--seed")
    folder, recipe = checkpoint_recipe_of(checkpoint)  # config.json only: refuse before loading
    limit = recipe.model.max_seq_len
    if lengths is None:
        base = max(recipe.train.seq_len, 1024)
        length_list = sorted({min(n * base, limit) for n in (1, 2, 4)})
    else:
        length_list = parse_lengths(lengths)
    for n in length_list:
        check_length("--lengths", n, limit, folder)
    if samples is None:
        samples = 20 if on_cuda(device) else 2
    task_list = list(TASKS) if tasks.strip() == "all" else [t.strip() for t in tasks.split(",") if t.strip()]
    unknown = [t for t in task_list if t not in TASKS]
    if unknown or not task_list:
        raise NatslError(f"unknown RULER task {unknown[0] if unknown else tasks!r}; choose from {', '.join(TASKS)} or 'all'")
    if samples < 1:
        raise NatslError(f"--samples must be at least 1, got {samples}")
    if max_new_tokens < 1:
        raise NatslError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    essay = EssaySentences(seed)
    if essay_file is not None:
        path = Path(essay_file)
        if not path.is_file():
            raise NatslError(f"--essay-file {essay_file!r} does not exist")
        try:
            sentences = split_sentences(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise NatslError(f"--essay-file {essay_file!r} is not UTF-8 text (byte {err.start}); convert it "
                             "to UTF-8") from None
        if not sentences:
            raise NatslError(f"--essay-file {essay_file!r} holds no sentences")
        essay = EssaySentences(sentences=sentences)
    out_dir = prepare_out_dir(out)
    em = load_eval_model(folder, device, dtype, backend)
    force_keep_fraction(em.model, keep_fraction, 0)

    def on_first(stats, todo):
        prompt_tokens = sum(len(s.prompt_ids) for s in todo)
        per_token = stats["prefill_s"] / len(todo[0].prompt_ids)
        per_step = stats["decode_s"] / stats["decode_steps"] if stats["decode_steps"] else stats["prefill_s"]
        plan = (f"eval-ruler: {len(task_list)} tasks x {len(length_list)} lengths x {samples} samples = {len(todo)} "
                f"prompts, {human_count(prompt_tokens)} prompt tokens + up to {human_count(len(todo) * max_new_tokens)} "
                "generated")
        print_estimate(plan, prompt_tokens * per_token + len(todo) * (max_new_tokens - 1) * per_step,
                       f"the first prompt: {stats['prefill_s']:.1f} s prefill, {per_step * 1e3:.0f} ms per new token")

    summary, rows = run_ruler(em, task_list, length_list, samples, seed=seed, max_new_tokens=max_new_tokens,
                              essay=essay, progress=progress, on_first=on_first if samples * len(task_list) * len(length_list) > 1 else None)
    report = {"checkpoint": str(em.folder), "name": em.name, "seed": seed, "samples": samples,
              "max_new_tokens": max_new_tokens, "haystack_essay": essay_file or "generated",
              "forced_keep_fraction": keep_fraction,
              "decoding": "greedy, incremental cache" if hasattr(em.model, "new_cache") else "greedy, full recompute",
              **summary}
    print(format_table(summary, task_list, length_list))
    print(f"mean over tasks and lengths: {summary['mean']:.3f}")
    json_path = write_json(out_dir / "ruler.json", report)
    write_jsonl(out_dir / "ruler_samples.jsonl", rows)
    png_path = plot_scores(summary, task_list, length_list, out_dir / "ruler.png", f"RULER NIAH: {em.name}")
    print(f"wrote {json_path}, {out_dir / 'ruler_samples.jsonl'} and {png_path}")
