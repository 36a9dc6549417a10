"""Route gradients of the two NAtS-L ops (docs/spec.md section 3).

Two things live here:

* the route-gradient *policy* that the reference forwards apply to `keep` / `write` before use
  (`apply_route_grad_policy`): "full" is the plain autograd gradient, "active" (the method) keeps
  it only where the route chose the option (value 1) so the sparse cost is preserved;
* the *oracles*: the continuous-mask route gradients written out by hand, with no autograd
  inside. Tests check autograd against them, and the fast path uses them as its reference.

Both oracles compute in fp32 (float64 if any input is float64) and return the gradient in the
route's dtype, as autograd would.
"""

from __future__ import annotations

import math

import torch

from natsl.block_size import DEFAULT_BLOCK_SIZE

ROUTE_GRAD_POLICIES = ("active", "full")


# ----------------------------------------------------------------------------- shared helpers
def check_route_grad(route_grad: str) -> None:
    """Raise ValueError unless `route_grad` names a known policy."""
    if route_grad not in ROUTE_GRAD_POLICIES:
        raise ValueError(f"unknown route_grad {route_grad!r}: use 'active' or 'full'")


def check_block_size(block_size: int) -> None:
    """Raise ValueError unless `block_size` is a positive int."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def num_blocks(seq_len: int, block_size: int) -> int:
    """NB = ceil(T / C); a partial last block counts as a block."""
    return math.ceil(seq_len / block_size)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32, or float64 as soon as one input is float64 (gradcheck needs the latter)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    """Raise ValueError naming the tensor, its layout and both shapes when they differ."""
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(tensor.shape)}")


def expect_floating(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")


def chosen(route: torch.Tensor) -> torch.Tensor:
    """Where the route picked this option. Routes are exactly 0/1 in the model; 0.5 splits them."""
    return route > 0.5


# ----------------------------------------------------------------------------- the policy
class _ActiveRouteGrad(torch.autograd.Function):
    """Identity forward; backward lets the gradient through only where the route is chosen."""

    @staticmethod
    def forward(ctx, route: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(chosen(route))
        return route.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype)


def apply_route_grad_policy(route: torch.Tensor, route_grad: str) -> torch.Tensor:
    """The route as the op should use it: same values, gradient shaped by the policy."""
    check_route_grad(route_grad)
    if route_grad == "full" or not route.requires_grad:
        return route
    return _ActiveRouteGrad.apply(route)


def _apply_policy_to_grad(grad: torch.Tensor, route: torch.Tensor, route_grad: str) -> torch.Tensor:
    if route_grad == "active":
        grad = grad * chosen(route).to(grad.dtype)
    return grad


# ----------------------------------------------------------------------------- routed attention
def routed_attention_keep_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    o: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    route_grad: str = "full",
) -> torch.Tensor:
    """dL/dkeep [B, NB, G] of `routed_attention` (intra_block=True), given its output and dL/do.

    q, k [B,T,Hs,Dk]; v, o, do [B,T,Hs,Dv]; keep [B,NB,G] (None = all ones).
    dL/dkeep_c = sum over the group's heads, the queries i in blocks after c and the keys j in c of
    P_ij <dO_i, v_j - O_i>, with P_ij = exp(A_ij) / Z_i (no mask factor: valid for keep_c = 0 too).
    """
    check_route_grad(route_grad)
    check_block_size(block_size)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, Hs, Dk], got shape {tuple(q.shape)}")
    B, T, Hs, Dk = q.shape
    Dv = v.shape[-1]
    NB = num_blocks(T, block_size)
    expect_shape("k", k, (B, T, Hs, Dk), "[B, T, Hs, Dk]")
    expect_shape("v", v, (B, T, Hs, Dv), "[B, T, Hs, Dv]")
    expect_shape("o", o, (B, T, Hs, Dv), "[B, T, Hs, Dv]")
    expect_shape("do", do, (B, T, Hs, Dv), "[B, T, Hs, Dv]")
    if keep is None:  # plain causal attention; the gradient then comes back in the compute dtype
        keep = q.new_ones(B, NB, 1, dtype=compute_dtype(q, k, v, o, do))
    if keep.dim() != 3 or keep.shape[:2] != (B, NB) or keep.shape[2] < 1 or Hs % keep.shape[2]:
        raise ValueError(f"keep must be [B, NB, G] = ({B}, {NB}, G) with {Hs} % G == 0, got {tuple(keep.shape)}")
    G = keep.shape[2]
    dt = compute_dtype(q, k, v, keep, o, do)
    scale = Dk**-0.5 if scale is None else scale

    # Heads first: [B, Hs, T, D].
    qh, kh, vh, oh, doh = (x.detach().to(dt).transpose(1, 2) for x in (q, k, v, o, do))
    pos = torch.arange(T, device=q.device)
    blk = pos // block_size
    same_causal = (blk[:, None] == blk[None, :]) & (pos[None, :] <= pos[:, None])  # [i, j]
    earlier = blk[None, :] < blk[:, None]  # key j sits in a block before query i's block
    keep_keys = keep.detach().to(dt).repeat_interleave(Hs // G, dim=2)[:, blk].transpose(1, 2)  # [B,Hs,T]
    mask = same_causal.to(dt) + earlier.to(dt) * keep_keys[:, :, None, :]

    logits = scale * qh @ kh.transpose(-1, -2)
    reachable = same_causal | earlier
    # Subtracting the max over every reachable key keeps exp(.) <= 1 also for dropped keys.
    row_max = logits.masked_fill(~reachable, float("-inf")).amax(-1, keepdim=True)
    expo = torch.exp(logits.masked_fill(~reachable, float("-inf")) - row_max)
    z = (expo * mask).sum(-1, keepdim=True)
    p = expo / z  # P_ij, not multiplied by M_ij

    # <dO_i, v_j - O_i> for every (i, j), then only keys of earlier blocks count.
    inner = doh @ vh.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True)
    per_key = (p * inner * earlier.to(dt)).sum(dim=2)  # [B, Hs, T]: summed over queries i
    per_key = torch.nn.functional.pad(per_key, (0, NB * block_size - T))
    per_block = per_key.view(B, Hs, NB, block_size).sum(-1)  # [B, Hs, NB]
    dkeep = per_block.view(B, G, Hs // G, NB).sum(2).transpose(1, 2)  # [B, NB, G]
    return _apply_policy_to_grad(dkeep, keep, route_grad).to(keep.dtype)


# ----------------------------------------------------------------------------- gated delta rule
def _erase(x: torch.Tensor, k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """(I - beta k k^T) x for x [B,H,K,V], k [B,H,K], beta [B,H]; the matrix is symmetric."""
    k_x = torch.einsum("bhk,bhkv->bhv", k, x)
    return x - beta[..., None, None] * k[..., :, None] * k_x[..., None, :]


def gated_delta_write_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    write: torch.Tensor | None,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    d_final_state: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    decay_skipped_blocks: bool = True,
    route_grad: str = "full",
) -> torch.Tensor:
    """dL/dwrite [B, NB, H] of `gated_delta_rule` (intra_block=True), given dL/do.

    q, k [B,T,H,K]; v, do [B,T,H,V]; g, beta [B,T,H]; write [B,NB,H] (None = all ones);
    initial_state, d_final_state [B,H,K,V] (d_final_state is dL/dS_start(NB); None = zero).
    Forward stores S_start(b) and S_end(b); an explicit reverse recurrence carries dL/dS, and
    dL/dwrite_b = <dL/dS_start(b+1), S_end(b) - Gamma_b S_start(b)>.
    """
    check_route_grad(route_grad)
    check_block_size(block_size)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    NB = num_blocks(T, block_size)
    expect_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    expect_shape("v", v, (B, T, H, V), "[B, T, H, V]")
    expect_shape("do", do, (B, T, H, V), "[B, T, H, V]")
    expect_shape("g", g, (B, T, H), "[B, T, H]")
    expect_shape("beta", beta, (B, T, H), "[B, T, H]")
    if write is None:  # plain Gated DeltaNet; the gradient then comes back in the compute dtype
        write = q.new_ones(B, NB, H, dtype=compute_dtype(q, k, v, g, beta, do, initial_state, d_final_state))
    expect_shape("write", write, (B, NB, H), "[B, NB, H]")
    for name, state in (("initial_state", initial_state), ("d_final_state", d_final_state)):
        if state is not None:
            expect_shape(name, state, (B, H, K, V), "[B, H, K, V]")
    dt = compute_dtype(q, k, v, g, beta, write, do, initial_state, d_final_state)
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta, w_all, do = (x.detach().to(dt) for x in (q, k, v, g, beta, write, do))

    def block_range(b: int) -> range:
        return range(b * block_size, min((b + 1) * block_size, T))

    def block_decay(b: int) -> torch.Tensor:  # Gamma_b as [B, H, 1, 1]
        if not decay_skipped_blocks:
            return torch.ones(B, H, 1, 1, dtype=dt, device=q.device)
        return g[:, block_range(b)].sum(1).exp()[..., None, None]

    # Forward, keeping only what the route gradient needs.
    zeros = torch.zeros(B, H, K, V, dtype=dt, device=q.device)
    state = zeros if initial_state is None else initial_state.detach().to(dt)
    starts, ends = [], []
    for b in range(NB):
        starts.append(state)
        for t in block_range(b):
            kv = k[:, t, :, :, None] * v[:, t, :, None, :]
            erased = _erase(state, k[:, t], beta[:, t])
            state = g[:, t].exp()[..., None, None] * erased + beta[:, t, :, None, None] * kv
        ends.append(state)
        w = w_all[:, b, :, None, None]
        base = block_decay(b) * starts[b]
        state = base + w * (state - base)

    # Reverse: d_next is dL/dS_start(b + 1) while block b is processed.
    d_next = zeros if d_final_state is None else d_final_state.detach().to(dt)
    dwrite = torch.zeros(B, NB, H, dtype=dt, device=q.device)
    for b in reversed(range(NB)):
        w = w_all[:, b, :, None, None]
        gamma = block_decay(b)
        dwrite[:, b] = (d_next * (ends[b] - gamma * starts[b])).sum((-2, -1))
        adj = w * d_next  # dL/dS_end(b) through the commit
        for t in reversed(block_range(b)):
            adj = adj + scale * q[:, t, :, :, None] * do[:, t, :, None, :]  # from o_t = scale S_t^T q_t
            adj = g[:, t].exp()[..., None, None] * _erase(adj, k[:, t], beta[:, t])  # to dL/dS_{t-1}
        d_next = adj + gamma * (1 - w) * d_next  # dL/dS_start(b): token path + commit's skip path
    return _apply_policy_to_grad(dwrite, w_all, route_grad).to(write.dtype)
