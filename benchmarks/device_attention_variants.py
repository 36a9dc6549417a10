"""Routed-attention forward: launch settings and TMA key tiles at several keep fractions, beside SDPA (H200).

    PYTHONPATH=. python3 benchmarks/device_attention_variants.py [--lengths 4096 16384 65536]
        [--keep-fractions 1 0.5 0.25] [--shapes 800M] [--skip-sdpa]

For each length and each shape (24 heads x 64, the anchor's; the 800M layer's 18 heads of 64/128),
times the forward kernel alone (`attention_forward`, block lists built once) under each variant of
(BLOCK_M, BLOCK_N, num_warps, num_stages, TMA descriptors on/off) at each keep fraction (random
routes with exactly that fraction kept), checks each variant's output against the current
setting's, and times causal SDPA (flash and cuDNN) at 24 x 64 in the same run.
Medians of triton.testing.do_bench; JSON to $OUT/attention_variants.json, a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_routed_attention as bench  # noqa: E402
from natsl.fast.block_sparse import config, forward  # noqa: E402
from natsl.fast.block_sparse.blocks import build_block_lists  # noqa: E402

SHAPES = {"24x64": (24, 8, 64, 64, "FORWARD_SMALL_DV"), "800M": (18, 6, 64, 128, "FORWARD")}
# (BLOCK_M, BLOCK_N, num_warps, num_stages, descriptors); the first of each list is the current
# setting. Rounds 1 and 2 (2026-11-30, docs/results/2026-11-30d/call1, call2) compared the earlier
# settings with 4-warp, 128-key and TMA variants; round 3 re-times the winners after the grid
# order change (every head's heaviest tiles first).
# Round 4 (2026-11-30, fifth session, docs/results/2026-11-30e/call3, script of commit e9a0deb):
# Triton's warp specialization of the kept-block loop (tl.range(..., warp_specialize=True)) did not
# compile for the 800M tiles on Triton 3.6 (MLIR pass failure), gained nothing at 24 x 64 (16K 2.212
# vs 2.213 ms) and lost with 256-row tiles on 8 warps (16K 2.560 vs 2.047 ms); the switch was removed.
# Round 5 (2026-12-01, thirteenth session, docs/results/2026-12-01c/call2): the softmax itself, with
# the tiles of the current setting: every n-th kept key tile's exponentials on the FMA pipe (a cubic
# for 2^x, as FlashAttention-4 does on Blackwell) and rescaling the running sums only when a row's max
# grew by more than 2^8 (a CTA-wide decision per tile). Both lost everywhere: 128K keep 0.5 62.5 ms
# plain, 64.7 lazy, 68.3-71.1 with FMA exponentials every 4th-2nd tile (lazy on), 69.2 every 4th
# alone; 16K keep 1 2.04 against 2.20-2.46. The SASS (Triton 3.6 offline) shows why: the cubic path
# costs ~10.8 issue slots per score against ~6.5 for the MUFU path, so the issue slots, not the
# special-function unit, bound the softmax, and the lazy test's cross-warp reduction adds two
# barriers per tile. Both switches were removed.
# Round 6 (same session, call 3): 64-row query tiles (no register spills offline, against 328 bytes
# of spill stack for 128 x 64 on Triton 3.6; but K/V read twice as often).
VARIANTS = {
    "24x64": [(128, 128, 4, 2, False), (128, 64, 4, 3, True)],
    "800M": [(128, 64, 4, 3, True), (64, 64, 4, 3, True), (64, 128, 4, 2, False)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--keep-fractions", type=float, nargs="+", default=[1.0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--skip-sdpa", action="store_true")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/natsl_out")
    os.makedirs(out_dir, exist_ok=True)
    results = {"gpu": torch.cuda.get_device_name(), "rows": []}

    def save():
        with open(os.path.join(out_dir, "attention_variants.json"), "w") as f:
            json.dump(results, f, indent=1)

    for T in args.lengths:
        rep = 100 if T <= 16384 else 600
        for backend in () if args.skip_sdpa else ("flash", "cudnn"):
            ms = bench.time_sdpa(1, T, 24, 64, 64, backend=backend)
            row = {"T": T, "what": f"sdpa {backend} 24x64", "ms": ms,
                   "tflops": bench.causal_flops(1, T, 24, 64, 64) / ms / 1e9}
            results["rows"].append(row)
            print(row, flush=True)
        for name, frac in [(n, f) for n in args.shapes for f in args.keep_fractions]:
            H, G, DK, DV, cfg_name = SHAPES[name]
            q, k, v, _ = bench.attention_inputs(1, T, H, DK, DV, torch.bfloat16, "cuda")
            keep = None if frac >= 1 else bench.random_keep(1, -(-T // 64), G, frac, "cuda")
            lists = build_block_lists(keep, 1, -(-T // 64), G, "cuda")
            cfg = getattr(config, cfg_name)
            saved, saved_desc = dict(cfg), config.USE_DESCRIPTORS
            want = None
            for bm, bn, warps, stages, desc in VARIANTS[name]:
                cfg.update(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                config.USE_DESCRIPTORS = desc
                label = f"{name} keep {frac:g} M{bm} N{bn} w{warps} s{stages}" + (" tma" if desc else "")
                row = {"T": T, "what": label, "keep": frac}
                try:
                    o, _ = forward.attention_forward(q, k, v, lists, 0.125, 64, G)
                    if want is None:
                        want = o.float()
                    row["max_rel_diff_vs_first"] = float((o.float() - want).abs().max() / want.abs().max())
                    row["rel_rms_vs_first"] = float((o.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
                    ms = do_bench(lambda: forward.attention_forward(q, k, v, lists, 0.125, 64, G),
                                  warmup=25, rep=rep, return_mode="median")
                    row.update(ms=ms, tflops=bench.causal_flops(1, T, H, DK, DV) * frac / ms / 1e9)
                except Exception as e:  # a setting that does not compile or fit is reported, not fatal
                    row["error"] = repr(e)[:300]
                results["rows"].append(row)
                print(row, flush=True)
                save()
            cfg.clear()
            cfg.update(saved)
            config.USE_DESCRIPTORS = saved_desc
            del q, k, v
            torch.cuda.empty_cache()
    save()
    print(f"\n| T | variant | ms | TFLOP/s (real, keep-scaled) |\n|---|---|---|---|")
    for r in results["rows"]:
        if "ms" in r:
            print(f"| {r['T']} | {r['what']} | {r['ms']:.3f} | {r['tflops']:.0f} |")


if __name__ == "__main__":
    main()
