"""Native Sparse Attention (Yuan et al. 2025) through flash-linear-attention (`pip install 'natsl[fla]'`).

The layer is fla's `fla/layers/nsa.py: NativeSparseAttention` on natsl's linears and RoPE: q from
nsa_num_heads heads, k and v from nsa_kv_heads heads (grouped-query), three sigmoid gates per query
head from x (g_proj, d -> 3 heads), and o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa:

- compressed: attention over the mean-pooled key/value blocks of nsa_block_size tokens that lie
  wholly in the past;
- selected: attention over the tokens of the nsa_block_counts blocks that the compressed scores rank
  highest (summed over the kv group; the first block and the query's own and previous block always);
- window: causal attention over the last nsa_window keys (the query's own included).

On CUDA the compressed and selected branches run fla's Triton kernels (`parallel_nsa`, forward and
backward). On the CPU they run fla's PyTorch reference (`fla/ops/nsa/naive.py`: compression, top-k
and selection) after a mean pooling written here: fla's `naive_nsa` pools with a Triton kernel, so
it does not run on a CPU. The window branch is natsl's sliding-window attention on both devices
(natsl.models.attention): fla computes it with flash_attn, which is not a dependency of natsl.

No incremental cache: fla's reference assumes the queries start at position 0 (it cannot decode),
and its kernels decode only over a contiguous K/V that grows by concatenation, not natsl's
preallocated, per-sequence caches; natsl.models.cache refuses a model with NSA layers.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from natsl.errors import NatslError
from natsl.models.attention import sliding_window_attention
from natsl.models.linear import Linear
from natsl.models.rope import RopeTable, apply_rope

if TYPE_CHECKING:
    from natsl.config import ModelConfig

MISSING_FLA = "NSA layers need flash-linear-attention, which is not installed: pip install 'natsl[fla]'"
NO_CACHE = ("NSA layers have no inference cache (flash-linear-attention's NSA decodes only through its own growing "
            "K/V, its reference not at all); evaluate them with full-sequence forwards (eval-ppl, eval-recall)")


def require_fla() -> None:
    if importlib.util.find_spec("fla") is None:
        raise NatslError(MISSING_FLA)


class NativeSparseAttention(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        require_fla()
        self.config = config
        d, hq, hkv, hd = config.hidden_size, config.nsa_num_heads, config.nsa_kv_heads, config.nsa_head_dim
        self.num_heads, self.kv_heads, self.head_dim = hq, hkv, hd
        self.q_proj = Linear(d, hq * hd, bias=False, device=device)
        self.k_proj = Linear(d, hkv * hd, bias=False, device=device)
        self.v_proj = Linear(d, hkv * hd, bias=False, device=device)
        self.g_proj = Linear(d, hq * 3, bias=False, device=device)
        self.o_proj = Linear(hq * hd, d, bias=False, device=device)

    def forward(self, x: torch.Tensor, cache=None, rope: RopeTable | None = None) -> torch.Tensor:
        if cache is not None:
            raise NatslError(NO_CACHE)
        b, t, _ = x.shape
        c = self.config
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        positions = None if rope is not None else torch.arange(t, device=x.device)
        q = apply_rope(q, positions, c.rope_theta, rope)
        k = apply_rope(k, positions, c.rope_theta, rope)
        g_cmp, g_slc, g_swa = self.g_proj(x).view(b, t, self.num_heads, 3).sigmoid().unbind(-1)
        o = sparse_attention(q, k, v, g_cmp, g_slc, g_swa, block_size=c.nsa_block_size,
                             block_counts=c.nsa_block_counts, window=c.nsa_window)
        return self.o_proj(o.reshape(b, t, -1))


def naive_default(device: torch.device) -> bool:
    """Whether the compressed and selected branches run fla's PyTorch reference by default: off CUDA
    (fla's Triton kernels need a GPU); natsl.inference.kernel_table prints it."""
    return device.type != "cuda"


def sparse_attention(q, k, v, g_cmp, g_slc, g_swa, *, block_size: int, block_counts: int, window: int,
                     naive: bool | None = None) -> torch.Tensor:
    """NSA's gated sum of its three branches. q [B, T, HQ, D], k, v [B, T, H, D], gates [B, T, HQ] ->
    [B, T, HQ, D]. `naive`: fla's PyTorch reference (default: on the CPU) instead of its Triton kernels."""
    if naive is None:
        naive = naive_default(q.device)
    o = fla_branches(q, k, v, g_cmp, g_slc, block_size=block_size, block_counts=block_counts, naive=naive)
    if window:
        o = torch.addcmul(o, window_attention(q, k, v, window), g_swa.unsqueeze(-1))
    return o


@torch.compiler.disable
def fla_branches(q, k, v, g_cmp, g_slc, *, block_size: int, block_counts: int, naive: bool) -> torch.Tensor:
    """The compressed and selected branches, gated and summed, through fla (its reference or kernels).

    Never traced by torch.compile (a graph break; the layers around it still compile): a trace would
    follow fla's first import, which imports transformers and scipy and stops dynamo (an internal
    error on each device), and then fla's Python dispatch around its Triton kernels, which natsl has
    no reason to put in a graph. Run eagerly, fla's own autograd.Function gives the gradients."""
    scale = q.shape[-1] ** -0.5
    try:
        # Importing fla warns that flash_attn is missing (natsl computes the window without it) and, on a
        # machine without a GPU, that Triton has no device: neither concerns natsl's use.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if naive:
                from fla.ops.nsa.naive import naive_nsa_compression, naive_nsa_selection, naive_nsa_topk
            else:
                from fla.ops.nsa import parallel_nsa
    except ModuleNotFoundError as err:
        if err.name is not None and err.name.split(".")[0] == "fla":
            raise NatslError(MISSING_FLA) from None
        raise
    if naive:
        k_cmp, v_cmp = block_means(k, block_size), block_means(v, block_size)
        o_cmp, _ = naive_nsa_compression(q, k_cmp, v_cmp, block_size, scale)
        indices = naive_nsa_topk(q, k_cmp, block_counts, block_size, scale)
        o_slc = naive_nsa_selection(q, k, v, indices, block_size, scale)
        return torch.addcmul(o_slc * g_slc.unsqueeze(-1), o_cmp, g_cmp.unsqueeze(-1))
    # window 0: fla would run its window branch through flash_attn
    return parallel_nsa(q, k, v, g_cmp, g_slc, None, block_counts=block_counts, block_size=block_size,
                        window_size=0, scale=scale)


def block_means(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [B, T, H, D] -> the mean of each block of `block_size` tokens [B, ceil(T / block_size), H, D] (a
    partial last block: the mean of its tokens), as fla's mean_pooling kernel computes it."""
    b, t, h, d = x.shape
    pad = -t % block_size
    sums = F.pad(x, (0, 0, 0, 0, 0, pad)).view(b, -1, block_size, h, d).sum(2)
    counts = torch.full((sums.shape[1],), block_size, dtype=x.dtype, device=x.device)
    counts[-1] = block_size - pad
    return sums / counts[:, None, None]


def window_attention(q, k, v, window: int) -> torch.Tensor:
    """Causal attention over the last `window` keys (own included), q [B, T, HQ, D], k, v [B, T, H, D]
    (query head i reads kv head i // (HQ / H), as fla's kernels) -> [B, T, HQ, D]."""
    group = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if window < q.shape[2]:
        o = sliding_window_attention(q, k, v, window, flex=q.device.type == "cuda")
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2)
