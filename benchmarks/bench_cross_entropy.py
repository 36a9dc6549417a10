"""The LM loss's softmax work per chunk: natsl.fast.cross_entropy's kernel against the eager ops (GPU).

    PYTHONPATH=. python3 benchmarks/bench_cross_entropy.py [--out bench_cross_entropy.json]

One chunk of the 800M head (bf16 logits [4096, 32000], as linear_cross_entropy takes them after the
head's matmul): the eager chunk (cast to fp32, max, exp, sum, softmax, one-hot, scale, cast back)
and the kernel (two reads and one write of the chunk), each turning the logits into the loss per row
and the gradient. Median of triton.testing.do_bench over a fresh copy each call (the copy's time is
measured alone and subtracted). Before timing, the two forms' losses and gradients are compared
(relative RMS). GB/s counts the kernel's necessary traffic (the chunk read twice, written once) for both.
Then the whole loss (linear_cross_entropy, forward with its gradients, micro-batch 8 x 4096 rows,
hidden 1536) both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS, VOCAB, HIDDEN, TOKENS = 4096, 32000, 1536, 8 * 4096


def rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_cross_entropy.json")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    from natsl.fast.cross_entropy import softmax_cross_entropy_
    from natsl.provenance import provenance
    from natsl.training import loss as L

    dev = "cuda"
    torch.manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, device=dev, dtype=torch.bfloat16) * 3
    targets = torch.randint(0, VOCAB, (ROWS,), device=dev)
    valid = torch.ones(ROWS, dtype=torch.bool, device=dev)
    scale = torch.tensor(1.0 / TOKENS, device=dev)

    def eager(x):
        total = torch.zeros((), device=dev)
        grad = L._eager_chunk(x, targets[:, None], valid, scale, torch.float32, torch.bfloat16, True, total)
        return total, grad

    def fused(x):
        total = torch.zeros((), device=dev)
        grad = L._fused_chunk(x, targets, valid, scale, True, total)
        return total, grad

    (ref_loss, ref_grad), (got_loss, got_grad) = eager(logits.clone()), fused(logits.clone())
    errors = {"loss": rel_rms(got_loss, ref_loss), "grad": rel_rms(got_grad, ref_grad)}
    print("kernel vs eager, relative RMS:", {k: f"{v:.1e}" for k, v in errors.items()})
    work = logits.clone()
    copy_ms = do_bench(lambda: work.copy_(logits), warmup=25, rep=100)
    rows = []
    chunk_bytes = 3 * ROWS * VOCAB * 2
    for name, fn in (("eager ops", eager), ("fused kernel", fused)):
        ms = do_bench(lambda: fn(work.copy_(logits)), warmup=25, rep=100) - copy_ms
        rows.append({"what": "one chunk 4096 x 32000", "form": name, "ms": ms, "GB/s": chunk_bytes / ms / 1e6})
    hidden = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN, device=dev) * 0.02).requires_grad_()
    ids = torch.randint(0, VOCAB, (TOKENS,), device=dev)
    for name, flag in (("eager ops", False), ("fused kernel", True)):
        def whole():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return torch.autograd.grad(L.linear_cross_entropy(hidden, weight, ids, fused=flag), (hidden, weight))
        ms = do_bench(whole, warmup=5, rep=50)
        rows.append({"what": "linear_cross_entropy 8 x 4096 rows, with gradients", "form": name, "ms": ms})
    for r in rows:
        print(f"{r['what']:52s} {r['form']:13s} {r['ms']:8.3f} ms" + (f" {r['GB/s']:7.0f} GB/s" if "GB/s" in r else ""))
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "errors": errors, "copy_ms": copy_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
