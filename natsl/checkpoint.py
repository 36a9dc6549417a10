"""Model folders: `model.safetensors` + `config.json` + `tokenizer.json` (+ `recipe.yaml`).

A folder is written into a temporary sibling, fsynced, then renamed into place, so a reader never
sees half of one. Weights are read with safetensors only (nothing is unpickled), and `config.json`
names the format so that a folder of another model type is refused with a clear message.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import yaml

from natsl import __version__
from natsl.config import Recipe, recipe_from_dict
from natsl.errors import NatslError

FORMAT = "natsl"
FORMAT_VERSION = 1
COMPLETE_MARKER = "config.json"  # written last inside the temporary folder


def fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_folder(target: Path, fill) -> Path:
    """Create `target` atomically: `fill(tmp_folder)` writes the files, then one rename publishes it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        fsync_tree(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


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
    from safetensors.torch import save_file

    save_file(state_dict_for_saving(model, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(folder)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False), encoding="utf-8")
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "natsl_version": __version__,
              "recipe": recipe.to_dict(), **(extra_config or {})}
    (folder / COMPLETE_MARKER).write_text(json.dumps(config, indent=2), encoding="utf-8")


def save_model_folder(path, model, recipe: Recipe, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """An inference folder (weights, config, tokenizer), written atomically."""
    return atomic_folder(Path(path), lambda tmp: write_model_files(tmp, model, recipe, tokenizer, dtype))


def read_config(folder: Path) -> dict:
    path = folder / COMPLETE_MARKER
    if not path.is_file():
        raise NatslError(f"{str(folder)!r} is not a natsl checkpoint (no config.json); "
                         "pass a folder written by `natsl train` or `natsl convert`")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise NatslError(f"{str(path)!r} is corrupt (not JSON); use another checkpoint") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        kind = config.get("model_type") if isinstance(config, dict) else None
        hint = (f" (model type {kind!r}: import it with `natsl convert --from-hf`)" if kind else "")
        raise NatslError(f"{str(folder)!r} holds a checkpoint of another model type{hint}; natsl reads folders "
                         "written by `natsl train` or `natsl convert`")
    return config


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


def load_checkpoint(path, device=None, dtype: torch.dtype | None = None):
    """(model, tokenizer or None) from a folder that `natsl train` or `natsl convert` wrote."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from natsl.models import build_model
    from natsl.tokenizer import Tokenizer

    folder = resolve_checkpoint_folder(path)
    config = read_config(folder)
    recipe = recipe_from_dict(config["recipe"])
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise NatslError(f"{str(folder)!r} has no model.safetensors; the checkpoint is incomplete, use another one")
    try:
        state = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError) as err:
        raise NatslError(f"{str(weights)!r} is corrupt ({err}); use another checkpoint") from None
    model = build_model(recipe, device="meta")
    model = model.to_empty(device=device or "cpu")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    missing = [m for m in missing if not (recipe.model.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise NatslError(f"{str(weights)!r} does not match its config (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}); the checkpoint is corrupt or of another natsl version")
    if recipe.model.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    tokenizer = Tokenizer.from_file(folder) if (folder / "tokenizer.json").is_file() else None
    model.recipe = recipe
    return model, tokenizer
