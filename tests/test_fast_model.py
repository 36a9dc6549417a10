"""A whole tiny NAtS-L Hybrid on the fast path: loss and every parameter gradient match the
PyTorch path (the chunked form, itself pinned to the recurrent reference)."""

import dataclasses

import pytest
import torch

import natsl
from numerics import rel_rms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loss_and_grads(model, ids, backend):
    model.set_backend(backend)
    model.zero_grad(set_to_none=True)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_model(device, length, route_grad, tol_loss, tol_grad, dtype=torch.float32):
    base = natsl.load_recipe("tiny_hybrid").model
    cfg = dataclasses.replace(base, route_grad=route_grad, natsl_rope=True)
    torch.manual_seed(0)
    model = natsl.build_model(cfg, device=device).to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (2, length + 1), device=device)
    loss_ref, grads_ref = loss_and_grads(model, ids, "chunked")
    loss_fast, grads_fast = loss_and_grads(model, ids, "fast")
    assert abs(loss_fast.item() - loss_ref.item()) <= tol_loss * abs(loss_ref.item())
    assert grads_fast.keys() == grads_ref.keys()
    router_grads = [n for n in grads_ref if n.endswith("router.weight")]
    assert router_grads and all(grads_ref[n].abs().sum() > 0 for n in router_grads)
    worst = max(grads_ref, key=lambda n: rel_rms(grads_fast[n], grads_ref[n]))
    assert rel_rms(grads_fast[worst], grads_ref[worst]) <= tol_grad, worst


@pytest.mark.parametrize("route_grad", ["active", "full"])
def test_tiny_hybrid_fast_matches_pytorch_on_a_short_sequence(route_grad):
    # T = 100: one full 64-token block and a partial one, so both routes are exercised. On the GPU where
    # there is one, else on the CPU under Triton's interpreter; fp32 either way (the fast kernels' fp32 dots
    # are ieee or tf32x3 on the GPU), with the same bounds.
    check_model(DEVICE, 100, route_grad, tol_loss=1e-5, tol_grad=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("route_grad", ["active", "full"])
def test_tiny_hybrid_fast_matches_pytorch_on_gpu(route_grad):
    check_model("cuda", 1000, route_grad, tol_loss=1e-4, tol_grad=5e-3)
