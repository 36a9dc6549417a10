"""`natsl warmup RECIPE_OR_CKPT --lengths 1k,4k,...`: compile once, so that later processes start warm."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads
from natsl.cli.jobs import force_option
from natsl.errors import NatslError


@command("warmup", stop_soon=True)
def warmup(
    model_path: str = typer.Argument(..., metavar="RECIPE_OR_CKPT",
                                     help="A recipe (YAML or name; random weights) or a checkpoint folder."),
    lengths: str = typer.Option("1k,4k", help="Prompt lengths to prefill, comma separated (4k = 4096)."),
    batch_size: int = typer.Option(1, help="Sequences per call: use the batch size the later processes use."),
    decode_tokens: int = typer.Option(4, help="Decode steps after each prefill."),
    seed: int = typer.Option(0, help="Seed for the weights of a recipe and the random tokens (0 to 2**63-1)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on CPU)."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda if present)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU)."),
    threads: Optional[int] = threads_option(),
    force: bool = force_option(),
) -> None:
    """Prefill and decode at each length so that Triton's and Inductor's on-disk caches hold the kernels.

    Triton keeps its kernels in TRITON_CACHE_DIR (default ~/.triton/cache), Inductor in
    TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER); a later process with the same model,
    dtype, backend, batch size, torch, Triton and GPU (and the same two variables) loads them from
    there instead of compiling. On the CPU nothing is compiled: the calls just run. Lengths the estimate
    calls long or large say so first; lengths the device's memory cannot hold are refused (--force starts
    anyway).
    """
    from natsl.data.grid import parse_lengths
    from natsl.runtime import check_length, checkpoint_recipe_of, pick_backend, pick_device, pick_dtype
    from natsl.seeding import check_seed
    from natsl.cli.jobs import check_models, latency_works

    check_seed(seed, "--seed")
    length_list = parse_lengths(lengths)
    for name, value in (("--batch-size", batch_size), ("--decode-tokens", decode_tokens)):
        if value < 1:
            raise NatslError(f"--{name.lstrip('-')} must be at least 1, got {value}")
    import natsl

    is_checkpoint = Path(model_path).is_dir()
    config = (checkpoint_recipe_of(model_path)[1] if is_checkpoint else natsl.load_recipe(model_path)).model
    limit = config.max_seq_len
    check_length("--lengths", max(length_list), limit, model_path)
    if decode_tokens >= limit:
        raise NatslError(f"--decode-tokens {decode_tokens} leaves no prompt within the max_seq_len {limit} of "
                         f"{model_path}; lower it")
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    chosen_backend = pick_backend(backend, torch_device)
    threads_note = use_threads(threads, torch_device, say=False)
    works = latency_works(length_list, batch=batch_size, decode_tokens=decode_tokens, repeats=2)
    check_models(f"warmup: {len(length_list)} length(s) up to {max(length_list):,} tokens",
                 [(config, 1.0 if is_checkpoint else 0.5, works)], device=torch_device, dtype=torch_dtype,
                 backend=chosen_backend, force=force, fix="lower --lengths or --batch-size")

    from natsl.inference import bench
    from natsl.inference.warmup import cache_dirs, warm_up

    # A recipe's router is untrained: keep half the blocks, so that the kept-block paths run too.
    spec = bench.BenchModel("checkpoint" if is_checkpoint else "recipe", model_path, None if is_checkpoint else 0.5)
    model, name, _ = bench.load_model(spec, torch_device, torch_dtype, chosen_backend, seed)
    dirs = cache_dirs()
    print(f"warming up {name} on {torch_device}, {str(torch_dtype).replace('torch.', '')}, backend {chosen_backend}, "
          f"batch {batch_size}{'; ' + threads_note if threads_note else ''}")
    header = f"{'length':>8} {'first prefill s':>16} {'warm prefill s':>15} {'ragged s':>9} {'decode s':>9} " \
             f"{'triton files':>13} " \
             f"{'inductor files':>15} {'graphs':>7}"
    print(header)
    print("-" * len(header))

    def show(r: dict) -> None:
        print(f"{r['length']:>8} {r['first_prefill_s']:>16.3f} {r['warm_prefill_s']:>15.3f} "
              f"{r['ragged_prefill_s']:>9.3f} {r['decode_s']:>9.3f} "
              f"{r['new_triton_files']:>13} {r['new_inductor_files']:>15} {r['graphs_compiled']:>7}", flush=True)

    records = warm_up(model, length_list, device=torch_device, batch=batch_size, decode_steps=decode_tokens,
                      seed=seed, on_length=show)
    print(f"{sum(r['seconds'] for r in records):.1f} s in all; new files: {sum(r['new_triton_files'] for r in records)} "
          f"in the Triton cache ({dirs['triton']}, TRITON_CACHE_DIR), {sum(r['new_inductor_files'] for r in records)} "
          f"in the Inductor cache ({dirs['inductor']}, TORCHINDUCTOR_CACHE_DIR); "
          f"{sum(r['graphs_compiled'] for r in records)} graphs compiled by torch.compile")
    if torch_device.type == "cpu" and not any(r["graphs_compiled"] for r in records):
        print("on the CPU nothing is compiled (the elementwise pieces run eagerly there, Triton kernels only in its "
              "interpreter): the calls just ran")
    else:
        print("a later process with the same model, dtype, backend, batch size and cache folders loads these "
              "kernels instead of compiling them")
