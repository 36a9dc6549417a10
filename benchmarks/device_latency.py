"""The H200 latency run (paper Fig. 4): GPU checks of the cache path, then prefill / decode latency
of the 800M NAtS-L Hybrid, Transformer and GDN at bf16 from 1K to 131072 tokens of context.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_latency.py

1. `pytest -m gpu tests/test_inference.py`: the fast backend's prefill + decode against the full
   forward, and CUDA-graph decoding against eager decoding (output in $OUT/gpu_tests.txt);
2. `natsl.inference.bench.run_benchmark` (what `natsl bench-latency` runs) on the three 800M recipes
   with random weights, the NAtS-L routes forced to keep half the blocks, batch 1, bf16, backend
   fast, CUDA graphs on. $OUT/latency.json is rewritten after every point (a run cut short keeps
   what it measured); $OUT/latency.png and the table come at the end. An out-of-memory point is
   recorded and ends that model's ladder; the time budget is shared by the models.

Options: --max-len, --min-len, --budget SECONDS (whole script, default 540), --skip-tests,
--recipes a,b,c, --decode-tokens, --repeats, --keep-fraction.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

OUT = os.environ.get("OUT", "/tmp/device_latency_out")


def log(*parts) -> None:
    print(*parts, flush=True)


def gpu_tests(timeout: float) -> None:
    """Run the @gpu inference tests; their output goes to $OUT/gpu_tests.txt and the tail to the log."""
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-x", "tests/test_inference.py"],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text, status = proc.stdout + proc.stderr, f"exit code {proc.returncode}"
    except subprocess.TimeoutExpired as err:
        text, status = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), "timed out"
    with open(os.path.join(OUT, "gpu_tests.txt"), "w") as fh:
        fh.write(text)
    log(f"gpu tests: {status} after {time.monotonic() - started:.0f} s")
    log("\n".join(text.strip().splitlines()[-15:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-len", type=int, default=131072)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole script")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--recipes", default="800m_hybrid,800m_transformer,800m_gdn")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-fraction", type=float, default=0.5)
    args = parser.parse_args()
    began = time.monotonic()
    os.makedirs(OUT, exist_ok=True)

    import torch

    from natsl.inference import bench

    if not torch.cuda.is_available():
        sys.exit("this script measures a CUDA GPU; on the CPU use `natsl bench-latency --recipe recipes/tiny_hybrid.yaml "
                 "--max-len 2048 --device cpu`")
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    if not args.skip_tests:
        gpu_tests(timeout=min(240.0, args.budget / 3))

    json_path, png_path = os.path.join(OUT, "latency.json"), os.path.join(OUT, "latency.png")
    specs = [bench.BenchModel("recipe", name, args.keep_fraction) for name in args.recipes.split(",")]
    remaining = args.budget - (time.monotonic() - began) - 20  # keep time for the plot and the table
    log(f"benchmark: {args.recipes} at {args.min_len}..{args.max_len}, {remaining:.0f} s")
    result = bench.run_benchmark(
        specs, bench.context_lengths(args.min_len, args.max_len), device=torch.device("cuda"), dtype=torch.bfloat16,
        backend="fast", decode_tokens=args.decode_tokens, repeats=args.repeats, cuda_graphs=True, progress=False,
        on_update=lambda r: (bench.save_json(r, json_path), log(_last_point(r))), time_budget_s=remaining)
    bench.save_json(result, json_path)
    bench.plot(result, png_path)
    log(bench.format_table(result))
    log(f"wrote {json_path} and {png_path} after {time.monotonic() - began:.0f} s")


def _last_point(result: dict) -> str:
    entry = result["models"][-1]
    point = entry["points"][-1]
    if "error" in point:
        return f"{entry['name']} @ {point['context']}: {point['error']}"
    return (f"{entry['name']} @ {point['context']}: prefill {point['prefill_s']:.3f} s (floor {point['prefill_floor_s']:.3f}), "
            f"decode {point['decode_ms']:.3f} ms (floor {point['decode_floor_ms']:.3f}), keep {point['keep_fraction']}, "
            f"peak {point['peak_memory_bytes'] / 2**30:.1f} GiB, graphs {point['cuda_graphs']}")


if __name__ == "__main__":
    main()
