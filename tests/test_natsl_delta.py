"""NAtS-L on a plain DeltaNet state (`natsl_state: delta`, natsl/models/deltanet.py; the authors'
natsl_attn_delta): the GDN-state layer with the gate removed (g = 0), on every backend and path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import natsl
from natsl.models.natsl_layer import NAtSL
from natsl.models.registry import NAtSLDelta, kind_of
from numerics import rel_rms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the fast backend: Triton's interpreter on a CPU
TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_heads=2, head_k_dim=16, head_v_dim=32,
            softmax_heads_per_group=2, block_size=16, natsl_rope=True)


def config(**changes):
    base = natsl.load_recipe("tiny_hybrid").model
    return dataclasses.replace(base, **{**TINY, "natsl_state": "delta", **changes})


def route(kind: str):
    """A route_override: every block kept, every block written, or a fixed mix (by block and group)."""
    def keep(index, groups):
        shape = (*index.shape, groups)
        if kind == "keep":
            return torch.ones(shape, device=index.device)
        if kind == "write":
            return torch.zeros(shape, device=index.device)
        return ((index[..., None] * 3 + torch.arange(groups, device=index.device)) % 2).float()
    return None if kind == "router" else keep


def run(layer, x, backend):
    """(output, {name: gradient}) of the layer on `backend` for a fixed output weighting."""
    layer.backend = backend
    for module in layer.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    (out * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads["x"] = x.grad.detach().clone()
    return out.detach(), grads


def test_the_registry_builds_it_without_a_decay():
    cfg = config()
    kind = kind_of(cfg, "natsl")
    assert isinstance(kind, NAtSLDelta) and kind.state_title == "DeltaNet"
    model = natsl.build_model(cfg)
    layers = model.natsl_layers()
    assert layers
    names = [n for layer in layers.values() for n in layer.state_dict() if n.startswith("proj.")]
    assert names and not any(n.endswith(("A_log", "dt_bias", "a_proj.weight")) for n in names)
    assert any(n.endswith("proj.b_proj.weight") for n in names)
    gdn = natsl.build_model(dataclasses.replace(cfg, natsl_state="gdn"))
    per_layer = cfg.num_heads * (cfg.hidden_size + 2)  # W_a, A_log, dt_bias
    assert gdn.num_parameters() - model.num_parameters() == per_layer * len(model.natsl_layers())


@pytest.mark.parametrize("routes", ["keep", "write", "mixed", "router"])
@pytest.mark.parametrize("T", [1, 11, 16, 37])
def test_it_is_the_gdn_state_layer_with_g_zero(T, routes):
    """Against NAtS-L on a GDN state with the same weights and A_log = -inf (g = -exp(A_log) dt = 0), in float64
    on the token-by-token reference: forward and every gradient."""
    cfg = config(backend="reference")
    torch.manual_seed(0)
    delta = NAtSL(cfg).double()
    gdn = NAtSL(dataclasses.replace(cfg, natsl_state="gdn")).double()
    missing = gdn.load_state_dict(delta.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["proj.A_log", "proj.a_proj.weight", "proj.dt_bias"]
    with torch.no_grad():
        gdn.proj.A_log.fill_(-float("inf"))
    delta.route_override = gdn.route_override = route(routes)
    x = torch.randn(2, T, cfg.hidden_size, dtype=torch.float64)
    out, grads = run(delta, x, "reference")
    want, want_grads = run(gdn, x, "reference")
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("routes", ["keep", "write", "mixed", "router"])
@pytest.mark.parametrize("T", [1, 37, 100])
def test_chunked_and_fast_match_the_reference(T, routes):
    """The layer's twins: the chunk-parallel form (float64, to 1e-9) and the Triton kernels (float32, fla-style
    relative RMS) against the recurrent reference, on odd lengths (T = 1, T < block, not a multiple of the
    block), all-keep / all-write / mixed routes and the router; forward and every gradient. Block 64: the
    fast gated_delta_rule's."""
    cfg = config(block_size=64)
    torch.manual_seed(1)
    layer = NAtSL(cfg)
    layer.route_override = route(routes)
    x = torch.randn(2, T, cfg.hidden_size)
    ref64, ref64_grads = run(layer.double(), x.double(), "reference")
    out, grads = run(layer, x.double(), "chunked")
    torch.testing.assert_close(out, ref64, rtol=1e-9, atol=1e-9)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref64_grads[name], rtol=1e-9, atol=1e-9, msg=name)
    layer = layer.float().to(DEVICE)
    ref, ref_grads = run(layer, x.to(DEVICE), "reference")
    fast, fast_grads = run(layer, x.to(DEVICE), "fast")
    assert rel_rms(fast, ref) <= 1e-4
    assert fast_grads.keys() == ref_grads.keys()
    for name, grad in fast_grads.items():
        if ref_grads[name].abs().max() <= 1e-6:  # zero but for rounding (T = 1: one key, q and k move no weight)
            assert grad.abs().max() <= 1e-6, name
        else:
            assert rel_rms(grad, ref_grads[name]) <= 1e-3, name


AUTHORS_FORM = {"branch_norm": "after_sum_state_head", "mix_weights": "none"}  # their natsl_attn_delta's read


@pytest.mark.parametrize("changes", [{"intra_block_output": "both"}, {"intra_block_output": "softmax"}, AUTHORS_FORM],
                         ids=["both", "softmax", "authors-form"])
def test_prefill_and_decode_match_the_full_forward(changes):
    cfg = config(base_layer="gdn", natsl_layers=[1, 3], backend="chunked", **changes)
    torch.manual_seed(2)
    model = natsl.build_model(cfg).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 64)
        steps = [model(ids[:, :21], cache=cache)]
        steps += [model(ids[:, t:t + 1], cache=cache) for t in range(21, 40)]
    got = torch.cat(steps, 1)
    assert float((got - full).abs().max() / full.abs().max()) < 1e-6  # as tests/test_inference.py compares


@pytest.mark.parametrize("size", ["380m", "800m"])
def test_the_recipes_are_the_natsl_recipes_on_a_delta_state(size):
    delta, plain = natsl.load_recipe(f"{size}_natsl_delta").model, natsl.load_recipe(f"{size}_natsl").model
    assert dataclasses.replace(delta, natsl_state="gdn") == plain and delta.natsl_state == "delta"
    built = natsl.build_model(delta, device="meta").num_parameters()
    reference = natsl.build_model(plain, device="meta").num_parameters()
    assert reference - built == plain.num_layers * plain.num_heads * (plain.hidden_size + 2)


def test_the_authors_form_sums_the_branches_and_normalises_each_state_head():
    """branch_norm after_sum_state_head, no mixing weights (the authors' natsl_attn_delta): out = W_o(RMSNorm_V(o_la
    + o_nla viewed per state head) * silu(W_g x)), the norm over a state head's V channels (R softmax heads),
    written out here from their layer's code, not from natsl's."""
    cfg = config(**AUTHORS_FORM)
    torch.manual_seed(4)
    layer = NAtSL(cfg).double()
    with torch.no_grad():
        layer.out_norm.weight.normal_()
    b, t, h, r, v = 2, 5, cfg.num_heads, cfg.softmax_heads_per_group, cfg.head_v_dim
    assert layer.out_norm.weight.shape == (v,) and not hasattr(layer, "mix_proj") and r > 1
    o_la, o_nla = torch.randn(2, b, t, h * r, v // r, dtype=torch.float64).unbind(0)
    x = torch.randn(b, t, cfg.hidden_size, dtype=torch.float64)
    q = torch.randn(b, t, h * cfg.head_k_dim, dtype=torch.float64)
    total = (o_la + o_nla).reshape(b, t, h, v)  # their o_gated_delta + o_attn.view(o_gated_delta.shape)
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * layer.out_norm.weight
    gate = layer.g_proj(x).view(b, t, h, v)
    want = layer.o_proj((normed * torch.nn.functional.silu(gate)).reshape(b, t, h * v))
    assert torch.allclose(layer.mix(o_la, o_nla, q, x), want, rtol=1e-12, atol=1e-12)
    per_softmax_head = NAtSL(dataclasses.replace(cfg, branch_norm="after_sum")).double()
    assert per_softmax_head.out_norm.weight.shape == (v // r,)  # the other after-sum form: per softmax head

