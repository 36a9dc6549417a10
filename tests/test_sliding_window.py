"""Sliding-window attention (model.attn_window): the band, its ring-buffer cache, the recipes."""

import dataclasses
from pathlib import Path

import pytest
import torch

import natsl
from natsl.errors import NatslError
from natsl.models.attention import band_mask, banded_attention, sliding_window_attention

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def tiny_swa(window=5, seed=0, **changes):
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml").model
    config = dataclasses.replace(base, natsl_layers=[], attention_layers=[1, 3], attn_window=window,
                                 backend="chunked", block_size=16, **changes)
    torch.manual_seed(seed)
    return natsl.build_model(config).double().eval()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
def test_band_matches_flex_and_explicit_loop():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 11, 8, dtype=torch.float64) for _ in range(3))
    got = sliding_window_attention(q, k, v, 4)
    for i in range(11):  # query i sees keys max(0, i-3) .. i
        lo = max(0, i - 3)
        p = torch.softmax(q[:, :, i:i + 1] @ k[:, :, lo:i + 1].transpose(-1, -2) / 8 ** 0.5, -1)
        torch.testing.assert_close(got[:, :, i:i + 1], p @ v[:, :, lo:i + 1])
    # The CUDA path's flex_attention with the same band, eagerly (its unfused form on the CPU).
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 4), None, None, 11, 11, device="cpu")
    flex = flex_attention(q.float(), k.float(), v.float(), block_mask=mask)
    torch.testing.assert_close(flex, got.float(), atol=1e-5, rtol=1e-5)
    assert band_mask(torch.arange(3), torch.arange(3), 2).tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]


@pytest.mark.parametrize("earlier, t, window", [(0, 1, 4), (0, 7, 4), (3, 10, 4), (0, 33, 8), (5, 64, 16),
                                                (0, 4, 8), (7, 5, 8)])
def test_banded_prefill_attention_equals_one_masked_call(earlier, t, window):
    """The ring prefill's query chunks (each with the keys its band reaches) = one SDPA call over every
    key with the whole band mask; `earlier` keys come from the ring before the new tokens."""
    torch.manual_seed(t)
    q = torch.randn(2, 3, t, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 3, earlier + t, 8, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(100 - earlier, 100 + t)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(pos[-t:], pos, window))
    torch.testing.assert_close(banded_attention(q, k, v, pos, window), whole, rtol=1e-12, atol=1e-12)


def test_window_changes_the_output_only_past_the_window():
    full, swa = tiny_swa(window=0), tiny_swa(window=6)
    ids = torch.randint(0, 1024, (1, 20), generator=torch.Generator().manual_seed(1))
    a, b = full(ids), swa(ids)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6


@pytest.mark.parametrize("chunks", [[], [3], [9], [4, 13], [20]])
@torch.no_grad()
def test_ring_buffer_prefill_and_decode_equal_the_full_forward(chunks):
    model = tiny_swa(window=5)
    ids = torch.randint(0, 1024, (2, 23), generator=torch.Generator().manual_seed(2))
    expected = model(ids)
    cache = model.new_cache(2, max_len=23)
    parts, start = [], 0
    for end in chunks:
        parts.append(model(ids[:, start:end], cache=cache))
        start = end
    parts += [model(ids[:, t:t + 1], cache=cache) for t in range(start, 23)]
    got = torch.cat(parts, dim=1)
    # float64 model; the cached GDN steps token by token where the full forward runs the chunked form
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-7
    attention = [c for c in cache.layers if hasattr(c, "window") and c.window]
    assert attention and all(c.k.shape[2] == 5 for c in attention)  # only the last `window` keys are kept
    per_entry = 2 * 16 * 8  # K and V of head dim 16 in float64
    assert attention[0].live_bytes() == 2 * 4 * 5 * per_entry


def test_window_rule():
    recipe = natsl.load_recipe("800m_gdn_hybrid")
    with pytest.raises(NatslError, match=r"'model.attn_window' must be an integer >= 0 \(0: full causal attention\), got -1"):
        natsl.config.apply_overrides(recipe, ["model.attn_window=-1"])


@pytest.mark.parametrize("size", ["380m", "800m"])
def test_gdn_swa_recipe_matches_gdn_hybrid_parameters(size):
    swa, hybrid = natsl.load_recipe(f"{size}_gdn_swa"), natsl.load_recipe(f"{size}_gdn_hybrid")
    assert swa.model.attn_window > 0 and swa.model.layer_types() == hybrid.model.layer_types()
    a = natsl.build_model(swa, device="meta").num_parameters()
    b = natsl.build_model(hybrid, device="meta").num_parameters()
    assert abs(a - b) / b < 0.005


def test_recall_swa_recipe_trains_a_step():
    recipe = natsl.load_recipe("recall/gdn_swa")
    assert 0 < recipe.model.attn_window < recipe.train.seq_len
    model = natsl.build_model(dataclasses.replace(recipe.model, backend="chunked", attn_window=32))
    ids = torch.randint(0, recipe.model.vocab_size, (1, 96))
    model(ids).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_checkpoints_from_before_the_window_load_as_full_attention(tmp_path):
    import json

    from natsl.checkpoint import load_checkpoint, save_model_folder
    from natsl.hf.export import llama_refusal

    model = tiny_swa(window=0).float()
    recipe = natsl.config.Recipe(name="old", model=model.config)
    folder = save_model_folder(tmp_path / "old", model, recipe, None)
    config = json.loads((folder / "config.json").read_text())
    del config["recipe"]["model"]["attn_window"]
    del config["model_sha256"]  # recorded by later checkpoints only
    (folder / "config.json").write_text(json.dumps(config))
    loaded, _ = load_checkpoint(folder)
    assert loaded.config.attn_window == 0
    windowed = dataclasses.replace(natsl.load_recipe("800m_transformer").model, attn_window=2048)
    assert "sliding window" in llama_refusal(windowed)
