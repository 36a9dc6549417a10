"""The graphed prefill (natsl.inference.prefill_graph): a padded prompt leaves the cache a plain
prefill leaves, with the same last logits.

On the CPU the padded prefill runs eagerly (the padding, masks and cache transfer: everything but
the graph); @gpu replays the recorded graphs against the plain prefill on the fast backend.
"""

import dataclasses

import pytest
import torch

from natsl.inference import prefill_graph
from natsl.inference.decode import DecodeRunner
from natsl.inference.prefill_graph import PrefillGraphs, bucket, bucket_quantum
from natsl.models.routing import force_keep_fraction
from test_inference import LAYOUTS, tiny_model

LENGTHS = (1, 63, 64, 65, 1000)
# the layouts whose padded prefill is exact (prefill_graph.padding_is_exact): all of them (a sliding window is not,
# test_graphs_only_for_models_whose_padding_is_exact)
PADDED = list(LAYOUTS)


def live_tensors(cache):
    """Every tensor of every layer cache, the K/V buffers cut to the slots a later read may see
    (attention: the tokens so far; NAtS-L: each head's kept blocks and its unfinished block)."""
    length = int(cache.positions.lengths[0])
    C = cache.positions.block_size
    out = []
    for layer in cache.layers:
        for name, t in layer.tensors().items():
            if name in ("k", "v"):
                out.append((name, t[:, :, :length]))
            elif name in ("k_mem", "v_mem"):
                heads = t.shape[1]
                kept = layer.kept_len.repeat_interleave(heads // layer.kept_len.shape[1], dim=1)[0]
                out += [(f"{name}[{h}]", t[0, h, :int(kept[h]) + length % C]) for h in range(heads)]
            else:
                out.append((name, t))
    return out


def assert_same_cache(got, expected, tol):
    assert got.positions.lengths.tolist() == expected.positions.lengths.tolist()
    assert got.positions.pos.tolist() == expected.positions.pos.tolist()
    pairs = list(zip(live_tensors(got), live_tensors(expected)))
    assert pairs
    for (name, a), (_, b) in pairs:
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


def test_buckets_hold_a_natsl_prompt_in_its_last_block():
    model = tiny_model(**LAYOUTS["natsl_hybrid"])  # block size 16
    assert bucket_quantum(model.config) == 16
    assert bucket_quantum(tiny_model(**LAYOUTS["transformer"]).config) == 64
    assert bucket_quantum(tiny_model(**LAYOUTS["natsl_hybrid"], block_size=128).config) == 64
    assert [bucket(n, 64) for n in (1, 63, 64, 65, 1000)] == [64, 64, 64, 128, 1024]
    for C in (16, 64, 128):
        q = bucket_quantum(tiny_model(**LAYOUTS["natsl_hybrid"], block_size=C).config)
        for length in range(1, 300):
            n = bucket(length, q)
            assert length == n or (length - 1) // C == (n - 1) // C, (C, length, n)


@pytest.mark.parametrize("layout", PADDED)
def test_padded_prefill_leaves_the_plain_cache(layout):
    """Lengths below, at and past a bucket (and 1: the plain path), then two decode steps."""
    model = tiny_model("chunked", torch.float64, **LAYOUTS[layout])
    if model.natsl_layers():
        force_keep_fraction(model, 0.5, seed=3)  # some blocks kept, some dropped
    runner = PrefillGraphs(model, max_len=1024, cuda_graphs=False)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for length in LENGTHS:
            ids = torch.randint(0, 1024, (1, length + 2), generator=gen)
            plain, padded = model.new_cache(1, max_len=length + 2), model.new_cache(1, max_len=length + 2)
            want = model.forward_cached(ids[:, :length], plain, last_only=True)
            got = runner.prefill(ids[:, :length], padded)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
            assert_same_cache(padded, plain, 1e-9)
            for t in (length, length + 1):
                torch.testing.assert_close(model(ids[:, t:t + 1], cache=padded), model(ids[:, t:t + 1], cache=plain),
                                           rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_graphs_only_for_models_whose_padding_is_exact(layout):
    """A sliding window lets a pad overwrite a slot still in the window: such a model always prefills plainly;
    every other layer kind (Mamba2 too: a pad's dt and g are zero) leaves its cache as a plain prefill does."""
    config = tiny_model("chunked", **LAYOUTS[layout]).config
    assert prefill_graph.padding_is_exact(config) == (layout in PADDED)
    windowed = dataclasses.replace(config, attn_window=16) if hasattr(config, "attn_window") else None
    if windowed is not None and "attention" in config.layer_types():
        assert not prefill_graph.padding_is_exact(windowed)


def test_prefill_takes_the_plain_path_where_it_must(use_switches):
    model = tiny_model(**LAYOUTS["natsl_hybrid"])
    runner = PrefillGraphs(model, max_len=128, cuda_graphs=False)
    ids = torch.randint(0, 1024, (2, 200), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert runner.fits(ids[:1, :100], model.new_cache(1, max_len=128))
        assert not runner.fits(ids[:1, :1], model.new_cache(1, max_len=128))  # one token: a decode step
        assert not runner.fits(ids[:1, :129], model.new_cache(1, max_len=200))  # past max_len
        assert not runner.fits(ids[:, :100], model.new_cache(2, max_len=128))  # batch 2
        started = model.new_cache(1, max_len=128)
        model(ids[:1, :3], cache=started)
        assert not runner.fits(ids[:1, 3:50], started)  # the cache holds tokens already
        assert not runner.fits(ids[:1, :100], model.new_cache(1, max_len=128, dtype=torch.float64))
    assert not runner.fits(ids[:1, :100], model.new_cache(1, max_len=128))  # gradients on: plain path
    use_switches(prefill_graphs=True)
    assert prefill_graph.runner_for(model) is None  # the CPU: no graphs, even with the switch on
    use_switches(prefill_graphs=False)
    assert prefill_graph.runner_for(model) is None


# -- on the GPU (pytest -m gpu tests/test_prefill_graph.py) ----------------------------------------

@pytest.mark.parametrize("layout", ["gdn", "transformer", "natsl_hybrid", "mamba2", "hybrid_mamba2"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphed_prefill_equals_the_plain_prefill(layout):
    """Recorded graphs (the first prompt of a bucket records, the next replays) against the plain
    fast prefill in float32: logits and cache, at lengths around a bucket and 1000, two prompts per
    bucket, then decode steps from the graphed cache (through DecodeRunner, which merges weights:
    the graphs are then recorded afresh)."""
    model = tiny_model("fast", torch.float32, **{**LAYOUTS[layout], "block_size": 64}).cuda()
    if model.natsl_layers():
        force_keep_fraction(model, 0.5, seed=3)
    runner = PrefillGraphs(model, max_len=1024)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for length in (*LENGTHS, 62, 999):
            ids = torch.randint(0, 1024, (1, length + 4), generator=gen).cuda()
            plain, graphed = model.new_cache(1, max_len=length + 4), model.new_cache(1, max_len=length + 4)
            want = model.forward_cached(ids[:, :length], plain, last_only=True)
            got = runner.prefill(ids[:, :length], graphed)
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
            assert_same_cache(graphed, plain, 2e-3)
            decode = [DecodeRunner(model, c, cuda_graphs=False) for c in (plain, graphed)]
            for t in range(length, length + 4):
                a, b = (d.step(ids[:, t]) for d in decode)
                torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3)
    assert runner.captures >= 3 and runner.replays >= 2 and runner.cuda_graphs



def test_a_kv_press_takes_the_plain_prefill():
    """A KV press keeps its queries from Python during the prefill (natsl.inference.evict.observe), which a
    replayed graph never runs: `natsl compare`'s SnapKV rows on trained checkpoints failed on an H100 on
    2026-12-06 with "KV eviction follows a prefill made with ... observe" after a graph was replayed."""
    from natsl.inference.evict import Press, evict, observe

    model = tiny_model("chunked", torch.float64, **LAYOUTS["transformer"])
    runner = PrefillGraphs(model, max_len=1024, cuda_graphs=False)
    ids = torch.randint(0, 1024, (1, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert runner.fits(ids, model.new_cache(1, max_len=128))
        press = Press("snapkv", 0.5)
        observe(model, press)
        cache = model.new_cache(1, max_len=128)
        assert not runner.fits(ids, cache)
        runner.prefill(ids, cache)
        evict(model, cache, press)
        observe(model, None)
        assert runner.fits(ids, model.new_cache(1, max_len=128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_pressed_prefill_after_a_recorded_graph_can_be_evicted():
    """The sequence of `natsl compare`: a graph recorded without a press, then a pressed prefill of the same
    bucket, then the eviction."""
    from natsl.inference.evict import Press, evict, observe

    model = tiny_model("fast", torch.float32, **{**LAYOUTS["transformer"], "block_size": 64}).cuda()
    runner = PrefillGraphs(model, max_len=1024)
    ids = torch.randint(0, 1024, (1, 200), device="cuda")
    with torch.no_grad():
        runner.prefill(ids, model.new_cache(1, max_len=256))
        press = Press("snapkv", 0.5)
        observe(model, press)
        cache = model.new_cache(1, max_len=256)
        runner.prefill(ids, cache)
        evict(model, cache, press)
        observe(model, None)
