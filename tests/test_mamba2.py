"""The Mamba2 layer and NAtS-L on a Mamba2 state: each against Mamba2's recurrence written out token by
token here, Mamba2's init, and `natsl train` / `bench-latency` / `info` / `inspect-routing` on tiny models of both.
(Prefill + decode against the full forward: tests/test_inference.py's mamba2 layouts and its conv-bias test.)"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner
import yaml

import natsl
from natsl.checkpoint import load_checkpoint, save_model_folder
from natsl.cli.main import app
from natsl.config import Recipe
from natsl.models.mamba2 import Mamba2, Mamba2StateProjections

from cli_checks import assert_one_line_error

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TINY_MAMBA2 = {"mamba2_head_dim": 16, "mamba2_state_size": 8, "mamba2_groups": 2}  # 8 heads, 4 per group
# The fast backend's tests run on the GPU where there is one (its kernels take no CPU tensors there), else
# in Triton's interpreter on the CPU (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_config(**changes):
    base = natsl.load_recipe(RECIPES / "tiny_hybrid.yaml").model
    return dataclasses.replace(base, **{"backend": "reference", "block_size": 8, **TINY_MAMBA2, **changes})


def ssd_by_token(C, B, x, dt, A, D):
    """Mamba2's recurrence as its paper writes it, per head: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,
    y_t = C_t^T h_t + D x_t. C, B [T, H, N]; x [T, H, P]; dt [T, H]; A, D [H] -> y [T, H, P]."""
    h = torch.zeros(B.shape[1], B.shape[2], x.shape[2], dtype=x.dtype)
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t] * A)[:, None, None] * h + dt[t][:, None, None] * B[t][:, :, None] * x[t][:, None, :]
        ys.append(torch.einsum("hn,hnp->hp", C[t], h) + D[:, None] * x[t])
    return torch.stack(ys)


@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("T", [1, 7, 19])
def test_mamba2_layer_is_the_ssd_recurrence(T, conv_bias):
    config = tiny_config(base_layer="mamba2", natsl_layers=[], intermediate_size=0, mamba2_conv_bias=conv_bias)
    torch.manual_seed(0)
    layer = Mamba2(config).double()
    assert (layer.conv.bias is not None) == conv_bias
    bias = torch.zeros(layer.conv_dim, dtype=torch.float64)
    with torch.no_grad():
        layer.D.uniform_(0.5, 1.5)  # not all ones, so a D that multiplies the wrong thing shows
        layer.norm.weight.uniform_(0.5, 1.5)
        if conv_bias:  # off its zero init, so a bias left out (or added after the SiLU) shows
            bias = layer.conv.bias.uniform_(-1.0, 1.0).clone()
    x = torch.randn(1, T, config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)[0]
        z, xbc, a = layer.in_proj(x[0]).split([layer.inner, layer.conv_dim, layer.num_heads], dim=-1)
        pad = torch.cat([xbc.new_zeros(config.conv_size - 1, layer.conv_dim), xbc])
        w = layer.conv.weight[:, 0]  # [channels, width]: y_t = sum_j w_j x_{t - width + 1 + j}
        xbc = F.silu(torch.stack([(pad[t:t + config.conv_size].T * w).sum(-1) + bias for t in range(T)]))
        xs, B, C = xbc.split([layer.inner, 2 * 8, 2 * 8], dim=-1)
        B = B.view(T, 2, 8).repeat_interleave(4, dim=1)  # group g serves heads 4g .. 4g+3
        C = C.view(T, 2, 8).repeat_interleave(4, dim=1)
        dt = F.softplus(a + layer.dt_bias)
        y = ssd_by_token(C, B, xs.view(T, 8, 16), dt, -layer.A_log.exp(), layer.D).reshape(T, -1)
        gated = y * F.silu(z)  # Mamba2 gates before its norm (norm_before_gate=False), over all channels
        expected = layer.out_proj(gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + config.norm_eps)
                                  * layer.norm.weight)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("T", [1, 37])
def test_mamba2_forward_without_autograd_runs_the_fused_kernels(T, monkeypatch, use_switches):
    """Evaluation's full forward (no autograd, no cache: eval-ppl's windows) takes the fused kernel set
    for the write x dt and the skip + gated norm, and computes what the training forward (the compiled
    formulas) does; with autograd on, the fused kernels are never called."""
    from natsl import ops
    from natsl.devices import triton_interpreted

    if DEVICE == "cpu" and not triton_interpreted():
        pytest.skip("the fused kernels need CUDA or the Triton interpreter")
    use_switches(force_fused_inference=True)
    config = tiny_config(base_layer="mamba2", natsl_layers=[], intermediate_size=0)
    torch.manual_seed(0)
    layer = Mamba2(config).to(DEVICE)
    with torch.no_grad():
        layer.D.uniform_(0.5, 1.5)
        layer.norm.weight.uniform_(0.5, 1.5)
    calls = []
    for family in ("step_values", "gated_input_rms_norm"):
        fast = ops.twin(family, True)
        monkeypatch.setitem(ops._LOADED, (family, True),
                            lambda *args, fast=fast, family=family, **kw: calls.append(family) or fast(*args, **kw))
    x = torch.randn(2, T, config.hidden_size, device=DEVICE)
    trained = layer(x)
    assert calls == []
    with torch.no_grad():
        evaluated = layer(x)
    assert sorted(calls) == ["gated_input_rms_norm", "step_values"]
    assert float((evaluated - trained.detach()).abs().max() / trained.detach().abs().max()) < 1e-5


def test_a_biased_conv_never_reaches_the_triton_kernels(monkeypatch):
    """natsl.ops.short_conv sends a call with a bias to the reference formula on the fast backend too,
    full sequence and cached chunk (fused) alike; the kernels take no bias."""
    from natsl.ops import short_conv as door
    from natsl.reference.short_conv import short_conv_silu

    def no_twin(*args, **kwargs):
        raise AssertionError("a biased conv reached a fast twin")

    monkeypatch.setattr(door, "twin", no_twin)
    monkeypatch.setattr(door, "resolve_backend", lambda backend, device: "fast")
    g = torch.Generator().manual_seed(5)
    x, w, b, tail = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((2, 6, 5), (5, 1, 4), (5,),
                                                                                       (2, 3, 5)))
    with torch.no_grad():
        got = door.short_conv_silu(x, w, bias=b, backend="fast")
        cached = door.short_conv_silu(x, w, tail, bias=b, backend="fast", fused=True)
    # against PyTorch's biased depthwise conv over the inputs before x (zeros, then the tail) and x
    for before, y in ((x.new_zeros(2, 3, 5), got), (tail, cached)):
        conv = F.conv1d(torch.cat([before, x], 1).transpose(1, 2), w, b, groups=5).transpose(1, 2)
        torch.testing.assert_close(y, F.silu(conv))
    assert not torch.allclose(got, short_conv_silu(x, w))  # the bias matters here


def l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("l2_heads, skip", [(True, False), (False, True)])
def test_natsl_state_branch_is_the_ssd_with_the_write_mask(l2_heads, skip):
    """The linear branch of NAtS-L on a Mamba2 state: the layer's q, k, v read as C, B, x, written with
    v dt and decayed by A dt; a dropped block decays the committed state but adds nothing. Default (the
    authors' natsl_attn_mamba2): q, k L2-normalised per head, no D; the other form: unnormalised, + D v."""
    config = tiny_config(base_layer="natsl", natsl_layers=[], natsl_state="mamba2", mamba2_state_l2=l2_heads,
                         mamba2_state_skip=skip)
    torch.manual_seed(1)
    proj = Mamba2StateProjections(config).double()
    assert not hasattr(proj, "b_proj") and (proj.D is not None) == skip
    T, C_ = 21, config.block_size
    x = torch.randn(1, T, config.hidden_size, dtype=torch.float64)
    write = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]], dtype=torch.float64)  # [B, NB=3, H=2]
    with torch.no_grad():
        if skip:
            proj.D.uniform_(0.5, 1.5)
        q, k, v, g, dt, _ = proj(x)
        ql, kl, vl = proj.split_heads(q, k, v)
        o, _ = proj.rule(ql, kl, vl, g, dt, write, block_size=C_, backend="reference")
        got = proj.skip(o, vl)[0]
        # by token, from the raw conv outputs: run each block from its committed state, then commit
        h, K, V = config.num_heads, config.head_k_dim, config.head_v_dim
        qh, kh, vh = q[0].view(T, h, K), k[0].view(T, h, K), v[0].view(T, h, V)
        if l2_heads:
            qh, kh = l2(qh), l2(kh)
        A = -proj.A_log.exp()
        S = torch.zeros(h, K, V, dtype=torch.float64)
        outs = []
        for b0 in range(0, T, C_):
            start, gamma = S.clone(), torch.ones(h, dtype=torch.float64)
            for t in range(b0, min(b0 + C_, T)):
                decay = torch.exp(dt[0, t] * A)
                gamma = gamma * decay
                S = decay[:, None, None] * S + dt[0, t][:, None, None] * kh[t][:, :, None] * vh[t][:, None, :]
                out = torch.einsum("hk,hkv->hv", qh[t], S)
                outs.append(out + proj.D[:, None] * vh[t] if skip else out)
            w = write[0, b0 // C_][:, None, None]
            S = gamma[:, None, None] * start + w * (S - gamma[:, None, None] * start)
    torch.testing.assert_close(got, torch.stack(outs), rtol=1e-10, atol=1e-12)


def test_the_skip_saves_no_fp32_copy_of_x_and_computes_what_it_did():
    """add_skip (y + D x) multiplies D by x in x's own dtype (promoted, the same values): a bf16 x is
    saved for D's gradient as it is, not as an fp32 copy (which torch.compile's partitioner kept as
    well, 12 KiB a token a layer at 800M), and the result and every gradient are bit for bit those of
    the formula with the explicit upcast."""
    from natsl.reference.gates import add_skip

    torch.manual_seed(0)
    o, x = (torch.randn(2, 5, 3, 4).bfloat16().requires_grad_() for _ in range(2))
    D = torch.rand(3).add_(0.5).requires_grad_()
    dy = torch.randn(2, 5, 3, 4).bfloat16()

    def run(fn):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fn(o, x, D)
        grads = torch.autograd.grad(y, (o, x, D), dy)
        fresh = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                 if t.untyped_storage().data_ptr() not in {u.untyped_storage().data_ptr() for u in (o, x, D)}}
        return y, grads, sum(fresh.values()), saved

    def upcast_first(o, x, D):  # the formula before
        dtype = torch.promote_types(o.dtype, torch.float32)
        return (o.to(dtype) + D.to(dtype)[:, None] * x.to(dtype)).to(o.dtype)

    y, grads, fresh_bytes, saved = run(add_skip)
    y0, grads0, fresh_bytes0, _ = run(upcast_first)
    assert torch.equal(y, y0) and all(torch.equal(g, g0) for g, g0 in zip(grads, grads0))
    assert fresh_bytes0 >= x.numel() * 4 and fresh_bytes < fresh_bytes0 and fresh_bytes < x.numel() * 4
    assert not any(t.dtype == torch.float32 and t.shape == x.shape for t in saved)
    # fp64 (the recurrence tests): unchanged; a wider x than the output is still cut to fp32 first
    o64, x64, D64 = o.double(), x.double(), D.double()
    assert torch.equal(add_skip(o64, x64, D64), upcast_first(o64, x64, D64))
    assert torch.equal(add_skip(o.float(), x64, D), upcast_first(o.float(), x64, D))


def expanded_ssd(monkeypatch):
    """natsl.ops.gated_linear_rule as Mamba2 called it before grouped q, k: B and C repeat_interleave'd
    to every head first (returned to restore the grouped call); records the q heads of each call."""
    grouped, calls = natsl.ops.gated_linear_rule, []

    def expanded(q, k, v, *args, **kwargs):
        calls.append(q.shape[2])
        per_group = v.shape[2] // q.shape[2]
        return grouped(q.repeat_interleave(per_group, dim=2), k.repeat_interleave(per_group, dim=2), v, *args,
                       **kwargs)

    def use(old: bool):
        monkeypatch.setattr(natsl.ops, "gated_linear_rule", expanded if old else grouped)
    return use, calls


def mamba2_layer(backend, dtype, device="cpu"):
    """Built and initialised on the CPU (the same weights on every device), then moved to `device`."""
    config = tiny_config(base_layer="mamba2", natsl_layers=[], intermediate_size=0, backend=backend)
    torch.manual_seed(0)
    layer = Mamba2(config).to(dtype)
    with torch.no_grad():
        layer.D.uniform_(0.5, 1.5)
    return layer.to(device)


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("fast", torch.float32)])
def test_mamba2_passes_grouped_b_c_and_computes_what_the_expanded_call_did(monkeypatch, backend, dtype):
    """The layer hands the SSD op B and C on their G groups (not repeat_interleave'd to the H heads):
    output bit for bit and every gradient (x's and each parameter's) as with the expanded call, dB and
    dC summed per group inside the op instead of by repeat_interleave's backward."""
    use, calls = expanded_ssd(monkeypatch)
    device = DEVICE if backend == "fast" else "cpu"
    layer = mamba2_layer(backend, dtype, device)
    x = torch.randn(2, 37, layer.config.hidden_size, dtype=dtype).to(device)
    results = []
    for old in (False, True):
        use(old)
        leaf = x.clone().requires_grad_()
        y = layer(leaf)
        dy = torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y).to(device)
        grads = torch.autograd.grad(y, [leaf, *layer.parameters()], dy)
        results.append((y, grads))
    assert calls == [layer.groups] and layer.groups < layer.num_heads
    (y, grads), (y0, grads0) = results
    assert torch.equal(y, y0)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0, **tol)


def test_mamba2_saves_no_expanded_b_c_for_backward(monkeypatch, use_switches):
    """The saved tensors of one Mamba2 layer's forward (fast SSD op, eager, saved_tensors_hooks; storages
    counted once, parameters and the input left out): at least the two H/G-fold expanded copies of B
    and C fewer bytes than with the expanded call (the grouped B, C saved are views of the conv's output,
    which the backward keeps anyway). At 800M (48 heads, 1 group, N 128, bf16): 24 KiB a token a layer."""
    use_switches(compile_pointwise="0")  # on a GPU too the eager pieces around the op: what the CPU counts
    use, _ = expanded_ssd(monkeypatch)
    layer = mamba2_layer("fast", torch.float32, DEVICE)
    x = torch.randn(1, 16, layer.config.hidden_size).to(DEVICE).requires_grad_()
    known = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters())}

    def saved_bytes():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            layer(x)
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                    if t.untyped_storage().data_ptr() not in known}.values())

    use(True)
    before = saved_bytes()
    use(False)
    after = saved_bytes()
    expanded_b_c = 2 * x.shape[0] * x.shape[1] * layer.num_heads * layer.state_size * x.element_size()
    assert before - after >= expanded_b_c, (before, after, expanded_b_c)


def test_mamba2_compiled_saves_no_expanded_b_c_for_backward(monkeypatch, use_switches):
    """The same under torch.compile (fullgraph, the fast SSD custom op and its fake impl with grouped B, C;
    AOT autograd with the min-cut partitioner, as inductor partitions; bf16 autocast): the forward graph
    saves no [b, t, H, N] copy of B or C, and at least their expanded bytes less the grouped ones fewer
    bytes than with the expanded call."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    use_switches(compile_pointwise="0")  # the pieces' formulas traced as on the CPU, not nested compiles
    use, _ = expanded_ssd(monkeypatch)
    layer = mamba2_layer("fast", torch.float32, DEVICE)
    b, t, H, G, N = 1, 16, layer.num_heads, layer.groups, layer.state_size

    def saved():
        graphs = []

        def fw_compiler(gm, _):
            outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            graphs.append([o.meta["val"] for o in outputs[1:] if isinstance(o.meta.get("val"), torch.Tensor)])
            return make_boxed_func(gm)

        def backend(gm, inputs):
            return aot_module_simplified(gm, inputs, fw_compiler=fw_compiler,
                                         bw_compiler=lambda gm, _: make_boxed_func(gm),
                                         partition_fn=min_cut_rematerialization_partition)

        torch._dynamo.reset()
        x = torch.randn(b, t, layer.config.hidden_size).to(DEVICE).requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = torch.compile(layer, backend=backend, fullgraph=True)(x)
        y.float().sum().backward()
        (tensors,) = graphs
        return tensors

    use(True)
    before = saved()
    use(False)
    after = saved()
    torch._dynamo.reset()
    nbytes = lambda ts: sum(v.numel() * v.element_size() for v in ts)  # noqa: E731
    assert sum(tuple(v.shape) == (b, t, H, N) for v in before) == 2
    assert not any(tuple(v.shape) == (b, t, H, N) for v in after)
    assert nbytes(before) - nbytes(after) >= 2 * b * t * (H - G) * N * 2, (nbytes(before), nbytes(after))


def test_mamba2_init():
    torch.manual_seed(2)
    config = tiny_config(base_layer="mamba2", natsl_layers=[1], natsl_state="mamba2", hidden_size=256,
                         mamba2_state_skip=True)
    model = natsl.build_model(config)
    for mixer, a_min in ((model.layers[0].mixer, 1.0), (model.layers[1].mixer.proj, 0.0)):
        A = mixer.A_log.exp()
        dt = F.softplus(mixer.dt_bias)
        # Mamba2 layers: A ~ U(1, 16); the NAtS-L state, as the authors' natsl_attn_mamba2: U(0, 16)
        assert (A >= a_min).all() and (A <= 16).all()
        assert (dt >= 1e-3 * (1 - 1e-5)).all() and (dt <= 0.1 * (1 + 1e-5)).all()
        assert torch.equal(mixer.D, torch.ones_like(mixer.D))
        assert all(getattr(p, "_no_weight_decay", False) for p in (mixer.A_log, mixer.dt_bias, mixer.D))
    # log-uniform dt: its log spreads over [log 1e-3, log 0.1] (32 heads: the median lies mid-range)
    dt = F.softplus(model.layers[0].mixer.dt_bias.detach())
    assert abs(float(dt.log().median()) - (math.log(1e-3) + math.log(0.1)) / 2) < 1.0


def test_mamba2_blocks_hold_no_mlp_unless_asked():
    """The MLP rule: intermediate_size gives every block but a Mamba2 block its SwiGLU (the authors'
    NAtS-L Mamba2 model); mamba2_mlp gives the Mamba2 blocks one too (natsl's first hybrids)."""
    config = tiny_config(base_layer="mamba2", natsl_layers=[1], natsl_state="mamba2")
    assert [b.mlp is None for b in natsl.build_model(config, device="meta").layers] == [True, False, True, True]
    both = natsl.build_model(dataclasses.replace(config, mamba2_mlp=True), device="meta")
    assert all(b.mlp is not None for b in both.layers)
    assert both.layers[0].mlp.gate_proj.weight.shape == (config.intermediate_size, config.hidden_size)


def write_tiny_recipe(path: Path, **model) -> Path:
    data = yaml.safe_load((RECIPES / "tiny_hybrid.yaml").read_text())
    data["name"] = path.stem
    data["model"].update({**TINY_MAMBA2, "block_size": 16, **model})
    path.write_text(yaml.safe_dump(data))
    return path


TINY_SYSTEMS = {"mamba2": dict(base_layer="mamba2", natsl_layers=[], intermediate_size=0),
                "natsl_mamba2": dict(base_layer="mamba2", natsl_layers=[1, 3], natsl_state="mamba2"),
                # the first form: unnormalised state q, k with D v, and an MLP in every block
                "natsl_mamba2_ssd": dict(base_layer="mamba2", natsl_layers=[1, 3], natsl_state="mamba2",
                                         mamba2_state_l2=False, mamba2_state_skip=True, mamba2_mlp=True)}


@pytest.mark.parametrize("system", TINY_SYSTEMS)
def test_natsl_train_lowers_the_loss_of_tiny_mamba2_models(system, tmp_path, natsl_cache_dir):
    """On the CPU on any machine (--device cpu), from ln(1024) ~ 6.93: 20 steps, so that the 0.5 drop holds
    with a margin across seeds and torch releases (12 steps sat at its edge)."""
    recipe = write_tiny_recipe(tmp_path / f"tiny_{system}.yaml", **TINY_SYSTEMS[system])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", str(recipe), "--set", "train.seq_len=64", "train.micro_batch_size=4", "train.tokens_per_step=256",
        "optim.warmup_tokens=0", "train.eval_every=1000", "train.save_every=1000", "--max-steps", "20",
        "--device", "cpu", "--backend", "chunked", "--no-progress", "--out", str(out)],
        env={"NATSL_CACHE_DIR": natsl_cache_dir, "OMP_NUM_THREADS": "1"})
    assert result.exit_code == 0, result.output + result.stderr
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


def test_bench_latency_measures_a_tiny_mamba2_and_natsl_mamba2(tmp_path):
    recipes = [write_tiny_recipe(tmp_path / f"tiny_{name}.yaml", **changes) for name, changes in TINY_SYSTEMS.items()]
    result = CliRunner().invoke(app, [
        "bench-latency", *[arg for r in recipes for arg in ("--recipe", str(r))], "--min-len", "32", "--max-len", "32",
        "--device", "cpu", "--decode-tokens", "2", "--repeats", "1", "--out", str(tmp_path / "bench"), "--no-progress"])
    assert result.exit_code == 0, result.output + result.stderr
    models = json.loads((tmp_path / "bench" / "latency.json").read_text())["models"]
    assert [m["name"] for m in models] == ["tiny_mamba2", "tiny_natsl_mamba2", "tiny_natsl_mamba2_ssd"]
    for model in models:
        (point,) = model["points"]
        assert "error" not in point and point["prefill_s"] > 0 and point["decode_ms"] > 0


def test_bench_latency_lists_the_800m_mamba2_among_its_systems():
    from natsl.inference import bench

    assert "800m_mamba2" in bench.DEFAULT_RECIPES


def save_tiny_checkpoint(folder: Path, system: str) -> Path:
    config = tiny_config(backend=None, block_size=16, **TINY_SYSTEMS[system])
    torch.manual_seed(5)
    return save_model_folder(folder, natsl.build_model(config), Recipe(name=system, model=config), None)


def test_info_reads_a_mamba2_checkpoint_and_names_its_state(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "natsl_mamba2")
    result = CliRunner().invoke(app, ["info", str(ckpt), "--seq-len", "40", "--seed", "3"])
    assert result.exit_code == 0, result.output + result.stderr
    assert "layers: M N M N" in result.stdout and "N = NAtS-L on a Mamba2 state" in result.stdout
    assert result.stdout.count(". = Mamba2 state") == 2  # layers 1 and 3 route between softmax and the SSD state
    # The forward ran the checkpoint's weights, not a fresh model of its recipe.
    model, _ = load_checkpoint(ckpt)
    model.set_backend("chunked")
    torch.manual_seed(3)
    with torch.no_grad():
        logits = model(torch.randint(0, model.config.vocab_size, (1, 40)))
    assert f"mean |logit| {logits.abs().mean():.4f}" in result.stdout


def test_inspect_routing_reports_natsl_on_mamba2_and_refuses_plain_mamba2(tmp_path):
    plain = save_tiny_checkpoint(tmp_path / "mamba2", "mamba2")
    args = ["--seq-len", "40", "--samples", "1", "--device", "cpu"]
    assert_one_line_error(CliRunner().invoke(app, ["inspect-routing", str(plain), *args, "--out", str(tmp_path / "a")]),
                          "has no NAtS-L layers")
    hybrid = save_tiny_checkpoint(tmp_path / "hybrid", "natsl_mamba2")
    result = CliRunner().invoke(app, ["inspect-routing", str(hybrid), *args, "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads((tmp_path / "b" / "routing.json").read_text())
    assert report["natsl_layers"] == [1, 3]
    assert all(0.0 <= layer["keep_fraction"] <= 1.0 for layer in report["datasets"][0]["layers"])


def test_a_checkpoint_older_than_the_authors_form_loads_as_the_model_it_was(tmp_path):
    """A NAtS-L Mamba2 checkpoint written before mamba2_state_l2, mamba2_state_skip, mamba2_mlp and
    mamba2_conv_bias existed read its state unnormalised with D v, gave every block the MLP and its Mamba2
    convs no bias: it loads as that model."""
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "natsl_mamba2_ssd")
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    for key in ("mamba2_state_l2", "mamba2_state_skip", "mamba2_mlp", "mamba2_conv_bias"):
        del config["recipe"]["model"][key]
    del config["model_sha256"]  # recorded by later checkpoints only
    path.write_text(json.dumps(config))
    model, _ = load_checkpoint(ckpt)
    c = model.config
    assert not c.mamba2_state_l2 and c.mamba2_state_skip and c.mamba2_mlp and not c.mamba2_conv_bias
    assert model.layers[0].mlp is not None and model.layers[1].mixer.proj.D is not None
    assert model.layers[0].mixer.conv.bias is None
    torch.manual_seed(5)
    fresh = natsl.build_model(tiny_config(backend=None, block_size=16, **TINY_SYSTEMS["natsl_mamba2_ssd"]))
    ids = torch.randint(0, c.vocab_size, (1, 40))
    model.set_backend("chunked")
    fresh.set_backend("chunked")
    with torch.no_grad():
        assert torch.equal(model(ids), fresh(ids))
