"""Where the 800M models' inference time goes on the GPU, and before/after timings (< 120 s).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_profile_inference.py

1. Correctness: a short prefill + decode of 800m_hybrid and 800m_gdn with the fused kernels
   (natsl.fast.cached) against NATSL_FUSED_INFERENCE=0 (the old cached path): max relative
   logit difference (bf16).
2. Profile (torch.profiler) of one CUDA-graph decode step and one 32K prefill of 800m_gdn and
   800m_hybrid (keep 0.5, bf16, fast): top-15 CUDA and CPU ops; kernel launches per decode step
   (eager step and graph replay), with fused kernels on and off.
3. Timing with natsl.inference.bench's method (best-of prefill with last_only, median decode through
   DecodeRunner with CUDA events): prefill at 32768 and 131072 and decode at 32768 for the three 800M
   models, fused on ("after") and off ("before", same code otherwise).

Writes $OUT/profile_inference.json (rewritten as it goes) and the profiler tables to
$OUT/profile_tables.txt. Every part catches its errors (OOM included) and has a time cap.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
OUT = os.environ.get("OUT", "/tmp/device_profile_out")
BUDGET = float(os.environ.get("PROFILE_BUDGET_S", "115"))
BEGAN = time.monotonic()
RESULT: dict = {"parts": {}}


def log(*parts) -> None:
    print(f"[{time.monotonic() - BEGAN:6.1f}s]", *parts, flush=True)


def left() -> float:
    return BUDGET - (time.monotonic() - BEGAN)


def save() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "profile_inference.json"), "w") as fh:
        json.dump(RESULT, fh, indent=1, default=str)


def tables(text: str) -> None:
    with open(os.path.join(OUT, "profile_tables.txt"), "a") as fh:
        fh.write(text + "\n")


def set_fused(on: bool) -> None:
    from natsl.ops import fused as kernels

    kernels.FORCE = None if on else False


def guarded(name: str, fn, *args, **kwargs):
    import torch

    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - record and go on
        msg = "out of memory" if "out of memory" in str(err).lower() else f"{type(err).__name__}: {str(err)[:300]}"
        log(f"{name}: FAILED {msg}")
        RESULT.setdefault("errors", {})[name] = msg + "\n" + traceback.format_exc()[-1500:]
        torch.cuda.empty_cache()
        return None


def model_for(name: str):
    import torch

    from natsl.inference import bench

    model, _, _ = bench.load_model(bench.BenchModel("recipe", name, 0.5), torch.device("cuda"), torch.bfloat16,
                                   "fast", 0)
    return model


def correctness(models) -> None:
    import torch

    from natsl.inference.decode import DecodeRunner

    out = {}
    for name, model in models.items():
        ids = torch.randint(0, model.config.vocab_size, (1, 300), device="cuda")
        res = []
        for fused in (False, True):
            set_fused(fused)
            with torch.no_grad():
                cache = model.new_cache(1, max_len=300)
                logits = [model.forward_cached(ids[:, :200], cache, last_only=True)[:, -1].float()]
                runner = DecodeRunner(model, cache, cuda_graphs=True)
                for t in range(200, 300):
                    logits.append(runner.step(ids[:, t]).float())
            res.append(torch.stack(logits))
        set_fused(True)
        err = float((res[1] - res[0]).abs().max() / res[0].abs().max())
        agree = float((res[1].argmax(-1) == res[0].argmax(-1)).float().mean())
        out[name] = {"max_rel_diff_fused_vs_old": err, "argmax_agreement": agree}
        log(f"correctness {name}: fused vs old path max rel diff {err:.2e}, argmax agreement {agree:.3f}")
    RESULT["parts"]["correctness"] = out
    save()


def profile(name: str, model) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile

    from natsl.inference.decode import DecodeRunner

    out = {}
    L = 32768
    ids = torch.randint(0, model.config.vocab_size, (1, L), device="cuda")
    for fused in (True, False):
        set_fused(fused)
        tag = "fused" if fused else "old"
        with torch.no_grad():
            cache = model.new_cache(1, max_len=L + 16)
            model.forward_cached(ids, cache, last_only=True)  # warm (Triton compiles)
            cache.reset()
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.forward_cached(ids, cache, last_only=True)
                torch.cuda.synchronize()
            ka = prof.key_averages()
            tables(f"==== {name} prefill 32K ({tag}) top CUDA ====\n" + ka.table(sort_by="cuda_time_total", row_limit=15))
            tables(f"==== {name} prefill 32K ({tag}) top CPU ====\n" + ka.table(sort_by="self_cpu_time_total", row_limit=15))
            out[f"prefill32k_{tag}_kernels"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
            out[f"prefill32k_{tag}_top_cuda"] = [(e.key, e.count, getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3)
                                                 for e in sorted(ka, key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))[:15]]
            # decode: an eager step (kernel count) and a graph replay (GPU time)
            runner = DecodeRunner(model, cache, cuda_graphs=True)
            tok = torch.zeros(1, dtype=torch.long, device="cuda")
            for _ in range(3):
                runner.step(tok)
            eager = DecodeRunner(model, cache, cuda_graphs=False)
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                eager.step(tok)
                torch.cuda.synchronize()
            kernels_eager = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
            ka = prof.key_averages()
            tables(f"==== {name} decode step eager ({tag}) top CUDA ====\n" + ka.table(sort_by="cuda_time_total", row_limit=15))
            tables(f"==== {name} decode step eager ({tag}) top CPU ====\n" + ka.table(sort_by="self_cpu_time_total", row_limit=15))
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.step(tok)
                torch.cuda.synchronize()
            ka = prof.key_averages()
            tables(f"==== {name} decode step graph replay ({tag}) ====\n" + ka.table(sort_by="cuda_time_total", row_limit=15))
            out[f"decode_{tag}_kernel_launches_eager_step"] = kernels_eager
            out[f"decode_{tag}_kernels_in_graph_replay"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
            out[f"decode_{tag}_graph_captures"] = runner.captures
            log(f"profile {name} ({tag}): decode kernels/step eager {kernels_eager}, in replay "
                f"{out[f'decode_{tag}_kernels_in_graph_replay']}, prefill 32K kernels {out[f'prefill32k_{tag}_kernels']}")
            del cache, runner, eager
        torch.cuda.empty_cache()
    set_fused(True)
    RESULT["parts"].setdefault("profile", {})[name] = out
    save()


def timing(name: str, model, fused: bool, lengths=(32768, 131072)) -> None:
    import torch

    from natsl.inference import bench

    set_fused(fused)
    tag = "after_fused" if fused else "before_old_path"
    rows = RESULT["parts"].setdefault("timing", {}).setdefault(name, {}).setdefault(tag, {})
    gen = torch.Generator().manual_seed(0)
    for L in lengths:
        if left() < 12:
            rows[str(L)] = "skipped: time"
            continue
        def point():
            ids = torch.randint(0, model.config.vocab_size, (1, L), generator=gen).to("cuda")
            cache = model.new_cache(1, max_len=L + 3 + 16)
            with torch.no_grad():
                p = bench.time_prefill(model, ids, cache, 2, torch.device("cuda"))
                d = None
                if L == 32768:
                    d, runner = bench.time_decode(model, cache, 16, 3, torch.device("cuda"), gen, True)
            return {"prefill_s": p, "decode_ms": d}
        r = guarded(f"timing {name} {tag} {L}", point)
        rows[str(L)] = r if r is not None else "failed"
        log(f"timing {name} {tag} @ {L}: {rows[str(L)]}")
        torch.cuda.empty_cache()
        save()
    set_fused(True)


def main() -> None:
    import torch

    os.makedirs(OUT, exist_ok=True)
    open(os.path.join(OUT, "profile_tables.txt"), "w").close()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    RESULT["device"] = torch.cuda.get_device_name()
    RESULT["torch"] = torch.__version__
    log(RESULT["device"], RESULT["torch"])
    models = {}
    for name in ("800m_gdn", "800m_hybrid"):
        models[name] = guarded(f"load {name}", model_for, name)
    models = {k: v for k, v in models.items() if v is not None}
    guarded("correctness", correctness, models)
    for name, model in models.items():
        if left() > 70:
            guarded(f"profile {name}", profile, name, model)
    # timing: after (fused) for all three, then before (old path) as time allows
    for fused in (True, False):
        for name in ("800m_gdn", "800m_hybrid", "800m_transformer"):
            if left() < 15:
                break
            if name not in models:
                models[name] = guarded(f"load {name}", model_for, name)
            if models.get(name) is not None:
                timing(name, models[name], fused)
        if fused:
            models.pop("800m_transformer", None)
            torch.cuda.empty_cache()
    RESULT["elapsed_s"] = time.monotonic() - BEGAN
    save()
    log(json.dumps(RESULT["parts"].get("timing", {}), indent=1))
    log(f"done in {RESULT['elapsed_s']:.0f} s; wrote {OUT}/profile_inference.json and profile_tables.txt")


if __name__ == "__main__":
    main()
