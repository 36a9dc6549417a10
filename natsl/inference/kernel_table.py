"""Which kernel runs and why: one table per model config and device (`natsl info --kernels`).

`kernel_table(config, device)` lists every op family a model of `config` uses, on each path (the
training step's forward and backward, a cached prefill, a decode step), with the implementation that
runs and the rule or switch that chose it. Every row is computed by calling the decision function that
the op itself calls (`natsl.ops.fused.enabled_why`, `natsl.ops.gemv.enabled_why`, `natsl.ops.state_rule`,
`natsl.inference.prefill_graph.applies_why`, ...), with a one-element tensor on `device` where the
decision reads a tensor, so the table cannot drift from what runs. It lives here, above natsl.models
and natsl.ops, because two of its rows (prefill graphs, the prefill's second stream) are decided there.

What it does not see: per-call shapes (a GDN key dim above 256 takes the reference token step, a fp64
state the reference kernel set, a prompt longer than the prefill graphs' 2048 tokens the plain
prefill), which the rows' reasons name where they matter.
"""

from __future__ import annotations

import contextlib

import torch

from natsl import ops, switches
from natsl.errors import NatslError
from natsl.inference import prefill_graph
from natsl.models import nsa, overlap, registry
from natsl.models.registry import present
from natsl.ops import cached, compiled, cross_entropy, fused, gemv, kernel_set, mix, short_conv

PATHS = ("train", "prefill", "decode")


def _label(fn) -> str:
    """The implementation a function is: a fast twin (Triton), a chunked form or a reference."""
    module = fn.__module__
    if module.startswith("natsl.fast."):
        return "fast (Triton)"
    if module.endswith("_chunked"):
        return "chunked (PyTorch)"
    return "reference (PyTorch)"


def _pointwise(x: torch.Tensor) -> tuple[str, str]:
    """A compiled formula (natsl.ops.compiled.pointwise) on x's device in the current grad mode."""
    on, why = compiled.compile_why(x)
    return ("compiled (torch.compile)" if on else "eager (PyTorch)"), why


def _backend(config, device: torch.device, backend: str | None, command: bool) -> tuple[str | None, str, str]:
    """(the layers' backend attribute, the backend their ops resolve to, why)."""
    if command:
        from natsl.runtime import pick_backend_why

        chosen, why = pick_backend_why(backend, device)
        return chosen, chosen, why
    layer = backend if backend is not None else config.backend
    name, source = ops.requested_backend(layer, device)
    chosen = ops.resolve_backend(layer, device)  # checks it (Triton, its interpreter) as a call would
    why = {"caller": "backend argument" if backend is not None else "recipe model.backend",
           "NATSL_BACKEND": f"NATSL_BACKEND={name}",
           "default": "default_backend: fast on CUDA, reference elsewhere (a library call)"}[source]
    return layer, chosen, why


def _state_rule(family: str, chosen: str, config, device: torch.device, backward: bool, no_kernel: bool):
    """(runs, why) of a state rule (gated_delta_rule, gated_linear_rule) on `chosen`."""
    runs, why = _label(ops.state_rule(family, chosen)), f"backend {chosen}"
    if chosen != "fast":
        return runs, why
    if no_kernel:
        return "reference (PyTorch)", "NAtS-L layers: intra_block_output=softmax, an ablation with no kernel"
    from natsl.fast.gated_delta.function import block_size_problem

    problem = block_size_problem(family, config.block_size, "chunked", on_gpu=device.type == "cuda")
    return ("refused", problem) if problem else (runs, why + f", block_size {config.block_size}")


def kernel_table(config, device: torch.device | str, *, training: bool | None = None, backend: str | None = None,
                 command: bool = False) -> list[dict]:
    """The kernel each op of a model of `config` runs on `device`, and the rule or switch that chose it.

    Args:
        config: the model's ModelConfig (a recipe's model section).
        device: the device the model runs on (it must exist here: decisions read a tensor on it).
        training: True: the training step's rows only; False: the cached paths' (prefill, decode) only;
            None: all.
        backend: the layers' backend ("reference", "chunked", "fast"); None: the recipe's model.backend,
            else NATSL_BACKEND, else the default (with `command`: the commands' default, `--backend`).
        command: choose the backend as the commands do (natsl.runtime.pick_backend), not as a library
            call does (natsl.ops.resolve_backend).

    Returns:
        Rows in order, each a dict with "path" ("all", "train", "prefill" or "decode"), "op", "runs"
        (the implementation) and "why" (the switch, with its NATSL_* variable, or the condition).

    Raises:
        NatslError: a backend that cannot run on `device` (fast without Triton, or on the CPU without
            TRITON_INTERPRET=1), or a device this machine lacks.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NatslError("--device cuda asked for, but this machine has no CUDA GPU; use --device cpu")
    kinds = present(config)  # the layer kinds it builds (natsl.models.registry)
    natsl = any(k.routed for k in kinds)
    gdn_state = any(k.state_rule == "gated_delta_rule" for k in kinds)
    gla_state = any(k.state_rule == "gated_linear_rule" for k in kinds)
    no_cache = next((k for k in kinds if not k.has_cache), None)
    conv_bias = any(k.conv_bias(config) for k in kinds)
    layer, chosen, why = _backend(config, device, backend, command)
    x = torch.zeros(1, device=device)
    rows = [dict(path="all", op="backend", runs=chosen, why=why)]

    def row(path, op, runs, why):
        rows.append(dict(path=path, op=op, runs=runs, why=why))

    paths = [p for p in PATHS if training is None or (p == "train") == training]
    for path in paths:
        grad = path == "train"
        if no_cache is not None and path != "train":
            row(path, "cached paths", "none", f"{no_cache.legend} layers have no inference cache")
            continue
        if path in ("train", "prefill"):
            for rule in ("gated_delta_rule", "gated_linear_rule"):
                if any(k.state_rule == rule for k in kinds):
                    row(path, rule, *_state_rule(rule, chosen, config, device, grad, config.intra_block_output
                                                 == "softmax" and any(k.routed and k.state_rule == rule for k in kinds)))
            if natsl:
                fast = ops.attention_is_fast(layer, device)
                runs, why = _label(ops.twin("routed_attention", fast)), f"backend {chosen}"
                if chosen == "chunked":
                    why += ": no chunked attention, the dense reference is one batched matmul"
                if fast and config.intra_block_output == "gdn":
                    runs, why = "reference (PyTorch)", "intra_block_output=gdn, an ablation with no kernel"
                row(path, "routed_attention", runs, why)
            if any(isinstance(k, registry.NSA) for k in kinds) and path == "train":
                naive = nsa.naive_default(device)
                row(path, "NSA branches (fla)", "fla naive (PyTorch)" if naive else "fla parallel_nsa (Triton)",
                    "not CUDA" if naive else "CUDA")
        with torch.set_grad_enabled(grad), (compiled.decode_step_scope() if path == "decode" else contextlib.nullcontext()):
            pointwise = _pointwise(x)
        kernels = None
        if path != "train":
            kernels = kernel_set.pick(layer, device, torch.float32)
            on, why = fused.enabled_why(layer, device)
            row(path, "kernel set (norms, conv, K/V)",
                "fused (Triton)" if kernels.fused else "reference set", why)
        if gdn_state or gla_state:
            if path == "train":
                on = ops.resolve_backend(layer, device) == "fast"
                row(path, "short conv + SiLU", "fast (Triton)" if on else pointwise[0],
                    f"backend {chosen}" if on else pointwise[1])
                if gdn_state:
                    sizes = [config.num_heads * config.head_k_dim] * 2 + [config.num_heads * config.head_v_dim]
                    joined = short_conv.split_applies(sizes, config.conv_size, backend=layer, device=device)
                    row(path, "GDN q/k/v convs joined", "one op" if joined else "one op per conv",
                        "fast backend, NATSL_JOINED_CONV on, tiles fit" if joined else
                        ("NATSL_JOINED_CONV=0" if not switches.current().joined_conv else "the fast backend only"))
            if conv_bias:
                row(path, "Mamba2 conv with bias", pointwise[0], "mamba2_conv_bias: the kernels take no bias")
        if path == "decode":
            # a GDN state's decode step (fused), and a DeltaNet state's (the GDN token step at g = 0)
            steps: dict = {}
            for kind in kinds:
                if kind.state_rule == "gated_delta_rule":
                    steps.setdefault(kind.fused_decode, kind)
            for kind in steps.values():
                op = "GDN decode step" if kind.fused_decode else f"{kind.state_title} decode step (g = 0)"
                if kernels.fused and kind.fused_decode:
                    row(path, op, "fused (Triton)", "the fused kernel set")
                else:
                    on, why = cached.use_fast_why(layer, device)
                    row(path, op, "fast token step (Triton)" if on else "reference (PyTorch)",
                        why + (" (key dim <= 256)" if on else ""))
            if gla_state:
                on = kernels.gla_decode_fused()
                why = ("NATSL_FUSED_GLA_DECODE on" if on else "NATSL_FUSED_GLA_DECODE=0" if kernels.fused
                       else fused.enabled_why(layer, device)[1])
                row(path, "Mamba2 (SSD) decode step", "fused (Triton)" if on else "reference (PyTorch)", why)
            if natsl:
                budget = config.router_keep_budget is not None
                if kernels.fused and kernels.compiled_block_end(None, budget):
                    row(path, "NAtS-L block end", "compiled (natsl.ops.block_end)", "the fused kernel set")
                else:
                    on, why = cached.use_fast_why(layer, device)
                    row(path, "NAtS-L block end", "eager, commit " + ("fast (Triton)" if on else "reference"),
                        "model.router_keep_budget: the compiled form does not carry the gaps" if kernels.fused
                        else why)
            if any(k.softmax_memory for k in kinds):
                on, why = fused.decode_attention_enabled_why(layer, device)
                row(path, "decode attention", "split-K (Triton)" if on else "reference (PyTorch)", why)
            on, why = gemv.enabled_why(x)
            row(path, "GEMV (decode products)", "GEMV (Triton)" if on else "F.linear", why)
        if natsl:
            kind = config.mix_weights
            logits = None if kind == "none" else x
            out_weight = None if config.branch_norm == "separate" else x
            heads = config.num_heads * config.softmax_heads_per_group
            o_nla = torch.zeros(1, 1, heads, config.head_v_dim // config.softmax_heads_per_group, device=device)
            on, why = mix.fused_applies_why(o_nla, logits, kind, out_weight, layer)
            row(path, "NAtS-L mix read", "fast (Triton)" if on else pointwise[0],
                why if on else f"{why} (backend {chosen})")
        row(path, "pointwise (norms, gates, SwiGLU)", *pointwise)
        if path == "train":
            on, why = cross_entropy.fused_default_why(device)
            row(path, "LM loss (softmax work)", "fused (Triton)" if on else "eager (PyTorch)", why)
        if path == "prefill":
            on, why = prefill_graph.applies_why(config, device)
            if on and not kernels.fused:
                on, why = False, "the layers are not on the fused kernel set"
            row(path, "prefill graphs (short prompts)", "CUDA graphs" if on else "plain prefill", why)
            if natsl:
                on, why = overlap.applies_why(device)
                row(path, "prefill overlap (2 streams)", "two streams" if on else "one stream", why)
    return rows


def format_table(rows: list[dict], width: int = 100) -> str:
    """The rows as aligned columns (path, op, runs, why), the why column wrapped to fit `width`.

    Args:
        rows: `kernel_table`'s rows.
        width: the widest line.

    Returns:
        The table's text, without a trailing newline.
    """
    import textwrap

    head = dict(path="path", op="op", runs="runs", why="why")
    cols = ("path", "op", "runs")
    sizes = {c: max(len(str(r[c])) for r in [head, *rows]) for c in cols}
    indent = sum(sizes.values()) + 2 * len(cols)
    wrap = max(20, width - indent)
    lines = []
    for r in [head, *rows]:
        left = "  ".join(str(r[c]).ljust(sizes[c]) for c in cols) + "  "
        parts = textwrap.wrap(str(r["why"]), wrap, break_long_words=False, break_on_hyphens=False) or [""]
        lines.append(left + parts[0])
        lines.extend(" " * indent + part for part in parts[1:])
    return "\n".join(line.rstrip() for line in lines)

