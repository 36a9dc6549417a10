"""Every op family of natsl.ops with twins (natsl.ops.TWINS): the reference and fast functions take the
same arguments, and agree on tiny shapes (the fast side in Triton's interpreter on the CPU; the
per-kernel tests go in depth)."""

import importlib
import inspect

import pytest
import torch

from natsl import ops

from numerics import rel_rms


def load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def parameters(fn):
    """Names, kinds and defaults (the chunked form has no annotations; the kernels' do not differ)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("family", sorted(ops.TWINS))
def test_twins_take_the_same_arguments(family):
    reference, fast = (load(path) for path in ops.TWINS[family])
    assert parameters(reference) == parameters(fast)
    public = getattr(ops, family.removesuffix("_chunked"))
    assert [p for p in parameters(public) if p[0] != "backend"] == parameters(reference)


def gdn_inputs(T=64, H=2, K=16, V=16):
    torch.manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1)
    v = torch.randn(1, T, H, V)
    g = -torch.rand(1, T, H) * 0.1
    beta = torch.rand(1, T, H)
    write = torch.tensor([[[1.0, 0.0]]])
    return (q, k, v, g, beta, write), dict(initial_state=torch.randn(1, H, K, V), output_final_state=True)


@pytest.mark.parametrize("family", ["gated_delta_rule", "gated_delta_rule_chunked"])
@pytest.mark.parametrize("intra_block", [True, False])
def test_gated_delta_twins_agree(family, intra_block):
    reference, twin = (load(path) for path in ops.TWINS[family])
    args, kwargs = gdn_inputs()
    (o_ref, s_ref), (o, s) = (fn(*args, intra_block=intra_block, **kwargs) for fn in (reference, twin))
    assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4


@pytest.mark.parametrize("intra_block", [True, False])
def test_routed_attention_twins_agree(intra_block):
    reference, fast = (load(path) for path in ops.TWINS["routed_attention"])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 2, 16) for _ in range(3))
    keep = torch.tensor([[[1.0], [0.0]]])
    o_ref, o = (fn(q, k, v, keep, intra_block=intra_block) for fn in (reference, fast))
    assert rel_rms(o, o_ref) < 1e-4


@pytest.mark.parametrize("family", ["gated_linear_rule", "gated_linear_rule_chunked"])
@pytest.mark.parametrize("intra_block", [True, False])
def test_gated_linear_twins_agree(family, intra_block):
    reference, twin = (load(path) for path in ops.TWINS[family])
    (q, k, v, g, _, write), kwargs = gdn_inputs()
    (o_ref, s_ref), (o, s) = (fn(q, k, v, g, write, intra_block=intra_block, **kwargs) for fn in (reference, twin))
    assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4
