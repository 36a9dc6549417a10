"""`natsl eval-ruler CHECKPOINT`: the RULER needle-in-a-haystack subset (paper Table 2)."""

from __future__ import annotations

from typing import Optional

import typer

from natsl.cli.app import command


def parse_lengths(text: str) -> list[int]:
    from natsl.errors import NatslError

    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1
        if part.endswith("k"):
            part, scale = part[:-1], 1024
        try:
            value = int(float(part) * scale)
        except ValueError:
            raise NatslError(f"--lengths {text!r}: {part!r} is not a length; use e.g. 4k,8k,16k or 4096,8192") from None
        if value < 1:
            raise NatslError(f"--lengths {text!r}: lengths must be positive")
        out.append(value)
    if not out:
        raise NatslError("--lengths is empty; use e.g. 4k,8k,16k")
    return out


@command("eval-ruler")
def eval_ruler(
    checkpoint: str = typer.Argument(..., help="Checkpoint folder (or a training run folder: newest step)."),
    lengths: str = typer.Option("4k,8k,16k", help="Context lengths in tokens, comma separated (4k = 4096)."),
    tasks: str = typer.Option("all", help="Comma-separated RULER NIAH tasks, or 'all' (the 8 of Table 2)."),
    samples: int = typer.Option(20, help="Samples per task and length."),
    seed: int = typer.Option(0, help="Seed of the generated samples (same seed, same prompts)."),
    max_new_tokens: int = typer.Option(128, help="Tokens generated per sample (RULER: 128)."),
    essay_file: Optional[str] = typer.Option(None, help="Plain-text essays for the essay haystack (default: generated prose)."),
    keep_fraction: Optional[float] = typer.Option(None, help="Force NAtS-L layers to keep this fraction of blocks "
                                                             "(a fixed KV budget; default: the router decides)."),
    out: str = typer.Option("eval_ruler", help="Folder for ruler.json, ruler_samples.jsonl and ruler.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
) -> None:
    """Generate RULER's retrieval tasks with the checkpoint's tokenizer, decode greedily, score by string match."""
    from pathlib import Path

    from natsl.errors import NatslError
    from natsl.eval.common import load_eval_model, prepare_out_dir, write_json, write_jsonl
    from natsl.eval.haystack import EssaySentences, split_sentences
    from natsl.eval.ruler import TASKS, format_table, plot_scores, run_ruler
    from natsl.inference.routing import force_keep_fraction

    if keep_fraction is not None and not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    length_list = parse_lengths(lengths)
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
    em = load_eval_model(checkpoint, device, dtype, backend)
    force_keep_fraction(em.model, keep_fraction, 0)
    limit = em.model.config.max_seq_len
    too_long = [n for n in length_list if n > limit]
    if too_long:
        raise NatslError(f"--lengths: {too_long[0]} is beyond the model's max_seq_len {limit}; drop the longer lengths")
    summary, rows = run_ruler(em, task_list, length_list, samples, seed=seed, max_new_tokens=max_new_tokens, essay=essay)
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
