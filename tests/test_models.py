"""The model zoo: meta builds, causality, ablation switches, and a tiny NAtS-L Hybrid that learns."""

import dataclasses
from pathlib import Path

import pytest
import torch

import natsl
from natsl.config import ModelConfig
from natsl.models.natsl_layer import NAtSL
from natsl.reference.router import block_mean, route_blocks

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def tiny_config(**changes) -> ModelConfig:
    """The tiny hybrid on the chunked PyTorch backend (pinned to the reference by test_chunked_backend)."""
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml").model
    return dataclasses.replace(base, **{"backend": "chunked", **changes})


def test_meta_build_allocates_nothing():
    model = natsl.build_model(natsl.load_recipe(RECIPES / "800m_hybrid.yaml"), device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_natsl_layer_budget_is_gdn_plus_router_and_mixer():
    cfg = natsl.load_recipe(RECIPES / "800m_hybrid.yaml").model
    d, h, k = cfg.hidden_size, cfg.num_heads, cfg.head_k_dim
    layer = NAtSL(cfg, device="meta")
    n = sum(p.numel() for p in layer.parameters())
    extras = d * 2 * h + h * k * h * cfg.softmax_heads_per_group * 2  # W_r and W_m
    assert 0 < n - 6 * d * d - extras < 0.01 * 6 * d * d  # convs, gates, norms: well under 1%


def test_router_block_mean_handles_a_partial_block():
    x = torch.randn(2, 10, 3, dtype=torch.float64)
    means = block_mean(x, 4)
    assert torch.allclose(means[:, 1], x[:, 4:8].mean(1)) and torch.allclose(means[:, 2], x[:, 8:].mean(1))


def test_router_is_hard_with_softmax_gradient():
    x = torch.randn(1, 12, 5, dtype=torch.float64)
    weight = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    keep, write, probs = route_blocks(x, weight, num_heads=2, block_size=4)
    assert set(keep.unique().tolist()) <= {0.0, 1.0} and torch.equal(keep + write, torch.ones_like(keep))
    assert torch.equal(keep, (probs[..., 0] >= probs[..., 1]).to(keep.dtype))
    coeff = torch.randn_like(keep)
    got = torch.autograd.grad((coeff * keep).sum(), weight, retain_graph=True)[0]
    expected = torch.autograd.grad((coeff * probs[..., 0]).sum(), weight)[0]
    assert torch.allclose(got, expected) and got.abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_model_is_causal_at_every_position(backend):
    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(backend=backend)).double().eval()
    ids = torch.randint(0, 1024, (2, 150))
    with torch.no_grad():
        base = model(ids)
        for cut in (1, 63, 64, 100, 149):
            changed = ids.clone()
            changed[:, cut:] = torch.randint(0, 1024, changed[:, cut:].shape)
            assert torch.equal(model(changed)[:, :cut], base[:, :cut]), cut


ABLATIONS = [
    {"intra_block_output": "softmax"}, {"intra_block_output": "gdn"}, {"decay_skipped_blocks": False},
    {"branch_norm": "after_sum"}, {"branch_norm": "after_sum_state_head", "mix_weights": "none"}, {"mix_input": "x"}, {"mix_weights": "sigmoid"}, {"mix_weights": "linear"},
    {"mix_weights": "none"}, {"block_size": 128}, {"route_grad": "full"}, {"natsl_rope": True},
    {"base_layer": "natsl"}, {"base_layer": "attention", "natsl_layers": []},
]


@pytest.mark.parametrize("changes", ABLATIONS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_ablation_builds_runs_and_differs(changes):
    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (2, 200))
    default = natsl.build_model(tiny_config())
    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(**changes))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    if changes != {"route_grad": "full"}:  # the gradient policy changes no forward value
        with torch.no_grad():
            assert not torch.allclose(default(ids), logits)


def test_tiny_hybrid_learns_and_the_router_gets_gradients():
    torch.manual_seed(0)
    model = natsl.build_model(tiny_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 1024, (4, 192))  # one fixed batch: the model must learn to predict it
    losses, router_grads = [], []
    for _ in range(30):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        router_grads.append(sum(layer.router.weight.grad.abs().sum().item() for layer in model.natsl_layers().values()))
        losses.append(loss.item())
        opt.step()
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(g > 0 for g in router_grads)


@pytest.mark.parametrize("changes", [{"base_layer": "attention", "natsl_layers": [], "attn_rope": True},
                                     {"natsl_rope": True, "attention_layers": [0], "attn_rope": True}],
                         ids=["transformer", "hybrid-with-rope"])
def test_shared_rope_table_gives_the_per_layer_angles(changes, monkeypatch):
    """hidden_states makes RoPE's angles once and hands them to every rotating layer; the logits and
    gradients are bitwise those of each layer computing its own angles from positions 0..T-1."""
    from natsl.models import lm

    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(**changes))
    ids = torch.randint(0, 1024, (2, 150))
    assert model.rope_table(150, ids.device) is not None

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    shared = logits_and_grads()
    monkeypatch.setattr(lm.CausalLM, "rope_table", lambda self, length, device: None)  # each layer its own angles
    per_layer = logits_and_grads()
    assert torch.equal(shared[0], per_layer[0])
    assert len(shared[1]) == len(per_layer[1]) and all(torch.equal(a, b) for a, b in zip(shared[1], per_layer[1]))


def test_no_rope_table_without_a_rotating_layer():
    model = natsl.build_model(tiny_config(), device="meta")
    assert model.rope_table(64, "cpu") is None


@pytest.mark.slow
def test_compiled_hidden_states_read_a_table_made_outside():
    """As `natsl train` runs them: the RoPE table made eagerly and passed into the compiled hidden
    states (fullgraph); same states as eager, and a new table of the same length compiles nothing new."""
    from natsl.training.trainer import HiddenStates

    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(base_layer="attention", natsl_layers=[], attn_rope=True, backend=None))
    ids = torch.randint(0, 1024, (2, 96))
    eager = model.hidden_states(ids)
    compiled = torch.compile(HiddenStates(model), fullgraph=True)
    torch._dynamo.utils.counters.clear()
    got = compiled(ids, model.rope_table(96, ids.device))
    again = compiled(ids, model.rope_table(96, ids.device))
    assert torch.allclose(got, eager, rtol=1e-4, atol=1e-5) and torch.equal(got, again)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("base_layer", ["gdn", "attention"])
def test_concatenated_projections_give_the_separate_products(base_layer, monkeypatch, use_switches):
    """Every group run as one product over its concatenated (zero-padded) weights gives, in fp32, the
    logits and every parameter's gradient of one product per weight; a padded concatenation is
    really taken (the H-wide gate inputs: 2 x 2 rows padded to 8)."""
    from natsl.models import merged

    torch.manual_seed(0)
    model = natsl.build_model(tiny_config(base_layer=base_layer, attn_rope=base_layer == "attention"))
    ids = torch.randint(0, 1024, (2, 70))

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    products = []
    real_linear = merged.linear
    monkeypatch.setattr(merged, "linear", lambda x, w: products.append(tuple(w.shape)) or real_linear(x, w))
    use_switches(concat_linears="none")
    separate = logits_and_grads()
    assert products == []  # one nn.Linear call each
    use_switches(concat_linears="all")
    together = logits_and_grads()
    if base_layer == "gdn":
        assert (8, 64) in products and (2 * 32 + 2 * 32 + 2 * 64, 64) in products  # a, b; q, k, v
    assert (2 * 192, 64) in products  # SwiGLU's gate and up
    torch.testing.assert_close(together[0], separate[0], rtol=1e-5, atol=1e-6)
    assert together[1].keys() == separate[1].keys()
    for name, grad in separate[1].items():
        torch.testing.assert_close(together[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_concat_labels_from_the_switch(use_switches):
    from natsl.errors import NatslError
    from natsl.models import merged

    use_switches(concat_linears="gate_up, gdn_ab")
    assert merged._concat_labels() == {"gate_up", "gdn_ab"}
    use_switches(concat_linears="all")
    assert merged._concat_labels() == set(merged.CONCAT_LABELS)
    use_switches(concat_linears="none")
    assert merged._concat_labels() == set()
    use_switches(concat_linears="gate_up,qkvab")
    with pytest.raises(NatslError, match="unknown groups \\['qkvab'\\]"):
        merged._concat_labels()
    use_switches(concat_linears="gdn_ab")
    assert merged._concat_labels(grad=True) == {"gdn_ab"}  # a set switch holds with and without gradients
    use_switches(concat_linears=None)
    assert merged._concat_labels() == merged.CONCAT_DEFAULT == {"gdn_ab"}
    assert merged._concat_labels(grad=True) == merged.CONCAT_DEFAULT_GRAD == {"gdn_ab", "gdn_qkv"}


def test_gdn_qkv_concatenates_by_default_only_with_gradients(monkeypatch, use_switches):
    """The defaults: a GDN layer's q, k, v run as one product when autograd records (training), apart
    without gradients (prefill); a and b together in both."""
    from natsl.models import merged

    use_switches(concat_linears=None)
    torch.manual_seed(5)
    linears = [torch.nn.Linear(16, n, bias=False) for n in (8, 8, 12)]
    x = torch.randn(3, 16)
    products = []
    real_linear = merged.linear
    monkeypatch.setattr(merged, "linear", lambda inp, w: products.append(tuple(w.shape)) or real_linear(inp, w))
    with torch.no_grad():
        apart = merged.group_product("gdn_qkv", linears, x)
    assert products == []
    together = merged.group_product("gdn_qkv", linears, x)
    assert products == [(8 + 8 + 12 + 4, 16)]  # padded to a multiple of ALIGN_ROWS
    for a, b in zip(apart, together):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    gates = [torch.nn.Linear(16, 2, bias=False) for _ in range(2)]  # a, b: H-wide
    products.clear()
    with torch.no_grad():
        merged.group_product("gdn_ab", gates, x)
    merged.group_product("gdn_ab", gates, x)
    assert products == [(2 + 2 + 4, 16)] * 2


@pytest.mark.parametrize("bias", [False, True])
def test_aligned_linear_equals_the_plain_product_with_gradients(bias, monkeypatch):
    """natsl.models.linear.aligned_linear pads a 36-wide weight (the NAtS-L W_m) to 40 zero-filled rows
    and slices: the same output and input/weight/bias gradients as the layer itself (fp32), and the
    product really ran on the padded weight."""
    from natsl.models import linear as linear_module

    monkeypatch.setattr(linear_module, "_has_aligned_kernels", lambda x: True)
    torch.manual_seed(3)
    layer = linear_module.Linear(48, 36, bias=bias)
    x = torch.randn(2, 70, 48)
    widths = []
    real_linear = torch.nn.functional.linear

    def spy(inp, weight, b=None):
        widths.append(weight.shape[0])
        return real_linear(inp, weight, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)  # the products of natsl.ops.gemv.linear
    results = []
    for fn in (lambda t: linear_module.aligned_linear(t, layer), layer):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = fn(xi)
        (y * torch.linspace(-1, 1, 36)).sum().backward()
        results.append((y.detach(), xi.grad, layer.weight.grad.clone(), None if not bias else layer.bias.grad.clone()))
    assert widths == [40, 36]
    (y_a, dx_a, dw_a, db_a), (y_p, dx_p, dw_p, db_p) = results
    assert y_a.shape == y_p.shape == (2, 70, 36)
    torch.testing.assert_close(y_a, y_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_a, dx_p, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw_a, dw_p, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(db_a, db_p, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_gpu_aligned_linear_at_the_800m_mix_shape():
    """bf16, 8 x 4096 rows of the 800M NAtS-L W_m (1152 -> 36): padded product against the fp32 product."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from natsl.models.linear import Linear, aligned_linear

    torch.manual_seed(4)
    layer = Linear(1152, 36, bias=False, device="cuda").to(torch.bfloat16)
    x = torch.randn(8, 4096, 1152, device="cuda").to(torch.bfloat16).requires_grad_()
    y = aligned_linear(x, layer)
    ref = x.detach().float() @ layer.weight.detach().float().t()
    assert ((y.float() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt() < 5e-3
    y.float().sum().backward()
    dw = torch.ones(8 * 4096, 36, device="cuda").t() @ x.detach().float().reshape(-1, 1152)
    assert ((layer.weight.grad.float() - dw).pow(2).mean() / dw.pow(2).mean()).sqrt() < 1e-2
