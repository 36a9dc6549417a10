"""Latency against context length (the paper's Fig. 4): prefill seconds and decode ms per token.

For each model and each context length L (1K doubling to the maximum) one cache is made for
L + the decode tokens. The first call at a length is never timed as a warm one: a prompt of L random
tokens is prefilled once and a few tokens decoded (`first_call`), and that prefill's time is
reported on its own as `cold_prefill_s` (it pays the Triton JIT compiles and torch.compile
(re)compiles a process meets at a new length). Then the prompt is prefilled `repeats` more times
(chunk mode, the last token's logits only; the median is `prefill_s`), and `decode_tokens`
single-token steps run through `DecodeRunner` (CUDA graphs on CUDA) after a few untimed ones; their
median step time is reported. A model's `warmup_s` is its first calls at a short length, before any
point. Beside each time stands a floor measured on the same device in the same run:

- compute floor of prefill = model FLOPs / measured matmul rate (`prefill_flops`: every linear
  map, causal softmax attention, NAtS-L attention over its own block and kept blocks, the chunked
  GDN recurrence; approximate, exact in the dominant terms);
- memory floor of decode = (bytes of weights + bytes of cache content) / measured copy bandwidth:
  what one step must read at least.

A NAtS-L model built from a recipe has an untrained router, so its routes are forced to keep a
chosen fraction of blocks (`force_keep_fraction`); a checkpoint keeps its trained router and the
measured fraction is reported. An out-of-memory point is recorded as such and the longer contexts
of that model are skipped.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from natsl.atomic import save_figure, write_json
from natsl.provenance import provenance

from natsl.inference.decode import DecodeRunner
from natsl.inference.evict import evict, observe
from natsl.inference.prefill_graph import prefill as graphed_prefill
from natsl.models.routing import force_keep_fraction
from natsl.models.registry import kinds_of

DEFAULT_RECIPES = ("800m_hybrid", "800m_transformer", "800m_gdn", "800m_mamba2")


@dataclass
class BenchModel:
    """A model to measure: a recipe (random weights) or a checkpoint folder."""

    kind: str  # "recipe" or "checkpoint"
    path: str
    force_keep: float | None = None  # keep fraction forced on NAtS-L layers (None: the router decides)


def context_lengths(min_len: int, max_len: int) -> list[int]:
    """min_len, 2*min_len, ... up to max_len (max_len itself included when it is not on the ladder)."""
    lengths, length = [], min_len
    while length <= max_len:
        lengths.append(length)
        length *= 2
    if not lengths or lengths[-1] != max_len:
        lengths.append(max_len)
    return lengths


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_rates(device: torch.device, dtype: torch.dtype) -> dict:
    """Matmul FLOP/s (square matmul in `dtype`) and copy bandwidth (bytes read + written per second)."""
    n, reps = (8192, 20) if device.type == "cuda" else (768, 4)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b)
    synchronize(device)
    matmul = 2 * n**3 * reps / (time.perf_counter() - start)
    del a, b
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    start = time.perf_counter()
    copies = 10 if device.type == "cuda" else 4
    for _ in range(copies):
        dst.copy_(src)
    synchronize(device)
    bandwidth = 2 * size * copies / (time.perf_counter() - start)
    del src, dst
    return {"matmul_flops_per_s": matmul, "copy_bytes_per_s": bandwidth, "matmul_n": n,
            "matmul_dtype": str(dtype).replace("torch.", "")}


def prefill_flops(model, length: int, batch: int = 1, keep: float = 1.0) -> float:
    """Approximate FLOPs of a prefill of `length` tokens (logits of the last token only)."""
    c = model.config
    head = model.lm_head.weight.numel()
    body = sum(p.numel() for name, p in model.named_parameters()
               if p.dim() >= 2 and not name.startswith(("embed.", "lm_head.")) and "conv" not in name)
    flops = 2.0 * batch * length * body + 2.0 * batch * head
    for kind in kinds_of(c):  # each layer kind's own term (natsl.models.registry: LayerKind.prefill_flops)
        flops += kind.prefill_flops(c, length, batch, keep)
    return flops


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter but the embedding table (one row is read)."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name == "embed.weight" and model.lm_head.weight is not p:
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def load_model(spec: BenchModel, device: torch.device, dtype: torch.dtype, backend: str, seed: int):
    """(model, display name, parameter count) for a recipe (random weights) or a checkpoint."""
    import natsl
    from natsl.checkpoint import load_checkpoint

    if spec.kind == "recipe":
        recipe = natsl.load_recipe(spec.path)
        torch.manual_seed(seed)
        model = natsl.build_model(recipe, device=device).to(dtype)
        name = recipe.name
    else:
        model, _ = load_checkpoint(spec.path, device=device, dtype=dtype)
        name = Path(spec.path).resolve().name
    model.set_backend(backend)
    model.eval()
    force_keep_fraction(model, spec.force_keep, seed)
    return model, name, model.num_parameters()


def prefill(model, ids, cache, press=None):
    """One timed prefill: logits of the last token (from a CUDA graph where that applies:
    natsl.inference.prefill_graph); with `press`, the KV eviction after it."""
    logits = graphed_prefill(model, ids, cache)
    if press is not None:
        evict(model, cache, press)
    return logits


def time_prefill(model, ids, cache, repeats: int, device, press=None) -> float:
    """Median seconds of `repeats` prefills of `ids` into `cache` (reset before each)."""
    times = []
    for _ in range(repeats):
        cache.reset()
        synchronize(device)
        start = time.perf_counter()
        prefill(model, ids, cache, press)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def first_call(model, ids, cache, decode_steps: int, device, cuda_graphs: bool = False, press=None) -> dict:
    """Prefill `ids` into `cache` (reset first) and decode `decode_steps` tokens, timing each part:
    the call that pays the compiles of a new length, so that later calls at that length are warm.
    Returns prefill_s and decode_s (the whole of the decode steps)."""
    cache.reset()
    synchronize(device)
    start = time.perf_counter()
    logits = prefill(model, ids, cache, press)  # a short prompt records its bucket's CUDA graph here
    synchronize(device)
    prefilled = time.perf_counter()
    runner = DecodeRunner(model, cache, cuda_graphs=cuda_graphs)
    token = logits[:, -1].argmax(-1)
    for _ in range(decode_steps):
        token = runner.step(token).argmax(-1)
    synchronize(device)
    return {"prefill_s": prefilled - start, "decode_s": time.perf_counter() - prefilled}


def time_decode(model, cache, steps: int, warmup: int, device, generator, cuda_graphs: bool) -> tuple[float, DecodeRunner]:
    """Median milliseconds of one decode step (random tokens), after `warmup` steps."""
    runner = DecodeRunner(model, cache, cuda_graphs=cuda_graphs)
    vocab = model.config.vocab_size

    def tokens():
        return torch.randint(0, vocab, (cache.batch_size,), generator=generator).to(device)

    for _ in range(warmup):
        runner.step(tokens())
    times = []
    for _ in range(steps):
        ids = tokens()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            runner.step(ids)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            runner.step(ids)
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), runner


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower() \
        or "can't allocate memory" in str(err).lower()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@torch.no_grad()
def measure_point(model, length: int, *, batch: int, decode_tokens: int, repeats: int, device, seed: int,
                  cuda_graphs: bool, rates: dict, weights: int, press=None) -> dict:
    """One (model, context) point: cold and warm prefill s, decode ms/token, floors, memory, keep fraction.
    With `press` (natsl.inference.evict.Press) each prefill is followed by its KV eviction, timed with
    it, and the decode steps read the evicted cache."""
    warmup = 3
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = model.new_cache(batch, max_len=length + warmup + decode_tokens)
    observe(model, press)
    try:
        # Untimed as a warm call: the first prefill at a new length compiles; reported on its own.
        cold = first_call(model, ids, cache, warmup, device, press=press)
        prefill_s = time_prefill(model, ids, cache, repeats, device, press)
        keep = cache.kept_fraction()
        live, kv = cache.live_bytes(), cache.kv_bytes()
        decode_ms, runner = time_decode(model, cache, decode_tokens, warmup, device, generator, cuda_graphs)
        point = {
            "context": length, "cold_prefill_s": cold["prefill_s"], "prefill_s": prefill_s, "decode_ms": decode_ms,
            "prefill_floor_s": prefill_flops(model, length, batch, 1.0 if keep is None else keep) / rates["matmul_flops_per_s"],
            "decode_floor_ms": 1000 * (weights + live) / rates["copy_bytes_per_s"],
            "keep_fraction": keep, "cache_bytes": live, "kv_bytes": kv, "cache_allocated_bytes": cache.allocated_bytes(),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "cuda_graphs": runner.cuda_graphs, "graph_captures": runner.captures,
        }
    finally:
        if press is not None:
            observe(model, None)
        del cache
    return point


@torch.no_grad()
def warm_up_model(model, n: int, batch: int, device) -> float:
    """Compile kernels and settle the allocator before the first point; returns the seconds it took.
    Two prefill calls (whole blocks + a partial one, then the rest of that block), so that every
    piece of a block-aligned prefill has been compiled, then one decode step."""
    synchronize(device)
    start = time.perf_counter()
    warm = model.new_cache(batch, max_len=n + 4)
    for piece in filter(None, (n - min(n // 2, 27), min(n // 2, 27))):
        model.forward_cached(torch.zeros(batch, piece, dtype=torch.long, device=device), warm)
    DecodeRunner(model, warm, cuda_graphs=False).step(torch.zeros(batch, dtype=torch.long, device=device))
    del warm
    synchronize(device)
    return time.perf_counter() - start


def run_benchmark(specs: list[BenchModel], lengths: list[int], *, device: torch.device, dtype: torch.dtype,
                  backend: str, batch: int = 1, decode_tokens: int = 32, repeats: int = 3, seed: int = 0,
                  cuda_graphs: bool = True, progress: bool = True, on_update=None,
                  time_budget_s: float | None = None) -> dict:
    """Measure every spec at every length; `on_update(result)` is called after each point (to save it).

    With `time_budget_s`, model i of n may run until i+1 n-ths of the budget have passed (time a
    model leaves unused goes to the next); the points after that are recorded as skipped. A model's
    first point runs as long as the whole budget is not spent, so a model whose warm-up (compiling)
    ate its share still gets one point rather than none.
    """
    from tqdm import tqdm

    rates = measure_rates(device, dtype)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""), "backend": backend, "batch": batch,
        "decode_tokens": decode_tokens, "repeats": repeats, "torch": torch.__version__, "provenance": provenance(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": rates, "models": [],
    }
    if on_update is not None:  # an interrupted run then has a result to keep, even before its first point
        on_update(result)
    bar = tqdm(total=len(specs) * len(lengths), desc="bench-latency", unit="point", disable=not progress)
    began = time.monotonic()
    for index, spec in enumerate(specs):
        deadline = None if time_budget_s is None else began + time_budget_s * (index + 1) / len(specs)
        model, name, params = load_model(spec, device, dtype, backend, seed)
        entry = {"name": name, "source": spec.kind, "path": spec.path, "parameters": params,
                 "forced_keep_fraction": spec.force_keep, "weight_bytes": weight_bytes(model), "points": []}
        result["models"].append(entry)
        entry["warmup_s"] = warm_up_model(model, min(lengths[0], 256), batch, device)
        failed = None
        for length in lengths:
            bar.set_postfix_str(f"{name} @ {length}")
            if deadline is not None and time.monotonic() > (deadline if entry["points"] else began + time_budget_s):
                failed = failed or "time budget spent"
            if failed is not None:
                entry["points"].append({"context": length, "error": f"skipped: {failed}"})
            else:
                try:
                    entry["points"].append(measure_point(
                        model, length, batch=batch, decode_tokens=decode_tokens, repeats=repeats, device=device,
                        seed=seed, cuda_graphs=cuda_graphs, rates=rates, weights=entry["weight_bytes"]))
                except Exception as err:  # noqa: BLE001 - record the point and go on with the others
                    oom = is_oom(err)
                    message = "out of memory" if oom else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                    entry["points"].append({"context": length, "error": message})
                    if oom:
                        failed = "out of memory at a shorter context"
                    free_memory(device)
            bar.update(1)
            if on_update is not None:
                on_update(result)
        del model
        free_memory(device)
    bar.close()
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return result


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(result: dict) -> str:
    """The terminal table: one row per (model, context)."""
    rates = result["rates"]
    lines = [f"device {result['device']}, {result['dtype']}, batch {result['batch']}, backend {result['backend']}; "
             f"measured matmul {rates['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s, copy {rates['copy_bytes_per_s'] / 1e9:.1f} GB/s"]
    header = f"{'model':<22} {'context':>8} {'cold s':>9} {'prefill s':>10} {'floor s':>9} {'decode ms':>10} {'floor ms':>9} " \
             f"{'keep':>5} {'cache':>10} {'peak mem':>10}"
    lines += [header, "-" * len(header)]
    for entry in result["models"]:
        for p in entry["points"]:
            if "error" in p:
                lines.append(f"{entry['name']:<22} {p['context']:>8} {p['error']}")
                continue
            keep = "-" if p["keep_fraction"] is None else f"{p['keep_fraction']:.2f}"
            lines.append(f"{entry['name']:<22} {p['context']:>8} {p['cold_prefill_s']:>9.4f} {p['prefill_s']:>10.4f} "
                         f"{p['prefill_floor_s']:>9.4f} "
                         f"{p['decode_ms']:>10.3f} {p['decode_floor_ms']:>9.3f} {keep:>5} "
                         f"{human_bytes(p['cache_bytes']):>10} {human_bytes(p['peak_memory_bytes']):>10}")
    return "\n".join(lines)


def save_json(result: dict, path: Path) -> Path:
    return write_json(path, result, indent=1)


def plot(result: dict, path: Path) -> Path:
    """Two panels as the paper's Fig. 4: prefill s and decode ms per token against context; dotted: floors;
    dashed with crosses: the first (cold) prefill at each length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, entry in enumerate(result["models"]):
        ok = [p for p in entry["points"] if "error" not in p]
        if not ok:
            continue
        x = [p["context"] for p in ok]
        color = colors[i % len(colors)]
        left.plot(x, [p["prefill_s"] for p in ok], "o-", color=color, label=entry["name"])
        left.plot(x, [p["prefill_floor_s"] for p in ok], ":", color=color, linewidth=1)
        if all("cold_prefill_s" in p for p in ok):  # results written before the cold call was kept have none
            left.plot(x, [p["cold_prefill_s"] for p in ok], "x--", color=color, linewidth=1, alpha=0.6)
        right.plot(x, [p["decode_ms"] for p in ok], "o-", color=color, label=entry["name"])
        right.plot(x, [p["decode_floor_ms"] for p in ok], ":", color=color, linewidth=1)
    contexts = sorted({p["context"] for e in result["models"] for p in e["points"] if "error" not in p})
    for ax, title, unit in ((left, "Prefill", "time (s)"), (right, "Decode, per token", "time (ms)")):
        ax.set_xscale("log", base=2)
        if contexts:
            ax.set_xticks(contexts)
            ax.set_xticklabels([f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts], fontsize=8)
            ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    right.set_yscale("log")  # the memory floor sits decades below the measured step on a linear axis
    handles, labels = left.get_legend_handles_labels()
    if handles:
        left.legend(fontsize=8)
    fig.suptitle(f"{result['device']}, {result['dtype']}, batch {result['batch']} (dotted: compute / memory floor; "
                 "dashed: first, cold prefill)",
                 fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
