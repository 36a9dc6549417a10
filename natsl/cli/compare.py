"""`natsl compare CHECKPOINT...`: quality against measured KV bytes and latency at KV budgets (issue 37)."""

from __future__ import annotations

from typing import List, Optional

import typer

from natsl.cli.app import command


def parse_fractions(text: str, option: str) -> list[float]:
    from natsl.errors import NatslError

    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise NatslError(f"{option} {text!r} is not a comma-separated list of numbers; pass e.g. 0.125,0.25,0.5,1") from None


@command("compare")
def compare(
    checkpoints: List[str] = typer.Argument(..., help="Checkpoint folders (NAtS-L, Transformer, GDN Hybrid, GDN + SWA, "
                                                        "GDN, Mamba2, NAtS-L on Mamba2)."),
    budgets: str = typer.Option("0.125,0.25,0.5,1", help="KV budgets, fractions of the tokens kept: NAtS-L's forced "
                                                         "kept fraction, the eviction presses' budget."),
    methods: str = typer.Option("snapkv,pyramidkv,adakv", help="KV-eviction presses for full-attention checkpoints."),
    context: int = typer.Option(4096, help="Tokens prefilled for the KV bytes and latency."),
    recall: bool = typer.Option(True, "--recall/--no-recall", help="Measure recall accuracy (eval-recall's task)."),
    task: Optional[str] = typer.Option(None, help="mqar or passkey (default: the checkpoint's own task)."),
    lengths: Optional[str] = typer.Option(None, help="Recall sequence lengths (default: the training task's)."),
    pairs: Optional[str] = typer.Option(None, help="Recall pairs or digits (default: the training task's)."),
    samples: int = typer.Option(64, help="Recall samples per (length, pairs) point."),
    batch_size: int = typer.Option(16, help="Recall samples per forward."),
    data: Optional[str] = typer.Option(None, help="Perplexity data as eval-ppl's --data (default: no perplexity)."),
    max_len: int = typer.Option(2048, help="Perplexity window length."),
    windows: int = typer.Option(4, help="Perplexity windows."),
    chunk: Optional[int] = typer.Option(None, help="Tokens read between two presses in the quality runs "
                                                   "(default: the block size, where NAtS-L decides)."),
    decode_tokens: int = typer.Option(16, help="Timed decode steps (median)."),
    repeats: int = typer.Option(3, help="Timed prefills (median)."),
    seed: int = typer.Option(0, help="Seed of the samples, forced routes and random prompts."),
    out: str = typer.Option("compare", help="Folder for compare.json, compare.png and compare.md."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    cuda_graphs: bool = typer.Option(True, help="Replay decode steps as CUDA graphs (CUDA only)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Quality (recall, perplexity) against KV bytes and prefill / decode latency, per checkpoint and budget."""
    from natsl.atomic import write_json, write_text
    from natsl.cli.eval_ruler import parse_lengths
    from natsl.errors import NatslError
    from natsl.eval.common import prepare_out_dir
    from natsl.eval import compare as logic
    from natsl.seeding import check_seed

    check_seed(seed, "--seed")
    for name, value in (("--context", context), ("--samples", samples), ("--batch-size", batch_size),
                        ("--decode-tokens", decode_tokens), ("--repeats", repeats), ("--windows", windows)):
        if value < 1:
            raise NatslError(f"{name} must be at least 1, got {value}")
    if max_len < 2:
        raise NatslError(f"--max-len must be at least 2, got {max_len}")
    if chunk is not None and chunk < 1:
        raise NatslError(f"--chunk must be at least 1, got {chunk}")
    if not recall and data is None:
        raise NatslError("nothing measures quality: keep --recall or pass --data for perplexity")
    budget_list = parse_fractions(budgets, "--budgets")
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    logic.check_budgets(budget_list, method_list)
    out_dir = prepare_out_dir(out)
    recall_args = {"task": task, "lengths": parse_lengths(lengths) if lengths else None,
                   "pairs": parse_lengths(pairs) if pairs else None, "vocab": None,
                   "samples": samples, "batch_size": batch_size} if recall else None
    ppl_args = {"data": data, "max_len": max_len, "windows": windows} if data else None
    result = logic.run_compare(checkpoints, budgets=budget_list, methods=method_list, context=context,
                               recall_args=recall_args, ppl_args=ppl_args, chunk=chunk, decode_tokens=decode_tokens,
                               repeats=repeats, seed=seed, device=device, dtype=dtype, backend=backend,
                               cuda_graphs=cuda_graphs, progress=progress)
    table = logic.format_table(result)
    json_path = write_json(out_dir / "compare.json", result, indent=1)
    png_path = logic.plot(result, out_dir / "compare.png")
    write_text(out_dir / "compare.md", f"```\n{table}\n```\n")
    print(table)
    print(f"wrote {json_path}, {png_path} and {out_dir / 'compare.md'}")
