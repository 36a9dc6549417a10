"""A NAtS-L layer's two memories, side by side on the GPU during a long prefill.

The GDN branch and the softmax branch read the same projections and meet again only in the
mixing, so a prefill can run the GDN branch on a second CUDA stream while the routed attention
runs on the caller's. The GDN state recurrence is sequential over blocks and at batch 1 fills
about half of the SMs (B x H x V/BV programs, 72 for the 800M layer); the attention's many tiles
take the other half. The side stream has the higher priority, so that the recurrence (the
critical path of its branch) gets SMs as soon as attention tiles retire.

Memory safety follows the caching allocator's rules: everything the side stream reads is held by
the caller until `join`, and the side stream waits on the caller's stream before each use, so a
block it allocates can only be reused after all earlier work of the caller's stream.

    side = overlap.side_stream(x, n_tokens)
    with overlap.running_on(side):
        ...GDN branch...
    ...softmax branch...
    overlap.join(side, x.device)

The switch prefill_overlap (NATSL_PREFILL_OVERLAP=0) turns it off (one stream, as before); `MIN_TOKENS` is the shortest call it
is used for (short calls are launch-bound: a second stream only adds events).
"""

from __future__ import annotations

import contextlib

import torch

from natsl import switches

MIN_TOKENS = 4096
_streams: dict[torch.device, torch.cuda.Stream] = {}


def enabled() -> bool:
    """The switch prefill_overlap (NATSL_PREFILL_OVERLAP)."""
    return switches.current().prefill_overlap


def applies_why(device: torch.device) -> tuple[bool, str]:
    """Whether a long prefill (MIN_TOKENS or more, outside a CUDA-graph capture) on `device` runs the
    branches on two streams, and the rule that decided it (natsl.inference.kernel_table prints it).

    Args:
        device: the device of the layer's tensors.

    Returns:
        (on, why): why a constant string naming the switch or condition.
    """
    if device.type != "cuda":
        return False, "not CUDA: one stream"
    if not enabled():
        return False, "NATSL_PREFILL_OVERLAP=0"
    return True, "CUDA, NATSL_PREFILL_OVERLAP on (calls of 4096+ tokens)"


def side_stream(x: torch.Tensor, n_tokens: int) -> torch.cuda.Stream | None:
    """A high-priority stream ordered after the caller's current work, or None where the branches
    should run in order: off CUDA, short calls, inside a CUDA-graph capture, or switched off."""
    if n_tokens < MIN_TOKENS or not applies_why(x.device)[0] or torch.cuda.is_current_stream_capturing():
        return None
    stream = _streams.get(x.device)
    if stream is None:
        stream = _streams[x.device] = torch.cuda.Stream(x.device, priority=-100)  # clamped to the highest
    stream.wait_stream(torch.cuda.current_stream(x.device))
    return stream


def running_on(stream: torch.cuda.Stream | None):
    """Context in which kernels launch on `stream` (or where they did, for None)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def join(stream: torch.cuda.Stream | None, device: torch.device) -> None:
    """Make the caller's stream wait for everything launched on `stream`."""
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)
