"""Where a training step's or an inference call's time goes: torch.profiler tables, matmul shapes, launches.

    python -m benchmarks.profile --recipe 800m_hybrid --batch 8 --compile --optimizer --phases --matmul-shapes
    python -m benchmarks.profile --recipe 800m_hybrid --inference prefill --seq-len 131072 --keep 0.5
    python -m benchmarks.profile --recipe 800m_gdn --inference decode --seq-len 32768

--inference prefill|decode profiles instead one prefill of --seq-len tokens (random weights, the NAtS-L
routes forced to --keep, as `natsl bench-latency`) or one CUDA-graph decode step after such a prefill
(steps averaged over --repeats): kernel time by kind, the top kernels, kernels per call and the host's
kernel launches per call (fewer launches than kernels: a graph replay).

Training (the default):

bf16 autocast and the chunked LM loss as in `natsl train`; with --optimizer also the rest of a
training step as `natsl train` runs it: gradient clipping, the host reading the loss and gradient
norm (its finite check, which waits for the GPU), the fused AdamW step; on CUDA by default (NATSL_FOLD_CLIP=0
turns it off), clipping and the check inside the fused step, as natsl train does. Prints the step's
median time over a few repeats and the kernels that take the most GPU time, grouped by name; with
--out, writes the table as JSON. The layers' pointwise pieces are compiled unless
NATSL_COMPILE_POINTWISE=0 (natsl.models.pointwise), so running both shows what compiling buys;
--compile compiles the whole model's hidden states as `natsl train --compile` does. Kernel time is
also summed by kind (matmuls, the two fast ops, SDPA, Inductor-fused, other). On the GPU it also
reports where the GPU sat idle inside the profiled step: the gaps between consecutive kernels longer
than 20 us (the host not keeping up, or waiting for the GPU), with the kernels on either side.
--phases times steps with host clocks and CUDA events at the ends of the forward, backward and
optimizer launches (is the host ahead of the GPU?); --host-head profiles one step with host activity
and reports how long the host took to its first kernel launch and what it did before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common
from natsl import switches
from natsl.config import load_recipe
from natsl.models import build_model
from natsl.training.loss import linear_cross_entropy
from natsl.training.optim import build_optimizer, clip_and_step, fold_clip_requested, no_decay_names
from natsl.training.trainer import HiddenStates

# the gated-delta kernels and the gated linear rule's own (Mamba2's SSD), which shares most of them
GDN_KERNELS = ("_prepare_kernel", "_state_fwd_kernel", "_output_kernel", "_local_dr_kernel", "_state_bwd_kernel",
               "_grad_qk_kernel", "_grad_wy_kernel", "_chunk_cumsum_kernel")
ROUTED_KERNELS = ("_forward_kernel", "_dq_kernel", "_dkdv_kernel", "_row_delta_kernel", "_block_lists_kernel")
# Kernel names as the profiler reports them (matched as text, never imported)
SHORT_CONV_KERNELS = ("_conv_fwd_kernel", "_conv_bwd_kernel", "_conv_dx_kernel", "_conv_bwd_walk_kernel",
                      "_dw_sum_kernel")
MIX_KERNELS = ("_mix_fwd_kernel", "_mix_bwd_kernel")  # natsl.fast.mix, the NAtS-L read


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel from its name, for the by-kind summary."""
    if any(k in name for k in GDN_KERNELS):
        return "GDN / SSD state kernels"
    if any(k in name for k in ROUTED_KERNELS):
        return "routed attention kernels"
    if any(k in name for k in SHORT_CONV_KERNELS):
        return "short conv kernels"
    if any(k in name for k in MIX_KERNELS):
        return "NAtS-L read (mix) kernels"
    lowered = name.lower()
    if any(k in lowered for k in ("flash", "fmha", "cudnn", "attention")):
        return "SDPA attention"
    if any(k in lowered for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")):
        return "matmuls"
    if name.startswith("triton_"):
        return "Inductor-fused"
    if "multi_tensor_apply" in name or "lpnorm" in lowered:  # fused AdamW and the clipping norm (--optimizer)
        return "optimizer and clipping (multi-tensor kernels)"
    return "other (PyTorch elementwise, copies, reductions)"


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


def product_dims(shapes: list) -> tuple | None:
    """(batch, M, K, N) of a matmul op from its recorded input shapes: the first two operands that chain
    ([.., M, K] then [.., K, N]); None where none do (e.g. shapes not recorded)."""
    operands = [tuple(s) for s in shapes if isinstance(s, (list, tuple)) and len(s) in (2, 3)]
    for a, b in zip(operands, operands[1:]):
        if len(a) == len(b) and a[-1] == b[-2] and a[:-2] == b[:-2]:
            return (a[0] if len(a) == 3 else 1, a[-2], a[-1], b[-1])
    return None


def matmul_shapes(events, cuda: bool) -> list[dict]:
    """Matmul time grouped by (M, K, N, kernel): which products run below the others' TFLOP/s. Needs a
    profile with record_shapes and CPU activity, so that each kernel hangs under the op that launched it."""
    groups: dict = {}
    for event in events:
        if event.name not in MATMUL_OPS:
            continue
        dims = product_dims(event.input_shapes)
        if dims is None:
            continue
        kernels = list(getattr(event, "kernels", [])) if cuda else []
        us = sum(k.duration for k in kernels) if cuda else event.self_cpu_time_total
        kernel = max(kernels, key=lambda k: k.duration).name[:70] if kernels else event.name
        row = groups.setdefault((*dims, kernel), {"batch": dims[0], "m": dims[1], "k": dims[2], "n": dims[3],
                                                  "kernel": kernel, "calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += us / 1e3
    rows = sorted(groups.values(), key=lambda r: -r["ms"])
    for r in rows:
        r["gflop"] = 2 * r["batch"] * r["m"] * r["k"] * r["n"] * r["calls"] / 1e9
        r["tflops"] = r["gflop"] / r["ms"] if r["ms"] > 0 else None
    return rows


def trace_events(prof) -> list:
    """The chrome-trace events of a finished torch.profiler run."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return json.loads(Path(f.name).read_text())["traceEvents"]


def idle_gaps(events: list, min_us: float = 20.0) -> dict:
    """The GPU's idle time between the first and last kernel of a profiled CUDA timeline (trace events):
    gaps between consecutive kernels (by start time) longer than `min_us`, largest first, with their
    neighbours."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    if not kernels:
        return {"span_ms": 0.0, "idle_ms": 0.0, "kernels": 0, "gaps": [], "n_gaps": 0}
    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for prev, e in zip(kernels, kernels[1:]):
        if e["ts"] - end > min_us:
            gaps.append({"us": e["ts"] - end, "at_ms": (end - kernels[0]["ts"]) / 1e3,
                         "after": prev["name"][:60], "before": e["name"][:60]})
        end = max(end, e["ts"] + e["dur"])
    gaps.sort(key=lambda g: -g["us"])
    return {"span_ms": (end - kernels[0]["ts"]) / 1e3, "idle_ms": sum(g["us"] for g in gaps) / 1e3,
            "kernels": len(kernels), "gaps": gaps[:40], "n_gaps": len(gaps)}


STEP_MARK = "natsl training step"


def host_head(events: list, top: int = 15) -> dict:
    """From a trace with CPU and CUDA activity of one step marked STEP_MARK: how long the host took from
    the step's start to its first kernel launch, when that kernel ran, and the host ranges and ops that
    began before the launch (longest first)."""
    marks = [e for e in events if e.get("name") == STEP_MARK and "dur" in e]
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and "aunch" in e.get("name", "")),
                      key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not (marks and launches and kernels):
        return {}
    start, launch = marks[0]["ts"], launches[0]["ts"]
    before = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op", "python_function")
              and start <= e["ts"] < launch and "dur" in e and e.get("name") != STEP_MARK]
    before.sort(key=lambda e: -e["dur"])
    return {"host_to_first_launch_ms": (launch - start) / 1e3, "first_kernel_ms": (kernels[0]["ts"] - start) / 1e3,
            "first_kernel": kernels[0]["name"][:80],
            "before_first_launch": [{"name": e["name"][:80], "cat": e["cat"], "ms": e["dur"] / 1e3,
                                     "at_ms": (e["ts"] - start) / 1e3} for e in before[:top]]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="800m_hybrid")
    parser.add_argument("--inference", choices=["prefill", "decode"], default=None,
                        help="profile an inference call instead of a training step")
    parser.add_argument("--keep", type=float, default=0.5, help="with --inference: the NAtS-L layers' forced keep fraction")
    parser.add_argument("--batch", type=int, default=None, help="default: 8 for training, 1 for inference")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 4096 for training, 32768 for inference")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a smoke run")
    common.add_out_argument(parser)
    parser.add_argument("--compile", action="store_true", help="torch.compile the whole model (as natsl train --compile)")
    parser.add_argument("--optimizer", action="store_true",
                        help="also clip, read the loss and norm on the host and take the AdamW step, as natsl train")
    parser.add_argument("--compare-fold", action="store_true",
                        help="with --optimizer: time whole steps with the clip folded into the fused AdamW step "
                             "(NATSL_FOLD_CLIP=1) and without, interleaved in this one process, before the profile")
    parser.add_argument("--host-head", action="store_true",
                        help="also profile one step with host activity: the host's time from the step's start "
                             "to its first kernel launch, and what it did before it")
    parser.add_argument("--matmul-shapes", action="store_true",
                        help="also profile one step with shapes recorded and sum matmul time by (M, K, N, kernel)")
    parser.add_argument("--phases", action="store_true",
                        help="also time steps with host clocks and CUDA events at the ends of the forward, the "
                             "backward and the optimizer step (where the wall time beyond the kernels goes)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare_fold and not args.optimizer:
        parser.error("--compare-fold needs --optimizer")
    inference = args.inference is not None
    args.batch = args.batch or (1 if inference else 8)
    args.seq_len = args.seq_len or (32768 if inference else 4096)
    if inference:
        profile_inference(args)
    else:
        profile_training(args)


def profile_training(args) -> None:
    """A training step of a recipe's model (see the module's docstring)."""

    recipe = load_recipe(args.recipe)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = build_model(recipe, device=device)
    model.set_backend("fast" if cuda else "chunked")
    ids = torch.randint(0, recipe.model.vocab_size, (args.batch, args.seq_len + 1), device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    body = torch.compile(HiddenStates(model)) if args.compile else HiddenStates(model)
    fold = args.optimizer and fold_clip_requested(device)  # as natsl train
    optimizer = (build_optimizer(model, recipe.optim, device, no_decay_names(model), False,
                                 fused=True if fold or args.compare_fold else None)
                 if args.optimizer else None)

    def step(fold=fold, mark=lambda: None):
        """One training step; `mark` is called after the forward, the backward, the optimizer's launch and
        the host's read of the values (phase_ms's clocks)."""
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            hidden = body(ids[:, :-1], model.rope_table(args.seq_len, device))  # as natsl train
            loss = linear_cross_entropy(hidden, model.lm_head.weight, ids[:, 1:])
        mark()
        loss.backward()
        mark()
        norm = None
        if optimizer is not None:  # as Trainer.optimizer_step, then its read of the values
            norm = clip_and_step(optimizer, model.parameters(), recipe.optim.grad_clip, loss, fold)
        mark()
        if norm is not None:
            float(norm)
            loss.item()
        mark()
        model.zero_grad(set_to_none=True)

    def timed_ms(**kw) -> float:
        sync()
        start = time.perf_counter()
        step(**kw)
        sync()
        return 1000 * (time.perf_counter() - start)

    def phase_ms() -> dict:
        """One step with host clocks and CUDA events at its phase ends: where the wall time goes."""
        host, events = [], []

        def mark():
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
            host.append(time.perf_counter())

        sync()
        mark()
        step(mark=mark)
        sync()
        host.append(time.perf_counter())
        gpu = [events[0].elapsed_time(e) for e in events[1:4]]
        return {"wall": 1000 * (host[-1] - host[0]), "gpu_to_optimizer_end": gpu[2],
                "host_forward_launch": 1000 * (host[1] - host[0]), "host_backward_launch": 1000 * (host[2] - host[1]),
                "host_optimizer_launch": 1000 * (host[3] - host[2]), "host_wait": 1000 * (host[4] - host[3]),
                "host_tail": 1000 * (host[5] - host[4]), "gpu_forward": gpu[0], "gpu_backward": gpu[1] - gpu[0],
                "gpu_optimizer": gpu[2] - gpu[1]}

    step()  # compile, autotune, allocate
    step()  # a second pass: the compiled backward's first call lands here
    step_ms = statistics.median(timed_ms() for _ in range(args.repeats))
    phases = None
    if args.phases and cuda:
        runs = [phase_ms() for _ in range(args.repeats)]
        phases = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print("phases of a step, median of", args.repeats, "(ms): " +
              ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    tokens = args.batch * args.seq_len
    fold_ms = None
    if args.compare_fold:  # both ways on one compiled model and one fused AdamW, interleaved
        runs: dict = {False: [], True: []}
        step(True)
        for _ in range(args.repeats):
            for way in (False, True):
                runs[way].append(timed_ms(fold=way))
        fold_ms = {"clip then step": statistics.median(runs[False]), "folded": statistics.median(runs[True]),
                   "runs": {str(k): v for k, v in runs.items()}}
        print(f"whole step, median of {args.repeats} interleaved: clip then step {fold_ms['clip then step']:.1f} ms, "
              f"folded into the fused AdamW step {fold_ms['folded']:.1f} ms")
    print(f"{args.recipe} B={args.batch} T={args.seq_len} compile_pointwise="
          f"{switches.current().compile_pointwise} compile={args.compile}: "
          f"{'step' if args.optimizer else 'fwd+bwd'} {step_ms:.1f} ms, {tokens / step_ms * 1e3:,.0f} tok/s")

    head = None
    if args.host_head and cuda:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as host_prof:
            sync()
            with torch.profiler.record_function(STEP_MARK):
                step()
            sync()
        head = host_head(trace_events(host_prof))
        if head:
            print(f"host head (profiled with host activity): first launch {head['host_to_first_launch_ms']:.2f} ms "
                  f"after the step's start, first kernel at {head['first_kernel_ms']:.2f} ms ({head['first_kernel']})")
            for e in head["before_first_launch"]:
                print(f"  {e['ms']:8.3f} ms at {e['at_ms']:7.3f} ms  {e['cat']:15s} {e['name']}")

    products = None
    if args.matmul_shapes:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities, record_shapes=True) as shape_prof:
            step()
            sync()
        products = matmul_shapes(shape_prof.events(), cuda)
        total_ms, total_gflop = sum(r["ms"] for r in products), sum(r["gflop"] for r in products)
        print(f"matmuls by shape: {total_ms:.1f} ms, {total_gflop / 1e3:.1f} TFLOP, "
              f"{total_gflop / max(total_ms, 1e-9):.0f} TFLOP/s overall")
        print("      ms  calls   TFLOP/s  batch x M x K x N  kernel")
        for r in products[:args.top]:
            dims = f"{r['batch']} x {r['m']} x {r['k']} x {r['n']}"
            print(f"{r['ms']:8.2f} {r['calls']:6d} {r['tflops'] or 0:9.1f}  {dims}  {r['kernel']}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda
                                                else torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        sync()
    kernels = kernel_table(prof, cuda, args.top)
    gaps = idle_gaps(trace_events(prof)) if cuda else None
    if gaps:
        print(f"GPU timeline of the profiled step: {gaps['span_ms']:.1f} ms from first to last kernel "
              f"({gaps['kernels']} kernels), idle {gaps['idle_ms']:.1f} ms in {gaps['n_gaps']} gaps > 20 us")
        for g in gaps["gaps"][:12]:
            print(f"  {g['us'] / 1e3:7.2f} ms idle at {g['at_ms']:7.1f} ms: after {g['after']} / before {g['before']}")
    path = common.write_result(f"profile_train_{Path(args.recipe).stem}", {
        "recipe": args.recipe, "batch": args.batch, "seq_len": args.seq_len, "compile": args.compile,
        "optimizer": args.optimizer, "step_ms": step_ms, **kernels, "idle": gaps, "fold_compare_ms": fold_ms,
        "phases_ms": phases, "host_head": head, "matmul_shapes": products}, args.out)
    print(f"wrote {path}")


def kernel_table(prof, cuda: bool, top: int, calls: int = 1) -> dict:
    """Kernel time per call (device time on CUDA, host time of each op elsewhere) of a finished profile
    over `calls` calls: by kind and by kernel, printed and returned; host launches counted on CUDA."""
    rows, launches = [], 0
    for event in prof.key_averages():
        us = event.device_time_total if cuda else event.self_cpu_time_total
        if cuda and "aunch" in event.key and event.key.startswith("cu"):  # cudaLaunchKernel, cuLaunchKernelEx, ...
            launches += event.count
        if us > 0 and not (cuda and event.device_type != torch.autograd.DeviceType.CUDA):
            rows.append({"kernel": event.key[:90], "calls": event.count / calls, "ms": us / 1e3 / calls})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    print(f"kernel time per call: {total:.2f} ms, {sum(r['calls'] for r in rows):.0f} kernels"
          + (f", {launches / calls:.0f} host launches" if cuda else ""))
    kinds: dict = {}
    for r in rows:
        kind = kernel_kind(r["kernel"])
        kinds[kind] = kinds.get(kind, 0.0) + r["ms"]
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{ms:8.2f} ms {100 * ms / max(total, 1e-9):5.1f}%  {kind}")
    for r in rows[:top]:
        print(f"{r['ms']:8.3f} ms {100 * r['ms'] / max(total, 1e-9):5.1f}% {r['calls']:7.1f}x  {r['kernel']}")
    return {"kernel_ms_total": total, "kinds_ms": kinds, "kernels": rows,
            "kernels_per_call": sum(r["calls"] for r in rows), "host_launches_per_call": launches / calls if cuda else None}


def profile_inference(args) -> None:
    """One prefill, or one CUDA-graph decode step after a prefill, of a recipe's model (random weights)."""
    from natsl.inference import bench
    from natsl.inference.decode import DecodeRunner

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, name, _ = bench.load_model(bench.BenchModel("recipe", args.recipe, args.keep), device,
                                      torch.bfloat16 if cuda else torch.float32, "fast" if cuda else "chunked", 0)
    steps = args.repeats if args.inference == "decode" else 1
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + steps + 8), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        cache = model.new_cache(args.batch, max_len=args.seq_len + steps + 8)
        if args.inference == "prefill":
            model.forward_cached(ids[:, :args.seq_len // 2], cache, last_only=True)  # compile and allocate first
            cache = model.new_cache(args.batch, max_len=args.seq_len + 8)
            sync()
            start = time.perf_counter()
            with torch.profiler.profile(activities=activities) as prof:
                model.forward_cached(ids[:, :args.seq_len], cache, last_only=True)
                sync()
            wall_ms = 1000 * (time.perf_counter() - start)
        else:
            model.forward_cached(ids[:, :args.seq_len], cache, last_only=True)
            runner = DecodeRunner(model, cache, cuda_graphs=cuda)
            t = args.seq_len
            for _ in range(3):  # the eager step and the capture, then replays
                runner.step(ids[:, t])
                t += 1
            sync()
            start = time.perf_counter()
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    runner.step(ids[:, t])
                    t += 1
                sync()
            wall_ms = 1000 * (time.perf_counter() - start) / steps
    print(f"{name} {args.inference} at {args.seq_len} (keep {args.keep}): {wall_ms:.2f} ms per call under the profiler")
    kernels = kernel_table(prof, cuda, args.top, steps)
    path = common.write_result(f"profile_{args.inference}_{Path(args.recipe).stem}", {
        "recipe": args.recipe, "inference": args.inference, "batch": args.batch, "seq_len": args.seq_len,
        "keep": args.keep, "profiled_wall_ms": wall_ms, **kernels}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
