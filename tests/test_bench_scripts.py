"""The benchmark suite's CPU-runnable parts: options, the registry, results files, tiny CPU runs, the
profile's readers and the training entry's process handling (the measurements run on the GPU)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from benchmarks import common, latency, ops, profile, training

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0) until reaped: read its state where /proc exists.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_training_ends_its_workers_when_it_is_terminated(tmp_path):
    """`timeout` around the training entry sends SIGTERM to it only: its workers (and their own
    children, as under torchrun) must end with it instead of holding the GPU and the pipe."""
    pid_file = tmp_path / "pids"
    driver = textwrap.dedent(f"""
        import sys
        from benchmarks import training
        worker = ("import os, subprocess, sys, time; "
                  "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                  "open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(120)")
        sys.exit(training.run_child([sys.executable, "-c", worker]))
    """)
    script = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
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


def test_ops_options_are_checked_by_name():
    """Unknown ops, providers and modes are refused (argparse's exit code 2); 'all' takes every op."""
    for argv in (["--op", "nope"], ["--op", "mix", "--provider", "natsl_fast,magic"], ["--op", "mix", "--mode", "bwd"],
                 [], ["--op", "mix", "--keep", "1.5"]):
        with pytest.raises(SystemExit) as exit_info:
            ops.parse(argv)
        assert exit_info.value.code == 2
    args = ops.parse(["--op", "all", "--provider", "fla,cublas", "--mode", "fwd"])
    assert args.ops == list(ops.REGISTRY)
    assert ops.enumerate_cases(args) == [("gated_delta", "fla", "fwd"), ("gated_linear", "fla", "fwd"),
                                         ("gemv", "cublas", "fwd")]


def test_the_registry_holds_every_op_and_its_points_take_the_recipes_widths():
    assert set(ops.REGISTRY) == {"gated_delta", "gated_linear", "routed_attention", "short_conv", "mix", "cross_entropy",
                                 "decode_attention", "decode_step", "gemv", "gemv_fold", "pointwise"}
    for op in ops.REGISTRY.values():
        assert set(op.providers) <= set(ops.PROVIDERS) and "natsl_fast" in op.providers and op.modes
    args = ops.parse(["--op", "routed_attention", "--shapes", "800m,tiny", "--keep", "1", "0.5"])
    points = ops.points(ops.REGISTRY["routed_attention"], args)
    assert len(points) == 2 * len(ops.SEQUENCE_POINTS) * 2
    assert ops.attention_dims(points[0].model) == (18, 64, 128)  # the 800M layer's softmax branch
    assert points[0].label == "800m 1x4096 keep=1.0" and points[-1].shape == "tiny"
    args = ops.parse(["--op", "gemv", "--lengths", "7", "--batch", "2"])
    gemv = ops.points(ops.REGISTRY["gemv"], args)
    assert {(p.batch, p.length) for p in gemv} == {(2, 7)}
    assert {"product": "lm head", "N": 32000, "K": 1536} in [p.variant for p in gemv]
    assert "gated_delta: providers natsl_fast, natsl_fast_dense, natsl_reference, fla" in ops.describe()


def test_a_sweep_setting_is_applied_and_then_restored():
    from natsl.fast import mix, short_conv

    before, tile = dict(mix.BACKWARD), short_conv.FORWARD_TILE
    with ops.applied(mix, {"BACKWARD": {"BLOCK_ROWS": 64}}):
        assert mix.BACKWARD == {**before, "BLOCK_ROWS": 64}
    assert mix.BACKWARD == before
    with pytest.raises(RuntimeError), ops.applied(short_conv, {"FORWARD_TILE": (1, 2)}):
        assert short_conv.FORWARD_TILE == (1, 2)
        raise RuntimeError("a setting that fails to compile")
    assert short_conv.FORWARD_TILE == tile
    assert ops.setting_label({"BACKWARD": {"BLOCK_ROWS": 64}}) == "BACKWARD={'BLOCK_ROWS':64}"


def test_a_tiny_cpu_run_of_the_reference_provider_writes_json_and_png(tmp_path, capsys):
    """The mix op's PyTorch path on the tiny recipe's widths, forward and forward + backward; the fast
    provider says why it is skipped on a CPU instead of failing."""
    args = ops.parse(["--op", "mix", "--provider", "natsl_fast,natsl_reference,sdpa_flash", "--shapes", "tiny",
                      "--lengths", "16", "--device", "cpu", "--out", str(tmp_path)])
    rows = ops.run(args)["mix"]
    printed = capsys.readouterr().out
    assert "skip mix natsl_fast fwd at tiny 1x16: needs a CUDA device" in printed
    assert "skip mix sdpa_flash: not a provider of this op" in printed
    assert [(r["provider"], r["mode"]) for r in rows] == [("natsl_reference", "fwd"), ("natsl_reference", "fwdbwd")]
    assert all(r["ms"] > 0 and r["x_first"] == 1.0 for r in rows)
    assert all(isinstance(r["first_call_s"], float) for r in rows)  # the first calls' wall time rides along
    assert "(first call " in printed
    data = json.loads((tmp_path / "ops_mix.json").read_text())
    assert data["benchmark"] == "ops_mix" and data["rows"] == rows and "source_sha256" in data["provenance"]
    assert (tmp_path / "ops_mix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_providers_of_one_point_are_compared_with_the_first():
    """Two providers at a point: the second's output is compared with the first's, its time divided by it."""
    op = ops.Op("double", {"natsl_reference": lambda x, p, mode: ops.Call(lambda t: 2 * t, [x["t"]], grads=[x["t"]]),
                           "natsl_fast": lambda x, p, mode: ops.Call(lambda t: 2.5 * t, [x["t"]], grads=[x["t"]])},
                lambda p, device, dtype: {"t": torch.ones(4, 8)})
    point = ops.Point("tiny", None, 1, 8)
    args = ops.parse(["--op", "mix"])
    rows = ops.run_point(op, point, ["natsl_reference", "natsl_fast"], "fwdbwd", args, torch.device("cpu"),
                         torch.float32)
    assert rows[1]["rel_rms_vs_natsl_reference"] == pytest.approx(0.25)
    assert rows[1]["grad_rel_rms_vs_natsl_reference"] == pytest.approx(0.25)  # 2.5 dout against 2 dout
    assert "grad_rel_rms_vs_natsl_reference" not in rows[0]
    assert rows[1]["x_first"] == pytest.approx(rows[1]["ms"] / rows[0]["ms"])


def test_fla_unguarded_lifts_only_the_issue_640_guard_of_the_backward(monkeypatch):
    """--fla-unguarded: fla's gated dq/dk backward no longer refuses on Hopper with Triton < 3.7.1; the
    forward-only runs and a run without the flag leave fla as it is."""
    chunk_o = pytest.importorskip("fla.ops.common.chunk_o")
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    for unguarded, mode in ((False, "fwdbwd"), (True, "fwd")):
        monkeypatch.setattr(ops, "FLA_UNGUARDED", unguarded)
        assert ops.fla_ops("fla.ops.simple_gla", mode).chunk_simple_gla and chunk_o.TRITON_ABOVE_3_7_1 is False
    monkeypatch.setattr(ops, "FLA_UNGUARDED", True)
    ops.fla_ops("fla.ops.gated_delta_rule", "fwdbwd")
    assert chunk_o.TRITON_ABOVE_3_7_1 is True
    from natsl.fast.toolchain import torch_ptxas

    assert torch_ptxas() is None or os.environ["TRITON_PTXAS_PATH"]  # natsl's ptxas pinned before fla compiles
    assert ops.parse(["--op", "gated_linear", "--fla-unguarded"]).fla_unguarded


def test_results_are_written_with_provenance_and_tables_fill_missing_cells(tmp_path):
    path = common.write_result("thing", {"rows": [{"a": 1.0}]}, tmp_path / "deep")
    data = json.loads(path.read_text())
    assert data["benchmark"] == "thing" and data["rows"] == [{"a": 1.0}] and "torch" in data["provenance"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    assert common.bar_png(tmp_path / "empty.png", {}, "ms", "nothing") is None
    assert common.bar_png(tmp_path / "bars.png", {"4K": {"a": 1.0, "b": 2.0}, "16K": {"a": 3.0}}, "ms", "t").is_file()
    assert common.table([{"x": 1.23456, "y": "s"}, {"x": None}], ["x", "y"]).splitlines()[2:] == [
        "| 1.235 | s |", "| - | - |"]
    assert common.time_ms(lambda: None, cuda=False) >= 0


def test_latency_side_by_side_divides_by_the_first_model_at_each_context():
    def point(context, prefill, decode):
        return {"context": context, "cold_prefill_s": 3 * prefill, "prefill_s": prefill, "decode_ms": decode,
                "prefill_floor_s": 0.1, "decode_floor_ms": 0.1}

    runs = [{"models": [{"name": "hybrid", "forced_keep_fraction": 0.5, "points": [point(4096, 1.0, 2.0)]},
                        {"name": "transformer", "forced_keep_fraction": None,
                         "points": [point(4096, 4.0, 8.0), {"context": 8192, "error": "out of memory"}]}]},
            {"models": [{"name": "hybrid", "forced_keep_fraction": 0.25, "points": [point(4096, 0.5, 1.0)]}]}]
    rows = latency.side_by_side(runs)
    assert [(r["model"], r["keep"], r["prefill_x_first"], r["decode_x_first"]) for r in rows] == [
        ("hybrid", 0.5, 1.0, 1.0), ("transformer", None, 4.0, 4.0), ("hybrid", 0.25, 0.5, 0.5)]
    assert [r["cold_prefill_s"] for r in rows] == [3.0, 12.0, 1.5]  # the cold first call rides along


def test_idle_gaps_are_the_gpu_timeline_holes_between_kernels():
    """The profile's idle report: gaps over 20 us between one kernel's end (the latest end so far,
    kernels may overlap) and the next start, largest first, CPU events ignored."""
    events = [{"cat": "kernel", "name": "a", "ts": 0, "dur": 100},
              {"cat": "kernel", "name": "b", "ts": 50, "dur": 10},  # inside a: no gap after it
              {"cat": "kernel", "name": "c", "ts": 130, "dur": 10},  # 30 us after a ends
              {"cat": "kernel", "name": "d", "ts": 150, "dur": 10},  # 10 us: under the threshold
              {"cat": "kernel", "name": "e", "ts": 260, "dur": 40},  # 100 us
              {"cat": "cpu_op", "name": "x", "ts": 0, "dur": 300}]
    gaps = profile.idle_gaps(events)
    assert gaps["n_gaps"] == 2 and gaps["kernels"] == 5
    assert [(g["us"], g["after"], g["before"]) for g in gaps["gaps"]] == [(100, "d", "e"), (30, "b", "c")]
    assert gaps["idle_ms"] == 0.13 and gaps["span_ms"] == 0.3
    assert profile.idle_gaps(events[-1:]) == {"span_ms": 0.0, "idle_ms": 0.0, "kernels": 0, "gaps": [], "n_gaps": 0}


def test_host_head_is_the_host_time_before_the_first_launch():
    """The profile's --host-head: from the step's mark to the first kernel launch, the first
    kernel's start, and the host ranges and ops begun in between (longest first, the mark itself and
    later ones left out)."""
    mark = profile.STEP_MARK
    events = [{"cat": "user_annotation", "name": mark, "ts": 1000, "dur": 9000},
              {"cat": "user_annotation", "name": "Torch-Compiled Region", "ts": 1100, "dur": 8000},
              {"cat": "cpu_op", "name": "aten::empty", "ts": 1200, "dur": 30},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 4000, "dur": 5},
              {"cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": 3000, "dur": 5},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 3500, "dur": 50},  # after the first launch
              {"cat": "kernel", "name": "first", "ts": 3200, "dur": 10},
              {"cat": "kernel", "name": "second", "ts": 4100, "dur": 10}]
    head = profile.host_head(events)
    assert head["host_to_first_launch_ms"] == 2.0 and head["first_kernel_ms"] == 2.2 and head["first_kernel"] == "first"
    assert [(e["name"], e["ms"], e["at_ms"]) for e in head["before_first_launch"]] == [
        ("Torch-Compiled Region", 8.0, 0.1), ("aten::empty", 0.03, 0.2)]
    assert profile.host_head(events[1:]) == {}  # no step mark


def test_matmul_shapes_sum_each_product_and_its_rate():
    """profile --matmul-shapes: kernels summed under the (M, K, N, kernel) of the op that
    launched them, with the products' TFLOP/s; ops whose operands do not chain are left out."""
    from types import SimpleNamespace as Event

    assert profile.product_dims([[32768, 1536], [1536, 4608]]) == (1, 32768, 1536, 4608)
    assert profile.product_dims([[4608], [32768, 1536], [1536, 4608], [], []]) == (1, 32768, 1536, 4608)
    assert profile.product_dims([[8, 64, 32], [8, 32, 16]]) == (8, 64, 32, 16)
    assert profile.product_dims([[3, 4], [5, 6]]) is None

    def kernel(name, us):
        return Event(name=name, duration=us)

    events = [Event(name="aten::mm", input_shapes=[[1000, 2000], [2000, 500]], kernels=[kernel("nvjet_a", 100.0)]),
              Event(name="aten::mm", input_shapes=[[1000, 2000], [2000, 500]], kernels=[kernel("nvjet_a", 300.0)]),
              Event(name="aten::addmm", input_shapes=[[500], [1000, 2000], [2000, 500], [], []],
                    kernels=[kernel("splitK", 150.0), kernel("reduce", 10.0)]),
              Event(name="aten::add", input_shapes=[[1000, 2000], [1000, 2000]], kernels=[kernel("add", 50.0)]),
              Event(name="aten::mm", input_shapes=[], kernels=[kernel("nvjet_b", 70.0)])]
    rows = profile.matmul_shapes(events, cuda=True)
    assert [(r["kernel"], r["calls"], round(r["ms"], 3)) for r in rows] == [("nvjet_a", 2, 0.4), ("splitK", 1, 0.16)]
    assert rows[0]["gflop"] == 2 * 2 * 1000 * 2000 * 500 / 1e9 and rows[0]["tflops"] == rows[0]["gflop"] / 0.4


def test_free_attention_outputs_zeros_and_leaves_the_rest_of_the_hybrid_training(monkeypatch):
    """The bound of `training.py --free-attention`: the NAtS-L layers' softmax branch gives zeros
    and no gradient, the GDN branch and the read still train, and the op passes torch's op checks."""
    import torch

    import natsl.ops
    from natsl.config import load_recipe
    from natsl.models import build_model

    monkeypatch.setattr(natsl.ops, "routed_attention", natsl.ops.routed_attention)  # restored after the test
    v = torch.randn(2, 5, 3, 4, requires_grad=True)
    torch.library.opcheck(training.free_attention, (v,))
    training.install_free_attention()
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


def test_training_marks_a_free_attention_run_and_gives_it_no_mfu(tmp_path, monkeypatch, natsl_cache_dir):
    """The worker with --free-attention runs the free op in the NAtS-L layers, records that it did, and
    leaves MFU out (the FLOP count includes attention work that does not run); without it, neither."""
    import natsl.ops

    monkeypatch.setattr(natsl.ops, "routed_attention", natsl.ops.routed_attention)  # restored after the test
    calls = []
    free = training.routed_attention_for_free
    monkeypatch.setattr(training, "routed_attention_for_free", lambda *a, **kw: calls.append(1) or free(*a, **kw))
    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)  # the run's shared corpus cache
    monkeypatch.setenv("NATSL_PEAK_FLOPS", "1e12")  # so that the CPU run has an MFU to leave out
    results = {}
    for bound in (False, True):
        result = tmp_path / f"result_{bound}.json"
        args = training.build_parser().parse_args([
            "--worker", "tiny_hybrid", "--result", str(result), "--micro-batch-size", "1", "--seq-len", "64",
            "--max-steps", "2", "--warmup-steps", "1", "--device", "cpu", "--backend", "chunked",
            *(["--free-attention"] if bound else [])])
        training.worker(args)
        results[bound] = json.loads(result.read_text())
        assert bool(calls) == bound
    plain, bound = results[False], results[True]
    assert plain["status"] == bound["status"] == "ok"
    assert plain["mfu"] > 0 and bound["mfu"] is None
    assert bound["free_attention"] and not plain["free_attention"]
    assert training.label(bound) == "tiny_hybrid (free attn)" and training.label(plain) == "tiny_hybrid"


def test_the_training_entry_runs_the_tiny_recipe_in_process_and_writes_json_and_png(
        tmp_path, monkeypatch, natsl_cache_dir):
    monkeypatch.setenv("NATSL_CACHE_DIR", natsl_cache_dir)  # the run's shared corpus cache
    training.main(["--recipes", "tiny_hybrid", "--in-process", "--max-steps", "2", "--warmup-steps", "1",
                   "--seq-len", "64", "--micro-batch-size", "1", "--device", "cpu", "--backend", "chunked",
                   "--out", str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "training.json").read_text())
    (result,) = data["results"]
    assert result["recipe"] == "tiny_hybrid" and result["status"] == "ok" and result["steps_timed"] == 1
    assert result["tokens_per_s"] > 0 and (tmp_path / "out" / "training.png").is_file()
    with pytest.raises(SystemExit):
        training.main(["--max-steps", "3", "--warmup-steps", "3"])


def test_the_gated_linear_entry_builds_mamba2_shaped_inputs_and_times_its_chunked_path(tmp_path):
    """Mamba2's SSD at the tiny recipe's width: heads of 64 values and a 128-wide state, g <= 0."""
    args = ops.parse(["--op", "gated_linear", "--provider", "natsl_reference", "--shapes", "tiny",
                      "--lengths", "70", "--mode", "fwdbwd", "--device", "cpu", "--out", str(tmp_path)])
    point = ops.points(ops.REGISTRY["gated_linear"], args)[0]
    x = ops.gla_inputs(point, torch.device("cpu"), torch.float32)
    assert x["q"].shape[-1] == ops.SSD_STATE and x["v"].shape[-1] == ops.SSD_HEAD_DIM and (x["g"] <= 0).all()
    assert x["write"].shape[1] == 2
    rows = ops.run(args)["gated_linear"]
    assert [r["provider"] for r in rows] == ["natsl_reference"] and rows[0]["ms"] > 0


def test_graph_times_forwards_by_replay_and_leaves_fwdbwd_alone(monkeypatch):
    """--graph: a forward on CUDA goes to common.graph_ms with the call's own arguments, GRAPH_CALLS calls a
    graph; fwdbwd, and anything off CUDA, keeps its usual timing."""
    seen = []

    def fake_graph_ms(fn, *, calls=50, replays=20):
        seen.append((fn(), calls))
        return 1.5

    monkeypatch.setattr(ops.common, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(ops.common, "time_ms", lambda fn, **kw: (fn(), 2.5)[1])
    x = torch.ones(3)
    call = ops.Call(lambda a: a * 2, [x], grads=[x], out=lambda r: r.sum())
    assert ops.time_call(call, "fwd", cuda=True, graph=True) == 1.5
    assert len(seen) == 1 and torch.equal(seen[0][0], x * 2) and seen[0][1] == ops.GRAPH_CALLS
    assert ops.time_call(call, "fwd", cuda=True, graph=False) == 2.5
    assert ops.time_call(call, "fwdbwd", cuda=True, graph=True) == 2.5
    assert ops.time_call(call, "fwd", cuda=False, graph=True) == 2.5
    assert len(seen) == 1


def test_profile_lists_each_calls_slowest_operators(tmp_path, capsys):
    """--profile: every timed row carries its slowest kernels (operators on the CPU), per call, slowest first,
    forward and forward + backward, and the log prints them under the row."""
    args = ops.parse(["--op", "gated_linear", "--provider", "natsl_reference", "--shapes", "tiny", "--lengths", "70",
                      "--mode", "fwd,fwdbwd", "--device", "cpu", "--profile", "--out", str(tmp_path)])
    rows = ops.run(args)["gated_linear"]
    assert [r["mode"] for r in rows] == ["fwd", "fwdbwd"]
    for row in rows:
        kernels = row["kernels"]
        assert 0 < len(kernels) <= 8 and all(k["ms"] > 0 and k["count"] > 0 for k in kernels)
        assert [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
    # the backward's trace holds more than the forward's: its matmuls run more often per call
    bmm = {r["mode"]: next(k["count"] for k in r["kernels"] if k["name"] == "aten::bmm") for r in rows}
    assert bmm["fwdbwd"] > bmm["fwd"]
    assert f"x{rows[0]['kernels'][0]['count']:g}  {rows[0]['kernels'][0]['name']}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "ops_gated_linear.json").read_text())["rows"]
    assert saved[0]["kernels"] == rows[0]["kernels"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_profile_and_graph_time_the_kernels(tmp_path):
    """On CUDA, --profile lists the device's kernels (the SSD forward's three Triton kernels, not the CPU
    operators that launched them), and --graph's replay time is at most the launch-bound time plus noise."""
    base = ["--op", "gated_linear", "--provider", "natsl_fast", "--shapes", "tiny", "--lengths", "4096", "--batch", "1",
            "--mode", "fwd", "--out", str(tmp_path)]
    row = ops.run(ops.parse(base + ["--profile"]))["gated_linear"][0]
    names = [k["name"] for k in row["kernels"]]
    assert {"_chunk_cumsum_kernel", "_state_fwd_kernel", "_output_kernel"} <= set(names), names
    assert not any(n.startswith("aten::") for n in names)
    assert all(k["count"] == 1 for k in row["kernels"] if k["name"].endswith("_kernel"))  # per call
    graphed = ops.run(ops.parse(base + ["--graph"]))["gated_linear"][0]
    assert 0 < graphed["ms"] <= 1.2 * row["ms"]


def test_graph_is_recorded_in_the_result(tmp_path):
    args = ops.parse(["--op", "gated_linear", "--provider", "natsl_reference", "--shapes", "tiny", "--lengths", "16",
                      "--mode", "fwd", "--device", "cpu", "--graph", "--out", str(tmp_path)])
    ops.run(args)
    result = json.loads((tmp_path / "ops_gated_linear.json").read_text())
    assert result["graph"] is True and result["rows"][0]["ms"] > 0


@pytest.mark.parametrize("op", ["gated_delta", "gated_linear", "routed_attention"])
def test_an_op_entry_runs_in_a_fresh_process(op, tmp_path):
    """Each op entry imports what it calls: run alone, nothing else has imported natsl.ops for it."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.ops", "--op", op, "--provider", "natsl_reference",
                           "--shapes", "tiny", "--lengths", "16", "--mode", "fwd", "--device", "cpu",
                           "--dtype", "fp32", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Error" not in done.stdout, done.stdout[-2000:]
    assert json.loads((tmp_path / f"ops_{op}.json").read_text())["rows"][0]["ms"] > 0


def test_profile_sorts_kernels_by_kind_from_their_names():
    """The by-kind summary of `python -m benchmarks.profile`: natsl's own kernels by package, then the
    libraries' by their naming (as the profiler reports them on the H200)."""
    kinds = {name: profile.kernel_kind(name) for name in (
        "_local_dr_kernel", "_grad_qk_kernel", "_chunk_cumsum_kernel", "_dkdv_kernel", "_conv_bwd_walk_kernel",
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "triton_poi_fused__to_copy_add_cat_mul_silu_12")}
    assert kinds == {"_local_dr_kernel": "GDN / SSD state kernels", "_grad_qk_kernel": "GDN / SSD state kernels",
                     "_chunk_cumsum_kernel": "GDN / SSD state kernels", "_dkdv_kernel": "routed attention kernels",
                     "_conv_bwd_walk_kernel": "short conv kernels",
                     "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmuls",
                     "triton_poi_fused__to_copy_add_cat_mul_silu_12": "Inductor-fused"}


def _interpreted_points(monkeypatch, op_name: str, shapes: str = "tiny", batch: str = "2"):
    """(op, its decode-sized points at `shapes`) for a CPU run of natsl_fast's kernels in the Triton interpreter
    (the provider's CUDA check lifted); skips without the interpreter (CUDA timing is the benchmark's own job)."""
    from natsl.devices import triton_interpreted

    if not triton_interpreted():
        pytest.skip("needs the Triton interpreter (CUDA timing is the benchmark's own job)")
    monkeypatch.setattr(ops, "_needs_cuda", lambda device: None)
    args = ops.parse(["--op", op_name, "--shapes", shapes, "--device", "cpu", "--batch", batch, "--lengths", "1"])
    op = ops.REGISTRY[op_name]
    return op, ops.points(op, args)


def test_gemv_fold_providers_compute_the_same_pieces(monkeypatch):
    """benchmarks.ops gemv_fold: at the tiny recipe's widths, the folded GEMV (natsl_fast) and the norm or
    conv kernel then the GEMV (natsl_unfused) give the same product for every piece (the q conv's output for
    the conv piece), so the side-by-side times one computation two ways; so do the --sweep's fold tiles
    (settings of natsl.fast.gemv.FOLD_TILES). Runs the kernels in the interpreter."""
    import torch

    from natsl.fast import gemv

    op, points = _interpreted_points(monkeypatch, "gemv_fold")
    assert {p.variant["piece"].split()[0] for p in points} == {"add_norm", "add_norm+conv", "o_norm",
                                                               "gated_input_norm"}
    assert op.sweep[0] == "natsl.fast.gemv" and all(set(s) == {"FOLD_TILES"} for s in op.sweep[1])
    for setting in [{}] + [s["FOLD_TILES"] for s in op.sweep[1]]:
        for fold in ("output_norm", "row_norm"):
            monkeypatch.setitem(gemv.FOLD_TILES, fold, setting.get(fold))
        for point in points:
            inputs = op.inputs(point, torch.device("cpu"), torch.float32)
            fused = op.providers["natsl_fast"](inputs, point, "fwd").fn()
            unfused = op.providers["natsl_unfused"](inputs, point, "fwd").fn()
            if "conv" in point.variant["piece"]:  # (sum, product with the convs' outputs) against the conv steps
                q = unfused[0][:, 0]
                fused, unfused = fused[1][:, :q.shape[-1]], q
            elif point.variant["piece"].startswith("add_norm"):
                fused = fused[1]
            assert fused.shape == unfused.shape and torch.allclose(fused, unfused, rtol=1e-4, atol=1e-4), (
                point.label, setting)



def test_gemv_fold_times_the_output_norm_fold_at_the_800m_head_of_384(monkeypatch):
    """At the 800M widths a GDN head is 384 wide (not a power of two): the natsl_fast provider folds the norm
    into o_proj's GEMV there, equal to the norm kernel then the GEMV (natsl_unfused). Interpreted kernels."""
    import torch

    op, points = _interpreted_points(monkeypatch, "gemv_fold", shapes="800m", batch="1")
    point = next(p for p in points if p.variant["piece"].startswith("o_norm"))
    inputs = op.inputs(point, torch.device("cpu"), torch.float32)
    assert inputs["norm"].numel() == 384
    fused = op.providers["natsl_fast"](inputs, point, "fwd").fn()
    unfused = op.providers["natsl_unfused"](inputs, point, "fwd").fn()
    assert fused.shape == unfused.shape and torch.allclose(fused, unfused, rtol=1e-4, atol=1e-4)


def test_resources_compiles_the_gemv_variants_for_hopper_and_reads_their_registers(tmp_path):
    """benchmarks.resources --kernels gemv: every decode GEMV variant compiled for sm_90 (no GPU, no
    interpreter), with registers within Hopper's 255 a thread and spill bytes read from the cubin."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.resources", "--kernels", "gemv", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if proc.returncode and "has no NVIDIA backend tools" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "resources.json").read_text())["rows"]
    assert len(rows) == 12 and all(0 < r["registers"] <= 255 and r["spill_bytes"] >= 0 for r in rows)
    assert {r["variant"] for r in rows} >= {"gemv MLP down, SwiGLU, 2 rows", "gemv LM head, 1 row"}
    assert "registers" in proc.stdout and "wrote" in proc.stdout


def test_decode_step_providers_compute_the_same_step(monkeypatch):
    """benchmarks.ops decode_step: at the tiny recipe's widths, the fused step (natsl_fast, interpreted) and its
    reference twin give the same read, log decay and new state, for the GDN and the Mamba2 layer; and the sweep's
    tile widths are settings of natsl.fast.cached.STEP_TILES."""
    import torch

    op, points = _interpreted_points(monkeypatch, "decode_step")
    assert {p.variant["layer"] for p in points} == {"gdn", "mamba2"}
    from natsl.fast import cached

    assert op.sweep[0] == "natsl.fast.cached" and all(set(s) == {"STEP_TILES"} for s in op.sweep[1])
    for tiles in ({}, {"gdn": 16, "gla": 16}):  # the defaults, and V tiles narrower than a head (the sweep's)
        for layer, width in tiles.items():
            monkeypatch.setitem(cached.STEP_TILES, layer, width)
        for point in points:
            results = {}
            for provider in ("natsl_fast", "natsl_reference"):
                torch.manual_seed(0)
                inputs = op.inputs(point, torch.device("cpu"), torch.float32)
                o, g = op.providers[provider](inputs, point, "fwd").fn()
                results[provider] = (o, g, inputs["states"][0])
            for got, want in zip(results["natsl_fast"], results["natsl_reference"]):
                assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4), (point.label, tiles)
    assert any(p.variant["V"] > 16 for p in points)  # so the narrow tiles split a head
