"""Filling the on-disk compile caches before the first real call (`natsl warmup`).

The first prefill of a process at a new length pays Triton's JIT compiles (the fast backend's
kernels and the cached paths' fused kernels), and its first decode steps torch.compile's (the layers'
elementwise pieces, `natsl.models.pointwise`, compiled on CUDA in decode steps and training; a
prefill runs them eagerly: natsl.ops.compiled.compile_for). Both keep what they built on disk: Triton in
TRITON_CACHE_DIR (default ~/.triton/cache), Inductor in TORCHINDUCTOR_CACHE_DIR (default
/tmp/torchinductor_$USER), and a later process with the same model shapes, dtype, backend,
batch size, torch, Triton and GPU loads from there instead of compiling again. `warm_up` runs
each length once (a prefill and a few decode steps) and says what each call added to those caches.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import torch

from natsl.inference.bench import first_call, synchronize, time_prefill
from natsl.inference.prefill_graph import prefill

# The ragged call after each length: a prompt this much shorter (so no multiple of 16, which Triton
# compiles apart), then the rest as a second call (the path that continues a cache).
RAGGED_TAIL = 27


def cache_dirs() -> dict[str, Path]:
    """Where Triton and Inductor keep their compiled kernels (as this process resolves them)."""
    dirs = {}
    try:
        from triton import knobs

        dirs["triton"] = Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton absent, or older than its knobs module
        dirs["triton"] = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    dirs["inductor"] = Path(cache_dir())
    return dirs


def count_files(folder: Path) -> int:
    """Files under `folder` (0 when it does not exist yet)."""
    if not folder.is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


def graphs_compiled() -> int:
    """Graphs torch.compile has built in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def ragged_prefill(model, ids, cache, device) -> float:
    """Seconds of a prefill of all but the last RAGGED_TAIL tokens of `ids` (a length Triton specialises
    apart; a short prompt's padded CUDA-graph bucket) and then of those tokens (the continuation
    path), into `cache` (reset first)."""
    cache.reset()
    cut = max(1, ids.shape[1] - RAGGED_TAIL)
    synchronize(device)
    start = time.perf_counter()
    prefill(model, ids[:, :cut], cache)
    if cut < ids.shape[1]:
        model.forward_cached(ids[:, cut:], cache, last_only=True)
    synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def warm_up(model, lengths: list[int], *, device: torch.device, batch: int = 1, decode_steps: int = 4, seed: int = 0,
            on_length: Callable[[dict], None] | None = None) -> list[dict]:
    """Prefill `batch` x L random tokens and decode `decode_steps` tokens at each L of `lengths`, then
    prefill once more (warm), then a ragged prefill (`ragged_prefill`). One record per length: first
    (cold), warm and ragged prefill seconds, the decode steps' seconds, new files in the Triton and
    Inductor caches and graphs torch.compile built. On CUDA a short prompt's prefill records its
    bucket's CUDA graph here too (natsl.inference.prefill_graph), compiling the padded shapes."""
    dirs = cache_dirs()
    generator = torch.Generator().manual_seed(seed)
    records = []
    for length in lengths:
        before = {name: count_files(folder) for name, folder in dirs.items()}
        graphs = graphs_compiled()
        ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)
        # At the model's max_seq_len there is no room to decode after the prompt: the decode steps then
        # follow a prompt `decode_steps` shorter (its own cache), so that their kernels are warmed too.
        steps_here = min(decode_steps, model.config.max_seq_len - length)
        cache = model.new_cache(batch, max_len=length + steps_here)
        start = time.perf_counter()
        # CUDA graphs are not kept on disk: the decode steps run plain, which compiles the same kernels.
        cold = first_call(model, ids, cache, steps_here, device)
        if steps_here < decode_steps:
            short = max(1, model.config.max_seq_len - decode_steps)
            short_cache = model.new_cache(batch, max_len=short + decode_steps)
            cold["decode_s"] = first_call(model, ids[:, :short], short_cache, decode_steps, device)["decode_s"]
            del short_cache
        warm = time_prefill(model, ids, cache, 1, device)
        record = {"length": length, "first_prefill_s": cold["prefill_s"], "decode_s": cold["decode_s"],
                  "warm_prefill_s": warm, "ragged_prefill_s": ragged_prefill(model, ids, cache, device),
                  "seconds": time.perf_counter() - start, "graphs_compiled": graphs_compiled() - graphs,
                  **{f"new_{name}_files": count_files(folder) - before[name] for name, folder in dirs.items()}}
        del cache
        records.append(record)
        if on_length is not None:
            on_length(record)
    return records
