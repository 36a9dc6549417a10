"""natsl checkpoints <-> Hugging Face `transformers` folders.

Export (`natsl convert CKPT OUT --to hf`):
- a Transformer (every layer softmax attention) becomes a standard Llama folder (`model_type: llama`,
  no remote code): natsl's attention layer is Llama's (RMSNorm pre-norms, SwiGLU MLP, rotate-half RoPE,
  no biases, no q/k norm, one KV head per query head), so every tool built for Llama reads it;
- every other system (GDN, GDN Hybrid, NAtS-L, NAtS-L Hybrid, GDN + SWA, Mamba2, NAtS-L on a Mamba2 state
  and its hybrid) becomes a `model_type: natsl` folder whose `auto_map` names `modeling_natsl.py`
  (natsl.hf.modeling_natsl), for `trust_remote_code=True`; beside it natsl's model code as
  plain PyTorch files (natsl.hf.bundle), so the folder runs with torch and transformers alone, and on
  the installed natsl (its Triton kernels) where there is one.
Both hold the full natsl recipe under `natsl_recipe`, `tokenizer.json` with `tokenizer_config.json`,
and `generation_config.json`.

Import (`natsl convert HF_FOLDER OUT --from-hf`) tells the formats apart by `model_type`: `llama` and
`natsl` come here; the authors' release (`neural_attention_search_linear_attn_gdn`) goes to
natsl.eval.convert. The round trip natsl -> HF -> natsl gives the same tensors, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from natsl.config import context_length
from natsl.errors import NatslError
from natsl.files import read_json
from natsl.models.registry import kinds_of

LLAMA = "llama"
NATSL = "natsl"
OWN_MODEL_TYPES = (LLAMA, NATSL)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ----------------------------------------------------------------------------- names

def llama_name_map(cfg) -> dict[str, str]:
    """natsl parameter name -> Llama tensor name."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i, kind in enumerate(kinds_of(cfg)):  # each layer kind's own names (llama_refusal: all have some)
        names.update(kind.llama_names(cfg, f"layers.{i}.", f"model.layers.{i}."))
    return names


def natsl_name_map(model) -> dict[str, str]:
    """natsl parameter name -> its name in a `model_type: natsl` folder (NatslForCausalLM.model); a tied
    head is stored once, as the embedding."""
    tied = model.config.tie_embeddings
    return {name: f"model.{name}" for name in model.state_dict() if not (tied and name == "lm_head.weight")}


# ----------------------------------------------------------------------------- export

def llama_refusal(cfg) -> str | None:
    """Why a natsl model cannot be a plain Llama checkpoint (None: it can)."""
    others = sorted({kind.layer_type for kind in kinds_of(cfg) if kind.llama_names(cfg, "", "") is None})
    if others:
        return f"it has {', '.join(others)} layers"
    if not cfg.attn_rope:
        return "its attention has no RoPE (attn_rope: false), and Llama always rotates"
    if cfg.attn_window:
        return f"its attention is a {cfg.attn_window}-token sliding window, and Llama attends to every token"
    return None


def llama_config(recipe, tokenizer) -> dict:
    cfg = recipe.model
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": LLAMA,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.attn_num_heads,
        "num_key_value_heads": cfg.attn_num_heads, "head_dim": cfg.attn_head_dim, "hidden_act": "silu",
        # the trained context, as lm-eval's --model natsl scores (natsl.config.context_length)
        "max_position_embeddings": context_length(recipe), "rms_norm_eps": cfg.norm_eps,
        # rope_theta for transformers 4, rope_parameters for 5: the same default (unscaled) RoPE
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "use_cache": True,
        **special_token_ids(tokenizer),
    }


def natsl_config(recipe, tokenizer) -> dict:
    cfg = recipe.model
    return {
        "architectures": ["NatslForCausalLM"], "model_type": NATSL,
        "auto_map": {"AutoConfig": "modeling_natsl.NatslConfig",
                     "AutoModelForCausalLM": "modeling_natsl.NatslForCausalLM"},
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        # the trained context (natsl.config.context_length); the remote code's limit is the recipe's max_seq_len
        "max_position_embeddings": context_length(recipe), "tie_word_embeddings": cfg.tie_embeddings,
        **special_token_ids(tokenizer),
    }


def special_token_ids(tokenizer) -> dict:
    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None}
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def bos_post_processor(tokenizer) -> dict:
    """A `tokenizers` TemplateProcessing that puts BOS before each text, as natsl's documents start."""
    from tokenizers import processors

    bos = tokenizer.inner.id_to_token(tokenizer.bos_id)
    processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                              special_tokens=[(bos, tokenizer.bos_id)])
    return json.loads(processor.__getstate__())


def write_tokenizer_files(folder: Path, tokenizer, max_len: int) -> None:
    """tokenizer.json as natsl encodes (no special tokens added: natsl's `Tokenizer.encode` adds none, and
    training data is documents each followed by EOS), plus tokenizer_config.json naming the special tokens,
    so `AutoTokenizer(text).input_ids` is natsl's encoding."""
    data = json.loads(tokenizer.to_json())
    # The tokenizer's own post-processor may add what natsl's training did not (or not add what it did):
    # replaced by exactly natsl's document start, "<s> $A" when the model trained with BOS, else nothing.
    data["post_processor"] = bos_post_processor(tokenizer) if tokenizer.document_start() else None
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    bos = tokenizer.bos_id
    specials = {"eos_token": tokenizer.eos_token, "bos_token": None if bos is None else tokenizer.inner.id_to_token(bos)}
    specials["pad_token"] = specials["eos_token"]  # batched evaluation pads (left, with natsl models)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "add_bos_token": bool(tokenizer.document_start()), "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "padding_side": "left", **specials}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({k: v for k, v in specials.items() if v is not None}, indent=2), encoding="utf-8")


def export_hf(src, out, dtype: torch.dtype | None = None) -> Path:
    """A natsl checkpoint (or run folder: newest step) -> a Hugging Face folder (see the module doc)."""
    from natsl.checkpoint import (atomic_folder, load_checkpoint, resolve_checkpoint_folder, save_tensors,
                                  state_dict_for_saving)
    from natsl.eval.convert import _check_target, stored_dtype
    from natsl.hf.bundle import write_remote_code

    folder = resolve_checkpoint_folder(src)
    _check_target(Path(out), src, folder)
    model, tokenizer = load_checkpoint(folder)
    recipe = model.recipe
    dtype = dtype or stored_dtype(folder) or torch.float32
    llama = llama_refusal(recipe.model) is None
    names = llama_name_map(recipe.model) if llama else natsl_name_map(model)
    state = state_dict_for_saving(model.state_dict(), dtype)
    tensors = {names[k]: v for k, v in state.items()}
    config = llama_config(recipe, tokenizer) if llama else natsl_config(recipe, tokenizer)
    config.update(dtype=DTYPE_NAMES.get(dtype, "float32"), **export_record(recipe))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["eos_token_id"], "do_sample": False}

    def fill(tmp: Path) -> None:
        save_tensors(tensors, tmp / "model.safetensors")  # a full disk: one line, not a SafetensorError
        if tokenizer is not None:
            write_tokenizer_files(tmp, tokenizer, recipe.model.max_seq_len)
        if not llama:
            write_remote_code(tmp)  # modeling_natsl.py and the natsl code it runs without natsl
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

    return atomic_folder(Path(out), fill)


def export_record(recipe) -> dict:
    """What an export's config.json says about natsl: the recipe, the natsl version that wrote it (the
    remote code names it when the installed natsl cannot run the folder), the format of the recipe (a
    checkpoint's format_version) and the fingerprint of its model section (natsl.checkpoint.model_fingerprint)."""
    from natsl import __version__
    from natsl.checkpoint import FORMAT_VERSION, model_fingerprint

    saved = recipe.to_dict()
    return {"natsl_recipe": saved, "natsl_version": __version__, "natsl_format_version": FORMAT_VERSION,
            "natsl_model_sha256": model_fingerprint(saved["model"])}


def check_export_record(config: dict, where: str) -> None:
    """Refuse an export whose natsl_format_version this natsl cannot read, or whose natsl_recipe model
    section was edited after export (exports from before these keys pass).

    Args:
        config: the export's config.json (a transformers config's to_dict() in the remote code).
        where: the file, for the error line.
    """
    from natsl.checkpoint import check_fingerprint, check_format_version, model_fingerprint

    if config.get("natsl_format_version") is not None:
        check_format_version(config["natsl_format_version"], config.get("natsl_version"), where, "natsl_format_version")
    recipe = config.get("natsl_recipe")
    model = recipe.get("model") if isinstance(recipe, dict) else None
    if isinstance(model, dict):
        check_fingerprint(model_fingerprint(model), config.get("natsl_model_sha256"), f"{where}'s natsl_recipe")


# ----------------------------------------------------------------------------- import

def hf_model_type(folder: Path) -> str | None:
    """The `model_type` of a Hugging Face folder's config.json (None when there is none to read)."""
    try:
        config = read_json(Path(folder) / "config.json", "")
    except (OSError, NatslError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def recipe_from_llama(config: dict, name: str):
    """The natsl Transformer recipe of a Llama config; settings natsl cannot represent are refused."""
    from natsl.config import ModelConfig, Recipe, TrainConfig, from_dict

    def refuse(what: str):
        raise NatslError(f"cannot import this Llama checkpoint: {what}; natsl's Transformer has no equivalent")

    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    absent = [k for k in needed if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if absent:
        raise NatslError(f"config.json of this Llama checkpoint lacks an integer {absent[0]!r}; fix the config")
    heads = config.get("num_attention_heads")
    if config.get("num_key_value_heads", heads) != heads:
        refuse(f"num_key_value_heads = {config.get('num_key_value_heads')} differs from num_attention_heads = {heads} "
               "(grouped-query attention)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            refuse(f"{key} = true")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        refuse(f"hidden_act = {config['hidden_act']!r} (natsl's MLP is SwiGLU)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r}")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    hidden = config["hidden_size"]
    fields = dict(vocab_size=config["vocab_size"], hidden_size=hidden, intermediate_size=config["intermediate_size"],
                  num_layers=config["num_hidden_layers"], base_layer="attention", attn_num_heads=heads,
                  attn_head_dim=config.get("head_dim") or hidden // heads, attn_rope=True, rope_theta=float(theta),
                  norm_eps=float(config.get("rms_norm_eps", 1e-6)), init_std=float(config.get("initializer_range", 0.02)),
                  tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                  max_seq_len=int(config.get("max_position_embeddings", 131072)))
    saved = config.get("natsl_recipe")
    if isinstance(saved, dict):  # written by natsl: the recipe back, if the Llama fields still agree with it
        recipe = exported_recipe(saved)
        # max_position_embeddings is the trained context (context_length; earlier exports wrote max_seq_len):
        # natsl_recipe holds max_seq_len itself.
        differ = [k for k, v in fields.items() if k != "max_seq_len" and getattr(recipe.model, k) != v]
        if differ:
            raise NatslError(f"config.json's Llama settings differ from its natsl_recipe in {', '.join(differ)}; "
                             "remove natsl_recipe from config.json to import the Llama settings")
        return recipe
    try:
        model = from_dict(ModelConfig, fields, "model")
        model.validate()
    except NatslError as err:
        raise NatslError(f"cannot import this Llama checkpoint: {err}") from None
    # transformers' max_position_embeddings is the context a model declares (Llama-2: its 4096 training
    # tokens); as the training length, natsl's lm-eval default scores the windows `--model hf` scores.
    return Recipe(name=name, model=model, train=TrainConfig(seq_len=model.max_seq_len))


def exported_recipe(saved: dict):
    """The natsl recipe of an export's `natsl_recipe`; an export older than a model field gets the value
    that reproduces its model (natsl.checkpoint.complete_model_section), as an older checkpoint does."""
    from natsl.checkpoint import complete_model_section
    from natsl.config import Recipe, from_dict

    saved = dict(saved)
    if not isinstance(saved.get("model"), dict):
        raise NatslError("config.json's natsl_recipe has no model section; export the checkpoint again with "
                         "`natsl convert CKPT OUT --to hf`")
    saved["model"] = dict(saved["model"])
    complete_model_section(saved["model"], "config.json's natsl_recipe")
    # Only the model's rules, as for a checkpoint (natsl.checkpoint.checkpoint_recipe): a rule added to
    # the train or optim sections later must not make an exported model unloadable.
    recipe = from_dict(Recipe, saved)
    recipe.model.validate()
    return recipe


def import_own_hf(src, out, dtype: torch.dtype | None = None, tokenizer_path=None) -> Path:
    """A Llama or `model_type: natsl` folder -> a natsl inference folder."""
    from natsl.eval.convert import _check_target, write_imported

    folder = Path(src)
    _check_target(Path(out), folder, tokenizer_path)
    recipe, state, kind = read_own_hf(folder)
    return write_imported(folder, out, recipe, state, dtype, tokenizer_path, kind)


def verify_hf_export(src, folder: Path) -> int:
    """Read a folder that `export_hf(src, folder)` wrote as an import would (its config's recipe, every tensor
    under natsl's names, shapes checked) and compare each tensor with `src`'s at the stored dtype.

    Returns:
        The number of tensors compared; a tensor that differs or is missing is a one-line NatslError.
    """
    from natsl.checkpoint import load_checkpoint, resolve_checkpoint_folder

    model, _ = load_checkpoint(resolve_checkpoint_folder(src))
    _, stored, _ = read_own_hf(Path(folder))
    wanted = model.state_dict()
    if model.recipe.model.tie_embeddings and "lm_head.weight" not in stored:
        wanted.pop("lm_head.weight", None)  # a tied head is stored once, as the embedding
    missing = sorted(set(wanted) - set(stored))
    bad = [k for k, v in stored.items() if k not in wanted or not torch.equal(wanted[k].to(v.dtype), v)]
    if missing or bad:
        raise NatslError(f"verification failed: {(missing + bad)[:3]} missing or changed in {str(folder)!r}; "
                         "export again (without --force into a folder another program writes)")
    return len(stored)


def read_own_hf(folder: Path):
    """(recipe, state dict under natsl's names, model type) of a Llama or `model_type: natsl` folder, every tensor's
    shape checked against the model its config builds."""
    from natsl.checkpoint import check_state_dict
    from natsl.eval.convert import decode_special_floats, read_hf_tensors
    from natsl.models import build_model

    config = decode_special_floats(read_json(folder / "config.json", "fix the file or export the checkpoint again"))
    check_export_record(config, repr(str(folder / "config.json")))
    kind = config.get("model_type")
    if kind == LLAMA:
        recipe = recipe_from_llama(config, name=f"hf-{folder.resolve().name}")
    else:
        if not isinstance(config.get("natsl_recipe"), dict):
            raise NatslError(f"{str(folder / 'config.json')!r} has model type 'natsl' but no natsl_recipe; "
                             "export the checkpoint again with `natsl convert CKPT OUT --to hf`")
        recipe = exported_recipe(config["natsl_recipe"])
    tensors = read_hf_tensors(folder)
    model = build_model(recipe, device="meta")
    names = llama_name_map(recipe.model) if kind == LLAMA else natsl_name_map(model)
    back = {h: n for n, h in names.items()}
    state = {back.get(h, h): t for h, t in tensors.items()}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    check_state_dict(folder / "model.safetensors", state, expected, recipe.model.tie_embeddings)
    return recipe, state, kind
