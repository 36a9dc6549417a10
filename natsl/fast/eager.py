"""Eager calls of the fast ops, without the custom-op dispatcher.

Each fast op is a pair of torch.library custom ops joined by register_autograd, so that
torch.compile sees one opaque node. Called eagerly, the dispatcher's work is host time per call
that a batch-1 call at 4K cannot hide (the kernels there are as short as the host's work), so
eager calls take an autograd.Function built from the same forward, backward and autograd formula.
"""

from __future__ import annotations

import torch

_compiling = torch.compiler.is_compiling  # a module attribute, so that tests can pick the path


def twin(forward_impl, setup_context, backward, backward_impl) -> type[torch.autograd.Function]:
    """An autograd.Function that runs `forward_impl`, saves what `setup_context` saves, and
    differentiates with the custom op's formula `backward`, given `backward_impl` in place of the
    backward custom op (`backward(ctx, *grads, backward_op=...)`)."""

    class EagerTwin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = forward_impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads, backward_op=backward_impl)

    return EagerTwin


def run(custom_op, eager_twin: type[torch.autograd.Function], forward_impl, *inputs):
    """The op's outputs: through the custom op under torch.compile, through its eager twin when
    autograd needs a graph, and straight from `forward_impl` otherwise."""
    if _compiling():
        return custom_op(*inputs)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return eager_twin.apply(*inputs)
    return forward_impl(*inputs)
