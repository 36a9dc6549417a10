"""The fused NAtS-L read (natsl.fast.mix) against its reference twin, forward and every gradient.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before Triton is imported).
Reference: natsl.reference.mix.mix_branches (the reference twin) run in fp64 on the same inputs (softmax
weights, separate norms). Metric: relative RMS error. The `gpu` test runs the 800M layer's shape.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from natsl.errors import NatslError  # noqa: E402
from natsl.fast import mix  # noqa: E402
from natsl.reference.mix import mix_branches as mix_reference  # noqa: E402
from numerics import output_and_grads as run, rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(mix._mix_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip("natsl.fast was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (5e-3, 1e-2)}  # (forward, gradients)
NAMES = ("o_la", "o_nla", "logits", "gate", "la_weight", "nla_weight")


def make_inputs(b, t, heads, d, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    inputs = [rand(b, t, heads, d).to(dtype), rand(b, t, heads, d, scale=3.0).to(dtype),
              rand(b, t, heads, 2, scale=2.0).to(dtype), rand(b, t, heads * d, scale=2.0).to(dtype),
              1.0 + rand(d, scale=0.2), 1.0 + rand(d, scale=0.2)]  # norm weights stay fp32 (parameters)
    return inputs, rand(b, t, heads * d).to(dtype)


def oracle(inputs, dout, eps):
    return run(lambda la, nla, lg, gt, w1, w2: mix_reference(la, nla, lg, gt, w1, w2, eps),
               inputs, dout, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,t,heads,d", [(1, 1, 3, 32), (2, 37, 3, 32), (1, 70, 2, 128)])
def test_fused_mix_matches_the_formula(dtype, b, t, heads, d, monkeypatch):
    """Output and the six gradients; rows not a multiple of the tile, one token, and (few programs)
    the backward's grid-stride loop over several row tiles per program."""
    monkeypatch.setitem(mix.BACKWARD, "PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(mix, "sm_count", lambda device: 1)
    inputs, dout = make_inputs(b, t, heads, d, dtype)
    eps = 1e-6
    out, grads = run(lambda *xs: mix.mix_branches(*xs, eps), inputs, dout)
    ref_out, ref_grads = oracle(inputs, dout, eps)
    assert out.dtype == dtype and out.shape == (b, t, heads * d)
    fwd_tol, grad_tol = TOL[dtype]
    assert rel_rms(out, ref_out) < fwd_tol
    for name, grad, ref, x in zip(NAMES, grads, ref_grads, inputs):
        assert grad.dtype == x.dtype, name
        assert rel_rms(grad, ref) < grad_tol, (name, rel_rms(grad, ref))


@pytest.mark.parametrize("settings", [{"BLOCK_ROWS": 16, "num_warps": 8}, {"BLOCK_ROWS": 64, "num_stages": 2}])
def test_fused_mix_backward_settings_give_the_same_gradients(settings, monkeypatch):
    """Other backward launch settings (`python -m benchmarks.ops --op mix --sweep`): the per-row gradients bitwise equal
    (on a GPU within fp32 rounding), the norm weights' (summed in another order) within fp32 rounding."""
    monkeypatch.setattr(mix, "sm_count", lambda device: 1)
    inputs, dout = make_inputs(2, 37, 3, 32, torch.float32)
    _, default = run(lambda *xs: mix.mix_branches(*xs, 1e-6), inputs, dout)
    for key, value in settings.items():
        monkeypatch.setitem(mix.BACKWARD, key, value)
    _, other = run(lambda *xs: mix.mix_branches(*xs, 1e-6), inputs, dout)
    for name, a, b in zip(NAMES, other, default):
        if name.endswith("weight"):
            assert rel_rms(a, b) < 1e-6, name
        elif DEVICE == "cuda":  # other num_warps split a row's sums across warps: another order on the GPU
            assert rel_rms(a, b) < 1e-6, (name, rel_rms(a, b))
        else:
            assert torch.equal(a, b), name


def test_fused_mix_rejects_what_it_cannot_take():
    inputs, _ = make_inputs(1, 4, 2, 24, torch.float32)
    with pytest.raises(NatslError, match="power of two"):
        mix.mix_branches(*inputs, 1e-6)
    inputs, _ = make_inputs(1, 4, 2, 32, torch.float32)
    inputs[2] = inputs[2][..., :1]
    with pytest.raises(NatslError, match="do not fit"):
        mix.mix_branches(*inputs, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_mix_at_the_800m_shape():
    """bf16, 2 x 4096 tokens x 18 heads x 128 (the 800M NAtS-L layer), against the fp64 formula."""
    inputs, dout = make_inputs(2, 4096, 18, 128, torch.bfloat16)
    out, grads = run(lambda *xs: mix.mix_branches(*xs, 1e-6), inputs, dout)
    ref_out, ref_grads = oracle(inputs, dout, 1e-6)
    assert rel_rms(out, ref_out) < 5e-3
    for name, grad, ref in zip(NAMES, grads, ref_grads):
        assert rel_rms(grad, ref) < 1e-2, (name, rel_rms(grad, ref))


@pytest.mark.parametrize("changes,env,expected", [({}, None, 2), ({}, "0", 0), ({"mix_weights": "sigmoid"}, None, 0),
                                                  ({"branch_norm": "after_sum"}, None, 0)],
                         ids=["default", "switched-off", "sigmoid-weights", "one-norm"])
def test_the_layer_takes_the_fused_read_only_where_it_applies(changes, env, expected, monkeypatch, use_switches):
    """The tiny hybrid's two NAtS-L layers read through natsl.fast.mix on the fast backend with softmax
    weights and separate norms; the switch fused_mix off and the other Table 4 variants keep the formula."""
    import dataclasses

    import natsl

    if env is not None:
        use_switches(fused_mix=env != "0")
    calls = []
    real = mix.mix_branches
    # natsl.ops.mix reaches the fast twin through natsl.ops.twin, which remembers what it loaded
    from natsl import ops

    monkeypatch.setitem(ops._LOADED, ("mix_branches", True), lambda *args: calls.append(1) or real(*args))
    config = dataclasses.replace(natsl.load_recipe("tiny_hybrid").model, backend="fast", **changes)
    torch.manual_seed(0)
    model = natsl.build_model(config).to(DEVICE)
    with torch.no_grad():
        model(torch.randint(0, config.vocab_size, (1, 20), device=DEVICE))
    assert len(calls) == expected
