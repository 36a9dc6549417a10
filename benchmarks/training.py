"""Training throughput (tokens/s, MFU, peak memory, energy) of recipes, through the real `natsl train` loop.

    python -m benchmarks.training                      # the five 800M systems, 4096 context, 30 steps
    python -m benchmarks.training --recipes 800m_hybrid 800m_transformer --compile --micro-batch-size 8
    python -m benchmarks.training --recipes 800m_natsl 800m_mamba2 --micro-batch-size 8,auto   # side by side
    python -m benchmarks.training --nproc 8            # each recipe under torchrun on 8 GPUs (DDP)
    python -m benchmarks.training --nproc 2 --parallel fsdp
    python -m benchmarks.training --recipes 800m_hybrid --free-attention    # the bound: attention for free

Each recipe runs in its own process (a fresh CUDA context; an out-of-memory failure is retried with
half the micro-batch, down to 1) on the embedded corpus at the model's vocabulary (built once in
the cache), with `--max-steps` steps of one micro-batch per rank each (set --tokens-per-step for
gradient accumulation), no checkpoint and a one-window evaluation. `--micro-batch-size` takes a
comma list of counts and `auto` (`train.micro_batch_size: auto`, natsl.training.micro_batch): each
recipe runs once per entry, all at the same tokens per step (the largest count's micro-batch per rank,
or 8 sequences, unless --tokens-per-step says), so `8,auto` puts today's fixed micro-batch beside
what auto picks (micro-batch, accumulation, activation checkpointing, the probe's peak and the card's
memory in each result); with `auto` in the list an out-of-memory run is a result, not retried. The first `--warmup-steps`
steps (allocation, autotuning, compilation) are left out of the averages. MFU uses
natsl.training.flops (6 N per token plus attention/GDN terms, measured keep fraction) over the
bf16 peak of the GPU (989 TFLOP/s for H100/H200). Where NVML can tell (nvidia-ml-py; common.GpuMeter),
each result also holds the timed steps' energy per step, mean power and SM clock: the H200 trains at
its power limit, so joules per step are what a step costs. `--in-process` runs the recipes one after
the other in this process instead (no fresh CUDA context each, no out-of-memory retry; for the CPU).
Results: OUT/training.json, .png, and a table on stdout.

`--free-attention` is a bound, not a model: the NAtS-L layers' routed attention is replaced by an op
that outputs zeros and passes no gradient back, so the hybrid trains with every other piece as it is.
Its tokens/s are the most any routed-attention kernel could give the hybrid at that shape; MFU is left
out (the FLOP count includes the skipped work) and the losses are not a NAtS-L model's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import natsl.ops
from benchmarks import common
from benchmarks.common import GpuMeter

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS_800M = ["800m_hybrid", "800m_gdn_hybrid", "800m_transformer", "800m_gdn", "800m_natsl"]


@torch.library.custom_op("natsl_bench::free_attention", mutates_args=())
def free_attention(v: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as the attention's output [B, T, H, Dv] (one write of that size, no reads)."""
    return v.new_zeros(v.shape)


@free_attention.register_fake
def _(v: torch.Tensor) -> torch.Tensor:
    return v.new_empty(v.shape)


# the softmax branch passes nothing back: its q, k, v and keep get no gradient from it
free_attention.register_autograd(lambda ctx, grad: None)


def routed_attention_for_free(q, k, v, keep, **_options):
    """natsl.ops.routed_attention's signature; q, k and keep are not read."""
    return free_attention(v)


def install_free_attention() -> None:
    """From here on every NAtS-L layer's forward runs the free op (the layer looks the function up at each call)."""
    natsl.ops.routed_attention = routed_attention_for_free


def worker(args) -> None:
    """One recipe, in this process (or in each torchrun rank); rank 0 writes the result JSON."""
    from natsl.config import apply_overrides, load_recipe
    from natsl.errors import NatslError
    from natsl.training import TrainOptions, train
    from natsl.training.flops import flops_per_token, peak_flops

    recipe = load_recipe(args.worker)
    if args.free_attention:  # a bound on what the attention kernel can give
        install_free_attention()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = micro_batches(args.micro_batch_size)[0]
    tokens_per_step = args.tokens_per_step or step_sequences([micro]) * args.seq_len * world
    overrides = [f"train.seq_len={args.seq_len}", f"train.tokens_per_step={tokens_per_step}",
                 f"train.micro_batch_size={micro}", "train.save_every=1000000000",
                 "train.eval_every=1000000000", f"train.eval_tokens={args.seq_len}", "train.log_every=1",
                 "train.activation_checkpointing=" + ("true" if args.activation_checkpointing else "auto"),
                 f"train.parallel={args.parallel}", f"train.cuda_graphs={str(args.cuda_graphs).lower()}",
                 f"train.total_tokens={max(recipe.train.total_tokens, tokens_per_step * (args.max_steps + 1))}",
                 "data.path=builtin"]
    recipe = apply_overrides(recipe, overrides)
    rank = int(os.environ.get("RANK", "0"))
    from natsl.provenance import provenance

    result = {"recipe": args.worker, "provenance": provenance(), "micro_batch_size": micro,
              "seq_len": args.seq_len,
              "tokens_per_step": tokens_per_step, "world_size": world, "compile": args.compile,
              "cuda_graphs": args.cuda_graphs,
              "parallel": args.parallel,
              "activation_checkpointing": args.activation_checkpointing,
              "free_attention": args.free_attention}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    step_ends: list[float] = []  # host time at the end of each step (its GPU work done)
    with tempfile.TemporaryDirectory(prefix="natsl-bench-") as out, GpuMeter.for_device(device) as meter:
        if device.type == "cuda" and not meter.available:
            print(f"{args.worker}: no energy meter ({meter.reason}): times only", flush=True)
        try:
            run = train(recipe, TrainOptions(out_dir=out, resume="never", device=args.device, backend=args.backend,
                                             compile=args.compile, max_steps=args.max_steps, save_final=False,
                                             progress=False, log=lambda *_: None,
                                             on_step=lambda record: step_ends.append(time.perf_counter())))
        except torch.cuda.OutOfMemoryError as err:
            result.update(status="oom", error=str(err).splitlines()[0])
        except NatslError as err:  # auto: not even one sequence fits
            result.update(status="refused", error=str(err))
        else:
            steps = [r for r in run.history[args.warmup_steps:] if not r["skipped"]]
            seconds = sum(r["time_s"] for r in steps)
            tps = len(steps) * tokens_per_step / seconds if seconds else float("nan")
            keeps = [v for r in steps for v in r["keep"].values()]
            keep = sum(keeps) / len(keeps) if keeps else 1.0
            fpt = flops_per_token(recipe.model, args.seq_len, keep)
            peak = peak_flops(device)
            result.update(status="ok", steps_timed=len(steps), tokens_per_s=tps,
                          tokens_per_s_per_gpu=tps / world,
                          # the free-attention bound skips work the FLOP count includes: no MFU for it
                          mfu=(tps * fpt / (peak * world)) if peak and not args.free_attention else None,
                          flops_per_token=fpt, keep_fraction=keep, final_loss=run.loss,
                          step_ms=1000 * seconds / max(len(steps), 1),
                          # the mean above is what tokens/s counts; the median and the steps show outliers
                          step_ms_median=1000 * statistics.median(r["time_s"] for r in steps) if steps else None,
                          step_times_ms=[round(1000 * r["time_s"], 2) for r in steps],
                          peak_memory_gib=(torch.cuda.max_memory_allocated(device) / 2**30
                                           if device.type == "cuda" else None),
                          device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          params=None, **micro_batch_record(run))
            # Energy of the timed steps (from the end of the last warm-up step), where NVML can tell: the
            # H200 trains at its power limit, so joules per step are what a step costs (common.GpuMeter)
            timed = len(run.history) - args.warmup_steps
            first = args.warmup_steps - 1
            if timed > 0 and len(step_ends) == len(run.history):
                start = step_ends[first] if first >= 0 else step_ends[0] - run.history[0]["time_s"]
                power = meter.window(start, step_ends[-1])
                if power is not None:
                    result.update(energy_j_per_step=power["energy_j"] / timed,
                                  tokens_per_joule=timed * tokens_per_step / power["energy_j"],
                                  **{k: v for k, v in power.items() if k != "energy_j"})
            from torch._dynamo.utils import counters

            # compiled regions that fell back to plain launches (each also logged with its reason)
            result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
            from natsl.models import build_model

            result["params"] = build_model(recipe, device="meta").num_parameters()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result, indent=2))


def micro_batches(text: str) -> list:
    """`--micro-batch-size`: a comma list of counts and `auto`, e.g. "8,auto" -> [8, "auto"]."""
    entries = []
    for part in str(text).split(","):
        part = part.strip()
        if part == "auto":
            entries.append(part)
        elif part.isdigit() and int(part) >= 1:
            entries.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is neither a micro-batch (1 or more) nor auto")
    if not entries:
        raise argparse.ArgumentTypeError("give a micro-batch, auto, or a comma list of them")
    return entries


def step_sequences(entries: list) -> int:
    """Sequences per rank and step when --tokens-per-step is not given: the largest count, else 8."""
    counts = [m for m in entries if m != "auto"]
    return max(counts) if counts else 8


def micro_batch_record(run) -> dict:
    """What the run trained at: its micro-batch and accumulation, and for auto what the probe measured."""
    record = {"micro_batch": run.micro_batch, "accumulation": run.accumulation}
    choice = run.micro_batch_choice
    if choice is not None:
        record.update(activation_checkpointing=choice.checkpointing, micro_batch_note=choice.note,
                      probe_peak_gib=choice.peak_bytes / 2**30 if choice.peak_bytes is not None else None,
                      usable_memory_gib=choice.limit_bytes / 2**30 if choice.limit_bytes is not None else None,
                      device_memory_gib=choice.total_bytes / 2**30 if choice.total_bytes is not None else None)
    return record


def micro_batch_text(result: dict) -> str:
    """"8", or "auto 4x2" (micro-batch x accumulation, "+ckpt" with activation checkpointing)."""
    asked = result.get("micro_batch_size")
    if asked != "auto":
        return str(asked)
    if result.get("micro_batch") is None:
        return "auto"
    ckpt = "+ckpt" if result.get("activation_checkpointing") else ""
    return f"auto {result['micro_batch']}x{result['accumulation']}{ckpt}"


def run_one(recipe: str, mbs, args, result_path: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.training", "--worker", recipe, "--result", str(result_path),
           "--micro-batch-size", str(mbs), "--seq-len", str(args.seq_len), "--max-steps", str(args.max_steps),
           "--warmup-steps", str(args.warmup_steps)]
    for flag in ("device", "backend", "tokens_per_step"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--compile"] if args.compile else []
    cmd += ["--cuda-graphs"] if args.cuda_graphs else []
    cmd += ["--parallel", args.parallel]
    cmd += ["--activation-checkpointing"] if args.activation_checkpointing else []
    cmd += ["--free-attention"] if args.free_attention else []
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "--module", *cmd[2:]]
    result_path.unlink(missing_ok=True)
    code = run_child(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if result_path.is_file():
        return json.loads(result_path.read_text())
    return {"recipe": recipe, "micro_batch_size": mbs, "status": "failed", "error": f"exit code {code}"}


def run_child(cmd: list[str], **popen_kwargs) -> int:
    """Run `cmd` (a worker, or torchrun and its ranks) in a process group of its own and wait for it;
    a SIGTERM or SIGINT to this script ends the whole group first. Without this, `timeout` around
    the benchmark kills only this script, and the workers keep the GPU and the output pipe open."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    stopped_by = []

    def kill_group(sig):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def stop(signum, frame):
        # Only signal here: the interrupted proc.wait() below holds Popen's wait lock.
        stopped_by.append(signum)
        kill_group(signal.SIGTERM)
        # for a worker that ignores SIGTERM (one compiling can take longer to stop); well before `timeout -k 10`
        # (benchmarks/gpu.sh) kills this script, after which nothing would kill the group
        timer = threading.Timer(3.0, kill_group, (signal.SIGKILL,))
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped_by:
        raise SystemExit(128 + stopped_by[0])
    return code


def label(result: dict) -> str:
    """The recipe, marked where the run was the free-attention bound rather than the model."""
    return result["recipe"] + (" (free attn)" if result.get("free_attention") else "")


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    several = len({micro_batch_text(r) for r in ok}) > 1
    names = [label(r) + (f"\nmbs {micro_batch_text(r)}" if several else "") for r in ok]
    axes[0].bar(names, [r["tokens_per_s"] / 1e3 for r in ok])
    axes[0].set_ylabel("thousand tokens / s")
    axes[1].bar(names, [100 * (r["mfu"] or 0) for r in ok])
    axes[1].set_ylabel("MFU (%)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(axis="y", alpha=0.3)
    first = ok[0]
    fig.suptitle(f"training throughput, {first['seq_len']} context, {first['world_size']} x {first.get('device')}")
    fig.tight_layout()
    from natsl.atomic import save_figure

    save_figure(fig, png)


def build_parser() -> argparse.ArgumentParser:
    """The script's options; the worker reads the same namespace (tests build theirs through this too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=SYSTEMS_800M)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", "--micro-batch", default="8",
                        help="a micro-batch, auto, or a comma list of them run side by side (e.g. 8,auto)")
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="default: one micro-batch per rank (no accumulation)")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs per recipe (torchrun)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true", help="with --compile: train.cuda_graphs")
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp", help="with --nproc > 1")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="always (default: auto, on only where auto finds that one sequence does not fit)")
    parser.add_argument("--free-attention", action="store_true",
                        help="a bound: the NAtS-L layers' routed attention costs nothing (see above)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the recipes one after the other in this process (no out-of-memory retry)")
    common.add_out_argument(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def run_in_process(recipe: str, args, result_path: Path) -> dict:
    """One recipe through `worker` in this process (the same result a worker process writes)."""
    result_path.unlink(missing_ok=True)
    worker(argparse.Namespace(**{**vars(args), "worker": recipe, "result": str(result_path)}))
    return json.loads(result_path.read_text())


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.warmup_steps >= args.max_steps:
        parser.error("--warmup-steps must be below --max-steps")
    if args.cuda_graphs and not args.compile:
        parser.error("--cuda-graphs replays the compiled model: add --compile")
    try:
        entries = micro_batches(args.micro_batch_size)
    except argparse.ArgumentTypeError as err:
        parser.error(f"--micro-batch-size: {err}")
    if args.tokens_per_step is None:  # every entry at the same step: a side-by-side compares like with like
        args.tokens_per_step = step_sequences(entries) * args.seq_len * args.nproc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for recipe in args.recipes:
        for first in entries:
            mbs = first
            while True:
                print(f"== {recipe}: micro-batch {mbs} x {args.seq_len}, {args.tokens_per_step:,} tokens per step, "
                      f"{args.max_steps} steps", flush=True)
                where = out / f".{Path(recipe).stem}.json"
                result = run_in_process(recipe, argparse.Namespace(**{**vars(args), "micro_batch_size": str(mbs)}),
                                        where) if args.in_process else run_one(recipe, mbs, args, where)
                if result.get("status") != "oom" or mbs == "auto" or mbs == 1 or "auto" in entries \
                        or args.in_process:
                    break
                mbs //= 2
                print(f"   out of memory; retrying with micro-batch {mbs}", flush=True)
            results.append(result)
            common.write_result("training", {"results": results}, out)  # rewritten after each run
    plot(results, out / "training.png")
    print(f"\n{'recipe':<20} {'params':>8} {'mbs':>12} {'tok/s':>10} {'tok/s/GPU':>10} {'MFU':>7} {'keep':>5} "
          f"{'step ms':>8} {'median':>7} {'mem GiB':>8} {'J/step':>7} {'W':>5} {'SM MHz':>6}")
    for r in results:
        if r.get("status") != "ok":
            print(f"{label(r):<20} {'':>8} {micro_batch_text(r):>12} {r.get('status')}: {r.get('error', '')}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
        median = f"{r['step_ms_median']:.0f}" if r.get("step_ms_median") is not None else "n/a"
        energy = (f"{r['energy_j_per_step']:>7.1f} {r['power_w_mean']:>5.0f} {r['sm_clock_mhz_median']:>6.0f}"
                  if r.get("energy_j_per_step") is not None else f"{'n/a':>7} {'n/a':>5} {'n/a':>6}")
        print(f"{label(r):<20} {r['params'] / 1e6:>7.1f}M {micro_batch_text(r):>12} {r['tokens_per_s']:>10,.0f} "
              f"{r['tokens_per_s_per_gpu']:>10,.0f} {mfu:>7} {r['keep_fraction']:>5.2f} {r['step_ms']:>8.0f} "
              f"{median:>7} {mem:>8} {energy}")
    print(f"\nwrote {out / 'training.json'} and {out / 'training.png'}")


if __name__ == "__main__":
    main()
