"""Routing lives in one place (natsl.reference.router.route_means): the full-sequence forward, the cached
prefill, token-by-token decode and the fused decode block end (natsl.ops.block_end.close_block, eagerly
on the CPU) take the same route for every block and routing group, with a router that routes blocks
both ways, with and without the keep bias, with and without a KeepFraction override, and with the keep
budget (which the compiled block end leaves to the eager one). Tiny models as tests/test_inference.py
builds them (block_size 16). The commit of the state after a route is one rule too
(natsl.reference.router.commit_block): the training kernels and the decode path's token steps and block-end
commits leave the same state.
"""

from types import SimpleNamespace

import pytest
import torch
from test_inference import BLOCK, LAYOUTS, natsl_layer_inputs, prefill_then_decode, tiny_model

from natsl.models.routing import force_keep_fraction
from natsl.ops import kernel_set

LENGTH = 5 * BLOCK + 3  # five complete blocks and a partial one


def ids_of(seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (2, LENGTH), generator=torch.Generator().manual_seed(seed))


def trained_looking_model(bias: bool, budget: bool, override: bool):
    """A tiny NAtS-L hybrid whose routers have large random weights (so blocks go both ways), a random
    nonzero keep bias where `bias`, the keep budget 0.5 where `budget`, a KeepFraction(0.5) where `override`."""
    changes = {"router_keep_target": 0.5} if bias else {}
    if budget:
        changes["router_keep_budget"] = 0.5
    model = tiny_model("reference", **LAYOUTS["natsl_hybrid"], **changes)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in model.natsl_layers().values():
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen))
            if bias:
                layer.router_keep_bias.copy_(torch.randn(layer.num_heads, generator=gen))
    if override:
        force_keep_fraction(model, 0.5, seed=4)
    return model


def recorded_routes(model):
    """Wrap each NAtS-L layer's `decide_routes` (the cached prefill's and the decode block end's route) to
    record keep [B, H] per absolute block; a later call for a block overwrites an earlier one (a decode
    step in mid-block routes its unfinished block too, and its block end comes last)."""
    routes = {i: {} for i in model.natsl_layers()}
    for i, layer in model.natsl_layers().items():
        def recording(sums, count, block_index, cache=None, layer=layer, seen=routes[i]):
            keep, write = type(layer).decide_routes(layer, sums, count, block_index, cache)
            index = block_index.expand(keep.shape[0], -1)
            for n in range(keep.shape[1]):
                assert torch.equal(index[:, n], index[0, n].expand(keep.shape[0]))  # all rows at one block
                seen[int(index[0, n])] = keep[:, n].clone()
            return keep, write
        layer.decide_routes = recording
    return routes


def fused_block_end_routes(model, inputs) -> dict:
    """Each NAtS-L layer's routes [B, NB, H] of the complete blocks by the fused kernel set's block end
    (`Fused.close_block`, on its compiled form natsl.ops.block_end.close_block where that applies, run
    eagerly here), fed the block's first C-1 tokens as the running sum and its last token: kept_len grows
    by C for each kept group."""
    fused = kernel_set.Fused("reference")
    routes = {}
    for i, layer in model.natsl_layers().items():
        x = inputs[i].float()
        B, H, C = x.shape[0], layer.num_heads, BLOCK
        K, V = model.config.head_k_dim, model.config.head_v_dim
        keeps = []
        for n in range(LENGTH // C):
            block = x[:, n * C:(n + 1) * C]
            cache = SimpleNamespace(x_sum=block[:, :-1].sum(1), state_start=torch.zeros(B, H, K, V),
                                    state_run=torch.zeros(B, H, K, V), decay_sum=torch.zeros(B, H),
                                    kept_len=torch.zeros(B, H, dtype=torch.long), keep_gaps=None)
            pos = torch.full((B,), n * C + C - 1)
            fused.close_block(cache, block[:, -1], pos, layer.router.weight, layer.route_override, layer.decide_routes,
                              C, True, router_bias=layer.router_keep_bias)
            keeps.append(cache.kept_len // C)
        routes[i] = torch.stack(keeps, 1).float()
    return routes


@pytest.mark.parametrize("override", [False, True], ids=["router", "override"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_every_path_takes_the_same_route(bias, override):
    model = trained_looking_model(bias, budget=False, override=override)
    ids = ids_of(3)
    complete = LENGTH // BLOCK
    with torch.no_grad():
        inputs = natsl_layer_inputs(model, ids)
        full = {i: layer.last_keep[:, :complete].clone() for i, layer in model.natsl_layers().items()}
        for i, keep in full.items():  # blocks go both ways in every layer (else the test says little)
            assert 0 < float(keep.mean()) < 1, (i, keep)
        if bias and not override:  # the bias decides some routes
            for i, layer in model.natsl_layers().items():
                bias_before = layer.router_keep_bias.clone()
                layer.router_keep_bias.zero_()
                unbiased = layer.route(inputs[i])[0][:, :complete]
                layer.router_keep_bias.copy_(bias_before)
                assert not torch.equal(unbiased, full[i])
        fused = fused_block_end_routes(model, inputs)
        for chunks in ([BLOCK + 3], [7], [LENGTH - 1]):  # prefill then decode across block ends; prefill alone
            routes = recorded_routes(model)
            prefill_then_decode(model, ids, chunks)
            for i, keep in full.items():
                cached = torch.stack([routes[i][n] for n in range(complete)], 1)
                assert torch.equal(cached, keep), (chunks, i)
                assert torch.equal(fused[i], keep), i


def test_the_keep_budget_routes_alike_on_every_path():
    """With model.router_keep_budget: the full forward, prefill and decode apply it and agree; the fused
    kernel set's block end hands it to the eager block end (its compiled form has no budget), which routes
    by the layer's decide_routes, as the plain decode does."""
    model = trained_looking_model(bias=True, budget=True, override=False)
    unbudgeted = trained_looking_model(bias=True, budget=False, override=False)
    ids = ids_of(5)
    complete = LENGTH // BLOCK
    with torch.no_grad():
        unbudgeted(ids)
        model(ids)
        full = {i: layer.last_keep[:, :complete].clone() for i, layer in model.natsl_layers().items()}
        assert any(not torch.equal(a.last_keep, b.last_keep)
                   for a, b in zip(model.natsl_layers().values(), unbudgeted.natsl_layers().values()))
        for chunks in ([BLOCK + 3], [7]):
            routes = recorded_routes(model)
            prefill_then_decode(model, ids, chunks)
            for i, keep in full.items():
                assert torch.equal(torch.stack([routes[i][n] for n in range(complete)], 1), keep), (chunks, i)
    assert not kernel_set.Reference.compiled_block_end(None, keep_budget=True)
    assert kernel_set.Reference.compiled_block_end(model.natsl_layers()[1].route_override, keep_budget=False)


@pytest.mark.parametrize("decay_skipped_blocks", [True, False], ids=["decay", "no_decay_ablation"])
@pytest.mark.parametrize("length", [4 * BLOCK, 3 * BLOCK + 5], ids=["whole_blocks", "partial_last"])
def test_every_path_commits_the_state_alike(decay_skipped_blocks, length):
    """The commit lives in one place too (natsl.reference.router.commit_block): the training kernels (token
    recurrence and chunked), and the decode path (a token step per token, natsl.ops.cached.commit_state at each
    block end, as the cached layer and both block ends do) leave the same state after the same routes."""
    from natsl.ops.cached import commit_state
    from natsl.reference.cached import gated_delta_step
    from natsl.reference.gated_delta import gated_delta_rule
    from natsl.reference.gated_delta_chunked import gated_delta_rule as chunked_rule

    gen = torch.Generator().manual_seed(11)
    B, H, K, V = 2, 3, 8, 8
    q = torch.nn.functional.normalize(torch.randn(B, length, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, length, H, K, generator=gen), dim=-1)
    v = torch.randn(B, length, H, V, generator=gen)
    g = -torch.rand(B, length, H, generator=gen) * 0.2
    beta = torch.rand(B, length, H, generator=gen)
    blocks = -(-length // BLOCK)
    write = torch.randint(0, 2, (B, blocks, H), generator=gen).float()
    assert 0 < float(write.mean()) < 1
    start = torch.randn(B, H, K, V, generator=gen)
    states = {}
    for name, rule in (("token recurrence", gated_delta_rule), ("chunked", chunked_rule)):
        _, states[name] = rule(q, k, v, g, beta, write, initial_state=start, output_final_state=True,
                               block_size=BLOCK, decay_skipped_blocks=decay_skipped_blocks)
    committed, running, decay = start.clone(), start.clone(), torch.zeros(B, H)
    for t in range(length):  # the decode path: a token step, and a commit where a block ends
        _, running = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], running)
        decay = decay + g[:, t]
        if t % BLOCK == BLOCK - 1:
            committed = commit_state(committed, running, decay, write[:, t // BLOCK], decay_skipped_blocks)
            running, decay = committed.clone(), torch.zeros(B, H)
    if length % BLOCK:  # a partial last block: the training kernels commit it by its route too
        committed = commit_state(committed, running, decay, write[:, -1], decay_skipped_blocks)
    for name, state in states.items():
        assert torch.allclose(state, committed, rtol=1e-5, atol=1e-5), name
