"""The gated-delta forward with the output folded into the state recurrence against the separate output
kernel (config.STATE_FWD["FOLD_OUTPUT"], state.folds_output), on the GPU, at 800M training shapes.

    PYTHONPATH=. python3 benchmarks/bench_fold_output.py [--shapes 8x4096,4x4096] [--rounds 5] [--out fold.json]

Per shape (H=6, K=192, V=384, bf16 intermediates, random binary routes): the recurrence + output kernel
and the folded recurrence on the same prepared inputs; their outputs compared (o, h, R: bitwise or the
max relative error), then timed `--rounds` times alternately (medians of do_bench each), and the same
for the whole op's forward and forward + backward (gated_delta_rule) with the switch off and on. The
table gives the medians over rounds and the ratios (folded / separate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Settings of the folded recurrence timed beside the default (KEY=VALUE overrides of config.STATE_FWD): 32-wide
# slices (offline 1136 B of spill stack against 3104 at 64), two pipeline stages there, and the intra-chunk
# weights from a pass of their own (SCORES_PASS; fewer registers). Not here: 8 warps (one stage, which the
# 64-wide fold needs for shared memory, faults with an illegal memory access on the H200 with Triton 3.6, as the
# state backward's 8-warp one-stage settings did; it poisons the process) and 64-wide slices at two stages
# (246 KB of shared memory, over the 227 KB there are).
VARIANTS = ("BV=16,BV_WIDE=32,SPLIT_LAST_ROUND=false", "BV=16,BV_WIDE=32,SPLIT_LAST_ROUND=false,FOLD_NUM_STAGES=2",
            "SCORES_PASS=true", "SCORES_PASS=true,FOLD_NUM_STAGES=2")


def _overrides(text: str) -> dict:
    """"num_warps=8,SPLIT_LAST_ROUND=false" -> {"num_warps": 8, "SPLIT_LAST_ROUND": False}."""
    out = {}
    for item in text.split(","):
        key, value = item.split("=")
        out[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="8x4096,4x4096")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="fold_output.json")
    args = parser.parse_args()
    import torch
    import triton

    import device_gated_delta as dgd
    from natsl.devices import sm_count
    from natsl.fast.gated_delta import config, gated_delta_rule
    from natsl.fast.gated_delta.common import fp32_precision
    from natsl.fast.gated_delta.output import chunk_output
    from natsl.fast.gated_delta.prepare import prepare_chunks
    from natsl.fast.gated_delta.state import folds_output, state_forward
    from natsl.provenance import provenance

    config.INTERMEDIATE = "input"
    cfg = config.STATE_FWD
    C, H, K, V, DT = dgd.C, dgd.H, dgd.K, dgd.V, dgd.DT
    rows = []
    for shape in args.shapes.split(","):
        B, T = (int(n) for n in shape.split("x"))
        q, k, v, g, beta = dgd.inputs(T, seed=3, B=B)
        NB = triton.cdiv(T, C)
        w32 = torch.randint(0, 2, (B, NB, H), device="cuda").float()
        prec, scale = fp32_precision(DT), K**-0.5
        gc, _, w, u = prepare_chunks(k, v, g, beta, C, config.PREPARE, DT)
        fold_applies = folds_output(B, H, V, {**cfg, "FOLD_OUTPUT": True}, sm_count(q.device), DT)

        def separate():
            h, r, _, _ = state_forward(w, u, k, gc, w32, None, False, C, True, prec, {**cfg, "FOLD_OUTPUT": False})
            return chunk_output(q, k, gc, h, r, scale, C, prec, config.OUTPUT), h, r

        def folded(**overrides):
            settings = {**cfg, "FOLD_OUTPUT": True, **overrides}
            h, r, _, o = state_forward(w, u, k, gc, w32, None, False, C, True, prec, settings, q=q, scale=scale)
            assert o is not None, f"the fold does not apply with {overrides}"
            return o, h, r

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
        do = torch.randn(B, T, H, V, device="cuda", dtype=DT)

        def op_forward():
            with torch.no_grad():
                return gated_delta_rule(*leaves, w32)[0]

        def op_both():
            o, _ = gated_delta_rule(*leaves, w32)
            o.backward(do)

        reference = [x.float() for x in separate()]
        pairs = {"kernels": (separate, folded), "op forward": (op_forward, op_forward),
                 "op forward + backward": (op_both, op_both)}
        for text in VARIANTS:  # the folded kernels at other launch settings, against the same separate pair
            overrides = _overrides(text)
            pairs[f"kernels, folded at {text}"] = (separate, lambda o=overrides: folded(**o))
        checks = {}
        for what, (_, fn) in list(pairs.items()):
            if what.startswith("kernels"):
                try:
                    got = [x.float() for x in fn()]
                except triton.runtime.errors.OutOfResources as exc:  # e.g. shared memory at more stages
                    print(f"B={B} T={T} {what}: does not launch ({exc})", flush=True)
                    rows.append({"B": B, "T": T, "what": what, "error": str(exc)})
                    del pairs[what]
                    continue
                checks[what] = (all(torch.equal(a, b) for a, b in zip(got, reference)),
                                max(dgd.rel(a, b) for a, b in zip(got, reference)))
        times = {what: {False: [], True: []} for what in pairs}
        for _ in range(args.rounds):
            for what, (off_fn, on_fn) in pairs.items():
                for on, fn in ((False, off_fn), (True, on_fn)):
                    cfg["FOLD_OUTPUT"] = on  # the op reads the dict; the kernel closures pass their own
                    times[what][on].append(dgd.median_ms(fn, grad_to_none=leaves if what.endswith("backward") else None))
        cfg["FOLD_OUTPUT"] = config.FOLD_OUTPUT
        for what, t in times.items():
            off, on = statistics.median(t[False]), statistics.median(t[True])
            bitwise, err = checks.get(what, (None, None))
            row = {"B": B, "T": T, "what": what, "separate_ms": off, "folded_ms": on, "ratio": on / off,
                   "fold_applies": fold_applies, "bitwise_equal": bitwise, "max_rel_err": err,
                   "rounds": {"separate": t[False], "folded": t[True]}}
            rows.append(row)
            same = "" if bitwise is None else f"; o, h, R bitwise equal {bitwise} (max rel err {err:.1e})"
            print(f"B={B} T={T} {what:40s} separate {off:.3f} ms, folded {on:.3f} ms ({on / off:.3f}x); "
                  f"fold applies {fold_applies}{same}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
