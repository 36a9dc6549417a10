"""Linear maps that read the same input, run as one matmul when their weights share one buffer.

Decoding one token multiplies a vector by every weight matrix: each projection is a separate
matrix-vector product of a few MB, too small to keep the GPU's memory system busy (separate
products took several times their weights' read time in an 800M decode step). `merge_(module)` re-points the weights of each group a module names in its `merge_groups`
attribute (q, k, v, a, b and the output gate's input g of a GDN layer; q, k, v, a, b of a NAtS-L layer; q, k, v of attention; gate and up of SwiGLU) into one
contiguous buffer, as views, so the parameters, their names and the checkpoint layout stay as they are; `shared_linear` then runs a
group as one product (through natsl.ops.gemv.linear: its GEMV kernel where that applies) and splits the result. The merged product is used only without autograd (the
buffer is not a parameter) and only for inputs of at most `MERGE_MAX_ROWS` rows (decode steps):
a 128K prefill keeps one product per weight, as cuBLAS runs the separate, 128-aligned widths
(1152, 2304, ...) faster than one 6924-wide product followed by strided splits
(`python -m benchmarks.profile --inference prefill` measures both). With gradients, or when a weight no longer
lies in the buffer (the model was moved or cast after merging), each linear runs on its own.
"""

from __future__ import annotations

import torch
from torch import nn

from natsl import switches
from natsl.errors import NatslError
from natsl.models.linear import ALIGN_ROWS
from natsl.ops.gemv import linear


# Inputs with more rows than this (batch x tokens) run one product per weight.
MERGE_MAX_ROWS = 64


class _Group:
    def __init__(self, linears: list[nn.Linear]):
        self.buffer = torch.cat([lin.weight.detach() for lin in linears])
        self.sizes = [lin.out_features for lin in linears]
        start = 0
        for lin, size in zip(linears, self.sizes):
            lin.weight.data = self.buffer[start:start + size]
            start += size
        self.pointers = [lin.weight.data_ptr() for lin in linears]

    def holds(self, linears) -> bool:
        return [lin.weight.data_ptr() for lin in linears] == self.pointers


def _linears(owner: nn.Module, name: str) -> list[nn.Linear]:
    return [owner.get_submodule(path) for path in owner.merge_groups[name]]


def merge_(module: nn.Module) -> int:
    """Merge the groups of every submodule with a `merge_groups` attribute, {name: (paths of nn.Linear
    submodules, ...)} (linears without bias, same input size, dtype and device; a path may name a child's
    linear, "proj.q_proj"). A group holding a linear that an enclosing module's group holds already is not
    merged: the enclosing module runs that product (a GDN layer's q, k, v, a, b and its gate input in one).
    Returns how many groups it merged."""
    merged = 0
    claimed: set[int] = set()  # the linears of groups seen so far; modules() lists a module before its children
    for sub in module.modules():
        groups = getattr(sub, "merge_groups", None)
        if groups is None:
            continue
        store = sub.__dict__.setdefault("_merged_linears", {})
        for name in groups:
            linears = _linears(sub, name)
            if claimed & {id(lin) for lin in linears}:
                store.pop(name, None)
                continue
            claimed |= {id(lin) for lin in linears}
            if name in store and store[name].holds(linears):
                continue
            if any(lin.bias is not None for lin in linears) or len({
                    (lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
                raise ValueError(f"cannot merge {name}: the linears differ in input size, dtype or device, or have bias")
            store[name] = _Group(linears)
            merged += 1
    return merged


def buffer_product(owner: nn.Module, name: str, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The outputs on x of group `name` as one product over the buffer `merge_` made, where that
    applies (merged, no gradient wanted, at most MERGE_MAX_ROWS rows); else None."""
    buffer = merged_weight(owner, name, x)
    if buffer is None:
        return None
    return linear(x, buffer).split(owner.__dict__["_merged_linears"][name].sizes, dim=-1)


def product_and_last(owner: nn.Module, name: str, x: torch.Tensor):
    """(the outputs of group `name` but its last, the last) on x from the merged product where
    `buffer_product` runs it; else (None, None). For a layer whose group is its projections' group and
    one product more (a GDN or NAtS-L layer's output gate input)."""
    merged = buffer_product(owner, name, x)
    return (None, None) if merged is None else (merged[:-1], merged[-1])


def group_sizes(owner: nn.Module, name: str) -> list[int]:
    """The out_features of group `name`'s linears, in order: how its product splits."""
    return [lin.out_features for lin in _linears(owner, name)]


def merged_weight(owner: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """The buffer [sum of out_features, in_features] of group `name` where `buffer_product` would run it on
    x (merged, no gradient wanted, few rows); else None."""
    group = owner.__dict__.get("_merged_linears", {}).get(name)
    rows = x.numel() // max(x.shape[-1], 1)
    if group is not None and rows <= MERGE_MAX_ROWS and not torch.is_grad_enabled() and group.holds(_linears(owner, name)):
        return group.buffer
    return None


def _concat_labels(grad: bool = False) -> frozenset[str]:
    """The groups that concatenate: the switch concat_linears (NATSL_CONCAT_LINEARS) where set (with
    and without gradients alike), else the default for products with (`grad`) or without gradients.
    A bad value is reported when a product first needs it (a one-line error at the CLI)."""
    value = switches.current().concat_linears
    if value is None:
        return CONCAT_DEFAULT_GRAD if grad else CONCAT_DEFAULT
    parts = {part.strip() for part in value.split(",")} - {"", "none"}
    if parts == {"all"}:
        return frozenset(CONCAT_LABELS)
    unknown = sorted(parts - set(CONCAT_LABELS))
    if unknown:
        raise NatslError(f"NATSL_CONCAT_LINEARS names unknown groups {unknown}: use a comma list of "
                         f"{', '.join(CONCAT_LABELS)}, or all, or none")
    return frozenset(parts)


# Groups that run as one product over their weights concatenated per call (training, prefill: many
# rows, gradients) rather than one product each. The concatenation is differentiable (the weight
# gradients come back as slices of one product) and its rows are padded with zeros to a multiple of
# ALIGN_ROWS, so that the output's rows stay 16-byte aligned for cuBLAS; the outputs are strided views.
# Labels: "gdn_qkv" and "gdn_ab" (a GDN or NAtS-L layer's q, k, v and its two H-wide gate inputs),
# "attn_qkv", "gate_up" (SwiGLU). The switch concat_linears (NATSL_CONCAT_LINEARS: comma list, "all" or "none")
# overrides the defaults.
CONCAT_LABELS = ("gdn_qkv", "gdn_ab", "attn_qkv", "gate_up")
CONCAT_DEFAULT = frozenset({"gdn_ab"})
# With gradients (training) the GDN projections' q, k and v also run as one product: the compiled 800M
# hybrid trained faster that way in same-machine pairs on the H200, while the Transformer's attn_qkv
# was slower (so it stays apart). Without gradients (prefill) q, k, v stay apart: not measured there.
CONCAT_DEFAULT_GRAD = frozenset({"gdn_ab", "gdn_qkv"})


def group_product(label: str, linears: list[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs on x of `linears` (no bias, one input size): one product over their concatenated
    weights when `label` concatenates (natsl.switches concat_linears, else the defaults below), else one product each."""
    y = joined_product(label, linears, x)
    if y is None:
        return tuple(lin(x) for lin in linears)
    return y.split([lin.out_features for lin in linears], dim=-1)


def joined_product(label: str, linears: list[nn.Linear], x: torch.Tensor) -> torch.Tensor | None:
    """The outputs on x of `linears` side by side, [..., sum of out_features], as one product over
    their concatenated weights (rows padded to ALIGN_ROWS, the padding's columns cut off again) when
    `label` concatenates (see group_product); else None."""
    if label not in _concat_labels(torch.is_grad_enabled()):
        return None
    weights = [lin.weight for lin in linears]
    width = sum(w.shape[0] for w in weights)
    pad = -width % ALIGN_ROWS
    if pad:
        weights.append(weights[0].new_zeros(pad, weights[0].shape[1]))
    y = linear(x, torch.cat(weights))
    return y[..., :width] if pad else y


def shared_linear(owner: nn.Module, name: str, x: torch.Tensor, label: str | None = None) -> tuple[torch.Tensor, ...]:
    """The outputs on x of the linears of `owner.merge_groups[name]`: one product over the merged
    buffer where `merge_` merged them and no gradient is wanted, else by `group_product` under
    `label` (default: the group's name)."""
    merged = buffer_product(owner, name, x)
    if merged is not None:
        return merged
    return group_product(label or name, _linears(owner, name), x)
