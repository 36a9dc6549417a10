"""Registers and spills of natsl's Triton kernels on Hopper, from any machine (no GPU needed).

    python -m benchmarks.resources                          # every kernel family below, at its settings
    python -m benchmarks.resources --kernels gemv --out bench_results/resources

Each kernel variant is compiled for sm_90 by Triton's own code generator and ptxas (`triton.compile` on an
`ASTSource`, the path a launch takes on the GPU), and `cuobjdump -res-usage` reads its registers per thread,
its spill bytes (stack) and static shared memory from the cubin. A kernel that spills in its inner loop trades
registers for local-memory traffic, which timing alone shows only as "slower than expected"; this finds it on
a CPU host, for the Triton version installed here (compare with the GPU image's: docs/performance.md).

Variants: the decode GEMV (`natsl.fast.gemv`) at the 800M shapes' tiles, the GDN and Mamba2 decode steps
(`natsl.fast.decode_step_kernels`), and routed attention's forward, dq
and dk/dv kernels (`natsl.fast.block_sparse`) at their configured settings and at each alternative that
`python -m benchmarks.ops --op routed_attention --sweep` times. Needs Triton's NVIDIA backend (ptxas and
cuobjdump ship in its wheel). Results: a table on stdout, OUT/resources.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = ("gemv", "decode_step", "routed_attention")
H100_SMS = 132  # the launcher's tile choice depends on the SM count: the H100's (the H200 has as many)
FP32_POINTERS = {"lse_ptr", "delta_ptr", "dkeep_ptr"}
INT_POINTERS = {"flags_ptr", "before_ptr", "blocks_ptr"}
FLOAT_SCALARS = {"eps", "scale", "qk_scale"}
# the GEMV kernel's pointer arguments without the _ptr suffix (the conv epilogue's weights and tails)
GEMV_POINTERS = {"cw0", "cw1", "cw2", "ct0", "ct1", "ct2"}


def signature(fn, constexprs: dict, pointers: dict | None = None) -> dict:
    """Triton signature of a bf16 kernel: constexprs as given, pointers by name (`pointers` overrides), the
    rest 32-bit scalars."""
    types = {}
    for name in inspect.signature(fn.fn).parameters:
        if pointers and name in pointers:
            types[name] = pointers[name]
        elif name in constexprs:
            types[name] = "constexpr"
        elif name in FP32_POINTERS:
            types[name] = "*fp32"
        elif name in INT_POINTERS:
            types[name] = "*i32"
        elif name.endswith(("_ptr", "_desc")) or name in GEMV_POINTERS:
            types[name] = "*bf16"
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        sys.exit(f"error: {path} is missing: this Triton has no NVIDIA backend tools; install triton from PyPI")
    return str(path)


def usage(fn, constexprs: dict, num_warps: int, num_stages: int, pointers: dict | None = None) -> dict:
    """Compile fn for sm_90 and read the cubin's registers, stack (spill) bytes and static shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    source = ASTSource(fn=fn, signature=signature(fn, constexprs, pointers),
                       constexprs={(params.index(name),): value for name, value in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {"registers": int(fields["REG"]), "spill_bytes": int(fields["STACK"]), "shared_bytes": int(fields["SHARED"])}


def gemv_variants() -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, constexprs, options): the 800M decode products at one and two rows, at the tiles the
    launcher picks on an H100 (`natsl.fast.gemv.launch_tiles`)."""
    from natsl.fast.gemv import launch_tiles
    from natsl.fast.gemv_kernel import gemv_kernel

    base = {"GATED": False, "NORM_HEAD": 0, "ROW_NORM": False, "HAS_RES": False, "GATE_FIRST": False, "PDL": True,
            "CONV": False, "CONV_W": 1}
    products = [  # (label, N, K, the product's mode)
        ("GDN q|k|v|a|b|g, add + norm + conv", 9228, 1536, {"ROW_NORM": True, "HAS_RES": True, "CONV": True,
                                                          "CONV_W": 3}),
        ("MLP gate|up, add + norm", 8192, 1536, {"ROW_NORM": True, "HAS_RES": True}),
        ("MLP down, SwiGLU", 1536, 4096, {"GATED": True}),
        ("GDN o_proj, output norm (head 384)", 1536, 2304, {"GATED": True, "NORM_HEAD": 384}),
        ("Mamba2 out_proj, gated-input norm", 1536, 3072, {"ROW_NORM": True, "GATE_FIRST": True}),
        ("LM head", 32000, 1536, {}),
    ]
    out = []
    for rows in (1, 2):
        for label, N, K, mode in products:
            constexprs = {**base, **mode, "M": rows,
                          **launch_tiles(N, K, rows, mode.get("NORM_HEAD", 0), H100_SMS)}
            out.append((f"gemv {label}, {rows} row{'s' * (rows > 1)}", gemv_kernel, constexprs,
                        {"num_warps": 4, "num_stages": 3}))
    return out


def decode_step_variants() -> list[tuple[str, object, dict, dict]]:
    """The recurrent decode steps (`natsl.fast.cached`'s gdn_decode_step, gla_decode_step) at the 800M widths:
    fp32 states and per-head vectors, V tiles as `_step_launch` picks them at batch 1 on an H100."""
    from natsl.fast.cached import STEP_TILES, step_blocks, step_tile
    from natsl.fast.decode_step_kernels import gdn_step_kernel, gla_step_kernel

    fp32 = {name: "*fp32" for name in ("s_ptr", "g_ptr", "alog_ptr", "dtb_ptr", "d_ptr")}
    options = {"num_warps": 4, "num_stages": 3, "pointers": fp32}
    out = []
    for label, kernel, layer, heads, K, V, extra in (
            ("decode step GDN (K 192, V 384)", gdn_step_kernel, "gdn", 6, 192, 384, {}),
            ("decode step Mamba2 (state 128, head 64)", gla_step_kernel, "gla", 48, 128, 64,
             {"L2": False, "HAS_D": True})):
        BK, BV = step_blocks(K, V, step_tile(V, heads, H100_SMS, STEP_TILES[layer]))
        out.append((label, kernel, {"K": K, "V": V, "BK": BK, "BV": BV, "PDL": True, **extra}, options))
    return out


def routed_variants() -> list[tuple[str, object, dict, dict]]:
    """Routed attention's kernels at the 800M layer (Dk 64, Dv 128) and at plain 64-dim heads, each at its
    configured settings, then at each alternative of benchmarks.ops' --sweep for it."""
    import torch

    from benchmarks.ops import REGISTRY
    from natsl.fast.block_sparse import config
    from natsl.fast.block_sparse.backward import _dkdv_kernel, _dq_kernel
    from natsl.fast.block_sparse.forward import _forward_kernel, dot_precision

    prec = dot_precision(torch.bfloat16)
    alternatives = {}
    for setting in REGISTRY["routed_attention"].sweep[1]:
        for name, update in setting.items():
            if isinstance(update, dict):
                alternatives.setdefault(name, []).append(update)
    out = []
    for shape, dk, dv in (("800M", 64, 128), ("64-dim heads", 64, 64)):
        forward = "FORWARD_SMALL_DV" if dv <= 64 else "FORWARD"
        for name, kernel in ((forward, _forward_kernel), ("BACKWARD_DQ", _dq_kernel), ("BACKWARD_DKDV", _dkdv_kernel)):
            settings = getattr(config, name)
            for update in [{}, *alternatives.get(name, [])]:
                cfg = {**settings, **update}
                constexprs = {"C": 64, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "DK": dk, "DV": dv,
                              "PREC": prec, "HEADS_FIRST": False}
                if kernel is _forward_kernel:
                    constexprs["USE_DESC"] = False
                if kernel is _dkdv_kernel:
                    constexprs["FULL"] = False
                label = f"routed {shape} {name}" + (f" {update}" if update else " (configured)")
                out.append((label, kernel, constexprs, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}))
    return out


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    parser.add_argument("--out", default="bench_results/resources", help="folder for resources.json")
    args = parser.parse_args(argv)
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in args.kernels if k not in FAMILIES]
    if unknown or not args.kernels:
        parser.error(f"--kernels: unknown family {unknown[0] if unknown else ''!r}; choose from {', '.join(FAMILIES)}")
    return args


def main(argv=None) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("error: TRITON_INTERPRET=1 replaces the compiler with the interpreter; unset it for this script")
    args = parse(argv)
    import triton

    variants = []
    if "gemv" in args.kernels:
        variants += gemv_variants()
    if "decode_step" in args.kernels:
        variants += decode_step_variants()
    if "routed_attention" in args.kernels:
        variants += routed_variants()
    rows = []
    print(f"sm_90, Triton {triton.__version__}: registers per thread, spill bytes, static shared bytes")
    for label, kernel, constexprs, options in variants:
        found = usage(kernel, constexprs, options["num_warps"], options["num_stages"], options.get("pointers"))
        rows.append({"variant": label, "num_warps": options["num_warps"], "num_stages": options["num_stages"],
                     **found})
        print(f"{label}: {found['registers']} registers, {found['spill_bytes']} spill bytes"
              f"{'  <- spills' if found['spill_bytes'] else ''}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "resources.json"
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"triton": triton.__version__, "target": "sm_90", "rows": rows}, indent=2))
    os.replace(tmp, target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
