"""`natsl compare MODEL...`: quality against measured KV bytes and latency at KV budgets (issue 37); a model is
a checkpoint or a recipe (random weights: latency and memory only)."""

from __future__ import annotations

from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import comma_list, threads_option, use_threads
from natsl.cli.jobs import force_option


def parse_fractions(text: str, option: str) -> list[float]:
    return comma_list(text, option, float, "numbers", "0.125,0.25,0.5,1")


def parse_contexts(text: str) -> list[int]:
    """`--context`: one token count or a comma-separated list of them."""
    return comma_list(text, "--context", int, "token counts", "32768,65536,131072")


@command("compare", stop_soon=True)
def compare(
    models: List[str] = typer.Argument(..., help="Checkpoint folders or recipes (a YAML file or a shipped name such as "
                                                   "800m_hybrid: random weights, latency and memory only): NAtS-L, "
                                                   "Transformer, GDN Hybrid, GDN + SWA, GDN, Mamba2, NAtS-L on Mamba2."),
    budgets: str = typer.Option("0.125,0.25,0.5,1", help="KV budgets, fractions of the tokens kept: NAtS-L's forced "
                                                         "kept fraction, the eviction presses' budget."),
    methods: str = typer.Option("snapkv,pyramidkv,adakv", help="KV-eviction presses for full-attention checkpoints."),
    context: str = typer.Option("4096", help="Tokens prefilled for the KV bytes and latency: one count or a comma list "
                                             "(32768,65536,131072), a table row and a plot row each."),
    quality: bool = typer.Option(True, "--quality/--no-quality", help="Measure quality (recall, perplexity) of the "
                                                                     "checkpoints; --no-quality: latency and memory only."),
    recall: Optional[bool] = typer.Option(None, "--recall/--no-recall", help="Measure recall accuracy (eval-recall's "
                                          "task; default: with --quality)."),
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
    time_budget: Optional[float] = typer.Option(None, help="Seconds for the whole run, shared by the models as "
                                                           "bench-latency shares them; later points are recorded as skipped."),
    out: str = typer.Option("compare", help="Folder for compare.json, compare.png and compare.md."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    cuda_graphs: bool = typer.Option(True, help="Replay decode steps as CUDA graphs (CUDA only)."),
    threads: Optional[int] = threads_option(),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
    force: bool = force_option(),
) -> None:
    """Quality (recall, perplexity) against KV bytes and prefill / decode latency, per model, budget and context.

    A run the estimate calls long or large says so first; one the device's memory cannot hold is refused
    (--force starts it anyway)."""
    from natsl.atomic import write_json, write_text
    from natsl.data.grid import parse_lengths, parse_pairs
    from natsl.errors import NatslError
    from natsl.eval.common import prepare_out_dir
    from natsl.eval import compare as logic
    from natsl.outputs import check_output
    from natsl.seeding import check_seed
    from natsl.cli.jobs import check_compare

    check_output(out, [*models, data], "--out")
    check_seed(seed, "--seed")
    contexts = parse_contexts(context)
    logic.check_contexts(contexts)
    for name, value in (("--samples", samples), ("--batch-size", batch_size),
                        ("--decode-tokens", decode_tokens), ("--repeats", repeats), ("--windows", windows)):
        if value < 1:
            raise NatslError(f"{name} must be at least 1, got {value}")
    if max_len < 2:
        raise NatslError(f"--max-len must be at least 2, got {max_len}")
    if chunk is not None and chunk < 1:
        raise NatslError(f"--chunk must be at least 1, got {chunk}")
    if time_budget is not None and not 0 < time_budget < float("inf"):
        raise NatslError(f"--time-budget must be a positive number of seconds, got {time_budget}")
    if not quality and data is not None:
        raise NatslError("--no-quality measures no perplexity: leave out --data, or --no-quality")
    if not quality and recall:
        raise NatslError("--no-quality measures no recall: leave out --recall, or --no-quality")
    recall = quality if recall is None else recall
    if quality and not recall and data is None:
        raise NatslError("nothing measures quality: keep --recall, pass --data for perplexity, or pass --no-quality")
    budget_list = parse_fractions(budgets, "--budgets")
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    logic.check_budgets(budget_list, method_list)
    logic.check_sources([logic.resolve_source(m) for m in models], contexts)  # before the output folder is made
    use_threads(threads, device)
    ppl_args = {"data": data, "max_len": max_len, "windows": windows} if data else None
    check_compare(models, budgets=budget_list, methods=method_list, contexts=contexts, decode_tokens=decode_tokens,
                  repeats=repeats, ppl_args=ppl_args, chunk=chunk, device=device, dtype=dtype, backend=backend,
                  force=force)
    out_dir = prepare_out_dir(out)
    recall_args = {"task": task, "lengths": parse_lengths(lengths) if lengths else None,
                   "pairs": parse_pairs(pairs) if pairs else None, "vocab": None,
                   "samples": samples, "batch_size": batch_size} if recall and quality else None
    json_path = out_dir / "compare.json"
    result = logic.run_compare(models, budgets=budget_list, methods=method_list, contexts=contexts, quality=quality,
                               recall_args=recall_args, ppl_args=ppl_args, chunk=chunk, decode_tokens=decode_tokens,
                               repeats=repeats, seed=seed, device=device, dtype=dtype, backend=backend,
                               cuda_graphs=cuda_graphs, progress=progress, time_budget_s=time_budget,
                               on_update=lambda partial: write_json(json_path, partial, indent=1))
    table = logic.format_table(result)
    write_json(json_path, result, indent=1)
    png_path = logic.plot(result, out_dir / "compare.png")
    write_text(out_dir / "compare.md", f"```\n{table}\n```\n")
    print(table)
    print(f"wrote {json_path}, {png_path} and {out_dir / 'compare.md'}")
