"""`DecodeRunner`: one token per sequence per call, as a replayed CUDA graph on CUDA.

At batch 1 a decode step of an 800M model is a few hundred small kernels; launched one by one from
Python they cost more than reading the weights. On CUDA the runner therefore captures
`CausalLM.decode_step` in a CUDA graph and replays it: the cache is allocated once (fixed addresses),
positions live on the device, and the only shape that changes is how many key slots attention reads,
which `ModelCache.prepare_decode` rounds up (`read_length`) so one graph serves many steps. A graph
is captured per (attention read, NAtS-L read) pair, after one eager step at that pair (the eager step
is a real step: it compiles the Triton kernels and its logits are used). If capture fails the runner
says so once on stderr and stays eager. On the CPU it is always eager.

A runner belongs to one cache (the graphs hold its addresses); `cache.reset()` keeps them valid.
"""

from __future__ import annotations

import sys

import torch

from natsl.models.merged import merge_


class DecodeRunner:
    def __init__(self, model, cache, *, cuda_graphs: bool | None = None):
        # A decode step reads every weight for one token: projections of the same input run as one
        # product (their weights re-pointed into one buffer, values and names unchanged).
        merge_(model)
        self.model = model
        self.cache = cache
        device = model.embed.weight.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else (cuda_graphs and device.type == "cuda")
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.captures = 0

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one per sequence, on the model's device) -> logits [B, vocab]; the cache advances."""
        cache = self.cache
        cache.check_room(1)
        ids = tokens.reshape(-1, 1)
        key = cache.prepare_decode()
        entry = self.graphs.get(key) if self.cuda_graphs else None
        if entry is None and not self.cuda_graphs:
            logits = self.model.decode_step(ids, cache)[:, -1]
        elif entry is None:
            # The warm-up before a capture is this real step, on a side stream as CUDA graphs want.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self.model.decode_step(ids, cache)[:, -1]
            torch.cuda.current_stream().wait_stream(side)
            logits = logits.clone()  # owned by the default stream from here on
            self._capture(key, ids)
        else:
            graph, static_ids, static_logits = entry
            static_ids.copy_(ids)
            graph.replay()
            logits = static_logits[:, -1].clone()
        cache.advance(1)
        return logits

    def _capture(self, key, ids) -> None:
        """Record decode_step at this read length (recording runs nothing, so the cache is unchanged)."""
        try:
            torch.cuda.synchronize()
            static_ids = ids.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = self.model.decode_step(static_ids, self.cache)
            self.graphs[key] = (graph, static_ids, static_logits)
            self.captures += 1
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to eager decoding
            self.cuda_graphs = False
            self.graphs.clear()
            print(f"note: CUDA graph capture failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                  "decoding eagerly", file=sys.stderr)
