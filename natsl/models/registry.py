"""The layer types ("mixers") of natsl's models, each one entry that owns what the rest of natsl asks of it.

A recipe names a layer type per layer (`ModelConfig.layer_types()`: "gdn", "attention", "natsl", "mamba2",
"nsa"); some types come in variants chosen by other config fields (`natsl_state` picks the NAtS-L layer's
linear memory, `attn_window` makes softmax attention a sliding window). `kind_of(config, layer_type)` gives
the entry of that variant, a `LayerKind`, which says:

- how its config fields are checked (`validate`), whether its block carries the MLP (`has_mlp`) and which
  RoPE head dims it rotates (`rope_dims`);
- how its mixer module is built (`build`: the parameters and their init are the module's own);
- how its inference cache is allocated (`new_cache`, as mamba_ssm's `allocate_inference_cache`; the
  prefill and decode steps are the module's `forward(x, cache=...)`);
- what it costs (`state_flops`: the linear memory per token; `train_flops`: the FLOPs a trained token
  adds beyond the dense products; `prefill_flops`: a prefill's beyond them), and what it holds at
  inference (the cache's own `kv_bytes` / `live_bytes`);
- how the authors' Hugging Face format names its tensors (`authors_names`, natsl.eval.convert);
- how `natsl info`, the kernel table, `natsl compare` and the memory estimate describe it (`letter`,
  `legend`, `state_rule`, `family`, `saved` / `transient`).

The model, the caches, bench, info, flops, convert and the kernel table ask this registry and compare no
layer-type names. A new layer type is a `LayerKind` subclass and one `register(...)` line. This module
imports nothing heavy at import time (config validation runs through it); the modules it describes are
imported when first needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from natsl.errors import NatslError

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from natsl.config import ModelConfig
    from natsl.models.cache import CacheSpace, LayerCache


def attention_pairs(length: int, block_size: int | None = None, keep: float = 1.0, window: int = 0) -> float:
    """(query, key) pairs a causal softmax reads (within `window` when > 0); with `block_size`, NAtS-L's
    own block plus kept blocks."""
    if block_size is None:
        if window and window < length:
            return window * (window + 1) / 2 + (length - window) * window
        return length * (length + 1) / 2
    blocks, rest = divmod(length, block_size)
    own = blocks * block_size * (block_size + 1) / 2 + rest * (rest + 1) / 2
    earlier = keep * block_size * block_size * (blocks * (blocks - 1) / 2 + (rest / block_size) * blocks)
    return own + earlier


def gdn_state_flops(config: "ModelConfig", chunk: float) -> float:
    """A GDN state per token, chunk-parallel: about 6 K V per head (read, delta, write) plus 2 C (K + V)."""
    h, k, v = config.num_heads, config.head_k_dim, config.head_v_dim
    return h * (6.0 * k * v + 2.0 * chunk * (k + v))


def ssd_state_flops(heads: int, n: int, p: int, chunk: float) -> float:
    """A Mamba2 (SSD) state per token: about 4 N P per head (read, write; no delta) plus 2 C (N + P)."""
    return heads * (4.0 * n * p + 2.0 * chunk * (n + p))


class LayerKind:
    """One layer type (or variant of one). Subclasses set the class attributes and override what differs."""

    name: str = ""  # unique in the registry ("gdn", "attention", "swa", "natsl", "natsl_mamba2", ...)
    layer_type: str = ""  # the recipe's name for the layers it builds (ModelConfig.layer_types())
    letter: str = "?"  # its letter in `natsl info`'s layout line
    legend: str = ""  # what the letter means there
    state_title: Optional[str] = None  # its linear memory, in words ("GDN", "Mamba2"); None: none
    # The chunk-parallel op of its linear memory ("gated_delta_rule", "gated_linear_rule"), or None.
    state_rule: Optional[str] = None
    # Whether a decode token steps its linear memory with the kernel set's fused decode step (its gates
    # computed inside it); False: with the plain token step (natsl.ops.cached).
    fused_decode: bool = True
    routed: bool = False  # a NAtS-L router: keep fractions, routing maps, the routed attention
    softmax_memory: bool = False  # a K/V memory read by the decode attention
    has_cache: bool = True  # incremental inference (prefill and decode from a cache)
    # Whether a padded prefill (natsl.inference.prefill_graph) leaves its cache as a plain prefill does.
    pad_exact: bool = False
    family: str = ""  # natsl compare's family of its points
    marker: str = "o"  # their marker in natsl compare's plot (matplotlib)
    # natsl.estimate: values per token per unit of layer width kept for the backward / alive at once in
    # a forward without gradients, by device kind (measured; the layer type's, shared by its variants).
    saved: dict = {}
    transient: dict = {}

    # Its section of a recipe's model (natsl.config: the nested form): section key (dotted inside a
    # subsection, "router.noise") -> the ModelConfig field it sets. Variants of one layer type share it.
    section: Optional[str] = None
    section_keys: dict[str, str] = {}

    def applies(self, config: "ModelConfig") -> bool:
        """Whether this variant is the one `config` builds for layers of `layer_type`."""
        return True

    # -- config ---------------------------------------------------------------------------------

    def validate(self, config: "ModelConfig", prefix: str) -> None:
        """Raise a one-line NatslError for a value of its config fields that cannot build it."""

    def has_mlp(self, config: "ModelConfig") -> bool:
        """Whether its block carries the SwiGLU MLP (every block where intermediate_size > 0, by default)."""
        return config.intermediate_size > 0

    def rope_dims(self, config: "ModelConfig") -> list[int]:
        """The head dims it rotates with RoPE in a full-sequence forward (shared RopeTable)."""
        return []

    def conv_bias(self, config: "ModelConfig") -> bool:
        """Whether its short conv adds a bias (which the Triton conv kernels do not take)."""
        return False

    # -- module and cache -----------------------------------------------------------------------

    def build(self, config: "ModelConfig", device=None):
        """Its mixer module (an nn.Module taking x [B, T, d] and returning [B, T, d]; parameters initialised)."""
        raise NotImplementedError

    def new_cache(self, config: "ModelConfig", space: "CacheSpace") -> "LayerCache":
        """Its inference cache in `space` (natsl.models.cache.CacheSpace: batch, capacity, device, dtypes)."""
        raise NatslError(f"layer type {self.layer_type!r} has no inference cache")

    # -- costs ----------------------------------------------------------------------------------

    def state_flops(self, config: "ModelConfig", chunk: float) -> float:
        """Forward FLOPs per token of its linear memory in chunk-parallel form (chunks of `chunk`); 0: none."""
        return 0.0

    def train_flops(self, config: "ModelConfig", seq_len: float, chunk: float, keep: float) -> float:
        """Training FLOPs per token beyond the dense products (3x the forward's), at `seq_len` tokens, chunks
        of `chunk` and keep fraction `keep` (natsl.training.flops)."""
        return 3.0 * self.state_flops(config, chunk)

    def prefill_flops(self, config: "ModelConfig", length: int, batch: int, keep: float) -> float:
        """A prefill's FLOPs beyond the dense products (natsl.inference.bench.prefill_flops)."""
        return batch * length * self.state_flops(config, config.block_size)

    # -- the authors' Hugging Face format (natsl.eval.convert) -------------------------------------

    authors_root: str = "model"  # the authors' model whose layers of this kind it imports

    def authors_names(self, config: "ModelConfig", n: str, h: str) -> Optional[dict[str, str]]:
        """natsl parameter name -> the authors' tensor name, for the layer whose natsl prefix is `n`
        ("layers.3.") and authors' prefix `h` ("model.layers.3."); None: their format has no such layer."""
        return None

    def llama_names(self, config: "ModelConfig", n: str, h: str) -> Optional[dict[str, str]]:
        """natsl parameter name -> Llama tensor name for the layer of prefixes `n` and `h` (natsl.hf.export);
        None: a Llama checkpoint has no such layer."""
        return None


# ----------------------------------------------------------------------------- the kinds of today

def _authors_block_names(n: str, h: str, gate_names, decays: bool = True) -> dict[str, str]:
    """The names every block of the authors' GDN-based layers shares: norms, MLP, projections, convs, and
    the decay's A_log and dt_bias where the state decays."""
    m, a = n + "mixer.", h + "attn."
    names = {n + "mixer_norm.weight": h + "attn_norm.weight", n + "mlp_norm.weight": h + "mlp_norm.weight"}
    for p in ("gate_proj", "up_proj", "down_proj"):
        names[f"{n}mlp.{p}.weight"] = f"{h}mlp.{p}.weight"
    for p in ("q_proj", "k_proj", "v_proj", *gate_names):
        names[f"{m}proj.{p}.weight"] = f"{a}{p}.weight"
    for p in ("q", "k", "v"):
        names[f"{m}proj.{p}_conv.weight"] = f"{a}{p}_conv1d.weight"
    if decays:
        names[m + "proj.A_log"] = a + "A_log"
        names[m + "proj.dt_bias"] = a + "dt_bias"
    names[m + "g_proj.weight"] = a + "g_proj.weight"
    names[m + "o_proj.weight"] = a + "o_proj.weight"
    return names


class GDN(LayerKind):
    """Gated DeltaNet (models/gated_deltanet.py)."""

    name = layer_type = "gdn"
    letter, legend, state_title = "G", "GDN", "GDN"
    state_rule = "gated_delta_rule"
    pad_exact = True
    family = "gdn"
    # the GDN head set, which the NAtS-L layers' linear memory shares
    section = "gdn"
    section_keys = {"num_heads": "num_heads", "head_k_dim": "head_k_dim", "head_v_dim": "head_v_dim"}
    marker = "D"
    saved = {"cpu": 2.4, "cuda": 1.1}
    transient = {"cpu": 1.6, "cuda": 0.8}

    def build(self, config, device=None):
        from natsl.models.gated_deltanet import GatedDeltaNet

        return GatedDeltaNet(config, device=device)

    def new_cache(self, config, space):
        from natsl.models.cache import GDNCache

        h, k, v = config.num_heads, config.head_k_dim, config.head_v_dim
        return GDNCache(space.positions, conv=space.conv_tails(config),
                        state=space.zeros(space.batch, h, k, v, dt=space.state_dtype))

    def state_flops(self, config, chunk):
        return gdn_state_flops(config, chunk)

    def authors_names(self, config, n, h):
        from natsl.models.gated_deltanet import GatedDeltaProjections

        names = _authors_block_names(n, h, GatedDeltaProjections.gate_names)
        names[n + "mixer.o_norm.weight"] = h + "attn.o_norm.weight"
        return names


class Mamba2(LayerKind):
    """Mamba2 (SSD) blocks (models/mamba2.py); the mixer alone unless mamba2_mlp."""

    name = layer_type = "mamba2"
    letter, legend, state_title = "M", "Mamba2", "Mamba2"
    state_rule = "gated_linear_rule"
    family = "mamba2"
    section = "mamba2"
    pad_exact = True  # a pad's dt and g are zero (its conv tail ends at the prompt): it leaves the state as it was
    section_keys = {key: f"mamba2_{key}" for key in ("head_dim", "state_size", "expand", "groups", "conv_bias", "mlp")}
    marker = "P"
    saved = {"cpu": 6.4, "cuda": 1.6}
    transient = {"cpu": 4.0, "cuda": 2.3}
    authors_root = "backbone"

    def validate(self, config, prefix):
        inner = config.mamba2_expand * config.hidden_size
        if inner % config.mamba2_head_dim:
            raise NatslError(f"recipe key '{prefix}.mamba2_head_dim' = {config.mamba2_head_dim} does not divide "
                             f"mamba2_expand * hidden_size = {inner}; pick a head dim that divides it")
        if (inner // config.mamba2_head_dim) % config.mamba2_groups:
            raise NatslError(f"recipe key '{prefix}.mamba2_groups' = {config.mamba2_groups} does not divide the "
                             f"{inner // config.mamba2_head_dim} Mamba2 heads; pick a group count that divides them")

    def has_mlp(self, config):
        return config.intermediate_size > 0 and config.mamba2_mlp

    def conv_bias(self, config):
        return config.mamba2_conv_bias

    def build(self, config, device=None):
        from natsl.models.mamba2 import Mamba2 as Mamba2Layer

        return Mamba2Layer(config, device=device)

    def new_cache(self, config, space):
        from natsl.models.cache import GDNCache, ssd_state

        inner = config.mamba2_expand * config.hidden_size
        xbc = inner + 2 * config.mamba2_groups * config.mamba2_state_size
        return GDNCache(space.positions, conv=[space.zeros(space.batch, config.conv_size - 1, xbc)],
                        state=ssd_state(space.batch, config, space.device, space.state_dtype))

    def state_flops(self, config, chunk):
        p = config.mamba2_head_dim
        return ssd_state_flops(config.mamba2_expand * config.hidden_size // p, config.mamba2_state_size, p, chunk)

    def authors_names(self, config, n, h):
        # flash-linear-attention's Mamba2 block: its norm and the mixer, no MLP
        names = {n + "mixer_norm.weight": h + "norm.weight"}
        conv = ("conv.weight", "conv.bias") if config.mamba2_conv_bias else ("conv.weight",)
        for p in ("in_proj.weight", *conv, "A_log", "dt_bias", "D", "norm.weight", "out_proj.weight"):
            names[n + "mixer." + p] = h + "mixer." + p.replace("conv.", "conv1d.")
        return names


class Attention(LayerKind):
    """Full causal softmax attention (models/attention.py)."""

    name = layer_type = "attention"
    letter, legend = "A", "softmax attention"
    softmax_memory = True
    pad_exact = True
    family = "attention"
    section = "attention"
    section_keys = {"num_heads": "attn_num_heads", "head_dim": "attn_head_dim", "rope": "attn_rope",
                    "window": "attn_window"}
    marker = "s"
    saved = {"cpu": 1.1, "cuda": 0.9}
    transient = {"cpu": 1.0, "cuda": 0.9}

    def applies(self, config):
        return not config.attn_window

    def validate(self, config, prefix):
        if config.attn_rope and config.attn_head_dim % 2:
            raise NatslError(f"recipe key '{prefix}.attn_head_dim' must be even for RoPE, got {config.attn_head_dim}")

    def rope_dims(self, config):
        return [config.attn_head_dim] if config.attn_rope else []

    def build(self, config, device=None):
        from natsl.models.attention import SoftmaxAttention

        return SoftmaxAttention(config, device=device)

    def new_cache(self, config, space):
        from natsl.models.cache import AttentionCache

        a, d, w = config.attn_num_heads, config.attn_head_dim, config.attn_window
        n = min(w, space.capacity) if w else space.capacity
        return AttentionCache(space.positions, k=space.zeros(space.batch, a, n, d),
                              v=space.zeros(space.batch, a, n, d), window=w)

    def train_flops(self, config, seq_len, chunk, keep):
        return 3.0 * seq_len * config.attn_num_heads * 2 * config.attn_head_dim

    def prefill_flops(self, config, length, batch, keep):
        pairs = attention_pairs(length, window=config.attn_window)
        return 2.0 * batch * config.attn_num_heads * 2 * config.attn_head_dim * pairs

    def llama_names(self, config, n, h):
        names = {n + "mixer_norm.weight": h + "input_layernorm.weight",
                 n + "mlp_norm.weight": h + "post_attention_layernorm.weight"}
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{n}mixer.{p}.weight"] = f"{h}self_attn.{p}.weight"
        for p in ("gate_proj", "up_proj", "down_proj"):
            names[f"{n}mlp.{p}.weight"] = f"{h}mlp.{p}.weight"
        return names


class SlidingWindow(Attention):
    """Softmax attention over the last attn_window keys, its cache a ring buffer (models/attention.py)."""

    name = "swa"
    pad_exact = False  # a pad may overwrite a ring slot still in the window
    family = "swa"
    marker = "^"

    def applies(self, config):
        return bool(config.attn_window)


class NAtSL(LayerKind):
    """NAtS-L on a GDN state, the paper's layer (models/natsl_layer.py)."""

    name = layer_type = "natsl"
    natsl_state = "gdn"  # the value of config.natsl_state that picks this variant
    letter, legend, state_title = "N", "NAtS-L", "GDN"
    state_rule = "gated_delta_rule"
    routed = softmax_memory = pad_exact = True
    family = "natsl"
    section = "natsl"
    section_keys = {
        "softmax_heads_per_group": "softmax_heads_per_group", "block_size": "block_size", "rope": "natsl_rope",
        "state": "natsl_state", "state_l2": "mamba2_state_l2", "state_skip": "mamba2_state_skip",
        **{key: key for key in ("intra_block_output", "decay_skipped_blocks", "branch_norm", "mix_input",
                                "mix_weights", "route_grad")},
        **{f"router.{key}": f"router_{key}" for key in ("noise", "balance", "target_keep", "keep_target",
                                                        "bias_rate", "keep_budget", "keep_budget_sink")}}
    saved = {"cpu": 2.7, "cuda": 1.15}
    transient = {"cpu": 1.8, "cuda": 0.8}

    def applies(self, config):
        return config.natsl_state == self.natsl_state

    def projections(self):
        """The class of its linear memory's projections (GatedDeltaProjections or a subclass)."""
        from natsl.models.gated_deltanet import GatedDeltaProjections

        return GatedDeltaProjections

    def validate(self, config, prefix):
        r = config.softmax_heads_per_group
        for key in ("head_k_dim", "head_v_dim"):
            if getattr(config, key) % r:
                raise NatslError(f"recipe key '{prefix}.{key}' = {getattr(config, key)} is not divisible by "
                                 f"softmax_heads_per_group = {r}; each GDN head must cut into {r} equal softmax heads")
        if config.natsl_rope and (config.head_k_dim // r) % 2:
            raise NatslError(f"RoPE needs an even softmax key dim, got head_k_dim/softmax_heads_per_group = "
                             f"{config.head_k_dim // r}; set '{prefix}.natsl_rope: false' or change the head dims")

    def rope_dims(self, config):
        return [config.softmax_k_dim] if config.natsl_rope else []

    def build(self, config, device=None):
        from natsl.models.natsl_layer import NAtSL as NAtSLLayer

        return NAtSLLayer(config, device=device, projections=self.projections())

    def new_cache(self, config, space):
        import torch

        from natsl.models.cache import NAtSLCache

        B, L, C = space.batch, space.capacity, config.block_size
        H, K, V = config.num_heads, config.head_k_dim, config.head_v_dim
        hs, zeros, fp = H * config.softmax_heads_per_group, space.zeros, space.state_dtype
        return NAtSLCache(
            space.positions, conv=space.conv_tails(config), state_start=zeros(B, H, K, V, dt=fp),
            state_run=zeros(B, H, K, V, dt=fp), decay_sum=zeros(B, H, dt=fp), x_sum=zeros(B, config.hidden_size, dt=fp),
            k_mem=zeros(B, hs, L, config.softmax_k_dim), v_mem=zeros(B, hs, L, config.softmax_v_dim),
            kept_len=zeros(B, H, dt=torch.long),
            keep_gaps=None if config.router_keep_budget is None else zeros(B, H, -(-L // C), dt=torch.float32))

    def state_flops(self, config, chunk):
        return gdn_state_flops(config, chunk)

    def train_flops(self, config, seq_len, chunk, keep):
        # the routed softmax branch: the own block (C/2) plus the kept fraction of the earlier tokens
        context = chunk / 2 + keep * max(seq_len - chunk, 0.0) / 2
        heads = config.num_heads * config.softmax_heads_per_group
        return 3.0 * self.state_flops(config, chunk) + \
            3.0 * 2.0 * context * heads * (config.softmax_k_dim + config.softmax_v_dim)

    def prefill_flops(self, config, length, batch, keep):
        pairs = attention_pairs(length, config.block_size, keep)
        return super().prefill_flops(config, length, batch, keep) + \
            2.0 * batch * config.num_heads * (config.head_k_dim + config.head_v_dim) * pairs

    def authors_names(self, config, n, h):
        m, a = n + "mixer.", h + "attn."
        names = _authors_block_names(n, h, self.projections().gate_names)
        names[m + "router.weight"] = a + "nats_layer.weight"
        names[m + "q_norm.weight"] = a + "q_norm.weight"
        names[m + "k_norm.weight"] = a + "k_norm.weight"
        # FusedMultiInputRMSNormGated(x1 = linear-memory output, x2 = softmax output): weight1, weight2.
        names[m + "la_norm.weight"] = a + "o_norm.weight1"
        names[m + "nla_norm.weight"] = a + "o_norm.weight2"
        if config.mix_weights != "none":
            names[m + "mix_proj.weight"] = a + "nats_out_weights_layer.weight"
        return names


class NAtSLMamba2(NAtSL):
    """NAtS-L on a Mamba2 (SSD) state, the authors' natsl_attn_mamba2 (models/mamba2.py: Mamba2StateProjections)."""

    name = "natsl_mamba2"
    natsl_state = "mamba2"
    legend, state_title = "NAtS-L on a Mamba2 state", "Mamba2"
    state_rule = "gated_linear_rule"
    authors_root = "backbone"

    def projections(self):
        from natsl.models.mamba2 import Mamba2StateProjections

        return Mamba2StateProjections

    def state_flops(self, config, chunk):
        # the NAtS-L layer's heads (K for N, V for P), on a Mamba2 state
        return ssd_state_flops(config.num_heads, config.head_k_dim, config.head_v_dim, chunk)


class NAtSLDelta(NAtSL):
    """NAtS-L on a plain DeltaNet state, the GDN state without its gate (g = 0), the authors'
    natsl_attn_delta (models/deltanet.py: DeltaProjections)."""

    name = "natsl_delta"
    natsl_state = "delta"
    legend, state_title = "NAtS-L on a DeltaNet state", "DeltaNet"
    fused_decode = False  # the GDN token step at g = 0 (the fused GDN step computes g from A_log)

    def projections(self):
        from natsl.models.deltanet import DeltaProjections

        return DeltaProjections

    def authors_names(self, config, n, h):
        # The authors' natsl_attn_delta sums its two outputs and runs one gated norm per DeltaNet head
        # (their model's outputs_are_weighted never reaches the layer, which reads outputs_are_wighted):
        # natsl's layer in that form alone has their tensors.
        if config.mix_weights != "none" or config.branch_norm != "after_sum_state_head":
            return None
        m, a = n + "mixer.", h + "attn."
        names = _authors_block_names(n, h, self.projections().gate_names, decays=False)
        names[m + "router.weight"] = a + "nats_layer.weight"
        names[m + "q_norm.weight"] = a + "q_norm.weight"
        names[m + "k_norm.weight"] = a + "k_norm.weight"
        names[m + "out_norm.weight"] = a + "o_norm.weight"
        return names


class NSA(LayerKind):
    """Native Sparse Attention (models/nsa.py: flash-linear-attention's); no inference cache."""

    name = layer_type = "nsa"
    letter, legend = "S", "NSA"
    has_cache = False
    family = "nsa"
    section = "nsa"
    section_keys = {key: f"nsa_{key}" for key in ("num_heads", "kv_heads", "head_dim", "block_size", "block_counts",
                                                   "window")}
    saved = {"cpu": 1.6, "cuda": 1.2}
    transient = {"cpu": 1.2, "cuda": 1.0}

    def validate(self, config, prefix):
        config.validate_nsa(prefix)

    def rope_dims(self, config):
        return [config.nsa_head_dim]

    def build(self, config, device=None):
        from natsl.models.nsa import NativeSparseAttention

        return NativeSparseAttention(config, device=device)

    def new_cache(self, config, space):
        from natsl.models.nsa import NO_CACHE

        raise NatslError(NO_CACHE)

    def train_flops(self, config, seq_len, chunk, keep):
        # compressed blocks ((T/2) / block size), selected blocks (at most T/2) and the window (at most T/2)
        t = seq_len
        context = t / 2 / config.nsa_block_size + min(config.nsa_block_counts * config.nsa_block_size, t / 2) \
            + min(config.nsa_window, t / 2)
        return 3.0 * 2.0 * context * config.nsa_num_heads * 2 * config.nsa_head_dim

    def prefill_flops(self, config, length, batch, keep):
        return 0.0  # no cached prefill


# ----------------------------------------------------------------------------- the registry

KINDS: list[LayerKind] = []


def register(kind: LayerKind) -> LayerKind:
    """Add a layer kind (its `name` unique); variants of one layer type are tried in registration order."""
    if any(k.name == kind.name for k in KINDS):
        raise ValueError(f"layer kind {kind.name!r} is registered twice")
    KINDS.append(kind)
    return kind


for _kind in (GDN(), Attention(), SlidingWindow(), NAtSL(), NAtSLMamba2(), NAtSLDelta(), Mamba2(), NSA()):
    register(_kind)


def layer_type_names() -> list[str]:
    """The recipe's layer-type names, in registration order, each once ("gdn", "attention", "natsl", ...)."""
    return list(dict.fromkeys(k.layer_type for k in KINDS))


def config_sections() -> dict[str, dict[str, str]]:
    """The model sections of the registered kinds, in registration order: section -> {key: ModelConfig field}."""
    sections: dict[str, dict[str, str]] = {}
    for kind in KINDS:
        if kind.section is not None:
            sections.setdefault(kind.section, {}).update(kind.section_keys)
    return sections


def kind_of(config: "ModelConfig", layer_type: str) -> LayerKind:
    """The registered kind that `config` builds for layers of `layer_type`.

    Args:
        config: the model config (its variant fields pick among a type's kinds).
        layer_type: a name from `ModelConfig.layer_types()`.

    Returns:
        The LayerKind; a NatslError for a name no kind has.
    """
    for kind in KINDS:
        if kind.layer_type == layer_type and kind.applies(config):
            return kind
    raise NatslError(f"layer type {layer_type!r} is not one natsl builds; allowed: {', '.join(layer_type_names())}")


def kinds_of(config: "ModelConfig") -> list[LayerKind]:
    """The kind of every layer of `config`, in layer order."""
    return [kind_of(config, t) for t in config.layer_types()]


def present(config: "ModelConfig") -> list[LayerKind]:
    """The distinct kinds `config` builds, in layer order of their first layer."""
    return list({k.name: k for k in kinds_of(config)}.values())


def any_routed(config: "ModelConfig") -> bool:
    """Whether `config` has a NAtS-L (routed) layer."""
    return any(k.routed for k in kinds_of(config))
