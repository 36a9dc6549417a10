"""The op registry: ops x shapes x providers, forward or forward + backward, side by side.

    python -m benchmarks.ops --op gated_delta --provider natsl_fast,fla --mode fwd,fwdbwd --shapes 800m
    python -m benchmarks.ops --op routed_attention --keep 1 0.5 0.25 --shapes 800m,380m
    python -m benchmarks.ops --op mix --provider natsl_fast --mode fwdbwd --sweep      # launch settings
    python -m benchmarks.ops --list                                                     # the registry

Ops: gated_delta, gated_linear (Mamba2's SSD), routed_attention, short_conv, mix, cross_entropy, decode_attention, gemv,
gemv_fold (a decode step's norms and convs inside the GEMV, against their own kernels then the GEMV), pointwise.
Providers: natsl_fast (the Triton path), natsl_fast_dense (gated_delta, gated_linear without a write mask, as fla
runs it), natsl_unfused (gemv_fold: the fast norm or conv kernel and the GEMV kernel, one launch each), natsl_reference (natsl's PyTorch path: the chunked GDN, the
dense routed attention, the model's pointwise formulas -- compiled on CUDA), fla
(flash-linear-attention), sdpa_flash and sdpa_cudnn (causal SDPA with that backend), cublas
(F.linear). A provider that is not installed, or does not apply to an op, mode or shape, is skipped
with one line. `--shapes` takes recipe names or paths (800m = 800m_hybrid, 380m = 380m_hybrid, tiny =
tiny_hybrid): the op's tensors take that model's widths; `--lengths` / `--batch` replace the op's
default (batch, length) points. Before timing, every provider's output at a point is compared with
the first provider's that ran there (relative RMS, forward output; the row keeps how long those first
calls took, compiles and autotuning included, as `first_call_s`; in fwdbwd also the worst of the
gradients, for one fixed upstream gradient). `--fla-unguarded` runs fla's backward where its issue-640
guard would refuse it (Hopper, Triton 3.4-3.7.0): the gradient comparison then says whether it computed. `--sweep` times natsl_fast under
each of the op's other launch settings too, each checked against the default's output. `--graph` times
forwards as CUDA graph replays, so that a small op whose Python launch cost exceeds its GPU time is
measured by the GPU's time, as it runs inside a model compiled with CUDA graphs. `--profile` adds each
provider's slowest kernels per call (torch.profiler; operators on the CPU) to the table's log and the JSON.
Results: OUT/ops_<op>.json and .png (median ms per provider; the table also gives each provider's
time over the first provider's).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from benchmarks import common

MODES = ("fwd", "fwdbwd")
PROVIDERS = ("natsl_fast", "natsl_fast_dense", "natsl_unfused", "natsl_reference", "fla", "sdpa_flash", "sdpa_cudnn",
             "cublas")
LABELS = ("keep", "channels", "product", "piece")  # the variant fields that name a point
SEQUENCE_POINTS = ((1, 4096), (1, 16384), (1, 65536), (8, 4096))
EPS = 1e-6


class Skip(Exception):
    """A provider that does not apply here: the reason is printed, nothing is timed."""


@dataclass
class Point:
    """One shape of an op: the model whose widths it takes, a batch, a length and the op's variant."""

    shape: str
    model: object  # natsl.config.ModelConfig
    batch: int
    length: int
    variant: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.variant.items() if k in LABELS)
        return f"{self.shape} {self.batch}x{self.length}{extra}"


@dataclass
class Call:
    """What a provider times: fn(*args); `grads` are the args differentiated in fwdbwd; `out` picks the
    tensor the backward starts from (and the one compared across providers)."""

    fn: Callable
    args: list
    grads: list = field(default_factory=list)
    out: Callable = lambda result: result
    graph: bool = False  # time by CUDA-graph replay (decode-sized work)


@dataclass
class Op:
    name: str
    providers: dict  # provider name -> build(inputs, point, mode) -> Call (raises Skip)
    inputs: Callable  # (point, device, dtype) -> dict of tensors
    points: tuple = SEQUENCE_POINTS
    variants: Callable = lambda model, args: [{}]
    modes: tuple = MODES
    sweep: Optional[tuple] = None  # (module, [settings]); a setting maps a module attribute to a value or dict update


def _torch():
    import torch

    return torch


def _needs_cuda(device) -> None:
    if device.type != "cuda":
        raise Skip("needs a CUDA device")


def _module(name: str, what: str):
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise Skip(f"{what} is not installed ({err})") from None


# ---------------------------------------------------------------------------------------------- gated_delta
def gdn_inputs(p: Point, device, dtype):
    torch, F = _torch(), _torch().nn.functional
    m, (B, T) = p.model, (p.batch, p.length)
    H, K, V = m.num_heads, m.head_k_dim, m.head_v_dim
    return {"q": F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype),
            "k": F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype),
            "v": torch.randn(B, T, H, V, device=device, dtype=dtype),
            "g": F.logsigmoid(torch.randn(B, T, H, device=device) + 2.0),
            "beta": torch.sigmoid(torch.randn(B, T, H, device=device)).to(dtype),
            "write": torch.randint(0, 2, (B, -(-T // m.block_size), H), device=device).float()}


def gdn_natsl(backend, masked=True):
    def build(x, p, mode):
        import natsl.ops

        if backend == "fast":
            _needs_cuda(x["q"].device)
        args = [x["q"], x["k"], x["v"], x["g"], x["beta"]]
        write = x["write"] if masked else None
        return Call(lambda *a: natsl.ops.gated_delta_rule(*a, write, block_size=p.model.block_size,
                                                          backend=backend)[0], args, grads=args)
    return build


def fla_ops(name: str, mode: str):
    """flash-linear-attention's op module; its backward on Hopper with Triton 3.4-3.7.0 refuses to run (its
    issue 640: a miscompiled gated dq/dk/dg kernel) unless --fla-unguarded lifted that guard."""
    module = _module(name, "flash-linear-attention")
    if mode == "fwdbwd" and FLA_UNGUARDED:
        import natsl.fast  # noqa: F401 - pins the ptxas (natsl/fast/toolchain.py) before fla's kernels compile
        from fla.ops.common import chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True  # the guard's only condition this process can change
    return module


FLA_UNGUARDED = False  # set by --fla-unguarded


def gdn_fla(x, p, mode):
    _needs_cuda(x["q"].device)
    fla = fla_ops("fla.ops.gated_delta_rule", mode)
    args = [x["q"], x["k"], x["v"], x["g"], x["beta"]]
    # FLA's rule has no write mask: every block writes (the dense work natsl's mask can only reduce)
    return Call(lambda *a: fla.chunk_gated_delta_rule(*a, scale=p.model.head_k_dim ** -0.5)[0], args, grads=args)


# ----------------------------------------------------------------------------------------- routed_attention
def attention_dims(m) -> tuple[int, int, int]:
    """(heads, Dk, Dv) of a NAtS-L layer's softmax branch: each GDN head cut into softmax heads."""
    s = m.softmax_heads_per_group
    return m.num_heads * s, m.head_k_dim // s, m.head_v_dim // s


def routed_inputs(p: Point, device, dtype):
    torch = _torch()
    m, (B, T) = p.model, (p.batch, p.length)
    H, Dk, Dv = attention_dims(m)
    NB, fraction = -(-T // m.block_size), p.variant.get("keep", 1.0)
    order = torch.rand(B, NB, m.num_heads).argsort(dim=1).argsort(dim=1)  # a random rank per block
    return {"q": torch.randn(B, T, H, Dk, device=device, dtype=dtype),
            "k": torch.randn(B, T, H, Dk, device=device, dtype=dtype),
            "v": torch.randn(B, T, H, Dv, device=device, dtype=dtype),
            "keep": (order < round(fraction * NB)).float().to(device)}  # exactly that fraction per (batch, group)


def routed_natsl(backend):
    def build(x, p, mode):
        import natsl.ops

        if backend == "fast":
            _needs_cuda(x["q"].device)
        args = [x["q"], x["k"], x["v"], x["keep"]]
        return Call(lambda *a: natsl.ops.routed_attention(*a, block_size=p.model.block_size, backend=backend), args,
                    grads=args)
    return build


def sdpa(backend_name):
    """Dense causal SDPA in its [B, H, T, D] layout, at the branch's heads with Dv = Dk (flash needs equal
    head dims): what a softmax layer of that width costs, whatever the keep fraction."""
    def build(x, p, mode):
        torch = _torch()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if backend_name == "CUDNN_ATTENTION":
            _needs_cuda(x["q"].device)
        if p.variant.get("keep", 1.0) != 1.0:
            raise Skip("dense: timed at keep 1 only")
        Dk = x["q"].shape[-1]
        q, k, v = (t[..., :Dk].transpose(1, 2).contiguous() for t in (x["q"], x["k"], x["v"]))

        def fn(q, k, v):
            with sdpa_kernel([getattr(SDPBackend, backend_name)]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return Call(fn, [q, k, v], grads=[q, k, v])
    return build


# ----------------------------------------------------------------------------------------------- short_conv
def conv_inputs(p: Point, device, dtype):
    torch = _torch()
    C = p.variant["channels"]
    return {"x": torch.randn(p.batch, p.length, C, device=device, dtype=dtype),
            "w": 0.5 * torch.randn(C, 1, p.model.conv_size, device=device),
            "tail": torch.zeros(p.batch, p.model.conv_size - 1, C, device=device, dtype=dtype)}


def conv_fast(x, p, mode):
    _needs_cuda(x["x"].device)
    from natsl.fast.short_conv import short_conv_silu

    return Call(short_conv_silu, [x["x"], x["w"]], grads=[x["x"], x["w"]])


def conv_reference(x, p, mode):
    from natsl.models import pointwise

    return Call(pointwise.conv_silu, [x["x"], x["w"], x["tail"]], grads=[x["x"], x["w"]])


# ---------------------------------------------------------------------------------------------------- mix
def mix_inputs(p: Point, device, dtype):
    torch = _torch()
    H, _, Dv = attention_dims(p.model)
    shape = (p.batch, p.length, H)
    return {"o_la": torch.randn(*shape, Dv, device=device, dtype=dtype),
            "o_nla": torch.randn(*shape, Dv, device=device, dtype=dtype),
            "logits": torch.randn(*shape, 2, device=device, dtype=dtype),
            "gate": torch.randn(p.batch, p.length, H * Dv, device=device, dtype=dtype),
            "w1": 1 + 0.1 * torch.randn(Dv, device=device), "w2": 1 + 0.1 * torch.randn(Dv, device=device)}


def mix_args(x):
    return [x["o_la"], x["o_nla"], x["logits"], x["gate"], x["w1"], x["w2"]]


def mix_fast(x, p, mode):
    _needs_cuda(x["o_la"].device)
    from natsl.fast import mix

    args = mix_args(x)
    return Call(lambda *a: mix.mix_branches(*a, EPS), args, grads=args)


def mix_reference(x, p, mode):
    from natsl.models import pointwise

    args = mix_args(x)
    return Call(lambda la, nla, lg, gt, w1, w2: pointwise.mix_read(la, nla, lg, "softmax", gt, w1, w2, None, EPS),
                args, grads=args)


# ------------------------------------------------------------------------------------------- cross_entropy
def loss_inputs(p: Point, device, dtype):
    torch = _torch()
    m, rows = p.model, p.batch * p.length
    return {"hidden": torch.randn(rows, m.hidden_size, device=device, dtype=dtype),
            "weight": 0.02 * torch.randn(m.vocab_size, m.hidden_size, device=device),
            "ids": torch.randint(0, m.vocab_size, (rows,), device=device)}


def loss(fused):
    def build(x, p, mode):
        from natsl.training.loss import linear_cross_entropy

        if fused:
            _needs_cuda(x["hidden"].device)
        torch = _torch()
        on_cuda = x["hidden"].device.type == "cuda"

        def fn(hidden, weight, ids):  # under autocast, as `natsl train` runs the head
            with torch.autocast(x["hidden"].device.type, dtype=torch.bfloat16, enabled=on_cuda):
                return linear_cross_entropy(hidden, weight, ids, fused=fused)
        return Call(fn, [x["hidden"], x["weight"], x["ids"]], grads=[x["hidden"], x["weight"]])
    return build


# ---------------------------------------------------------------------------------------- decode_attention
def decode_inputs(p: Point, device, dtype):
    """One query per sequence over a cache of `length` keys, at the Transformer layer's heads."""
    torch = _torch()
    m, B, L = p.model, p.batch, p.length
    H, D = m.attn_num_heads, m.attn_head_dim
    return {"q": torch.randn(B, 1, H, D, device=device, dtype=dtype),
            "keys": torch.randn(B, H, L, D, device=device, dtype=dtype),
            "values": torch.randn(B, H, L, D, device=device, dtype=dtype),
            "visible": torch.full((B, H), L, device=device, dtype=torch.long)}


def decode_natsl(fast):
    def build(x, p, mode):
        args = [x["q"], x["keys"], x["values"], x["visible"]]
        if fast:
            _needs_cuda(x["q"].device)
            from natsl.fast.decode_attention import decode_attention as fn
        else:
            from natsl.reference.cached import attend_one as fn
        return Call(fn, args)
    return build


def decode_sdpa(backend_name):
    def build(x, p, mode):
        torch = _torch()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if backend_name == "CUDNN_ATTENTION":
            _needs_cuda(x["q"].device)
        q = x["q"].transpose(1, 2)

        def fn(q, k, v):  # every key visible: no mask
            with sdpa_kernel([getattr(SDPBackend, backend_name)]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return Call(fn, [q, x["keys"], x["values"]])
    return build


# --------------------------------------------------------------------------------------------- decode_step
def step_variants(m, args) -> list[dict]:
    """A GDN layer's decode step and Mamba2's at the model's widths (Mamba2: heads of 64 over expand x d,
    state 128, one B/C group)."""
    d = m.hidden_size
    return [{"layer": "gdn", "H": m.num_heads, "K": m.head_k_dim, "V": m.head_v_dim, "G": m.num_heads},
            {"layer": "mamba2", "H": m.mamba2_expand * d // 64, "K": 128, "V": 64, "G": 1}]


def step_inputs(p: Point, device, dtype):
    """One token's post-conv projections (q, k per head or group; v per head), its gate inputs, the per-head
    parameters (fp32) and enough fp32 states (>= 256 MB on CUDA) that each call reads its own from memory."""
    torch = _torch()
    v, B = p.variant, p.batch
    H, K, V, G = v["H"], v["K"], v["V"], v["G"]
    copies = max(1, -(-(256 << 20) // (B * H * K * V * 4))) if device.type == "cuda" else 1
    return {"q": torch.randn(B, G * K, device=device, dtype=dtype), "k": torch.randn(B, G * K, device=device, dtype=dtype),
            "v": torch.randn(B, H * V, device=device, dtype=dtype), "a": torch.randn(B, H, device=device, dtype=dtype),
            "b": torch.randn(B, H, device=device, dtype=dtype), "A_log": torch.randn(H, device=device),
            "dt_bias": torch.randn(H, device=device), "D": torch.randn(H, device=device),
            "states": [0.1 * torch.randn(B, H, K, V, device=device) for _ in range(copies)]}


def step_build(fast):
    """natsl.fast.cached's decode step (natsl_fast) or its reference twin, on a fresh state each call."""
    def build(x, p, mode):
        if fast:
            _needs_cuda(x["q"].device)
            from natsl.fast import cached
        else:
            from natsl.reference import cached
        turn = iter(range(10 ** 9))

        def state():
            return x["states"][next(turn) % len(x["states"])]

        if p.variant["layer"] == "gdn":
            fn = lambda: cached.gdn_decode_step(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"],  # noqa: E731
                                                x["dt_bias"], state())
        else:
            fn = lambda: cached.gla_decode_step(x["q"], x["k"], x["v"], x["a"], x["A_log"], x["dt_bias"],  # noqa: E731
                                                state(), D=x["D"])
        return Call(fn, [], graph=fast)
    return build


# --------------------------------------------------------------------------------------------------- gemv
def gemv_products(m, args) -> list[dict]:
    """The decode step's products [N, K] at a model's widths."""
    H, K, V, d, Ha, Da = m.num_heads, m.head_k_dim, m.head_v_dim, m.hidden_size, m.attn_num_heads, m.attn_head_dim
    return [{"product": name, "N": n, "K": k} for name, n, k in (
        ("gdn q|k|v|g|a|b", 2 * H * K + 2 * H * V + 2 * H, d), ("gdn o", d, H * V),
        ("mlp gate|up", 2 * m.intermediate_size, d), ("mlp down", d, m.intermediate_size),
        ("attn q|k|v", 3 * Ha * Da, d), ("attn o", d, Ha * Da), ("lm head", m.vocab_size, d))]


def gemv_inputs(p: Point, device, dtype):
    """x [rows, K] and enough copies of the weight (>= 256 MB on CUDA) that the captured calls read each
    from memory rather than from L2, as a decode step does."""
    torch = _torch()
    N, K = p.variant["N"], p.variant["K"]
    copies = max(1, -(-(256 << 20) // (N * K * 2))) if device.type == "cuda" else 1
    return {"x": torch.randn(p.batch, K, device=device, dtype=dtype),
            "weights": [torch.randn(N, K, device=device, dtype=dtype) for _ in range(copies)]}


def gemv_call(linear):
    def fn(x, weights):
        turn = iter(range(10 ** 9))
        return lambda: linear(x, weights[next(turn) % len(weights)])
    return fn


def gemv_build(fast):
    def build(x, p, mode):
        torch = _torch()
        if fast:
            _needs_cuda(x["x"].device)
            from natsl.fast.gemv import linear
        else:
            linear = torch.nn.functional.linear
        call = gemv_call(linear)(x["x"], x["weights"])
        return Call(lambda: call(), [], graph=True)
    return build


# ---------------------------------------------------------------------------------------------- gemv_fold
FOLD_CONV = 3  # the short conv's tail: conv_size 4


def fold_pieces(m, args) -> list[dict]:
    """The decode step's folds (natsl.ops.gemv) at a model's widths: the piece and its product [N, K]."""
    H, K, V, d = m.num_heads, m.head_k_dim, m.head_v_dim, m.hidden_size
    gdn_in = 2 * H * K + 2 * H * V + 2 * H
    return [{"piece": name, "N": n, "K": k} for name, n, k in (
        ("add_norm gdn q|k|v|a|b|g", gdn_in, d), ("add_norm+conv gdn q|k|v|a|b|g", gdn_in, d),
        ("add_norm mlp gate|up", 2 * m.intermediate_size, d), ("o_norm gdn o", d, H * V),
        ("gated_input_norm mamba2 out", d, m.mamba2_expand * d))]


def fold_inputs(p: Point, device, dtype):
    """gemv_inputs' x and weight copies, and the fold's pieces: a residual, a gate, the norm weight (a head's
    for o_norm), the q, k, v convs' weights and tails."""
    torch = _torch()
    m, rows, K = p.model, p.batch, p.variant["K"]
    x = gemv_inputs(p, device, dtype)
    widths = [m.num_heads * m.head_k_dim] * 2 + [m.num_heads * m.head_v_dim]
    return {**x, "residual": torch.randn(rows, K, device=device, dtype=dtype),
            "gate": torch.randn(rows, K, device=device, dtype=dtype),
            "norm": 1 + 0.1 * torch.randn(m.head_v_dim if p.variant["piece"].startswith("o_norm") else K,
                                          device=device, dtype=dtype),
            "conv_weights": [torch.randn(c, 1, FOLD_CONV + 1, device=device, dtype=dtype) for c in widths],
            "tails": [torch.randn(rows, FOLD_CONV, c, device=device, dtype=dtype) for c in widths]}


def fold_build(fused: bool):
    """natsl_fast: the folded GEMV, one launch; natsl_unfused: the norm (and conv) kernels, then the GEMV."""
    def build(x, p, mode):
        _needs_cuda(x["x"].device)
        from natsl.fast import cached, gemv, norms

        piece, rows, eps = p.variant["piece"], p.batch, EPS
        tails = [t.clone() for t in x["tails"]]  # each provider steps its own
        turn = iter(range(10 ** 9))

        def weight():
            return x["weights"][next(turn) % len(x["weights"])]

        if piece.startswith("add_norm"):
            conv = (0, x["conv_weights"], tails) if "conv" in piece else None
            if fused:
                fn = lambda: gemv.add_norm_linear(x["x"], x["residual"], x["norm"], eps, weight(), conv=conv)  # noqa: E731
            else:
                def fn():
                    y = gemv.linear(norms.add_rms_norm(x["x"], x["residual"], x["norm"], eps)[1], weight())
                    if conv is None:
                        return y
                    pieces = y[:, None, :sum(t.shape[-1] for t in tails)].split([t.shape[-1] for t in tails], dim=-1)
                    return cached.conv_steps(list(pieces), tails, x["conv_weights"])
        elif piece.startswith("o_norm"):
            head = x["norm"].numel()
            if fused:
                fn = lambda: gemv.linear(x["x"], weight(), up=x["gate"], norm=(x["norm"], eps))  # noqa: E731
            else:
                heads = (rows, p.variant["K"] // head, head)
                fn = lambda: gemv.linear(norms.rms_norm(x["x"].view(heads), x["norm"], eps,  # noqa: E731
                                                        gate=x["gate"].view(heads)).view(rows, -1), weight())
        elif fused:
            fn = lambda: gemv.gated_input_norm_linear(x["x"], x["gate"], x["norm"], eps, weight())  # noqa: E731
        else:
            fn = lambda: gemv.linear(norms.gated_input_rms_norm(x["x"], x["norm"], eps, x["gate"]), weight())  # noqa: E731
        return Call(fn, [], graph=True)
    return build


# ---------------------------------------------------------------------------------------------- pointwise
def norm_pieces(m, args) -> list[dict]:
    """The model's norms at their row widths: (piece, row shape, has weight, has gate, L2)."""
    H, K, V, d = m.num_heads, m.head_k_dim, m.head_v_dim, m.hidden_size
    Hs, Dk, _ = attention_dims(m)
    return [{"piece": "block norm", "row": (d,), "weight": True, "gate": False, "l2": False},
            {"piece": "gdn q/k l2", "row": (H, K), "weight": False, "gate": False, "l2": True},
            {"piece": "gdn out norm x silu(gate)", "row": (H, V), "weight": True, "gate": True, "l2": False},
            {"piece": "softmax q/k norm", "row": (Hs, Dk), "weight": True, "gate": False, "l2": False}]


def norm_inputs(p: Point, device, dtype):
    torch = _torch()
    v, row = p.variant, p.variant["row"]
    x = torch.randn(p.batch * p.length, *row, device=device, dtype=dtype)
    return {"x": x, "weight": (1 + 0.1 * torch.randn(row[-1], device=device)) if v["weight"] else None,
            "gate": torch.randn_like(x) if v["gate"] else None}


def norm_fast(x, p, mode):
    _needs_cuda(x["x"].device)
    if mode == "fwdbwd":
        raise Skip("the fused norms are inference kernels (no backward)")
    from natsl.fast import norms

    return Call(lambda t: norms.rms_norm(t, x["weight"], EPS, x["gate"], mean=not p.variant["l2"]), [x["x"]])


def norm_reference(x, p, mode):
    from natsl.models import pointwise

    if p.variant["l2"]:
        fn = lambda t: pointwise.l2_normalize(t, EPS)  # noqa: E731
    elif p.variant["gate"]:
        fn = lambda t: pointwise.gated_rms_norm(t, x["weight"], EPS, x["gate"])  # noqa: E731
    else:
        fn = lambda t: pointwise.rms_norm(t, x["weight"], EPS)  # noqa: E731
    return Call(fn, [x["x"]], grads=[x["x"]])


def channel_variants(m, args) -> list[dict]:
    return [{"channels": m.num_heads * m.head_k_dim}, {"channels": m.num_heads * m.head_v_dim}]


def keep_variants(m, args) -> list[dict]:
    return [{"keep": k} for k in args.keep]


# ---------------------------------------------------------------------------------------------- gated_linear
# Mamba2's SSD at the model's width: expand 2, head dim 64 (V), state dim 128 (K), as the Mamba2 paper and
# flash-linear-attention's layer; q = C, k = B, v = x dt, g = A dt, scale 1.
SSD_EXPAND, SSD_HEAD_DIM, SSD_STATE = 2, 64, 128


def gla_inputs(p: Point, device, dtype):
    torch, F = _torch(), _torch().nn.functional
    m, (B, T) = p.model, (p.batch, p.length)
    H, K, V = SSD_EXPAND * m.hidden_size // SSD_HEAD_DIM, SSD_STATE, SSD_HEAD_DIM
    dt = F.softplus(torch.randn(B, T, H, device=device) - 4.0)
    return {"q": (torch.randn(B, T, H, K, device=device) * K**-0.5).to(dtype),
            "k": (torch.randn(B, T, H, K, device=device) * K**-0.5).to(dtype),
            "v": (torch.randn(B, T, H, V, device=device) * dt[..., None]).to(dtype),
            "g": -torch.rand(H, device=device).mul(15).add(1) * dt,
            "write": torch.randint(0, 2, (B, -(-T // m.block_size), H), device=device).float()}


def gla_natsl(backend, masked=True):
    def build(x, p, mode):
        import natsl.ops

        if backend == "fast":
            _needs_cuda(x["q"].device)
        args = [x["q"], x["k"], x["v"], x["g"]]
        write = x["write"] if masked else None
        return Call(lambda *a: natsl.ops.gated_linear_rule(*a, write, scale=1.0, block_size=p.model.block_size,
                                                           backend=backend)[0], args, grads=args)
    return build


def gla_fla(x, p, mode):
    _needs_cuda(x["q"].device)
    fla = fla_ops("fla.ops.simple_gla", mode)
    args = [x["q"], x["k"], x["v"], x["g"]]
    # FLA's chunk_simple_gla has no write mask: every block writes (compare natsl_fast_dense)
    return Call(lambda *a: fla.chunk_simple_gla(*a, scale=1.0)[0], args, grads=args)


def _settings(**groups) -> list[dict]:
    """{attribute: [update, ...]} -> one setting per update."""
    return [{name: update} for name, updates in groups.items() for update in updates]


REGISTRY = {op.name: op for op in (
    Op("gated_delta", {"natsl_fast": gdn_natsl("fast"), "natsl_fast_dense": gdn_natsl("fast", masked=False),
                       "natsl_reference": gdn_natsl("chunked"), "fla": gdn_fla},
       gdn_inputs,
       sweep=("natsl.fast.gated_delta.config", _settings(
           PREPARE=[{"num_warps": 4}], STATE_FWD=[{"num_stages": 2}, {"BV_WIDE": 32}],
           OUTPUT=[{"BV": 32}, {"num_warps": 8}], LOCAL_DR=[{"BV": 32}],
           STATE_BWD=[{"BV_WIDE": 32}], GRAD_QK=[{"num_warps": 8}, {"BV": 64}], GRAD_WY=[{"descriptors": False}]))),
    Op("gated_linear", {"natsl_fast": gla_natsl("fast"), "natsl_fast_dense": gla_natsl("fast", masked=False),
                        "natsl_reference": gla_natsl("chunked"), "fla": gla_fla},
       gla_inputs,
       sweep=("natsl.fast.gated_linear.config", _settings(
           STATE_FWD=[{"BV": 32}, {"BV": 32, "K_SPLIT": 1}, {"BV": 16}, {"num_stages": 2}, {"K_SPLIT": 1},
                      {"K_SPLIT": 2}, {"K_SPLIT": 4}, {"num_warps": 8}, {"num_stages": 4}, {"num_stages_split": 3},
                      {"num_stages_split": 5}, {"num_warps_split": 4}],
           STATE_BWD=[{"BV": 64}, {"BV": 16}], CUMSUM=[{"BH": 8}, {"BH": 32}, {"num_warps": 1}, {"num_warps": 4}],
           OUTPUT=[{"BV": 32}, {"num_warps": 8}, {"num_stages": 3}, {"num_stages": 1}],
           DV=[{"BV": 32}, {"num_warps": 8}], GRAD_QK=[{"num_warps": 8}, {"BV": 64}]))),
    Op("routed_attention", {"natsl_fast": routed_natsl("fast"), "natsl_reference": routed_natsl("chunked"),
                            "sdpa_flash": sdpa("FLASH_ATTENTION"), "sdpa_cudnn": sdpa("CUDNN_ATTENTION")},
       routed_inputs, variants=keep_variants,
       sweep=("natsl.fast.block_sparse.config", _settings(
           USE_DESCRIPTORS=[False], FORWARD=[{"BLOCK_N": 128, "num_stages": 2}, {"BLOCK_M": 64}, {"num_warps": 8}],
           FORWARD_SMALL_DV=[{"BLOCK_N": 64, "num_stages": 3}, {"num_warps": 8}],
           BACKWARD_DQ=[{"BLOCK_M": 64}, {"num_stages": 3}, {"num_warps": 8}],
           BACKWARD_DKDV=[{"BLOCK_M": 32}, {"num_warps": 8}]))),
    Op("short_conv", {"natsl_fast": conv_fast, "natsl_reference": conv_reference}, conv_inputs,
       points=((8, 4096), (1, 131072)), variants=channel_variants,
       sweep=("natsl.fast.short_conv", _settings(
           FORWARD_TILE=[(64, 128), (32, 64)], BACKWARD_TILES=[{"walk": (64, 128, 1)}, {"walk": (128, 64, 1)},
                                                               {"walk": (64, 256, 2)}]))),
    Op("mix", {"natsl_fast": mix_fast, "natsl_reference": mix_reference}, mix_inputs,
       points=((8, 4096), (1, 131072)),
       sweep=("natsl.fast.mix", _settings(BACKWARD=[
           {"BLOCK_ROWS": r, "num_warps": w, "PROGRAMS_PER_SM": s}
           for r, w, s in ((16, 1, 8), (8, 2, 8), (32, 4, 8), (8, 1, 16), (16, 2, 16))]))),
    Op("cross_entropy", {"natsl_fast": loss(True), "natsl_reference": loss(False)}, loss_inputs,
       points=((8, 4096),)),
    Op("decode_attention", {"natsl_fast": decode_natsl(True), "natsl_reference": decode_natsl(False),
                            "sdpa_flash": decode_sdpa("FLASH_ATTENTION"), "sdpa_cudnn": decode_sdpa("CUDNN_ATTENTION")},
       decode_inputs, points=((1, 4096), (1, 16384), (1, 65536), (1, 131072)), modes=("fwd",),
       sweep=("natsl.fast.decode_attention", _settings(PROGRAMS_PER_SM_NARROW=[8, 32], PROGRAMS_PER_SM=[2, 4]))),
    Op("decode_step", {"natsl_fast": step_build(True), "natsl_reference": step_build(False)}, step_inputs,
       points=((1, 1), (4, 1)), variants=step_variants, modes=("fwd",),
       sweep=("natsl.fast.cached", _settings(STEP_TILES=[{"gdn": w} for w in (64, 32, 16)] + [{"gla": w} for w in (64, 32, 16)]))),
    Op("gemv", {"natsl_fast": gemv_build(True), "cublas": gemv_build(False)}, gemv_inputs,
       points=((1, 1), (2, 1)), variants=gemv_products, modes=("fwd",)),
    Op("gemv_fold", {"natsl_fast": fold_build(True), "natsl_unfused": fold_build(False)}, fold_inputs,
       points=((1, 1), (2, 1)), variants=fold_pieces, modes=("fwd",),
       sweep=("natsl.fast.gemv", _settings(FOLD_TILES=[{"output_norm": (4, 512)}, {"output_norm": (8, 512)},
                                                       {"row_norm": (4, 1024)}, {"row_norm": (8, 512)}]))),
    Op("pointwise", {"natsl_fast": norm_fast, "natsl_reference": norm_reference}, norm_inputs,
       points=((1, 131072), (8, 4096)), variants=norm_pieces,
       sweep=("natsl.fast.norms", _settings(RMS_LAUNCH=[{"pdl": False}, {"rows": 4}, {"rows": 32},
                                                              {"rows": 64, "warps": 8}]))),
)}


@contextlib.contextmanager
def applied(module, setting: dict):
    """The module's attributes set (values) or updated (dicts) as `setting` says, restored afterwards."""
    saved = {}
    try:
        for name, value in setting.items():
            current = getattr(module, name)
            saved[name] = dict(current) if isinstance(current, dict) else current
            if isinstance(current, dict):
                current.update(value)
            else:
                setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            current = getattr(module, name)
            if isinstance(current, dict):
                current.clear()
                current.update(value)
            else:
                setattr(module, name, value)


def setting_label(setting: dict) -> str:
    return ",".join(f"{name}={value}" for name, value in setting.items()).replace(" ", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", help=f"one of {', '.join(REGISTRY)}, or 'all'")
    parser.add_argument("--provider", default=None, help=f"comma list of {', '.join(PROVIDERS)} (default: all of the op's)")
    parser.add_argument("--mode", default=",".join(MODES), help="fwd, fwdbwd or both (comma list)")
    parser.add_argument("--shapes", default="800m", help="comma list of 800m, 380m, tiny or recipe names / paths")
    parser.add_argument("--lengths", type=int, nargs="+", help="replace the op's default lengths")
    parser.add_argument("--batch", type=int, help="replace the op's default batch sizes")
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5, 0.25], help="routed_attention's keep fractions")
    parser.add_argument("--sweep", action="store_true", help="also time natsl_fast under the op's other launch settings")
    parser.add_argument("--profile", action="store_true",
                        help="also trace each provider's call (torch.profiler) and list its slowest kernels, ms per call")
    parser.add_argument("--graph", action="store_true",
                        help="time forwards as CUDA graph replays: the GPU's time without Python's launch cost, as a "
                             "model compiled with CUDA graphs runs the op (fwdbwd is timed as usual)")
    parser.add_argument("--fla-unguarded", action="store_true",
                        help="run flash-linear-attention's backward where its issue-640 guard refuses it (Hopper, "
                             "Triton 3.4-3.7.0), under the ptxas natsl pins; fwdbwd compares every gradient with the "
                             "first provider's, so a miscompile shows in the table")
    parser.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--list", action="store_true", help="print the registry and exit")
    common.add_out_argument(parser)
    return parser


def parse(argv=None) -> argparse.Namespace:
    """The parsed options, validated: unknown ops, providers or modes are refused by name."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        return args
    ops = list(REGISTRY) if args.op == "all" else [args.op]
    if not args.op or any(o not in REGISTRY for o in ops):
        parser.error(f"--op must be one of {', '.join(REGISTRY)} or all, got {args.op!r}")
    args.ops = ops
    args.providers = [p for p in (args.provider or ",".join(PROVIDERS)).split(",") if p]
    args.modes = [m for m in args.mode.split(",") if m]
    for name, given, known in (("--provider", args.providers, PROVIDERS), ("--mode", args.modes, MODES)):
        unknown = [g for g in given if g not in known]
        if unknown or not given:
            parser.error(f"{name} takes a comma list of {', '.join(known)}, got {','.join(given) or 'nothing'}")
    if not all(0.0 <= k <= 1.0 for k in args.keep):
        parser.error("--keep fractions lie in [0, 1]")
    return args


def points(op: Op, args) -> list[Point]:
    """Every (shape, batch, length, variant) the op runs at with these options."""
    import natsl

    out = []
    for shape in [s for s in args.shapes.split(",") if s]:
        model = natsl.load_recipe(common.PRESETS.get(shape, shape)).model
        sizes = op.points
        if args.lengths or args.batch:
            lengths = args.lengths or sorted({t for _, t in op.points})
            sizes = [(args.batch or 1, t) for t in lengths]
        for batch, length in sizes:
            out += [Point(shape, model, batch, length, variant) for variant in op.variants(model, args)]
    return out


def enumerate_cases(args) -> list[tuple[str, str, str]]:
    """(op, provider, mode) triples these options ask for that the registry holds."""
    return [(name, provider, mode) for name in args.ops for mode in args.modes if mode in REGISTRY[name].modes
            for provider in args.providers if provider in REGISTRY[name].providers]


GRAPH_CALLS = 10  # forwards per captured graph under --graph


def differentiable_args(call: Call) -> tuple[list, list]:
    """(leaves, args): fresh leaves requiring grad for the call's `grads`, and its args with those in place."""
    index = {id(g): i for i, g in enumerate(call.grads)}
    leaves = [g.detach().requires_grad_() for g in call.grads]
    return leaves, [leaves[index[id(a)]] if id(a) in index else a for a in call.args]


def time_call(call: Call, mode: str, cuda: bool, graph: bool = False) -> float:
    torch = _torch()
    if call.graph and cuda:
        with torch.no_grad():
            return common.graph_ms(call.fn)
    if graph and cuda and mode == "fwd":
        # few calls per graph: each call's outputs and workspaces come from the graph's own pool
        with torch.no_grad():
            return common.graph_ms(lambda: call.fn(*call.args), calls=GRAPH_CALLS)
    if mode == "fwd":
        with torch.no_grad():
            return common.time_ms(lambda: call.fn(*call.args), cuda=cuda)
    leaves, args = differentiable_args(call)
    dout = torch.randn_like(call.out(call.fn(*args)))
    return common.time_ms(lambda: torch.autograd.grad(call.out(call.fn(*args)), leaves, dout), grad_to_none=leaves,
                          cuda=cuda)


PROFILE_CALLS = 10  # calls per --profile trace; kernel times are per call


def kernel_breakdown(call: Call, mode: str, cuda: bool, top: int = 8) -> list[dict]:
    """The `top` kernels (CUDA) or operators (CPU) of one call by their time, from torch.profiler over
    PROFILE_CALLS calls after a warm-up: [{name, ms, count}] per call, as --profile prints them."""
    torch = _torch()
    from torch.profiler import ProfilerActivity, profile

    if mode == "fwd":
        def step():
            with torch.no_grad():
                call.fn(*call.args)
    else:
        leaves, args = differentiable_args(call)

        def step():
            out = call.out(call.fn(*args))
            torch.autograd.grad(out, leaves, torch.ones_like(out))
    step()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as trace:
        for _ in range(PROFILE_CALLS):
            step()
        if cuda:
            torch.cuda.synchronize()
    # CUDA: the device's own events (kernels, copies), not the CPU operators that launched them; CPU: operators
    if cuda:
        from torch.autograd import DeviceType

        events = [(e.key, e.device_time_total, e.count) for e in trace.key_averages()
                  if e.device_type == DeviceType.CUDA]
    else:
        events = [(e.key, e.self_cpu_time_total, e.count) for e in trace.key_averages()]
    events.sort(key=lambda e: -e[1])
    return [{"name": k[:120], "ms": t / 1000 / PROFILE_CALLS, "count": c / PROFILE_CALLS} for k, t, c in events[:top]]


def forward_output(call: Call):
    torch = _torch()
    with torch.no_grad():
        result = call.fn(*call.args)
    return call.out(result() if callable(result) else result)


def gradients(call: Call) -> list:
    """The gradients of the call's `grads` for an upstream gradient drawn from a fixed seed (the same for
    every provider at a point), so that providers' backwards can be compared."""
    torch = _torch()
    leaves, args = differentiable_args(call)
    out = call.out(call.fn(*args))
    gen = torch.Generator(device=out.device).manual_seed(1)
    dout = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
    return list(torch.autograd.grad(out, leaves, dout))


def run_point(op: Op, point: Point, providers: list[str], mode: str, args, device, dtype) -> list[dict]:
    """Every provider (and with --sweep natsl_fast's settings) at one point: rows of median ms."""
    torch = _torch()
    torch.manual_seed(0)
    inputs = op.inputs(point, device, dtype)
    cuda = device.type == "cuda"
    rows, first = [], None
    for provider in providers:
        base = {"op": op.name, "shape": point.label, "batch": point.batch, "length": point.length, **point.variant,
                "mode": mode, "provider": provider}
        base["row"] = str(base["row"]) if "row" in base else None
        settings = [{}]
        if args.sweep and provider == "natsl_fast" and op.sweep:
            settings += op.sweep[1]
        module = importlib.import_module(op.sweep[0]) if len(settings) > 1 else None
        for setting in settings:
            row = dict(base, setting=setting_label(setting) or "default")
            try:
                with applied(module, setting) if setting else contextlib.nullcontext():
                    call = op.providers[provider](inputs, point, mode)
                    if not call.graph:
                        started = time.perf_counter()
                        out = forward_output(call)
                        grads = gradients(call) if mode == "fwdbwd" else []
                        if cuda:
                            torch.cuda.synchronize()
                        # the first call(s) with their compiles and autotuning, as a fresh process pays them
                        row["first_call_s"] = time.perf_counter() - started
                        if first is None:
                            first = (provider, out, grads)
                        elif out.shape == first[1].shape:
                            row[f"rel_rms_vs_{first[0]}"] = common.rel_rms(out.float(), first[1].float())
                            if grads and [g.shape for g in grads] == [g.shape for g in first[2]]:
                                # the worst of the gradients: one wrong kernel of a backward shows here
                                row[f"grad_rel_rms_vs_{first[0]}"] = max(
                                    common.rel_rms(a.float(), b.float()) for a, b in zip(grads, first[2]))
                    row["ms"] = time_call(call, mode, cuda, graph=args.graph)
                    if args.profile and not call.graph:
                        row["kernels"] = kernel_breakdown(call, mode, cuda)
            except Skip as why:
                print(f"skip {op.name} {provider} {mode} at {point.label}: {why}", flush=True)
                break
            except Exception as err:  # noqa: BLE001 - a setting that does not compile, an OOM: reported, not fatal
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
                if cuda:
                    torch.cuda.empty_cache()
            rows.append(row)
            result = f"{row['ms']:.4g} ms" if "ms" in row else row["error"]
            if "first_call_s" in row and setting == {}:
                result += f" (first call {row['first_call_s']:.1f} s)"
            print(f"{op.name} {mode} {point.label} {provider} [{row['setting']}]: {result}", flush=True)
            for kernel in row.get("kernels", []):
                print(f"    {kernel['ms']:.4f} ms x{kernel['count']:g}  {kernel['name']}", flush=True)
    base_ms = next((r["ms"] for r in rows if "ms" in r), None)
    for r in rows:
        if "ms" in r and base_ms:
            r["x_first"] = r["ms"] / base_ms
    return rows


def run(args) -> dict:
    """Run every op of `args.ops`; write OUT/ops_<op>.json and .png; return {op: rows}."""
    torch = _torch()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    results = {}
    for name in args.ops:
        op = REGISTRY[name]
        providers = [p for p in args.providers if p in op.providers]
        for p in args.providers if args.provider else ():
            if p not in op.providers:
                print(f"skip {name} {p}: not a provider of this op ({', '.join(op.providers)})", flush=True)
        rows = []
        for mode in args.modes:
            if mode not in op.modes:
                print(f"skip {name} {mode}: the op runs {', '.join(op.modes)} only", flush=True)
                continue
            for point in points(op, args):
                rows += run_point(op, point, providers, mode, args, device, dtype)
                # rewritten after every point: a run cut short by its time cap keeps what it measured
                common.write_result(f"ops_{name}", {"op": name, "device": str(device), "dtype": str(dtype),
                                                    "graph": bool(args.graph), "rows": rows}, args.out)
        results[name] = rows
        if not rows:
            continue
        groups: dict = {}
        for r in rows:
            if "ms" in r:
                groups.setdefault(f"{r['shape']} {r['mode']}", {})[
                    r["provider"] + ("" if r["setting"] == "default" else f" [{r['setting']}]")] = r["ms"]
        common.bar_png(f"{args.out}/ops_{name}.png", groups, "median ms", f"{name} on {device}, {dtype}")
        compared = sorted({k for r in rows for k in r if k.startswith(("rel_rms_vs_", "grad_rel_rms_vs_"))})
        print(common.table(rows, ["shape", "mode", "provider", "setting", "ms", "x_first", *compared]))
    return results


def describe() -> str:
    lines = []
    for op in REGISTRY.values():
        sweep = f"; --sweep: {len(op.sweep[1])} settings of {op.sweep[0]}" if op.sweep else ""
        lines.append(f"{op.name}: providers {', '.join(op.providers)}; modes {', '.join(op.modes)}; "
                     f"points {', '.join(f'{b}x{t}' for b, t in op.points)}{sweep}")
    return "\n".join(lines)


def main(argv=None) -> None:
    global FLA_UNGUARDED
    args = parse(argv)
    if args.list:
        print(describe())
        return
    FLA_UNGUARDED = args.fla_unguarded
    run(args)


if __name__ == "__main__":
    main()
