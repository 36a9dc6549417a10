"""Short prompts prefilled from CUDA graphs, one graph per length bucket.

A prefill of a short prompt is host-bound: hundreds of kernel launches (and the Python around
them) for a few milliseconds of GPU work. `PrefillGraphs` records the prefill of a padded prompt
into its own batch-1 cache as a CUDA graph per bucket length n (multiples of `QUANTUM` up to
`MAX_LEN`), and serves every prompt of n - QUANTUM + 1 .. n tokens from it:

1. the prompt goes into the graph's input buffer, followed by pads (token 0), and its length into
   a one-element device tensor;
2. the graph replays `CausalLM.prefill_padded` on the private cache: pads leave no trace in the
   states (zero GDN gates, conv tails gathered at the prompt's end, the NAtS-L router sum masked,
   the last routing block kept unfinished when the prompt ends inside it) and the logits are
   those of the prompt's last token;
3. the private cache is copied into the caller's (`transfer`: every state whole, K/V up to the
   prompt's length) and the caller's positions advance by the prompt's length.

The caller's cache therefore ends exactly as a plain prefill leaves it (up to K/V slots past the
prompt, which every read masks). With NAtS-L layers the quantum divides the block size, so every
pad of a bucket sits in the routing block of the prompt's last token (`prefill_padded`).

Used where it is exact and capturable: CUDA, no gradient, batch 1, an empty cache of the model's
dtype, 2 .. MAX_LEN tokens, the last token's logits only, every layer on the fused inference
kernels (the plain NAtS-L K/V store reads the device). Anything else, and everything with the
switch prefill_graphs off (NATSL_PREFILL_GRAPHS=0), takes `model.forward_cached`. The first
prompt of a bucket runs the padded prefill eagerly on a side stream (its result is used; it also
compiles the kernels) and then records the graph; later prompts of that bucket replay it. At
most MAX_GRAPHS graphs are kept (least recently used dropped), sharing one memory pool. A change
of weights (their addresses: `merge_`, loading, `.to`), of routing overrides, backends or switches
drops them all. If a capture fails the runner says so once on stderr and prefills plainly.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections import OrderedDict

import torch

from natsl import switches
from natsl.models.merged import merge_
from natsl.models.registry import any_routed, kinds_of

QUANTUM = 64  # bucket step in tokens (a divisor of the block size with NAtS-L layers: bucket_quantum)
MAX_LEN = 2048  # longest prompt served from a graph; longer prefills are GPU-bound
MAX_GRAPHS = 32  # graphs kept per model
KV_FIELDS = ("k", "v", "k_mem", "v_mem")  # per-token buffers [B, heads, capacity, D]: copied up to the prompt


def bucket_quantum(config) -> int:
    """Bucket step: QUANTUM, or its greatest common divisor with the block size when NAtS-L layers
    are present (then no multiple of the block size falls strictly inside a bucket)."""
    if any_routed(config):
        return math.gcd(QUANTUM, config.block_size)
    return QUANTUM


def bucket(length: int, quantum: int) -> int:
    """The bucket of a prompt of `length` tokens: `length` rounded up to a multiple of `quantum`."""
    return -(-length // quantum) * quantum


def transfer(src, dst, length: int) -> None:
    """Copy a prefilled batch-1 cache `src` into the empty cache `dst` (same model, dtype, batch 1)
    and advance `dst` by `length` tokens: every state whole, K/V buffers up to `length`, the keep
    budget's gaps over the blocks the prompt completed."""
    for s, d in zip(src.layers, dst.layers):
        targets = d.tensors()
        for name, t in s.tensors().items():
            if name in KV_FIELDS:
                targets[name][:, :, :length].copy_(t[:, :, :length])
            elif name == "keep_gaps":  # per block [B, groups, max blocks] (sized by each cache's max_len)
                blocks = length // src.positions.block_size
                targets[name][..., :blocks].copy_(t[..., :blocks])
            else:
                targets[name].copy_(t)
    dst.positions.pos.add_(length)
    dst.advance(length)


def _first_tensor(cache) -> torch.Tensor:
    return next(iter(cache.layers[0].tensors().values()))


class PrefillGraphs:
    """The graphed prefill of one model (see the module doc). `cuda_graphs=False` runs the same padded
    prefill and transfer eagerly (the CPU tests of the padding; no graph is recorded)."""

    def __init__(self, model, *, max_len: int = MAX_LEN, max_graphs: int = MAX_GRAPHS, cuda_graphs: bool = True):
        self.model = model
        self.device = model.embed.weight.device
        self.quantum = bucket_quantum(model.config)
        self.max_len = max(self.quantum, max_len - max_len % self.quantum)
        self.max_graphs = max_graphs
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.has_natsl = bool(model.natsl_layers())
        self.graphs: OrderedDict = OrderedDict()  # (n, partial_last) -> (graph, ids, valid, logits)
        self.pool = None
        self.captures = 0
        self.replays = 0
        self._private = None
        self._fingerprint = None

    def private(self):
        """The batch-1 cache the padded prefills run on (allocated on first use)."""
        if self._private is None:
            self._private = self.model.new_cache(1, max_len=self.max_len)
        return self._private

    def fingerprint(self) -> tuple:
        """What the recorded graphs depend on besides their inputs: weight addresses, routing
        overrides, backends and the switches in force."""
        model = self.model
        return (tuple(p.data_ptr() for p in model.parameters()),
                tuple(id(layer.route_override) for layer in model.natsl_layers().values()),
                tuple(getattr(m, "backend", None) for m in model.modules() if hasattr(m, "backend")),
                switches.current())

    def fits(self, ids: torch.Tensor, cache) -> bool:
        """Whether this prefill can be served here (else the plain path). A graph needs every layer
        on the fused inference kernels (the plain NAtS-L K/V store reads the device)."""
        length = ids.shape[1]
        # a KV press (natsl.inference.evict.observe) keeps queries from Python during the prefill, which a
        # replayed graph never runs: pressed prefills take the plain path
        observing = any(getattr(m, "observe", 0) for m in self.model.modules())
        return (not observing and not torch.is_grad_enabled() and cache.batch_size == 1 and 2 <= length <= self.max_len
                and ids.device == self.device and int(cache.positions.lengths[0]) == 0
                and cache.capacity >= length
                and _first_tensor(cache).dtype == self.model.embed.weight.dtype
                and (not self.cuda_graphs or all(block.kernels(ids.device).fused for block in self.model.layers)))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Prefill ids [1, T] into the empty `cache`; logits of the last token [1, 1, vocab]."""
        if not self.fits(ids, cache):
            return self.model.forward_cached(ids, cache, last_only=True)
        length = ids.shape[1]
        n = bucket(length, self.quantum)
        key = (n, self.has_natsl and length < n)
        if self.cuda_graphs:
            fingerprint = self.fingerprint()
            if fingerprint != self._fingerprint:
                self.graphs.clear()
                self._fingerprint = fingerprint
        entry = self.graphs.get(key)
        if entry is None:
            static_ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
            static_valid = torch.zeros(1, dtype=torch.long, device=self.device)
            self._fill(static_ids, static_valid, ids)
            logits = self._run_then_record(key, static_ids, static_valid)
        else:
            self.graphs.move_to_end(key)
            graph, static_ids, static_valid, static_logits = entry
            self._fill(static_ids, static_valid, ids)
            graph.replay()
            self.replays += 1
            logits = static_logits.clone()
        transfer(self.private(), cache, length)
        return logits

    @staticmethod
    def _fill(static_ids, static_valid, ids) -> None:
        length = ids.shape[1]
        static_ids[:, :length].copy_(ids)
        static_ids[:, length:].zero_()
        static_valid.fill_(length)

    def _call(self, key, static_ids, static_valid):
        return self.model.prefill_padded(static_ids, self.private(), static_valid, key[1])

    def _run_then_record(self, key, static_ids, static_valid) -> torch.Tensor:
        """The first prompt of a bucket: the padded prefill runs for real (on a side stream, as a
        capture wants its kernels compiled and its memory allocated beforehand), then the graph is
        recorded (recording runs nothing, so the private cache keeps this prompt's state)."""
        if not self.cuda_graphs:
            return self._call(key, static_ids, static_valid)
        merge_(self.model)  # as DecodeRunner will: re-pointing weights after a capture would drop the graphs
        self._fingerprint = self.fingerprint()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._call(key, static_ids, static_valid)
        torch.cuda.current_stream().wait_stream(side)
        logits = logits.clone()
        try:
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                static_logits = self._call(key, static_ids, static_valid)
            self.graphs[key] = (graph, static_ids, static_valid, static_logits)
            self.captures += 1
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to the plain prefill
            self.cuda_graphs = False
            self.graphs.clear()
            print(f"note: CUDA graph capture of a prefill failed ({type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}); prefilling without graphs", file=sys.stderr)
        return logits


_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

def padding_is_exact(config) -> bool:
    """Whether a padded prefill of this model leaves its cache as a plain prefill does: every layer kind
    says (natsl.models.registry: LayerKind.pad_exact). GDN, Mamba2 and NAtS-L (on every state) zero the
    pads' gates (a Mamba2 pad's dt too) and end their conv tails at the prompt, full attention masks the K/V
    slots past the prompt; a sliding window's ring buffer lets a pad overwrite a slot still in the window."""
    return all(kind.pad_exact for kind in kinds_of(config))


def applies_why(config, device: torch.device) -> tuple[bool, str]:
    """Whether a model of `config` on `device` prefills short prompts from CUDA graphs (`runner_for`),
    and the rule that decided it (natsl.inference.kernel_table prints it). A prompt is then served from
    a graph where `PrefillGraphs.fits` (batch 1, empty cache, every layer on the fused kernels).

    Args:
        config: the model's ModelConfig.
        device: the model's device.

    Returns:
        (on, why): why a constant string naming the switch or condition.
    """
    if not switches.current().prefill_graphs:
        return False, "NATSL_PREFILL_GRAPHS=0"
    if device.type != "cuda":
        return False, "not CUDA"
    if not padding_is_exact(config):
        return False, "a padded prefill is not exact (a sliding window)"
    return True, f"CUDA, NATSL_PREFILL_GRAPHS on: prompts of 2 to {MAX_LEN} tokens, batch 1, fused kernels"


def runner_for(model) -> PrefillGraphs | None:
    """The model's graphed prefill (made on first use), or None off CUDA, with prefill_graphs off, or
    for a model whose padded prefill would not be exact (`padding_is_exact`)."""
    if not applies_why(model.config, model.embed.weight.device)[0]:
        return None
    runner = _RUNNERS.get(model)
    if runner is None:
        runner = _RUNNERS[model] = PrefillGraphs(model)
    return runner


def prefill(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """`model.forward_cached(ids, cache, last_only=True)`, from a CUDA graph where that applies."""
    runner = runner_for(model)
    if runner is None:
        return model.forward_cached(ids, cache, last_only=True)
    return runner.prefill(ids, cache)
