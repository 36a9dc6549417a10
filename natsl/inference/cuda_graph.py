"""Record a function into a CUDA graph, warmed up first as graph capture requires."""

from __future__ import annotations

import torch


def capture(fn, *, warmups: int = 1, calls: int = 1):
    """Run `fn` `warmups` times on a side stream (so that kernels compile and memory is allocated
    outside the capture), then record `calls` calls of it into a CUDA graph.
    Returns (graph, what the last recorded call returned); replaying the graph refills that result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out
