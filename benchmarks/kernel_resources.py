"""Registers, spill stack and shared memory of the fast kernels compiled for Hopper (sm_90), on a CPU.

    python3 benchmarks/kernel_resources.py [--out resources.json]

No GPU needed: a child process runs one bf16 gated_delta_rule forward + backward (800M head dims, a
few tokens) and a short conv backward under TRITON_INTERPRET=1 and records every kernel launch's
argument dtypes, constexprs and launch options; this process then compiles each launch with
`triton.compile(..., target=GPUTarget("cuda", 90, 32))` and reads the cubin's resource usage with the
cuobjdump that ships with Triton. The gated-delta kernels run at their training-shape settings (the
two state recurrences at their 64-wide slices); `VARIANTS` adds a few other launch settings.

What it tells: whether a kernel spills (STACK > 0 means registers went to local memory) and how many
blocks fit an SM (registers and shared memory), which a profile on the GPU then weighs. It compiles
with this machine's Triton, which may differ from the GPU's (the lent H200 has Triton 3.6): read it
as a guide to change a kernel by, not as the device's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the kernels are imported from the checkout, installed or not

# (module, kernel) pairs; the recorder wraps each module attribute during one interpreted run.
KERNELS = (("natsl.fast.gated_delta.prepare", "_prepare_kernel"), ("natsl.fast.gated_delta.state", "_state_fwd_kernel"),
           ("natsl.fast.gated_delta.output", "_output_kernel"), ("natsl.fast.gated_delta.output", "_local_dr_kernel"),
           ("natsl.fast.gated_delta.state", "_state_bwd_kernel"), ("natsl.fast.gated_delta.grad_qk", "_grad_qk_kernel"),
           ("natsl.fast.gated_delta.grad_wy", "_grad_wy_kernel"), ("natsl.fast.short_conv", "_conv_bwd_walk_kernel"),
           ("natsl.fast.short_conv", "_conv_fwd_kernel"))
# Launch settings beside the defaults: (kernel, constexpr overrides, num_warps, num_stages).
VARIANTS = (("_state_fwd_kernel", {"BV": 32}, 4, 3), ("_state_bwd_kernel", {"BV": 32}, 4, 2),
            ("_state_bwd_kernel", {"BV": 32}, 8, 2), ("_grad_wy_kernel", {}, 8, 3), ("_grad_qk_kernel", {}, 8, 3),
            ("_conv_bwd_walk_kernel", {"BLOCK_C": 64}, 1, 3), ("_grad_wy_kernel", {"DESC": True}, 4, 3))
# Kernels whose tiles can come through TMA tensor descriptors (DESC=True; recorded with them off, as
# None): argument -> the constexpr giving the block's width; the block is [1, C, 1, width] of a
# [B, T, H, D] tensor (common.token_descriptors).
DESCRIPTOR_ARGS = {"_grad_wy_kernel": {"dr_desc": "BV", "v_desc": "BV", "dv_desc": "BV", "dw_desc": "BK",
                                       "k_desc": "BK", "dkp_desc": "BK", "dk_desc": "BK"}}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

RECORD = r'''
import importlib, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
os.environ["NATSL_SHORT_CONV_BACKWARD"] = "walk"  # the GPU default (the interpreter's is two passes)
import torch
import torch.nn.functional as F
kernels = json.loads(sys.argv[1])
launches = {}
for module_name, name in kernels:
    module = importlib.import_module(module_name)
    kernel = getattr(module, name)
    class Recorder:
        def __init__(self, kernel, name, module_name):
            self.kernel, self.name, self.module_name = kernel, name, module_name
        def __getitem__(self, grid):
            def launch(*args, **kw):
                types = {}
                for arg_name, a in zip(self.kernel.arg_names, args):
                    types[arg_name] = (str(a.dtype).replace("torch.", "") if isinstance(a, torch.Tensor) else
                                       "none" if a is None else "fp32" if isinstance(a, float) else "i32")
                launches[self.name] = {"module": self.module_name, "types": types, "kw": kw}
                return self.kernel[grid](*args, **kw)
            return launch
    setattr(module, name, Recorder(kernel, name, module_name))
from natsl.fast.gated_delta import config, gated_delta_rule
from natsl.fast import short_conv
config.INTERMEDIATE = "input"
B, T, H, K, V = 1, 64, 1, 192, 384
q, k = (F.normalize(torch.randn(B, T, H, K), dim=-1).bfloat16().requires_grad_() for _ in range(2))
v = torch.randn(B, T, H, V).bfloat16().requires_grad_()
g = F.logsigmoid(torch.randn(B, T, H) + 2).requires_grad_()
beta = torch.sigmoid(torch.randn(B, T, H)).bfloat16().requires_grad_()
o, _ = gated_delta_rule(q, k, v, g, beta, torch.ones(B, 1, H))
o.float().sum().backward()
x = torch.randn(1, 8, 128).bfloat16().requires_grad_()
short_conv.short_conv_silu(x, torch.randn(128, 1, 4)).float().sum().backward()
print(json.dumps(launches, default=str))
'''

# An sm_90 SM: 64K 32-bit registers, 228 KB of shared memory, at most 32 resident blocks.
SM_REGISTERS, SM_SHARED_BYTES, SM_BLOCKS = 65536, 233472, 32
POINTER = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


def record() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", RECORD, json.dumps(KERNELS)], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def resources(launch: dict, name: str, overrides: dict, num_warps: int, num_stages: int) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), name)
    kw = {k: v for k, v in launch["kw"].items() if k not in ("num_warps", "num_stages")}
    kw.update(overrides)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if "maxnreg" in kw:  # a compile option (the register cap per thread), not a constexpr
        options["maxnreg"] = kw.pop("maxnreg")
    signature, constexprs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        kind = launch["types"].get(arg)
        width = DESCRIPTOR_ARGS.get(name, {}).get(arg) if kw.get("DESC") else None
        if width:  # recorded as None (descriptors off): the tensor's dtype is its pointer twin's, x_desc -> x_ptr
            dtype = SHORT_DTYPE[launch["types"][arg.replace("_desc", "_ptr")]]
            signature[arg] = f"tensordesc<{dtype}[1,{kw['C']},1,{kw[width]}]>"
        elif arg in kw or kind == "none":
            signature[arg] = "constexpr"
            constexprs[(i,)] = kw.get(arg)
        else:
            signature[arg] = POINTER.get(kind, kind)
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(item.split(":", 1) for item in next(line for line in usage.splitlines() if "REG:" in line).split()
                  if ":" in item)
    regs, shared = int(fields["REG"]), compiled.metadata.shared
    blocks = min(SM_REGISTERS // max(regs * 32 * num_warps, 1), SM_SHARED_BYTES // shared if shared else SM_BLOCKS,
                 SM_BLOCKS)
    return {"kernel": name, "settings": {**{k: v for k, v in overrides.items()}, "num_warps": num_warps,
                                         "num_stages": num_stages},
            "registers": regs, "stack_bytes": int(fields["STACK"]), "shared_bytes": shared, "blocks_per_sm": blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the table as JSON")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_resources.py compiles for the GPU: unset TRITON_INTERPRET (its recording child sets it itself)")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    launches = record()
    runs = [(name, {"BV": 64} if name in ("_state_fwd_kernel", "_state_bwd_kernel") else {}, None, None) for _, name in KERNELS]
    rows = []
    for name, overrides, warps, stages in runs + list(VARIANTS):
        launch = launches[name]
        row = resources(launch, name, overrides, warps or launch["kw"].get("num_warps", 4),
                        stages or launch["kw"].get("num_stages", 3))
        rows.append(row)
        print(f"{name:24s} {json.dumps(row['settings']):52s} registers {row['registers']:3d}  spill stack "
              f"{row['stack_bytes']:5d} B  shared {row['shared_bytes']:6d} B  blocks/SM {row['blocks_per_sm']}", flush=True)
    if args.out:
        import triton

        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "target": "sm_90", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
