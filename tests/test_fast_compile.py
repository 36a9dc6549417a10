"""The fast ops are torch.library custom ops: their schemas, fake (shape) implementations and
autograd registrations pass torch.library.opcheck, and a whole model with them compiles with
torch.compile(fullgraph=True) and gives the eager loss and gradients. On the GPU where there is one,
else on the CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there); the inputs
are drawn on the CPU and moved, so that the CPU runs see the same numbers either way."""

import pytest
import torch
import torch.nn.functional as F

import natsl
import natsl.ops
from natsl.fast.block_sparse.function import routed_attention_forward
from natsl.fast.gated_delta.function import gated_delta_forward
from natsl.fast.gated_linear.function import gated_linear_forward
from natsl.fast import short_conv
from natsl.fast.short_conv import short_conv_forward, short_conv_split_forward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("with_write", [True, False])
def test_gated_delta_custom_op_passes_opcheck(with_write):
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 70, 2, 16, 16
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    v = torch.randn(B, T, H, V, generator=gen).to(DEVICE).requires_grad_()
    g = (-torch.rand(B, T, H, generator=gen) * 0.1).to(DEVICE).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen).to(DEVICE).requires_grad_()
    write = torch.randint(0, 2, (B, 2, H), generator=gen).float().to(DEVICE).requires_grad_() if with_write else None
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE).requires_grad_()
    torch.library.opcheck(gated_delta_forward, (q, k, v, g, beta, write, h0, K**-0.5, True, 64, True, "full", True))


@pytest.mark.parametrize("with_write, heads_qk", [(True, 2), (False, 1), (True, 4)])
def test_gated_linear_custom_op_passes_opcheck(with_write, heads_qk):
    """Mamba2's SSD op, also with q, k on fewer heads than v (groups read in place, dq, dk summed back)."""
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = 1, 70, 4, 16, 16
    q = torch.randn(B, T, heads_qk, K, generator=gen).to(DEVICE).requires_grad_()
    k = torch.randn(B, T, heads_qk, K, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(B, T, H, V, generator=gen).to(DEVICE).requires_grad_()
    g = (-torch.rand(B, T, H, generator=gen) * 0.1).to(DEVICE).requires_grad_()
    write = torch.randint(0, 2, (B, 2, H), generator=gen).float().to(DEVICE).requires_grad_() if with_write else None
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE).requires_grad_()
    torch.library.opcheck(gated_linear_forward, (q, k, v, g, write, h0, 1.0, True, 64, True, "full"))


def test_routed_attention_custom_op_passes_opcheck():
    gen = torch.Generator().manual_seed(4)
    B, T, H, D = 1, 70, 4, 16
    q, k, v = (torch.randn(B, T, H, D, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    keep = torch.randint(0, 2, (B, 2, 2), generator=gen).float().to(DEVICE).requires_grad_()
    torch.library.opcheck(routed_attention_forward, (q, k, v, keep, D**-0.5, 64, "full"))


@pytest.mark.parametrize("with_tail", [True, False])
def test_short_conv_custom_op_passes_opcheck(with_tail):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 37, 24, generator=gen).to(DEVICE).requires_grad_()
    weight = torch.randn(24, 1, 4, generator=gen).to(DEVICE).requires_grad_()
    tail = torch.randn(2, 3, 24, generator=gen).to(DEVICE) if with_tail else None
    torch.library.opcheck(short_conv_forward, (x, weight, tail))


def test_split_short_conv_custom_op_passes_opcheck(monkeypatch, use_switches):
    monkeypatch.setattr(short_conv, "FORWARD_TILE", (32, 8))
    use_switches(short_conv_backward="walk")
    monkeypatch.setitem(short_conv.BACKWARD_TILES, "walk", (16, 8, 1))
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 37, 32, generator=gen).to(DEVICE).requires_grad_()
    weight = torch.randn(32, 1, 4, generator=gen).to(DEVICE).requires_grad_()
    torch.library.opcheck(short_conv_split_forward, (x, weight, 8, 16))


@pytest.mark.slow
@pytest.mark.parametrize("joined_convs", [False, True])
def test_whole_model_compiles_around_the_fast_ops(joined_convs, monkeypatch):
    """Also with each layer's q, k, v convs as one op (64-wide channel tiles, so that the tiny
    model's widths, 64, 64 and 128, fit them: the CPU's default backward form, "two_pass", has 64 already;
    the GPU's, "walk", is patched)."""
    if joined_convs:
        monkeypatch.setattr(short_conv, "FORWARD_TILE", (32, 64))
        monkeypatch.setitem(short_conv.BACKWARD_TILES, "walk", (64, 64, 1))
        calls = []
        real = short_conv.short_conv_silu_split
        # natsl.ops reaches the fast twin through natsl.ops.twin, which remembers what it loaded: patch
        # that memory (a patched module attribute would stay remembered after the test)
        monkeypatch.setitem(natsl.ops._LOADED, ("short_conv_silu_split", True),
                            lambda *args: calls.append(1) or real(*args))
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe).to(DEVICE)  # initialised on the CPU: the same weights on either device
    model.set_backend("fast")
    ids = torch.randint(0, recipe.model.vocab_size, (1, 71)).to(DEVICE)

    def loss_and_grads(run):
        model.zero_grad()
        logits = run(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_grads(model)
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, fullgraph=True))
    if joined_convs:
        assert len(calls) == 2 * recipe.model.num_layers  # eager, then traced by the compile
    assert torch.allclose(compiled_loss, eager_loss, rtol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        err = ((compiled_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)).item()
        assert err < 1e-4, (name, err)


@pytest.mark.slow
def test_trainer_with_compile_gives_the_eager_losses(tmp_path):
    """`natsl train --compile` end to end: the loss module with the compiled hidden states and the
    fast ops as custom ops trains to the losses of the eager run (on the GPU where there is one, else on
    the CPU under Triton's interpreter; the recipe trains in fp32 either way)."""
    from natsl.config import apply_overrides
    from natsl.training import TrainOptions, train

    # One GDN and one NAtS-L layer (the tiny recipe has two of each): compiling is most of this test's
    # CPU time, and it grows with the layers.
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), [
        "model.num_layers=2", "model.natsl_layers=[1]",
        "train.seq_len=128", "train.micro_batch_size=2", "train.tokens_per_step=256", "train.eval_every=1000",
        "train.eval_tokens=128", "train.save_every=1000"])
    runs = {}
    for compiled in (False, True):
        runs[compiled] = train(recipe, TrainOptions(
            out_dir=str(tmp_path / str(compiled)), resume="never", device=DEVICE, backend="fast", compile=compiled,
            max_steps=2, save_final=False, progress=False, log=lambda *_: None))
    eager, compiled = ([h["loss"] for h in runs[c].history] for c in (False, True))
    assert len(eager) == 2 and compiled == pytest.approx(eager, rel=1e-5)
    assert runs[True].val_loss == pytest.approx(runs[False].val_loss, rel=1e-5)
