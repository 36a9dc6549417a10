"""`pointwise(fn)`: a reference formula run through torch.compile on CUDA tensors (eagerly elsewhere).

Eager PyTorch runs an fp32 RMSNorm as about nine kernels, a short conv + SiLU as a copy, two
transposes, a depthwise convolution and an activation, and their backward passes as many again;
compiled, Inductor turns each formula into one or two kernels forward and backward. `pointwise(fn)`
keeps fn's eager behaviour on the CPU (tests, the quick start: compiling needs a C++ toolchain there
and buys little) and calls `torch.compile(fn)` on CUDA tensors. It lives here, below the models,
so that a door of natsl.ops (`short_conv`, `mix`) can hand the models the compiled reference twin
as its reference side; `natsl.models.pointwise` wraps the layers' other elementwise pieces with it.
`NATSL_COMPILE_POINTWISE` says when (`compile_for`); 0 turns compilation off.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from natsl import switches


_IN_DECODE_STEP = False


@contextlib.contextmanager
def decode_step_scope():
    """Marks the calls inside as one decode step (one token per sequence): see `compile_for`."""
    global _IN_DECODE_STEP
    outer, _IN_DECODE_STEP = _IN_DECODE_STEP, True
    try:
        yield
    finally:
        _IN_DECODE_STEP = outer


def compile_for(x: torch.Tensor) -> bool:
    """NATSL_COMPILE_POINTWISE: "auto" (default) compiles for CUDA tensors while autograd records and
    inside a decode step (`decode_step_scope`), "1" for CUDA tensors always, "0" never, "all" on every
    device (the CPU tests use it to check the compiled forms without a GPU).

    Why "auto" leaves a prefill eager: a fresh process pays dynamo's trace and Inductor's cache loads
    for every piece at its first call even with the on-disk caches full, several times a warm 128K
    prefill, while eagerly these pieces are a small share of that prefill. A decode step is the other
    way round: its dozens of tiny launches, replayed from a CUDA graph, cost more eagerly than
    compiled, and training gains the compiled backward fusions. The figures are in
    docs/performance.md, "First calls and short prompts"."""
    return compile_why(x)[0]


def compile_why(x: torch.Tensor) -> tuple[bool, str]:
    """`compile_for` and the rule that decided it (natsl.inference.kernel_table prints it).

    Args:
        x: the piece's first argument (only its device is read).

    Returns:
        (compiled, why): why a constant string naming NATSL_COMPILE_POINTWISE's value or the condition.
    """
    mode = switches.current().compile_pointwise
    if mode == "all":
        return True, "NATSL_COMPILE_POINTWISE=all"
    if mode == "0":
        return False, "NATSL_COMPILE_POINTWISE=0"
    if not x.is_cuda:
        return False, "not CUDA (NATSL_COMPILE_POINTWISE=all: also here)"
    if mode == "1":
        return True, "NATSL_COMPILE_POINTWISE=1"
    if _IN_DECODE_STEP:
        return True, "NATSL_COMPILE_POINTWISE=auto: a decode step"
    if torch.is_grad_enabled():
        return True, "NATSL_COMPILE_POINTWISE=auto: autograd records"
    return False, "NATSL_COMPILE_POINTWISE=auto: no gradients (prefill, evaluation) run eagerly"


RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    """Each function here is traced once per input rank, dtype, grad mode and None-ness of its
    optional arguments, and once more when a size first changes (it becomes symbolic then), which
    can pass dynamo's default limit of 8 graphs per function in one process (tests, prefill +
    decode); past the limit dynamo would run the function eagerly. Raise the limit, never lower it."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


def compile_dynamic() -> bool | None:
    """NATSL_POINTWISE_DYNAMIC: "auto" (default) keeps every tensor's last (feature) dim a constant and
    lets torch.compile make the other sizes symbolic only once they change (automatic dynamic
    shapes); "1" makes every size symbolic from the start, "0" none. Symbolic sizes cost speed: a kernel's index
    arithmetic then divides by runtime values (the short conv's kernel ran at a small fraction of
    the copy bandwidth with all sizes symbolic)."""
    mode = switches.current().pointwise_dynamic
    return None if mode == "auto" else mode != "0"


def _mark_feature_dims_static(args) -> None:
    """The last dim of every tensor argument is a model width: keep it a constant in the kernels,
    so that only batch and length may become symbolic (the conv's q/k and v widths differ, which
    would otherwise make the width symbolic on the second call)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            torch._dynamo.mark_static(arg, arg.dim() - 1)


def _mark_length_dynamic(args) -> None:
    """Without gradients (prefill, evaluation), the length dim (dim 1) of every activation argument
    ([B, T, ...], as the first argument) is symbolic from the first call: one graph serves every
    length, in this process and, through Inductor's on-disk cache, in the next ones, where
    automatic dynamic shapes would compile a static graph at the first length (keyed on it on
    disk) and a symbolic one at the second. Length 1 (decode) stays its own graph (dynamo always
    specialises sizes 0 and 1). Training keeps its static length (one length per run)."""
    first = args[0]
    if first.dim() < 3 or torch.is_grad_enabled():
        return
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() >= 3 and arg.shape[:2] == first.shape[:2]:
            torch._dynamo.maybe_mark_dynamic(arg, 1)


def pointwise(fn):
    """fn, run through torch.compile where `compile_for(first argument)` says so (CUDA, by default)."""
    compiled = dynamic = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled, dynamic
        # Inside a model that is itself being compiled, dynamo inlines the plain function.
        if not torch.compiler.is_compiling() and compile_for(args[0]):
            if compiled is None:
                _allow_recompiles()
                dynamic = compile_dynamic()
                compiled = torch.compile(fn, dynamic=dynamic)
            if dynamic is None:
                _mark_feature_dims_static(args)
                _mark_length_dynamic(args)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    run.eager = fn
    return run
