"""`natsl convert`: a training checkpoint into a clean inference folder, and the import of the
authors' released Hugging Face checkpoints (model type `neural_attention_search_linear_attn_gdn`,
github.com/automl/NeuralAttentionSearchLinear, built on flash-linear-attention layers). Their NAtS-L
on Mamba2 (model type `nats_mamba`) is refused with the reason (mamba2_refusal).

Only safetensors are read; a checkpoint that ships only pickled weights (`pytorch_model.bin`) is
refused rather than unpickled. The full name mapping and what it assumes is in docs/evaluation.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from natsl.errors import NatslError

HF_MODEL_TYPE = "neural_attention_search_linear_attn_gdn"
# The authors' NAtS-L on Mamba2 (src/nats/models/natsl_attn_mamba2): refused, see mamba2_refusal.
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
    _check_target(Path(out), folder)  # before any loading
    model, tokenizer = load_checkpoint(folder)
    dtype = dtype or stored_dtype(folder) or torch.float32
    recipe = model.recipe
    extra = {"converted_from": str(folder.resolve()), "dtype": DTYPE_NAMES.get(dtype, str(dtype))}
    training = read_config(folder).get("training")
    if training is not None:  # step and tokens seen of a `natsl train` checkpoint
        extra["training"] = training
    return atomic_folder(Path(out), lambda tmp: write_model_files(tmp, model, recipe, tokenizer, dtype, extra_config=extra))


def _check_target(out: Path, src: Path) -> None:
    from natsl.checkpoint import check_replaceable

    if out.resolve() == Path(src).resolve():
        raise NatslError("the output folder is the source folder; pass another --out folder")
    check_replaceable(out)  # writing replaces what is at `out`: never the user's other data


# ----------------------------------------------------------------------------- Hugging Face import

def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise NatslError(f"{str(folder)!r} has no config.json; pass the folder of a Hugging Face checkpoint")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NatslError(f"{str(path)!r} is not valid JSON") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind == HF_MAMBA2_MODEL_TYPE:
        raise NatslError(mamba2_refusal(config))
    if kind != HF_MODEL_TYPE:
        if isinstance(config, dict) and config.get("format") == "natsl":
            raise NatslError(f"{str(folder)!r} is already a natsl checkpoint; drop --from-hf")
        raise NatslError(f"{str(folder)!r} has model type {kind!r}; --from-hf imports {HF_MODEL_TYPE!r} checkpoints only")
    return config


def mamba2_refusal(config: dict) -> str:
    """Why the authors' NAtS-L on Mamba2 cannot be a natsl model. Their layer (natsl_attn_mamba2.py) has the
    GDN-based layer's tensors with a_proj alone, but its SSD branch computes another function than natsl's
    Mamba2 state (natsl_state: mamba2): it L2-normalises the state's q and k (natsl reads them unnormalised,
    as Mamba2's C and B) and adds no D v (natsl's D could be set to 0; the norm has no counterpart). Their
    plain Mamba2 blocks (mamba_layers) also hold no MLP, while every natsl block of a model shares one."""
    reasons = ["its NAtS-L layers L2-normalise the Mamba2 state's q and k, which natsl's Mamba2 state "
               "(natsl_state: mamba2) reads unnormalised as Mamba2's C and B"]
    if config.get("mamba_layers"):
        reasons.append("its Mamba2 blocks have no MLP beside NAtS-L blocks with one")
    return (f"cannot import this checkpoint: model type {HF_MAMBA2_MODEL_TYPE!r} (the authors' NAtS-L on Mamba2): "
            f"{'; '.join(reasons)}; natsl has no equivalent")


def read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint; never unpickles anything."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise NatslError(f"{str(index)!r} is not a valid safetensors index") from None
        files = sorted(set(weight_map.values()))
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
        path = folder / name
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


def hf_recipe(config: dict, tensors: dict[str, torch.Tensor], name: str):
    """The natsl Recipe that reproduces an authors' checkpoint, or a NatslError naming the setting
    natsl cannot represent."""
    from natsl.config import ModelConfig, Recipe

    def refuse(what: str):
        raise NatslError(f"cannot import this checkpoint: {what}; natsl has no equivalent")

    num_heads = _int("num_heads", config.get("num_heads", 6))
    head_dim = _int("head_dim", config.get("head_dim", 256))
    expand_v = _number("expand_v", config.get("expand_v", 2.0))
    head_v = int(round(head_dim * expand_v))
    attn_heads = _int("num_attn_heads", config.get("num_attn_heads", 12))
    layers = _int("num_hidden_layers", _get(config, "num_hidden_layers", default=21))
    gdn_layers = config.get("gdn_layers") or []
    if not isinstance(gdn_layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in gdn_layers):
        raise _bad("gdn_layers", "a list of layer indices", gdn_layers)
    if _get(config, "num_v_heads") not in (None, num_heads):
        refuse(f"num_v_heads = {config['num_v_heads']} differs from num_heads = {num_heads} (grouped value heads)")
    if _flag("allow_neg_eigval", config.get("allow_neg_eigval", False)):
        refuse("allow_neg_eigval = true (beta in (0, 2))")
    if not _flag("use_short_conv", config.get("use_short_conv", True)):
        refuse("use_short_conv = false")
    if _flag("conv_bias", config.get("conv_bias", False)):
        refuse("conv_bias = true")
    if not _flag("use_gate", config.get("use_gate", True)):
        refuse("use_gate = false (no output gate)")
    if _int("n_ops", config.get("n_ops", 2)) != 2:
        refuse(f"n_ops = {config['n_ops']} (natsl routes between exactly two memories)")
    if _get(config, "num_nats_head") not in (None, num_heads):
        refuse(f"num_nats_head = {config['num_nats_head']} differs from num_heads = {num_heads}")
    if config.get("nats_block_agg_type", "mean") != "mean":
        refuse(f"nats_block_agg_type = {config['nats_block_agg_type']!r} (natsl routes on the block mean)")
    if config.get("hidden_act", "swish") not in ("swish", "silu"):
        refuse(f"hidden_act = {config['hidden_act']!r} (natsl's MLP is SwiGLU)")
    if attn_heads % num_heads:
        refuse(f"num_attn_heads = {attn_heads} is not a multiple of num_heads = {num_heads}")
    natsl_indices = [i for i in range(layers) if i not in gdn_layers]
    if natsl_indices:
        first = f"model.layers.{natsl_indices[0]}.attn."
        has_qk_norm = f"{first}q_norm.weight" in tensors
        if not has_qk_norm or not _flag("attn_qk_norm", config.get("attn_qk_norm", has_qk_norm)):
            refuse("attn_qk_norm = false (the softmax branch without RMSNorm on q and k)")
        if not _flag("attn_with_short_conv", config.get("attn_with_short_conv", False)):
            refuse("attn_with_short_conv = false (the softmax branch reads the projections before the conv)")
    mlp = tensors.get("model.layers.0.mlp.gate_proj.weight")
    if mlp is not None:
        intermediate = int(mlp.shape[0])
    elif _get(config, "intermediate_size") is not None:
        intermediate = _int("intermediate_size", config["intermediate_size"])
    else:
        raise NatslError("cannot tell the MLP width: no model.layers.0.mlp.gate_proj.weight and no intermediate_size")
    incomplete = config.get("ops_for_incomplete_chunks", "all")
    intra_of = {"all": "both", "attn": "softmax", "gated_delta_net": "gdn"}
    intra = intra_of.get(incomplete) if isinstance(incomplete, str) else None  # a list is unhashable
    if intra is None:
        refuse(f"ops_for_incomplete_chunks = {incomplete!r}")
    weighted_key = "outputs_are_weighted" if _get(config, "outputs_are_weighted") is not None else "outputs_are_wighted"
    weighted = _flag(weighted_key, config.get(weighted_key, True))  # the authors' configs misspell it
    vocab = _int("vocab_size", config.get("vocab_size", 32000))
    emb = tensors.get("model.embeddings.weight")
    if emb is not None and emb.shape[0] != vocab:
        vocab = int(emb.shape[0])
    model = ModelConfig(
        vocab_size=vocab, hidden_size=_int("hidden_size", config.get("hidden_size", 2048)),
        intermediate_size=intermediate,
        num_layers=layers, base_layer="natsl", gdn_layers=gdn_layers, num_heads=num_heads, head_k_dim=head_dim,
        head_v_dim=head_v, conv_size=_int("conv_size", config.get("conv_size", 4)), attn_num_heads=attn_heads,
        attn_head_dim=max(head_dim // (attn_heads // num_heads), 1),
        rope_theta=_number("attn_rope_theta", _get(config, "attn_rope_theta", default=10000.0)),
        softmax_heads_per_group=attn_heads // num_heads,
        block_size=_int("nats_block_size", config.get("nats_block_size", 64)),
        natsl_rope=_flag("attn_apply_pos_encoding", config.get("attn_apply_pos_encoding", False)),
        intra_block_output=intra,
        # The authors' layer defaults to decaying across skipped blocks; their current model code forwards
        # this key to the layer (their first version did not: the default, true, applied), and their
        # released configs set it true (docs/evaluation.md).
        decay_skipped_blocks=_flag("decay_for_non_gdn_blocks", config.get("decay_for_non_gdn_blocks", True)),
        branch_norm="separate", mix_input="q", mix_weights="softmax" if weighted else "none",
        norm_eps=_number("norm_eps", config.get("norm_eps", 1e-6)),
        init_std=_number("initializer_range", config.get("initializer_range", 0.02)),
        tie_embeddings=_flag("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    try:
        model.validate()
    except NatslError as err:
        raise NatslError(f"cannot import this checkpoint: {err}") from None
    return Recipe(name=name, model=model)


def hf_name_map(recipe) -> dict[str, str]:
    """natsl parameter name -> the authors' tensor name (the mixing weights also need a row swap)."""
    cfg = recipe.model
    names = {"embed.weight": "model.embeddings.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i, kind in enumerate(cfg.layer_types()):
        n, h = f"layers.{i}.", f"model.layers.{i}."
        names[n + "mixer_norm.weight"] = h + "attn_norm.weight"
        names[n + "mlp_norm.weight"] = h + "mlp_norm.weight"
        for p in ("gate_proj", "up_proj", "down_proj"):
            names[f"{n}mlp.{p}.weight"] = f"{h}mlp.{p}.weight"
        m, a = n + "mixer.", h + "attn."
        for p in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj"):
            names[f"{m}proj.{p}.weight"] = f"{a}{p}.weight"
        for p in ("q", "k", "v"):
            names[f"{m}proj.{p}_conv.weight"] = f"{a}{p}_conv1d.weight"
        names[m + "proj.A_log"] = a + "A_log"
        names[m + "proj.dt_bias"] = a + "dt_bias"
        names[m + "g_proj.weight"] = a + "g_proj.weight"
        names[m + "o_proj.weight"] = a + "o_proj.weight"
        if kind == "gdn":
            names[m + "o_norm.weight"] = a + "o_norm.weight"
        elif kind == "natsl":
            names[m + "router.weight"] = a + "nats_layer.weight"
            names[m + "q_norm.weight"] = a + "q_norm.weight"
            names[m + "k_norm.weight"] = a + "k_norm.weight"
            # FusedMultiInputRMSNormGated(x1 = GDN output, x2 = softmax output): weight1, weight2.
            names[m + "la_norm.weight"] = a + "o_norm.weight1"
            names[m + "nla_norm.weight"] = a + "o_norm.weight2"
            if cfg.mix_weights != "none":
                names[m + "mix_proj.weight"] = a + "nats_out_weights_layer.weight"
        else:
            raise NatslError(f"layer {i} has type {kind!r}, which the authors' format does not have")
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
    names = hf_name_map(recipe)
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
    _check_target(Path(out), folder)  # before any loading
    config = read_hf_config(folder)
    tensors = read_hf_tensors(folder)
    recipe = hf_recipe(config, tensors, name=f"hf-{folder.resolve().name}")
    state = hf_state_dict(recipe, tensors)
    return write_imported(folder, out, recipe, state, dtype, tokenizer_path, HF_MODEL_TYPE)


def _hf_adds_bos(folder: Path) -> bool:
    path = folder / "tokenizer_config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("add_bos_token") is True
    except (OSError, ValueError, AttributeError):  # absent or not a JSON object: nothing said
        return False


def write_imported(folder: Path, out, recipe, state: dict, dtype, tokenizer_path, source_type: str) -> Path:
    """A natsl inference folder from an imported natsl state dict (dtype None: as stored), with the
    tokenizer at `tokenizer_path` (default: the source folder's tokenizer.json, if any)."""
    from natsl.checkpoint import atomic_folder, write_model_files
    from natsl.models import build_model
    from natsl.tokenizer import Tokenizer

    if dtype is None:
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model = build_model(recipe, device="meta").to_empty(device="cpu")
    model = model.to(dtype)
    model.load_state_dict(state, strict=not recipe.model.tie_embeddings, assign=False)
    if recipe.model.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    tok_file = Path(tokenizer_path) if tokenizer_path else folder / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tok_file) if (tokenizer_path or tok_file.is_file()) else None
    if tokenizer is not None:  # Hugging Face says whether texts start with BOS in tokenizer_config.json
        tokenizer.apply_conventions({"add_bos": _hf_adds_bos(folder)})
    extra = {"converted_from": str(folder.resolve()), "source_model_type": source_type,
             "dtype": DTYPE_NAMES.get(dtype, str(dtype))}
    return atomic_folder(Path(out), lambda tmp: write_model_files(tmp, model, recipe, tokenizer, dtype, extra_config=extra))
