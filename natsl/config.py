"""Recipes: a YAML file with `model`, `train` and `data` sections, validated on load.

Every section is a dataclass; loading checks each key against its field (unknown key, wrong type,
value outside its choices, inconsistent head counts) and raises a one-line `NatslError` naming
the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from natsl.block_size import DEFAULT_BLOCK_SIZE, MODEL_ALLOWED, fast_problem, model_takes
from natsl.errors import NatslError
from natsl.seeding import check_seed

LAYER_TYPES = ("gdn", "attention", "natsl", "mamba2", "nsa")
# The shipped recipes live once, in the checkout's top-level recipes/ (so that `natsl train
# recipes/800m_hybrid.yaml` works from a checkout as written); a wheel ships them as package data
# natsl/recipes/, copied there by setup.py's build step. `load_recipe("800m_hybrid")` or
# `load_recipe("recall/gdn")` names one from either place (recipes_root).
RECIPES_PACKAGE = "natsl"


@dataclass
class ModelConfig:
    """Architecture of a causal LM built from GDN, softmax-attention, NAtS-L, Mamba2 and NSA layers."""

    vocab_size: int = 32000
    hidden_size: int = 1536
    # The SwiGLU MLP of every block (Mamba2 blocks only with mamba2_mlp); 0: blocks without an MLP.
    intermediate_size: int = 4096
    num_layers: int = 21
    # Layout: every layer is `base_layer` except the indices listed for another type.
    base_layer: Literal["gdn", "attention", "natsl", "mamba2", "nsa"] = "gdn"
    natsl_layers: list[int] = field(default_factory=list)
    attention_layers: list[int] = field(default_factory=list)
    gdn_layers: list[int] = field(default_factory=list)
    nsa_layers: list[int] = field(default_factory=list)
    # GDN and NAtS-L heads: H heads of key dim K and value dim V.
    num_heads: int = 6
    head_k_dim: int = 192
    head_v_dim: int = 384
    conv_size: int = 4
    # Plain softmax-attention layers (Transformer, GDN Hybrid).
    attn_num_heads: int = 24
    attn_head_dim: int = 64
    attn_rope: bool = True
    # Sliding-window attention: each softmax-attention layer's query at position p sees the keys at
    # p - attn_window + 1 .. p (its own token included), and the cache keeps only those (a ring
    # buffer). 0: full causal attention.
    attn_window: int = 0
    rope_theta: float = 10000.0
    # Native Sparse Attention layers (flash-linear-attention's NSA, natsl/models/nsa.py): nsa_num_heads query
    # heads of nsa_head_dim share nsa_kv_heads key/value heads (fla's kernels need a group of a power of two,
    # at least 16); each query reads the mean-pooled blocks of nsa_block_size keys (compressed branch), the
    # nsa_block_counts blocks they score highest (selected branch) and the last nsa_window keys (0: no
    # window branch), mixed by sigmoid gates; RoPE at rope_theta.
    nsa_num_heads: int = 16
    nsa_kv_heads: int = 1
    nsa_head_dim: int = 128
    nsa_block_size: int = 64
    nsa_block_counts: int = 16
    nsa_window: int = 512
    # NAtS-L: each GDN head is cut into R softmax heads that share its route.
    softmax_heads_per_group: int = 3
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per routing block (natsl/block_size.py)
    natsl_rope: bool = True
    # The linear memory of the NAtS-L layers: the GDN state (the paper's layer), a Mamba2 (SSD) state
    # (the paper's NAtS-L Mamba2, the authors' natsl_attn_mamba2; natsl/models/mamba2.py) or a plain
    # DeltaNet state, GDN without its gate (the authors' natsl_attn_delta; natsl/models/deltanet.py).
    natsl_state: Literal["gdn", "mamba2", "delta"] = "gdn"
    # Mamba2 layers: heads of mamba2_head_dim (P) over expand * hidden_size channels, state size N per
    # head, B and C shared by groups of heads (Mamba2's defaults: P 64, N 128, expand 2, 1 group).
    mamba2_head_dim: int = 64
    mamba2_state_size: int = 128
    mamba2_expand: int = 2
    mamba2_groups: int = 1
    # Whether the Mamba2 layers' short conv adds a bias before its SiLU (mamba_ssm's and the authors'
    # default, use_conv_bias; natsl's recipes have none). A biased conv runs the PyTorch formula on every
    # path (the Triton conv kernels take no bias).
    mamba2_conv_bias: bool = False
    # The Mamba2 state of a NAtS-L layer reads as the authors' natsl_attn_mamba2 by default: its q and k
    # L2-normalised per head (the GDN state's normalisation, same code) and no D v skip. False / True
    # give the plain SSD read (q, k as Mamba2's unnormalised C and B, plus D v), natsl's first form.
    mamba2_state_l2: bool = True
    mamba2_state_skip: bool = False
    # Whether Mamba2 blocks carry the SwiGLU MLP of intermediate_size (which every other block has): no,
    # as Mamba2's own stack and the plain Mamba2 blocks of the authors' NAtS-L Mamba2 model.
    mamba2_mlp: bool = False
    # Table 4 ablations.
    intra_block_output: Literal["both", "softmax", "gdn"] = "both"
    decay_skipped_blocks: bool = True
    # after_sum normalises the sum per softmax head (V/R channels); after_sum_state_head per state head (V
    # channels, R softmax heads together: the authors' NAtS-L on DeltaNet, natsl_attn_delta).
    branch_norm: Literal["separate", "after_sum", "after_sum_state_head"] = "separate"
    mix_input: Literal["q", "x"] = "q"
    mix_weights: Literal["softmax", "sigmoid", "linear", "none"] = "softmax"
    route_grad: Literal["active", "full"] = "active"
    # Training-only router options against routes that collapse to constants (docs/recall.md); the
    # defaults are the paper's layer. router_noise: scale of Gumbel noise added to the router's two
    # scores in training (exploration); router_balance: weight of the auxiliary loss
    # sum over groups of (mean keep probability - router_target_keep)^2 per NAtS-L layer.
    router_noise: float = 0.0
    router_balance: float = 0.0
    router_target_keep: float = 0.5
    # The auxiliary-loss-free balancing controller (docs/recall.md): with router_keep_target F set, every
    # NAtS-L layer holds a float32 bias per routing group, added to the keep score on every path
    # (training, evaluation, prefill, decode; saved in checkpoints), and each training forward moves it
    # by router_bias_rate * sign(F - the group's kept fraction in that forward). None: no bias (the paper's
    # layer). The rate is read in training only.
    router_keep_target: Optional[float] = None
    router_bias_rate: float = 1e-3
    # The keep budget (docs/recall.md): with router_keep_budget F set, the hard route of every NAtS-L
    # layer is a causal rule on the router's keep gaps instead of their sign: a block is kept when its
    # gap ranks in the top F of its group's blocks so far and the group's kept count stays at most
    # ceil(F n) over every prefix of n blocks (natsl.reference.router.budget_keep), on every path.
    # None: the argmax (the paper's layer). With router_keep_target the bias shifts the gaps it ranks;
    # a route_override (a forced keep fraction) replaces it.
    router_keep_budget: Optional[float] = None
    # With the budget: the first router_keep_budget_sink blocks of every sequence are always kept and lie
    # outside it (the budget's rank and cap count from the block after them), so that a prompt's opening
    # blocks (MQAR's key-value pairs) are never split between the two memories. 0: no sink.
    router_keep_budget_sink: int = 0
    # Common.
    norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    backend: Optional[Literal["reference", "chunked", "fast"]] = None

    def layer_types(self) -> list[str]:
        types_ = [self.base_layer] * self.num_layers
        for name, indices in (("natsl", self.natsl_layers), ("attention", self.attention_layers),
                              ("gdn", self.gdn_layers), ("nsa", self.nsa_layers)):
            for i in indices:
                types_[i] = name
        return types_

    def validate(self, prefix: str = "model") -> None:
        check_ranges(self, prefix, MODEL_RULES)
        if self.backend == "fast" and fast_problem(self.block_size):
            raise NatslError(f"recipe key '{prefix}.block_size' {fast_problem(self.block_size)}")
        if self.router_keep_budget_sink and self.router_keep_budget is None:
            raise NatslError(f"recipe key '{prefix}.router_keep_budget_sink' = {self.router_keep_budget_sink} needs "
                             f"'{prefix}.router_keep_budget' (the sink lies outside a keep budget); set one, or the sink to 0")
        seen: dict[int, str] = {}
        for name in ("natsl_layers", "attention_layers", "gdn_layers", "nsa_layers"):
            for i in getattr(self, name):
                if not 0 <= i < self.num_layers:
                    raise NatslError(f"recipe key '{prefix}.{name}' has layer index {i}; allowed: 0 to {self.num_layers - 1}")
                if i in seen:
                    raise NatslError(f"layer {i} is listed in both '{prefix}.{seen[i]}' and '{prefix}.{name}'; list each layer once")
                seen[i] = name
        # Each layer kind checks its own fields (natsl.models.registry: LayerKind.validate; no torch import).
        from natsl.models.registry import present

        for kind in present(self):
            kind.validate(self, prefix)

    def validate_nsa(self, prefix: str) -> None:
        """The shapes flash-linear-attention's NSA kernels take (fla/ops/nsa/parallel.py)."""
        heads, kv = self.nsa_num_heads, self.nsa_kv_heads
        group = heads // kv
        if heads % kv or group < 16 or group & (group - 1):
            raise NatslError(f"recipe key '{prefix}.nsa_num_heads' = {heads} must be nsa_kv_heads = {kv} times a power of "
                             "two of at least 16 (flash-linear-attention's NSA kernels); e.g. 16 heads over 1 kv head")
        if self.nsa_head_dim % 2:
            raise NatslError(f"recipe key '{prefix}.nsa_head_dim' must be even for RoPE, got {self.nsa_head_dim}")
        if 2 * self.nsa_block_counts > self.nsa_block_size:
            raise NatslError(f"recipe key '{prefix}.nsa_block_counts' = {self.nsa_block_counts} must be at most half of "
                             f"nsa_block_size = {self.nsa_block_size} (fla's top-k kernel); lower it or raise the block size")

    @property
    def softmax_k_dim(self) -> int:
        return self.head_k_dim // self.softmax_heads_per_group

    @property
    def softmax_v_dim(self) -> int:
        return self.head_v_dim // self.softmax_heads_per_group


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5  # the initial (warmup start) and final (cosine end) learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_tokens: int = 1_000_000_000

    def validate(self, prefix: str = "optim") -> None:
        check_ranges(self, prefix, OPTIM_RULES)
        _require(self.min_lr <= self.lr, f"{prefix}.min_lr", self.min_lr,
                 f"a finite number from 0 to {prefix}.lr = {self.lr}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{prefix}.betas", self.betas,
                 "two numbers [beta1, beta2], each in [0, 1)")  # nan fails the range test too


@dataclass
class TrainConfig:
    seq_len: int = 4096
    tokens_per_step: int = 524288
    # Sequences per forward/backward; "auto": the largest that fits the device, found before the first
    # step (natsl.training.micro_batch), with accumulation keeping tokens_per_step.
    micro_batch_size: int | Literal["auto"] = 8
    total_tokens: int = 50_000_000_000
    max_steps: Optional[int] = None
    seed: int = 0
    dtype: Literal["bf16", "fp32"] = "bf16"
    compile: bool = False
    # With compile, on one CUDA device: replay the compiled forward and backward as CUDA graphs
    # (torch.compile's "reduce-overhead" mode), for models small enough that the host falls behind the
    # GPU; the 800M ones at micro-batch 8 gained nothing (docs/training.md).
    cuda_graphs: bool = False
    # Recompute each block in the backward (less memory, slower steps); "auto": on only where
    # micro_batch_size auto finds that not even one sequence fits without it.
    activation_checkpointing: bool | Literal["auto"] = "auto"
    # Several ranks (torchrun): "ddp" replicates the model; "fsdp" shards parameters, gradients and
    # optimizer state with PyTorch's FSDP2 (fully_shard per block).
    parallel: Literal["ddp", "fsdp"] = "ddp"
    log_every: int = 10
    eval_every: int = 500
    eval_tokens: int = 1_048_576
    save_every: int = 1000
    keep_last: int = 3
    max_bad_steps: int = 20
    out_dir: str = "runs/{name}"
    # Start from these weights (any checkpoint folder of the same model) with a fresh optimizer and schedule:
    # fine-tuning, or a curriculum's next stage. A run that resumes its own checkpoint ignores it.
    init_from: Optional[str] = None
    # Also send every metrics.jsonl record to TensorBoard (OUT/tensorboard) or wandb (offline, OUT/wandb).
    tracker: Literal["none", "tensorboard", "wandb"] = "none"

    def validate(self, prefix: str = "train") -> None:
        # Sizes and intervals; the trainer reads none of them as 0 = 'never'.
        for key in ("seq_len", "tokens_per_step", "total_tokens", "log_every",
                    "eval_every", "eval_tokens", "save_every", "max_bad_steps"):
            _require(getattr(self, key) >= 1, f"{prefix}.{key}", getattr(self, key), "at least 1")
        _require(self.micro_batch_size == "auto" or self.micro_batch_size >= 1, f"{prefix}.micro_batch_size",
                 self.micro_batch_size, "at least 1, or auto (the largest that fits the device)")
        _require(self.max_steps is None or self.max_steps >= 1, f"{prefix}.max_steps", self.max_steps,
                 "at least 1 (null: no limit)")
        check_seed(self.seed, f"recipe key '{prefix}.seed'")  # the one seed rule of every command
        # Checkpoint pruning keeps every step folder when keep_last is 0.
        _require(self.keep_last >= 0, f"{prefix}.keep_last", self.keep_last, "at least 0 (0 keeps every checkpoint)")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from.strip()):
            raise NatslError(f"recipe key '{prefix}.init_from' = {self.init_from!r} must be a checkpoint folder's path "
                             "(or null: start from random weights)")
        if self.tokens_per_step % self.seq_len:
            raise NatslError(f"recipe key '{prefix}.tokens_per_step' = {self.tokens_per_step} must be a multiple "
                             f"of {prefix}.seq_len = {self.seq_len}")

    def accumulation(self, world: int = 1, micro_batch: Optional[int] = None) -> Optional[int]:
        """Micro-batches each of `world` ranks runs per optimizer step at `micro_batch` (default:
        micro_batch_size); tokens_per_step must be a whole number of micro-batches over the ranks (the
        trainer's rule; the sweep checks it at load). None for micro_batch_size auto, after checking that
        the ranks share the step's sequences evenly: the trainer picks the micro-batch on the device."""
        micro_batch = self.micro_batch_size if micro_batch is None else micro_batch
        if micro_batch == "auto":
            if self.tokens_per_step % (self.seq_len * world):
                raise NatslError(f"train.tokens_per_step = {self.tokens_per_step} is not a multiple of seq_len x "
                                 f"ranks = {self.seq_len} x {world}; change one of them")
            return None
        micro_tokens = micro_batch * self.seq_len
        if self.tokens_per_step % (micro_tokens * world):
            raise NatslError(f"train.tokens_per_step = {self.tokens_per_step} is not a multiple of micro_batch_size x "
                             f"seq_len x ranks = {micro_batch} x {self.seq_len} x {world}; change one of them")
        return self.tokens_per_step // (micro_tokens * world)


@dataclass
class DataConfig:
    # A folder written by `natsl tokenize`; "builtin" means the embedded smoke-test corpus.
    path: str = "builtin"
    tokenizer: Optional[str] = None
    # Start each document with the tokenizer's BOS when it has one (how the paper's Llama-2 tokenizer
    # trained). Applies where natsl tokenizes for the run (the builtin corpus); a `natsl tokenize` folder
    # keeps what it was made with (`--no-bos`), recorded in its meta.json.
    bos: bool = True


@dataclass
class Recipe:
    name: str = "unnamed"
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def context_length(recipe: Recipe) -> int:
    """The context a model declares and is evaluated at by default: the length it trained at
    (train.seq_len), capped at what its cache holds (model.max_seq_len).

    One rule for `lm_eval --model natsl` and `natsl eval-lm` (their default max_length) and for a
    `--to hf` export's `max_position_embeddings`, which lm-eval's `--model hf` (and most tools built on
    transformers) take as the model's context; so both score the same windows by default. Longer
    contexts stay open: max_length= in model_args, and generation up to model.max_seq_len (natsl's hard
    limit, kept in the export's natsl_recipe), as Llama-2 declares its 4096 training tokens and still runs
    past them.

    Args:
        recipe: the model's recipe.

    Returns:
        A number of tokens.
    """
    return min(recipe.train.seq_len, recipe.model.max_seq_len)


# The default output folders of `natsl train`: runs/NAME. A recipe's name and train.out_dir come from a
# file, and a name such as `../../x` must not put a run (and its writes) anywhere else.
RUNS_FOLDER = "runs"
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}")


def run_folder(recipe: Recipe) -> Path:
    """The folder `natsl train` writes to without --out: train.out_dir with {name} replaced by the
    recipe's name; it must lie inside runs/ (a relative path, no `..`), and the name must be one plain
    folder name.

    Args:
        recipe: the validated recipe.

    Returns:
        The relative path, e.g. runs/tiny_hybrid.
    """
    template = recipe.train.out_dir
    try:
        folder = template.format(name=recipe.name)
    except (KeyError, IndexError, ValueError, AttributeError):
        raise NatslError(f"recipe key 'train.out_dir' = {template!r} may only use the placeholder "
                         "{name}") from None
    if "{name}" in template and not RUN_NAME.fullmatch(recipe.name):
        raise NatslError(f"recipe name {recipe.name!r} cannot name a run folder (letters, digits and _ . + = - only, "
                         "not starting with a dot, at most 128 characters); set `name:` in the recipe, or pass --out")
    parts = Path(folder).parts
    if Path(folder).is_absolute() or ".." in parts or len(parts) < 2 or parts[0] != RUNS_FOLDER or "\\" in folder:
        raise NatslError(f"recipe key 'train.out_dir' = {template!r} gives {folder!r}, not a folder inside "
                         f"{RUNS_FOLDER}/ (e.g. {RUNS_FOLDER}/{{name}}); pass --out to train anywhere else")
    return Path(folder)


def _finite(low: float, high: float = math.inf, *, open_low: bool = True) -> tuple:
    """A rule: a finite number above `low` (or from `low`, with open_low=False) and at most `high`."""
    def ok(v):
        return math.isfinite(v) and (v > low if open_low else v >= low) and v <= high
    bound = f"> {low:g}" if open_low else f">= {low:g}"
    return ok, f"a finite number {bound}" + (f" and <= {high:g}" if high != math.inf else "")


def _count(low: int, high: Optional[int] = None) -> tuple:
    """A rule: an integer from `low` (to `high`)."""
    if high is None:
        return (lambda v: v >= low), f"at least {low}"
    return (lambda v: low <= v <= high), f"an integer from {low} to {high}"


def _power_of_two(low: int):
    return lambda v: v >= low and v & (v - 1) == 0


# The range of every numeric field, as (rule, what is allowed). Values outside them either crash
# deep inside the model or train quietly on NaN (norm_eps < 0, rope_theta <= 0, init_std < 0).
MODEL_RULES = {
    # token ids are stored as uint16 or uint32 (natsl.data.tokenize.token_dtype)
    "vocab_size": _count(1, 2**32),
    # layers: the checks walk a list of num_layers types, so an unbounded count (10**9 in a recipe or an HF
    # config) would hang them; 1024 is far past any model trained (the paper's deepest has 48)
    "hidden_size": _count(1), "num_layers": _count(1, 1024),
    "intermediate_size": (lambda v: v >= 0, "at least 0 (0: blocks without an MLP)"),
    "mamba2_head_dim": _count(1), "mamba2_state_size": _count(1), "mamba2_expand": _count(1), "mamba2_groups": _count(1),
    "num_heads": _count(1), "head_k_dim": _count(1), "head_v_dim": _count(1),
    # A *short* conv: the Triton kernels unroll their loop over its width (a width in the thousands
    # compiles and runs for many minutes per step), and the decode cache keeps width - 1 rows per layer.
    "conv_size": _count(1, 64),
    "attn_num_heads": _count(1), "attn_head_dim": _count(1),
    "attn_window": (lambda v: v >= 0, "an integer >= 0 (0: full causal attention)"),
    "nsa_num_heads": _count(1), "nsa_kv_heads": _count(1),
    # fla's NSA kernels hold a key in one tile of at most 256 and multiply tiles of at least 16
    "nsa_head_dim": _count(16, 256),
    # fla's kernels index a block with tl.arange (a power of two) and multiply it in tiles of at least 16;
    # the top-k kernel stores a power of two of selected blocks, so another count would run more on CUDA
    "nsa_block_size": (_power_of_two(16), "a power of two, at least 16"),
    "nsa_block_counts": (_power_of_two(1), "a power of two, at least 1"),
    "nsa_window": (lambda v: v >= 0, "an integer >= 0 (0: no sliding-window branch)"),
    "rope_theta": _finite(0),  # the angles are position * theta**(-2i/d): theta <= 0 gives NaN
    "softmax_heads_per_group": _count(1), "block_size": (model_takes, MODEL_ALLOWED),
    "norm_eps": _finite(0),  # rsqrt(mean(x^2) + eps): a negative eps gives NaN on small activations
    "init_std": _finite(0),  # normal_(std=...) refuses < 0 and 0 makes every unit the same
    "max_seq_len": _count(1),
    # training-only router options (docs/recall.md); 0 turns noise and balance off
    "router_noise": _finite(0, open_low=False), "router_balance": _finite(0, open_low=False),
    "router_target_keep": _finite(0, 1, open_low=False),
    "router_keep_target": (lambda v: v is None or (math.isfinite(v) and 0 < v < 1),
                           "a number strictly between 0 and 1, or null (no keep bias)"),
    "router_bias_rate": _finite(0),
    "router_keep_budget": (lambda v: v is None or (math.isfinite(v) and 0 < v < 1),
                           "a number strictly between 0 and 1 (the kept fraction), or null (no budget)"),
    "router_keep_budget_sink": _count(0),
}
OPTIM_RULES = {
    "lr": _finite(0),
    "min_lr": _finite(0, open_low=False),  # the initial (warmup start) and final (cosine end) rate
    "eps": _finite(0),
    "weight_decay": _finite(0, open_low=False),
    # The trainer clips at grad_clip when it is > 0; 0 turns clipping off.
    "grad_clip": (_finite(0, open_low=False)[0], "a finite number >= 0 (0 turns clipping off)"),
    "warmup_tokens": _count(0),
}


def check_ranges(section: Any, prefix: str, rules: dict) -> None:
    """Check every field of `section` named in `rules` (see MODEL_RULES); a one-line NatslError names the key."""
    for key, (ok, allowed) in rules.items():
        _require(ok(getattr(section, key)), f"{prefix}.{key}", getattr(section, key), allowed)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise NatslError(f"recipe key '{key}' must be {allowed}, got {value!r}")


# ----------------------------------------------------------------------------- parsing

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        options = typing.get_args(tp)
        return repr(options[0]) if len(options) == 1 else "one of " + ", ".join(repr(a) for a in options)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp`; return it converted (e.g. int -> float)."""
    origin = typing.get_origin(tp)
    fail = NatslError(f"recipe key '{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except NatslError:
                pass
        raise fail
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise fail
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise fail
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise fail
        return value
    if tp is int:
        # YAML 1.1 reads `50e9` as a string and `1.0e9` as a float; both are fine for a count.
        if isinstance(value, bool):
            raise fail
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise fail from None
        if isinstance(value, float):
            if not math.isfinite(value) or value != int(value):
                raise fail
            value = int(value)
        if not isinstance(value, int):
            raise fail
        return value
    if tp is float:
        if isinstance(value, bool):
            raise fail
        if isinstance(value, str):  # `3e-4` without a dot is a string to PyYAML
            try:
                return float(value)
            except ValueError:
                raise fail from None
        if not isinstance(value, (int, float)):
            raise fail
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def from_dict(cls: type, data: Any, prefix: str = ""):
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    where = f"'{prefix}'" if prefix else "the recipe"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise NatslError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise NatslError(f"unknown recipe key '{full}'; allowed keys here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


# ----------------------------------------------------------------------------- the nested model section

# A recipe's model section may group its fields by what they configure (the nested form the shipped
# recipes use): the common fields at the top, `layers` (the layout) and one section per layer kind, whose
# keys drop the kind's prefix (`natsl: {block_size: 64, rope: false, router: {keep_budget: 0.25}}`). It is
# read into ModelConfig's flat fields, which the code, checkpoints and exports keep; the flat form (every
# recipe and checkpoint from before) reads as it always did, and `--set model.block_size=128` and
# `--set model.natsl.block_size=128` name the same field.
LAYOUT_SECTION = {"base": "base_layer", "natsl": "natsl_layers", "attention": "attention_layers",
                  "gdn": "gdn_layers", "nsa": "nsa_layers"}


def model_sections() -> dict[str, dict[str, str]]:
    """The nested model sections: "layers" and each layer kind's (natsl.models.registry, LayerKind.section),
    each a mapping of its keys (dotted inside a subsection: "router.noise") to ModelConfig fields."""
    from natsl.models.registry import config_sections

    return {"layers": LAYOUT_SECTION, **config_sections()}


def _level_keys(table: dict[str, str], inner: str) -> list[str]:
    """The keys of a section (or of its subsection `inner`, "router.") one level down."""
    return list(dict.fromkeys(k[len(inner):].split(".")[0] for k in table if k.startswith(inner)))


def flatten_model(data: Any, prefix: str = "model") -> tuple[Any, dict[str, str]]:
    """A recipe's model section with its nested sections read into ModelConfig's field names.

    Args:
        data: the section as parsed (flat, nested or both); anything but a mapping is returned as is.
        prefix: the section's name in error lines.

    Returns:
        (the flat mapping, {field: the nested key that set it} for error lines). A field set twice (a
        flat key and its nested one) or an unknown key in a section is a one-line NatslError.
    """
    if not isinstance(data, dict):
        return data, {}
    sections = model_sections()
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(name: str, value: Any, key: str) -> None:
        if name in flat:
            raise NatslError(f"recipe keys '{where.get(name, f'{prefix}.{name}')}' and '{key}' both set the model's "
                             f"{name}; keep one")
        flat[name] = value
        if key != f"{prefix}.{name}":
            where[name] = key

    def read(value: Any, table: dict[str, str], full: str, inner: str) -> None:
        if value is None:  # an empty section
            return
        if not isinstance(value, dict):
            raise NatslError(f"recipe key '{full}' is a section, a mapping of {', '.join(_level_keys(table, inner))}; "
                             f"got {type(value).__name__} {value!r}")
        for key, item in value.items():
            dotted = f"{inner}{key}"
            if dotted in table:
                put(table[dotted], item, f"{full}.{key}")
            elif any(k.startswith(dotted + ".") for k in table):
                read(item, table, f"{full}.{key}", dotted + ".")
            else:
                raise NatslError(f"unknown recipe key '{full}.{key}'; allowed keys here: "
                                 f"{', '.join(_level_keys(table, inner))}")

    for key, value in data.items():
        if key in sections:
            read(value, sections[key], f"{prefix}.{key}", "")
        else:
            put(key, value, f"{prefix}.{key}")
    return flat, where


def nest_model(flat: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields (a flat mapping, e.g. `dataclasses.asdict(config)`) in the nested form: the fields
    of no section first (in their given order), then `layers` and each layer kind's section, in the
    sections' own order, holding only the given fields."""
    sections = model_sections()
    owned = {name for table in sections.values() for name in table.values()}
    out = {name: value for name, value in flat.items() if name not in owned}
    for section, table in sections.items():
        values: dict[str, Any] = {}
        for key, name in table.items():
            if name in flat:
                node = values
                *subs, last = key.split(".")
                for sub in subs:
                    node = node.setdefault(sub, {})
                node[last] = flat[name]
        if values:
            out[section] = values
    return out


def _nested_names(message: str, where: dict[str, str], prefix: str = "model") -> str:
    """An error line about flat fields, naming the nested keys that set them."""
    for name, key in where.items():
        message = re.sub(rf"\b{re.escape(prefix)}\.{re.escape(name)}\b", key, message)
    return message


def recipe_from_dict(data: Any) -> Recipe:
    where: dict[str, str] = {}
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        model, where = flatten_model(data["model"])
        data = {**data, "model": model}
    try:
        recipe = from_dict(Recipe, data)
        recipe.model.validate()
    except NatslError as err:
        if not where:
            raise
        raise NatslError(_nested_names(str(err), where)) from None
    recipe.optim.validate()
    recipe.train.validate()
    if recipe.model.router_keep_target is not None and recipe.train.activation_checkpointing is True:
        # the backward's recompute of a block would route on the keep bias that its forward already moved
        raise NatslError("recipe key 'model.router_keep_target' cannot train with 'train.activation_checkpointing: "
                         "true' (a recomputed block would route on the bias its forward already updated); "
                         "turn one of them off")
    return recipe


# Every YAML file natsl reads (recipes, sweep specs, override values) comes through load_yaml_text.
# A recipe holds about a hundred values and a sweep spec a few hundred; a document that expands far
# beyond that through its aliases (*name repeats what &name marked: "billion laughs") would make every
# later walk over the data -- the duplicate-key check, validation, copies, JSON records -- pay for
# the expansion, not for the text. Counting is linear: each distinct node is visited once.
MAX_YAML_VALUES = 100_000
MAX_YAML_BYTES = 1 << 20  # a recipe or sweep spec is a few KB


def load_yaml_text(text: str, what: str) -> Any:
    """Parse YAML from an untrusted source: safe constructors only (nothing is executed), one document,
    no key given twice in a mapping, no alias that contains itself, and at most MAX_YAML_VALUES values
    with every alias counted as a copy of what it names.

    Args:
        text: the YAML text.
        what: what it is, starting every error line (e.g. "recipe file 'x.yaml'").

    Returns:
        The parsed value (None for an empty document).
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()  # the node graph only: an alias is one shared node here
        if root is None:
            return None
        check_yaml_nodes(root, what)
        return loader.construct_document(root)
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise NatslError(f"{what} is not valid YAML ({first}); correct it") from None
    except RecursionError:
        raise NatslError(f"{what} is nested too deeply (a recipe or sweep spec nests a few levels); "
                         "correct it") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path, what: str) -> Any:
    """load_yaml_text of a file of at most MAX_YAML_BYTES of UTF-8 (natsl.files.read_small_text).

    Args:
        path: the file.
        what: what it is, starting every error line (e.g. "sweep spec 'x.yaml'").

    Returns:
        The parsed value (None for an empty file).
    """
    from natsl.files import read_small_text

    return load_yaml_text(read_small_text(path, MAX_YAML_BYTES, "fix the file"), what)


def check_yaml_nodes(root: yaml.Node, what: str) -> None:
    """Refuse a node graph with a key given twice in one mapping (yaml.safe_load would silently keep the
    last value: a recipe with two `lr:` lines would train with whichever came last), an alias inside what
    it names, or more than MAX_YAML_VALUES values once expanded. A loop over an explicit stack, each
    distinct node visited once (its expanded size kept): linear in the text, and a deep file cannot
    exhaust Python's stack here."""
    sizes: dict[int, int] = {}  # id(node) -> how many values it expands to
    path: set[int] = set()  # the nodes being expanded (an alias to one of them contains itself)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        children = ([part for pair in node.value for part in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        if expanded:
            path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > MAX_YAML_VALUES:
                raise NatslError(f"{what} expands to more than {MAX_YAML_VALUES} values (each alias *name counts as "
                                 "a copy of what &name marks); a recipe or sweep spec needs far fewer: write the "
                                 "values out instead of nesting aliases")
            continue
        if id(node) in sizes:
            continue
        if id(node) in path:
            raise NatslError(f"{what} has an alias inside the value it names (line {node.start_mark.line + 1}), "
                             "an endless value; write the value out")
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key, _ in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and name in seen:
                    raise NatslError(f"{what} gives key {name!r} twice (lines {seen[name]} and "
                                     f"{key.start_mark.line + 1}); keep one")
                if name is not None:
                    seen[name] = key.start_mark.line + 1
        path.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children)


def recipes_root():
    """The folder of the shipped recipes (a Traversable): an installed wheel's package data natsl/recipes/,
    else the checkout's top-level recipes/ beside the natsl package (editable installs, PYTHONPATH runs)."""
    packaged = resources.files(RECIPES_PACKAGE) / "recipes"
    if (packaged / "tiny_hybrid.yaml").is_file():  # not a bare folder left behind by an older checkout
        return packaged
    return Path(__file__).resolve().parent.parent / "recipes"


def recipe_names() -> list[str]:
    """Names of the recipes shipped with natsl ("tiny_hybrid", "recall/gdn", ...), sorted; sweep specs
    (sweep.yaml, sweep_*.yaml) beside them are not recipes."""
    names = []
    folders = [("", recipes_root())]
    while folders:
        prefix, folder = folders.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                folders.append((f"{prefix}{entry.name}/", entry))
            elif entry.name.endswith(".yaml") and not (entry.name == "sweep.yaml" or entry.name.startswith("sweep_")):
                names.append(prefix + entry.name[:-len(".yaml")])
    return sorted(names)


def shipped_recipe(name: str):
    """The packaged recipe file called `name` (a Traversable), or None."""
    if not name or name.startswith(("/", ".")) or "\\" in name or ".." in name.split("/"):
        return None
    entry = recipes_root()
    for part in f"{name}.yaml".split("/"):
        entry = entry / part
    return entry if entry.is_file() else None


# What a recipe without the section (or with an empty one) would silently run: from_dict fills a
# missing section with its defaults, which are the 800M model and its 50B-token training.
SECTION_DEFAULTS = {"model": "the 800M default model", "train": "the 800M training run (50B tokens at seq_len 4096)"}


def load_recipe(path: str | Path, require: tuple[str, ...] = ("model",)) -> Recipe:
    """Read and validate a recipe: a YAML file, or the name of a shipped one such as `800m_hybrid` or
    `recall/gdn` (load_yaml_file: safe constructors, bounded aliases; nothing is executed).

    Args:
        path: the file, or a shipped recipe's name.
        require: sections that must be present and non-empty (SECTION_DEFAULTS says what each would
            silently fall back to); `natsl train` needs the train section too.

    Returns:
        The validated recipe, named after the file when it sets no name.
    """
    path = Path(path)
    if not path.is_file() and path.suffix == "" and (shipped := shipped_recipe(path.as_posix())) is not None:
        path = shipped
    elif path.is_dir():
        raise NatslError(f"recipe {str(path)!r} is a folder; pass a recipe file or name such as tiny_hybrid "
                         "(to continue a run, pass its recipe and --out FOLDER)")
    elif not path.is_file():
        raise NatslError(f"recipe file {str(path)!r} does not exist; pass a path to a YAML file or a recipe name "
                         f"({', '.join(recipe_names())})")
    if isinstance(path, Path):
        data = load_yaml_file(path, f"recipe file {str(path)!r}")
    else:  # a shipped recipe inside an installed wheel (a Traversable)
        data = load_yaml_text(path.read_text(encoding="utf-8"), f"recipe file {str(path)!r}")
    check_sections(data, f"recipe file {str(path)!r}", require)
    recipe = recipe_from_dict(data)
    if recipe.name == "unnamed":
        recipe.name = Path(path.name).stem
    return recipe


def check_sections(data: Any, where: str, require: tuple[str, ...]) -> None:
    """Refuse an empty recipe, or one whose required sections are absent, null or empty (a mapping
    that is not one is left to recipe_from_dict's message)."""
    if data is None:  # from_dict would read it as {}: silently the 800M defaults
        raise NatslError(f"{where} is empty; a recipe needs at least a model section (see recipes/tiny_hybrid.yaml)")
    if not isinstance(data, dict):
        return
    for section in require:
        if section in data and data[section] is not None and data[section] != {}:
            continue
        state = "has no" if section not in data else "has an empty"
        raise NatslError(f"{where} {state} {section} section, which would silently be {SECTION_DEFAULTS[section]}; "
                         f"write the {section} section out (see recipes/tiny_hybrid.yaml)")


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply dotted `section.key=value` overrides (values parsed as YAML) and re-validate."""
    data = recipe.to_dict()
    for item in overrides:
        if "=" not in item:
            raise NatslError(f"override {item!r} is not of the form section.key=value (e.g. optim.lr=1e-3)")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        sections = model_sections()
        if len(parts) >= 2 and parts[0] == "model" and parts[1] in sections:  # the nested form's name
            value = load_yaml_text(raw, f"override value {raw[:80]!r} for '{dotted}'")
            fields, _ = flatten_model({parts[1]: value} if len(parts) == 2 else
                                      {parts[1]: _nest_value(parts[2:], value)})
            data["model"].update(fields)
            continue
        node = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node, dict) or part not in node or not isinstance(node[part], dict):
                raise NatslError(f"override key '{'.'.join(parts[:i + 1])}' is not a recipe section; "
                                 f"sections: {', '.join(k for k, v in data.items() if isinstance(v, dict))}")
            node = node[part]
        node[parts[-1]] = load_yaml_text(raw, f"override value {raw[:80]!r} for '{dotted}'")
    return recipe_from_dict(data)


def _nest_value(keys: list[str], value: Any) -> dict:
    """{"a": {"b": value}} for keys ["a", "b"]."""
    for key in reversed(keys):
        value = {key: value}
    return value
