"""`natsl convert`: a training checkpoint into a clean inference folder, and the import of the
authors' released Hugging Face checkpoints (model type `neural_attention_search_linear_attn_gdn`,
github.com/automl/NeuralAttentionSearchLinear, built on flash-linear-attention layers), and of their NAtS-L
on Mamba2 (model type `nats_mamba`: NAtS-L layers on a Mamba2 state beside flash-linear-attention's Mamba2
blocks), except where its Mamba2 blocks have several B/C groups (hf_mamba2_recipe); their conv bias (the
default, use_conv_bias) maps to natsl's mamba2_conv_bias.

Only safetensors are read; a checkpoint that ships only pickled weights (`pytorch_model.bin`) is
refused rather than unpickled. The full name mapping and what it assumes is in docs/evaluation.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from natsl.errors import NatslError
from natsl.files import read_json
from natsl.models.registry import kind_of

HF_MODEL_TYPE = "neural_attention_search_linear_attn_gdn"
# The authors' NAtS-L on DeltaNet (src/nats/models/natsl_attn_delta): natsl_state delta, summed outputs.
HF_DELTA_MODEL_TYPE = "neural_attention_search_linear_attn_delta"
# The authors' NAtS-L on Mamba2 (src/nats/models/natsl_attn_mamba2): hf_mamba2_recipe.
HF_MAMBA2_MODEL_TYPE = "nats_mamba"
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Tensors of the authors' format that natsl recomputes instead of storing.
HF_IGNORED_SUFFIXES = ("rotary.inv_freq",)


# ----------------------------------------------------------------------------- natsl -> natsl

def stored_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype the weights of a model folder are stored in."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        for name in fh.keys():
            t = fh.get_slice(name)
            kind = t.get_dtype()
            return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(kind)
    return None


def convert_checkpoint(src, out, dtype: torch.dtype | None = None) -> Path:
    """A training checkpoint (or run folder: newest step) -> an inference folder with weights only
    (in `dtype`, default: as stored), config (recipe) and tokenizer."""
    from natsl.checkpoint import atomic_folder, load_checkpoint, read_config, resolve_checkpoint_folder, write_model_files

    folder = resolve_checkpoint_folder(src)
    _check_target(Path(out), src, folder)  # before any loading
    model, tokenizer = load_checkpoint(folder)
    dtype = dtype or stored_dtype(folder) or torch.float32
    recipe = model.recipe
    extra = {"converted_from": str(folder.resolve()), "dtype": DTYPE_NAMES.get(dtype, str(dtype))}
    training = read_config(folder).get("training")
    if training is not None:  # step and tokens seen of a `natsl train` checkpoint
        extra["training"] = training
    return atomic_folder(Path(out), lambda tmp: write_model_files(tmp, model, recipe, tokenizer, dtype, extra_config=extra))


def _check_target(out: Path, *sources) -> None:
    """Writing replaces what is at `out`: never an input, a training checkpoint or the user's other data."""
    from natsl.checkpoint import check_replaceable
    from natsl.outputs import check_output

    check_output(out, sources, "OUT")
    check_replaceable(out)


# ----------------------------------------------------------------------------- Hugging Face import

FLOAT_TAG = "__float__"  # transformers >= 5: json.dumps would write Infinity and NaN, which JSON has not
FLOAT_TAG_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(value):
    """A config value with transformers' encoding of the floats JSON cannot hold undone.

    transformers >= 5 saves float("inf") as {"__float__": "Infinity"} (and "-Infinity", "NaN"), where
    transformers 4 wrote the bare literal `Infinity` that Python's json reads as is; both then mean the same.

    Args:
        value: a parsed JSON value (dicts and lists are walked).

    Returns:
        The value with every {"__float__": TAG} of a known TAG replaced by its float; any other such
        object is kept, as transformers keeps it.
    """
    if isinstance(value, dict):
        if set(value) == {FLOAT_TAG} and isinstance(value[FLOAT_TAG], str) and value[FLOAT_TAG] in FLOAT_TAG_VALUES:
            return FLOAT_TAG_VALUES[value[FLOAT_TAG]]
        return {k: decode_special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_special_floats(v) for v in value]
    return value


def read_hf_config(folder: Path) -> dict:
    """The config.json of an authors' checkpoint folder, floats decoded (decode_special_floats)."""
    path = folder / "config.json"
    if not path.is_file():
        raise NatslError(f"{str(folder)!r} has no config.json; pass the folder of a Hugging Face checkpoint")
    config = decode_special_floats(read_json(path, "fix the file or download the checkpoint again"))
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in (HF_MODEL_TYPE, HF_MAMBA2_MODEL_TYPE, HF_DELTA_MODEL_TYPE):
        if isinstance(config, dict) and config.get("format") == "natsl":
            raise NatslError(f"{str(folder)!r} is already a natsl checkpoint; drop --from-hf")
        raise NatslError(f"{str(folder)!r} has model type {kind!r}; --from-hf imports {HF_MODEL_TYPE!r}, "
                         f"{HF_DELTA_MODEL_TYPE!r} and {HF_MAMBA2_MODEL_TYPE!r} checkpoints only")
    return config


def hub_blobs(folder: Path) -> list[Path]:
    """Where the files of a Hugging Face cache snapshot (HUB/models--ORG--NAME/snapshots/REVISION) link to:
    that model's blobs/ folder; none for any other folder."""
    real = Path(os.path.realpath(folder))
    return [real.parent.parent / "blobs"] if real.parent.name == "snapshots" else []


def read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint; never unpickles anything, and never
    reads outside `folder` (or, for a Hugging Face cache snapshot, its blobs), whatever the index names."""
    from safetensors.torch import load_file

    from natsl.files import resolve_inside

    index = folder / "model.safetensors.index.json"
    where = f"the folder {str(folder)!r}"
    if index.is_file():
        try:
            weight_map = read_json(index, "fix the file or download the checkpoint again")["weight_map"]
        except (KeyError, TypeError):
            raise NatslError(f"{str(index)!r} is not a valid safetensors index") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise NatslError(f"{str(index)!r} is not a valid safetensors index (its weight_map must map tensor "
                             "names to file names); use another copy of the checkpoint")
        files = sorted(set(weight_map.values()))
        where = repr(str(index))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (f" (it has {pickled[0]}: natsl never unpickles weights; re-save them as safetensors with a trusted tool)"
                if pickled else "")
        raise NatslError(f"{str(folder)!r} has no .safetensors weights{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = resolve_inside(folder, name, where, also_inside=hub_blobs(folder))
        if not path.is_file():
            raise NatslError(f"weight shard {str(path)!r} is missing")
        try:
            tensors.update(load_file(str(path), device="cpu"))
        except Exception as err:  # safetensors raises its own error types on corrupt files
            raise NatslError(f"{str(path)!r} is not a readable safetensors file ({str(err).splitlines()[0]})") from None
    return tensors


def _get(config: dict, *names, default=None):
    for name in names:
        if name in config and config[name] is not None:
            return config[name]
    return default


def _bad(key: str, allowed: str, value) -> NatslError:
    return NatslError(f"config.json key {key!r} must be {allowed}, got {value!r}; fix the checkpoint's config.json")


# Checked readers of config values: a wrong value is named instead of a ValueError or ZeroDivisionError.
def _int(key: str, value, minimum: int = 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 6.0 from some JSON writers
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(key, f"an integer >= {minimum}", value)
    return value


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise _bad(key, "a finite number > 0", value)
    return float(value)


def _flag(key: str, value) -> bool:
    if value is None:
        return False  # the authors' code tests these for truth: null is false
    if not isinstance(value, bool):  # bool("false") would be True
        raise _bad(key, "true or false", value)
    return value


def _refuse(what: str) -> NatslError:
    return NatslError(f"cannot import this checkpoint: {what}; natsl has no equivalent")


# What the authors' config classes set where a config.json leaves a key out: the keyword defaults of
# NeuralAttentionSearchLineraAttnGDNConfig (src/nats/models/natsl_attn_gdn/configuration_natsl_attn_gdn.py)
# and NATSMamba2Config (src/nats/models/natsl_attn_mamba2/configuration_nats_mamba2.py), for every key
# natsl reads. Their model classes forward each of these to the layers, so the config class's default is
# what their code computes with (not the layer's own default, which differs for several keys).
AUTHORS_SHARED_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 2048, "norm_eps": 1e-6, "initializer_range": 0.02,
    "tie_word_embeddings": False, "intermediate_size": None, "hidden_act": "swish", "use_gate": True,
    "n_ops": 2, "num_nats_head": None, "nats_block_size": 64, "nats_block_agg_type": "mean",
    "ops_for_incomplete_chunks": "all", "outputs_are_wighted": True, "attn_qk_norm": False,
    "attn_with_short_conv": False, "attn_apply_pos_encoding": True, "attn_rope_theta": 10000.0,
}
AUTHORS_GDN_DEFAULTS = {
    **AUTHORS_SHARED_DEFAULTS, "num_hidden_layers": 21, "gdn_layers": [], "num_heads": 6, "head_dim": 256,
    "expand_v": 2.0, "num_attn_heads": 12, "num_v_heads": None, "allow_neg_eigval": False, "use_short_conv": True,
    "conv_size": 4, "conv_bias": False, "decay_for_non_gdn_blocks": False,
}
# NeuralAttentionSearchLineraAttnDeltaConfig (configuration_natsl_attn_delta.py): the GDN class's defaults but
# for the decay, which its state does not have.
AUTHORS_DELTA_DEFAULTS = {key: value for key, value in AUTHORS_GDN_DEFAULTS.items() if key != "decay_for_non_gdn_blocks"}
AUTHORS_MAMBA2_DEFAULTS = {
    **AUTHORS_SHARED_DEFAULTS, "num_hidden_layers": 24, "mamba_layers": [], "num_mamba_heads": 8,
    "head_dim_nats": 128, "expand_v": 1, "num_attn_heads": 16, "conv_kernel": 4, "decay_for_non_mamba_blocks": False,
    "head_dim": 64, "state_size": 128, "expand": 2, "n_groups": 1, "use_bias": False, "use_conv_bias": True,
    "mamba_hidden_act": "silu", "rms_norm": True, "time_step_limit": [0.0, float("inf")],
}  # num_nats_head: None here; their Mamba2 class stores num_mamba_heads for it, which natsl reads None as
# What their Mamba2 model passes its NAtS-L layers and MLPs whatever config.json says (modeling_nats_mamba2.py:
# use_short_conv=True, allow_neg_eigval=False, conv_bias=False, hidden_act="swish"; num_v_heads not passed).
AUTHORS_MAMBA2_FIXED = {"use_short_conv": True, "allow_neg_eigval": False, "conv_bias": False, "hidden_act": "swish",
                        "num_v_heads": None}


def authors_config(config: dict) -> dict:
    """An authors' config.json as their config class reads it: every key natsl uses that the file leaves
    out set to the class's default, and (nats_mamba) the values their model passes whatever the file says.

    Args:
        config: the parsed config.json (floats decoded: decode_special_floats).

    Returns:
        A new dict; `config` itself is not changed.
    """
    if config.get("model_type") == HF_MAMBA2_MODEL_TYPE:
        return {**AUTHORS_MAMBA2_DEFAULTS, **config, **AUTHORS_MAMBA2_FIXED}
    if config.get("model_type") == HF_DELTA_MODEL_TYPE:
        return {**AUTHORS_DELTA_DEFAULTS, **config}
    return {**AUTHORS_GDN_DEFAULTS, **config}


# The config keys that differ between the authors' GDN-based model and their NAtS-L on Mamba2; every
# other NAtS-L key is shared.
GDN_KEYS = {"root": "model", "heads": "num_heads", "head_dim": "head_dim", "decay": "decay_for_non_gdn_blocks",
            "conv": "conv_size", "linear_only": "gated_delta_net", "others": "gdn_layers"}
# Their NAtS-L on DeltaNet: the GDN model's keys; its op names the linear-only option "delta_net", and its
# state has no decay to carry across skipped blocks.
DELTA_KEYS = {**GDN_KEYS, "linear_only": "delta_net", "decay": None, "summed": True}
MAMBA2_KEYS = {"root": "backbone", "heads": "num_mamba_heads", "head_dim": "head_dim_nats",
               "decay": "decay_for_non_mamba_blocks", "conv": "conv_kernel", "linear_only": "mamba",
               "others": "mamba_layers"}


def hf_recipe(config: dict, tensors: dict[str, torch.Tensor], name: str):
    """The natsl Recipe that reproduces an authors' checkpoint (either model type), or a NatslError
    naming the setting natsl cannot represent.

    Args:
        config: the checkpoint's config.json (floats decoded); keys it leaves out take the authors'
            config-class defaults (authors_config).
        tensors: its tensors, by name.
        name: the recipe's name.

    Returns:
        natsl.config.Recipe.
    """
    from natsl.config import ModelConfig, Recipe

    given = config
    mamba = config.get("model_type") == HF_MAMBA2_MODEL_TYPE
    delta = config.get("model_type") == HF_DELTA_MODEL_TYPE
    config = authors_config(config)
    keys = MAMBA2_KEYS if mamba else DELTA_KEYS if delta else GDN_KEYS
    layers = _int("num_hidden_layers", config["num_hidden_layers"])
    other_key = keys["others"]
    others = config[other_key] or []
    if not isinstance(others, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in others):
        raise _bad(other_key, "a list of layer indices", others)
    natsl_indices = [i for i in range(layers) if i not in others]
    fields = _natsl_fields(config, given, tensors, keys, natsl_indices)
    root = keys["root"]
    # The MLP width from the first block that has one (the authors' Mamba2 blocks have none).
    mlp = tensors.get(f"{root}.layers.{natsl_indices[0] if mamba and natsl_indices else 0}.mlp.gate_proj.weight")
    if mlp is not None:
        intermediate = int(mlp.shape[0])
    elif _get(config, "intermediate_size") is not None:
        intermediate = _int("intermediate_size", config["intermediate_size"])
    elif mamba and not natsl_indices:
        intermediate = 0
    else:
        raise NatslError("cannot tell the MLP width: no mlp.gate_proj.weight and no intermediate_size")
    if mamba:  # as their NAtS-L layer: L2-normalised state q, k, no D; MLPs in the NAtS-L blocks only
        fields.update(_mamba2_fields(config, others), natsl_state="mamba2", mamba2_state_l2=True,
                      mamba2_state_skip=False, mamba2_mlp=False)
        fields.update(base_layer="mamba2", natsl_layers=natsl_indices) if others else fields.update(base_layer="natsl")
    else:
        fields.update(base_layer="natsl", gdn_layers=others)
    if delta:
        fields.update(natsl_state="delta")
    vocab = _int("vocab_size", config["vocab_size"])
    emb = tensors.get(f"{root}.embeddings.weight")
    if emb is not None and emb.shape[0] != vocab:
        vocab = int(emb.shape[0])
    model = ModelConfig(
        vocab_size=vocab, hidden_size=_int("hidden_size", config["hidden_size"]),
        intermediate_size=intermediate, num_layers=layers, **fields,
        norm_eps=_number("norm_eps", config["norm_eps"]),
        init_std=_number("initializer_range", config["initializer_range"]),
        tie_embeddings=_flag("tie_word_embeddings", config["tie_word_embeddings"]))
    try:
        model.validate()
    except NatslError as err:
        raise NatslError(f"cannot import this checkpoint: {err}") from None
    return Recipe(name=name, model=model)


def _absent(given: dict, key: str) -> str:
    """" (absent from config.json: the authors' default)" when the file leaves `key` out, for an error line."""
    return "" if key in given else " (absent from config.json: the authors' default)"


def _natsl_fields(config: dict, given: dict, tensors: dict[str, torch.Tensor], keys: dict,
                  natsl_indices: list[int]) -> dict:
    """The ModelConfig fields of the authors' NAtS-L layers (GDN or Mamba2 state), after refusing every
    setting natsl does not have. `config`: with the authors' defaults (authors_config); `given`: the file
    as written, to say in an error line when a refused value is a default."""
    heads_key, head_dim_key = keys["heads"], keys["head_dim"]
    num_heads = _int(heads_key, config[heads_key])
    head_dim = _int(head_dim_key, config[head_dim_key])
    head_v = int(round(head_dim * _number("expand_v", config["expand_v"])))
    attn_heads = _int("num_attn_heads", config["num_attn_heads"])
    if _get(config, "num_v_heads") not in (None, num_heads):
        raise _refuse(f"num_v_heads = {config['num_v_heads']} differs from {heads_key} = {num_heads} (grouped value heads)")
    if _flag("allow_neg_eigval", config["allow_neg_eigval"]):
        raise _refuse("allow_neg_eigval = true (beta in (0, 2))")
    if not _flag("use_short_conv", config["use_short_conv"]):
        raise _refuse("use_short_conv = false")
    if _flag("conv_bias", config["conv_bias"]):
        raise _refuse("conv_bias = true")
    if not _flag("use_gate", config["use_gate"]):
        raise _refuse("use_gate = false (no output gate)")
    if _int("n_ops", config["n_ops"]) != 2:
        raise _refuse(f"n_ops = {config['n_ops']} (natsl routes between exactly two memories)")
    if _get(config, "num_nats_head") not in (None, num_heads):
        raise _refuse(f"num_nats_head = {config['num_nats_head']} differs from {heads_key} = {num_heads}")
    if config["nats_block_agg_type"] != "mean":
        raise _refuse(f"nats_block_agg_type = {config['nats_block_agg_type']!r} (natsl routes on the block mean)")
    if config["hidden_act"] not in ("swish", "silu"):
        raise _refuse(f"hidden_act = {config['hidden_act']!r} (natsl's MLP is SwiGLU)")
    if attn_heads % num_heads:
        raise _refuse(f"num_attn_heads = {attn_heads} is not a multiple of {heads_key} = {num_heads}")
    if natsl_indices:
        # Their config classes default both to false: a config that leaves them out describes a softmax
        # branch natsl does not have, and is refused with the key named.
        if not _flag("attn_qk_norm", config["attn_qk_norm"]):
            raise _refuse("attn_qk_norm = false" + _absent(given, "attn_qk_norm")
                          + " (the softmax branch without RMSNorm on q and k)")
        if not _flag("attn_with_short_conv", config["attn_with_short_conv"]):
            raise _refuse("attn_with_short_conv = false" + _absent(given, "attn_with_short_conv")
                          + " (the softmax branch reads the projections before the conv)")
    incomplete = config["ops_for_incomplete_chunks"]
    intra_of = {"all": "both", "attn": "softmax", keys["linear_only"]: "gdn"}
    intra = intra_of.get(incomplete) if isinstance(incomplete, str) else None  # a list is unhashable
    if intra is None:
        raise _refuse(f"ops_for_incomplete_chunks = {incomplete!r}")
    # The authors' code reads the misspelled key only; the spelled-out one would be ignored there, so a
    # file that sets it to another value than the misspelled key's is refused rather than guessed at.
    # Their NAtS-L on DeltaNet passes neither to its layer, whose default sums the two outputs, then runs one
    # gated norm per DeltaNet head (o_norm over V): natsl's after_sum_state_head without mixing weights.
    summed = keys.get("summed", False)
    weighted = not summed and _flag("outputs_are_wighted", config["outputs_are_wighted"])
    if not summed and "outputs_are_weighted" in given and \
            _flag("outputs_are_weighted", given["outputs_are_weighted"]) != weighted:
        raise NatslError(f"config.json sets outputs_are_weighted = {given['outputs_are_weighted']}, which the authors' "
                         f"code does not read (it reads outputs_are_wighted = {weighted}); remove it or set both alike")
    decay_key, conv_key = keys["decay"], keys["conv"]
    return dict(
        num_heads=num_heads, head_k_dim=head_dim, head_v_dim=head_v, attn_num_heads=attn_heads,
        conv_size=_int(conv_key, config[conv_key]),
        attn_head_dim=max(head_dim // (attn_heads // num_heads), 1),
        rope_theta=_number("attn_rope_theta", _get(config, "attn_rope_theta", default=10000.0)),
        softmax_heads_per_group=attn_heads // num_heads,
        block_size=_int("nats_block_size", config["nats_block_size"]),
        natsl_rope=_flag("attn_apply_pos_encoding", config["attn_apply_pos_encoding"]),
        intra_block_output=intra,
        # Both config classes default to false (their layers default to true, but the models always
        # forward the config's value); the released 340M and 760M configs set it true.
        decay_skipped_blocks=_flag(decay_key, config[decay_key]) if decay_key else True,  # no decay: moot
        branch_norm="after_sum_state_head" if summed else "separate", mix_input="q",
        mix_weights="softmax" if weighted else "none")


def _mamba2_fields(config: dict, mamba_layers: list[int]) -> dict:
    """The ModelConfig fields of the authors' Mamba2 blocks (flash-linear-attention's Mamba2), after refusing
    what natsl's Mamba2 layer computes otherwise. `config`: with the authors' defaults (authors_config)."""
    fields = dict(mamba2_head_dim=_int("head_dim", config["head_dim"]),
                  mamba2_state_size=_int("state_size", config["state_size"]),
                  mamba2_expand=_int("expand", config["expand"]),
                  mamba2_groups=_int("n_groups", config["n_groups"]),
                  # their config's default, true (mamba_ssm's): a conv bias in every Mamba2 block
                  mamba2_conv_bias=_flag("use_conv_bias", config["use_conv_bias"]) and bool(mamba_layers))
    if not mamba_layers:
        return fields
    if fields["mamba2_groups"] != 1:
        raise _refuse(f"n_groups = {fields['mamba2_groups']} (their Mamba2 norms each B/C group's channels apart; "
                      "natsl's gated norm spans all of them)")
    if _flag("use_bias", config["use_bias"]):
        raise _refuse("use_bias = true (Mamba2's in_proj and out_proj with biases)")
    if not _flag("rms_norm", config["rms_norm"]):
        raise _refuse("rms_norm = false (Mamba2 without its gated norm)")
    if config["mamba_hidden_act"] not in ("silu", "swish"):
        raise _refuse(f"mamba_hidden_act = {config['mamba_hidden_act']!r} (natsl's Mamba2 conv is followed by SiLU)")
    # Their default (0.0, inf) leaves dt unclamped; transformers >= 5 writes its inf as {"__float__": "Infinity"}
    # (decoded by read_hf_config), transformers 4 as the bare literal Infinity.
    limit = config["time_step_limit"]
    numbers = isinstance(limit, (list, tuple)) and len(limit) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)
    if not numbers or limit[0] > 0 or limit[1] != float("inf"):
        raise _refuse(f"time_step_limit = {limit!r} (natsl does not clamp Mamba2's dt)")
    return fields


def hf_name_map(recipe, root: str = "model") -> dict[str, str]:
    """natsl parameter name -> the authors' tensor name (the mixing weights also need a row swap). `root`:
    "model" (their GDN-based model) or "backbone" (their NAtS-L on Mamba2)."""
    cfg = recipe.model
    final = "norm_f" if root == "backbone" else "norm"
    names = {"embed.weight": f"{root}.embeddings.weight", "norm.weight": f"{root}.{final}.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i, layer_type in enumerate(cfg.layer_types()):
        # each layer kind names its own tensors (natsl.models.registry: LayerKind.authors_names)
        layer = kind_of(cfg, layer_type).authors_names(cfg, f"layers.{i}.", f"{root}.layers.{i}.")
        if layer is None:
            raise NatslError(f"layer {i} has type {layer_type!r}, which the authors' format does not have")
        names.update(layer)
    return names


def swap_mix_rows(weight: torch.Tensor) -> torch.Tensor:
    """The authors' mixing projection gives per softmax head [w for GDN, w for softmax]; natsl's
    gives [w for softmax, w for GDN]. Rows are (head, option) pairs, so swap within each pair."""
    rows, cols = weight.shape
    return weight.reshape(rows // 2, 2, cols).flip(1).reshape(rows, cols).contiguous()


def hf_state_dict(recipe, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """natsl state dict from the authors' tensors; every natsl parameter must be filled and every
    source tensor used (or known to be recomputed), with matching shapes."""
    from natsl.models import build_model

    shapes = {k: tuple(v.shape) for k, v in build_model(recipe, device="meta").state_dict().items()}
    names = hf_name_map(recipe, root=kind_of(recipe.model, "natsl").authors_root)
    missing_src = [h for n, h in names.items() if h not in tensors]
    if missing_src:
        raise NatslError(f"the checkpoint lacks {len(missing_src)} tensor(s) its config implies, e.g. {missing_src[:3]}; "
                         "it is incomplete or not of the expected layout")
    unfilled = [n for n in shapes if n not in names and not (n == "lm_head.weight" and recipe.model.tie_embeddings)]
    if unfilled:
        raise NatslError(f"no source for natsl parameter(s) {unfilled[:3]}")
    used = set(names.values())
    unused = [k for k in tensors if k not in used and not k.endswith(HF_IGNORED_SUFFIXES)]
    if unused:
        raise NatslError(f"{len(unused)} tensor(s) of the checkpoint have no place in natsl, e.g. {unused[:3]}; "
                         "this variant of the authors' model is not supported")
    state = {}
    for n, h in names.items():
        t = tensors[h]
        if n.endswith("mix_proj.weight"):
            t = swap_mix_rows(t)
        if tuple(t.shape) != shapes[n]:
            raise NatslError(f"tensor {h} has shape {tuple(t.shape)}, natsl's {n} needs {shapes[n]}; "
                             "config.json does not match the weights")
        state[n] = t
    return state


def import_hf(src, out, dtype: torch.dtype | None = None, tokenizer_path=None) -> Path:
    """An authors' Hugging Face checkpoint folder -> a natsl inference folder."""
    folder = Path(src)
    if not folder.is_dir():
        raise NatslError(f"{str(folder)!r} is not a folder; pass the folder of a Hugging Face checkpoint")
    _check_target(Path(out), folder, tokenizer_path)  # before any loading
    config = read_hf_config(folder)
    tensors = read_hf_tensors(folder)
    recipe = hf_recipe(config, tensors, name=f"hf-{folder.resolve().name}")
    state = hf_state_dict(recipe, tensors)
    return write_imported(folder, out, recipe, state, dtype, tokenizer_path, config["model_type"])


def _hf_adds_bos(folder: Path) -> bool:
    path = folder / "tokenizer_config.json"
    try:
        return read_json(path, "").get("add_bos_token") is True
    except (OSError, NatslError, AttributeError):  # absent, unreadable or not a JSON object: nothing said
        return False


def write_imported(folder: Path, out, recipe, state: dict, dtype, tokenizer_path, source_type: str) -> Path:
    """A natsl inference folder from an imported natsl state dict (dtype None: as stored), with the
    tokenizer at `tokenizer_path` (default: the source folder's tokenizer.json, if any)."""
    from natsl.checkpoint import atomic_folder, write_model_files
    from natsl.models import build_model
    from natsl.tokenizer import Tokenizer, check_fits_model

    if dtype is None:
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    bad = next((name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:  # a model of NaN weights computes nothing; the verification would only say "changed"
        raise NatslError(f"{str(folder)!r}: tensor {bad} holds NaN or infinite values; the source weights are "
                         "damaged: use another copy")
    model = build_model(recipe, device="meta").to_empty(device="cpu")
    model = model.to(dtype)
    model.load_state_dict(state, strict=not recipe.model.tie_embeddings, assign=False)
    if recipe.model.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    tok_file = Path(tokenizer_path) if tokenizer_path else folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_file) if (tokenizer_path or tok_file.is_file()) else None
    if tokenizer is not None:  # Hugging Face says whether texts start with BOS in tokenizer_config.json
        tokenizer.apply_conventions({"add_bos": _hf_adds_bos(folder)})
        check_fits_model(tokenizer, recipe.model.vocab_size, f"tokenizer {str(tok_file)!r}")
    extra = {"converted_from": str(folder.resolve()), "source_model_type": source_type,
             "dtype": DTYPE_NAMES.get(dtype, str(dtype))}
    return atomic_folder(Path(out), lambda tmp: write_model_files(tmp, model, recipe, tokenizer, dtype, extra_config=extra))
