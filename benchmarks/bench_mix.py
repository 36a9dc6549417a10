"""The NAtS-L read on its Triton kernels (natsl.fast.mix) against Inductor's compiled formula (GPU).

    PYTHONPATH=. python3 benchmarks/bench_mix.py [--out bench_mix.json] [--sweep]

The 800M layer's read (18 softmax heads x Dv 128, separate norms, softmax weights), bf16: an 800M
training micro-batch [8, 4096] (forward, and forward + backward through torch.autograd.grad) and a
128K prefill [1, 131072] (forward). Each row is the median of triton.testing.do_bench; before timing,
the two forms' outputs (and gradients) are compared, relative RMS. GB/s counts the bytes each
direction must move: forward o_la, o_nla, gate, logits read and out written; backward also dout read
and the four gradients written. The op alone, standalone: in a compiled step Inductor fuses the
formula with its neighbours differently (docs/benchmarks.md has the step's profile).

--sweep times the backward kernel alone at the training shape under other launch settings
(natsl.fast.mix.BACKWARD: rows per tile, warps, pipelining stages, programs per SM), each checked
against the default's gradients (the per-row ones must be bitwise equal), and prints the fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS, DV = 18, 128
SHAPES = {"train 8x4096": (8, 4096, True), "prefill 1x131072": (1, 131072, False)}


def rel_rms(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def time_forms(label: str, forms: dict, inputs: list, dout, backward: bool, fwd_bytes: int, bwd_bytes: int,
               rows: list) -> None:
    """Compare the forms' outputs (and gradients) with the first form's, then time each: forward, and
    forward + backward through torch.autograd.grad when `backward`; rows appended to `rows`."""
    import torch
    from triton.testing import do_bench

    leaves = [x.requires_grad_(backward) if x.is_floating_point() else x for x in inputs]
    results = {}
    for name, fn in forms.items():
        with torch.no_grad():
            out = fn(*inputs)
        grads = torch.autograd.grad(fn(*leaves), leaves, dout) if backward else ()
        results[name] = (out, grads)
        with torch.no_grad():
            ms = do_bench(lambda: fn(*inputs), warmup=25, rep=100)
        rows.append({"shape": label, "form": name, "pass": "forward", "ms": ms, "GB/s": fwd_bytes / ms / 1e6})
        if backward:
            ms = do_bench(lambda: torch.autograd.grad(fn(*leaves), leaves, dout), warmup=25, rep=100)
            rows.append({"shape": label, "form": name, "pass": "forward+backward", "ms": ms,
                         "GB/s": (fwd_bytes + bwd_bytes) / ms / 1e6})
    (ref_out, ref_grads), *others = results.values()
    for name, (out, grads) in zip(list(results)[1:], others):
        errors = {"out": rel_rms(out, ref_out)}
        errors.update({f"d{i}": rel_rms(g, r) for i, (g, r) in enumerate(zip(grads, ref_grads))})
        rows.append({"shape": label, f"relative RMS, {name} vs {next(iter(results))}": errors})
        print(label, f"{name} vs {next(iter(results))}, relative RMS:", {k: f"{v:.1e}" for k, v in errors.items()})


def report(rows: list, path: str) -> None:
    """The table on stdout, and the rows with provenance() as JSON at `path`."""
    from natsl.provenance import provenance

    print(f"{'shape':18s} {'form':18s} {'pass':17s} {'ms':>8s} {'GB/s':>8s}")
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:18s} {r['form']:18s} {r['pass']:17s} {r['ms']:8.3f} {r['GB/s']:8.0f}")
    with open(path, "w") as f:
        json.dump({"provenance": provenance(), "rows": rows}, f, indent=1)


SWEEP = [dict(BLOCK_ROWS=r, num_warps=w, num_stages=None, PROGRAMS_PER_SM=p)
         for r in (16, 32, 64) for w in (4, 8) for p in (8, 16)] + [
        dict(BLOCK_ROWS=r, num_warps=w, num_stages=None, PROGRAMS_PER_SM=p)
        for r, w in ((8, 1), (16, 1), (8, 2), (16, 2), (32, 2)) for p in (8, 16, 32)] + [
        dict(BLOCK_ROWS=32, num_warps=4, num_stages=s, PROGRAMS_PER_SM=8) for s in (1, 2, 3, 4)]


def sweep_backward(path: str, dev: str = "cuda", b: int = 8, t: int = 4096, settings_list=None) -> None:
    """The backward kernel at the training shape under each SWEEP setting, against the default."""
    import torch
    from triton.testing import do_bench

    from natsl.fast import mix

    torch.manual_seed(0)
    bf = torch.bfloat16
    args = [torch.randn(b, t, HEADS, DV, device=dev, dtype=bf), torch.randn(b, t, HEADS, DV, device=dev, dtype=bf),
            torch.randn(b, t, HEADS, 2, device=dev, dtype=bf), torch.randn(b, t, HEADS * DV, device=dev, dtype=bf),
            1 + 0.1 * torch.randn(DV, device=dev), 1 + 0.1 * torch.randn(DV, device=dev), 1e-6,
            torch.randn(b, t, HEADS * DV, device=dev, dtype=bf)]
    default = dict(mix.BACKWARD)
    reference = mix.backward(*args)
    rows = []
    for settings in [default] + (SWEEP if settings_list is None else settings_list):
        mix.BACKWARD.update(settings)
        try:
            grads = mix.backward(*args)
            per_row_equal = all(torch.equal(g, r) for g, r in zip(grads[:4], reference[:4]))
            weight_rel = max(rel_rms(g, r) for g, r in zip(grads[4:], reference[4:]))
            ms = do_bench(lambda: mix.backward(*args), warmup=25, rep=100)
            rows.append(dict(settings=dict(settings), ms=ms, per_row_equal=per_row_equal, weight_rel=weight_rel))
            print(f"{settings}  {ms:.3f} ms  per-row gradients equal {per_row_equal}  weights {weight_rel:.1e}",
                  flush=True)
        except Exception as exc:  # a setting the compiler refuses (e.g. out of shared memory)
            rows.append(dict(settings=dict(settings), error=repr(exc)[:300]))
            print(settings, "failed:", repr(exc)[:200], flush=True)
        finally:
            mix.BACKWARD.clear()
            mix.BACKWARD.update(default)
    ok = [r for r in rows if "ms" in r and r["per_row_equal"] and r["weight_rel"] < 1e-3]
    best = min(ok, key=lambda r: r["ms"])
    print(f"default {rows[0]['ms']:.3f} ms; fastest {best['ms']:.3f} ms with {best['settings']}")
    from natsl.provenance import provenance

    with open(path, "w") as f:
        json.dump({"provenance": provenance(), "shape": [b, t, HEADS, DV], "rows": rows, "best": best}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_mix.json")
    parser.add_argument("--sweep", action="store_true", help="time the backward's launch settings instead")
    args = parser.parse_args()
    if args.sweep:
        sweep_backward(args.out)
        return
    import torch

    from natsl.fast import mix
    from natsl.models import pointwise as pw

    dev, bf = "cuda", torch.bfloat16
    compiled = torch.compile(pw.mix_branches.eager)
    forms = {"compiled formula": lambda la, nla, lg, gt, w1, w2: compiled(la, nla, lg, "softmax", gt, w1, w2, None, 1e-6),
             "fused kernels": lambda la, nla, lg, gt, w1, w2: mix.mix_branches(la, nla, lg, gt, w1, w2, 1e-6)}
    rows = []
    for label, (b, t, backward) in SHAPES.items():
        torch.manual_seed(0)
        inputs = [torch.randn(b, t, HEADS, DV, device=dev, dtype=bf), torch.randn(b, t, HEADS, DV, device=dev, dtype=bf),
                  torch.randn(b, t, HEADS, 2, device=dev, dtype=bf), torch.randn(b, t, HEADS * DV, device=dev, dtype=bf),
                  1 + 0.1 * torch.randn(DV, device=dev), 1 + 0.1 * torch.randn(DV, device=dev)]
        dout = torch.randn(b, t, HEADS * DV, device=dev, dtype=bf)
        big = b * t * HEADS * DV * 2  # bytes of one [rows, Dv] bf16 tensor
        fwd_bytes, bwd_bytes = 4 * big, 4 * big + 3 * big  # (fwd: 3 read + 1 written; logits are ~2%)
        time_forms(label, forms, inputs, dout, backward, fwd_bytes, bwd_bytes, rows)
    report(rows, args.out)


if __name__ == "__main__":
    main()
