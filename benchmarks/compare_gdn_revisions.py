"""Side by side on the GPU: this tree's gated-delta backward kernels against another revision's.

    git archive REV natsl/fast/gated_delta | tar -x -C baseline/      (on a machine with git)
    python3 benchmarks/compare_gdn_revisions.py --baseline baseline/natsl/fast/gated_delta \
        --kernels grad_qk,grad_wy --out $OUT

For each named kernel module (a file in natsl/fast/gated_delta/), the baseline's copy is loaded as a
module of its own beside the current one. Both run on the same stage inputs (B=4, T=4096, the
training shape, and B=1, T=32768), their outputs are compared (relative RMS error, the current one
against the baseline's), and they are timed interleaved (rounds of triton.testing.do_bench medians,
alternating which goes first). Then the whole gated_delta_rule forward + backward is timed with the
baseline's kernels swapped into natsl.fast.gated_delta.function and with the current ones.
--variants times the current kernels also at other launch settings (each a comma list of KEY=VALUE
overrides of the kernel's dict in config.py, e.g. "DOR_PASS=separate,num_warps=8"), each compared
with the baseline; --shapes picks the (B, T) shapes. Outputs that hold per-tile partial sums along
their first dim (grad_qk's dg, p1, p2) are compared as sums over it when the two revisions' tile
counts differ.
The baseline's modules import this tree's common.py, so the script refuses a baseline whose
common.py differs (the comparison would then mix two revisions' helpers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from device_gated_delta import C, DT, H, V, inputs, rel, stage_runner  # noqa: E402
from natsl.fast.gated_delta import config, function, gated_delta_rule  # noqa: E402
from natsl.provenance import provenance  # noqa: E402

PACKAGE = ROOT / "natsl" / "fast" / "gated_delta"
ROUNDS = 5


def load_baseline(directory: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"baseline_{name}", directory / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"8x4096,1x32768" -> ((8, 4096), (1, 32768))."""
    return tuple(tuple(int(n) for n in part.split("x")) for part in text.split(",") if part)


def parse_overrides(text: str) -> dict:
    """"DOR_PASS=separate,num_warps=8,descriptors=true" -> {"DOR_PASS": "separate", "num_warps": 8,
    "descriptors": True}."""
    def typed(value: str):
        if value.lower() in ("true", "false"):
            return value.lower() == "true"
        return int(value) if value.lstrip("-").isdigit() else value

    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {key: typed(value) for key, value in pairs}


def comparable(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two revisions' outputs as tensors of one shape: partial sums along dim 0 summed."""
    if a.shape != b.shape and a.dim() == b.dim() and a.shape[1:] == b.shape[1:]:
        return a.sum(0), b.sum(0)
    return a, b


def tensors(out):
    return [x for x in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(x, torch.Tensor)]


def interleaved_ms(fns: dict) -> dict:
    """Median over ROUNDS of do_bench medians, the order of the variants flipped every round."""
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(ROUNDS):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(do_bench(fns[name], warmup=10, rep=50, return_mode="median"))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, type=Path, help="the other revision's natsl/fast/gated_delta folder")
    ap.add_argument("--kernels", default="grad_qk,grad_wy", help="comma list of kernel modules to compare")
    ap.add_argument("--shapes", default="4x4096,1x32768", help="comma list of BxT shapes")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="other launch settings of the current kernels: KEY=VALUE,... overrides of config.py's dicts")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes)
    names = [n for n in args.kernels.split(",") if n]
    missing = [f for f in ["common"] + names if not (args.baseline / f"{f}.py").is_file()]
    if missing:
        sys.exit(f"compare_gdn_revisions.py: {args.baseline} has no {', '.join(m + '.py' for m in missing)}; pass "
                 "the other revision's natsl/fast/gated_delta folder")
    if (args.baseline / "common.py").read_bytes() != (PACKAGE / "common.py").read_bytes():
        sys.exit("compare_gdn_revisions.py: the baseline's common.py differs from this tree's; compare whole "
                 "trees in two processes instead (benchmarks/device_gated_delta.py in each)")
    if not torch.cuda.is_available():
        sys.exit("compare_gdn_revisions.py times Triton kernels on a CUDA GPU; none is visible here")
    baseline = {n: load_baseline(args.baseline, n) for n in names}
    current = {n: sys.modules[f"natsl.fast.gated_delta.{n}"] for n in names}
    config.INTERMEDIATE = "input"
    results = {"provenance": provenance(), "kernels": names, "stages": [], "whole": []}
    bench = sys.modules["device_gated_delta"]
    for B, T in shapes:
        # The stage runner calls the launchers through device_gated_delta's globals: swap them there.
        for n in names:
            setattr(bench, n, getattr(current[n], n))
        runner = stage_runner(T, B=B)
        for n in names:
            stage = runner[n.upper()]

            def with_module(module, n=n, stage=stage):
                def call():
                    setattr(bench, n, getattr(module, n))
                    return stage()
                return call

            settings = getattr(config, n.upper())
            default = dict(settings)

            def with_settings(fn, overrides):
                def call():
                    settings.clear()
                    settings.update(default, **overrides)
                    try:
                        return fn()
                    finally:
                        settings.clear()
                        settings.update(default)
                return call

            old_fn = with_module(baseline[n])
            fns = {"current": with_module(current[n])}
            fns.update({v: with_settings(fns["current"], parse_overrides(v)) for v in args.variants})
            old_out = tensors(old_fn())
            errors = {}
            for name, fn in fns.items():
                pairs = [comparable(a.float(), b.float()) for a, b in zip(tensors(fn()), old_out)]
                errors[name] = [rel(a, b) for a, b in pairs]
            ms = interleaved_ms({"baseline": old_fn, **fns})
            for name in fns:
                row = dict(B=B, T=T, kernel=n, variant=name, baseline_ms=ms["baseline"], current_ms=ms[name],
                           ratio=ms[name] / ms["baseline"], max_rel_error=max(errors[name]),
                           rel_errors=errors[name])
                results["stages"].append(row)
                print(f"B={B} T={T:6d} {n:8s} {name:28s} baseline {ms['baseline']:.3f} ms  current {ms[name]:.3f} "
                      f"ms  ratio {row['ratio']:.3f}  max rel error {max(errors[name]):.2e}", flush=True)
            setattr(bench, n, getattr(current[n], n))
        del runner
        xs = inputs(T, seed=2, requires_grad=True, B=B)
        write = torch.randint(0, 2, (B, triton.cdiv(T, C), H), device="cuda").float()
        do = torch.randn(B, T, H, V, device="cuda").to(DT)

        def fwd_bwd(modules):
            def run():
                for n, module in modules.items():
                    setattr(function, n, getattr(module, n))
                o, _ = gated_delta_rule(*xs, write, route_grad="full")
                o.backward(do)
            return run

        ms = interleaved_ms({"baseline": fwd_bwd(baseline), "current": fwd_bwd(current)})
        for n in names:
            setattr(function, n, getattr(current[n], n))
        row = dict(B=B, T=T, baseline_ms=ms["baseline"], current_ms=ms["current"], ratio=ms["current"] / ms["baseline"])
        results["whole"].append(row)
        print(f"B={B} T={T:6d} gated_delta_rule forward+backward: baseline {ms['baseline']:.3f} ms  current "
              f"{ms['current']:.3f} ms  ratio {row['ratio']:.3f}", flush=True)
        del xs, do
        torch.cuda.empty_cache()
    out = Path(args.out) / "compare_gdn_revisions.json"
    out.write_text(json.dumps(results, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
