"""What a sweep spec may say, checked before any worker starts: specs come from strangers.

A spec names folders (its systems and tasks become run folders under --out), files (a system's
recipe), environment variables for the workers and the evaluation grid. Each is checked here, once,
with a one-line error that names the problem and the fix:

- names are plain (letters, digits, `_`, `-`, `.`; never `..` or `/`), so every run folder lies in
  --out (checked again, symlinks resolved, before the runner writes there);
- a recipe file lies in the spec's folder (or is a shipped recipe's name);
- a system's `env:` holds only natsl's own switches (natsl/switches.py) and a few diagnostics that load
  nothing (no PYTHONPATH, LD_PRELOAD, TORCH_LOGS, which imports the modules it names, or any path);
- the `eval:` values are those eval-recall takes, and every run's grid fits its model;
- the device is one the machine has (in the runner: a spec loads where its GPU is not);
- --out is new, empty of summaries, or holds this very spec (the runner then resumes it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from natsl.errors import NatslError

# A run's folder is OUT/runs/TASK-SYSTEM-dWIDTH-lrLR[-sSEED]: its names must stay one plain path part.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,3})?")


def _flag(value: str) -> bool:
    return value in ("0", "1")


def _count(value: str) -> bool:
    return value.isdigit() and 1 <= int(value) <= 1024


def _line_limit(value: str) -> bool:
    return value.isdigit() and int(value) <= 10**6


# Diagnostics a system may set besides natsl's switches: name -> (what its value must be, the check).
# None of them names a file, a folder, a library or a module.
DIAGNOSTICS = {
    "NATSL_CHECK_OPS": ("0, 1 or a line limit (a number up to 10**6)", _line_limit),  # natsl.fast.op_check: non-finite values per op
    "CUDA_LAUNCH_BLOCKING": ("0 or 1", _flag),
    "TORCH_SHOW_CPP_STACKTRACES": ("0 or 1", _flag),
    "TORCHINDUCTOR_COMPILE_THREADS": ("a count from 1 to 1024", _count),  # 1: compile in the worker's process
}


def spec_error(path, message: str) -> NatslError:
    """The error of a sweep spec: one line, naming the spec file."""
    return NatslError(f"sweep spec {str(path)!r}: {message}")


def check_name(name: Any, what: str, path) -> str:
    """`name` if it can be a path part of a run folder (NAME), else a spec error naming `what` it is."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise spec_error(path, f"{what} name {name!r} is not a plain name; use at most 64 letters, digits, _, - "
                               "and . (it becomes part of a run folder's name)")
    return name


def inside(path: Path, root: Path) -> bool:
    """Whether `path` lies in folder `root` once both are resolved (symlinks followed)."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def allowed_env() -> list[str]:
    """The variables a system's `env:` may set: natsl's switches and DIAGNOSTICS."""
    from natsl import switches

    names = {f.metadata["env"] for f in switches.FIELDS.values() if f.metadata["env"] is not None}
    return sorted(names | set(DIAGNOSTICS))


def check_env(value: Any, system: str, path) -> dict[str, str]:
    """A system's `env:` mapping as environment strings (absent: none), each variable one of allowed_env()
    with a value it takes."""
    from natsl import switches

    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise spec_error(path, f"system {system!r}'s 'env' is {value!r}; write a mapping such as {{NATSL_CHECK_OPS: 1}}")
    allowed = allowed_env()
    env = {}
    for name, raw in value.items():
        if name not in allowed:
            raise spec_error(path, f"system {system!r}'s env variable {name!r} is not allowed (a spec may set only "
                                   f"natsl's switches and diagnostics: {', '.join(allowed)}); remove it")
        if isinstance(raw, (dict, list)) or raw is None:
            raise spec_error(path, f"system {system!r}'s env variable {name!r} has no plain value; write "
                                   f"{name}: 1 (a string, number or boolean)")
        # a YAML boolean as natsl reads its variables ("0" is off, anything else on: "false" would be on)
        text = str(int(raw)) if isinstance(raw, bool) else str(raw)
        if name in DIAGNOSTICS:
            expect, ok = DIAGNOSTICS[name]
            if not ok(text):
                raise spec_error(path, f"system {system!r}'s env variable {name}={text!r} must be {expect}")
        else:
            try:
                switches.from_environ({name: text})
            except NatslError as err:
                raise spec_error(path, f"system {system!r}'s env: {err}") from None
        env[name] = text
    return env


def recipe_location(entry: str, spec: Path, system: str) -> str:
    """Where a worker loads a system's recipe from: the file `entry` names in the spec's folder (absolute,
    resolved), else the shipped recipe of that name (e.g. recall/gdn). A file outside the folder is refused."""
    from natsl.config import shipped_recipe

    folder = spec.parent.resolve()
    given = Path(entry)
    beside = (folder / given).resolve()
    if not given.is_absolute() and beside.is_file() and inside(beside, folder):
        return str(beside)
    if shipped_recipe(entry) is not None:
        return entry
    if given.is_absolute() or not inside(beside, folder):
        raise spec_error(spec, f"system {system!r}'s recipe {entry!r} lies outside the spec's folder; put the recipe "
                               "beside the spec (or in a folder below it), or name a shipped recipe such as recall/gdn")
    raise spec_error(spec, f"system {system!r}'s recipe {entry!r} is no file beside the spec nor a shipped recipe; "
                           "fix the name (shipped: recall/gdn, recall/natsl_hybrid, ...)")


EVAL_KEYS = ("lengths", "pairs", "samples", "batch_size", "seed", "vocab")
EVAL_DEFAULTS = {"samples": 128, "batch_size": 32}


def check_eval(value: Any, path) -> dict:
    """The spec's `eval:` (eval-recall's grid and sample counts), checked as eval-recall checks its options;
    lengths and pairs as strings such as "512,1024". Whether each run's grid fits its model: check_run_eval."""
    from natsl.data.grid import parse_lengths, parse_pairs
    from natsl.seeding import check_seed

    value = {} if value is None else value
    if not isinstance(value, dict):
        raise spec_error(path, f"'eval' must be a mapping such as {{lengths: \"512,1024\", pairs: \"32,64\", "
                               f"samples: 128, batch_size: 32}}, got {value!r}")
    unknown = sorted(map(str, set(value) - set(EVAL_KEYS)))
    if unknown:
        raise spec_error(path, f"unknown eval key {unknown[0]!r}; allowed: {', '.join(EVAL_KEYS)}")
    evals = {**EVAL_DEFAULTS, **value}
    try:
        for key in ("samples", "batch_size", "vocab"):
            number = evals.get(key)
            if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
                raise NatslError(f"eval.{key} must be a whole number, at least 1, got {number!r}")
        check_seed(evals.get("seed", 0), "eval.seed")
        for key in ("lengths", "pairs"):
            grid = evals.get(key)
            if grid is None:
                continue
            if isinstance(grid, int) and not isinstance(grid, bool):
                grid = evals[key] = str(grid)
            if not isinstance(grid, str):
                raise NatslError(f"eval.{key} must be comma-separated numbers such as \"512,1024\", got {grid!r}")
            (parse_lengths if key == "lengths" else parse_pairs)(grid, f"eval.{key}")
    except NatslError as err:
        raise spec_error(path, f"{err}; fix the spec's eval:") from None
    return evals


def check_run_eval(evals: dict, recipe, run_id: str, path) -> None:
    """The grid a run's worker will evaluate on fits its model (natsl.data.grid.eval_grid, as eval-recall reads it)."""
    from natsl.data.grid import eval_grid, parse_lengths, parse_pairs

    lengths, pairs = evals.get("lengths"), evals.get("pairs")
    try:
        eval_grid(recipe, None, parse_lengths(lengths) if lengths else None, parse_pairs(pairs) if pairs else None,
                  evals.get("vocab"))
    except NatslError as err:
        raise spec_error(path, f"run {run_id}: eval: {err}; fix the spec's eval:") from None


def check_device(device: Any, where: str) -> Optional[str]:
    """A run's device as written (None: cuda when there is one): auto, cpu, cuda or cuda:N."""
    if device is not None and (not isinstance(device, str) or not DEVICE.fullmatch(device)):
        raise NatslError(f"{where} {device!r} is not one of auto, cpu, cuda, cuda:N; fix it")
    return device


def check_devices_present(devices: set) -> None:
    """Every device that runs still to train name is on this machine (a spec loads anywhere; it runs here)."""
    wanted = sorted(d for d in devices if d is not None and d.startswith("cuda"))
    if not wanted:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in wanted:
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            have = f"{count} CUDA GPU{'s' if count != 1 else ''}" if count else "no CUDA GPU"
            raise NatslError(f"the runs train on {device}, but this machine has {have}; pass --device cpu "
                             "(or run the sweep where that GPU is)")


SUMMARY_FILES = ("summary.json", "summary.png")


# Fields of a run (sweep.RunSpec) that are not its settings: where and until when it ran. `recipe` is the
# path the runner resolved (absolute, so it moves with the checkout); the spec's own entry, compared
# whole, stands for it.
RUN_PLACE_FIELDS = ("out", "train_deadline", "deadline", "recipe")


def spec_grows(old_spec: dict, spec: dict) -> Optional[str]:
    """Whether `spec` differs from `old_spec` only in its learning rates, by more systems and by more seeds of
    a system (its own `seeds:`, every earlier seed kept), each earlier system's entry otherwise unchanged: None
    if so, else what differs (one phrase). `grown_from` checks the runs too."""
    old_spec, spec = _plain(old_spec), _plain(spec)
    for key in sorted((set(old_spec) | set(spec)) - {"lrs", "systems"}):
        if old_spec.get(key) != spec.get(key):
            return f"'{key}' differs"
    old_systems, systems = old_spec.get("systems"), spec.get("systems")
    if not isinstance(old_systems, dict) or not isinstance(systems, dict):
        return "'systems' differs"
    spec_seeds = spec.get("seeds", [0])
    for system, entry in old_systems.items():
        if systems.get(system) != entry and not _adds_seeds(entry, systems.get(system), spec_seeds):
            return f"system {system!r} differs"
    return None


def _adds_seeds(old_entry: Any, entry: Any, spec_seeds: Any) -> bool:
    """Whether a system's entry differs from its old one only by seeds added (a recipe path alone reads as a
    mapping with the spec's seeds): its finished runs are then runs of the new entry too."""
    def parts(value: Any) -> Optional[dict]:
        value = {"recipe": value} if isinstance(value, str) else value
        if not isinstance(value, dict):
            return None
        seeds = value.get("seeds", spec_seeds)
        return {**value, "seeds": seeds} if isinstance(seeds, list) else None

    old, new = parts(old_entry), parts(entry)
    if old is None or new is None:
        return False
    same_rest = {k: v for k, v in old.items() if k != "seeds"} == {k: v for k, v in new.items() if k != "seeds"}
    return same_rest and all(seed in new["seeds"] for seed in old["seeds"])


def grown_from(previous: dict, spec: dict, runs: list[dict]) -> Optional[str]:
    """Whether a sweep of `spec` (its runs as dicts, sweep.RunSpec fields) only adds runs to the sweep
    recorded in `previous` (its sweep.json): more learning rates or more systems, every other key of
    the spec and every earlier run's settings unchanged. None if so, else what differs (one phrase).

    Such a spec may take the folder over: the runner keeps the finished runs and trains the new ones
    (a researcher who adds a rate reruns nothing)."""
    old_spec, old_runs = previous.get("spec"), previous.get("runs")
    if not isinstance(old_spec, dict) or not isinstance(old_runs, list):
        return "its sweep.json has no spec and runs"
    why = spec_grows(old_spec, spec)
    if why is not None:
        return why
    by_id = {run.get("id"): run for run in _plain(runs)}
    for run in old_runs:
        if not isinstance(run, dict):
            return "its sweep.json lists a run that is no record"
        new = by_id.get(run.get("id"))
        if new is None:
            return f"run {run.get('id')!r} is left out"
        for key in sorted((set(run) | set(new)) - set(RUN_PLACE_FIELDS)):
            if run.get(key) != new.get(key):
                return f"run {run.get('id')!r} differs in {key!r}"
    return None


def check_out_folder(out: Path, name: str, spec: dict, run_folders: list[Path],
                     runs: Optional[list[dict]] = None) -> Optional[int]:
    """--out is new, or holds the sweep of this very spec (whose finished runs the runner then keeps), or
    one that `spec` grows (`grown_from`: more rates or systems; `runs` are this sweep's runs as dicts);
    a folder with another spec's record, or a summary of no record, is refused before anything is written
    there. Every run folder lies in --out, symlinks resolved.

    Returns: how many runs the spec adds to the recorded sweep it grows, else None."""
    from natsl.files import read_json
    from natsl.outputs import check_output_folder

    check_output_folder(out, "--out")
    grown = None
    record = out / "sweep.json"
    if record.is_file() or record.is_symlink():
        try:
            previous = read_json(record, "pass a new --out folder")
        except (OSError, NatslError):  # unreadable, too large, not JSON, nested too deeply: no sweep record
            previous = None
        if not isinstance(previous, dict):
            raise NatslError(f"--out {str(out)!r} holds a sweep.json that is no sweep record; pass a new --out folder")
        if previous.get("name") != name:
            raise NatslError(f"--out {str(out)!r} holds the sweep {previous.get('name')!r} of another spec; pass a "
                             "new --out folder (the same spec again resumes its sweep there)")
        if _plain(previous.get("spec")) != _plain(spec):
            why = grown_from(previous, spec, runs or [])
            if why is not None:
                raise NatslError(f"--out {str(out)!r} holds the sweep {previous.get('name')!r} of another spec ({why}); "
                                 "pass a new --out folder (the same spec again resumes its sweep there, and one that "
                                 "only adds learning rates, systems or a system's seeds grows it)")
            grown = len(runs or []) - len(previous.get("runs") or [])
    elif any((out / f).exists() or (out / f).is_symlink() for f in SUMMARY_FILES):
        raise NatslError(f"--out {str(out)!r} holds a summary but no sweep.json; pass a new --out folder")
    for folder in run_folders:
        if not inside(folder, out):
            raise NatslError(f"run folder {str(folder)!r} resolves outside --out {str(out)!r} (a symlink?); "
                             "pass a new --out folder")
    return grown


def _plain(value: Any) -> Any:
    """`value` as it reads back from JSON (integer keys become strings)."""
    return json.loads(json.dumps(value, default=str))
