"""Native Sparse Attention layers (model.nsa_layers) through flash-linear-attention: the layer's math
against dense attention, a tiny training run, the recipes, the rules and the refusals."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

import natsl
from natsl.errors import NatslError

pytest.importorskip("fla", reason="NSA layers need flash-linear-attention (natsl[fla])")

from natsl.models.nsa import block_means, sparse_attention  # noqa: E402

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


TINY_NSA = dict(natsl_layers=[], nsa_layers=[1], backend="chunked", nsa_num_heads=16, nsa_kv_heads=1, nsa_head_dim=16,
                nsa_block_size=16, nsa_block_counts=2, nsa_window=8)


def tiny_nsa(**changes):
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml").model
    config = dataclasses.replace(base, **TINY_NSA, **changes)
    config.validate()
    return natsl.build_model(config)


def dense(q, k, v, mask):
    """q [T, HQ, D], k, v [T', HQ, D], mask [T, T'] -> softmax attention; rows with nothing visible: 0."""
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num()
    return torch.einsum("hts,shd->thd", p, v)


def test_block_means_average_each_block_and_the_partial_last():
    x = torch.arange(10, dtype=torch.float64).view(1, 10, 1, 1)
    assert block_means(x, 4).flatten().tolist() == [1.5, 5.5, 8.5]


def test_every_block_selected_is_dense_attention_per_branch():
    """With as many selected blocks as there are, the selected branch is causal attention; the compressed
    branch attends the means of whole past blocks; the window branch the last `window` keys."""
    torch.manual_seed(0)
    t, hq, d, bs, window = 11, 16, 8, 4, 3
    q = torch.randn(1, t, hq, d, dtype=torch.float64)
    k, v = (torch.randn(1, t, 1, d, dtype=torch.float64) for _ in range(2))
    g_cmp, g_slc, g_swa = (torch.rand(1, t, hq, dtype=torch.float64) for _ in range(3))
    got = sparse_attention(q, k, v, g_cmp, g_slc, g_swa, block_size=bs, block_counts=4, window=window)
    pos = torch.arange(t)
    kk, vv = k[0].expand(t, hq, d), v[0].expand(t, hq, d)
    causal = dense(q[0], kk, vv, pos[None, :] <= pos[:, None])
    band = dense(q[0], kk, vv, (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window))
    means_k = torch.stack([k[0, i:i + bs].mean(0) for i in range(0, t, bs)]).expand(-1, hq, d)
    means_v = torch.stack([v[0, i:i + bs].mean(0) for i in range(0, t, bs)]).expand(-1, hq, d)
    blocks = torch.arange(means_k.shape[0])
    compressed = dense(q[0], means_k, means_v, (blocks[None, :] + 1) * bs - 1 <= pos[:, None])
    want = g_slc[0, ..., None] * causal + g_cmp[0, ..., None] * compressed + g_swa[0, ..., None] * band
    torch.testing.assert_close(got[0], want, atol=1e-6, rtol=1e-5)  # fla's reference computes in fp32


def test_fewer_selected_blocks_read_less_than_dense():
    torch.manual_seed(1)
    t, hq, d = 24, 16, 8
    q = torch.randn(1, t, hq, d, dtype=torch.float64)
    k, v = (torch.randn(1, t, 1, d, dtype=torch.float64) for _ in range(2))
    zero, one = torch.zeros(1, t, hq, dtype=torch.float64), torch.ones(1, t, hq, dtype=torch.float64)
    every = sparse_attention(q, k, v, zero, one, zero, block_size=4, block_counts=8, window=0)
    two = sparse_attention(q, k, v, zero, one, zero, block_size=4, block_counts=2, window=0)
    # the first 8 tokens sit in blocks 0 and 1, which two selected blocks cover; later queries lose blocks
    torch.testing.assert_close(two[:, :8], every[:, :8], atol=1e-6, rtol=1e-5)
    assert (two[:, 12:] - every[:, 12:]).abs().max() > 1e-3


def test_tiny_nsa_model_trains():
    torch.manual_seed(0)
    model = tiny_nsa()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        nsa = model.layers[1].mixer
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in nsa.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


COMPILED_NSA = """
import dataclasses, sys, torch
import natsl
from natsl.training.trainer import HiddenStates

torch.manual_seed(0)
model = natsl.build_model(dataclasses.replace(natsl.load_recipe("tiny_hybrid").model, **{CHANGES}))
assert "fla" not in sys.modules  # the first import of fla happens inside the compiled call, as in a run
ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
body = HiddenStates(model)
compiled = torch.compile(body, backend="aot_eager")


def states_and_grads(fn):
    model.zero_grad()
    out = fn(ids, model.rope_table(ids.shape[1], ids.device))
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


torch._dynamo.utils.counters.clear()
got, got_grads = states_and_grads(compiled)
graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
want, want_grads = states_and_grads(body)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
assert got_grads.keys() == want_grads.keys() and any(n.startswith("layers.1.mixer.") for n in got_grads)
for name, grad in want_grads.items():
    torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
assert all(g.abs().sum() > 0 for n, g in got_grads.items() if n.startswith("layers.1.mixer."))
# the layers before and after fla's call are compiled graphs, fla's branches run between them
assert graphs >= 2, graphs
print("ok", graphs)
"""


def test_compiled_nsa_hybrid_matches_eager_with_fla_outside_the_graph():
    """torch.compile of the hidden states (as `natsl train --compile` does) in a fresh process, fla not yet
    imported: dynamo used to trace fla's first import and fail (InternalTorchDynamoError); fla's branches
    now run eagerly between compiled graphs, and the states and every gradient equal eager's.
    The aot_eager backend: dynamo and AOTAutograd as under Inductor, without a C++ compile."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = COMPILED_NSA.replace("{CHANGES}", repr(TINY_NSA))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr[-3000:]


def test_cached_inference_is_refused_in_one_line():
    model = tiny_nsa()
    with pytest.raises(NatslError, match="NSA layers have no inference cache") as err:
        model.new_cache(1, max_len=32)
    assert "\n" not in str(err.value)


def test_compare_refuses_an_nsa_checkpoint_before_measuring(tmp_path):
    from natsl.checkpoint import save_model_folder
    from natsl.eval.compare import run_compare

    model = tiny_nsa()
    folder = save_model_folder(tmp_path / "nsa", model, natsl.config.Recipe(name="nsa", model=model.config), None)
    with pytest.raises(NatslError, match="no inference cache.*natsl compare cannot measure it yet"):
        run_compare([str(folder)], budgets=[0.5], methods=[], contexts=[32], ppl_args=None, progress=False)


@pytest.mark.parametrize("size", ["380m", "800m"])
def test_nsa_recipes_match_gdn_hybrid_parameters(size):
    nsa, hybrid = natsl.load_recipe(f"{size}_nsa_hybrid"), natsl.load_recipe(f"{size}_gdn_hybrid")
    assert nsa.model.nsa_layers == hybrid.model.attention_layers and "attention" not in nsa.model.layer_types()
    a = natsl.build_model(nsa, device="meta").num_parameters()
    b = natsl.build_model(hybrid, device="meta").num_parameters()
    assert abs(a - b) / b < 0.005


def test_recall_nsa_recipe_loads_and_counts_its_sparse_flops():
    from natsl.models.state_cost import state_flops_per_token
    from natsl.training.flops import flops_per_token

    recipe = natsl.load_recipe("recall/nsa_hybrid")
    c = recipe.model
    n = natsl.build_model(recipe, device="meta").num_parameters()
    dense = 6.0 * (n - c.vocab_size * c.hidden_size)
    # one NSA layer at 512 tokens: 8 block means + 128 selected + 128 window keys on average
    sparse = 3.0 * 2.0 * (256 / 32 + 128 + 128) * 16 * 2 * 32
    gdn = 3 * 3.0 * state_flops_per_token(c, "gdn", 64)  # the three GDN layers
    assert flops_per_token(c, 512, n_params=n) - dense - gdn == pytest.approx(sparse)
    assert recipe.model.layer_types() == ["gdn", "gdn", "gdn", "nsa"]
    assert recipe.model.nsa_window < recipe.train.seq_len


@pytest.mark.parametrize("override, message", [
    ("model.nsa_num_heads=24", r"'model.nsa_num_heads' = 24 must be nsa_kv_heads = 1 times a power of two of at least 16"),
    ("model.nsa_block_size=48", r"'model.nsa_block_size' must be a power of two, at least 16, got 48"),
    ("model.nsa_block_counts=3", r"'model.nsa_block_counts' must be a power of two, at least 1, got 3"),
    ("model.nsa_block_counts=64", r"'model.nsa_block_counts' = 64 must be at most half of nsa_block_size = 64"),
    ("model.nsa_window=-1", r"'model.nsa_window' must be an integer >= 0 \(0: no sliding-window branch\), got -1"),
    ("model.nsa_head_dim=512", r"'model.nsa_head_dim' must be an integer from 16 to 256, got 512"),
])
def test_nsa_rules(override, message):
    with pytest.raises(NatslError, match=message):
        natsl.config.apply_overrides(natsl.load_recipe("800m_nsa_hybrid"), [override])


def test_missing_fla_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a))
    with pytest.raises(NatslError, match=r"pip install 'natsl\[fla\]'"):
        natsl.build_model(natsl.load_recipe("recall/nsa_hybrid"), device="meta")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_triton_kernels_match_the_reference():
    """fla's Triton NSA kernels against fla's PyTorch reference in bf16, forward and every gradient, on the
    same selected blocks; then how many rows the kernels' own selection changes.

    The selection is a top-k of compressed scores: where bf16 rounding orders a near-tie differently, a
    whole block of that row's keys is swapped, so two correct implementations differ there by O(1) and a
    norm over the whole output mixes such rows with real errors. With the reference's blocks given to
    both (parallel_nsa takes `block_indices`), the branches' math must agree to bf16 accuracy; each
    assertion names the part that differs."""
    import warnings

    from fla.ops.nsa import parallel_nsa
    from fla.ops.nsa.naive import naive_nsa_compression, naive_nsa_selection, naive_nsa_topk

    torch.manual_seed(0)
    t, hq, d, size, count = 300, 16, 64, 32, 4
    scale = d ** -0.5
    q = torch.randn(2, t, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, t, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g_cmp, g_slc = (torch.rand(2, t, hq, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        indices = naive_nsa_topk(q, block_means(k, size), count, size, scale)

    def kernels(q, k, v, g_cmp, g_slc):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fla warns that the given indices replace its selection
            return parallel_nsa(q, k, v, g_cmp, g_slc, None, block_indices=indices, block_counts=count,
                                block_size=size, window_size=0, scale=scale)

    def reference(q, k, v, g_cmp, g_slc):
        o_cmp, _ = naive_nsa_compression(q, block_means(k, size), block_means(v, size), size, scale)
        o_slc = naive_nsa_selection(q, k, v, indices, size, scale)
        return torch.addcmul(o_slc * g_slc.unsqueeze(-1), o_cmp, g_cmp.unsqueeze(-1))

    runs = []
    for fn in (kernels, reference):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g_cmp, g_slc)]
        o = fn(*leaves)
        o.float().square().sum().backward()
        runs.append((o.float(), [x.grad.float() for x in leaves]))
    (o_fast, grads_fast), (o_ref, grads_ref) = runs
    assert _relative(o_fast, o_ref) < 2e-2, f"output on shared blocks: relative error {_relative(o_fast, o_ref):.3g}"
    for name, fast, ref in zip(("q", "k", "v", "g_cmp", "g_slc"), grads_fast, grads_ref):
        assert _relative(fast, ref) < 5e-2, f"gradient of {name} on shared blocks: relative error {_relative(fast, ref):.3g}"

    with torch.no_grad():  # each side's own selection: only near-tie rows may differ
        own, ref = (sparse_attention(q, k, v, g_cmp, g_slc, g_slc, block_size=size, block_counts=count, window=0,
                                     naive=naive).float() for naive in (False, True))
    row_error = (own - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
    changed = (row_error > 5e-2).float().mean().item()
    assert changed < 0.05, f"{changed:.1%} of the (token, head) rows differ by > 5e-2 with each side's own selection"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_recall_nsa_hybrid_trains_compiled_with_cuda_graphs(tmp_path):
    """recall/nsa_hybrid as the recall sweep trains it on one GPU: torch.compile with CUDA graphs, each run
    in a fresh process (fla first imported under compile, where dynamo used to stop). fla's branches run
    eagerly between the compiled graphs; the first steps' losses are eager training's."""
    import json
    import subprocess
    import sys

    losses = {}
    for name, flags in (("graphs", ["--compile", "--set", "train.cuda_graphs=true"]), ("eager", ["--no-compile"])):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "natsl.cli.main", "train", "recall/nsa_hybrid", *flags,
                               "--set", "train.log_every=1", "--max-steps", "4", "--out", str(out), "--no-progress"],
                              capture_output=True, text=True, timeout=420)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert "skipping cudagraphs" not in done.stdout + done.stderr  # the compiled parts do replay
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if "loss" in r]
    assert len(losses["graphs"]) == 4
    # bf16 autocast, Inductor's kernels against eager ones: the same run within rounding
    torch.testing.assert_close(losses["graphs"], losses["eager"], atol=0.05, rtol=0)
