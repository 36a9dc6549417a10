"""The routing block size is a free parameter (natsl/block_size.py; issue 55, item 3).

- Its default is written once: every op's `block_size` default and the model config's read
  natsl.block_size.DEFAULT_BLOCK_SIZE.
- The reference and chunked backends take any multiple of 16 (16, 48, 256 here against each other).
- The fast (Triton) twins take 16, 32, 64, 128 and 256, forward and every gradient: chunks of 16 and 32
  tokens (prepare.py pads them to its 16-row sub-blocks) and blocks of 128 and 256 that span 64-token
  chunks (natsl/fast/gated_delta/spans.py), against the reference on fresh random inputs: odd lengths
  (T not a multiple of the block, T < block, T = 1), all-write / all-skip / random / fractional routes.
- A tiny NAtS-L model trains a step at block 128 and 32 on the fast backend as on the reference, and
  decodes through its cache at block 128 as its full forward computes.
- A recipe with a block size no backend takes is a one-line error naming the allowed values.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so the shapes
stay small; the `gpu` tests run the backward at block 128 (and 256, 32) at a training-sized shape, with
NATSL_GPU_BLOCK_SIZES=all (natsl refuses the sizes other than 64 on a GPU until these tests have passed there).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import natsl  # noqa: E402
import natsl.ops  # noqa: E402
from cli_checks import assert_one_line_error  # noqa: E402
from natsl.block_size import DEFAULT_BLOCK_SIZE, FAST_BLOCK_SIZES, MODEL_BLOCK_SIZES  # noqa: E402
from natsl.cli.main import app  # noqa: E402
from natsl.config import ModelConfig  # noqa: E402
from natsl.fast.gated_delta import gated_delta_rule as fast_gdn  # noqa: E402
from natsl.fast.gated_delta.prepare import _prepare_kernel  # noqa: E402
from natsl.fast.gated_delta.spans import chunking  # noqa: E402
from natsl.reference.gated_delta import gated_delta_rule as reference_gdn  # noqa: E402
from numerics import rel_rms  # noqa: E402
from test_chunked_backend import test_chunked_matches_recurrent as chunked_gdn_matches_recurrent  # noqa: E402
from test_fast_gated_delta import FP32_TOL  # noqa: E402
from test_fast_gated_delta import check as check_gdn  # noqa: E402
from test_fast_gated_delta import compare as compare_gdn  # noqa: E402
from test_fast_gated_delta import make_inputs as gdn_inputs  # noqa: E402
from test_fast_gated_delta import make_write  # noqa: E402
from test_fast_model import loss_and_grads  # noqa: E402
from test_fast_routed_attention import assert_close as check_attention  # noqa: E402
from test_fast_routed_attention import compare as compare_attention  # noqa: E402
from test_gated_linear import chunked as chunked_gla  # noqa: E402
from test_gated_linear import errors as gla_errors  # noqa: E402
from test_gated_linear import fast as fast_gla  # noqa: E402
from test_gated_linear import make_inputs as gla_inputs  # noqa: E402
from test_gated_linear import reference as reference_gla  # noqa: E402
from test_inference import prefill_then_decode, relative_error  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(_prepare_kernel).__name__ != "InterpretedFunction":
    pytest.skip("natsl.fast was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
RECIPES = Path(__file__).resolve().parent.parent / "recipes"


# ----------------------------------------------------------------------------- the default, written once
def test_every_block_size_default_is_the_one_constant():
    """Every op of natsl.ops.TWINS (reference, fast, chunked) and its door in natsl.ops, and the model
    config, default to DEFAULT_BLOCK_SIZE: none writes its own 64."""
    functions = [natsl.ops.gated_delta_rule, natsl.ops.gated_linear_rule, natsl.ops.routed_attention]
    for family in ("gated_delta_rule", "gated_delta_rule_chunked", "gated_linear_rule", "gated_linear_rule_chunked",
                   "routed_attention"):
        functions += [natsl.ops.twin(family, fast=False), natsl.ops.twin(family, fast=True)]
    for fn in functions:
        default = inspect.signature(fn).parameters["block_size"].default
        assert default is DEFAULT_BLOCK_SIZE, (fn.__module__, fn.__name__, default)
    assert ModelConfig().block_size == DEFAULT_BLOCK_SIZE
    assert {32, 64, 128} <= set(FAST_BLOCK_SIZES) <= set(MODEL_BLOCK_SIZES)


def test_a_block_spans_whole_chunks_above_64():
    assert [chunking(b) for b in FAST_BLOCK_SIZES] == [(16, 1), (32, 1), (64, 1), (64, 2), (64, 4)]


# ----------------------------------------------------------------------------- reference vs chunked
@pytest.mark.parametrize("T, C", [(1, 16), (45, 16), (100, 48), (100, 256), (300, 256)])
@pytest.mark.parametrize("route", ["ones", "zeros", "random", "fractional"])
def test_chunked_gated_delta_equals_the_recurrence_at_any_multiple_of_16(T, C, route):
    """float64, to 1e-10: odd lengths, T < block, T = 1 (tests/test_chunked_backend.py at these sizes)."""
    for decay_skipped_blocks in (True, False):
        chunked_gdn_matches_recurrent(T, C, route, decay_skipped_blocks, True)


@pytest.mark.parametrize("T, block_size", [(1, 16), (45, 16), (100, 48), (100, 256), (300, 256)])
@pytest.mark.parametrize("write_kind", ["ones", "zeros", "random"])
def test_chunked_gated_linear_equals_the_recurrence_at_any_multiple_of_16(T, block_size, write_kind):
    inputs, do, d_final = gla_inputs(1, T, 2, 8, 16, seed=T + block_size, write_kind=write_kind, block_size=block_size)
    for decay_skipped_blocks in (True, False):
        errs = gla_errors(chunked_gla, reference_gla, inputs, do, d_final, block_size=block_size,
                          decay_skipped_blocks=decay_skipped_blocks, route_grad="full")
        assert max(errs.values()) <= 1e-5, errs


# ----------------------------------------------------------------------------- fast vs reference
# (T, write kind): T = 1, T < block, T a block and a bit, a partial last block; every route kind.
def _cases(block_size):
    return [(block_size, 1, "random"), (block_size, block_size // 2 + 3, "ones"),
            (block_size, block_size + 5, "zeros"), (block_size, 2 * block_size + 37, "random"),
            (block_size, 2 * block_size + 37, "binary")]


@pytest.mark.parametrize("block_size, T, write_kind", _cases(32) + _cases(128))
@pytest.mark.parametrize("decay_skipped_blocks", [True, False])
def test_fast_gated_delta_matches_the_reference(block_size, T, write_kind, decay_skipped_blocks):
    errors = compare_gdn(1, T, 2, 16, 24, seed=T + block_size, write_kind=write_kind, block_size=block_size,
                         decay_skipped_blocks=decay_skipped_blocks)
    check_gdn(errors, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("block_size, T", [(16, 45), (256, 300), (128, 200)])
@pytest.mark.parametrize("route_grad", ["active", "full"])
def test_fast_gated_delta_other_sizes_and_policies(block_size, T, route_grad):
    """16 (one sub-block per chunk), 256 (four chunks per block), batch 2 and both route policies."""
    errors = compare_gdn(2, T, 2, 16, 24, seed=T, write_kind="binary", block_size=block_size, route_grad=route_grad)
    check_gdn(errors, FP32_TOL, FP32_TOL)


def test_fast_gated_delta_block_128_is_not_two_blocks_of_64():
    """The span is one route over both chunks: a skipped 128-block hides both chunks' writes from later
    blocks, but its second chunk reads its first chunk's. Routing the same drops per 64-token chunk
    computes something else (so the twin test above could tell a chunk-level commit apart)."""
    q, k, v, g, beta = gdn_inputs(1, 256, 2, 16, 24, seed=3)
    zeros = torch.zeros(1, 2, 2, device=q.device)
    o128, s128 = fast_gdn(q, k, v, g, beta, zeros, block_size=128, output_final_state=True)
    o64, s64 = fast_gdn(q, k, v, g, beta, zeros.repeat_interleave(2, 1), block_size=64, output_final_state=True)
    ref128, sref = reference_gdn(q, k, v, g, beta, zeros, block_size=128, output_final_state=True)
    assert rel_rms(o128, ref128) < FP32_TOL and rel_rms(s128, sref) < FP32_TOL
    assert rel_rms(o64[:, 64:128], o128[:, 64:128]) > 1e-2  # the second chunk sees the first's writes


@pytest.mark.parametrize("block_size, T, write_kind", _cases(32) + _cases(128))
def test_fast_gated_linear_matches_the_chunked_form(block_size, T, write_kind):
    inputs, do, d_final = gla_inputs(1, T, 2, 16, 24, seed=T + block_size, write_kind=write_kind, block_size=block_size)
    for decay_skipped_blocks in (True, False):
        errs = gla_errors(fast_gla, chunked_gla, inputs, do, d_final, block_size=block_size,
                          decay_skipped_blocks=decay_skipped_blocks, route_grad="full")
        assert max(errs.values()) <= FP32_TOL, errs


def test_fast_gated_linear_grouped_heads_at_block_256():
    """Mamba2's groups (q, k on 2 of 4 heads) with four chunks per block."""
    inputs, do, d_final = gla_inputs(1, 300, 4, 16, 24, seed=5, block_size=256)
    inputs["q"], inputs["k"] = inputs["q"][:, :, :2].contiguous(), inputs["k"][:, :, :2].contiguous()
    errs = gla_errors(fast_gla, chunked_gla, inputs, do, d_final, block_size=256, route_grad="active")
    assert max(errs.values()) <= FP32_TOL, errs


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("T, keep_kind, G, route_grad", [(1, "random", 1, "full"), (20, "ones", 2, "active"),
                                                         (150, "zeros", 2, "full"), (300, "random", 4, "full")])
def test_fast_routed_attention_matches_the_reference(block_size, T, keep_kind, G, route_grad):
    errs = compare_attention(1, T, 4, G, 16, 24, keep_kind, route_grad, block_size=block_size, seed=T + G)
    check_attention(errs, torch.float32)


# ----------------------------------------------------------------------------- whole models
def tiny_config(block_size, **changes):
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml").model
    return dataclasses.replace(base, block_size=block_size, natsl_rope=True, **changes)


@pytest.mark.parametrize("block_size, T", [(128, 170), (32, 75)])
def test_a_tiny_model_trains_a_step_on_fast_as_on_the_reference(block_size, T):
    """Loss and every parameter gradient of a training step: the fast backend (Triton, the interpreter
    on a CPU) against the reference (token recurrence and dense attention), T a partial last block."""
    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(block_size), device=DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, T + 1), device=DEVICE)
    loss_ref, grads_ref = loss_and_grads(model, ids, "reference")
    loss_fast, grads_fast = loss_and_grads(model, ids, "fast")
    keeps = [layer.last_keep for layer in model.natsl_layers().values()]
    assert any(0 < float(k.mean()) < 1 for k in keeps), "the routes should mix kept and dropped blocks"
    assert abs(loss_fast.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
    assert grads_fast.keys() == grads_ref.keys()
    router_grads = [n for n in grads_ref if n.endswith("router.weight")]
    assert router_grads and all(grads_ref[n].abs().sum() > 0 for n in router_grads)
    worst = max(grads_ref, key=lambda n: rel_rms(grads_fast[n], grads_ref[n]))
    assert rel_rms(grads_fast[worst], grads_ref[worst]) <= 2e-3, worst


@pytest.mark.parametrize("layout", [{}, {"natsl_state": "mamba2", "mamba2_head_dim": 32, "mamba2_state_size": 16}],
                         ids=["gdn_state", "mamba2_state"])
def test_a_block_128_model_decodes_as_its_full_forward(layout):
    """Prefill + decode through the cache at block 128 equal the full forward (docs/spec.md section 4):
    a prefill shorter than a block, one ending on a block's end, and several ending inside blocks."""
    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(128, backend="chunked", **layout)).double().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        keeps = [layer.last_keep[:, :-1] for layer in model.natsl_layers().values()]
        assert any(0 < float(k.mean()) < 1 for k in keeps), "the routes should mix kept and dropped blocks"
        for chunks in ([100, 140], [128, 256, 270], [60, 200, 290]):
            got, cache = prefill_then_decode(model, ids, chunks)
            assert relative_error(got, full) < 1e-6, chunks
            assert cache.positions.lengths.tolist() == [300, 300]


# ----------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("block_size, backend, allowed", [
    (100, None, "a multiple of 16 from 16 to 256 (16, 32, 48"),
    (512, None, "a multiple of 16 from 16 to 256"),
    (48, "fast", "must be one of 16, 32, 64, 128, 256 with backend fast"),
])
def test_a_recipe_with_an_unsupported_block_size_is_one_line(tmp_path, block_size, backend, allowed):
    text = (RECIPES / "tiny_hybrid.yaml").read_text().replace("  block_size: 64\n", f"  block_size: {block_size}\n")
    if backend:
        text = text.replace("model:\n", f"model:\n  backend: {backend}\n", 1)
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    result = CliRunner().invoke(app, ["train", str(recipe), "--out", str(tmp_path / "run")])
    assert_one_line_error(result, "'model.block_size'", allowed, f"got {block_size}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("block_size", [16, 32, 128, 256])
def test_a_recipe_takes_the_fast_sizes_on_backend_fast(block_size):
    tiny_config(block_size, backend="fast").validate()


# ----------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [128, 256, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_gated_delta_backward_at_large_and_small_blocks(block_size, dtype):
    """The GDN backward at the 800M layer's head shapes (K 192, V 384, 6 heads), batch 2 x 2K tokens: the
    Table 4 ablation "block size 128" trains on the fast backend. bf16 within the spec's bounds against
    the fp32 reference's chunked form (its token loop is too slow here), fp32 to 1e-3 (tf32 products)."""
    from natsl.reference.gated_delta_chunked import gated_delta_rule as chunked_gdn

    T = 2048
    q, k, v, g, beta = gdn_inputs(2, T, 6, 192, 384, seed=block_size, dtype=dtype, device="cuda")
    write = make_write(2, -(-T // block_size), 6, "binary", seed=block_size + 1, device="cuda")
    do = torch.randn(2, T, 6, 384, device="cuda")
    results = []
    for fn, cast in ((fast_gdn, dtype), (chunked_gdn, torch.float32)):
        leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v, g, beta)] + [write.clone().requires_grad_()]
        o, _ = fn(*leaves, block_size=block_size, route_grad="full")
        (o.float() * do).sum().backward()
        results.append([o] + [x.grad for x in leaves])
    fwd_tol, grad_tol = (5e-3, 1e-2) if dtype == torch.bfloat16 else (1e-3, 1e-3)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta", "dwrite")
    errs = {n: rel_rms(a, b) for n, a, b in zip(names, *results)}
    assert errs["o"] <= fwd_tol and max(v for n, v in errs.items() if n != "o") <= grad_tol, errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [128, 32])
def test_gpu_gated_linear_and_attention_backward_at_other_blocks(block_size):
    """Mamba2's SSD state (64 heads of P 64, N 128, one group) and routed attention, 2K tokens, bf16."""
    T = 2048
    inputs, do, d_final = gla_inputs(1, T, 8, 128, 64, seed=block_size, block_size=block_size)
    errs = gla_errors(fast_gla, chunked_gla, inputs, do, d_final, dtype=torch.bfloat16, block_size=block_size,
                      scale=1.0, route_grad="full")
    assert errs["o"] <= 5e-3 and max(errs.values()) <= 1e-2, errs
    check_attention(compare_attention(2, T, 8, 2, 64, 128, "random", "full", dtype=torch.bfloat16,
                                      block_size=block_size, seed=block_size, device="cuda"), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [128, 32])
def test_gpu_tiny_model_trains_a_step_on_fast_as_on_chunked(block_size):
    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(block_size), device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, 1001), device="cuda")
    loss_ref, grads_ref = loss_and_grads(model, ids, "chunked")
    loss_fast, grads_fast = loss_and_grads(model, ids, "fast")
    assert abs(loss_fast.item() - loss_ref.item()) <= 1e-4 * abs(loss_ref.item())
    worst = max(grads_ref, key=lambda n: rel_rms(grads_fast[n], grads_ref[n]))
    assert rel_rms(grads_fast[worst], grads_ref[worst]) <= 5e-3, worst


@pytest.fixture(autouse=True)
def every_fast_size_on_the_gpu(request, monkeypatch):
    """The gpu tests check the sizes natsl does not yet run on a GPU by default."""
    if request.node.get_closest_marker("gpu"):
        monkeypatch.setenv("NATSL_GPU_BLOCK_SIZES", "all")


def test_sizes_not_yet_checked_on_a_gpu_are_refused_there(monkeypatch):
    from natsl.block_size import GPU_CHECKED_BLOCK_SIZES, gpu_problem
    from natsl.fast.gated_delta.function import block_size_problem

    monkeypatch.delenv("NATSL_GPU_BLOCK_SIZES", raising=False)
    # what tests/test_block_sizes.py -m gpu passed on an H100 (2026-12-06): every size its gpu tests run
    assert GPU_CHECKED_BLOCK_SIZES == {"gated_delta_rule": (32, 64, 128, 256), "gated_linear_rule": (32, 64, 128)}
    for op, size in (("gated_delta_rule", 64), ("gated_delta_rule", 128), ("gated_delta_rule", 256),
                     ("gated_linear_rule", 32), ("gated_linear_rule", 128)):
        assert gpu_problem(op, size) is None and block_size_problem(op, size, "chunked", on_gpu=True) is None
    for op, size in (("gated_delta_rule", 16), ("gated_linear_rule", 16), ("gated_linear_rule", 256)):
        problem = block_size_problem(op, size, "chunked", on_gpu=True)
        assert f"block_size {size} on a GPU has not yet passed" in problem and "NATSL_GPU_BLOCK_SIZES=all" in problem
    assert block_size_problem("gated_delta_rule", 16, "chunked", on_gpu=False) is None  # the interpreter runs it
    monkeypatch.setenv("NATSL_GPU_BLOCK_SIZES", "all")
    assert block_size_problem("gated_linear_rule", 256, "chunked", on_gpu=True) is None
    assert "supports block_size" in block_size_problem("gated_delta_rule", 48, "chunked", on_gpu=True)

