"""Prefill and decode latency against context (the paper's Fig. 4) for the 800M systems, side by side.

    python -m benchmarks.latency                                   # 1K..128K, the three 800M systems, keep 0.5
    python -m benchmarks.latency --min-len 131072 --keep 0.5 0.25 --budget 300
    python -m benchmarks.latency --recipes tiny_hybrid --max-len 256 --device cpu    # a CPU smoke run

Each keep fraction is one run of `natsl.inference.bench.run_benchmark` (what `natsl bench-latency`
runs: random weights, the NAtS-L routes forced to keep that fraction, the first (cold) prefill at each
length timed apart, the median of the warm prefills after it, median CUDA-graph decode, each beside its
compute / memory floor); the fraction only changes the NAtS-L models, so the
others are measured in the first run only. OUT/latency.json is rewritten after every point (a run cut
short keeps what it measured); at the end come OUT/latency.png and a table of each model's prefill and
decode time over the first recipe's ("x first": the Transformer over the hybrid, e.g.) per context.
`--budget` seconds are shared by the runs (bench's time budget: points past a model's share are
recorded as skipped).
"""

from __future__ import annotations

import argparse
import time

from benchmarks import common

RECIPES = ("800m_hybrid", "800m_transformer", "800m_gdn")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=131072)
    parser.add_argument("--keep", type=float, nargs="+", default=[0.5], help="keep fractions of the NAtS-L models")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("--device", default=None)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    common.add_out_argument(parser)
    return parser


def has_natsl_layers(recipe: str) -> bool:
    import natsl

    return "natsl" in natsl.load_recipe(recipe).model.layer_types()


def side_by_side(runs: list[dict]) -> list[dict]:
    """One row per (model, keep, context): prefill s and decode ms, and each over the first model's at that
    context in the first run."""
    rows = []
    for run in runs:
        for entry in run["models"]:
            for p in entry["points"]:
                if "error" not in p:
                    rows.append({"model": entry["name"], "keep": entry["forced_keep_fraction"], "context": p["context"],
                                 "cold_prefill_s": p.get("cold_prefill_s"), "prefill_s": p["prefill_s"],
                                 "decode_ms": p["decode_ms"],
                                 "prefill_floor_s": p["prefill_floor_s"], "decode_floor_ms": p["decode_floor_ms"]})
    first = {}
    for r in rows:
        first.setdefault(r["context"], r)
    for r in rows:
        base = first[r["context"]]
        r["prefill_x_first"] = r["prefill_s"] / base["prefill_s"]
        r["decode_x_first"] = r["decode_ms"] / base["decode_ms"]
    return rows


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import torch

    from natsl.errors import NatslError
    from natsl.inference import bench

    if not args.recipes or not 1 <= args.min_len <= args.max_len:
        raise NatslError(f"need recipes and 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    began = time.monotonic()
    runs: list[dict] = []

    def save(current: dict) -> None:
        common.write_result("latency", {"runs": runs + [current]}, args.out)

    lengths = bench.context_lengths(args.min_len, args.max_len)
    for i, keep in enumerate(args.keep):
        recipes = [r for r in args.recipes if i == 0 or has_natsl_layers(r)]
        if not recipes:
            break
        budget = None if args.budget is None else (args.budget - (time.monotonic() - began)) / (len(args.keep) - i)
        print(f"== keep {keep}: {', '.join(recipes)} at {lengths[0]}..{lengths[-1]}", flush=True)
        result = bench.run_benchmark([bench.BenchModel("recipe", r, keep if has_natsl_layers(r) else None)
                                      for r in recipes], lengths, device=device,
                                     dtype=torch.bfloat16 if cuda else torch.float32,
                                     backend="fast" if cuda else "chunked", decode_tokens=args.decode_tokens,
                                     repeats=args.repeats, cuda_graphs=cuda and not args.no_cuda_graphs,
                                     progress=False, on_update=save, time_budget_s=budget)
        runs.append(result)
        print(bench.format_table(result), flush=True)
    rows = side_by_side(runs)
    common.write_result("latency", {"runs": runs, "side_by_side": rows}, args.out)
    merged = dict(runs[0], models=[entry for run in runs for entry in run["models"]])
    for entry in merged["models"]:
        if entry["forced_keep_fraction"] is not None:
            entry["name"] = f"{entry['name']} keep {entry['forced_keep_fraction']}"
    bench.plot(merged, f"{args.out}/latency.png")
    print(common.table(rows, ["model", "keep", "context", "cold_prefill_s", "prefill_s", "prefill_x_first", "decode_ms",
                              "decode_x_first"]))


if __name__ == "__main__":
    main()
