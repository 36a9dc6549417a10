"""Training checkpoints: a model folder plus the state that lets a run continue exactly.

    OUT/checkpoints/step_000050/
        model.safetensors  config.json  tokenizer.json  recipe.yaml   (natsl.checkpoint.write_model_files;
                                                                       `natsl.load_checkpoint` reads these)
        optimizer.safetensors   AdamW moments and step counts, keyed "<param name>::<state key>"
        rng.safetensors         torch RNG states of every rank (uint8)
        trainer_state.json      step, tokens and samples seen (the data position), counters, optimizer
                                hyper-parameters per group
        manifest.json           written last: the size and SHA-256 of every file above

Nothing is pickled. The folder is filled in a hidden temporary sibling and renamed into place
(`natsl.checkpoint.atomic_folder`), so a crash leaves either the whole checkpoint or a
`.step_*.tmp-*` folder that the next run reports and removes. On resume every file is checked
against the manifest (size, then SHA-256: a same-size corruption too) and loaded; a damaged
checkpoint is reported in one line and skipped. Weights holding a non-finite value are never written,
so a diverged run cannot push its last good checkpoints out of keep-last-k.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from natsl.checkpoint import atomic_folder, checkpoint_recipe, read_config, write_model_files
from natsl.errors import NatslError
from natsl.training.faults import fault_point

CHECKPOINTS = "checkpoints"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
STEP_RE = re.compile(r"^step_(\d+)$")
PARTIAL_RE = re.compile(r"^\.step_\d+\.(tmp|old)-")


def step_folder(out: Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step_{step:06d}"


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published step folder, oldest first (complete or not)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))]
    return sorted(found)


def remove_partial_writes(out: Path, log) -> None:
    """Delete the temporary folders of checkpoint writes that a crash interrupted (one line each)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.is_dir() and PARTIAL_RE.match(path.name):
            log(f"removing {path}: an unfinished checkpoint write (the run was killed while saving)")
            shutil.rmtree(path, ignore_errors=True)


def prune(out: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` step folders (all of them when keep_last < 1)."""
    if keep_last < 1:
        return
    for _, path in list_checkpoints(out)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- optimizer state

def _param_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str],
                         gather=lambda t: t) -> tuple[dict, list[dict]]:
    """AdamW state -> ({"<param>::<key>": tensor}, per-group hyper-parameters with their param names);
    `gather` makes each state tensor whole (FSDP: a collective, so every rank calls this)."""
    state = optimizer.state_dict()
    group_names = _param_names(optimizer, names)
    flat = [n for group in group_names for n in group]
    tensors = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            value = gather(value) if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{flat[index]}::{key}"] = value.detach().to("cpu").contiguous()
    groups = []
    for group, pnames in zip(state["param_groups"], group_names):
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "param_names": pnames})
    return tensors, groups


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str], tensors: dict,
                           groups: list[dict], where: str, place=lambda name, t: t) -> None:
    """Restore the AdamW state; `place(param_name, full_tensor)` lays each out as its parameter (FSDP: the
    rank's shard)."""
    group_names = _param_names(optimizer, names)
    if [g.get("param_names") for g in groups] != group_names:
        raise NatslError(f"the optimizer state in {where} does not match this model's parameters; "
                         "resume with the recipe the checkpoint was trained with")
    flat = [n for group in group_names for n in group]
    index_of = {n: i for i, n in enumerate(flat)}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        pname, _, skey = key.rpartition("::")
        if pname not in index_of:
            raise NatslError(f"the optimizer state in {where} names an unknown parameter {pname!r}")
        state.setdefault(index_of[pname], {})[skey] = place(pname, value)
    # Hyper-parameters come from the current recipe (lr is set every step anyway); only the state is restored.
    param_groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ----------------------------------------------------------------------------- save / load

def save_checkpoint(out: Path, step: int, model_state: dict, optimizer_state: tuple[dict, list[dict]],
                    recipe, tokenizer, trainer_state: dict, rng: dict[str, torch.Tensor], keep_last: int) -> Path:
    """Write OUT/checkpoints/step_NNNNNN atomically, then prune to the newest `keep_last`.
    `model_state`: the full state dict; `optimizer_state`: `optimizer_to_tensors(...)`."""
    from safetensors.torch import save_file

    bad = next((name for name, t in model_state.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise NatslError(f"step {step}: weight {bad} holds a non-finite value, so no checkpoint was written (the "
                         "earlier ones are kept); lower optim.lr or resume from the last good checkpoint")

    def fill(tmp: Path) -> None:
        tensors, groups = optimizer_state
        save_file(tensors, str(tmp / OPTIMIZER_FILE), metadata={"format": "pt"})
        fault_point("kill_in_checkpoint", step)  # the crash test: the temporary folder is half written
        save_file(rng, str(tmp / RNG_FILE), metadata={"format": "pt"})
        state = {**trainer_state, "optimizer_groups": groups}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        write_model_files(tmp, model_state, recipe, tokenizer,
                          extra_config={"training": {k: trainer_state[k] for k in ("step", "tokens_seen")}})
        files = [p for p in sorted(tmp.iterdir()) if p.is_file()]
        manifest = {"files": {p.name: p.stat().st_size for p in files}, "sha256": {p.name: _sha256(p) for p in files}}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")

    target = atomic_folder(step_folder(out, step), fill)
    prune(out, keep_last)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class LoadedCheckpoint:
    folder: Path
    recipe: object
    model_state: dict
    optimizer_tensors: dict
    trainer_state: dict
    rng: dict


def load_training_checkpoint(folder: Path) -> LoadedCheckpoint:
    """Read and check every file of a step folder; NatslError (one line) if anything is missing or damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise NatslError(f"checkpoint {str(folder)!r} does not exist; pass a step folder such as "
                         "runs/NAME/checkpoints/step_000050")
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise NatslError(f"{str(folder)!r} is not a complete training checkpoint (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        sizes = manifest["files"]
        hashes = manifest.get("sha256", {})  # manifests before 2026-11-30 hold sizes only
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise NatslError(f"{str(manifest_path)!r} is corrupt") from None
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            raise NatslError(f"{str(folder)!r} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise NatslError(f"{str(path)!r} is damaged: {path.stat().st_size} bytes, the manifest says {size}")
        if name in hashes and _sha256(path) != hashes[name]:
            raise NatslError(f"{str(path)!r} is damaged: its SHA-256 differs from the manifest's")
    for name in (OPTIMIZER_FILE, RNG_FILE, STATE_FILE, "model.safetensors"):
        if name not in sizes:
            raise NatslError(f"{str(folder)!r} is incomplete: the manifest lists no {name}")
    recipe = checkpoint_recipe(folder, read_config(folder))  # resuming compares its model with the new recipe's
    try:
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        for key in ("step", "tokens_seen", "samples_seen", "optimizer_groups"):
            state[key]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise NatslError(f"{str(folder / STATE_FILE)!r} is corrupt or incomplete") from None
    loaded = {}
    for name in ("model.safetensors", OPTIMIZER_FILE, RNG_FILE):
        try:
            loaded[name] = load_file(str(folder / name), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise NatslError(f"{str(folder / name)!r} is corrupt ({first})") from None
    return LoadedCheckpoint(folder, recipe, loaded["model.safetensors"], loaded[OPTIMIZER_FILE], state,
                            loaded[RNG_FILE])


def rng_tensors(states: list[dict]) -> dict[str, torch.Tensor]:
    """Per-rank {"cpu": ByteTensor, "cuda": ByteTensor?} -> flat safetensors dict."""
    out = {}
    for rank, entry in enumerate(states):
        for kind, tensor in entry.items():
            out[f"{kind}_rank{rank}"] = tensor.to("cpu").contiguous()
    return out


def capture_rng(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(tensors: dict, rank: int, device: torch.device) -> None:
    if f"cpu_rank{rank}" in tensors:
        torch.set_rng_state(tensors[f"cpu_rank{rank}"])
    if device.type == "cuda" and f"cuda_rank{rank}" in tensors:
        torch.cuda.set_rng_state(tensors[f"cuda_rank{rank}"], device)
