"""`natsl bench-latency`: prefill seconds and decode ms per token against context length (paper Fig. 4)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import comma_list, threads_option, use_threads
from natsl.cli.jobs import force_option
from natsl.errors import NatslError


@command("bench-latency", stop_soon=True)
def bench_latency(
    recipe: Optional[List[str]] = typer.Option(None, help="Recipe to measure with random weights (repeatable)."),
    checkpoint: Optional[List[str]] = typer.Option(None, help="Checkpoint folder to measure, trained router (repeatable)."),
    min_len: Optional[int] = typer.Option(None, help="Shortest context; the lengths double from here "
                                                     "(default: 1024, or --max-len when that is shorter)."),
    max_len: int = typer.Option(131072, help="Longest context (the paper goes to 131072)."),
    keep_fraction: float = typer.Option(0.5, help="Fraction of blocks kept by the NAtS-L layers of recipe models "
                                                  "(their router is untrained; forced by a seeded random mask)."),
    force_keep: bool = typer.Option(False, help="Force --keep-fraction on checkpoints too (default: their router decides)."),
    batch_size: str = typer.Option("1", help="Sequences per prefill / decode step; a comma list (1,4,16,64) "
                                             "measures each in turn, into OUT/batch_N/."),
    decode_tokens: int = typer.Option(32, help="Timed decode steps per point (the median is reported)."),
    repeats: int = typer.Option(3, help="Warm prefills per point, timed after an untimed first call whose "
                                        "(cold) time is reported apart; the median is reported."),
    seed: int = typer.Option(0, help="Seed for the weights, the tokens and the forced routes (0 to 2**63-1)."),
    out: str = typer.Option("bench_latency", help="Folder for latency.json and latency.png."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on CPU)."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda if present)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU)."),
    cuda_graphs: bool = typer.Option(True, help="Replay decode steps as CUDA graphs (CUDA only)."),
    threads: Optional[int] = threads_option(),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    time_budget: Optional[float] = typer.Option(None, help="Seconds for the whole run, shared by the models; "
                                                           "points past a model's share are recorded as skipped."),
    force: bool = force_option(),
) -> None:
    """Measure latency for recipes (default: the 800M NAtS-L Hybrid, Transformer, GDN and Mamba2) or checkpoints.

    `--batch-size 1,4,16,64` measures each batch size in turn (the decode rows of serving and batched
    evaluation), each into OUT/batch_N/ with its own latency.json and latency.png; --time-budget is shared
    equally by the batch sizes.

    A run the estimate calls long or large says so first; one the device's memory cannot hold is refused
    (--force starts it anyway). The first Ctrl-C stops within about two seconds and writes the points
    measured so far (latency.json with "interrupted": true, and latency.png); exit code 130."""
    import natsl
    from natsl.runtime import (check_keeps_natsl, check_length, checkpoint_recipe_of, pick_backend, pick_device,
                               pick_dtype)
    from natsl.outputs import check_output
    from natsl.inference import bench
    from natsl.seeding import check_seed
    from natsl.cli.jobs import check_bench
    from natsl.interrupts import Partial

    check_output(out, [*(recipe or []), *(checkpoint or [])], "--out")
    check_seed(seed, "--seed")
    if min_len is None:
        min_len = min(1024, max_len)
    if min_len < 1 or max_len < min_len:
        raise NatslError(f"need 1 <= --min-len <= --max-len, got {min_len} and {max_len}")
    if not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    batches = comma_list(batch_size, "--batch-size", int, "whole numbers", "1,4,16,64")
    if not batches or len(set(batches)) != len(batches):
        raise NatslError(f"--batch-size {batch_size!r}: give one batch size or distinct ones, e.g. 1,4,16,64")
    for name, value in (*(("--batch-size", b) for b in batches), ("--decode-tokens", decode_tokens),
                        ("--repeats", repeats)):
        if value < 1:
            raise NatslError(f"{name} must be at least 1, got {value}")
    if time_budget is not None and not 0 < time_budget < float("inf"):
        raise NatslError(f"--time-budget must be a positive number of seconds, got {time_budget}")
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    chosen_backend = pick_backend(backend, torch_device)

    from natsl.models.registry import any_routed

    specs, limits = [], []
    recipes = list(recipe or [])
    if not recipes and not checkpoint:
        recipes = list(bench.DEFAULT_RECIPES)
    for path in recipes:
        rec = natsl.load_recipe(path)  # validates the recipe now
        limits.append((path, rec.model.max_seq_len))
        # the fraction is forced on NAtS-L layers only: a model without them records none
        specs.append(bench.BenchModel("recipe", path, keep_fraction if any_routed(rec.model) else None))
    for path in checkpoint or []:
        folder, rec = checkpoint_recipe_of(path)
        limits.append((path, rec.model.max_seq_len))
        if force_keep:  # asked for by name: a checkpoint it cannot apply to is refused
            check_keeps_natsl(keep_fraction, rec, folder, "--force-keep")
        specs.append(bench.BenchModel("checkpoint", path, keep_fraction if force_keep else None))
    for path, limit in limits:
        check_length("--max-len", max_len, limit, path)

    use_threads(threads, torch_device)
    lengths = bench.context_lengths(min_len, max_len)
    for batch in batches:  # every estimate (and refusal) before any work
        check_bench(specs, lengths, batch=batch, decode_tokens=decode_tokens, repeats=repeats, device=torch_device,
                    dtype=torch_dtype, backend=chosen_backend, force=force)

    for batch in batches:
        # one batch size: OUT/latency.json as always; several: one run each, OUT/batch_N/latency.json
        folder = Path(out) if len(batches) == 1 else Path(out) / f"batch_{batch}"
        json_path, png_path = folder / "latency.json", folder / "latency.png"
        partial = Partial(lambda r, j=json_path, p=png_path: write_partial(r, j, p),
                          each=lambda r, j=json_path: bench.save_json(r, j))
        with partial.kept():
            result = bench.run_benchmark(specs, lengths, device=torch_device, dtype=torch_dtype, backend=chosen_backend,
                                         batch=batch, decode_tokens=decode_tokens, repeats=repeats, seed=seed,
                                         cuda_graphs=cuda_graphs, progress=progress,
                                         time_budget_s=None if time_budget is None else time_budget / len(batches),
                                         on_update=partial.update)
        bench.save_json(result, json_path)
        bench.plot(result, png_path)
        print(bench.format_table(result))
        print(f"wrote {json_path} and {png_path}")


def write_partial(result: dict, json_path: Path, png_path: Path) -> None:
    """What an interrupted run measured: latency.json (with "interrupted": true) and latency.png."""
    import sys

    from natsl.inference import bench

    bench.save_json(result, json_path)
    bench.plot(result, png_path)
    points = sum(1 for entry in result["models"] for p in entry["points"] if "error" not in p)
    print(f"interrupted: wrote the {points} point(s) measured to {json_path} and {png_path}", file=sys.stderr)
