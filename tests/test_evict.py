"""KV eviction presses (natsl.inference.evict) on tiny Transformer and GDN Hybrid models."""

import dataclasses
from pathlib import Path

import pytest
import torch

import natsl
from natsl.errors import NatslError
from natsl.inference.evict import METHODS, EvictingLM, Press, budget_entries, evict, kept_entries, layer_budgets, observe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
LAYOUTS = {"transformer": {"base_layer": "attention"}, "gdn_hybrid": {"base_layer": "gdn", "attention_layers": [1, 3]}}


def tiny(layout, seed=0):
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml").model
    config = dataclasses.replace(base, natsl_layers=[], backend="chunked", block_size=16, **LAYOUTS[layout])
    torch.manual_seed(seed)
    return natsl.build_model(config).double().eval()


def ids(t=40, b=2, seed=3):
    return torch.randint(0, 1024, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_full_budget_changes_nothing(layout, method):
    model, x = tiny(layout), ids()
    expected = model(x)
    pressed = EvictingLM(model, Press(method, 1.0, window=4), chunk=9, room=1)
    got = pressed(x)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-7
    # and decoding after the press reads the same (compacted, but complete) cache
    cache = pressed.last_cache
    step = model(x[:, :1], cache=cache)
    plain = model.new_cache(2, max_len=41)
    model(x, cache=plain)
    torch.testing.assert_close(step, model(x[:, :1], cache=plain))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_smaller_budget_holds_the_budgeted_entries(layout, method):
    model, x = tiny(layout), ids()
    press = Press(method, 0.25, window=4)
    pressed = EvictingLM(model, press, chunk=16, room=1)
    out = pressed(x)
    assert torch.isfinite(out).all()
    layers = sum(1 for blk in model.layers if blk.layer_type == "attention")
    heads = model.config.attn_num_heads
    assert kept_entries(pressed.last_cache) == 2 * budget_entries(40, heads, layers, press) < 2 * 40 * heads * layers
    assert (out - model(x)).abs().max() > 1e-6  # evicted keys change later predictions
    before = pressed.last_cache.live_bytes()
    kv = [c for c in pressed.last_cache.layers if getattr(c, "kv_len", None) is not None]
    lengths = [c.kv_len.clone() for c in kv]
    model(x[:, :1], cache=pressed.last_cache)  # a decode step appends one entry per head
    assert all(torch.equal(c.kv_len, n + 1) for c, n in zip(kv, lengths))
    assert pressed.last_cache.live_bytes() > before
    if method == "adakv":  # heads hold different numbers of entries, at least the floor each
        assert any(len(set(n.flatten().tolist())) > 1 for n in lengths)


@torch.no_grad()
def test_one_press_after_a_prefill_keeps_the_top_scored_keys():
    model, x = tiny("transformer"), ids(t=32, b=1)
    press = Press("snapkv", 0.5, window=4)
    cache = model.new_cache(1, max_len=33)
    observe(model, press)
    model(x, cache=cache)
    evict(model, cache, press)
    observe(model, None)
    kv_len = cache.layers[0].kv_len
    assert torch.equal(kv_len, torch.full_like(kv_len, 16))


def test_pyramid_budgets_and_bad_presses():
    budgets = layer_budgets(Press("pyramidkv", 0.4), 5)
    assert budgets[0] > budgets[-1] and abs(sum(budgets) / 5 - 0.4) < 1e-12
    with pytest.raises(NatslError, match="unknown KV-eviction method 'h2o'"):
        Press("h2o", 0.5)
    with pytest.raises(NatslError, match=r"budget must lie in \(0, 1\]"):
        Press("snapkv", 0.0)
    gdn = natsl.build_model(dataclasses.replace(natsl.load_recipe("tiny_hybrid").model, natsl_layers=[]))
    with pytest.raises(NatslError, match="needs softmax-attention layers"):
        observe(gdn, Press("snapkv", 0.5))
