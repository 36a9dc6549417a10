"""The benchmark scripts' own plumbing (their measurements run on the GPU, not here)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0) until reaped: read its state where /proc exists.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_bench_training_ends_its_workers_when_it_is_terminated(tmp_path):
    """`timeout` around bench_training sends SIGTERM to the script only: its workers (and their
    own children, as under torchrun) must end with it instead of holding the GPU and the pipe."""
    pid_file = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        import bench_training
        worker = ("import os, subprocess, sys, time; "
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                  "open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(120)")
        sys.exit(bench_training.run_child([sys.executable, "-c", worker]))
    """)
    script = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while not (pid_file.is_file() and len(pid_file.read_text().split()) == 2):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    pids = [int(p) for p in pid_file.read_text().split()]
    assert all(_alive(p) for p in pids)
    script.send_signal(signal.SIGTERM)
    assert script.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker outlived the terminated benchmark"


def _bench_module(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_idle_gaps_are_the_gpu_timeline_holes_between_kernels(tmp_path):
    """profile_training_step's idle report: gaps over 20 us between one kernel's end (the latest end
    so far, kernels may overlap) and the next start, largest first, CPU events ignored."""
    import json

    profile_training_step = _bench_module("profile_training_step")

    class Trace:
        def export_chrome_trace(self, path):
            events = [{"cat": "kernel", "name": "a", "ts": 0, "dur": 100},
                      {"cat": "kernel", "name": "b", "ts": 50, "dur": 10},  # inside a: no gap after it
                      {"cat": "kernel", "name": "c", "ts": 130, "dur": 10},  # 30 us after a ends
                      {"cat": "kernel", "name": "d", "ts": 150, "dur": 10},  # 10 us: under the threshold
                      {"cat": "kernel", "name": "e", "ts": 260, "dur": 40},  # 100 us
                      {"cat": "cpu_op", "name": "x", "ts": 0, "dur": 300}]
            Path(path).write_text(json.dumps({"traceEvents": events}))

    gaps = profile_training_step.idle_gaps(Trace())
    assert gaps["n_gaps"] == 2 and gaps["kernels"] == 5
    assert [(g["us"], g["after"], g["before"]) for g in gaps["gaps"]] == [(100, "d", "e"), (30, "b", "c")]
    assert gaps["idle_ms"] == 0.13 and gaps["span_ms"] == 0.3

    class NoKernels:
        def export_chrome_trace(self, path):
            Path(path).write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 5}]}))

    assert profile_training_step.idle_gaps(NoKernels()) == {"span_ms": 0.0, "idle_ms": 0.0, "kernels": 0, "gaps": [],
                                                            "n_gaps": 0}


def test_host_head_is_the_host_time_before_the_first_launch():
    """profile_training_step --host-head: from the step's mark to the first kernel launch, the first
    kernel's start, and the host ranges and ops begun in between (longest first, the mark itself and
    later ones left out)."""
    profile_training_step = _bench_module("profile_training_step")
    mark = profile_training_step.STEP_MARK
    events = [{"cat": "user_annotation", "name": mark, "ts": 1000, "dur": 9000},
              {"cat": "user_annotation", "name": "Torch-Compiled Region", "ts": 1100, "dur": 8000},
              {"cat": "cpu_op", "name": "aten::empty", "ts": 1200, "dur": 30},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 4000, "dur": 5},
              {"cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": 3000, "dur": 5},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 3500, "dur": 50},  # after the first launch
              {"cat": "kernel", "name": "first", "ts": 3200, "dur": 10},
              {"cat": "kernel", "name": "second", "ts": 4100, "dur": 10}]
    head = profile_training_step.host_head(events)
    assert head["host_to_first_launch_ms"] == 2.0 and head["first_kernel_ms"] == 2.2 and head["first_kernel"] == "first"
    assert [(e["name"], e["ms"], e["at_ms"]) for e in head["before_first_launch"]] == [
        ("Torch-Compiled Region", 8.0, 0.1), ("aten::empty", 0.03, 0.2)]
    assert profile_training_step.host_head(events[1:]) == {}  # no step mark


def test_matmul_shapes_sum_each_product_and_its_rate():
    """profile_training_step --matmul-shapes: kernels summed under the (M, K, N, kernel) of the op that
    launched them, with the products' TFLOP/s; ops whose operands do not chain are left out."""
    from types import SimpleNamespace as Event

    profile_training_step = _bench_module("profile_training_step")
    assert profile_training_step.product_dims([[32768, 1536], [1536, 4608]]) == (1, 32768, 1536, 4608)
    assert profile_training_step.product_dims([[4608], [32768, 1536], [1536, 4608], [], []]) == (1, 32768, 1536, 4608)
    assert profile_training_step.product_dims([[8, 64, 32], [8, 32, 16]]) == (8, 64, 32, 16)
    assert profile_training_step.product_dims([[3, 4], [5, 6]]) is None

    def kernel(name, us):
        return Event(name=name, duration=us)

    events = [Event(name="aten::mm", input_shapes=[[1000, 2000], [2000, 500]], kernels=[kernel("nvjet_a", 100.0)]),
              Event(name="aten::mm", input_shapes=[[1000, 2000], [2000, 500]], kernels=[kernel("nvjet_a", 300.0)]),
              Event(name="aten::addmm", input_shapes=[[500], [1000, 2000], [2000, 500], [], []],
                    kernels=[kernel("splitK", 150.0), kernel("reduce", 10.0)]),
              Event(name="aten::add", input_shapes=[[1000, 2000], [1000, 2000]], kernels=[kernel("add", 50.0)]),
              Event(name="aten::mm", input_shapes=[], kernels=[kernel("nvjet_b", 70.0)])]
    rows = profile_training_step.matmul_shapes(events, cuda=True)
    assert [(r["kernel"], r["calls"], round(r["ms"], 3)) for r in rows] == [("nvjet_a", 2, 0.4), ("splitK", 1, 0.16)]
    assert rows[0]["gflop"] == 2 * 2 * 1000 * 2000 * 500 / 1e9 and rows[0]["tflops"] == rows[0]["gflop"] / 0.4


def test_kernel_resources_compiles_the_fast_kernels_for_hopper_on_a_cpu(tmp_path):
    """benchmarks/kernel_resources.py: the launches recorded from an interpreted run, each compiled for
    sm_90 with a resource line read back (registers within the hardware's 1..255). A process of its
    own: the tests run the kernels under TRITON_INTERPRET, which the compiling side must not."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), "--out", str(out)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    kernel_resources = _bench_module("kernel_resources")
    assert {name for _, name in kernel_resources.KERNELS} <= {r["kernel"] for r in rows}
    assert all(0 < r["registers"] <= 255 and r["stack_bytes"] >= 0 and r["blocks_per_sm"] >= 1 for r in rows)
    assert "_conv_bwd_walk_kernel" in result.stdout


def test_compare_gdn_revisions_refuses_a_baseline_it_cannot_compare(tmp_path):
    """The revision comparison loads the baseline's kernel files beside this tree's common.py: a
    folder without them, or with another common.py, is refused with a one-line reason."""
    script = [sys.executable, str(ROOT / "benchmarks" / "compare_gdn_revisions.py"), "--baseline", str(tmp_path)]
    empty = subprocess.run(script, capture_output=True, text=True)
    assert empty.returncode == 1
    assert "has no common.py, grad_qk.py, grad_wy.py" in empty.stderr and "Traceback" not in empty.stderr
    package = ROOT / "natsl" / "fast" / "gated_delta"
    for name in ("common", "grad_qk", "grad_wy"):
        (tmp_path / f"{name}.py").write_text((package / f"{name}.py").read_text())
    (tmp_path / "common.py").write_text((package / "common.py").read_text() + "# another revision\n")
    other = subprocess.run(script, capture_output=True, text=True)
    assert other.returncode == 1
    assert "common.py differs" in other.stderr and "Traceback" not in other.stderr


def test_compare_gdn_revisions_reads_shapes_settings_and_partial_sums():
    """--shapes and --variants parse to (B, T) pairs and typed config overrides; outputs whose
    per-tile partials differ in count along dim 0 are compared as their sums."""
    import torch

    compare = _bench_module("compare_gdn_revisions")
    assert compare.parse_shapes("8x4096,1x32768") == ((8, 4096), (1, 32768))
    assert compare.parse_overrides("DOR_PASS=separate,num_warps=8,descriptors=true") == {
        "DOR_PASS": "separate", "num_warps": 8, "descriptors": True}
    parts = torch.arange(24.0).view(3, 2, 4)
    a, b = compare.comparable(parts.sum(0, keepdim=True), parts)
    assert torch.equal(a, b)
    same_shape = compare.comparable(torch.ones(2, 4), torch.full((2, 4), 2.0))
    assert torch.equal(same_shape[0], torch.ones(2, 4)) and torch.equal(same_shape[1], torch.full((2, 4), 2.0))


def test_bench_joined_product_pads_like_the_model_and_needs_a_gpu():
    """The product benchmark pads output widths as natsl.models.linear does, and without CUDA says so
    in one line instead of a traceback."""
    from natsl.models.linear import ALIGN_ROWS

    bench = _bench_module("bench_joined_product")
    assert bench.ALIGN == ALIGN_ROWS
    assert [bench.padded(w) for w in (4608, 12, 2304, 36)] == [4608, 16, 2304, 40]
    import torch

    if torch.cuda.is_available():
        return
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_joined_product.py")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "CUDA" in result.stderr and "Traceback" not in result.stderr


def test_energy_blocks_adds_up_each_recipes_stack_on_a_cpu(tmp_path):
    """benchmarks/energy_blocks.py as a CPU smoke run: one block of each of the tiny hybrid's kinds timed
    forward + backward, and the recipe's stack the layer counts times them; no meter off CUDA, so no joules."""
    import json

    out = tmp_path / "blocks.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "energy_blocks.py"), "--recipes", "tiny_hybrid",
                             "--batch", "1", "--seq-len", "70", "--device", "cpu", "--backend", "chunked",
                             "--no-compile", "--rounds", "1", "--seconds", "0.05", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    blocks = {b["layer_type"]: b for b in data["blocks"]}
    assert set(blocks) == {"gdn", "natsl"} and all(b["ms"] > 0 and b["j"] is None for b in blocks.values())
    (stack,) = data["stacks"]
    assert stack["layers"] == {"gdn": 2, "natsl": 2} and stack["j"] is None
    assert stack["ms"] == 2 * blocks["gdn"]["ms"] + 2 * blocks["natsl"]["ms"]


def test_free_attention_outputs_zeros_and_leaves_the_rest_of_the_hybrid_training(monkeypatch):
    """The bound of `bench_training.py --free-attention`: the NAtS-L layers' softmax branch gives zeros
    and no gradient, the GDN branch and the read still train, and the op passes torch's op checks."""
    import torch

    import natsl.ops
    from natsl.config import load_recipe
    from natsl.models import build_model

    free_attention = _bench_module("free_attention")
    monkeypatch.setattr(natsl.ops, "routed_attention", natsl.ops.routed_attention)  # restored after the test
    v = torch.randn(2, 5, 3, 4, requires_grad=True)
    torch.library.opcheck(free_attention.free_attention, (v,))
    free_attention.install()
    q = torch.randn(2, 5, 3, 4, requires_grad=True)
    out = natsl.ops.routed_attention(q, q, v, None, block_size=64)
    assert out.shape == v.shape and not out.any()
    (out.sum() + q.sum()).backward()
    assert v.grad is None and torch.equal(q.grad, torch.ones_like(q))

    calls = []
    free = natsl.ops.routed_attention
    monkeypatch.setattr(natsl.ops, "routed_attention", lambda *a, **kw: calls.append(1) or free(*a, **kw))
    torch.manual_seed(0)
    model = build_model(load_recipe("tiny_hybrid"), device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, (1, 80))
    model(tokens).float().pow(2).mean().backward()
    layers = [m for m in model.modules() if type(m).__name__ == "NAtSL"]
    assert layers and len(calls) == len(layers), "every NAtS-L layer took the free op"
    for layer in layers:  # the GDN branch and the read still get their gradients
        assert layer.proj.q_proj.weight.grad.abs().sum() > 0 and layer.mix_proj.weight.grad.abs().sum() > 0


def test_bench_training_marks_a_free_attention_run_and_gives_it_no_mfu(tmp_path, monkeypatch):
    """The worker with --free-attention runs the free op in the NAtS-L layers, records that it did, and
    leaves MFU out (the FLOP count includes attention work that does not run); without it, neither."""
    import json

    import natsl.ops

    bench_training, free_attention = _bench_module("bench_training"), _bench_module("free_attention")
    monkeypatch.setattr(natsl.ops, "routed_attention", natsl.ops.routed_attention)  # restored after the test
    calls = []
    free = free_attention.routed_attention_for_free
    monkeypatch.setattr(free_attention, "routed_attention_for_free", lambda *a, **kw: calls.append(1) or free(*a, **kw))
    monkeypatch.setenv("NATSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NATSL_PEAK_FLOPS", "1e12")  # so that the CPU run has an MFU to leave out
    results = {}
    for bound in (False, True):
        result = tmp_path / f"result_{bound}.json"
        args = bench_training.build_parser().parse_args([
            "--worker", "tiny_hybrid", "--result", str(result), "--micro-batch-size", "1", "--seq-len", "64",
            "--max-steps", "2", "--warmup-steps", "1", "--device", "cpu", "--backend", "chunked",
            *(["--free-attention"] if bound else [])])
        bench_training.worker(args)
        results[bound] = json.loads(result.read_text())
        assert bool(calls) == bound
    plain, bound = results[False], results[True]
    assert plain["status"] == bound["status"] == "ok"
    assert plain["mfu"] > 0 and bound["mfu"] is None
    assert bound["free_attention"] and not plain["free_attention"]
    assert bench_training.label(bound) == "tiny_hybrid (free attn)" and bench_training.label(plain) == "tiny_hybrid"
