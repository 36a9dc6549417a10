"""The Triton short conv + SiLU (natsl.fast.short_conv) against its formula compiled by Inductor (GPU).

    PYTHONPATH=. python3 benchmarks/bench_short_conv.py [--out bench_short_conv.json] [--joined]

Medians of triton.testing.do_bench, bf16, at an 800M training micro-batch [4, 4096, C] for the GDN
layer's q/k (C = 1152) and v (2304) widths: the op's forward and its backward launcher
(natsl.fast.short_conv.backward, called directly: no autograd) for a few settings of both forms (the
fastest is the one to keep in natsl/fast/short_conv.py; the "walk" settings each checked against the
default's dx and dw), the default "walk" setting also with x a
column slice of a wider tensor (as the model hands it over), the weight-gradient partials' sum
alone; and, with --with-compiled, torch.compile(natsl.models.pointwise.conv_silu) as the model ran
it before the op, forward and forward+backward through autograd. GB/s counts the bytes a pass must
move: forward x read and y written; backward dy and x read, dx written (the weight and its gradient
are negligible).

--joined times instead the op as training runs it since the seventeenth session: the three convs of a
GDN projection as one launch each way over the joined q|k|v product (natsl.fast.short_conv's split op,
widths 1152, 1152, 2304) at the recipes' micro-batch [8, 4096], under forward settings (tile, warps) and
"walk" backward settings, each checked against the defaults' outputs.

The first version (2026-11-30, sixth session) timed the op's forward+backward through
torch.autograd.grad: at ~0.3-0.6 ms of GPU work that measured autograd's host time as much as the
kernels, and the same setting moved by up to 2x between runs; the backward is now timed alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORWARD_TILES = ((32, 128), (64, 128), (32, 64))
# "two_pass": (time, channels, warps) of its first kernel
TWO_PASS_TILES = ((64, 64, 4), (32, 64, 4))
# "walk": (rows per program, channels, warps)
WALK_SETTINGS = ((64, 128, 1), (32, 128, 1), (128, 128, 1), (64, 64, 1), (64, 256, 2), (64, 128, 2), (32, 256, 2))


# --joined: forward (time, channels, warps); channels must divide the group widths (split_fits)
JOINED_FORWARD = ((32, 128, 4), (16, 128, 4), (64, 128, 4), (32, 128, 2), (16, 128, 2), (16, 128, 1), (8, 128, 1),
                  (32, 64, 4), (32, 64, 2), (16, 64, 1), (64, 64, 4), (64, 128, 8))
JOINED_WALK = ((64, 128, 1), (32, 128, 1), (16, 128, 1), (128, 128, 1), (64, 64, 1), (32, 64, 1), (128, 64, 1),
               (64, 128, 2), (32, 128, 2), (64, 32, 1))


def sweep_joined(path: str) -> None:
    """The split op's forward and backward at [8, 4096, 1152 + 1152 + 2304] under each setting."""
    import torch
    from triton.testing import do_bench

    from natsl.fast import short_conv as sc
    from natsl.provenance import provenance

    B, T, sizes = 8, 4096, [1152, 1152, 2304]
    C = sum(sizes)
    torch.manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
    w = 0.5 * torch.randn(C, 1, 4, device="cuda")
    dys = [torch.randn(B, T, c, device="cuda", dtype=torch.bfloat16) for c in sizes]
    nbytes = {"forward": 2 * x.numel() * 2, "backward": 3 * x.numel() * 2}
    tile0, warps0, walk0 = sc.FORWARD_TILE, sc.FORWARD_WARPS, sc.BACKWARD_TILES["walk"]
    rows = []

    def record(kind, setting, fn, expected):
        """Outputs (forward) and dx (backward) must be bitwise the default's; dw, whose per-program
        partials follow the rows per program, is compared as a relative difference."""
        got = fn()
        exact = got if kind == "forward" else got[:1]
        equal = all(torch.equal(a, b) for a, b in zip(exact, expected))
        dw_rel = 0.0 if kind == "forward" else ((got[1] - expected[1]).norm() / expected[1].norm()).item()
        ms = do_bench(fn, warmup=25, rep=100)
        rows.append({"pass": kind, "setting": setting, "ms": ms, "GB/s": nbytes[kind] / ms / 1e6, "equal": equal,
                     "dw_rel": dw_rel})
        print(f"{kind:8s} {str(setting):16s} {ms:7.3f} ms {nbytes[kind] / ms / 1e6:6.0f} GB/s  equal to default "
              f"{equal}  dw rel {dw_rel:.0e}", flush=True)

    forward = lambda: sc._forward_groups(x, w, None, sizes)  # noqa: E731
    expected = forward()
    for bt, bc, warps in JOINED_FORWARD:
        sc.FORWARD_TILE, sc.FORWARD_WARPS = (bt, bc), warps
        record("forward", (bt, bc, warps), forward, expected)
    sc.FORWARD_TILE, sc.FORWARD_WARPS = tile0, warps0
    backward = lambda: sc._backward_groups(x, w, None, dys)  # noqa: E731
    expected = backward()
    for setting in JOINED_WALK:
        sc.BACKWARD_TILES["walk"] = setting
        record("backward", setting, backward, expected)
    sc.BACKWARD_TILES["walk"] = walk0
    with open(path, "w") as fh:
        json.dump({"provenance": provenance(), "B": B, "T": T, "sizes": sizes, "rows": rows}, fh, indent=1)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_short_conv.json")
    parser.add_argument("--with-compiled", action="store_true",
                        help="also time the formula compiled by Inductor (a minute of compiling)")
    parser.add_argument("--joined", action="store_true",
                        help="sweep the joined q|k|v op's settings at micro-batch 8 instead")
    args = parser.parse_args()
    if args.joined:
        sweep_joined(args.out)
        return
    import torch
    from triton.testing import do_bench

    from natsl.fast import short_conv as sc
    from natsl.models import pointwise as pw
    from natsl.provenance import provenance

    rows = []

    def record(C, variant, ms, nbytes):
        rows.append({"C": C, "variant": variant, "ms": ms, "GB/s": nbytes / ms / 1e6})
        print(f"C={C:5d} {variant:34s} {ms:8.3f} ms {nbytes / ms / 1e6:7.0f} GB/s", flush=True)

    B, T = 4, 4096
    compiled = torch.compile(pw.conv_silu.eager, dynamic=False) if args.with_compiled else None
    for C in (1152, 2304):
        x = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (0.5 * torch.randn(C, 1, 4, device="cuda")).requires_grad_()
        dy = torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16)
        zeros = torch.zeros(B, 3, C, device="cuda", dtype=torch.bfloat16)
        fwd_bytes, bwd_bytes, step_bytes = 2 * x.numel() * 2, 3 * x.numel() * 2, 5 * x.numel() * 2

        def fwd_bwd(fn):
            def run():
                y = fn()
                torch.autograd.grad(y, (x, w), dy)
            return run

        if compiled is not None:
            with torch.no_grad():
                record(C, "compiled formula fwd", do_bench(lambda: compiled(x, zeros, w)), fwd_bytes)
            record(C, "compiled formula fwd+bwd", do_bench(fwd_bwd(lambda: compiled(x, zeros, w))), step_bytes)
        for tile in FORWARD_TILES:
            sc.FORWARD_TILE = tile
            with torch.no_grad():
                record(C, f"op fwd tile {tile}", do_bench(lambda: sc.short_conv_silu(x, w)), fwd_bytes)
        sc.FORWARD_TILE = FORWARD_TILES[0]
        default = dict(sc.BACKWARD_TILES), sc.BACKWARD_FORM
        for tile in TWO_PASS_TILES:
            sc.BACKWARD_TILES["two_pass"], sc.BACKWARD_FORM = tile, "two_pass"
            record(C, f"op bwd two_pass {tile}", do_bench(lambda: sc.backward(x.detach(), w.detach(), None, dy)),
                   bwd_bytes)
        # every "walk" setting checked against the default's dx and dw; the first also with x as the
        # model hands it over (a column slice of a wider projection output)
        wide = torch.randn(B, T, 2 * C, device="cuda", dtype=torch.bfloat16)
        sc.BACKWARD_TILES, sc.BACKWARD_FORM = dict(default[0]), default[1]
        expected = sc.backward(x.detach(), w.detach(), None, dy)
        for tile in WALK_SETTINGS:
            sc.BACKWARD_TILES["walk"], sc.BACKWARD_FORM = tile, "walk"
            got = sc.backward(x.detach(), w.detach(), None, dy)
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, expected))
            record(C, f"op bwd walk {tile} (rel diff {err:.0e})",
                   do_bench(lambda: sc.backward(x.detach(), w.detach(), None, dy)), bwd_bytes)
        sc.BACKWARD_TILES["walk"], sc.BACKWARD_FORM = WALK_SETTINGS[0], "walk"
        record(C, f"op bwd walk {WALK_SETTINGS[0]} strided x",
               do_bench(lambda: sc.backward(wide[..., :C], w.detach(), None, dy)), bwd_bytes)
        sc.BACKWARD_TILES, sc.BACKWARD_FORM = dict(default[0]), default[1]
        # the weight-gradient partials' sum alone (256 partials: 64-row tiles of 4 x 4096 rows)
        parts = torch.randn(256, 4, C, device="cuda")
        dw = torch.empty(C, 4, device="cuda")
        record(C, "dw sum of 256 partials", do_bench(lambda: sc._dw_sum_kernel[(-(-4 * C // 128),)](
            parts, dw, 256, C, W=4, BLOCK_P=32, BLOCK_F=128, num_warps=4)), parts.numel() * 4)
        sc.BACKWARD_TILES, sc.BACKWARD_FORM = default
    with open(args.out, "w") as fh:
        json.dump({"provenance": provenance(), "B": B, "T": T, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
