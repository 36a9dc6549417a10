"""NATSL_CHECK_OPS (natsl/fast/op_check.py): each event it reports, on ops made to misbehave, eager and
under torch.compile; the real natsl ops wrapped and restored; the trainer installing it from the variable."""

from __future__ import annotations

import json

import pytest
import torch

import natsl
from natsl.fast import op_check

NS = "natsl_opcheck_test"
# The tests that run natsl's fast (Triton) ops run them on the GPU where there is one, else on the CPU under
# Triton's interpreter (tests/conftest.py); the made-to-misbehave test ops below stay on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@torch.library.custom_op(f"{NS}::nan_maker", mutates_args=())
def nan_maker(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[..., 1] = float("nan")  # finite in, NaN out: the op's own doing
    return y


@torch.library.custom_op(f"{NS}::writer", mutates_args=())
def writer(x: torch.Tensor) -> torch.Tensor:
    x.add_(1.0)  # declares no mutation, writes anyway
    return x * 2


@torch.library.custom_op(f"{NS}::plain", mutates_args=())
def plain(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale


for _op in (nan_maker, writer, plain):
    _op.register_fake(lambda x, *rest: torch.empty_like(x))


def _check(lines):
    return op_check.OpCheck(lines.append, namespace=NS, devices=("cpu",))


def test_each_event_names_the_op_and_what_went_wrong():
    lines = []
    check = _check(lines)
    try:
        x = torch.randn(3, 4)
        out = torch.ops.natsl_opcheck_test.nan_maker(x)
        assert torch.isnan(out[..., 1]).all()  # the op's result is passed on untouched
        torch.ops.natsl_opcheck_test.writer(torch.randn(2, 2))
        torch.ops.natsl_opcheck_test.plain(torch.tensor([1.0, float("inf")]), 2.0)
        torch.ops.natsl_opcheck_test.plain(torch.randn(5), 2.0)  # nothing to say
    finally:
        check.remove()
    events = [e["event"] for e in check.events]
    assert events == ["nonfinite_output", "wrote_into_input", "nonfinite_input"]
    made = check.events[0]
    assert made["op"] == f"{NS}::nan_maker" and made["reruns_bad_outputs"] == [[0], [0]]  # deterministic
    assert made["outputs"][0]["fraction"] == 0.25 and made["outputs"][0]["distinct_per_dim"] == [3, 1]
    assert made["inputs"] == [[0, [3, 4], [4, 1], "float32"]]
    assert check.events[2]["args"] == [0] and check.events[2]["op"] == f"{NS}::plain"
    assert len(lines) == 3 and all(line.startswith("op check: ") for line in lines)
    assert json.loads(lines[0][len("op check: "):])["event"] == "nonfinite_output"


def test_calls_inside_a_compiled_graph_are_checked_and_remove_restores_the_op():
    lines = []
    check = _check(lines)
    try:
        compiled = torch.compile(lambda x: torch.ops.natsl_opcheck_test.nan_maker(x * 1.5) + 1, backend="aot_eager",
                                 fullgraph=True)
        compiled(torch.randn(2, 3))
    finally:
        check.remove()
    assert [e["event"] for e in check.events] == ["nonfinite_output"]
    torch.ops.natsl_opcheck_test.nan_maker(torch.randn(2, 3))
    assert len(check.events) == 1  # removed: no checks any more


def test_calls_during_a_cuda_graph_capture_run_unchecked(monkeypatch):
    """While a stream is captured the op runs as it is (no synchronisation, which would break the capture)
    and the call is counted as captured, not as checked."""
    lines = []
    check = _check(lines)
    monkeypatch.setattr(op_check, "_capturing", lambda tensors: True)
    try:
        out = torch.ops.natsl_opcheck_test.nan_maker(torch.randn(2, 3))
    finally:
        check.remove()
    assert torch.isnan(out[..., 1]).all() and check.events == [] and lines == []
    assert check.captured == {f"{NS}::nan_maker": 1} and check.calls == {}


def test_the_trainer_turns_cuda_graphs_off_while_the_ops_are_checked():
    from natsl.training.trainer import graphs_beside_op_check

    said = []
    assert graphs_beside_op_check(True, said.append) and not said  # no checks: graphs as asked
    op_check.install(lambda *_: None)
    try:
        assert not graphs_beside_op_check(True, said.append)
        assert not graphs_beside_op_check(False, said.append)
    finally:
        op_check.uninstall()
    assert len(said) == 1 and said[0].startswith("NATSL_CHECK_OPS: CUDA graphs off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_checked_op_captures_into_a_cuda_graph_and_replays():
    """On the GPU a checked op inside torch.cuda.graph capture does not break it; calls outside are checked."""
    check = op_check.OpCheck(lambda *_: None, namespace=NS, devices=("cuda",))
    try:
        x = torch.randn(4, 8, device="cuda")
        torch.ops.natsl_opcheck_test.plain(x, 2.0)  # warm-up, checked
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = torch.ops.natsl_opcheck_test.plain(x, 3.0)
        x.copy_(torch.ones_like(x))
        graph.replay()
        torch.cuda.synchronize()
    finally:
        check.remove()
    assert torch.equal(y, torch.full_like(x, 3.0))
    assert check.calls == {f"{NS}::plain": 1} and check.captured == {f"{NS}::plain": 1}


def test_the_line_limit_caps_the_log_not_the_record():
    lines = []
    check = op_check.OpCheck(lines.append, limit=2, namespace=NS, devices=("cpu",))
    try:
        for _ in range(4):
            torch.ops.natsl_opcheck_test.plain(torch.tensor([float("nan")]), 1.0)
    finally:
        check.remove()
    assert len(lines) == 2 and len(check.events) == 4


def test_install_from_env_wraps_the_fast_ops_and_routes_eager_calls_through_them(monkeypatch):
    from natsl.fast import eager
    from natsl.fast.mix import mix_branches

    monkeypatch.setenv(op_check.ENV, "0")
    assert op_check.install_from_env() is None
    monkeypatch.setenv(op_check.ENV, "1")
    lines = []
    check = op_check.install_from_env(lines.append)
    try:
        assert check is op_check.install(lines.append)  # idempotent
        names = {e for op in op_check._custom_ops("natsl") for e in [op._name]}
        assert {"gated_delta_forward", "gated_delta_backward", "routed_attention_forward", "mix_forward",
                "short_conv_forward", "gated_linear_forward"} <= names
        assert eager._compiling()
        g = torch.Generator().manual_seed(0)
        o_la, o_nla, gate = (torch.randn(1, 3, 2 * 16, generator=g).to(DEVICE) for _ in range(3))
        o_la[0, 1, 0] = float("nan")
        logits = torch.randn(1, 3, 2, 2, generator=g).to(DEVICE)
        w1, w2 = torch.ones(16, device=DEVICE), torch.ones(16, device=DEVICE)
        mix_branches(o_la.view(1, 3, 2, 16), o_nla.view(1, 3, 2, 16), logits, gate, w1, w2, 1e-6)
    finally:
        op_check.uninstall()
    assert not eager._compiling()
    assert [(e["event"], e["op"], e["args"]) for e in check.events] == [("nonfinite_input", "natsl::mix_forward", [0])]


def test_the_trainer_installs_it_from_the_variable(tmp_path, monkeypatch):
    from natsl.config import apply_overrides
    from natsl.training import TrainOptions, train

    monkeypatch.setenv(op_check.ENV, "1")
    assert op_check._installed is None

    def eager_routed():
        from natsl.fast import eager

        return eager._compiling()
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), [
        "train.seq_len=64", "train.micro_batch_size=2", "train.tokens_per_step=128", "train.eval_every=1000",
        "train.save_every=1000", "data.path=task:mqar?seq_len=64&pairs=4"])
    try:
        run = train(recipe, TrainOptions(out_dir=str(tmp_path / "run"), resume="never", device="cpu", backend="chunked",
                                         max_steps=1, save_final=False, progress=False, log=lambda *_: None))
        assert op_check._installed is not None and len(run.history) == 1
        assert eager_routed() and not run.history[0]["skipped"]
    finally:
        op_check.uninstall()


def test_a_checked_fast_model_trains_as_an_unchecked_one():
    """The fast NAtS-L Hybrid (on the GPU, else Triton's interpreter on the CPU), forward and backward, with
    the checks on: eager calls then go through the custom ops, with the same outputs and gradients (the same
    kernels on the same inputs: bitwise, on either device), and nothing to report."""
    from test_inference import LAYOUTS, tiny_model

    # initialised and drawn on the CPU, then moved: the same weights and tokens on either device
    model = tiny_model("fast", **LAYOUTS["natsl_hybrid"], block_size=64).to(DEVICE).train()
    ids = torch.randint(0, 1024, (1, 70), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def step():
        model.zero_grad()
        out = model(ids)
        out.float().square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, plain_grads = step()
    check = op_check.install(lambda *_: None)
    try:
        checked, checked_grads = step()
    finally:
        op_check.uninstall()
    assert torch.equal(plain, checked) and plain_grads.keys() == checked_grads.keys()
    assert all(torch.equal(plain_grads[n], checked_grads[n]) for n in plain_grads)
    assert check.events == [] and len(plain_grads) > 10
    for op in ("gated_delta", "routed_attention", "mix", "short_conv"):  # each kernel pair was checked
        assert check.calls.get(f"natsl::{op}_forward", 0) > 0 and check.calls.get(f"natsl::{op}_backward", 0) > 0, \
            check.calls
