"""`natsl info --kernels` and natsl.inference.kernel_table: which kernel each op runs on this CPU, and why;
the switches and NATSL_BACKEND move the rows; docs/performance.md lists every NATSL_* variable."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

import natsl
from natsl import switches
from natsl.cli.main import app
from natsl.inference.kernel_table import format_table, kernel_table

ROOT = Path(__file__).resolve().parent.parent


def by_op(rows, path):
    return {r["op"]: r for r in rows if r["path"] == path}


@pytest.mark.parametrize("recipe, rule", [("tiny_hybrid", "gated_delta_rule"), ("recall/gdn", "gated_delta_rule"),
                                          ("380m_natsl_mamba2", "gated_linear_rule")])
def test_cpu_command_rows_are_chunked_and_reference_with_the_cpu_reason(recipe, rule):
    rows = kernel_table(natsl.load_recipe(recipe).model, "cpu", command=True)
    assert rows[0]["op"] == "backend" and rows[0]["runs"] == "chunked"
    train, prefill, decode = (by_op(rows, p) for p in ("train", "prefill", "decode"))
    assert train[rule]["runs"] == "chunked (PyTorch)" and prefill[rule]["runs"] == "chunked (PyTorch)"
    assert prefill["kernel set (norms, conv, K/V)"]["runs"] == "reference set"
    assert "CPU" in decode["kernel set (norms, conv, K/V)"]["why"]
    assert train["LM loss (softmax work)"]["runs"] == "eager (PyTorch)"
    assert "not CUDA" in train["LM loss (softmax work)"]["why"]
    assert prefill["prefill graphs (short prompts)"]["runs"] == "plain prefill"
    step = "Mamba2 (SSD) decode step" if rule == "gated_linear_rule" else "GDN decode step"
    assert decode[step]["runs"] == "reference (PyTorch)"
    assert decode["GEMV (decode products)"]["runs"] == "F.linear"


def test_library_backend_follows_natsl_backend(monkeypatch):
    cfg = natsl.load_recipe("tiny_hybrid").model
    monkeypatch.delenv("NATSL_BACKEND", raising=False)
    rows = kernel_table(cfg, "cpu", training=True)
    assert rows[0]["runs"] == "reference" and "default_backend" in rows[0]["why"]
    assert by_op(rows, "train")["gated_delta_rule"]["runs"] == "reference (PyTorch)"
    monkeypatch.setenv("NATSL_BACKEND", "chunked")
    rows = kernel_table(cfg, "cpu", training=True)
    assert rows[0]["runs"] == "chunked" and rows[0]["why"] == "NATSL_BACKEND=chunked"
    assert by_op(rows, "train")["gated_delta_rule"]["runs"] == "chunked (PyTorch)"
    assert {r["path"] for r in rows} == {"all", "train"}
    assert by_op(kernel_table(cfg, "cpu", training=True, backend="reference"), "train")["gated_delta_rule"][
        "runs"] == "reference (PyTorch)"


def test_switches_override_moves_the_rows():
    cfg = natsl.load_recipe("tiny_hybrid").model
    with switches.override(compile_pointwise="all"):
        train = by_op(kernel_table(cfg, "cpu", training=True, command=True), "train")
    assert train["pointwise (norms, gates, SwiGLU)"] == dict(
        path="train", op="pointwise (norms, gates, SwiGLU)", runs="compiled (torch.compile)",
        why="NATSL_COMPILE_POINTWISE=all")
    with switches.override(fused_inference=False):
        decode = by_op(kernel_table(cfg, "cpu", training=False, command=True), "decode")
    assert decode["kernel set (norms, conv, K/V)"]["why"] == "NATSL_FUSED_INFERENCE=0"
    with switches.override(decode_attention=False):
        decode = by_op(kernel_table(cfg, "cpu", training=False, command=True), "decode")
    assert decode["decode attention"]["why"] == "NATSL_DECODE_ATTENTION=0"


def test_loss_row_is_the_loss_decision():
    """The loss row calls the function natsl.training.loss asks (`fused_default_why`), which names the switch."""
    import torch

    from natsl.ops.cross_entropy import fused_default_why

    cfg = natsl.load_recipe("tiny_hybrid").model
    loss = by_op(kernel_table(cfg, "cpu", training=True), "train")["LM loss (softmax work)"]
    assert (loss["runs"] == "fused (Triton)") == fused_default_why(torch.device("cpu"))[0]
    # off CUDA the device decides first; on CUDA the switch (the same function, read in this order)
    with switches.override(fused_loss=False):
        assert fused_default_why(torch.device("cpu")) == (False, "not CUDA: the loss kernel runs on CUDA")
        assert fused_default_why(torch.device("cuda")) == (False, "NATSL_FUSED_LOSS=0")


def test_format_fits_100_columns():
    text = format_table(kernel_table(natsl.load_recipe("tiny_hybrid").model, "cpu", command=True))
    assert max(len(line) for line in text.splitlines()) <= 100
    assert text.splitlines()[0].split() == ["path", "op", "runs", "why"]


def test_cli_info_kernels_and_errors():
    runner = CliRunner()
    result = runner.invoke(app, ["info", "tiny_hybrid", "--kernels", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "kernels on cpu" in result.stdout and "gated_delta_rule" in result.stdout
    assert "forward:" not in result.stdout
    bad = runner.invoke(app, ["info", "no_such_recipe", "--kernels"])
    assert bad.exit_code == 2
    assert len(bad.output.strip().splitlines()) == 1 and bad.output.startswith("error:")
    assert "Traceback" not in bad.output


def test_docs_list_every_variable():
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text[text.index("## Which kernel runs"):]
    assert switches.markdown_table() in section, "rerun natsl.switches.markdown_table() into docs/performance.md"
    for f in switches.FIELDS.values():
        if f.metadata["env"]:
            assert f"`{f.metadata['env']}`" in section
    for env in switches.OTHER_VARIABLES:
        assert f"`{env}`" in section
