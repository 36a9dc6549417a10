"""The routed-attention forward inside a 128K prefill of the 800M NAtS-L Hybrid against the same kernel
alone (H200, ~2 min).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_prefill_attention.py [--keep-fraction 0.25]

In the fourteenth session's profile (2026-12-01, call 1) the hybrid's six attention forwards took
36.8 ms each at keep 0.25, against 31.9 ms for the kernel alone on random inputs
(device_attention_variants.py), about the hybrid's whole unexplained excess over the GDN model. This
script tells the causes apart, one at a time:
  1. the prefill with the GDN branch on a side stream and without (NATSL_PREFILL_OVERLAP), best of 3;
  2. the first NAtS-L layer's (q, k, v, keep) captured during a prefill, then `ops.routed_attention`
     timed on them alone;
  3. the same shapes with random inputs: the captured keep, and a random keep of exactly the fraction;
  4. CUDA events around each layer's attention call during a prefill, with and without the side stream;
  5. the captured call after ~150 ms of bf16 matmuls and after 0.2 s idle (CUDA events), with the SM
     clock and power sampled by nvidia-smi every 20 ms in each phase (does a hot GPU run it slower?).
Medians of triton.testing.do_bench; JSON to $OUT/prefill_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
OUT = os.environ.get("OUT", "/tmp/prefill_attention_out")


def sample_clocks(fn):
    """fn() while nvidia-smi samples SM clock (MHz), power (W) and temperature every 20 ms."""
    import subprocess

    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
             "-lms", "20", "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]]
    try:
        proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return fn(), []
    try:
        value = fn()
    finally:
        proc.terminate()
        text = proc.communicate(timeout=5)[0]
    samples = []
    for line in text.splitlines():
        try:
            samples.append([float(x) for x in line.split(",")])
        except ValueError:
            continue
    return value, samples


def median_clock(samples) -> float | None:
    """The middle SM clock (MHz) of sample_clocks' samples (the upper one of an even count), None without samples."""
    clocks = sorted(x[0] for x in samples)
    return clocks[len(clocks) // 2] if clocks else None


def heat_test(call, rounds: int = 5) -> dict:
    """Event times of `call` right after ~150 ms of large bf16 matmuls, then after 0.2 s idle."""
    import time

    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = {}
    for phase in ("after_matmuls", "after_idle"):
        def run():
            times = []
            for _ in range(rounds):
                if phase == "after_matmuls":
                    for _ in range(100):
                        a @ a
                else:
                    torch.cuda.synchronize()
                    time.sleep(0.2)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return times

        times, samples = sample_clocks(run)
        clocks = [s[0] for s in samples]
        out[phase] = {"attention_ms": times,
                      "sm_mhz_min_median_max": [min(clocks), median_clock(samples), max(clocks)] if clocks else None,
                      "power_w_max": max(s[1] for s in samples) if samples else None}
        print(phase, out[phase], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--keep-fraction", type=float, default=0.25)
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import bench_routed_attention as bench
    from natsl import ops
    from natsl.inference import bench as ibench
    from natsl.models import natsl_layer
    from natsl.provenance import provenance

    os.makedirs(OUT, exist_ok=True)
    device, L = torch.device("cuda"), args.length
    result = {"provenance": provenance(), "length": L, "keep_fraction": args.keep_fraction}
    model, _, _ = ibench.load_model(ibench.BenchModel("recipe", "800m_hybrid", args.keep_fraction), device,
                                    torch.bfloat16, "fast", 0)
    ids = torch.randint(0, model.config.vocab_size, (1, L), device=device)
    cache = model.new_cache(1, max_len=L + 8)

    real = ops.routed_attention
    captured, events = [], []

    def spy(q, k, v, keep, **kw):
        if not captured:
            captured.append((q.clone(), k.clone(), v.clone(), keep.clone(), kw))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real(q, k, v, keep, **kw)
        end.record()
        events.append((start, end))
        return out

    with torch.no_grad():
        model.forward_cached(ids[:, :4096 + 37], cache, last_only=True)  # compile / autotune warm-up
        for overlap in ("1", "0"):
            os.environ["NATSL_PREFILL_OVERLAP"] = overlap
            result[f"prefill_s_overlap{overlap}"] = ibench.time_prefill(model, ids, cache, 3, device)
            natsl_layer.ops.routed_attention = spy
            events.clear()
            cache.reset()

            def prefill():
                model.forward_cached(ids, cache, last_only=True)
                torch.cuda.synchronize()

            _, samples = sample_clocks(prefill)
            natsl_layer.ops.routed_attention = real
            result[f"sm_mhz_median_in_prefill_overlap{overlap}"] = median_clock(samples)
            result[f"attention_ms_in_prefill_overlap{overlap}"] = [s.elapsed_time(e) for s, e in events]
            print(f"overlap {overlap}: prefill {result[f'prefill_s_overlap{overlap}']:.4f} s, SM clock median "
                  f"{result[f'sm_mhz_median_in_prefill_overlap{overlap}']} MHz, attention calls (ms) "
                  + " ".join(f"{t:.2f}" for t in result[f"attention_ms_in_prefill_overlap{overlap}"]), flush=True)
        os.environ.pop("NATSL_PREFILL_OVERLAP")

        q, k, v, keep, kw = captured[0]
        result["captured"] = {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape), "keep": list(keep.shape),
                              "keep_mean": float(keep.float().mean()), "kwargs": {a: str(b) for a, b in kw.items()},
                              "strides": [list(x.stride()) for x in (q, k, v)]}
        print("captured", result["captured"], flush=True)
        B, T, H, DK = q.shape
        DV = v.shape[-1]
        G = keep.shape[-1]

        def timed(label, q_, k_, v_, keep_):
            ms, samples = sample_clocks(lambda: do_bench(lambda: real(q_, k_, v_, keep_, **kw), warmup=25, rep=600,
                                                         return_mode="median"))
            result[label] = {"ms": ms, "sm_mhz_median": median_clock(samples)}
            print(f"{label}: {ms:.3f} ms (SM clock median {result[label]['sm_mhz_median']} MHz)", flush=True)

        timed("alone, captured inputs", q, k, v, keep)
        rq, rk, rv, _ = bench.attention_inputs(B, T, H, DK, DV, torch.bfloat16, "cuda")
        timed("alone, random q/k/v, captured keep", rq, rk, rv, keep)
        exact = bench.random_keep(B, keep.shape[1], G, float(keep.float().mean()), "cuda").to(keep.dtype)
        timed("alone, random q/k/v, random keep of the same fraction", rq, rk, rv, exact)
        timed("alone, captured q/k/v, random keep of the same fraction", q, k, v, exact)
        result["after_matmuls_vs_idle"] = heat_test(lambda: real(q, k, v, keep, **kw))
    with open(os.path.join(OUT, "prefill_attention.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
