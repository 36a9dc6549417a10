"""The NAtS-L ops (and the gated linear rule of Mamba2 layers) with backend dispatch (docs/spec.md section 5).

`backend="reference"` is pure PyTorch (any device, the definition of correct); `backend="fast"` is
Triton (on a CPU tensor it runs under TRITON_INTERPRET=1); `backend="chunked"` is the pure-PyTorch
chunk-parallel form of the same function (one sequential step per block instead of per token: the
practical choice for training or evaluating on a CPU); `backend=None` reads the environment
variable NATSL_BACKEND and otherwise takes `default_backend`.

The ops of the cached paths are modules of this package, one per family: `cached` (GDN token step,
block commit, cached attention, K/V writes), `norms`, `gemv`, `short_conv`, `mix`, `cross_entropy`;
`fused` holds the cached paths' fused kernels (the GDN and gated-linear decode steps among them);
`kernel_set` gives a layer's cached call its kernel set (fused or reference: `fused.enabled` decides)
and `block_end` the NAtS-L decode step's compiled bookkeeping. Models reach kernels only here, and
every choice between a fast and a reference kernel is made here. `TWINS` names every kernel family's
reference and fast function; `twin` loads one.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

# Every reference twin is imported here (pure PyTorch, no Triton), so that `twin` finds it imported
# under torch.compile; the fast ones are imported on first use.
import natsl.reference.cross_entropy  # noqa: F401
import natsl.reference.gated_delta  # noqa: F401
import natsl.reference.gated_delta_chunked  # noqa: F401
import natsl.reference.routed_attention  # noqa: F401
from natsl.block_size import DEFAULT_BLOCK_SIZE
from natsl.devices import triton_available, triton_interpreted
from natsl.errors import NatslError

BACKENDS = ("reference", "chunked", "fast")
ROUTE_GRAD_POLICIES = ("active", "full")


def default_backend(device: torch.device, *, command: bool = False) -> str:
    """The backend when none is chosen, the one place this rule lives: fast on CUDA; on the CPU the
    reference for a library call (the definition of correct) and chunked for a command
    (`natsl.runtime.pick_backend`: the same function in one sequential step per block instead of per
    token, tested equal in tests/test_chunked_backend.py, the CPU's speed for training and evaluation)."""
    if device.type == "cuda":
        return "fast"
    return "chunked" if command else "reference"


def requested_backend(backend: str | None, device: torch.device) -> tuple[str, str]:
    """The backend a call asks for before any check, and what chose it: the caller's choice, else
    NATSL_BACKEND, else `default_backend` (`resolve_backend` and natsl.inference.kernel_table both ask here).

    Args:
        backend: the caller's choice (a layer's `backend`), or None.
        device: the tensors' device.

    Returns:
        (name, source): source is "caller", "NATSL_BACKEND" or "default".
    """
    if backend is not None:
        return backend, "caller"
    env = os.environ.get("NATSL_BACKEND") or None
    if env is not None:
        return env, "NATSL_BACKEND"
    return default_backend(device), "default"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend a call runs on, given the caller's choice and the tensors' device."""
    backend = requested_backend(backend, device)[0]
    if backend not in BACKENDS:
        raise NatslError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    # Inside torch.compile the check is skipped (dynamo would trace the import): the eager calls before
    # it, and the command line's backend choice, have made it.
    if backend == "fast" and not torch.compiler.is_compiling() and not triton_available():
        raise NatslError("backend 'fast' needs triton: pip install 'natsl[fast]', or use backend 'chunked' / "
                         "'reference'")
    if backend == "fast" and device.type == "cpu" and not triton_interpreted():
        raise NatslError("backend 'fast' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                         "before starting Python, or use backend 'chunked' / 'reference' on the CPU")
    return backend


def _check_route_grad(route_grad: str) -> None:
    if route_grad not in ROUTE_GRAD_POLICIES:
        raise NatslError(f"unknown route_grad {route_grad!r}: use 'active' or 'full'")


def state_rule(family: str, chosen: str):
    """The function of a state op (gated_delta_rule, gated_linear_rule) on backend `chosen`: its fast
    twin, its reference, or its chunk-parallel form (TWINS' `<family>_chunked`)."""
    if chosen == "chunked":
        return twin(family + "_chunked", fast=True)
    return twin(family, fast=chosen == "fast")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    write: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    decay_skipped_blocks: bool = True,
    route_grad: str = "active",
    backend: str | None = None,
    intra_block: bool = True,
):
    """Gated DeltaNet with a per-block write mask (docs/spec.md section 3).

    Within a block the state follows the token recurrence S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1}
    + beta_t k_t v_t^T, and o_t = scale S_t^T q_t reads it, so a query sees its own block's writes. At
    the block's end the route is committed: S_start(b+1) = Gamma_b S_start(b) + write_b (S_end(b) -
    Gamma_b S_start(b)), Gamma_b = exp(sum of g over the block). A block routed to softmax memory
    (write 0) keeps the decay but none of its content.

    Args:
        q: queries `[B, T, H, K]`, already L2-normalised per head.
        k: keys `[B, T, H, K]`, already L2-normalised per head.
        v: values `[B, T, H, V]`.
        g: log decay `[B, T, H]` (<= 0).
        beta: write strengths `[B, T, H]` (the model's are sigmoids, in (0, 1)).
        write: the route `[B, NB, H]`, NB = ceil(T / block_size): 1 commits the block's writes to the
            state, 0 drops them. None: all ones, plain Gated DeltaNet.
        scale: the query scale. Default: `K ** -0.5`.
        initial_state: the state before the first token, `[B, H, K, V]`. Default: zeros.
        output_final_state: return S_start(NB), the state after the last block's commit.
        block_size: tokens per routing block. The fast backend takes 16, 32, 64, 128 or 256, forward
            and backward; the reference and chunked any size (natsl/block_size.py).
        decay_skipped_blocks: False is the ablation that replaces Gamma_b by 1 in the commit.
        route_grad: "active" (the method: the gradient of `write` only where it is 1) or "full" (both
            options, the dense continuous-mask gradient).
        backend: "reference", "chunked" (chunk-parallel PyTorch, CPU speed), "fast" (Triton) or None
            (`NATSL_BACKEND`, else fast on CUDA and reference elsewhere).
        intra_block: False is the Table 4 ablation in which a query reads only the committed state of
            its block (decayed to its position), not the writes of its own block.

    Returns:
        A tuple `(o, final_state)`: o `[B, T, H, V]` in q's dtype; final_state `[B, H, K, V]` in fp32
        (float64 for float64 inputs) if `output_final_state`, else None.
    """
    _check_route_grad(route_grad)
    # The intra-block ablation (Table 4) has no kernel: the fast twin hands it to the reference.
    chosen = resolve_backend(backend, q.device)
    if chosen == "fast":
        import natsl.fast.gated_delta.function  # noqa: F401  (an import statement: see `twin`)
    return state_rule("gated_delta_rule", chosen)(
        q, k, v, g, beta, write, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        block_size=block_size, decay_skipped_blocks=decay_skipped_blocks, route_grad=route_grad,
        intra_block=intra_block)


def gated_linear_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    write: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    decay_skipped_blocks: bool = True,
    route_grad: str = "active",
    backend: str | None = None,
    intra_block: bool = True,
):
    """Gated linear attention (scalar decay per head: Mamba2's SSD) with a per-block write mask.

    gated_delta_rule without the delta erase and without beta: S_t = exp(g_t) S_{t-1} + k_t v_t^T,
    o_t = scale S_t^T q_t; write, the commit, `intra_block` and `route_grad` as there. Mamba2 passes
    q = C, k = B, v = x dt, g = A dt and scale = 1.

    q, k may have fewer heads than v: [B,T,Hk,K] with H % Hk == 0, head h of v reading q/k head
    h // (H // Hk) (as repeat_interleave(H // Hk, dim=2); Mamba2's G groups of B and C). The fast op
    saves them grouped for the backward and returns dq, dk [B,T,Hk,K]; Hk == H is the plain op.

    Args:
        q: queries `[B, T, Hk, K]` (Mamba2's C), Hk dividing H.
        k: keys `[B, T, Hk, K]` (Mamba2's B).
        v: values `[B, T, H, V]` (Mamba2's x dt).
        g: log decay `[B, T, H]` (<= 0; Mamba2's A dt).
        write: the route `[B, NB, H]`, NB = ceil(T / block_size); None: all ones (plain SSD).
        scale: the query scale. Default: `K ** -0.5` (Mamba2 passes 1).
        initial_state: the state before the first token, `[B, H, K, V]`. Default: zeros.
        output_final_state: return the state after the last block's commit.
        block_size: tokens per routing block, as in gated_delta_rule.
        decay_skipped_blocks: False replaces Gamma_b by 1 in the commit.
        route_grad: "active" or "full", as in gated_delta_rule.
        backend: "reference", "chunked", "fast" or None, as in gated_delta_rule.
        intra_block: False: a query reads only its block's committed state, as in gated_delta_rule.

    Returns:
        A tuple `(o, final_state)`: o `[B, T, H, V]` in q's dtype; final_state `[B, H, K, V]` in fp32
        if `output_final_state`, else None.
    """
    _check_route_grad(route_grad)
    chosen = resolve_backend(backend, q.device)
    if chosen == "fast":
        import natsl.fast.gated_linear.function  # noqa: F401  (an import statement: see `twin`)
    return state_rule("gated_linear_rule", chosen)(
        q, k, v, g, write, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        block_size=block_size, decay_skipped_blocks=decay_skipped_blocks, route_grad=route_grad,
        intra_block=intra_block)


def attention_is_fast(backend: str | None, device: torch.device) -> bool:
    """Whether routed_attention on a layer's `backend` runs its fast twin on `device`. "chunked" has no
    attention of its own: the dense reference is already one batched matmul."""
    return resolve_backend(backend, device) == "fast"


def routed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor | None,
    *,
    scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    route_grad: str = "active",
    backend: str | None = None,
    intra_block: bool = True,
):
    """Causal softmax attention in which earlier blocks are visible only where `keep` is 1.

    Query i of block a sees key j of block c where c == a and j <= i (its own block, causally), or
    c < a and keep_c is 1 for the query head's routing group (docs/spec.md section 3). Head h belongs
    to group h // (Hs // G).

    Args:
        q: queries `[B, T, Hs, Dk]`.
        k: keys `[B, T, Hs, Dk]`.
        v: values `[B, T, Hs, Dv]`.
        keep: the route `[B, NB, G]`, NB = ceil(T / block_size), G dividing Hs: 1 keeps the block's
            keys and values in softmax memory for later blocks, 0 hides them. None: every block is
            kept (plain causal attention).
        scale: the score scale. Default: `Dk ** -0.5`.
        block_size: tokens per routing block (the fast backend: a power of two from 16 to 256).
        route_grad: "active" (the gradient of `keep` only where it is 1) or "full".
        backend: "reference", "fast" or None (`NATSL_BACKEND`, else fast on CUDA and reference
            elsewhere); "chunked" runs the reference.
        intra_block: False is the Table 4 ablation in which a query does not see its own block (it
            then sees only kept blocks; a row with nothing visible outputs zeros).

    Returns:
        o `[B, T, Hs, Dv]` in q's dtype.
    """
    _check_route_grad(route_grad)
    fast = attention_is_fast(backend, q.device)
    if fast:
        import natsl.fast.block_sparse.function  # noqa: F401  (an import statement: see `twin`)
    impl = twin("routed_attention", fast)
    return impl(q, k, v, keep, scale=scale, block_size=block_size, route_grad=route_grad, intra_block=intra_block)


# Every kernel family: family -> (reference, fast) as "module:function", the two functions with the
# same parameters (names, kinds, defaults), the reference the definition of correct. The doors of this
# package pick an implementation with `twin`; tests/test_twins.py checks every pair's signatures and
# agreement on tiny shapes. The chunked forms are second references of gated_delta_rule and
# gated_linear_rule (CPU speed), checked the same way. docs/development.md has the table.
TWINS = {
    "gated_delta_rule": ("natsl.reference.gated_delta:gated_delta_rule", "natsl.fast.gated_delta.function:gated_delta_rule"),
    "gated_delta_rule_chunked": ("natsl.reference.gated_delta:gated_delta_rule",
                                 "natsl.reference.gated_delta_chunked:gated_delta_rule"),
    "gated_linear_rule": ("natsl.reference.gated_linear:gated_linear_rule",
                          "natsl.fast.gated_linear.function:gated_linear_rule"),
    "gated_linear_rule_chunked": ("natsl.reference.gated_linear:gated_linear_rule",
                                  "natsl.reference.gated_linear_chunked:gated_linear_rule"),
    "routed_attention": ("natsl.reference.routed_attention:routed_attention",
                         "natsl.fast.block_sparse.function:routed_attention"),
    "gated_delta_step": ("natsl.reference.cached:gated_delta_step", "natsl.fast.gated_delta.decode:gated_delta_step"),
    "commit_block": ("natsl.reference.router:commit_block", "natsl.fast.gated_delta.commit:commit_block"),
    "decode_attention": ("natsl.reference.cached:attend_one", "natsl.fast.decode_attention:decode_attention"),
    "write_kv": ("natsl.reference.cached:write_kv", "natsl.fast.cached:write_kv"),
    "rope_write_kv": ("natsl.reference.cached:rope_write_kv", "natsl.fast.cached:rope_write_kv"),
    "store_blocks": ("natsl.reference.cached:store_blocks", "natsl.fast.cached:store_blocks"),
    "gdn_decode_step": ("natsl.reference.cached:gdn_decode_step", "natsl.fast.cached:gdn_decode_step"),
    "gla_decode_step": ("natsl.reference.cached:gla_decode_step", "natsl.fast.cached:gla_decode_step"),
    "conv_step": ("natsl.reference.cached:conv_step", "natsl.fast.cached:conv_step"),
    "conv_steps": ("natsl.reference.cached:conv_steps", "natsl.fast.cached:conv_steps"),
    "conv_chunk": ("natsl.reference.cached:conv_chunk", "natsl.fast.cached:conv_chunk"),
    "short_conv_silu": ("natsl.reference.short_conv:short_conv_silu", "natsl.fast.short_conv:short_conv_silu"),
    "short_conv_silu_split": ("natsl.reference.short_conv:short_conv_silu_split",
                              "natsl.fast.short_conv:short_conv_silu_split"),
    "mix_branches": ("natsl.reference.mix:mix_branches", "natsl.fast.mix:mix_branches"),
    "rms_norm": ("natsl.reference.norms:rms_norm", "natsl.fast.norms:rms_norm"),
    "l2_normalize": ("natsl.reference.norms:l2_normalize", "natsl.fast.norms:l2_normalize"),
    "add_rms_norm": ("natsl.reference.norms:add_rms_norm", "natsl.fast.norms:add_rms_norm"),
    "gated_input_rms_norm": ("natsl.reference.norms:gated_input_rms_norm", "natsl.fast.norms:gated_input_rms_norm"),
    "step_values": ("natsl.reference.gates:step_values", "natsl.fast.gates:step_values"),
    "gemv": ("natsl.reference.gemv:linear", "natsl.fast.gemv:linear"),
    "add_norm_gemv": ("natsl.reference.gemv:add_norm_linear", "natsl.fast.gemv:add_norm_linear"),
    "gated_input_norm_gemv": ("natsl.reference.gemv:gated_input_norm_linear",
                              "natsl.fast.gemv:gated_input_norm_linear"),
    "cross_entropy": ("natsl.reference.cross_entropy:softmax_cross_entropy_",
                      "natsl.fast.cross_entropy:softmax_cross_entropy_"),
}


_LOADED: dict = {}


def twin(family: str, fast: bool):
    """The reference (fast=False) or fast (fast=True) function of a family of TWINS, imported on first
    use (a fast module imports Triton) and remembered.

    torch.compile traces the doors but not an import by name (importlib): under it the module must
    already be imported, so the doors a compiled model reaches import their fast module with a plain
    import statement (which it does trace) before asking, and the reference modules are imported
    with this package."""
    fn = _LOADED.get((family, fast))
    if fn is None:
        module, name = TWINS[family][int(fast)].split(":")
        loaded = sys.modules.get(module)
        # (`__package__`: the bundle of a Hugging Face export names its modules relatively, natsl.hf.bundle)
        loaded = loaded if loaded is not None else importlib.import_module(module, __package__)
        fn = _LOADED[(family, fast)] = getattr(loaded, name)
    return fn


# The modules of the fast backend beyond TWINS': the cached paths' fused kernels and the decode attention.
FAST_EXTRAS = ("natsl.fast.cached", "natsl.fast.decode_attention", "natsl.ops.fused")


def preload(backend: str | None) -> None:
    """Import every fast module now when `backend` is "fast" (and Triton is importable), instead of at a
    model's first call: their imports (Triton, the custom ops' registration with the dispatcher) cost
    about a second, which a first prefill should not pay. Anything else: nothing to do."""
    if backend != "fast" or not triton_available():
        return
    for family, (_, fast) in TWINS.items():
        if fast.startswith("natsl.fast."):
            twin(family, fast=True)
    for module in FAST_EXTRAS:
        importlib.import_module(module)
