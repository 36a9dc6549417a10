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
(`natsl.atomic.atomic_folder`), so a crash leaves either the whole checkpoint or hidden
`.step_*.tmp-*` (`.new-*`, `.old-*`) folders that the next run reports and puts right. On resume
every file is checked against the manifest (size, then SHA-256: a same-size corruption too) and
loaded; a damaged checkpoint is reported in one line and skipped. Weights holding a non-finite value are never written,
so a diverged run cannot push its last good checkpoints out of keep-last-k.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from natsl.atomic import recover_folders_in
from natsl.checkpoint import (MANIFEST_FILE, atomic_folder, checkpoint_recipe, read_config, save_tensors, sha256_file,
                              verify_manifest, write_model_files)
from natsl.errors import NatslError
from natsl.files import read_json
from natsl.training.faults import fault_point

CHECKPOINTS = "checkpoints"
SUPERSEDED = "superseded"  # checkpoints of an abandoned branch (set_aside_later)
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
STEP_RE = re.compile(r"^step_(\d+)$")


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
    """Put right the checkpoint writes that a crash interrupted (natsl.atomic.recover_folder: a step folder
    caught between its renames is completed or restored, the rest removed; one line each)."""
    recover_folders_in(Path(out) / CHECKPOINTS, log, what="checkpoint write")


def prune(out: Path, keep_last: int, written: int) -> None:
    """Keep the newest `keep_last` step folders up to step `written`, the one just saved (all of them
    when keep_last < 1). A folder of a later step is never counted nor deleted: the run that wrote
    `written` did not write it (and `set_aside_later` has moved such folders away before training)."""
    if keep_last < 1:
        return
    mine = [path for step, path in list_checkpoints(out) if step <= written]
    for path in mine[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def set_aside_later(out: Path, step: int, metrics_name: str = "metrics.jsonl") -> Path | None:
    """A run that starts at `step` while OUT holds checkpoints of later steps (resuming an older
    checkpoint: a branch) moves those step folders, and the metrics records after `step`, into
    OUT/superseded/<time>-after-step_NNNNNN/ (a run folder of its own: `--resume`, `natsl convert` and the
    eval commands take it), so that `--resume auto` continues the new branch and no file mixes the two.
    Returns that folder, or None when there was nothing later."""
    import datetime

    later = [path for s, path in list_checkpoints(out) if s > step]
    if not later:
        return None
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%S")
    aside = Path(out) / SUPERSEDED / f"{stamp}-after-step_{step:06d}"
    (aside / CHECKPOINTS).mkdir(parents=True)
    for path in later:
        os.replace(path, aside / CHECKPOINTS / path.name)
    metrics = Path(out) / metrics_name
    if metrics.is_file():
        records = metrics.read_text(encoding="utf-8").splitlines(keepends=True)
        dropped = [line for line in records if _record_step(line) > step]
        (aside / metrics_name).write_text("".join(dropped), encoding="utf-8")
    if (Path(out) / "recipe.yaml").is_file():
        shutil.copy2(Path(out) / "recipe.yaml", aside / "recipe.yaml")
    return aside


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (AttributeError, TypeError, ValueError, RecursionError):  # a line cut short, or not natsl's
        return 0


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


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's two moments per parameter, each of its parameter's shape


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
    shape_of = {n: tuple(p.shape) for n, p in zip(flat, (p for g in optimizer.param_groups for p in g["params"]))}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        pname, _, skey = key.rpartition("::")
        if pname not in index_of:
            raise NatslError(f"the optimizer state in {where} names an unknown parameter {pname!r}")
        if skey in MOMENTS and (not value.is_floating_point() or tuple(value.shape) != shape_of[pname]):
            raise NatslError(f"the optimizer state in {where}: {key} is {str(value.dtype).removeprefix('torch.')} "
                             f"{tuple(value.shape)}, not a float tensor of its parameter's shape {shape_of[pname]}; "
                             "use another checkpoint")
        state.setdefault(index_of[pname], {})[skey] = place(pname, value)
    for index, entry in state.items():
        missing = sorted(set(MOMENTS) - set(entry))
        if missing:
            raise NatslError(f"the optimizer state in {where} has no {missing[0]} for {flat[index]}; use another "
                             "checkpoint")
    # Hyper-parameters come from the current recipe (lr is set every step anyway); only the state is restored.
    param_groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


# ----------------------------------------------------------------------------- save / load

def save_checkpoint(out: Path, step: int, model_state: dict, optimizer_state: tuple[dict, list[dict]],
                    recipe, tokenizer, trainer_state: dict, rng: dict[str, torch.Tensor], keep_last: int) -> Path:
    """Write OUT/checkpoints/step_NNNNNN atomically, then prune to the newest `keep_last`.
    `model_state`: the full state dict; `optimizer_state`: `optimizer_to_tensors(...)`."""
    bad = next((name for name, t in model_state.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise NatslError(f"step {step}: weight {bad} holds a non-finite value, so no checkpoint was written (the "
                         "earlier ones are kept); lower optim.lr or resume from the last good checkpoint")

    def fill(tmp: Path) -> None:
        tensors, groups = optimizer_state
        save_tensors(tensors, tmp / OPTIMIZER_FILE)
        fault_point("kill_in_checkpoint", step)  # the crash test: the temporary folder is half written
        save_tensors(rng, tmp / RNG_FILE)
        state = {**trainer_state, "optimizer_groups": groups}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        write_model_files(tmp, model_state, recipe, tokenizer,
                          extra_config={"training": {k: trainer_state[k] for k in ("step", "tokens_seen")}})
        files = [p for p in sorted(tmp.iterdir()) if p.is_file()]
        manifest = {"files": {p.name: p.stat().st_size for p in files}, "sha256": {p.name: sha256_file(p) for p in files}}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")

    target = atomic_folder(step_folder(out, step), fill)
    prune(out, keep_last, step)
    return target


@dataclass
class LoadedCheckpoint:
    folder: Path
    recipe: object
    model_state: dict
    optimizer_tensors: dict
    trainer_state: dict
    rng: dict


def missing_checkpoint(folder) -> NatslError:
    """A --resume folder that is not there: the one line."""
    return NatslError(f"checkpoint {str(folder)!r} does not exist; pass a step folder such as "
                      "runs/NAME/checkpoints/step_000050")


def load_training_checkpoint(folder: Path) -> LoadedCheckpoint:
    """Read and check every file of a step folder; NatslError (one line) if anything is missing or damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise missing_checkpoint(folder)
    sizes = verify_manifest(folder)
    for name in (OPTIMIZER_FILE, RNG_FILE, STATE_FILE, "model.safetensors"):
        if name not in sizes:
            raise NatslError(f"{str(folder)!r} is incomplete: the manifest lists no {name}")
    recipe = checkpoint_recipe(folder, read_config(folder))  # resuming compares its model with the new recipe's
    state = read_json(folder / STATE_FILE, "the checkpoint is corrupt: use another one")
    check_trainer_state(state, folder / STATE_FILE)
    loaded = {}
    for name in ("model.safetensors", OPTIMIZER_FILE, RNG_FILE):
        try:
            loaded[name] = load_file(str(folder / name), device="cpu")
        except (SafetensorError, OSError, ValueError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise NatslError(f"{str(folder / name)!r} is corrupt ({first})") from None
    check_rng_tensors(loaded[RNG_FILE], folder / RNG_FILE)
    bad = next((name for name, t in loaded["model.safetensors"].items() if not t.is_floating_point()), None)
    if bad is not None:  # load_state_dict would cast it silently
        raise NatslError(f"{str(folder / 'model.safetensors')!r}: tensor {bad} is "
                         f"{str(loaded['model.safetensors'][bad].dtype).removeprefix('torch.')}, not a floating-point "
                         "type; the file was not written by natsl: use another checkpoint")
    return LoadedCheckpoint(folder, recipe, loaded["model.safetensors"], loaded[OPTIMIZER_FILE], state,
                            loaded[RNG_FILE])


# The counters a resumed run takes as they are: whole numbers from 0 (a step past 10**15 is no run's).
COUNTERS = {"step": True, "tokens_seen": True, "samples_seen": True, "bad_steps": False}
MAX_COUNT = 10**15


def check_trainer_state(state, path: Path) -> None:
    """NatslError (one line) unless trainer_state.json holds what resuming reads: the counters as whole numbers
    from 0 and the optimizer's groups as a list of objects naming their parameters. The file is untrusted: a
    counter as a string or a float would stop the run deep inside it, a negative one would train from it."""
    def corrupt(why: str) -> NatslError:
        return NatslError(f"{str(path)!r} is corrupt: {why}; use another checkpoint")

    if not isinstance(state, dict):
        raise corrupt("not a JSON object")
    for key, required in COUNTERS.items():
        if key not in state:
            if required:
                raise corrupt(f"it has no {key}")
            continue
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
            raise corrupt(f"{key} is {value!r}, not a whole number from 0")
    groups = state.get("optimizer_groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("param_names"), list) for g in groups):
        raise corrupt("optimizer_groups is not a list of groups that name their parameters")


def check_rng_tensors(tensors: dict, path: Path) -> None:
    """NatslError unless the RNG file holds rank 0's CPU generator state as this torch writes it (bytes of its
    size): a cut or retyped state would stop the resumed run in torch.set_rng_state, a missing one would resume
    on another random stream without a word."""
    size = torch.get_rng_state().numel()
    if "cpu_rank0" not in tensors:
        raise NatslError(f"{str(path)!r} holds no cpu_rank0 generator state; use another checkpoint")
    for name, tensor in tensors.items():
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or (name.startswith("cpu_") and tensor.numel() != size):
            raise NatslError(f"{str(path)!r}: {name} is {str(tensor.dtype).removeprefix('torch.')} of shape "
                             f"{tuple(tensor.shape)}, not a generator state; use another checkpoint")


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
