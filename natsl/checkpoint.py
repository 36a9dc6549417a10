"""Model folders: `model.safetensors` + `config.json` + `tokenizer.json` (+ `recipe.yaml`).

A folder is written into a temporary sibling, fsynced, then renamed into place, so a reader never
sees half of one. Weights are read with safetensors only (nothing is unpickled), and `config.json`
names the format so that a folder of another model type is refused with a clear message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import torch
import yaml

from natsl import __version__
from natsl.atomic import atomic_folder  # noqa: F401  (the model-folder writers import it from here)
from natsl.config import ModelConfig, Recipe, from_dict
from natsl.errors import NatslError
from natsl.files import read_json, resolve_inside

FORMAT = "natsl"
FORMAT_VERSION = 1
COMPLETE_MARKER = "config.json"  # written last inside the temporary folder
MANIFEST_FILE = "manifest.json"  # a training step folder's sizes and SHA-256 (natsl.training.state)
# Every file an inference folder holds (write_model_files). A folder with anything else is not ours to replace.
CHECKPOINT_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "recipe.yaml"})
# What only a training step folder holds (natsl/training/state.py): the state that lets a run continue
# (and its manifest, which other software names a file too: it counts only beside model.safetensors).
TRAINING_FILES = frozenset({"optimizer.safetensors", "rng.safetensors", "trainer_state.json"})
TRAINING_STEP_RE = re.compile(r"^step_\d+$")  # OUT/checkpoints/step_NNNNNN (natsl.training.state.step_folder)


def save_tensors(tensors: dict, path: Path) -> None:
    """safetensors' save_file, whose I/O failures (a full disk) come as SafetensorError with the OS
    error in the text: raised here as the OSError they are (any other as an EIO), so that the CLI says it
    in one line."""
    import errno as errno_

    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        text = str(err)
        code = re.search(r"(?:code: |os error )(\d+)", text)
        if code:
            number = int(code.group(1))
            raise OSError(number, os.strerror(number), str(path)) from None
        if "No space left" in text:
            raise OSError(errno_.ENOSPC, os.strerror(errno_.ENOSPC), str(path)) from None
        # Any other failure to write, as an OSError too: the folder writers name their target in it, not the
        # hidden temporary folder the file was in (natsl.files.os_error_at).
        first = text.splitlines()[0] if text else type(err).__name__
        raise OSError(errno_.EIO, f"could not write the weights ({first})", str(path)) from None


def is_training_checkpoint(folder) -> bool:
    """Whether `folder` is a training step folder (natsl.training.state): it holds training state, or it
    is a `step_N` folder of a run's `checkpoints/`. Either way its optimizer state, RNG state and manifest
    are what lets the run continue, and no command but `natsl train` may write there."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    if TRAINING_STEP_RE.match(folder.name) and folder.parent.name == "checkpoints":
        return True
    present = {name for name in (*TRAINING_FILES, MANIFEST_FILE, "model.safetensors")
               if (folder / name).exists() or (folder / name).is_symlink()}
    return bool(present & TRAINING_FILES) or {MANIFEST_FILE, "model.safetensors"} <= present


def training_checkpoint_at(path) -> Path | None:
    """The training checkpoint that `path` is or lies inside (links resolved), else None."""
    path = Path(os.path.realpath(path))
    return next((folder for folder in (path, *path.parents) if is_training_checkpoint(folder)), None)


def check_replaceable(target) -> None:
    """Refuse to replace `target` unless it is absent, an empty folder or a natsl inference folder:
    `--force` must never wipe the user's other data, nor a training checkpoint."""
    target = Path(target)
    if not target.exists() and not target.is_symlink():
        return
    if is_training_checkpoint(target):
        raise NatslError(f"{str(target)!r} is a training checkpoint; natsl never replaces one, not even with --force "
                         "(its optimizer and RNG state and manifest would be lost): choose another output folder")

    def refuse(why: str) -> NatslError:
        return NatslError(f"{str(target)!r} exists and is not a folder natsl convert wrote ({why}); only such a "
                          "folder or an empty one is replaced: choose another output folder or remove it yourself")

    if target.is_symlink() or not target.is_dir():
        raise refuse("it is a file or a link")
    entries = list(target.iterdir())
    if not entries:
        return
    other = sorted(p.name for p in entries if p.name not in CHECKPOINT_FILES or p.is_symlink() or not p.is_file())
    if other:
        raise refuse(f"it holds {other[0]!r}")
    names = {p.name for p in entries}
    if not {"config.json", "model.safetensors"} <= names:
        raise refuse(f"it has no {'config.json' if 'config.json' not in names else 'model.safetensors'}")
    try:
        fmt = read_json(target / "config.json", "").get("format")
    except (NatslError, AttributeError):
        fmt = None
    if fmt != FORMAT:
        raise refuse("its config.json is not a natsl config")


def state_dict_for_saving(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors of a module's (or a given full) state dict, tied weights stored once
    (safetensors refuses shared storage)."""
    state = model if isinstance(model, dict) else model.state_dict()
    out, seen = {}, {}
    for name, tensor in state.items():
        key = tensor.data_ptr()
        if key in seen and tensor.numel() > 0:
            continue  # a tied weight (lm_head = embed): rebuilt from the config on load
        seen[key] = name
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous()
    return out


def write_model_files(folder: Path, model, recipe: Recipe, tokenizer=None, dtype: torch.dtype | None = None,
                      extra_config: dict | None = None) -> None:
    """Write the model files into an existing folder (config.json last)."""
    save_tensors(state_dict_for_saving(model, dtype), folder / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save(folder)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False), encoding="utf-8")
    saved = recipe.to_dict()
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "natsl_version": __version__,
              "recipe": saved, "model_sha256": model_fingerprint(saved["model"]), **(extra_config or {})}
    if tokenizer is not None:  # how the model's documents were delimited, for evaluation and generation
        config["tokenizer"] = tokenizer.conventions()
    (folder / COMPLETE_MARKER).write_text(json.dumps(config, indent=2), encoding="utf-8")


def save_model_folder(path, model, recipe: Recipe, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """An inference folder (weights, config, tokenizer), written atomically."""
    return atomic_folder(Path(path), lambda tmp: write_model_files(tmp, model, recipe, tokenizer, dtype))


def read_config(folder: Path) -> dict:
    path = folder / COMPLETE_MARKER
    if not path.is_file():
        raise NatslError(f"{str(folder)!r} is not a natsl checkpoint (no config.json); "
                         "pass a folder written by `natsl train` or `natsl convert`")
    config = read_json(path, "the file is corrupt: use another checkpoint")
    if not isinstance(config, dict):
        raise NatslError(f"{str(path)!r} holds {json.dumps(config)[:40]}, not a natsl config (a JSON object): the "
                         "file is damaged; use another checkpoint")
    if config.get("format") != FORMAT:
        if "recipe" in config:  # ours, with its format field damaged
            raise NatslError(f"{str(path)!r} has format {config.get('format')!r}, not {FORMAT!r}: the file is "
                             "damaged; use another checkpoint")
        kind = config.get("model_type")
        hint = (f" (model type {kind!r}: import it with `natsl convert --from-hf`)" if kind else "")
        raise NatslError(f"{str(folder)!r} holds a checkpoint of another model type{hint}; natsl reads folders "
                         "written by `natsl train` or `natsl convert`")
    check_format_version(config.get("format_version"), config.get("natsl_version"), repr(str(path)), "format_version")
    return config


def check_format_version(version, written_by, where: str, key: str) -> None:
    """Refuse a folder whose format this natsl cannot read: a newer one (written by a later natsl, whose
    version `written_by` the folder records) or a value that is no version at all.

    Args:
        version: the folder's format version (config.json's `key`).
        written_by: the natsl version recorded beside it (natsl_version), or None.
        where: the file, for the error line.
        key: the key's name in that file.
    """
    if isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= FORMAT_VERSION:
        return
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        by = f"natsl {written_by}" if isinstance(written_by, str) else "a newer natsl"
        raise NatslError(f"{where} has {key} {version}, written by {by}; this natsl ({__version__}) reads up to "
                         f"{FORMAT_VERSION}: install that natsl or a newer one (pip install -U natsl), or use a "
                         "folder this version wrote")
    raise NatslError(f"{where} has {key} {version!r}, not a format version natsl wrote (1 to {FORMAT_VERSION}): "
                     "the file is damaged; use another checkpoint")


def model_fingerprint(model: dict) -> str:
    """SHA-256 of a recipe's model section as JSON with sorted keys. config.json records it beside the
    recipe, so that an edit of a value that no weight shape shows (block_size, natsl_rope, the routing
    options) is refused instead of silently running another model than the one trained."""
    return hashlib.sha256(json.dumps(model, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_fingerprint(as_read: str, recorded, where: str) -> None:
    """Compare the fingerprint of a model section as read (before complete_model_section fills in later
    fields) with the one written beside it; folders from before fingerprints (recorded None) pass."""
    if recorded is not None and recorded != as_read:
        raise NatslError(f"{where}: the model section differs from the one natsl wrote (its fingerprint "
                         f"{str(recorded)[:12]}... does not match: a value such as block_size was edited, which no "
                         "weight shape shows); restore the file, or delete the fingerprint to run the edited model")


# Model fields that only training reads, at values that train as checkpoints from before them did (off).
TRAINING_ONLY_MODEL_FIELDS = {"router_noise": 0.0, "router_balance": 0.0, "router_target_keep": 0.5,
                              "router_bias_rate": 1e-3}
# Model fields added with the Mamba2 layers: checkpoints from before have neither Mamba2 layers nor a
# NAtS-L layer on a Mamba2 state, which these values reproduce. The last four came later: the Mamba2
# checkpoints from before them read the state unnormalised with D v, gave every block the MLP and had no
# conv bias.
MAMBA2_MODEL_FIELDS = {"natsl_state": "gdn", "mamba2_head_dim": 64, "mamba2_state_size": 128, "mamba2_expand": 2,
                       "mamba2_groups": 1, "mamba2_state_l2": False, "mamba2_state_skip": True, "mamba2_mlp": True,
                       "mamba2_conv_bias": False}
# Model fields added after checkpoints existed, with the value every earlier checkpoint was trained
# with (attn_window: full causal attention, the only attention there was; the NSA fields: no NSA layers,
# the rest at their defaults, which such a model never reads; router_keep_target: no keep bias, which
# inference reads too: with it set, the layers hold the bias buffer that the weights file must supply;
# router_keep_budget: the argmax route, as every earlier model was trained and routes at inference; its sink: none).
LATER_MODEL_FIELDS = {"attn_window": 0, "nsa_layers": [], "nsa_num_heads": 16, "nsa_kv_heads": 1, "nsa_head_dim": 128,
                      "nsa_block_size": 64, "nsa_block_counts": 16, "nsa_window": 512, "router_keep_target": None,
                      "router_keep_budget": None, "router_keep_budget_sink": 0}


def complete_model_section(model: dict, where: str) -> None:
    """Fill in the model fields added after checkpoints (and Hugging Face exports) existed, at the values
    that reproduce those models (training-only fields: off; the Mamba2 fields: no Mamba2 anywhere;
    attn_window: full attention); any other missing field is refused, naming `where`."""
    for key, value in {**TRAINING_ONLY_MODEL_FIELDS, **MAMBA2_MODEL_FIELDS, **LATER_MODEL_FIELDS}.items():
        model.setdefault(key, value)
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in model]
    if missing:
        raise NatslError(f"{where}: the model section lacks {', '.join(missing)}; this is not a complete natsl "
                         "checkpoint config: restore the keys from the recipe it was trained with, or use another "
                         "checkpoint")


def checkpoint_recipe(folder: Path, config: dict) -> Recipe:
    """The recipe in a checkpoint's config. Its model section must name every model field: a default
    filled in for a missing key would silently build another model than the one trained."""
    path = str(folder / COMPLETE_MARKER)
    recipe = config.get("recipe")
    model = recipe.get("model") if isinstance(recipe, dict) else None
    if not isinstance(model, dict):
        raise NatslError(f"{path!r} has no recipe with a model section: this is not a complete natsl checkpoint "
                         "config; use a folder written by `natsl train` or `natsl convert`, or fix the file")
    as_read = model_fingerprint(model)
    complete_model_section(model, repr(path))
    try:
        # Only the model's rules: the train and optim sections do not change the model, and a rule added
        # to them later must not make a saved model unloadable (resuming checks them in full).
        loaded = from_dict(Recipe, recipe)
        loaded.model.validate()
    except NatslError as err:
        skew = "" if config.get("natsl_version") in (None, __version__) else \
            f" (written by natsl {config.get('natsl_version')}, this is natsl {__version__})"
        raise NatslError(f"{path!r}{skew}: {err}") from None
    check_fingerprint(as_read, config.get("model_sha256"), repr(path))
    return loaded


def check_state_dict(weights: Path, state: dict, expected: dict, tied: bool) -> None:
    """Compare stored tensors with the shapes the config's model needs, naming the first mismatch
    (load_state_dict would print every mismatch in a long RuntimeError)."""
    problems = []
    for name, shape in expected.items():
        if name not in state:
            if not (tied and name == "lm_head.weight"):  # a tied head is rebuilt from the embedding
                problems.append(f"lacks tensor {name} (the config needs shape {shape})")
        elif tuple(state[name].shape) != shape:
            problems.append(f"tensor {name} has shape {tuple(state[name].shape)}, the config needs {shape}")
        elif not state[name].is_floating_point():  # load_state_dict would cast it silently
            problems.append(f"tensor {name} is {str(state[name].dtype).removeprefix('torch.')}, not a "
                            "floating-point type")
    problems += [f"has tensor {name} that the config's model does not have" for name in state
                 if name not in expected]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise NatslError(f"{str(weights)!r} does not match its config.json: {problems[0]}{more}; the weights and "
                         "config come from different models: use a matching pair or another checkpoint")


def resolve_checkpoint_folder(path) -> Path:
    """A model folder, or a run folder whose newest complete `step_*` checkpoint is taken."""
    folder = Path(path)
    if not folder.exists():
        raise NatslError(f"checkpoint {str(folder)!r} does not exist; pass a folder written by `natsl train` or `natsl convert`")
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    steps = sorted((p for p in folder.glob("step_*") if (p / COMPLETE_MARKER).is_file()), key=lambda p: p.name)
    if steps:
        return steps[-1]
    if (folder / "checkpoints").is_dir():
        return resolve_checkpoint_folder(folder / "checkpoints")
    return folder  # read_config explains what is missing


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_manifest(folder: Path, hashed=None) -> dict:
    """Check a step folder's files against its manifest.json (written last by natsl.training.state):
    every listed file present with its size, and the SHA-256 of those in `hashed` (all when None), so
    that a flipped byte is found too. Returns the manifest's sizes; NatslError names the first problem."""
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise NatslError(f"{str(folder)!r} is not a complete training checkpoint (no {MANIFEST_FILE})")
    manifest = read_json(manifest_path, "the checkpoint is corrupt: use another one")
    try:
        sizes = manifest["files"]
        hashes = manifest.get("sha256", {})  # the first manifests held sizes only
        sizes.items(), hashes.items()
    except (KeyError, TypeError, AttributeError):
        raise NatslError(f"{str(manifest_path)!r} is corrupt") from None
    for name, size in sizes.items():
        path = resolve_inside(folder, name, repr(str(manifest_path)), fix="use another checkpoint")
        if not isinstance(size, int) or isinstance(size, bool):
            raise NatslError(f"{str(manifest_path)!r} is corrupt: the size of {name} is {size!r}")
        if not path.is_file():
            raise NatslError(f"{str(folder)!r} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise NatslError(f"{str(path)!r} is damaged: {path.stat().st_size} bytes, the manifest says {size}")
    for name, size in sizes.items():
        if name in hashes and (hashed is None or name in hashed) and sha256_file(folder / name) != hashes[name]:
            raise NatslError(f"{str(folder / name)!r} is damaged: its SHA-256 differs from the manifest's; use "
                             "another checkpoint")
    return sizes


def model_files(path) -> tuple[Path, dict, Recipe, Path]:
    """(folder, config.json's contents, recipe, weights file) of a folder that `natsl train` or `natsl convert` wrote (a step, a run
    folder: its newest step, an inference folder), each checked to be there."""
    folder = resolve_checkpoint_folder(path)
    for name in (COMPLETE_MARKER, "model.safetensors", "tokenizer.json"):  # a link out of the folder: not read
        if (folder / name).is_symlink():
            resolve_inside(folder, name, f"checkpoint {str(folder)!r}", fix="copy the file into the folder")
    config = read_config(folder)
    recipe = checkpoint_recipe(folder, config)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise NatslError(f"{str(folder)!r} has no model.safetensors; the checkpoint is incomplete, use another one")
    return folder, config, recipe, weights


def read_weights(folder: Path, weights: Path) -> dict:
    """The tensors of `weights` on the CPU; in a training step folder, checked against its manifest first."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (folder / MANIFEST_FILE).is_file():
        # A training step folder: the files the model is built from must match their manifest. Their
        # SHA-256 is one more pass over files the load reads next anyway (then from the page cache);
        # the optimizer and RNG states, not read here, are checked by size only.
        verify_manifest(folder, hashed=("model.safetensors", COMPLETE_MARKER))
    try:
        return load_file(str(weights), device="cpu")
    except (SafetensorError, OSError) as err:
        raise NatslError(f"{str(weights)!r} is corrupt ({err}); use another checkpoint") from None


def initial_weights(path, model: ModelConfig, expected: dict) -> tuple[dict, Path, list[str]]:
    """The weights that `train.init_from` starts a run from: (state dict on the CPU, the folder read, the
    model fields whose values differ from the checkpoint's). Every tensor must match the new model by name
    and shape; fields that change no shape (router options, backend) may differ and are reported, so that
    a curriculum can change them on purpose and see that it did."""
    folder, _, recipe, weights = model_files(path)
    state = read_weights(folder, weights)
    try:
        check_state_dict(weights, state, expected, model.tie_embeddings)
    except NatslError as err:
        raise NatslError(f"train.init_from: the checkpoint's weights do not fit this recipe's model "
                         f"({str(err).split(': ', 1)[-1].split('; ')[0]}); use a checkpoint of the same model "
                         "(widths, layers, layer types)") from None
    differing = [f.name for f in dataclasses.fields(model) if getattr(model, f.name) != getattr(recipe.model, f.name)]
    return state, folder, differing


def load_checkpoint(path, device=None, dtype: torch.dtype | None = None):
    """The model and tokenizer of a folder that `natsl train` or `natsl convert` wrote.

    Args:
        path: a training step, a run folder (its newest step is read) or an inference folder. A folder
            that is missing, incomplete or does not fit its config stops with a one-line NatslError.
        device: where the weights go (a `torch.device` or its name); None: the CPU.
        dtype: cast the model to this dtype; None keeps the stored one.

    Returns:
        A tuple `(model, tokenizer)`: the `CausalLM` in eval mode, its recipe as `model.recipe`; the
        tokenizer, or None for a folder without tokenizer.json.
    """
    from natsl.models import build_model

    folder, config, recipe, weights = model_files(path)
    tokenizer = checkpoint_tokenizer(folder, config, recipe.model.vocab_size)
    state = read_weights(folder, weights)
    model = build_model(recipe, device="meta")
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    check_state_dict(weights, state, expected, recipe.model.tie_embeddings)
    model = model.to_empty(device=device or "cpu")
    model.load_state_dict(state, strict=False, assign=False)
    if recipe.model.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    model.recipe = recipe
    return model, tokenizer


def checkpoint_tokenizer(folder: Path, config: dict, vocab_size: int):
    """The tokenizer of a checkpoint folder (None without tokenizer.json) with the conventions its model was
    trained with, checked to fit the model's `vocab_size`; reads no weights.

    Args:
        folder: the checkpoint folder (resolved).
        config: its config.json.
        vocab_size: its model's vocabulary.
    Returns:
        A natsl.tokenizer.Tokenizer, or None.
    """
    from natsl.tokenizer import Tokenizer, check_fits_model

    if not (folder / "tokenizer.json").is_file():
        return None
    tokenizer = Tokenizer.from_file(folder)
    recorded = config.get("tokenizer") or {}  # older checkpoints record nothing: no BOS
    if not isinstance(recorded, dict):
        raise NatslError(f"{str(folder / 'config.json')!r}: its tokenizer section is {type(recorded).__name__}, not "
                         "an object: the file is damaged; use another copy of the checkpoint")
    try:
        tokenizer.apply_conventions(recorded)
    except NatslError as err:
        raise NatslError(f"{str(folder / 'config.json')!r}: {err}") from None
    check_fits_model(tokenizer, vocab_size, f"checkpoint {str(folder)!r}")
    return tokenizer
