"""One device call for the Triton gated_delta_rule: GPU correctness, a launch-setting sweep, timings.

Run on the H200 through the device tool (flash-linear-attention's fla-core wheel carried in .whl/):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    PYTHONUNBUFFERED=1 python3 benchmarks/device_gated_delta.py --out $OUT

Steps (each guarded so that a failure is reported and the rest still runs):
  1. correctness: bf16 at the 800M shapes against the tests' chunk oracle in fp32 (every output and
     gradient; both intermediate dtypes; block 128; no decay across skips), fp32 against the
     reference token loop, the decode step;
  2. sweep, per intermediate dtype (config.INTERMEDIATE "fp32" / "input"): each kernel stage under
     a few launch settings at T=128K, each checked against the default settings' result (a Hopper
     miscompile shows as a mismatch) and timed; the fastest verified setting is kept;
  3. timings with those settings: forward and forward+backward at T = 4K, 16K, 64K, 128K (B=1,
     H=6, K=192, V=384, bf16), beside flash-linear-attention's chunk_gated_delta_rule forward
     (its backward refuses Triton 3.4-3.7.0 on Hopper); the decode step.
Medians of triton.testing.do_bench. JSON goes to --out; a short table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from natsl.fast.gated_delta import config, gated_delta_rule, gated_delta_step  # noqa: E402
from natsl.fast.gated_delta.common import fp32_precision  # noqa: E402
from natsl.fast.gated_delta.grad_qk import grad_qk  # noqa: E402
from natsl.fast.gated_delta.grad_wy import grad_wy  # noqa: E402
from natsl.fast.gated_delta.output import chunk_output, local_dr  # noqa: E402
from natsl.fast.gated_delta.prepare import prepare_chunks  # noqa: E402
from natsl.fast.gated_delta.state import state_backward, state_forward  # noqa: E402
from natsl.provenance import provenance  # noqa: E402

H, K, V, C = 6, 192, 384, 64
DT = torch.bfloat16
LENGTHS = (4096, 16384, 65536, 131072)
MODES = ("fp32", "input")
STAGES = ("PREPARE", "STATE_FWD", "OUTPUT", "LOCAL_DR", "STATE_BWD", "GRAD_QK", "GRAD_WY")
START = time.time()


def log(*a):
    print(f"[{time.time() - START:6.1f}s]", *a, flush=True)


def inputs(T, seed=0, requires_grad=False, B=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(DT)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).to(DT)
    v = torch.randn(B, T, H, V, device="cuda", generator=gen).to(DT)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 2.0)  # fp32, as the layer makes it
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen)).to(DT)
    xs = [q, k, v, g, beta]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


def rel(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def median_ms(fn, grad_to_none=None):
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def set_config(name, cfg):
    getattr(config, name).clear()
    getattr(config, name).update(cfg)


# ----------------------------------------------------------------------------- 1. correctness
def correctness(results):
    spec = importlib.util.spec_from_file_location("tfgd", os.path.join(ROOT, "tests", "test_fast_gated_delta.py"))
    tm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tm)
    oracle = tm.chunk_oracle
    real = dict(H=6, K=192, V=384, dtype=DT, oracle=oracle)
    cases = [
        ("bf16 T=4096 write=None", dict(B=1, T=4096, seed=43, write_kind=None, **real)),
        ("bf16 T=4096 binary write, route_grad full", dict(B=1, T=4096, seed=44, write_kind="binary",
                                                           route_grad="full", **real)),
        ("bf16 B=2 T=3000 random write, no decay across skips",
         dict(B=2, T=3000, seed=45, write_kind="random", decay_skipped_blocks=False, **real)),
        ("bf16 T=1000 block 128, binary write", dict(B=1, T=1000, seed=46, write_kind="binary", block_size=128,
                                                     **real)),
        ("bf16 T=4096 binary write, INTERMEDIATE=input", dict(B=1, T=4096, seed=44, write_kind="binary",
                                                              route_grad="full", intermediate="input", **real)),
        ("bf16 B=2 T=3000 random write, no decay across skips, INTERMEDIATE=input",
         dict(B=2, T=3000, seed=45, write_kind="random", decay_skipped_blocks=False, intermediate="input", **real)),
    ]
    for name, kw in cases:
        ftol, gtol = tm.TOL[DT] if kw.get("dtype") == DT else (tm.FP32_TOL, tm.FP32_TOL)
        try:
            B, T, Hh, Kk, Vv = (kw.pop(x) for x in ("B", "T", "H", "K", "V"))
            config.INTERMEDIATE = kw.pop("intermediate", "fp32")
            errors = tm.compare(B, T, Hh, Kk, Vv, **kw)
            ok = all(v <= (ftol if k in ("o", "final") else gtol) for k, v in errors.items())
            results["checks"].append(dict(name=name, ok=ok, errors=errors))
            log("CHECK", "PASS" if ok else "FAIL", name, {k: f"{v:.2e}" for k, v in errors.items()})
        except Exception as exc:  # report and go on
            results["checks"].append(dict(name=name, ok=False, error=repr(exc)))
            log("CHECK ERROR", name, traceback.format_exc())
        finally:
            config.INTERMEDIATE = "fp32"
    try:  # decode step vs the reference token loop (fp32)
        from natsl.reference.gated_delta import gated_delta_rule as reference

        q, k, v, g, beta = (x.float() for x in inputs(16, seed=5))
        s = torch.randn(1, H, K, V, device="cuda")
        o_ref, f_ref = reference(q, k, v, g, beta, initial_state=s, output_final_state=True)
        outs = []
        for t in range(16):
            o_t, s = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
            outs.append(o_t)
        errors = dict(o=rel(torch.stack(outs, 1), o_ref), final=rel(s, f_ref))
        ok = all(e < 1e-4 for e in errors.values())
        results["checks"].append(dict(name="decode step fp32 vs reference", ok=ok, errors=errors))
        log("CHECK", "PASS" if ok else "FAIL", "decode", errors)
    except Exception as exc:
        results["checks"].append(dict(name="decode step", ok=False, error=repr(exc)))
        log("CHECK ERROR decode", traceback.format_exc())


# ----------------------------------------------------------------------------- 2. sweep
def stage_runner(T, B=1):
    """Closures that run each kernel stage alone on fixed inputs (in the current config)."""
    q, k, v, g, beta = inputs(T, seed=1, B=B)
    NB = triton.cdiv(T, C)
    w32 = torch.randint(0, 2, (B, NB, H), device="cuda").float()
    do = torch.randn(B, T, H, V, device="cuda").to(DT)
    prec = fp32_precision(DT)
    wdt = torch.float32 if config.INTERMEDIATE == "fp32" else DT
    scale = K**-0.5
    st = {}
    st["gc"], st["ai"], st["w"], st["u"] = prepare_chunks(k, v, g, beta, C, config.PREPARE, wdt)
    st["h"], st["r"], _ = state_forward(st["w"], st["u"], k, st["gc"], w32, None, False, C, True, prec,
                                        config.STATE_FWD)
    st["drl"] = local_dr(q, k, st["gc"], do, scale, C, prec, config.LOCAL_DR, wdt)
    st["dh"], st["dr"], _ = state_backward(q, k, st["w"], st["gc"], w32, do, st["drl"], None, False, scale, C, True,
                                           prec, config.STATE_BWD)
    st["dq"], st["dkp"], st["dw"], st["dgp"], _, _ = grad_qk(q, k, st["gc"], w32, st["h"], st["dh"], st["r"],
                                                             st["dr"], do, scale, C, prec, config.GRAD_QK)
    dgl = torch.zeros(B, NB, H, device="cuda")
    return {
        "PREPARE": lambda: prepare_chunks(k, v, g, beta, C, config.PREPARE, wdt),
        "STATE_FWD": lambda: state_forward(st["w"], st["u"], k, st["gc"], w32, None, False, C, True, prec,
                                           config.STATE_FWD),
        "OUTPUT": lambda: chunk_output(q, k, st["gc"], st["h"], st["r"], scale, C, prec, config.OUTPUT),
        "LOCAL_DR": lambda: local_dr(q, k, st["gc"], do, scale, C, prec, config.LOCAL_DR, wdt),
        "STATE_BWD": lambda: state_backward(q, k, st["w"], st["gc"], w32, do, st["drl"], None, False, scale, C, True,
                                            prec, config.STATE_BWD),
        "GRAD_QK": lambda: grad_qk(q, k, st["gc"], w32, st["h"], st["dh"], st["r"], st["dr"], do, scale, C, prec,
                                   config.GRAD_QK),
        "GRAD_WY": lambda: grad_wy(k, v, beta, st["gc"], st["ai"], st["dr"], st["dw"], st["dkp"], st["dgp"], dgl, C,
                                   prec, config.GRAD_WY),
    }


def first_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [x for x in out if isinstance(x, torch.Tensor)]


SWEEP_STATE = [dict(BV=32, num_warps=8, num_stages=2), dict(BV=64, num_warps=4, num_stages=2),
               dict(BV=16, num_warps=4, num_stages=2)]
# Forward-only settings for the default (bf16 intermediates) mode: the sequential state kernel's
# software pipelining depth and width, and the two parallel forward stages around it.
SWEEP_STATE_FWD = [dict(BV=32, num_warps=4, num_stages=s) for s in (1, 3, 4)] + [
    dict(BV=32, num_warps=2, num_stages=2), dict(BV=32, num_warps=2, num_stages=3),
    dict(BV=64, num_warps=8, num_stages=2), dict(BV=64, num_warps=4, num_stages=3)]
SWEEP = {
    "fp32": {
        "STATE_FWD": SWEEP_STATE,
        "OUTPUT": [dict(BV=32, num_warps=4, num_stages=2)],
        "STATE_BWD": SWEEP_STATE,
        "GRAD_QK": [dict(BV=32, num_warps=8, num_stages=2)],
        "GRAD_WY": [dict(num_warps=8, num_stages=2)],
    },
    "input": {
        "STATE_FWD": SWEEP_STATE_FWD,
        "PREPARE": [dict(num_warps=2, num_stages=s) for s in (1, 3)] + [dict(num_warps=4, num_stages=2)],
        "OUTPUT": [dict(BV=32, num_warps=4, num_stages=2), dict(BV=64, num_warps=4, num_stages=3),
                   dict(BV=64, num_warps=8, num_stages=2), dict(BV=128, num_warps=8, num_stages=2)],
        "LOCAL_DR": [dict(BV=64, num_warps=4, num_stages=3)],
        "STATE_BWD": [dict(BV=32, num_warps=4, num_stages=s) for s in (1, 3, 4)] + [
            dict(BV=32, num_warps=2, num_stages=3)],
        "GRAD_QK": [dict(BV=32, num_warps=4, num_stages=3)],
        "GRAD_WY": [dict(num_warps=4, num_stages=3)],
    },
}


def _grid(BVs, warps, stages):
    return [dict(BV=bv, num_warps=w, num_stages=s) for bv in BVs for w in warps for s in stages]


# The training shape (B=4, T=4096: B*H = 24 heads, 64 chunks) has 4x the programs of B=1 at any T, so
# the sequential kernels' best V slice may differ from the T=128K sweep's; a wider net, "input" mode.
SWEEP_TRAIN = {  # in order of the stages' share of the hybrid's step (call 6 of 2026-11-30h)
    "input": {
        # 8 warps with BV=16, or with one stage, last: they hit an illegal memory access in the state
        # backward (2026-11-30i), which poisons the process's CUDA context (one stage per process: --stages)
        # first: the default's slices in one launch, without its last round split off (SPLIT_LAST_ROUND, B=8)
        "STATE_BWD": [dict(BV=32, BV_WIDE=64, num_warps=4, num_stages=2, SPLIT_LAST_ROUND=False, PROGRAMS_PER_SM=2)]
        + _grid((32, 64), (4,), (1, 2)) + _grid((32, 64), (8,), (2,)) + _grid((16,), (2, 4), (2,))
        + _grid((16,), (8,), (2,)) + _grid((32, 64), (8,), (1,)),
        "GRAD_WY": [dict(num_warps=4, num_stages=3, descriptors=True)]  # TMA tiles (config.GRAD_WY)
        + [dict(num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3)],
        "GRAD_QK": _grid((32, 64), (4, 8), (3,)) + _grid((32,), (4,), (2,)) + _grid((16,), (4, 8), (3,)),
        "STATE_FWD": [dict(BV=32, BV_WIDE=64, num_warps=4, num_stages=3, SPLIT_LAST_ROUND=False, PROGRAMS_PER_SM=2)]
        + _grid((32, 64), (4, 8), (3,)) + _grid((16, 32), (2,), (3,)) + _grid((64,), (4,), (2,))
        + _grid((16,), (4, 8), (3,)),
        "PREPARE": [dict(num_warps=w, num_stages=3) for w in (1, 2, 4)] + [dict(num_warps=2, num_stages=4)],
        "OUTPUT": _grid((32, 64, 128), (4, 8), (2,)),
        "LOCAL_DR": _grid((32, 64, 128), (4,), (3,)),
    },
}


# The two sequential kernels with a register cap (`maxnreg`): at the 255-register cap two programs share an
# SM, so at B=8 they hold ~2.2 latency-bound recurrences per SM. Offline (Triton 3.6, sm_90,
# benchmarks/kernel_resources.py) a cap of 168 fits three programs per SM and 128 four, at more spill stack
# (state forward BV 32: 144 -> 992 / 1704 B; state backward BV 32: 336 -> 1408 / 2296 B). PROGRAMS_PER_SM
# follows the cap so that the last round's split (state.batch_launches) counts the right slots.
# `--sweep-set regcap` (twentieth session, 2026-12-02, docs/results/2026-12-02b/call1): every cap slower
# (state forward 0.399 ms by default against 0.524-1.274, backward 0.686 against 0.891-1.509).
SWEEP_REGCAP = {
    "input": {
        stage: [dict(BV=bv, BV_WIDE=wide, num_warps=4, num_stages=stages, SPLIT_LAST_ROUND=split,
                     PROGRAMS_PER_SM=per_sm, maxnreg=cap)
                for bv, wide in ((32, 64), (32, 32)) for cap, per_sm in ((168, 3), (128, 4)) for split in (True, False)]
        for stage, stages in (("STATE_FWD", 3), ("STATE_BWD", 2))
    },
}


def sweep(results, T, mode, budget_s, B=1, variants=SWEEP, only=None):
    """Time every stage under its variants, each checked against the default settings' output;
    return the fastest verified settings per stage."""
    config.INTERMEDIATE = mode
    try:
        stages = stage_runner(T, B)
        best = {}
        order = list(variants[mode]) + [n for n in stages if n not in variants[mode]]
        order = [n for n in order if only is None or n in only]
        for name in order:
            fn = stages[name]
            cfg0 = copy.deepcopy(getattr(config, name))
            ref_out = [x.float().clone() for x in first_tensors(fn())]
            entry = dict(mode=mode, stage=name, B=B, T=T, default=cfg0, default_ms=median_ms(fn), variants=[])
            best[name] = (entry["default_ms"], cfg0)
            log("SWEEP", mode, name, cfg0, f"{entry['default_ms']:.3f} ms")
            for cfg in variants[mode].get(name, []):
                if time.time() - START > budget_s:
                    log("SWEEP: time budget reached, skipping the rest")
                    break
                set_config(name, cfg)
                try:
                    out = [x.float() for x in first_tensors(fn())]
                    err = max(rel(a, b) for a, b in zip(out, ref_out))
                    ms = median_ms(fn)
                    entry["variants"].append(dict(cfg=cfg, ms=ms, max_rel_err_vs_default=err))
                    log("  ", cfg, f"{ms:.3f} ms", f"err vs default {err:.1e}")
                    if err < 5e-3 and ms < best[name][0]:
                        best[name] = (ms, copy.deepcopy(cfg))
                except Exception as exc:
                    entry["variants"].append(dict(cfg=cfg, error=repr(exc)))
                    log("  ", cfg, "ERROR", repr(exc)[:300])
                finally:
                    set_config(name, cfg0)
            results["sweep"].append(entry)
            del ref_out
        return {name: cfg for name, (_, cfg) in best.items()}
    finally:
        config.INTERMEDIATE = "fp32"
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 3. timings
def load_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule
    except Exception as exc:
        log("flash-linear-attention unavailable:", repr(exc))
        return None


def timings(results, fla, best, modes=MODES):
    scale = K**-0.5
    defaults = {name: copy.deepcopy(getattr(config, name)) for name in STAGES}
    for T in LENGTHS:
        row = dict(T=T)
        xs = inputs(T, seed=2, requires_grad=True)
        write = torch.randint(0, 2, (1, triton.cdiv(T, C), H), device="cuda").float()
        do = torch.randn(1, T, H, V, device="cuda").to(DT)

        def fwd_bwd():
            o, _ = gated_delta_rule(*xs, write, route_grad="full")
            o.backward(do)

        for mode in modes:
            config.INTERMEDIATE = mode
            for name, cfg in best.get(mode, {}).items():
                set_config(name, cfg)
            try:
                with torch.no_grad():
                    row[f"fast_fwd_{mode}_ms"] = median_ms(lambda: gated_delta_rule(*xs, write))
                torch.cuda.reset_peak_memory_stats()
                row[f"fast_fwd_bwd_{mode}_ms"] = median_ms(fwd_bwd, grad_to_none=xs)
                row[f"fast_fwd_bwd_{mode}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            except Exception as exc:
                row[f"fast_{mode}_error"] = repr(exc)[:300]
            finally:
                config.INTERMEDIATE = "fp32"
                for name, cfg in defaults.items():
                    set_config(name, cfg)
        if fla is not None:
            try:
                with torch.no_grad():
                    row["fla_fwd_ms"] = median_ms(lambda: fla(*xs, scale=scale))
                    if T == LENGTHS[0]:
                        o_fla, _ = fla(*xs, scale=scale)
                        o_fast, _ = gated_delta_rule(*xs)
                        row["fast_vs_fla_rel"] = rel(o_fast, o_fla)
            except Exception as exc:
                row["fla_fwd_error"] = repr(exc)[:300]
        results["timings"].append(row)
        log("TIME", {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})
        del xs, do
        torch.cuda.empty_cache()
    q, k, v, g, beta = (x[:, 0].contiguous() for x in inputs(1, seed=3))
    s = torch.randn(1, H, K, V, device="cuda")
    results["decode_step_ms"] = median_ms(lambda: gated_delta_step(q, k, v, g, beta, s))
    log("TIME decode step", f"{results['decode_step_ms']:.4f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma list of steps to skip: check,sweep,time")
    ap.add_argument("--sweep-budget", type=float, default=130.0, help="stop sweeping after this many seconds")
    ap.add_argument("--modes", default=",".join(MODES), help="intermediate dtypes to sweep and time: fp32,input")
    ap.add_argument("--sweep-shape", default=f"1,{LENGTHS[-1]}",
                    help="B,T of the sweep; B > 1 (a training micro-batch, e.g. 4,4096 or 8,4096) widens the variants (SWEEP_TRAIN)")
    ap.add_argument("--stages", default="", help="comma list of the stages to sweep (default: all)")
    ap.add_argument("--sweep-set", choices=("default", "regcap"), default="default",
                    help="regcap: the sequential kernels under register caps (SWEEP_REGCAP)")
    args = ap.parse_args()
    modes = tuple(filter(None, args.modes.split(",")))
    skip = set(filter(None, args.skip.split(",")))
    props = torch.cuda.get_device_properties(0)
    results = dict(
        date=time.strftime("%Y-%m-%d"), provenance=provenance(), device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, config={n: copy.deepcopy(getattr(config, n)) for n in dir(config) if n.isupper()},
        checks=[], sweep=[], timings=[], best={},
    )
    log("device", props.name, "torch", torch.__version__, "triton", triton.__version__)
    fla = load_fla()
    best = results["best"]
    steps = [("check", lambda: correctness(results))]
    sweep_b, sweep_t = (int(x) for x in args.sweep_shape.split(","))
    variants = SWEEP_TRAIN if sweep_b > 1 else SWEEP  # batched shapes: training micro-batches
    if args.sweep_set == "regcap":
        variants = SWEEP_REGCAP
    for mode in modes:
        steps.append(("sweep", lambda mode=mode: best.__setitem__(
            mode, sweep(results, sweep_t, mode, args.sweep_budget, sweep_b, variants,
                        set(args.stages.split(",")) if args.stages else None))))
    steps.append(("time", lambda: timings(results, fla, best, modes)))
    os.makedirs(args.out, exist_ok=True)
    for step, fn in steps:
        if step in skip:
            continue
        try:
            fn()
        except Exception:
            log(f"STEP {step} FAILED", traceback.format_exc())
        with open(os.path.join(args.out, "gated_delta.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    nan = float("nan")
    print("\n=== gated_delta_rule on", props.name, "(bf16, B=1, H=6, K=192, V=384; medians, ms) ===")
    print("fp32 / bf16: the chunk intermediates W, U, R, dR in fp32 (INTERMEDIATE='fp32') or bf16 ('input')")
    print(f"{'T':>7} {'FLA fwd':>8} {'fwd fp32':>9} {'ratio':>6} {'fwd bf16':>9} {'ratio':>6} {'f+b fp32':>9} "
          f"{'f+b bf16':>9}")
    for r in results["timings"]:
        fla_f = r.get("fla_fwd_ms", nan)
        f32, b16 = r.get("fast_fwd_fp32_ms", nan), r.get("fast_fwd_input_ms", nan)
        print(f"{r['T']:>7} {fla_f:>8.3f} {f32:>9.3f} {f32 / fla_f:>6.2f} {b16:>9.3f} {b16 / fla_f:>6.2f} "
              f"{r.get('fast_fwd_bwd_fp32_ms', nan):>9.3f} {r.get('fast_fwd_bwd_input_ms', nan):>9.3f}")
    if "decode_step_ms" in results:
        print(f"decode step: {results['decode_step_ms']:.4f} ms")
    for c in results["checks"]:
        print("CHECK", "PASS" if c["ok"] else "FAIL", c["name"])
    for e in results["sweep"]:
        top = min([dict(cfg=e["default"], ms=e["default_ms"])] + [v for v in e["variants"] if "ms" in v],
                  key=lambda x: x["ms"])
        print(f"SWEEP {e['mode']:<5} {e['stage']:<9} default {e['default_ms']:.3f} ms; best {top['ms']:.3f} ms "
              f"{top['cfg']}")
    print("best:", json.dumps(best))


if __name__ == "__main__":
    main()
