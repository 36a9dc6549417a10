"""The elementwise pieces of the layers, as pure functions that torch.compile fuses on the GPU.

Eager PyTorch runs an fp32 RMSNorm as about nine kernels, a short conv + SiLU as a copy, two
transposes, a depthwise convolution and an activation, and their backward passes as many again;
at the 800M shapes these memory passes cost more than the GDN op of the layer they sit in. Each
function here is written so that Inductor turns it into one or two kernels forward and backward.

`pointwise(fn)` keeps fn's eager behaviour on the CPU (tests, the quick start: compiling needs a
C++ toolchain there and buys little) and calls `torch.compile(fn)` on CUDA tensors. The compiled
and eager forms compute the same formula (fp32 inside, one rounding to the activation dtype at the
end); tests/test_pointwise.py holds the formulas against plain PyTorch on the CPU and the compiled
forms against the eager ones (on the GPU, and on the CPU with NATSL_COMPILE_POINTWISE=all).
`NATSL_COMPILE_POINTWISE=0` turns compilation off.
"""

from __future__ import annotations

from natsl import switches

import functools
import torch
import torch.nn.functional as F


def compile_for(x: torch.Tensor) -> bool:
    """NATSL_COMPILE_POINTWISE: "1" (default) compiles for CUDA tensors, "0" never, "all" on every
    device (the CPU tests use it to check the compiled forms without a GPU)."""
    mode = switches.current().compile_pointwise
    return mode == "all" or (mode != "0" and x.is_cuda)


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


def _up(t: torch.Tensor) -> torch.Tensor:
    """16-bit tensors to fp32 for the arithmetic; fp32 and fp64 stay as they are."""
    return t.float() if t.element_size() < 4 else t


def _normalize(xf: torch.Tensor, eps: float, mean: bool) -> torch.Tensor:
    square = xf.pow(2)
    total = square.mean(dim=-1, keepdim=True) if mean else square.sum(dim=-1, keepdim=True)
    return xf * torch.rsqrt(total + eps)


@pointwise
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None):
    """RMSNorm over the last dim in fp32, times `weight` when given, in `out_dtype` (default x's dtype)."""
    y = _normalize(_up(x), eps, mean=True)
    if weight is not None:
        y = y * _up(weight)
    return y.to(out_dtype or x.dtype)


@pointwise
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate), all in fp32, one rounding to x's dtype (gate broadcasts as x)."""
    y = _normalize(_up(x), eps, mean=True) * _up(weight)
    return (y * F.silu(_up(gate))).to(x.dtype)


@pointwise
def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (flash-linear-attention's l2norm), in x's dtype."""
    return _normalize(_up(x), eps, mean=False).to(x.dtype)


@pointwise
def conv_silu(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv + SiLU: x [B, T, C], tail [B, W-1, C] (the inputs before x), weight
    [C, 1, W] -> SiLU(conv) [B, T, C] in x's dtype.

    Written as W shifted multiply-adds in fp32 (what F.conv1d computes: y_t = sum_j w_j x_{t-W+1+j})
    so that the whole of it, and its backward, is a single fused kernel. Input t-W+1+j of output t
    comes from x where t-W+1+j >= 0 and from the tail before that; each shift is a pair of pads
    (masked loads) rather than slices of one concatenation, which Inductor would write to memory in
    full ([B, T+W-1, C]: a copy kernel beside the conv in a prefill profile). The new
    tail is not an output either (`conv_tail` makes it): a slice would also force that buffer.
    """
    width = weight.shape[-1]
    length = x.shape[1]
    tail = tail.to(x.dtype)
    w = _up(weight[:, 0, :])
    y = None
    for j in range(width):
        back = width - 1 - j  # how far output t reaches back for this tap
        from_x = F.pad(x, (0, 0, back, 0))[:, :length]  # x[t - back], zero for t < back
        from_tail = F.pad(tail[:, j:], (0, 0, 0, length - back))  # tail[t + j] for t < back, then zeros
        term = (_up(from_x) + _up(from_tail)) * w[:, j]
        y = term if y is None else y + term
    return F.silu(y).to(x.dtype)


def conv_tail(x: torch.Tensor, tail: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The last W-1 inputs after x: the tail [B, W-1, C] that the conv of the next tokens needs.
    Eager and small: only the last W-1 rows of x are read. `valid` ([1] int64 on the device, a
    padded prefill call's prompt length): the W-1 inputs before token `valid` instead, gathered
    on the device (no host read, so a CUDA graph serves every valid)."""
    width = tail.shape[1] + 1
    if valid is not None:
        recent = torch.cat([tail.to(x.dtype), x], dim=1)  # token t of x is row t + W-1
        return recent.index_select(1, valid + torch.arange(width - 1, device=x.device))
    recent = torch.cat([tail.to(x.dtype), x[:, max(x.shape[1] - (width - 1), 0):]], dim=1)
    return recent[:, recent.shape[1] - (width - 1):]


@pointwise
def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's gates from the a and b projections [B, T, H]: log decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32, and write strength beta = sigmoid(b) in b's dtype."""
    g = -_up(A_log).exp() * F.softplus(_up(a) + _up(dt_bias))
    return g, torch.sigmoid(_up(b)).to(b.dtype)


@pointwise
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def mix_weights(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Mixing logits [..., 2] (index 0: the softmax memory, 1: the GDN state) -> the two read weights, fp32."""
    if kind == "softmax":
        return torch.softmax(_up(logits), dim=-1)
    if kind == "sigmoid":
        return torch.sigmoid(_up(logits))
    if kind == "linear":
        return _up(logits)
    raise ValueError(f"no mixing weights for kind {kind!r}")


@pointwise
def mix_branches(o_la: torch.Tensor, o_nla: torch.Tensor, logits, kind: str, gate: torch.Tensor,
                 la_weight, nla_weight, out_weight, eps: float) -> torch.Tensor:
    """The NAtS-L read (docs/spec.md section 2, step 6) of the branch outputs o_la, o_nla [B, T, heads, Dv]:
    w_la RMSNorm_1(o_la) + w_nla RMSNorm_2(o_nla) with separate norms (la_weight, nla_weight; out_weight
    None), or RMSNorm(w_la o_la + w_nla o_nla) with one (out_weight); w from `logits` [B, T, heads, 2]
    by `kind` (mix_weights), or 1 when logits is None; times silu(gate) [B, T, heads * Dv]. fp32
    inside, rounded once to o_nla's dtype."""
    la, nla = _up(o_la), _up(o_nla)
    if logits is None:
        w_nla = w_la = 1.0
    else:
        w = mix_weights(logits, kind)
        w_nla, w_la = w[..., 0:1], w[..., 1:2]
    if out_weight is None:
        o = (w_la * (_normalize(la, eps, True) * _up(la_weight))
             + w_nla * (_normalize(nla, eps, True) * _up(nla_weight)))
    else:
        o = _normalize(w_la * la + w_nla * nla, eps, True) * _up(out_weight)
    o = o.reshape(gate.shape) * F.silu(_up(gate))
    return o.to(o_nla.dtype)
