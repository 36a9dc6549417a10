"""The fused GDN output norm and gate (natsl.fast.gated_norm) against its reference twin, forward
and every gradient.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before Triton is imported).
Reference: natsl.models.pointwise.gated_rms_norm run eagerly in fp64 on the same inputs. Metric:
relative RMS error. The `gpu` test runs the 800M GDN layer's shape.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from natsl.errors import NatslError  # noqa: E402
from natsl.fast import gated_norm  # noqa: E402
from natsl.models import pointwise as pw  # noqa: E402
from numerics import output_and_grads as run, rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(gated_norm._gated_norm_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip("natsl.fast was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (5e-3, 1e-2)}  # (forward, gradients)
NAMES = ("x", "weight", "gate")


def make_inputs(shape, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*dims, scale=1.0):
        return (torch.randn(*dims, generator=g) * scale).to(device)

    d = shape[-1]
    # x, weight (an fp32 parameter), gate; and the upstream gradient
    return [rand(*shape, scale=3.0).to(dtype), 1.0 + rand(d, scale=0.2), rand(*shape, scale=2.0).to(dtype)], \
        rand(*shape).to(dtype)


def oracle(inputs, dout, eps):
    return run(lambda x, w, gate: pw.gated_rms_norm.eager(x, w, eps, gate), inputs, dout, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1, 2, 64), (2, 37, 3, 384), (1, 70, 2, 48)],
                         ids=["one-token", "800m-head-dim", "odd-dim"])
def test_fused_gated_norm_matches_the_formula(dtype, shape, monkeypatch):
    """Output and the three gradients: one token, the 800M head dim (384, padded to 512 in the kernel),
    a dim that is no power of two, rows not a multiple of the tile and (few programs) the backward's
    grid-stride loop over several row tiles per program."""
    monkeypatch.setattr(gated_norm, "PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(gated_norm, "sm_count", lambda device: 1)
    monkeypatch.setattr(gated_norm, "ROW_VALUES", 1024)  # several row tiles even at these sizes
    inputs, dout = make_inputs(shape, dtype)
    eps = 1e-6
    out, grads = run(lambda x, w, gate: gated_norm.gated_rms_norm(x, w, eps, gate), inputs, dout)
    ref_out, ref_grads = oracle(inputs, dout, eps)
    assert out.dtype == dtype and out.shape == shape
    fwd_tol, grad_tol = TOL[dtype]
    assert rel_rms(out, ref_out) < fwd_tol
    for name, grad, ref, x in zip(NAMES, grads, ref_grads, inputs):
        assert grad.dtype == x.dtype, name
        assert rel_rms(grad, ref) < grad_tol, (name, rel_rms(grad, ref))


def test_the_custom_op_and_the_eager_twin_agree_bitwise(monkeypatch):
    """Compiled models reach the kernels through the custom-op pair, eager calls through the
    autograd.Function twin: same output and gradients, bit for bit."""
    from natsl.fast import eager

    inputs, dout = make_inputs((2, 5, 2, 96), torch.float32)
    eager_out, eager_grads = run(lambda x, w, gate: gated_norm.gated_rms_norm(x, w, 1e-6, gate), inputs, dout)
    monkeypatch.setattr(eager, "_compiling", lambda: True)
    op_out, op_grads = run(lambda x, w, gate: gated_norm.gated_rms_norm(x, w, 1e-6, gate), inputs, dout)
    assert torch.equal(eager_out, op_out)
    for a, b in zip(eager_grads, op_grads):
        assert torch.equal(a, b)


def test_fused_gated_norm_rejects_shapes_that_do_not_fit():
    inputs, _ = make_inputs((1, 4, 2, 32), torch.float32)
    with pytest.raises(NatslError, match="do not fit"):
        gated_norm.gated_rms_norm(inputs[0], inputs[1][:16], 1e-6, inputs[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_gated_norm_at_the_800m_shape():
    """bf16, 2 x 4096 tokens x 6 heads x 384 (the 800M GDN layer), against the fp64 formula."""
    inputs, dout = make_inputs((2, 4096, 6, 384), torch.bfloat16)
    out, grads = run(lambda x, w, gate: gated_norm.gated_rms_norm(x, w, 1e-6, gate), inputs, dout)
    ref_out, ref_grads = oracle(inputs, dout, 1e-6)
    assert rel_rms(out, ref_out) < 5e-3
    for name, grad, ref in zip(NAMES, grads, ref_grads):
        assert rel_rms(grad, ref) < 1e-2, (name, rel_rms(grad, ref))


@pytest.mark.parametrize("env,expected", [(None, 0), ("1", 2)], ids=["default-off", "switched-on"])
def test_the_gdn_layers_take_the_kernels_only_when_switched_on(env, expected, monkeypatch):
    """The tiny hybrid's two GDN layers use natsl.fast.gated_norm on the fast backend only with
    NATSL_FUSED_GATED_NORM=1, and the model's loss and gradients then equal the formula's."""
    import dataclasses

    import natsl

    config = dataclasses.replace(natsl.load_recipe("tiny_hybrid").model, backend="fast")
    torch.manual_seed(0)
    model = natsl.build_model(config).to(DEVICE)
    tokens = torch.randint(0, config.vocab_size, (2, 20), device=DEVICE)

    def loss_and_grads():
        model.zero_grad()
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    want_loss, want_grads = loss_and_grads()
    if env is not None:
        monkeypatch.setenv("NATSL_FUSED_GATED_NORM", env)
    calls = []
    real = gated_norm.gated_rms_norm
    monkeypatch.setattr(gated_norm, "gated_rms_norm", lambda *args: calls.append(1) or real(*args))
    loss, grads = loss_and_grads()
    assert len(calls) == expected
    assert rel_rms(loss, want_loss) < 1e-6
    for got, want in zip(grads, want_grads):
        assert rel_rms(got, want) < 1e-5
