"""Whole-layer timing on a GPU: the NAtS-L layer (fast path) against a GDN layer and a softmax layer.

800M shapes (d=1536, 6 GDN heads of K=192/V=384 cut into 18 softmax heads of 64/128), batch 1,
bf16, forward and forward+backward, at T = 4K..128K, with the router forced to a keep fraction
(a seeded random block mask per routing group; the untrained router's choice would be arbitrary).
The issue's target: NAtS-L forward+backward at T=4096 at most 1.3x (GDN layer + softmax layer).
The authors' layer (ANCHORS.md): 7.11 ms forward at 4K keep 1, 211 ms at 128K keep 1.

    python benchmarks/bench_layer.py --lengths 4096 16384 65536 131072 --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch

import natsl
from natsl.provenance import provenance
from natsl.models.attention import SoftmaxAttention
from natsl.models.gated_deltanet import GatedDeltaNet
from natsl.models.natsl_layer import NAtSL


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


def time_layer(layer, x, backward: bool) -> float:
    from triton.testing import do_bench

    if not backward:
        with torch.no_grad():
            return do_bench(lambda: layer(x), warmup=25, rep=100, return_mode="median")
    grad = torch.randn_like(x)

    def step():
        x.grad = None
        layer(x).backward(grad)

    return do_bench(step, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--no-backward-above", type=int, default=65536,
                        help="skip forward+backward above this length (memory)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    hybrid = natsl.load_recipe("800m_hybrid").model
    transformer = natsl.load_recipe("800m_transformer").model
    layers = {
        "gdn": GatedDeltaNet(hybrid, device=device),
        "softmax": SoftmaxAttention(transformer, device=device),
        "natsl": NAtSL(hybrid, device=device),
    }
    for layer in layers.values():
        layer.to(torch.bfloat16)
        if hasattr(layer, "backend"):
            layer.backend = "fast"
    rows = []
    for length in args.lengths:
        x = torch.randn(1, length, hybrid.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
        num_blocks = -(-length // hybrid.block_size)
        row = {"T": length}
        for name in ("gdn", "softmax"):
            row[f"{name}_fwd_ms"] = time_layer(layers[name], x, backward=False)
            if length <= args.no_backward_above:
                row[f"{name}_fwdbwd_ms"] = time_layer(layers[name], x, backward=True)
        for fraction in args.fractions:
            keep, write = forced_routes(1, num_blocks, hybrid.num_heads, fraction, device)
            layers["natsl"].route = lambda _x, keep=keep, write=write: (keep, write)
            row[f"natsl_keep{fraction}_fwd_ms"] = time_layer(layers["natsl"], x, backward=False)
            if length <= args.no_backward_above:
                row[f"natsl_keep{fraction}_fwdbwd_ms"] = time_layer(layers["natsl"], x, backward=True)
        if "natsl_keep1.0_fwdbwd_ms" in row:
            row["natsl_vs_gdn_plus_softmax_fwdbwd"] = row["natsl_keep1.0_fwdbwd_ms"] / (
                row["gdn_fwdbwd_ms"] + row["softmax_fwdbwd_ms"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "provenance": provenance(), "rows": rows}, fh, indent=2)
    keys = [k for k in rows[0] if k != "T"]
    print("\n| T | " + " | ".join(keys) + " |")
    for row in rows:
        print(f"| {row['T']} | " + " | ".join(f"{row[k]:.3f}" if k in row else "-" for k in keys) + " |")


if __name__ == "__main__":
    main()
