"""Whole-layer timing: the NAtS-L layer against a GDN layer and a softmax layer (and the authors' layer if given).

    python -m benchmarks.layer                                        # 800M widths, T = 4K..128K
    python -m benchmarks.layer --lengths 4096 16384 --fractions 1 0.5 --energy
    python -m benchmarks.layer --authors MODULE:FACTORY               # FACTORY(model config, device) -> layer

The recipe's widths (800m: d=1536, 6 GDN heads of K=192/V=384 cut into 18 softmax heads of 64/128,
and a 24 x 64 softmax layer), batch 1, forward and forward+backward, with the NAtS-L router forced to
each keep fraction (a seeded random block mask per routing group: an untrained router's choice would
be arbitrary). The issue's target: NAtS-L forward+backward at T=4096 at most 1.3x (GDN layer +
softmax layer), the ratio `natsl_vs_gdn_plus_softmax_fwdbwd`. `--energy` also meters each layer's
forward+backward over about `--seconds` of back-to-back calls through NVML (joules per call, mean
power, SM clock), where a meter is available. Results: OUT/layer.json and .png.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from benchmarks import common



def forced_routes(batch: int, num_blocks: int, heads: int, fraction: float, device, seed: int = 0):
    """keep/write [B, NB, H] with round(fraction * NB) kept blocks per (batch, head)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    keep = torch.zeros(batch, num_blocks, heads)
    count = round(fraction * num_blocks)
    for b in range(batch):
        for h in range(heads):
            keep[b, torch.randperm(num_blocks, generator=gen)[:count], h] = 1.0
    keep = keep.to(device)
    return keep, 1.0 - keep


def layer_step(layer, x, backward: bool):
    """The call to time: a forward (no autograd) or a forward + backward from a fixed output gradient."""
    if not backward:
        def forward():
            with torch.no_grad():
                return layer(x)
        return forward
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        layer(x).backward(grad)
    return step


def joules(step, device, meter: common.GpuMeter, ms: float, seconds: float):
    """J per call and the window's power and clock over about `seconds` of back-to-back calls, or None."""
    if not meter.available:
        return None
    calls = max(3, round(1000 * seconds / max(ms, 1e-3)))
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize(device)
    window = meter.window(t0, time.perf_counter())
    return None if window is None else {**window, "j_per_call": window["energy_j"] / calls}


def authors_layer(spec: str | None, config, device):
    """The layer FACTORY(config, device) of `MODULE:FACTORY`, or None (with a line) where it cannot be had."""
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)(config, device)
    except Exception as err:  # noqa: BLE001 - not installed, or another API: skipped, not fatal
        print(f"skip the authors' layer {spec}: {type(err).__name__}: {err}", flush=True)
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="800m", help="800m, 380m, tiny or a recipe name / path")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--no-backward-above", type=int, default=65536,
                        help="skip forward+backward above this length (memory)")
    parser.add_argument("--authors", default=None, help="MODULE:FACTORY building the authors' layer")
    parser.add_argument("--energy", action="store_true", help="also meter joules per forward+backward (NVML)")
    parser.add_argument("--seconds", type=float, default=2.0, help="with --energy: metered stretch per layer")
    parser.add_argument("--device", default=None)
    common.add_out_argument(parser)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import natsl
    from natsl.models.attention import SoftmaxAttention
    from natsl.models.gated_deltanet import GatedDeltaNet
    from natsl.models.natsl_layer import NAtSL

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = natsl.load_recipe(common.PRESETS.get(args.shapes, args.shapes)).model
    torch.manual_seed(0)
    layers = {"gdn": GatedDeltaNet(config, device=device), "softmax": SoftmaxAttention(config, device=device),
              "natsl": NAtSL(config, device=device)}
    authors = authors_layer(args.authors, config, device)
    if authors is not None:
        layers["authors"] = authors
    for layer in layers.values():
        layer.to(dtype)
        for module in layer.modules():
            if hasattr(module, "backend"):
                module.backend = "fast" if cuda else "chunked"
    rows = []
    with common.GpuMeter.for_device(device, interval_s=0.02) if args.energy else common.GpuMeter(reason="off") as meter:
        if args.energy and not meter.available:
            print(f"no energy meter ({meter.reason}): times only", flush=True)
        for length in args.lengths:
            x = torch.randn(1, length, config.hidden_size, device=device, dtype=dtype, requires_grad=True)
            backward = length <= args.no_backward_above
            row = {"T": length}
            runs = [(name, layers[name], name) for name in layers if name != "natsl"]
            for fraction in args.fractions:
                routes = forced_routes(1, -(-length // config.block_size), config.num_heads, fraction, device)
                runs.append((f"natsl_keep{fraction}", layers["natsl"], routes))
            for label, layer, routes in runs:
                if isinstance(routes, tuple):
                    layer.route = lambda _x, routes=routes: routes
                for mode in ("fwd", "fwdbwd") if backward else ("fwd",):
                    step = layer_step(layer, x, mode == "fwdbwd")
                    row[f"{label}_{mode}_ms"] = ms = common.time_ms(step, cuda=cuda)
                    energy = joules(step, device, meter, ms, args.seconds) if mode == "fwdbwd" else None
                    if energy is not None:
                        row[f"{label}_fwdbwd_j"] = energy["j_per_call"]
                        row[f"{label}_fwdbwd_w"] = energy["power_w_mean"]
            if backward and args.fractions and 1.0 in args.fractions:
                row["natsl_vs_gdn_plus_softmax_fwdbwd"] = row["natsl_keep1.0_fwdbwd_ms"] / (
                    row["gdn_fwdbwd_ms"] + row["softmax_fwdbwd_ms"])
            rows.append(row)
            print(row, flush=True)
            del x
            if cuda:
                torch.cuda.empty_cache()
    common.write_result("layer", {"device": str(device), "shapes": args.shapes, "rows": rows}, args.out)
    groups = {f"T={r['T']} {mode}": {k[:-len(f'_{mode}_ms')]: v for k, v in r.items() if k.endswith(f"_{mode}_ms")}
              for r in rows for mode in ("fwd", "fwdbwd")}
    common.bar_png(f"{args.out}/layer.png", {k: v for k, v in groups.items() if v}, "median ms",
                   f"one layer, {args.shapes} widths, batch 1, {dtype}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(common.table(rows, keys))


if __name__ == "__main__":
    main()
