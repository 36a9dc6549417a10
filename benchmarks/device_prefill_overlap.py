"""128K prefill of the 800M models with the NAtS-L layers' two branches on one stream or two (H200).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_prefill_overlap.py [--length 131072]

Random weights, bf16, fast backend; the hybrid's routes forced to each keep fraction. For each
model, prefills alternate between NATSL_PREFILL_OVERLAP off and on (best of --repeats each), and
the cache each leaves is compared (the kernels and their order within a branch are the same, so
the states must be bitwise equal). The GDN model (no NAtS-L layer, so nothing to overlap) is the
ratio's denominator, measured in the same run. JSON to $OUT/prefill_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
OUT = os.environ.get("OUT", "/tmp/prefill_overlap_out")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="800m_gdn:0,800m_hybrid:0.5,800m_hybrid:0.25")
    args = parser.parse_args()
    import torch

    from natsl.inference import bench
    from natsl.provenance import provenance

    os.makedirs(OUT, exist_ok=True)
    device, L = torch.device("cuda"), args.length
    result = {"provenance": provenance(), "length": L, "rows": []}
    ids = None
    for item in args.models.split(","):
        name, keep = item.split(":")
        keep = float(keep) or None
        model, _, _ = bench.load_model(bench.BenchModel("recipe", name, keep), device, torch.bfloat16, "fast", 0)
        if ids is None:
            ids = torch.randint(0, model.config.vocab_size, (1, L), device=device)
        cache = model.new_cache(1, max_len=L + 8)
        row = {"model": name, "keep": keep}
        states = {}
        with torch.no_grad():
            cache.reset()
            model.forward_cached(ids[:, :4096 + 37], cache, last_only=True)  # compile / autotune warm-up
            for flag in ("0", "1") * args.repeats:
                os.environ["NATSL_PREFILL_OVERLAP"] = flag
                s = bench.time_prefill(model, ids, cache, 1, device)
                row[f"overlap_{flag}_s"] = min(row.get(f"overlap_{flag}_s", s), s)
                states[flag] = [t.clone() for c in cache.natsl_caches() for t in (c.state_start, c.state_run)]
        if states["0"]:
            row["states_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(states["0"], states["1"]))
        os.environ.pop("NATSL_PREFILL_OVERLAP")
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        del model, cache
        torch.cuda.empty_cache()
    gdn = next((r for r in result["rows"] if r["model"] == "800m_gdn"), None)
    for r in result["rows"]:
        if gdn and r is not gdn:
            for flag in ("0", "1"):
                r[f"over_gdn_{flag}"] = r[f"overlap_{flag}_s"] / gdn["overlap_1_s"]
            print(f"{r['model']} keep {r['keep']}: {r['overlap_0_s']:.4f} s one stream, {r['overlap_1_s']:.4f} s two "
                  f"({r['overlap_0_s'] / r['overlap_1_s']:.3f}x); over GDN {r['over_gdn_0']:.3f} -> {r['over_gdn_1']:.3f}")
    json.dump(result, open(os.path.join(OUT, "prefill_overlap.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
