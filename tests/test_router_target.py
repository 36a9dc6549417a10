"""The router's keep bias (model.router_keep_target, router_bias_rate): the auxiliary-loss-free balancing
controller of docs/recall.md, "Routing over training". Tiny models on the CPU, as tests/test_inference.py
builds them (block_size 16).
"""

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_inference import (BLOCK, LAYOUTS, mixed_routes, natsl_layer_inputs, prefill_then_decode, relative_error,
                            tiny_model)

import natsl
from natsl.devices import triton_interpreted
from natsl.errors import NatslError
from natsl.reference.router import block_mean, router_scores

ROOT = Path(__file__).resolve().parent.parent


def ids_of(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (batch, length), generator=torch.Generator().manual_seed(seed))


def biases(model) -> list[torch.Tensor]:
    return [layer.router_keep_bias.clone() for layer in model.natsl_layers().values()]


def set_splitting_bias(model, ids) -> None:
    """Each layer's bias at minus the median keep-score gap of its blocks (no bias), per group, so that
    about half of the blocks change their route: layer by layer, as each bias changes the next layer's input."""
    with torch.no_grad():
        for i, layer in model.natsl_layers().items():
            x = natsl_layer_inputs(model, ids)[i]
            scores = router_scores(block_mean(x, layer.config.block_size), layer.router.weight, layer.num_heads)
            gap = (scores[..., 0] - scores[..., 1])[:, :-1].flatten(0, 1)  # complete blocks only
            layer.router_keep_bias.copy_(-gap.median(dim=0).values + 1e-4)


# -- off by default ------------------------------------------------------------------------------

def test_off_by_default_no_buffer_and_the_plain_router(tmp_path):
    """Without router_keep_target the layer holds no bias (state dict and checkpoints as before) and routes as
    the plain router; with it, a zero bias routes the same, so the option changes nothing until it moves."""
    from natsl.checkpoint import load_checkpoint, save_model_folder

    plain = tiny_model("chunked", **LAYOUTS["natsl_hybrid"])
    assert plain.config.router_keep_target is None
    assert all(layer.router_keep_bias is None for layer in plain.natsl_layers().values())
    assert not any("router_keep_bias" in name for name in plain.state_dict())
    ids = ids_of(2, 5 * BLOCK + 3, 0)
    with torch.no_grad():
        expected = plain(ids)
        routes = [layer.last_keep for layer in plain.natsl_layers().values()]
        plain.train()
        plain(ids)  # a training forward of the plain layer has nothing to update
        plain.eval()
    biased = tiny_model("chunked", **LAYOUTS["natsl_hybrid"], router_keep_target=0.5)
    biased.load_state_dict(plain.state_dict(), strict=False)
    assert all(torch.equal(b, torch.zeros(2)) for b in biases(biased))
    with torch.no_grad():
        assert torch.equal(biased(ids), expected)
    assert all(torch.equal(a, b.last_keep) for a, b in zip(routes, biased.natsl_layers().values()))
    # a plain checkpoint loads as before: no bias, the same logits
    recipe = dataclasses.replace(natsl.load_recipe(ROOT / "recipes/tiny_hybrid.yaml"), model=plain.config)
    save_model_folder(tmp_path / "plain", plain, recipe)
    loaded, _ = load_checkpoint(tmp_path / "plain")
    assert all(layer.router_keep_bias is None for layer in loaded.natsl_layers().values())
    with torch.no_grad():
        assert torch.equal(loaded(ids), expected)


# -- the controller ------------------------------------------------------------------------------

@pytest.mark.parametrize("target, start", [(0.5, 1.0), (0.25, -1.0)])
def test_the_bias_moves_the_kept_fraction_to_its_target(target, start):
    """From a collapsed router (a keep bias of +1 keeps every block, -1 drops every one: the score gaps of
    these blocks are ~0.1), training forwards move the bias by rate * sign(target - kept fraction) each
    until the kept fraction sits near the target; evaluation forwards leave it alone."""
    rate = 0.02
    model = tiny_model("chunked", **LAYOUTS["natsl_hybrid"], router_keep_target=target, router_bias_rate=rate)
    ids = ids_of(4, 8 * BLOCK, 1)
    layers = list(model.natsl_layers().values())
    with torch.no_grad():
        for layer in layers:
            layer.router_keep_bias.fill_(start)
        model.eval()
        model(ids)
        assert all(float(layer.last_keep.mean()) == (1.0 if start > 0 else 0.0) for layer in layers)  # collapsed
        assert all(torch.equal(b, torch.full((2,), start)) for b in biases(model))  # eval: no update
        model.train()
        model(ids)  # the first step goes against the collapse, in every group
        step = -rate if start > 0 else rate
        assert all(torch.allclose(b, torch.full((2,), start + step)) for b in biases(model))
        fractions = []
        for _ in range(120):
            model(ids)
            fractions.append(torch.stack([layer.last_keep.mean(dim=(0, 1)) for layer in layers]))  # [layers, H]
        after = biases(model)
        model.eval()
        model(ids)
        assert all(torch.equal(a, b) for a, b in zip(after, biases(model)))
    late = torch.stack(fractions[-20:]).mean(0)  # the last 20 forwards, per layer and group
    assert (late - target).abs().max() < 0.15, late
    assert all(((b - start) * step > 0).all() for b in after)  # moved away from the collapse in every group
    for b in after:  # always a whole number of steps away from the start
        steps = (b - start) / rate
        assert torch.allclose(steps, steps.round(), atol=1e-3)


def test_the_update_is_the_sign_rule_per_group_and_combines_with_noise_and_balance():
    """bias += rate * sign(target - mean over batch and blocks of the hard keep), per routing group (a group
    exactly at its target does not move); with router_noise and router_balance on, the same rule on the
    routes the noisy router took, and the balance loss still comes."""
    model = tiny_model("chunked", **LAYOUTS["natsl"], router_keep_target=0.5, router_bias_rate=0.125,
                       router_noise=1.0, router_balance=0.5).train()
    ids = ids_of(2, 4 * BLOCK + 5, 2)
    before = biases(model)
    model(ids)
    for b0, layer in zip(before, model.natsl_layers().values()):
        observed = layer.last_keep.mean(dim=(0, 1))
        assert torch.equal(layer.router_keep_bias, b0 + 0.125 * torch.sign(0.5 - observed))
        assert layer.aux_loss is not None and layer.router_keep_bias.requires_grad is False


# -- every path routes alike --------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["natsl_hybrid", "natsl"])
def test_full_forward_equals_prefill_and_decode_with_a_bias(layout):
    """A nonzero bias that changes about half of the routes: the full-sequence forward and the cached
    prefill + decode (its block ends in `close_block` of the reference kernel set) keep the same blocks
    and give the same logits, for several splits."""
    model = tiny_model("chunked", torch.float64, **LAYOUTS[layout], router_keep_target=0.5)
    ids = ids_of(2, 5 * BLOCK + 3, 4)
    with torch.no_grad():
        model(ids)
        unbiased = [layer.last_keep.clone() for layer in model.natsl_layers().values()]
        set_splitting_bias(model, ids)
        full = model(ids)
        routes = [layer.last_keep[:, :-1].clone() for layer in model.natsl_layers().values()]
        assert mixed_routes(model)
        assert any(not torch.equal(a, b.last_keep) for a, b in zip(unbiased, model.natsl_layers().values()))
        for chunks in ([BLOCK + 3], [7, 2 * BLOCK], [5 * BLOCK + 3]):
            got, cache = prefill_then_decode(model, ids, chunks)
            assert relative_error(got, full) < 1e-6, chunks
            for r, c in zip(routes, cache.natsl_caches()):
                assert torch.equal(r.sum(1).long() * BLOCK, c.kept_len), chunks


def test_fused_decode_routes_with_the_bias(use_switches):
    """The fused kernel set (its block end is natsl.ops.block_end.close_block) in Triton's interpreter:
    prefill + decode across two block ends keep what the plain decode keeps, with a bias that flips
    routes, and both equal the full forward."""
    if not torch.cuda.is_available() and not triton_interpreted():
        pytest.skip("needs CUDA or the Triton interpreter")
    use_switches(force_decode_gemv=False)  # the products are not under test here (slow in the interpreter)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("chunked", **LAYOUTS["natsl"], router_keep_target=0.5).to(device)
    ids = ids_of(2, 2 * BLOCK + 2, 5).to(device)  # decoded: tokens 13-33, across two block ends
    results = {}
    with torch.no_grad():
        set_splitting_bias(model, ids)
        full = model(ids)
        routes = [layer.last_keep[:, :-1].clone() for layer in model.natsl_layers().values()]
        for fused in (False, True):
            use_switches(force_fused_inference=fused)
            logits, cache = prefill_then_decode(model, ids, [BLOCK - 3])
            results[fused] = logits, [c.kept_len.clone() for c in cache.natsl_caches()]
    for logits, kept in results.values():
        assert relative_error(logits, full) < 1e-4
        assert all(torch.equal(r.sum(1).long() * BLOCK, k) for r, k in zip(routes, kept))
    assert any(0 < float(r.mean()) < 1 for r in routes)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_block_end_with_the_bias_equals_the_reference(compiled, use_switches):
    """natsl.ops.block_end.close_block (eager, and compiled as on a GPU) against the reference kernel set's
    close_block routed by the layer's decide_routes, on one decode token for three sequences (two at a
    block end): the same kept lengths and states, and the bias changes a route."""
    from natsl.ops import block_end
    from natsl.ops.kernel_set import Reference

    if compiled:
        use_switches(compile_pointwise="all")
    model = tiny_model("reference", **LAYOUTS["natsl"], router_keep_target=0.5)
    layer = model.natsl_layers()[0]
    gen = torch.Generator().manual_seed(6)
    B, H, d, C = 3, layer.num_heads, model.config.hidden_size, BLOCK
    K, V = model.config.head_k_dim, model.config.head_v_dim
    x_sum, x = torch.randn(B, d, generator=gen), torch.randn(B, d, generator=gen)
    pos = torch.tensor([C - 1, C + 4, 3 * C - 1])  # rows 0 and 2 end their blocks
    gap = router_scores((x_sum + x) / C, layer.router.weight, H)
    gap = gap[..., 0] - gap[..., 1]
    with torch.no_grad():  # a bias that flips row 0's route in both groups
        layer.router_keep_bias.copy_(-gap[0] - 1e-3 * torch.sign(gap[0]))

    def cache():
        g = torch.Generator().manual_seed(7)
        return SimpleNamespace(x_sum=x_sum.clone(), state_start=torch.randn(B, H, K, V, generator=g),
                               state_run=torch.randn(B, H, K, V, generator=g), decay_sum=-torch.rand(B, H, generator=g),
                               kept_len=torch.full((B, H), 2 * C, dtype=torch.long))

    g_token = -torch.rand(B, H, generator=gen)
    ref, fused, unbiased = cache(), cache(), cache()
    Reference("reference").close_block(ref, x, pos, layer.router.weight, None, layer.decide_routes, C, True, g_token,
                                       router_bias=layer.router_keep_bias)
    block_end.close_block(fused.x_sum, x, pos, layer.router.weight, fused.state_start, fused.state_run,
                          fused.decay_sum, fused.kept_len, C, True, None, 0, g_token, layer.router_keep_bias)
    block_end.close_block(unbiased.x_sum, x, pos, layer.router.weight, unbiased.state_start, unbiased.state_run,
                          unbiased.decay_sum, unbiased.kept_len, C, True, None, 0, g_token)
    assert torch.equal(ref.kept_len, fused.kept_len)
    for name in ("state_start", "state_run", "decay_sum", "x_sum"):
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    assert not torch.equal(unbiased.kept_len[0], fused.kept_len[0])  # the bias decided row 0
    assert torch.equal(unbiased.kept_len[1], fused.kept_len[1])  # not at a block end: unchanged


def test_decode_step_with_a_bias_never_reads_the_device_on_the_host():
    """On meta tensors (a CUDA graph's requirement, as tests/test_inference.py checks the plain layer)."""
    config = dataclasses.replace(natsl.load_recipe(ROOT / "recipes/tiny_hybrid.yaml").model, block_size=BLOCK,
                                 router_keep_target=0.3)
    model = natsl.build_model(config, device="meta")
    cache = model.new_cache(2, max_len=64)
    cache.positions.attn_read = cache.positions.natsl_read = 64
    logits = model.decode_step(torch.zeros(2, 1, dtype=torch.long, device="meta"), cache)
    assert logits.shape == (2, 1, config.vocab_size)


# -- checkpoints ---------------------------------------------------------------------------------

def test_the_bias_round_trips_through_a_checkpoint(tmp_path):
    """Saved in model.safetensors, loaded back (float32 even into a bf16 model), and the loaded model routes
    as the saved one; weights without it are refused for a config that has it."""
    from safetensors.torch import load_file, save_file

    from natsl.checkpoint import load_checkpoint, save_model_folder

    model = tiny_model("chunked", **LAYOUTS["natsl_hybrid"], router_keep_target=0.4)
    ids = ids_of(2, 4 * BLOCK + 1, 8)
    with torch.no_grad():
        set_splitting_bias(model, ids)
        expected = model(ids)
    routes = [layer.last_keep.clone() for layer in model.natsl_layers().values()]
    recipe = dataclasses.replace(natsl.load_recipe(ROOT / "recipes/tiny_hybrid.yaml"), model=model.config)
    save_model_folder(tmp_path / "ckpt", model, recipe)
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert {k for k in stored if "router_keep_bias" in k} == {"layers.1.mixer.router_keep_bias",
                                                               "layers.3.mixer.router_keep_bias"}
    assert all(stored[k].dtype == torch.float32 for k in stored if "router_keep_bias" in k)
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    loaded.set_backend("chunked")
    assert loaded.config.router_keep_target == 0.4
    assert all(torch.equal(a, b) for a, b in zip(biases(model), biases(loaded)))
    with torch.no_grad():
        assert torch.equal(loaded(ids), expected)
    assert all(torch.equal(a, b.last_keep) for a, b in zip(routes, loaded.natsl_layers().values()))
    half, _ = load_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert all(b.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(biases(model), biases(half)))
    # weights that lack the bias (saved without it) do not match a config that has one
    save_file({k: v for k, v in stored.items() if "router_keep_bias" not in k}, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(NatslError, match="lacks tensor layers.1.mixer.router_keep_bias"):
        load_checkpoint(tmp_path / "ckpt")


# -- compiled training ---------------------------------------------------------------------------

@pytest.mark.slow
def test_compiled_training_forward_updates_the_bias_as_eager():
    """The update is in-place work on a buffer inside the forward (as BatchNorm's running statistics): the
    layer's route compiled whole by Inductor (fullgraph: no graph break, no host read) and the whole model's
    hidden states through dynamo and AOT autograd (aot_eager: the trainer's tracing, without the minutes of
    CPU code generation for the full model) move the bias as eager steps do, with the same gradients."""
    from natsl.training.trainer import HiddenStates

    eager = tiny_model("chunked", **LAYOUTS["natsl_hybrid"], router_keep_target=0.5, router_bias_rate=0.01).train()
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        for layer in model.natsl_layers().values():
            layer.router_keep_bias.fill_(0.01)  # near the gaps (~0.1): the signs differ between groups and steps
    route_eager, route_compiled = eager.natsl_layers()[3], compiled.natsl_layers()[3]
    route = torch.compile(route_compiled.route, fullgraph=True)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 4 * BLOCK, eager.config.hidden_size, generator=gen)
    w = torch.randn(2, 4, 2, 2, generator=gen)
    for _ in range(4):
        for fn in (route_eager.route, route):
            keep, write = fn(x)
            (keep * w[..., 0] + write * w[..., 1]).sum().backward()
        assert torch.equal(route_eager.router_keep_bias, route_compiled.router_keep_bias)
    torch.testing.assert_close(route_compiled.router.weight.grad, route_eager.router.weight.grad)
    eager.zero_grad()
    compiled.zero_grad()
    body = torch.compile(HiddenStates(compiled), backend="aot_eager")
    ids = ids_of(2, 4 * BLOCK, 10)
    moves = set()
    for _ in range(3):
        before = biases(eager)
        eager.hidden_states(ids).square().mean().backward()
        body(ids, None).square().mean().backward()
        assert all(torch.equal(a, b) for a, b in zip(biases(eager), biases(compiled)))
        moves |= {round(float(v) * 100) for a, b in zip(biases(eager), before) for v in a - b}
    assert moves <= {-1, 0, 1} and len(moves) > 1
    grads = {n: p.grad for n, p in compiled.named_parameters() if p.grad is not None}
    assert len(grads) > 0
    for name, p in eager.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


# -- the trainer ---------------------------------------------------------------------------------

def test_trainer_logs_the_bias_and_saves_it(tmp_path):
    """metrics.jsonl's step records carry router_bias per layer and group (beside keep_groups); each
    micro-batch's forward moves it by one step (2 per optimizer step here); the checkpoint holds the last value."""
    from natsl.checkpoint import load_checkpoint
    from natsl.config import apply_overrides
    from natsl.training import TrainOptions, train

    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), [
        "model.router_keep_target=0.5", "model.router_bias_rate=0.0625", "train.seq_len=64",
        "train.micro_batch_size=2", "train.tokens_per_step=256", "train.eval_every=1000", "train.save_every=1000",
        "data.path=task:mqar?seq_len=64&pairs=4&vocab=256"])
    out = tmp_path / "run"
    train(recipe, TrainOptions(out_dir=str(out), resume="never", device="cpu", backend="chunked", max_steps=3,
                               progress=False, log=lambda *_: None))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and all(set(r["router_bias"]) == {"1", "3"} for r in steps)
    for n, record in enumerate(steps, start=1):
        for values in record["router_bias"].values():
            assert len(values) == 2 and all(abs(v) <= 2 * n * 0.0625 and (v / 0.0625) % 1 == 0 for v in values)
    model, _ = load_checkpoint(out)
    last = steps[-1]["router_bias"]
    assert all(layer.router_keep_bias.tolist() == last[str(i)] for i, layer in model.natsl_layers().items())


# -- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("router_keep_target", 0), ("router_keep_target", 1.0),
                                        ("router_keep_target", 1.5), ("router_keep_target", float("nan")),
                                        ("router_bias_rate", 0), ("router_bias_rate", -1e-3),
                                        ("router_bias_rate", float("inf"))])
def test_bad_values_name_the_field(key, value):
    with pytest.raises(NatslError, match=f"recipe key 'model.{key}' must be") as err:
        natsl.config.recipe_from_dict({"model": {"router_keep_target": 0.5, key: value}})
    assert "\n" not in str(err.value)


def test_recipe_rules_and_checkpoints_from_before_the_fields(tmp_path):
    from natsl.checkpoint import checkpoint_recipe

    ok = natsl.config.recipe_from_dict({"model": {"router_keep_target": 0.25, "router_bias_rate": 0.01}})
    assert (ok.model.router_keep_target, ok.model.router_bias_rate) == (0.25, 0.01)
    with pytest.raises(NatslError, match="activation_checkpointing"):
        natsl.config.recipe_from_dict({"model": {"router_keep_target": 0.5}, "train": {"activation_checkpointing": True}})
    recipe = natsl.load_recipe(ROOT / "recipes/tiny_hybrid.yaml").to_dict()
    for key in ("router_keep_target", "router_bias_rate"):  # a checkpoint from before them
        del recipe["model"][key]
    loaded = checkpoint_recipe(tmp_path, {"recipe": recipe})
    assert (loaded.model.router_keep_target, loaded.model.router_bias_rate) == (None, 1e-3)
    # the shipped sweep's keep-bias systems: natsl_hybrid.yaml with the two keys set per system, nothing else
    from natsl.training.sweep import load_spec

    base = natsl.load_recipe(ROOT / "recipes/recall/natsl_hybrid.yaml")
    sweep = load_spec(ROOT / "recipes/recall/sweep_h200_target.yaml", tmp_path / "sweep")
    for system, target in (("natsl_hybrid_target", 0.5), ("natsl_hybrid_target25", 0.25)):
        run = next(r for r in sweep.runs if r.system == system and r.seed == 0)
        assert Path(run.recipe).resolve() == (ROOT / "recipes/recall/natsl_hybrid.yaml").resolve()
        shipped = natsl.config.apply_overrides(natsl.load_recipe(run.recipe), run.overrides)
        assert (shipped.model.router_keep_target, shipped.model.router_bias_rate) == (target, 0.001)
        assert dataclasses.replace(shipped.model, router_keep_target=None) == base.model


def test_metrics_plot_draws_the_keep_bias_beside_the_routes(tmp_path):
    """metrics.png gets a third panel, the keep bias per layer and group, when the records carry it."""
    import matplotlib.image

    from natsl.training.metrics import MetricsLog, group_series

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        log.write({"step": step, "loss": 5.0 - step / 10, "keep_groups": {"3": [0.1 * step, 0.5]},
                   "router_bias": {"3": [0.001 * step, -0.001 * step]}})
    log.write({"step": 5, "val_loss": 4.5})
    log.close()
    assert group_series(log.records(), "router_bias")["layer 3 group 1"] == [(s, -0.001 * s) for s in range(1, 6)]
    log.plot(tmp_path / "with_bias.png")
    plain = MetricsLog(tmp_path / "plain.jsonl")
    for record in log.records():
        plain.write({k: v for k, v in record.items() if k != "router_bias"})
    plain.close()
    plain.plot(tmp_path / "without_bias.png")
    widths = [matplotlib.image.imread(tmp_path / name).shape[1] for name in ("with_bias.png", "without_bias.png")]
    assert widths == [1700, 1200]  # three panels of 5 inches (+2) at 100 dpi against two
