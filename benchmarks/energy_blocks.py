"""Time and energy of one transformer block of each kind, forward + backward, at the training shape.

    python3 benchmarks/energy_blocks.py [--recipes 800m_hybrid 800m_transformer] [--batch 8] [--seq-len 4096]
        [--keep 0.56] [--no-compile] [--out energy_blocks.json]

Why: the H200 trains the 800M models at its ~690 W power limit (docs/benchmarks.md, nineteenth session),
so a step costs its energy and the SM clock is what the power leaves. This says which block spends the
joules: for every layer kind of each recipe (a GDN, NAtS-L or softmax block: pre-norm, mixer, residual,
pre-norm, SwiGLU, residual) it runs forward + backward as training does (fp32 weights and residual stream,
bf16 autocast, the block compiled whole, RoPE from a shared table, the fast ops), times it (medians of
do_bench) and meters its energy over about `--seconds` of back-to-back calls (NVML through
benchmarks/gpu_meter.py; the meter's absence leaves the energy out). Then each recipe's stack of
blocks is added up: layers x (ms, J). NAtS-L blocks route a fixed random `--keep` fraction of blocks to
the softmax memory (the untrained router's choice would be arbitrary; the 800M runs measure ~0.56).

The embedding, the LM head with its loss and the optimizer are the same in every 800M recipe and are left
out; the stacks' difference is the recipes' difference. On a CPU (`--device cpu --backend chunked
--no-compile`) it runs as a smoke test with host timings only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import natsl  # noqa: E402
from bench_layer import forced_routes  # noqa: E402
from gpu_meter import GpuMeter  # noqa: E402
from natsl.models.lm import Block, rope_table_for  # noqa: E402
from natsl.provenance import provenance  # noqa: E402


def block_step(config, layer_type: str, batch: int, seq_len: int, keep: float, device, backend, compiled: bool):
    """A closure running one forward + backward of a fresh block of `layer_type`, and the block's parameters."""
    torch.manual_seed(0)
    block = Block(config, layer_type, device=device)
    for module in block.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    if layer_type == "natsl":
        routes = forced_routes(batch, -(-seq_len // config.block_size), config.num_heads, keep, device)
        block.mixer.route = lambda _x, routes=routes: routes
    rope = rope_table_for(config, seq_len, device)
    run = torch.compile(block) if compiled else block
    x = torch.randn(batch, seq_len, config.hidden_size, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            out = run(x, rope=rope)
        out.backward(grad)

    return step, [x, *block.parameters()]


def time_ms(step, leaves, device) -> float:
    """Median ms of one call: do_bench on CUDA (gradients reset between calls), the host clock elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(step, warmup=10, rep=200, grad_to_none=leaves, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def energy_j(step, leaves, device, meter: GpuMeter, calls: int):
    """(J per call, the window's power and clock) over `calls` back-to-back calls, or None without a meter."""
    if not meter.available:
        return None
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        for leaf in leaves:
            leaf.grad = None
        step()
    torch.cuda.synchronize(device)
    window = meter.window(t0, time.perf_counter())
    return None if window is None else {**window, "j_per_call": window["energy_j"] / calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["800m_hybrid", "800m_transformer"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.56)
    parser.add_argument("--seconds", type=float, default=2.0, help="metered stretch per block and round")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the blocks (their medians are reported)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="fast")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", default="energy_blocks.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    configs = {name: natsl.load_recipe(name).model for name in args.recipes}
    kinds = {(name, layer_type): config for name, config in configs.items()  # (recipe, layer type) -> config
             for layer_type in sorted(set(config.layer_types()))}
    steps = {key: block_step(config, key[1], args.batch, args.seq_len, args.keep, device, args.backend,
                             not args.no_compile) for key, config in kinds.items()}
    measured = {key: {"ms": [], "windows": []} for key in kinds}
    with GpuMeter.for_device(device, interval_s=0.02) as meter:
        if not meter.available:
            print(f"no energy meter ({meter.reason}): times only", flush=True)
        for _ in range(args.rounds):  # round-robin, so that drift in clock and temperature spreads over all
            for key, (step, leaves) in steps.items():
                ms = time_ms(step, leaves, device)
                measured[key]["ms"].append(ms)
                energy = energy_j(step, leaves, device, meter, max(3, round(1000 * args.seconds / ms)))
                if energy is not None:
                    measured[key]["windows"].append(energy)
                print(f"{key[0]:18s} {key[1]:10s} {ms:8.3f} ms"
                      + (f"  {energy['j_per_call']:7.3f} J  {energy['power_w_mean']:5.0f} W  "
                         f"{energy['sm_clock_mhz_median']:5.0f} MHz" if energy else ""), flush=True)
    blocks = []
    for (name, layer_type), m in measured.items():
        joules = [w["j_per_call"] for w in m["windows"]]
        blocks.append({"recipe": name, "layer_type": layer_type, "ms": statistics.median(m["ms"]),
                       "j": statistics.median(joules) if joules else None, "rounds": m})
    stacks = []
    print("\n| recipe | layers | stack ms (fwd + bwd) | stack J |\n|---|---|---|---|")
    for name, config in configs.items():
        counts = Counter(config.layer_types())
        mine = {b["layer_type"]: b for b in blocks if b["recipe"] == name}
        ms = sum(n * mine[t]["ms"] for t, n in counts.items())
        j = sum(n * mine[t]["j"] for t, n in counts.items()) if all(mine[t]["j"] is not None for t in counts) else None
        stacks.append({"recipe": name, "layers": dict(counts), "ms": ms, "j": j})
        layers = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        print(f"| {name} | {layers} | {ms:.1f} | {'n/a' if j is None else f'{j:.1f}'} |")
    Path(args.out).write_text(json.dumps({"provenance": provenance(), "args": vars(args), "blocks": blocks,
                                          "stacks": stacks}, indent=1))


if __name__ == "__main__":
    main()
