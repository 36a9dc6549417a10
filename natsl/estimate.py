"""Before a long job starts: about how much memory and time it needs on a device, and the one step every
long command calls (`check_fits`): say so when the job is long or large, refuse when the device cannot
hold it (`--force` goes on anyway).

A job is a list of `Work` pieces run one after another (training steps, evaluation windows, prefills,
decode steps) on one model. Its estimate:

- memory (the peak of its pieces): the weights (in training also their gradients and the AdamW moments,
  all fp32, and on a GPU the bf16 copies autocast makes), the cache of a prefill or decode, and the
  activations. A layer keeps for its backward `SAVED` values per token and per unit of its width (the
  inputs and outputs of its linear maps and short convs, so that the count follows every dimension of
  the recipe); a forward without gradients holds one layer's `TRANSIENT` values at a time. On the
  reference and chunked backends a NAtS-L layer's routed attention is dense: `QUADRATIC_BYTES` per
  (query, key, softmax head) on top. The coefficients come from saved-tensor counts of the chunked forms
  and from the peak memory of the 800M recipes on an 80 GB card (docs/performance.md).
- time: per token the model's FLOPs (natsl.training.flops, natsl.models.state_cost) at `EFFICIENCY` of
  the device's matmul rate, or its memory traffic (`TRAFFIC` per unit of width) at the device's copy rate,
  whichever takes longer (on the CPU both rates are measured at the thread count in use, so that a busy
  machine gives a longer estimate); the dense routed attention's traffic (`QUADRATIC_TRAFFIC`); a decode
  step at least the bytes of its weights and cache over the copy rate; plus a fixed cost per layer call
  (Python and kernel launches: what small models spend most of their time on). A training step is three
  forwards and an AdamW pass over its fp32 state.

Meant to be within a small factor, never exact: commands use it to warn and to refuse before any work.
This module imports natsl.training.flops: only the commands (natsl.cli) import it.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from natsl.config import ModelConfig
from natsl.errors import NatslError

MODES = ("train", "forward", "prefill", "decode")

# Values per token per unit of layer width kept for the backward, in the activation dtype (fp32 on the
# CPU, bf16 under autocast on a GPU; the GPU's values fold in the fp32 pieces and the peak's transients),
# and values alive at once in one layer of a forward without gradients: each layer kind's `saved` and
# `transient` (natsl.models.registry), by device kind; a kind without its own values takes this one.
UNMEASURED = 2.0
# The dense routed attention (reference and chunked backends), per (query, key, softmax head): bytes
# of its logits, weights and masks (in training kept for the backward and met again there), and bytes
# of memory traffic its elementwise passes make.
QUADRATIC_BYTES = {"forward": 16, "saved": 17, "backward": 16}
QUADRATIC_TRAFFIC = 600
# Bytes of memory traffic per token per unit of layer width in a forward: many small elementwise ops on
# the CPU, fused kernels in bf16 on a GPU.
TRAFFIC = {"cpu": 75, "cuda": 8}
# Share of the measured (CPU) or peak (GPU) matmul rate that a model's work reaches.
EFFICIENCY = {"cpu": 0.3, "cuda": 0.3}
# Seconds of fixed cost per layer call: Python and small ops on the CPU, kernel launches on a GPU.
CALL_S = {"cpu": 1e-3, "cuda": 2e-4}
# A GPU's memory bandwidth (bytes/s) and, for a name natsl.training.flops.PEAK_BF16 does not list, its
# dense bf16 rate: conservative for the cards natsl runs on.
GPU_BANDWIDTH = 1.5e12
UNKNOWN_GPU_FLOPS = 100e12

# A job longer than this, or whose peak takes more than WARN_SHARE of the memory available, is said
# before it starts; one whose peak takes more than FIT_SHARE of it is refused (--force goes on).
LONG_S = 60.0
WARN_SHARE = 0.5
FIT_SHARE = 0.9


@dataclass(frozen=True)
class Work:
    """One piece of a job, run `calls` times.

    mode: "train" (forward and backward of `batch` x `tokens`, then AdamW; `calls` steps of `micro_batches`
    micro-batches each), "forward" (no gradients, no cache: evaluation windows), "prefill" (a prompt of
    `tokens` into a cache, `chunk` tokens per call) or "decode" (one token per sequence, the context
    growing to `tokens`)."""

    mode: str
    batch: int
    tokens: int
    calls: int = 1
    chunk: Optional[int] = None
    micro_batches: int = 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


@dataclass
class Estimate:
    """A job's estimate: `peak_bytes` of memory, `seconds` in all, and the memory's parts at the peak."""

    peak_bytes: float
    seconds: float
    parts: dict = field(default_factory=dict)


@dataclass
class ModelFacts:
    """What the estimate needs of a model, read from a copy built on the meta device (no memory)."""

    config: ModelConfig
    n_params: int
    widths: list  # (layer kind, width) per layer (natsl.models.registry.LayerKind)
    model: torch.nn.Module  # on the meta device: for the cache's size


def layer_width(layer: torch.nn.Module) -> int:
    """Inputs plus outputs of a layer's linear maps (2-D weights) and short convs (3-D weights, one channel
    in and out each)."""
    width = 0
    for p in layer.parameters():
        if p.dim() == 2:
            width += p.shape[0] + p.shape[1]
        elif p.dim() == 3:
            width += 2 * p.shape[0]
    return width


def model_facts(config: ModelConfig) -> ModelFacts:
    """The estimate's facts of a model config (built on the meta device: no memory, no weights)."""
    from natsl.models import build_model

    model = build_model(config, device="meta")
    widths = [(block.kind, layer_width(block)) for block in model.layers]
    return ModelFacts(config, model.num_parameters(), widths, model)


def device_class(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def median_seconds(fn, repeats: int) -> float:
    import statistics
    import time

    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


@functools.lru_cache(maxsize=None)
def measured_cpu_rates(threads: int) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) of this CPU now, at `threads` threads: a few milliseconds of small
    fp32 matmuls and copies, the median, so that the rates reflect what other processes leave."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 256
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n**3 / median_seconds(lambda: torch.matmul(a, b), 7)
        src = torch.empty(64 << 20, dtype=torch.uint8)  # beyond most caches
        dst = torch.empty_like(src)
        copy = 2 * src.numel() / median_seconds(lambda: dst.copy_(src), 5)
    finally:
        torch.set_num_threads(before)
    return flops, copy


@dataclass(frozen=True)
class DeviceRates:
    """How fast a device runs a model's work: FLOP/s reached, memory bytes/s, fixed cost per layer call."""

    flops_per_s: float
    bytes_per_s: float
    call_s: float


def device_rates(device: torch.device, threads: Optional[int] = None) -> DeviceRates:
    """The rates of `device` for the estimate (see the module doc); on the CPU at `threads` threads (default:
    torch's count now)."""
    from natsl.training.flops import peak_flops

    kind = device_class(device)
    if kind == "cuda":
        flops, bandwidth = peak_flops(device) or UNKNOWN_GPU_FLOPS, GPU_BANDWIDTH
    else:
        flops, bandwidth = measured_cpu_rates(threads or torch.get_num_threads())
    return DeviceRates(flops * EFFICIENCY[kind], bandwidth, CALL_S[kind])


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def cache_bytes(facts: ModelFacts, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes a cache for `batch` sequences of up to `tokens` allocates (built on the meta device); 0 for a
    model without one (NSA layers: the command that needs it says so itself)."""
    model = facts.model.to(dtype)
    try:
        return model.new_cache(batch, max_len=tokens).allocated_bytes()
    except NatslError:
        return 0


def routed_heads(config: ModelConfig) -> int:
    """Softmax heads of one NAtS-L layer."""
    return config.num_heads * config.softmax_heads_per_group


def dense_routes(facts: ModelFacts, backend: str) -> int:
    """NAtS-L layers whose routed attention is dense (every backend but fast)."""
    return 0 if backend == "fast" else sum(1 for layer, _ in facts.widths if layer.routed)


def train_bytes(facts: ModelFacts, work: Work, kind: str, backend: str, checkpointing: bool) -> dict:
    """Memory of a training step at its peak, by part."""
    c, p = facts.config, facts.n_params
    act = 4 if kind == "cpu" else 2
    tokens = work.batch * work.tokens
    state = p * 16 + (p * 2 if kind == "cuda" else 0)  # fp32 weights, gradients, two AdamW moments; bf16 copies
    per_layer = [layer.saved.get(kind, UNMEASURED) * w * act * tokens for layer, w in facts.widths]
    quadratic = work.batch * routed_heads(c) * work.tokens * work.tokens
    dense = dense_routes(facts, backend)
    if checkpointing:  # each layer keeps its input; one layer at a time is recomputed with everything
        saved = c.hidden_size * act * tokens * len(per_layer) + max(per_layer) \
            + (quadratic * QUADRATIC_BYTES["saved"] if dense else 0)
    else:
        saved = sum(per_layer) + dense * quadratic * QUADRATIC_BYTES["saved"]
    backward = (quadratic * QUADRATIC_BYTES["backward"] if dense else 0) + max(per_layer) / 2
    from natsl.training.loss import DEFAULT_CHUNK

    loss = 3 * min(DEFAULT_CHUNK, tokens) * c.vocab_size * 4  # a chunk of logits, its softmax and gradient
    return {"weights, gradients and optimizer": state, "activations": saved + backward + loss}


def forward_bytes(facts: ModelFacts, work: Work, kind: str, backend: str, dtype: torch.dtype) -> dict:
    """Memory of a forward without gradients (evaluation, prefill, decode) at its peak, by part."""
    c = facts.config
    size = dtype_bytes(dtype)
    parts = {"weights": facts.n_params * size}
    if work.mode in ("prefill", "decode"):
        parts["cache"] = cache_bytes(facts, work.batch, work.tokens, dtype)
    rows = 1 if work.mode == "decode" else min(work.chunk or work.tokens, work.tokens)
    act = 4 if kind == "cpu" else size
    layer = max(kinds.transient.get(kind, UNMEASURED) * w for kinds, w in facts.widths) * act * work.batch * rows
    quadratic = QUADRATIC_BYTES["forward"] * work.batch * routed_heads(c) * rows * work.tokens \
        if dense_routes(facts, backend) else 0
    parts["activations"] = layer + quadratic + work.batch * c.vocab_size * 4 * 2  # + the last logits
    return parts


def forward_seconds(facts: ModelFacts, kind: str, backend: str, rates: DeviceRates, keep: float, batch: int,
                    queries: int, context: int, pieces: int) -> float:
    """Seconds of a forward of `queries` new tokens per sequence at a context of up to `context` tokens, in
    `pieces` calls: the FLOPs or the memory traffic, whichever takes longer, the dense routed attention's
    traffic and the calls' fixed cost."""
    from natsl.training.flops import flops_per_token

    flops = flops_per_token(facts.config, max(context, 1), keep, facts.n_params) / 3  # a forward is a third
    traffic = sum(w for _, w in facts.widths) * TRAFFIC[kind]
    per_token = max(flops / rates.flops_per_s, traffic / rates.bytes_per_s)
    dense = dense_routes(facts, backend) * routed_heads(facts.config) * queries * context * QUADRATIC_TRAFFIC
    return batch * (queries * per_token + dense / rates.bytes_per_s) + pieces * len(facts.widths) * rates.call_s


def work_seconds(facts: ModelFacts, work: Work, kind: str, backend: str, rates: DeviceRates, keep: float,
                 parts: dict) -> float:
    """Seconds of a piece of work, all its calls."""
    if work.mode == "train":  # forward, backward (twice the forward), AdamW over the fp32 state
        forward = forward_seconds(facts, kind, backend, rates, keep, work.batch, work.tokens, work.tokens, 1)
        update = 3 * parts["weights, gradients and optimizer"] / rates.bytes_per_s
        return work.calls * (work.micro_batches * 3 * forward + update)
    if work.mode == "decode":  # a step reads every weight and the cache at least once
        compute = forward_seconds(facts, kind, "fast", rates, keep, work.batch, 1, 2 * work.tokens, 1)
        read = (parts.get("weights", 0) + parts.get("cache", 0)) / rates.bytes_per_s
        return work.calls * max(compute, read)
    chunk = min(work.chunk or work.tokens, work.tokens)
    return work.calls * forward_seconds(facts, kind, backend, rates, keep, work.batch, work.tokens, work.tokens,
                                        -(-work.tokens // chunk))


def estimate(config_or_facts, works: list[Work], device: torch.device, *, dtype: torch.dtype = torch.float32,
             backend: str = "chunked", keep: float = 1.0, checkpointing: bool = False,
             rates: Optional[DeviceRates] = None) -> Estimate:
    """Peak memory and time of `works` run one after another on one model.

    Args:
        config_or_facts: a `ModelConfig`, or `model_facts(config)` to build the meta copy once.
        works: the pieces of the job.
        device: where it runs (its class picks the coefficients).
        dtype: the weights' dtype of a forward (training keeps fp32 weights).
        backend: the ops' backend ("fast" reads no dense attention).
        keep: fraction of earlier blocks a NAtS-L layer reads (1: all).
        checkpointing: train.activation_checkpointing.
        rates: the device's rates (default: `device_rates(device)`).

    Returns:
        An `Estimate`: the peak over the pieces and the sum of their times.
    """
    facts = config_or_facts if isinstance(config_or_facts, ModelFacts) else model_facts(config_or_facts)
    kind = device_class(device)
    rates = rates or device_rates(device)
    peak, seconds, at_peak = 0.0, 0.0, {}
    for work in works:
        if work.mode == "train":
            parts = train_bytes(facts, work, kind, backend, checkpointing)
        else:
            parts = forward_bytes(facts, work, kind, backend, dtype)
        total = sum(parts.values())
        if total > peak:
            peak, at_peak = total, parts
        seconds += work_seconds(facts, work, kind, backend, rates, keep, parts)
    return Estimate(peak, seconds, at_peak)


# ----------------------------------------------------------------------------------------------- the check

def human_bytes(n: float) -> str:
    from natsl.inference.bench import human_bytes as readable

    return readable(n)


def human_duration(seconds: float) -> str:
    from natsl.eval.common import human_duration as readable

    return readable(seconds)


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes a new job can take on `device` now: free GPU memory (torch.cuda.mem_get_info), or on the CPU
    the memory the kernel calls available (psutil where it is installed, else /proc/meminfo); None where
    unknown (then nothing is refused)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def describe(est: Estimate) -> str:
    """"about 1.2 h, peak memory about 3.4 GB (weights 1.5 GB, cache 1.0 GB, activations 0.9 GB)"."""
    parts = ", ".join(f"{name} {human_bytes(size)}" for name, size in est.parts.items() if size >= 1)
    return f"about {human_duration(est.seconds)}, peak memory about {human_bytes(est.peak_bytes)} ({parts})"


def say(line: str) -> None:
    """A line on stderr that does not break a progress bar being drawn."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def check_fits(what: str, est: Estimate, device: torch.device, *, force: bool, fix: str,
               available: Optional[int] = None, held: int = 0, note: str = "",
               log: Callable[[str], None] = say) -> None:
    """The step every long command takes before its work: say the estimate when the job is long or large,
    refuse (NatslError, exit code 2) when its peak does not fit the memory available, unless `force`.

    Args:
        what: the job in a few words ("train 800m_hybrid: 100 steps of 8 x 4096 tokens").
        est: its `estimate`.
        device: where it runs.
        force: --force: go on after a warning instead of refusing.
        fix: what the user can change, said in the refusal ("lower --max-len").
        available: bytes the device has free (default: `available_memory(device)`; tests pass a small one).
        held: bytes of the estimate that this process already holds (a model loaded before the check).
        note: said after the estimate (what it assumes).
        log: where the lines go (default: stderr).
    """
    free = available_memory(device) if available is None else available
    need = max(est.peak_bytes - held, 0)
    where = f"{device.type}{'' if device.index is None else f':{device.index}'}"
    line = f"estimate for {what} on {where}: {describe(est)}{f' ({note})' if note else ''}"
    if free is not None and need > FIT_SHARE * free:
        if not force:
            raise NatslError(f"{what} needs about {human_bytes(need)} of memory at its peak (estimate) but {where} has "
                             f"{human_bytes(free)} available; {fix}, or pass --force to try anyway")
        log(f"{line}; {human_bytes(free)} available: more than it can hold, going on as --force asks")
        return
    if est.seconds > LONG_S or (free is not None and need > WARN_SHARE * free):
        room = f"; {human_bytes(free)} available" if free is not None else ""
        log(f"{line}{room}")
