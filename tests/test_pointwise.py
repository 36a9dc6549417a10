"""natsl.models.pointwise: each formula against plain PyTorch (CPU), and the torch.compile'd forms
against the eager ones, forward and every gradient (GPU)."""

import pytest
import torch
import torch.nn.functional as F

from natsl.models import pointwise as pw

torch.manual_seed(0)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def plain_rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("length", [1, 3, 37])
def test_conv_silu_is_the_depthwise_conv(length):
    x = torch.randn(2, length, 5, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 1, 4, dtype=torch.float64, requires_grad=True)
    y = pw.conv_silu(x, w, tail)
    full = torch.cat([tail, x], 1)
    want = F.silu(F.conv1d(full.transpose(1, 2), w, groups=5).transpose(1, 2))
    assert rel(y, want) < 1e-12
    assert torch.equal(pw.conv_tail(x, tail), full[:, -3:])
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, tail, w), dy)
    ref = torch.autograd.grad(want, (x, tail, w), dy)
    for g, r in zip(got, ref):
        assert rel(g, r) < 1e-12


def test_norms_and_gates_are_their_formulas():
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    gate = torch.randn(3, 7, 16, dtype=torch.float64)
    assert rel(pw.rms_norm(x, w, 1e-6), plain_rms(x, w, 1e-6)) < 1e-14
    assert rel(pw.gated_rms_norm(x, w, 1e-6, gate), plain_rms(x, w, 1e-6) * F.silu(gate)) < 1e-14
    assert rel(pw.l2_normalize(x), x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)) < 1e-14
    a, b = torch.randn(3, 7, 4, dtype=torch.float64), torch.randn(3, 7, 4, dtype=torch.float64)
    A_log, dt_bias = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    g, beta = pw.gdn_gates(a, b, A_log, dt_bias)
    assert rel(g, -A_log.exp() * torch.log1p((a + dt_bias).exp())) < 1e-12
    assert rel(beta, 1 / (1 + (-b).exp())) < 1e-14
    assert rel(pw.swiglu(a, b), a * torch.sigmoid(a) * b) < 1e-14


@pytest.mark.parametrize("kind", ["softmax", "sigmoid", "linear", "none"])
@pytest.mark.parametrize("separate", [True, False])
def test_mix_branches_is_the_spec_read(kind, separate):
    B, T, Hs, D = 2, 5, 6, 8
    o_la, o_nla = torch.randn(B, T, Hs, D, dtype=torch.float64), torch.randn(B, T, Hs, D, dtype=torch.float64)
    logits = None if kind == "none" else torch.randn(B, T, Hs, 2, dtype=torch.float64)
    gate = torch.randn(B, T, Hs * D, dtype=torch.float64)
    w1, w2 = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    if logits is None:
        wn = wl = 1.0
    else:
        mix = {"softmax": lambda s: s.softmax(-1), "sigmoid": torch.sigmoid, "linear": lambda s: s}[kind](logits)
        wn, wl = mix[..., :1], mix[..., 1:]
    if separate:
        want = wl * plain_rms(o_la, w1, 1e-6) + wn * plain_rms(o_nla, w2, 1e-6)
        got = pw.mix_read(o_la, o_nla, logits, kind, gate, w1, w2, None, 1e-6)
    else:
        want = plain_rms(wl * o_la + wn * o_nla, w1, 1e-6)
        got = pw.mix_read(o_la, o_nla, logits, kind, gate, None, None, w1, 1e-6)
    assert rel(got, want.reshape(B, T, -1) * F.silu(gate)) < 1e-14


def test_cpu_tensors_never_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called for a CPU tensor")

    monkeypatch.setattr(torch, "compile", refuse)
    x = torch.randn(2, 3, 8)
    assert torch.equal(pw.rms_norm(x, None, 1e-6), pw.rms_norm.eager(x, None, 1e-6))


@pytest.mark.parametrize("setting,dynamic", [(None, None), ("auto", None), ("1", True), ("0", False)])
def test_compile_dynamic_setting(setting, dynamic, monkeypatch, use_switches):
    """The switch pointwise_dynamic picks torch.compile's `dynamic`; in the default ("auto") every tensor
    argument's feature dim is marked static before the compiled call."""
    use_switches(pointwise_dynamic=setting or "auto")
    assert pw.compile_dynamic() is dynamic
    marked = []
    monkeypatch.setattr(torch._dynamo, "mark_static", lambda t, dim: marked.append((tuple(t.shape), dim)))
    use_switches(compile_pointwise="all")
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: fn)  # the call path, not Inductor
    fn = pw.pointwise(lambda x, w, eps: x * w)
    fn(torch.ones(2, 3, 8), torch.ones(8), 1e-6)
    assert marked == ([((2, 3, 8), 2), ((8,), 0)] if dynamic is None else [])


def test_length_dim_is_symbolic_from_the_first_call_without_gradients(monkeypatch, use_switches):
    """In the default ("auto"), calls without gradients mark dim 1 of the [B, T, ...] arguments dynamic
    (one graph for every length); with gradients nothing is marked (training keeps its static length)."""
    marked = []
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, dim: marked.append((tuple(t.shape), dim)))
    use_switches(compile_pointwise="all")
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: fn)
    fn = pw.pointwise(lambda x, tail, w: x * w)
    args = (torch.ones(2, 5, 8), torch.ones(2, 3, 8), torch.ones(8))
    fn(*args)
    assert marked == []
    with torch.no_grad():
        fn(*args)
        fn(torch.ones(2, 8), torch.ones(2, 8), torch.ones(8))  # a decode step's [B, d]: no length dim
    assert marked == [((2, 5, 8), 1)]


@pytest.mark.slow
def test_no_recompile_at_a_new_length_without_gradients(use_switches):
    """Through Inductor's CPU backend: an RMSNorm without gradients at three lengths builds one graph."""
    from torch._dynamo.utils import counters

    use_switches(compile_pointwise="all")
    fn = pw.pointwise(pw.rms_norm.eager)  # a fresh compiled function: no graph from other tests
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for length in (100, 37, 300):
            x = torch.randn(1, length, 16)
            assert torch.allclose(fn(x, None, 1e-6), pw.rms_norm.eager(x, None, 1e-6), atol=1e-6)
    assert counters["stats"]["unique_graphs"] - before == 1


# ----------------------------------------------------------------------------- GPU: compiled vs eager
def _cases(device, dtype, T):
    B, C, H, D = 2, 96, 6, 16
    mk = lambda *s, dt=dtype: torch.randn(*s, device=device, dtype=dt)  # noqa: E731
    return {
        "rms_norm": (pw.rms_norm, (mk(B, T, C), mk(C), 1e-6)),
        "gated_rms_norm": (pw.gated_rms_norm, (mk(B, T, H, D), mk(D), 1e-6, mk(B, T, H, D))),
        "l2_normalize": (pw.l2_normalize, (mk(B, T, H, D), 1e-6)),
        "conv_silu": (pw.conv_silu, (mk(B, T, C), mk(C, 1, 4, dt=torch.float32), mk(B, 3, C))),
        "gdn_gates": (pw.gdn_gates, (mk(B, T, H), mk(B, T, H), mk(H, dt=torch.float32), mk(H, dt=torch.float32))),
        "swiglu": (pw.swiglu, (mk(B, T, C), mk(B, T, C))),
        "mix_separate": (pw.mix_read, (mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, 2), "softmax",
                                          mk(B, T, H * D), mk(D), mk(D), None, 1e-6)),
        "mix_shared": (pw.mix_read, (mk(B, T, H, D), mk(B, T, H, D), mk(B, T, H, 2), "sigmoid",
                                        mk(B, T, H * D), None, None, mk(D), 1e-6)),
    }


def _check_compiled_against_eager(device, dtype):
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for T in (64, 37, 1):  # the first length compiles static, a new one re-traces with a symbolic length
        for name, (fn, args) in _cases(device, dtype, T).items():
            leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            outs = [fn(*leaves), fn.eager(*leaves)]
            outs = [o if isinstance(o, tuple) else (o,) for o in outs]
            tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
            cotangents = [torch.randn_like(o) for o in outs[0] if o.requires_grad]
            grads = []
            for out in outs:
                diff = [o for o in out if o.requires_grad]
                grads.append(torch.autograd.grad(diff, tensors, cotangents, allow_unused=True))
            for got, want in zip(outs[0], outs[1]):
                assert rel(got, want) < tol, (name, T, "forward", rel(got, want))
            for got, want in zip(*grads):
                if want is not None:
                    assert rel(got, want) < tol, (name, T, "gradient", rel(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_equals_eager_on_gpu(dtype):
    _check_compiled_against_eager("cuda", dtype)


@pytest.mark.slow
def test_compiled_equals_eager_on_cpu(use_switches):
    """The same check through Inductor's CPU backend: dynamo traces every function without a graph
    break or a recompile storm (the GPU run of 2026-11-30 first hit dynamo's recompile limit)."""
    from torch._dynamo.utils import counters

    use_switches(compile_pointwise="all")
    compiled_before = counters["stats"]["unique_graphs"]
    _check_compiled_against_eager("cpu", torch.float32)
    assert counters["stats"]["unique_graphs"] >= compiled_before + len(_cases("cpu", torch.float32, 4))


def test_autocast_norm_rounds_once_to_the_same_values(monkeypatch):
    """Under bf16 autocast RMSNorm returns bf16 (one cast for all the Linears it feeds); the logits
    are exactly those of letting every Linear cast the fp32 norm output itself."""
    import natsl
    from natsl.models import norms

    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    model.set_backend("chunked")
    ids = torch.randint(0, recipe.model.vocab_size, (2, 128))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block = model.layers[0]
        assert block.mixer_norm(model.embed(ids)).dtype == torch.bfloat16
        assert model.norm(model.embed(ids)).dtype == torch.float32  # the final norm keeps fp32 (the loss)
        once = model(ids)
        monkeypatch.setattr(norms, "autocast_dtype", lambda x: None)
        assert block.mixer_norm(model.embed(ids)).dtype == torch.float32
        per_linear = model(ids)
    assert torch.equal(once, per_linear)


@pytest.mark.parametrize("mode,cuda,grad,step,expected", [
    ("auto", True, True, False, True), ("auto", True, False, False, False), ("auto", True, False, True, True),
    ("auto", False, True, True, False), ("1", True, False, False, True), ("1", False, True, False, False),
    ("0", True, True, True, False), ("all", False, False, False, True)])
def test_compile_for_by_mode_device_grad_and_decode_step(mode, cuda, grad, step, expected, use_switches):
    """compile_pointwise: "auto" (default) compiles CUDA tensors while autograd records and inside a decode
    step (a prefill's first call then pays no dynamo trace; decode graphs keep their fused pieces), "1"
    CUDA always, "0" never, "all" everywhere. compile_for reads only the tensor's is_cuda, so a
    stand-in plays the CUDA tensor on the CPU."""
    import contextlib
    from types import SimpleNamespace

    from natsl.ops.compiled import compile_for, decode_step_scope

    use_switches(compile_pointwise=mode)
    with torch.set_grad_enabled(grad), (decode_step_scope() if step else contextlib.nullcontext()):
        assert compile_for(SimpleNamespace(is_cuda=cuda)) is expected


def test_decode_step_scope_ends_with_its_block_and_nests(use_switches):
    """Outside a decode step a grad-free CUDA call stays eager again; an inner scope's end leaves the
    outer one in force."""
    from types import SimpleNamespace

    from natsl.ops.compiled import compile_for, decode_step_scope

    use_switches(compile_pointwise="auto")
    cuda = SimpleNamespace(is_cuda=True)
    with torch.no_grad():
        with decode_step_scope():
            with decode_step_scope():
                assert compile_for(cuda)
            assert compile_for(cuda)
        assert not compile_for(cuda)


def test_default_compiles_pointwise_in_training_and_decode_steps_only():
    from natsl import switches

    assert switches.Switches().compile_pointwise == "auto"


def test_decode_step_runs_inside_the_decode_scope(monkeypatch):
    """LM.decode_step runs its layers inside decode_step_scope (where "auto" compiles on CUDA); a
    many-token cached call (a prefill) does not."""
    import natsl
    from natsl.ops import compiled

    seen = []
    model = natsl.build_model(natsl.load_recipe("tiny_hybrid"))
    model.eval()
    original = type(model)._cached_layers

    def spy(self, *args, **kwargs):
        seen.append(compiled._IN_DECODE_STEP)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "_cached_layers", spy)
    cache = model.new_cache(1, max_len=80)
    with torch.no_grad():
        model.forward_cached(torch.zeros(1, 70, dtype=torch.long), cache)
        model.forward_cached(torch.zeros(1, 1, dtype=torch.long), cache)
    assert seen == [False, True] and compiled._IN_DECODE_STEP is False
