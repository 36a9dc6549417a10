"""The chunked LM loss (natsl.training.loss) equals cross-entropy on the full logits: loss and the
gradients of the hidden states and the head, in fp64 and fp32, chunks that do not divide the rows,
ignored targets; and the trainer's losses with it equal those of the plain formula."""

import pytest
import torch
import torch.nn.functional as F

from natsl.training.loss import linear_cross_entropy

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in norm (absolute where the reference is all zeros)."""
    return ((a - b).norm() / b.norm().clamp(min=1.0 if b.norm() == 0 else 0.0)).item()


def inputs(dtype, batch=3, seq=37, d=24, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, d, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return hidden, weight, targets


def plain(hidden, weight, targets, **kw):
    """The reference: `F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten())` (fp64 kept fp64)."""
    logits = F.linear(hidden, weight)
    logits = logits.float() if logits.dtype != torch.float64 else logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 16, 50, 111, 4096])  # N = 3 x 37 = 111 rows
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_full_logits(dtype, chunk, reduction):
    hidden, weight, targets = inputs(dtype)
    ref = plain(hidden, weight, targets, reduction=reduction)
    ref_h, ref_w = torch.autograd.grad(ref * 0.7, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk, reduction=reduction)
    assert loss.dtype == ref.dtype and loss.shape == ()
    got_h, got_w = torch.autograd.grad(loss * 0.7, (hidden, weight))
    assert got_h.dtype == dtype and got_w.dtype == dtype
    tol = TOL[dtype]
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    assert rel(got_h, ref_h) <= tol and rel(got_w, ref_w) <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ignore_index_and_accumulated_backward(dtype):
    hidden, weight, targets = inputs(dtype, seed=1)
    targets[0, :9] = -100
    targets[2, -3:] = -100
    ref = plain(hidden, weight, targets, ignore_index=-100)
    # two backward passes into .grad, as in gradient accumulation
    (ref / 2).backward()
    (ref.detach() * 0 + plain(hidden, weight, targets, ignore_index=-100) / 2).backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    for _ in range(2):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=20, ignore_index=-100)
        (loss / 2).backward()
    tol = TOL[dtype]
    assert abs(loss.item() - ref.item()) <= tol * ref.item()
    assert rel(hidden.grad, ref_h) <= tol and rel(weight.grad, ref_w) <= tol
    assert hidden.grad[0, :9].abs().max() == 0  # ignored rows get no gradient


def test_no_grad_and_hidden_only_gradient():
    hidden, weight, targets = inputs(torch.float64, seed=2)
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, targets, chunk_size=7).item() == \
            pytest.approx(plain(hidden, weight, targets).item(), rel=1e-12)
    frozen = weight.detach()
    loss = linear_cross_entropy(hidden, frozen, targets, chunk_size=7)
    (got,) = torch.autograd.grad(loss, hidden)
    (ref,) = torch.autograd.grad(plain(hidden, frozen, targets), hidden)
    assert rel(got, ref) <= 1e-10


def test_bf16_head_matches_autocast_formula():
    """compute_dtype bf16 is what bf16 autocast does to the plain formula (up to bf16 rounding)."""
    hidden, weight, targets = inputs(torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=16, compute_dtype=torch.bfloat16)
    got_h, got_w = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert got_h.dtype == got_w.dtype == torch.float32
    assert rel(got_h, ref_h) < 2e-2 and rel(got_w, ref_w) < 2e-2


def test_model_hidden_states_and_parameter_gradients():
    """CausalLM.hidden_states + the chunked loss == cross_entropy(model(ids)) for every parameter's gradient
    (fp64, where rounding does not hide a wrong term)."""
    from natsl.config import load_recipe
    from natsl.models import build_model

    from pathlib import Path

    recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "tiny_hybrid.yaml")
    torch.manual_seed(0)
    model = build_model(recipe, device="cpu").double()
    model.set_backend("chunked")
    ids = torch.randint(0, recipe.model.vocab_size, (2, 65))
    inputs_, targets = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        assert torch.equal(model.lm_head(model.hidden_states(inputs_)), model(inputs_))
    params = [p for p in model.parameters()]
    ref = F.cross_entropy(model(inputs_).flatten(0, 1), targets.flatten())
    ref_g = torch.autograd.grad(ref, params)
    loss = linear_cross_entropy(model.hidden_states(inputs_), model.lm_head.weight, targets, chunk_size=50)
    got_g = torch.autograd.grad(loss, params)
    assert loss.dtype == torch.float64 and loss.item() == pytest.approx(ref.item(), rel=1e-12)
    for p, a, b in zip(params, got_g, ref_g):
        assert rel(a, b) <= 1e-10, [n for n, q in model.named_parameters() if q is p]


def test_trainer_losses_unchanged(tmp_path, natsl_cache_dir, monkeypatch):
    """A few steps of the tiny recipe (CPU, chunked backend): the chunked loss (chunks that do not divide
    the 512 tokens of a micro-batch, and the default) trains to the same losses as the full logits."""
    from natsl.config import apply_overrides, load_recipe
    from natsl.training import TrainOptions, train

    from pathlib import Path

    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)
    recipe = apply_overrides(load_recipe(Path(__file__).resolve().parent.parent / "recipes" / "tiny_hybrid.yaml"),
                             ["train.seq_len=128", "train.micro_batch_size=4", "train.tokens_per_step=1024",
                              "train.eval_every=2", "train.eval_tokens=2048"])

    def run(chunk):
        result = train(recipe, TrainOptions(out_dir=str(tmp_path / f"chunk{chunk}"), resume="never", device="cpu",
                                            backend="chunked", max_steps=4, threads=1, save_final=False,
                                            progress=False, loss_chunk=chunk, log=lambda *_: None))
        return [r["loss"] for r in result.history], [r["grad_norm"] for r in result.history], result.val_loss

    ref_loss, ref_norm, ref_val = run(0)
    for chunk in (100, 4096):
        loss, norm, val = run(chunk)
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
        assert val == pytest.approx(ref_val, rel=1e-5)
    assert len(ref_loss) == 4 and ref_val is not None
