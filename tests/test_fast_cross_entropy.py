"""The fused LM-loss kernel (natsl.fast.cross_entropy) against its reference twin, and the chunked
loss on it against the full-logits formula.

On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (set before Triton is imported).
Reference: log_softmax in fp64 on the same logits (per-row loss, and (softmax - onehot) * scale as
the gradient). Metric: relative RMS error. The `gpu` test runs the 800M head's chunk (4096 x 32000).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from natsl import ops  # noqa: E402
from natsl.errors import NatslError  # noqa: E402
from natsl.fast import cross_entropy as xent  # noqa: E402
from natsl.training.loss import linear_cross_entropy  # noqa: E402
from numerics import rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(xent._softmax_xent_kernel).__name__ != "InterpretedFunction":
    pytest.skip("natsl.fast was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (5e-3, 1e-2)}  # (loss, gradient)


def reference(logits, targets, row_scale):
    """(per-row loss, gradient) in fp64."""
    x = logits.double()
    logp = torch.log_softmax(x, dim=-1)
    loss = -logp.gather(1, targets[:, None]).squeeze(1)
    grad = (logp.exp() - F.one_hot(targets, x.shape[1]).double()) * row_scale.double()[:, None]
    return loss, grad


def make(rows, vocab, dtype, seed=0, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * spread).to(dtype).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    row_scale = (torch.rand(rows, generator=g) + 0.5).to(DEVICE)
    return logits, targets, row_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,vocab,block_v", [(1, 1, None), (5, 37, None), (7, 300, 64), (3, 257, 256), (4, 128, 32)])
def test_kernel_matches_log_softmax(dtype, rows, vocab, block_v):
    """Loss per row and the in-place gradient: one column, a vocabulary inside one tile, several tiles
    with a ragged last one, a tile boundary one short of the vocabulary, and an exact multiple."""
    logits, targets, row_scale = make(rows, vocab, dtype)
    ref_loss, ref_grad = reference(logits, targets, row_scale)
    work = logits.clone()
    loss = xent.softmax_cross_entropy_(work, targets, row_scale, block_v=block_v)
    loss_tol, grad_tol = TOL[dtype]
    assert loss.dtype == torch.float32 and loss.shape == (rows,)
    assert rel_rms(loss, ref_loss) < loss_tol or vocab == 1 and loss.abs().max() == 0
    assert work.dtype == dtype
    assert rel_rms(work, ref_grad) < grad_tol or vocab == 1 and work.abs().max() == 0


def test_kernel_is_stable_far_from_zero_and_skips_the_gradient_without_a_scale():
    """Logits around +-1e4 (a naive exp overflows) and a zero scale (a row that does not count); no
    row_scale leaves the logits untouched."""
    logits, targets, row_scale = make(6, 300, torch.float32, seed=3)
    logits = logits * 50 + torch.tensor([1e4, -1e4, 0, 0, 0, 0], device=DEVICE)[:, None]
    row_scale[2] = 0
    ref_loss, ref_grad = reference(logits, targets, row_scale)
    work = logits.clone()
    loss = xent.softmax_cross_entropy_(work, targets, row_scale, block_v=64)
    assert torch.isfinite(loss).all() and rel_rms(loss, ref_loss) < 1e-6
    assert rel_rms(work, ref_grad) < 1e-5 and work[2].abs().max() == 0
    untouched = logits.clone()
    loss_only = xent.softmax_cross_entropy_(untouched, targets, block_v=64)
    assert torch.equal(untouched, logits) and torch.equal(loss_only, loss)


def test_kernel_reads_strided_rows_targets_and_row_scale():
    """Every other row of a chunk, with targets and row_scale as strided views: loss and in-place
    gradient as the reference's on the same values (the kernel reads the logits by their row stride;
    targets and row_scale go to it contiguous)."""
    chunk, targets, row_scale = make(14, 37, torch.float32, seed=5)
    logits, targets, row_scale = chunk[::2], targets[::2], row_scale[::2]
    assert not (logits.is_contiguous() or targets.is_contiguous() or row_scale.is_contiguous())
    ref_loss, ref_grad = reference(logits, targets, row_scale)
    work = chunk.clone()[::2]
    loss = xent.softmax_cross_entropy_(work, targets, row_scale, block_v=16)
    assert rel_rms(loss, ref_loss) < 1e-6 and rel_rms(work, ref_grad) < 1e-5


def test_a_target_outside_the_vocabulary_gives_a_nan_loss_not_a_stray_read():
    logits, targets, row_scale = make(4, 40, torch.float32)
    targets[1], targets[2] = 40, -1
    loss = xent.softmax_cross_entropy_(logits.clone(), targets, row_scale)
    assert torch.isnan(loss[1:3]).all() and torch.isfinite(loss[[0, 3]]).all()


def test_kernel_rejects_what_it_cannot_take():
    logits, targets, row_scale = make(4, 40, torch.float32)
    with pytest.raises(NatslError, match="unit column stride"):
        xent.softmax_cross_entropy_(logits.t(), targets, row_scale)
    with pytest.raises(NatslError, match="unit column stride"):
        xent.softmax_cross_entropy_(logits.double(), targets, row_scale)
    with pytest.raises(NatslError, match="do not match"):
        xent.softmax_cross_entropy_(logits, targets[:3], row_scale)
    with pytest.raises(NatslError, match="row_scale"):
        xent.softmax_cross_entropy_(logits, targets, row_scale.double())
    with pytest.raises(NatslError, match="power of two"):
        xent.softmax_cross_entropy_(logits, targets, row_scale, block_v=48)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [16, 111])
def test_chunked_loss_on_the_kernel_matches_full_logits(reduction, chunk):
    """linear_cross_entropy(fused=True) in fp32 with ignored targets: loss, grad(hidden), grad(head)
    against F.cross_entropy on the full logits, and against the eager chunks."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 37, 24, generator=g).to(DEVICE).requires_grad_()
    weight = (torch.randn(101, 24, generator=g) * 0.5).to(DEVICE).requires_grad_()
    targets = torch.randint(0, 101, (3, 37), generator=g).to(DEVICE)
    targets[0, :9] = -100
    ref = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), targets.flatten(), reduction=reduction)
    ref_h, ref_w = torch.autograd.grad(ref * 0.7, (hidden, weight))
    for fused in (True, False):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk, reduction=reduction, fused=fused)
        got_h, got_w = torch.autograd.grad(loss * 0.7, (hidden, weight))
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), fused
        assert rel_rms(got_h, ref_h) < 1e-5 and rel_rms(got_w, ref_w) < 1e-5, fused
    with torch.no_grad():  # the evaluation path: the loss only
        assert abs(linear_cross_entropy(hidden, weight, targets, chunk_size=chunk, reduction=reduction,
                                        fused=True).item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_the_loss_takes_the_kernel_only_on_cuda_and_not_when_switched_off(monkeypatch, use_switches):
    calls = []
    real = xent.softmax_cross_entropy_
    # the loss reaches the kernel through natsl.ops.twin, which remembers what it loaded: patch that memory
    # (a patched module attribute would stay remembered after the test)
    monkeypatch.setitem(ops._LOADED, ("cross_entropy", True), lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden = torch.randn(2, 5, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(11, 8, device=DEVICE, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), device=DEVICE)
    linear_cross_entropy(hidden, weight, targets, chunk_size=4).backward()
    assert len(calls) == (3 if DEVICE == "cuda" else 0)
    use_switches(fused_loss=False)
    linear_cross_entropy(hidden, weight, targets, chunk_size=4).backward()
    linear_cross_entropy(hidden.double(), weight.double(), targets, chunk_size=4, fused=True).backward()
    assert len(calls) == (3 if DEVICE == "cuda" else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_at_the_800m_chunk():
    """bf16 [4096, 32000] logits (one chunk of the 800M head) against the fp64 formula."""
    logits, targets, row_scale = make(4096, 32000, torch.bfloat16, spread=3.0)
    ref_loss, ref_grad = reference(logits, targets, row_scale)
    work = logits.clone()
    loss = xent.softmax_cross_entropy_(work, targets, row_scale)
    assert rel_rms(loss, ref_loss) < 5e-3
    assert rel_rms(work, ref_grad) < 1e-2
