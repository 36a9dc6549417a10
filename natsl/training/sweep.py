"""Small-model sweeps: many short trainings in parallel processes on one device (Zoology's figure).

    python -m natsl.training.sweep recipes/recall/sweep_h200.yaml --max-parallel 16 --out OUT
    natsl sweep recipes/recall/sweep_cpu.yaml --out OUT          (the same, as a subcommand)

A spec (YAML) names systems (a recipe each), model widths, learning rates (one list for all systems
or one per system), training tasks and seeds; every combination is one run. A run is one worker process
(natsl.cli.sweep RUN.json, WORKER): it trains its recipe, scaled to the width, within its step
and wall-clock budget, then evaluates recall (`natsl eval-recall`) on the spec's grid, and writes
OUT/runs/ID/result.json. A model of width 128 leaves a GPU almost idle, so up to --max-parallel
workers share it.

Runs are matched in steps or in time (`budget.match`). In steps (the default when the budget gives
max_steps), every run trains exactly max_steps steps, its cosine schedule ending there; run_s only
caps it, and a run stopped before max_steps is marked `short` in the summary. In time (the default
when the budget gives run_s alone), a run trains for run_s seconds or max_steps steps, whichever ends
first, with the schedule still ending at max_steps: a system that steps faster gets more steps.

The summary's best entry per (task, system, width) is the learning rate with the best mean accuracy
over its seeds; seeds whose run has not finished are left out of the mean (not counted as zero).

A task that is not task:... is a language-model task: a `natsl tokenize` folder (read from the working
folder, as a recipe's data.path). Its runs keep their recipe's seq_len, tokens_per_step and micro-batch
(accumulation as the recipe says) and, with `widths:` left out, their own width; they are evaluated by the
trainer's validation loss (at their last step too), not eval-recall, and the summary's `best_lm` ranks each
(task, system, width)'s learning rates by the lowest final validation loss, mean over seeds
(natsl.training.sweep_lm). `budget.max_tokens` gives the run's length in tokens instead of max_steps.

Results are written as they come: a worker writes result.json after training and again after its
evaluation; the runner writes OUT/summary.json and OUT/summary.png at its start and again whenever a
run ends, from whatever has finished (a run cut off mid-training is summarised from its
metrics.jsonl), so a runner killed outright still leaves a summary. The global deadline
(`budget.deadline_s`; --deadline overrides it) stops starting runs that could not finish, tells
running workers when their training must end (leaving `budget.eval_reserve_s` for the evaluation,
which stops at the deadline too), and at the deadline kills every worker still running: SIGTERM to
its process group, SIGKILL a few seconds later, whatever state it is in. SIGTERM or SIGINT to the
runner does the same at once and it exits with 143 / 130; a second signal ends it at once, workers
killed. The summary is always written last. A worker whose runner is gone, or whose deadline has
passed, ends itself (natsl.cli.sweep), so no orphan keeps the GPU. The runner exits with 1 when a run
failed (its worker's error, not the deadline's or a signal's), 2 on bad input, before any worker starts.

Specs come from strangers: what a spec may name (run folders, recipe files, `env:` variables, the
evaluation grid, the device, --out) is checked in natsl.training.sweep_checks; every run's recipe with its
overrides validates here, at load. --out holds one spec's sweep: the same spec again resumes it (finished
runs are kept), another is refused.

The spec:

    systems:                       # name -> recipe file (beside the spec, or a name such as recall/gdn),
      gdn: gdn.yaml                # or name -> {recipe: FILE, set: [...]}: that system's own overrides,
      natsl_hybrid: natsl_hybrid.yaml   # applied after the spec's `set:` (a variant needs no recipe file)
      natsl_hybrid_target: {recipe: natsl_hybrid.yaml, set: [model.router_keep_target=0.5]}
      natsl_checked: {recipe: natsl.yaml, env: {NATSL_CHECK_OPS: 1}}   # env: that system's workers' variables
      natsl_seeds: {recipe: natsl.yaml, seeds: [0, 1, 2]}   # seeds: that system's own (instead of the spec's)
                                   # (natsl's switches and a few diagnostics only: sweep_checks.check_env)
    widths: [128, 64, 256]         # hidden size; head dims, MLP and attention heads scale with it
    lrs: [0.001, 0.003]            # or by width {64: [...], 256: [...]}, or by system {gdn: [...], natsl_hybrid:
                                   # {128: [...]}} (a list, or a list per width); a width left out is not run
    tasks:                         # training tasks: name -> data.path (train.seq_len follows the task)
      mqar512: task:mqar?seq_len=512&pairs=8,16,32,64   # or a natsl tokenize folder: a language-model task
    eval: {lengths: "512,1024", pairs: "32,64,128", samples: 128, batch_size: 32}
    seeds: [0, 1, 2]               # train.seed of each run (default [0]); ids end -s1, -s2 (seed 0: none)
    budget: {max_steps: 2000, run_s: 150, deadline_s: 470, eval_reserve_s: 40, match: steps}
    set: [train.log_every=50]      # overrides for every run (natsl train --set), before a system's own
    compile: false                 # default (key absent): compile + CUDA graphs on CUDA, eager on the CPU
    max_parallel: 16

Without a `compile:` key a run on CUDA trains with `train.compile` and `train.cuda_graphs` (a small
model's step is launch-bound: fewer, fused kernels replayed from a graph), and on the CPU eagerly;
a `set:` item (e.g. `train.cuda_graphs=false`) still overrides it. `compile: true|false` says it
for every device (and leaves train.cuda_graphs to the recipe).

With `--mps`, a runner that starts several workers on a GPU first starts the CUDA MPS control
daemon (`nvidia-cuda-mps-control -d`, when that program is on the PATH), so that the workers'
kernels share the GPU at once rather than time-slicing it, and stops it at the end. Its pipe and
log folders are a fresh temporary folder (CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, handed
to the workers), unless those variables are set already.

Runs start in the order task, width, seed, learning rate, system, so a sweep cut short still has every
system at the first widths listed, with its learning rates at the first seed.

This module starts workers as processes and reads their files; it imports no evaluation code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from natsl.errors import NatslError
from natsl.files import read_json, read_json_records
from natsl.training.sweep_checks import (check_devices_present, check_env, check_eval, check_name, check_out_folder,
                                         check_run_eval, check_device, recipe_location, spec_error)
from natsl.training.sweep_lm import LM_NOTE, best_lm_points, plot_lm_summary, save_figure, validation_of

SCALED = ("hidden_size", "intermediate_size", "head_k_dim", "head_v_dim", "attn_head_dim")
SPEC_KEYS = {"name", "systems", "widths", "lrs", "tasks", "eval", "budget", "set", "compile", "max_parallel",
             "device", "seeds"}
SYSTEM_KEYS = ("recipe", "set", "env", "seeds")  # of a system given as a mapping: {recipe: FILE, set: [...], env: {...}}
BUDGET_KEYS = {"max_steps", "max_tokens", "run_s", "deadline_s", "eval_reserve_s", "match"}
MATCHES = ("steps", "time")
# Recipe keys the runner sets for every run: a `set:` item must not overrule them (what to write instead).
RUNNER_KEYS = {"train.seed": "seeds: [0, 1, 2]", "train.total_tokens": "budget.max_steps or budget.max_tokens",
               "train.max_steps": "budget.max_steps or budget.max_tokens",
               "data.path": "tasks: {NAME: task:...} or {NAME: a natsl tokenize folder}",
               "train.out_dir": "--out"}
CROWDED = 16  # more workers than this on one GPU each get too few steps in a wall-clock budget


@dataclass
class RunSpec:
    id: str
    system: str
    recipe: str
    width: int
    lr: float
    task: str
    data: str
    overrides: list[str]
    max_steps: int
    run_s: float
    eval: dict
    compile: bool
    device: Optional[str]
    out: str
    train_deadline: Optional[float] = None  # absolute time.time() at which training must stop
    deadline: Optional[float] = None  # absolute time.time() of the sweep's deadline: the worker is gone by then
    seed: int = 0  # its train.seed
    match: str = "steps"  # steps: it must reach max_steps (run_s only caps it); time: run_s is its budget
    env: dict = field(default_factory=dict)  # its system's `env:`: set in its worker's environment
    kind: str = "recall"  # recall: an MQAR task, evaluated by eval-recall; lm: a token folder, by validation loss
    tokens_per_step: int = 0  # of its trained recipe (an lm run's tokens trained: steps x this)


@dataclass
class Sweep:
    name: str
    runs: list[RunSpec]
    max_parallel: int
    deadline_s: Optional[float]
    eval_reserve_s: float
    out: Path
    spec: dict = field(default_factory=dict)
    min_train_s: float = 10.0  # a run is started only if it can train this long before its evaluation reserve
    grace_s: float = 3.0  # a stopped worker's time to end on SIGTERM before SIGKILL
    match: str = "steps"  # budget.match of its runs (check_budget)
    clock: Callable[[], float] = time.time  # what the deadline is read from (tests pass their own)


_spec_error = spec_error


def runs_on_cuda(device: Optional[str]) -> bool:
    """Whether a worker given `device` (None: cuda when there is one) trains on a GPU."""
    if device is not None and device != "auto":
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def compile_settings(spec_compile, device: Optional[str]) -> tuple[bool, list[str]]:
    """(compile, overrides) of a run: the spec's `compile:` when it has one, else compile + CUDA graphs
    on CUDA and eager on the CPU."""
    if spec_compile is not None:
        return bool(spec_compile), []
    if runs_on_cuda(device):
        return True, ["train.cuda_graphs=true"]
    return False, []


def load_spec(path: str | Path, out: str | Path, max_parallel: Optional[int] = None,
              deadline_s: Optional[float] = None, device: Optional[str] = None) -> Sweep:
    """Read and check a sweep spec; expand it into runs (every recipe loads and validates here, with each
    run's overrides and evaluation grid, so that a bad spec fails in one line before any worker starts).

    Args:
        path: the spec (YAML, read as recipes are: natsl.config.load_yaml_file; nothing is executed).
        out: the sweep's folder (--out).
        max_parallel, deadline_s, device: --max-parallel, --deadline and --device (None: the spec's).
    Returns:
        the Sweep, its runs in the order they start.
    """
    from natsl.config import apply_overrides, load_recipe

    path = Path(path)
    spec = read_spec(path)
    if "seed" in spec:
        raise _spec_error(path, f"'seed' is not a key; write seeds: [{spec['seed']!r}] (each run's train.seed)")
    unknown = sorted(map(str, set(spec) - SPEC_KEYS))
    if unknown:
        raise _spec_error(path, f"unknown key {unknown[0]!r}; allowed: {', '.join(sorted(SPEC_KEYS))}")
    name = spec.get("name", path.stem)
    if not isinstance(name, str) or not name.strip() or not name.isprintable():
        raise _spec_error(path, f"'name' must be a one-line string, got {name!r}")
    systems = system_entries(spec.get("systems"), path)
    tasks = spec.get("tasks")
    if not isinstance(tasks, dict) or not tasks or not all(isinstance(v, str) and v for v in tasks.values()):
        raise _spec_error(path, "'tasks' must map names to data paths such as task:mqar?seq_len=512&pairs=64 "
                                "or a natsl tokenize folder such as data/mini")
    for task_name in tasks:
        check_name(task_name, "task", path)
    overrides = set_items(spec.get("set"), "'set'", path)
    recipes = {system: load_recipe(location) for system, (location, _, _) in systems.items()}
    widths = spec.get("widths")
    own_width = widths is None and not any(map(is_task, tasks.values()))  # language-model tasks only
    if own_width:  # each recipe's own width (after the `set:` items), unscaled
        configured = {system: _configured(recipes[system], overrides + system_set, system, path)
                      for system, (_, system_set, _) in systems.items()}
        widths = sorted({c.model.hidden_size for c in configured.values()})
    if not isinstance(widths, list) or not widths or not all(
            isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths):
        raise _spec_error(path, "'widths' must be a list of positive integers (hidden sizes); it may be left "
                                "out only when every task is a natsl tokenize folder (each recipe's own width)")
    lr_of = lr_table(spec.get("lrs"), systems, widths, path)
    seeds = seed_list(spec.get("seeds"), path)
    seeds_of = {system: seeds if value is None else seed_list(value, path, f"system {system!r}'s 'seeds'")
                for system, value in system_seed_lists(spec.get("systems")).items()}
    seeds = seeds + sorted(set().union(*seeds_of.values()) - set(seeds))  # the spec's, in its order, first
    budget, match = check_budget(spec.get("budget"), path)
    evals = check_eval(spec.get("eval"), path)
    if spec.get("compile") is not None and not isinstance(spec["compile"], bool):
        raise _spec_error(path, f"'compile' must be true or false (or left out), got {spec['compile']!r}")
    device = check_device(device, "--device") if device is not None else check_device(spec.get("device"), "the spec's device")
    parallel = max_parallel if max_parallel is not None else spec.get("max_parallel", 1)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise _spec_error(path, f"max_parallel must be a whole number of workers, at least 1, got {parallel!r}; "
                                "fix --max-parallel or the spec's max_parallel")
    compile_, compile_overrides = compile_settings(spec.get("compile"), device)
    runs = []
    for task_name, data in tasks.items():
        lm = not is_task(data)
        task_len = None if lm else _task_seq_len(data, path)
        for width in widths:
            for seed in seeds:  # the first seed's rates first: a sweep cut short has whole rate sweeps
                for lr_index in range(max(len(lr_of[s].get(width, ())) for s in systems)):
                    for system, (location, system_set, system_env) in systems.items():
                        values = lr_of[system].get(width, ())
                        if lr_index >= len(values) or (own_width and configured[system].model.hidden_size != width) \
                                or seed not in seeds_of[system]:
                            continue  # this system has fewer rates at this width, or none (not run at it)
                        lr = float(values[lr_index])
                        run_id = f"{task_name}-{system}-d{width}-lr{lr:g}" + (f"-s{seed}" if seed else "")
                        where = "the spec's `set:`" + (f" or system {system!r}'s `set:`" if system_set else "")
                        recipe = recipes[system]
                        if lm:  # a language model: the recipe's own context, step size and micro-batch
                            tokens = _configured(recipe, overrides + system_set, system, path).train.tokens_per_step
                            shape = [f"data.path={data}"]
                            default_steps = recipe.train.max_steps or recipe.train.total_tokens // tokens
                        else:
                            tokens = _recall_step_tokens(recipe, overrides + system_set, task_len, run_id, where,
                                                         system, path)
                            shape = [f"data.path={data}", f"train.seq_len={task_len}", f"train.tokens_per_step={tokens}"]
                            default_steps = (recipe.train.max_steps
                                             or recipe.train.total_tokens // recipe.train.tokens_per_step)
                        max_steps = budget_steps(budget, tokens, default_steps, run_id, path)
                        # a warmup of a tenth of the run at most
                        run_overrides = ([] if own_width else width_overrides(recipe, width)) + [
                            f"optim.lr={lr}", f"optim.min_lr={lr / 10}"] + shape + [
                            f"optim.warmup_tokens={min(recipe.optim.warmup_tokens, tokens * max_steps // 10)}"
                        ] + compile_overrides + overrides + system_set  # the spec's `set:`, then the system's,
                        # last: they may undo the defaults above, and the system's may undo the spec's
                        try:
                            trained = apply_overrides(recipe, run_overrides)
                            trained.train.accumulation()  # the trainer's step rule, here rather than in every worker
                        except NatslError as err:
                            raise _spec_error(path, f"run {run_id}: {err} (in {where})") from None
                        # the cosine schedule ends at max_steps whatever step size the `set:` items chose
                        last = [f"train.total_tokens={trained.train.tokens_per_step * max_steps}", f"train.seed={seed}"]
                        if not lm:  # a language model is evaluated by its validation loss, not a recall grid
                            check_run_eval(evals, apply_overrides(trained, last), run_id, path)
                        runs.append(RunSpec(run_id, system, location, width, lr, task_name, data,
                                            run_overrides + last, max_steps, float(budget.get("run_s", 1e9)),
                                            {} if lm else evals, compile_, device, str(Path(out) / "runs" / run_id),
                                            seed=seed, match=match, env=system_env, kind="lm" if lm else "recall",
                                            tokens_per_step=trained.train.tokens_per_step))
    if len({r.id for r in runs}) != len(runs):
        raise _spec_error(path, "two runs share an id (the same system, width, lr and task twice)")
    deadline = deadline_s if deadline_s is not None else budget.get("deadline_s")  # --deadline wins
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not math.isfinite(deadline) or not deadline > 0):
        raise _spec_error(path, f"the deadline must be a positive number of seconds, got {deadline!r}; "
                                "fix --deadline or budget.deadline_s")
    return Sweep(name, runs, parallel, deadline, float(budget.get("eval_reserve_s", 30)), Path(out), spec,
                 match=match)


def _configured(recipe, items: list[str], system: str, path):
    """`recipe` with the spec's and the system's `set:` items applied (a bad one fails here, in one line)."""
    from natsl.config import apply_overrides

    try:
        return apply_overrides(recipe, items)
    except NatslError as err:
        raise _spec_error(path, f"system {system!r}: {err} (in the spec's or the system's `set:`)") from None


def _recall_step_tokens(recipe, items: list[str], task_len: int, run_id: str, where: str, system: str, path) -> int:
    """The tokens of one step of a recall run: one micro-batch of the task's length."""
    from natsl.config import apply_overrides

    sizes = [item for item in items if item.split("=", 1)[0].strip() == "train.micro_batch_size"]
    try:  # a bad value or combination fails here, not in a worker
        mbs = apply_overrides(recipe, sizes).train.micro_batch_size
    except NatslError as err:
        raise _spec_error(path, f"run {run_id}: {err} (in {where})") from None
    if mbs == "auto":  # the step is one micro-batch: it needs a count
        raise _spec_error(path, f"system {system!r}: its recipe has train.micro_batch_size auto, "
                                "but a sweep's step is one micro-batch; set train.micro_batch_size to a count in `set:`")
    return mbs * task_len  # one micro-batch per step


def budget_steps(budget: dict, tokens_per_step: int, default: int, run_id: str, path) -> int:
    """A run's max_steps: budget.max_steps, else budget.max_tokens in whole steps of `tokens_per_step`,
    else `default` (its recipe's)."""
    if "max_steps" in budget:
        return int(budget["max_steps"])
    if "max_tokens" in budget:
        steps = budget["max_tokens"] // tokens_per_step
        if steps < 1:
            raise _spec_error(path, f"run {run_id}: budget.max_tokens {budget['max_tokens']} is less than one step "
                                    f"({tokens_per_step} tokens); raise budget.max_tokens")
        return int(steps)
    return int(default)


def read_spec(path: Path) -> dict:
    """The spec file's mapping, read as recipes are (natsl.config.load_yaml_file: no key twice, bounded
    aliases, yaml's safe constructors)."""
    from natsl.config import load_yaml_file

    if not path.is_file():
        raise NatslError(f"sweep spec {str(path)!r} does not exist; pass a file such as recipes/recall/sweep_cpu.yaml")
    spec = load_yaml_file(path, f"sweep spec {str(path)!r}")
    if not isinstance(spec, dict):
        raise _spec_error(path, "must be a mapping with systems, widths, lrs, tasks")
    return spec


def system_entries(systems, path) -> dict[str, tuple[str, list[str], dict[str, str]]]:
    """The spec's `systems`: name -> (where its recipe loads from, that system's `set:` items, its `env:`). A
    value is a recipe file (beside the spec) or a shipped recipe's name, or a mapping {recipe: FILE, set: [...],
    env: {NAME: value}} whose `set:` items are applied after the spec's (variants of one recipe without a
    recipe file each) and whose `env:` variables are set for its workers only (natsl's switches and a few
    diagnostics such as NATSL_CHECK_OPS, sweep_checks.check_env; a run's provenance records the ones it reads)."""
    if not isinstance(systems, dict) or not systems:
        raise _spec_error(path, "'systems' must map names to recipe files")
    entries = {}
    for name, value in systems.items():
        check_name(name, "system", path)
        if isinstance(value, str):
            entries[name] = (recipe_location(value, path, name), [], {})
            continue
        if not isinstance(value, dict):
            raise _spec_error(path, f"system {name!r} is {value!r}; give a recipe file, or "
                                    "{recipe: FILE, set: [section.key=value, ...]}")
        unknown = sorted(map(str, set(value) - set(SYSTEM_KEYS)))
        if unknown:
            raise _spec_error(path, f"system {name!r} has unknown key {unknown[0]!r}; allowed: {', '.join(SYSTEM_KEYS)}")
        recipe = value.get("recipe")
        if not isinstance(recipe, str) or not recipe:
            raise _spec_error(path, f"system {name!r} names no recipe file; write {{recipe: natsl_hybrid.yaml, "
                                    "set: [...]}")
        entries[name] = (recipe_location(recipe, path, name), set_items(value.get("set"), f"system {name!r}'s 'set'", path),
                         check_env(value.get("env"), name, path))
    return entries


def set_items(value, where: str, path) -> list[str]:
    """A `set:` list (the spec's, or one system's): section.key=value strings, none of the keys the runner
    sets for every run (RUNNER_KEYS)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _spec_error(path, f"{where} must be a list such as [train.log_every=50], got {value!r}")
    for item in value:
        if not isinstance(item, str) or "=" not in item:
            raise _spec_error(path, f"{where} item {item!r} is not of the form section.key=value "
                                    "(e.g. model.router_keep_target=0.5)")
        key = item.split("=", 1)[0].strip()
        if key in RUNNER_KEYS:
            raise _spec_error(path, f"{where} item {item!r}: the runner sets {key} for every run; "
                                    f"use {RUNNER_KEYS[key]} instead")
    return list(value)


def seed_list(value, path, where: str = "'seeds'") -> list[int]:
    """The spec's `seeds` (default [0]), or one system's: distinct integers, each a valid train.seed."""
    from natsl.seeding import SEED_MAX

    if value is None:
        return [0]
    if not isinstance(value, list) or not value:
        raise _spec_error(path, f"{where} must be a list of integers such as [0, 1, 2], got {value!r}")
    for seed in value:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
            raise _spec_error(path, f"{where} holds {seed!r}; each seed must be an integer from 0 to 2**63-1")
    if len(set(value)) != len(value):
        twice = next(s for s in value if value.count(s) > 1)
        raise _spec_error(path, f"{where} lists seed {twice} twice; list each seed once")
    return list(value)


def system_seed_lists(systems: dict) -> dict:
    """Each system's own `seeds:` as written (None: the spec's), for systems given as mappings (checked by
    system_entries before this is called)."""
    return {name: value.get("seeds") if isinstance(value, dict) else None for name, value in systems.items()}


def check_budget(budget, path) -> tuple[dict, str]:
    """The spec's `budget` mapping, checked, and how its runs are matched: `match:` when given, else
    steps when it gives max_steps (or no run_s), time when it gives run_s alone."""
    budget = {} if budget is None else budget
    if not isinstance(budget, dict):
        raise _spec_error(path, f"'budget' must be a mapping such as {{max_steps: 2000, run_s: 600}}, got {budget!r}")
    unknown = sorted(set(budget) - BUDGET_KEYS)
    if unknown:
        raise _spec_error(path, f"unknown budget key {unknown[0]!r}; allowed: {', '.join(sorted(BUDGET_KEYS))}")
    for key, unit in (("max_steps", "steps"), ("max_tokens", "tokens")):
        count = budget.get(key)
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise _spec_error(path, f"budget.{key} must be a whole number of {unit}, at least 1, got {count!r}")
    if "max_steps" in budget and "max_tokens" in budget:
        raise _spec_error(path, "budget gives both max_steps and max_tokens; keep one")
    for key, least in (("run_s", "more than 0"), ("eval_reserve_s", "at least 0")):
        value = budget.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or not (value > 0 if key == "run_s" else value >= 0)):
            raise _spec_error(path, f"budget.{key} must be a number of seconds, {least}, got {value!r}")
    match = budget.get("match")
    if match is None:
        match = "steps" if {"max_steps", "max_tokens"} & set(budget) or "run_s" not in budget else "time"
    elif match not in MATCHES:
        raise _spec_error(path, f"budget.match must be steps or time, got {match!r}")
    return budget, match


def lr_table(lrs, systems: dict, widths: list[int], path) -> dict[str, dict[int, list[float]]]:
    """The learning rates of every (system, width): `lrs` is one list for all, a mapping width -> list
    for all systems, or a mapping system -> (a list, or a mapping width -> list). A width that a
    mapping by width leaves out is not run for that system (e.g. ablations at one width only)."""

    def rates(value, where: str) -> list[float]:
        if not isinstance(value, list) or not value or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
            raise _spec_error(path, f"'lrs'{where} must be a list of positive numbers")
        return [float(x) for x in value]

    def by_width(value, where: str) -> dict[int, list[float]]:
        if not isinstance(value, dict):
            return {w: rates(value, where) for w in widths}
        for key in value:
            if isinstance(key, bool) or not isinstance(key, int):
                raise _spec_error(path, f"'lrs'{where} has key {key!r}: key it by width (an integer) or by system")
            if key not in widths:
                raise _spec_error(path, f"'lrs'{where} names width {key}, which 'widths' does not list")
        return {w: rates(value[w], f"{where}[{w}]") for w in widths if w in value}

    if isinstance(lrs, dict) and lrs and all(isinstance(k, str) for k in lrs):
        for name in lrs:
            if name not in systems:
                raise _spec_error(path, f"'lrs' names system {name!r}, which 'systems' does not list")
        table = {}
        for name in systems:
            if name not in lrs:
                raise _spec_error(path, f"'lrs' gives no learning rates for system {name!r}; add them")
            table[name] = by_width(lrs[name], f" for {name!r}")
    else:
        table = {name: by_width(lrs, "") for name in systems}
    for name, rows in table.items():
        if not rows:
            raise _spec_error(path, f"'lrs' for {name!r} names none of the widths {widths}")
    return table


def is_task(data: str) -> bool:
    """Whether a spec's task is a synthetic recall task (task:...); anything else is a natsl tokenize folder."""
    from natsl.data.tasks import is_task as task_path

    return task_path(data)


def _task_seq_len(data: str, path) -> int:
    from natsl.data.tasks import parse_task

    return parse_task(data, 1 << 30, 1 << 30).max_len


def width_overrides(recipe, width: int) -> list[str]:
    """`--set` items that scale the recipe's model to hidden size `width` (its dims in proportion)."""
    m = recipe.model
    scale = width / m.hidden_size
    out = []
    for key in SCALED:
        value = getattr(m, key) * scale
        if value < 1 or value != int(value):
            raise NatslError(f"width {width} scales model.{key} = {getattr(m, key)} of {recipe.name} to {value:g}, "
                             "not a whole number; pick widths that divide the recipe's dims")
        out.append(f"model.{key}={int(value)}")
    return out


# ----------------------------------------------------------------------------- running

def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_DEFAULT_PIPE = Path("/tmp/nvidia-mps")  # where the daemon listens when CUDA_MPS_PIPE_DIRECTORY is unset


def mps_skip_reason(sweep: Sweep, env: dict) -> Optional[str]:
    """Why `--mps` starts no daemon for this sweep (None: start one)."""
    if min(sweep.max_parallel, len(sweep.runs)) < 2:
        return "one worker at a time shares nothing"
    if not any(runs_on_cuda(r.device) for r in sweep.runs):
        return "the runs train on the CPU"
    if shutil.which(MPS_CONTROL, path=env.get("PATH")) is None:
        return f"{MPS_CONTROL} is not on the PATH"
    if "CUDA_MPS_PIPE_DIRECTORY" not in env and (MPS_DEFAULT_PIPE / "control").exists():
        return f"an MPS daemon already listens in {MPS_DEFAULT_PIPE}; the workers use it"
    return None


@contextlib.contextmanager
def mps_daemon(sweep: Sweep, env: dict, log=print) -> Iterator[dict]:
    """Start the CUDA MPS control daemon for the sweep's workers and stop it afterwards; yields the
    workers' environment (with the daemon's pipe and log folders). A daemon that will not start is
    reported and the sweep runs without it."""
    reason = mps_skip_reason(sweep, env)
    if reason is not None:
        log(f"--mps: {reason}; no MPS daemon started")
        yield env
        return
    program = shutil.which(MPS_CONTROL, path=env.get("PATH"))
    own = None
    if "CUDA_MPS_PIPE_DIRECTORY" not in env:
        own = Path(tempfile.mkdtemp(prefix="natsl-mps-"))  # short: the pipe is a socket path (108 bytes at most)
        env = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(own / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(own / "log")}
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        if key in env:
            Path(env[key]).mkdir(parents=True, exist_ok=True)
    # Its output goes to a file, not a pipe: a daemon that kept an inherited pipe open would make us wait
    # for the pipe's end until the timeout.
    with tempfile.TemporaryFile("w+") as output:
        try:
            code = subprocess.run([program, "-d"], env=env, stdin=subprocess.DEVNULL, stdout=output,
                                  stderr=subprocess.STDOUT, timeout=30).returncode
        except subprocess.TimeoutExpired:
            code = "no answer in 30 s"
        output.seek(0)
        message = output.read().strip().splitlines()
    if code != 0:
        log(f"--mps: {MPS_CONTROL} -d failed ({message[0] if message else f'exit code {code}'}); "
            "running without starting one")
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        yield env
        return
    log(f"--mps: started the MPS control daemon (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})")
    try:
        yield env
    finally:
        # `quit` waits for the daemon's clients to go; a worker stuck in the driver must not hold the runner
        # here, so it gets a few seconds and the daemon ends on its own once its clients have.
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([program], input="quit\n", env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, text=True, timeout=10)
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def run_sweep(sweep: Sweep, progress: bool = True, log=print, mps: bool = False) -> dict:
    """Run every run of `sweep` (at most max_parallel at once) within its deadline; returns the summary,
    whose `stopped` says what ended the sweep early ("deadline", "SIGTERM", "SIGINT"; None: it finished).
    `mps`: start the CUDA MPS daemon for the workers when several share a GPU (`mps_daemon`). Before any
    worker starts: --out (new, or this spec's own sweep to resume), the devices and the initial weights."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH")]))}
    if sweep.max_parallel < 1:
        raise NatslError(f"--max-parallel must be at least 1, got {sweep.max_parallel}")
    grown = check_out_folder(sweep.out, sweep.name, sweep.spec, [Path(r.out) for r in sweep.runs],
                             [asdict(r) for r in sweep.runs])
    if grown is not None:
        log(f"sweep {sweep.name}: the spec grows the sweep in {sweep.out} by {grown} runs; its earlier runs are kept")
    pending = [r for r in sweep.runs if not _finished(r)]
    check_devices_present({r.device for r in pending})
    check_initial_weights(sweep)
    check_data_folders(pending)
    check_run_memory(pending)
    if not mps:
        return _run_sweep(sweep, env, progress, log)
    with mps_daemon(sweep, env, log) as mps_env:
        return _run_sweep(sweep, mps_env, progress, log)


def check_initial_weights(sweep: Sweep) -> None:
    """Every `train.init_from` of a run still to train names a checkpoint that is there, checked before any
    worker starts: a curriculum whose checkpoints were not carried fails in one line, not in every worker
    after the GPU is held. (Not in load_spec: a spec loads on machines that do not hold its checkpoints.)"""
    from natsl.checkpoint import model_files
    from natsl.config import apply_overrides, load_recipe

    for run in sweep.runs:
        # only runs whose overrides name it (a recipe load each); read as the worker reads it
        if _finished(run) or not any(item.split("=", 1)[0].strip() == "train.init_from" for item in run.overrides):
            continue
        path = apply_overrides(load_recipe(run.recipe), run.overrides).train.init_from
        if path is None:
            continue
        try:
            model_files(path)
        except NatslError as err:
            raise NatslError(f"run {run.id}: train.init_from {path!r} is not a checkpoint ({err}); put the "
                             "checkpoints there (e.g. unpack the recall stage's recall_models_N.tar.gz) or fix the "
                             "spec's set:") from None


def check_data_folders(runs: list[RunSpec]) -> None:
    """Every language-model task of a run still to train names a folder that is there (read as its recipe's
    data.path is, from the working folder), checked before any worker starts."""
    for run in runs:
        if run.kind == "lm" and run.data != "builtin" and not Path(run.data).is_dir():
            raise NatslError(f"task {run.task!r}: data folder {run.data!r} does not exist (from {os.getcwd()}); make it "
                             f"with `natsl tokenize YOUR_TEXT_FILES... --out {run.data} ...` (docs/training.md) or fix "
                             "the spec's tasks")


def check_run_memory(runs: list[RunSpec]) -> None:
    """Every run still to train fits its device's memory alone (natsl.estimate, as `natsl train` checks), checked
    before any worker starts: a spec's `widths: [1000000000]` is one line here, not an out-of-memory traceback
    in a worker's log. Runs beside each other share the device; that the estimate does not count."""
    import torch

    from natsl import estimate as E
    from natsl.config import apply_overrides, load_recipe
    from natsl.runtime import pick_backend
    from natsl.training.micro_batch import cpu_micro_batch

    seen = set()
    for run in runs:
        key = (run.recipe, tuple(run.overrides), run.device)
        if key in seen:
            continue
        seen.add(key)
        try:
            recipe = apply_overrides(load_recipe(run.recipe), run.overrides)
        except NatslError:
            continue  # the spec's checks passed it; its worker says what went wrong since, as before
        device = torch.device(run.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tc = recipe.train
        micro = tc.micro_batch_size if isinstance(tc.micro_batch_size, int) else \
            cpu_micro_batch(max(tc.tokens_per_step // tc.seq_len, 1)) if device.type == "cpu" else 1
        work = E.Work("train", micro, tc.seq_len, calls=1, micro_batches=max(tc.tokens_per_step // (micro * tc.seq_len), 1))
        est = E.estimate(recipe.model, [work], device, backend=pick_backend(None, device),
                         checkpointing=tc.activation_checkpointing is True)
        free = E.available_memory(device)
        if free is not None and est.peak_bytes > E.FIT_SHARE * free:
            raise NatslError(f"run {run.id} (width {run.width}) needs about {E.human_bytes(est.peak_bytes)} of memory "
                             f"at its peak (estimate) but {device} has {E.human_bytes(free)} available; lower the "
                             "spec's widths or its train.micro_batch_size")


def exit_code(summary: Optional[dict]) -> int:
    """The runner's exit code: 128 + the signal that stopped it (143 SIGTERM, 130 SIGINT), else 1 when a run
    failed (its worker said so in result.json, or ended with an error of its own), else 0. Runs that the
    deadline cut off or left unstarted are no failure: they are the budget's."""
    summary = summary or {}
    stopped = summary.get("stopped") or ""
    if stopped.startswith("SIG"):
        return 128 + signal.Signals[stopped]
    return 1 if any(r.get("status") == "failed" or r.get("failed") for r in summary.get("runs", ())) else 0


def _run_sweep(sweep: Sweep, env: dict, progress: bool, log) -> dict:
    from tqdm import tqdm

    from natsl.training.trainer import stop_signals

    start = sweep.clock()
    end = start + sweep.deadline_s if sweep.deadline_s else None
    sweep.out.mkdir(parents=True, exist_ok=True)
    _write_json(sweep.out / "sweep.json", {"name": sweep.name, "spec": sweep.spec, "started": start,
                                          "deadline": end, "runs": [asdict(r) for r in sweep.runs]})
    pending = [r for r in sweep.runs if not _finished(r)]
    log(f"sweep {sweep.name}: {len(sweep.runs)} runs ({len(sweep.runs) - len(pending)} done already, {len(pending)} "
        f"to run), at most {sweep.max_parallel} at once, matched in {sweep.match}")
    warning = crowding_warning(sweep, pending)
    if warning:
        log(warning)
    running: dict[str, tuple[subprocess.Popen, RunSpec, Any]] = {}
    skipped: list[str] = []
    killed: dict[str, str] = {}
    failed: dict[str, str] = {}
    stopped = None

    heard: list[str] = []

    def on_signal(name: str) -> None:  # the second signal: no grace, no new summary (the last one stands)
        heard.append(name)
        if len(heard) > 1:
            for proc, _, _ in running.values():
                _signal_group(proc, signal.SIGKILL)
            os._exit(128 + signal.Signals[name])

    # SIGTERM / SIGINT set asked["signal"], which the loop reads (the trainer's handling, there per step)
    with stop_signals(True, on_signal) as asked:
        bar = tqdm(total=len(sweep.runs), initial=len(sweep.runs) - len(pending), unit="run", desc="sweep",
                   disable=not progress, dynamic_ncols=True)
        write_summary(sweep)  # at once, so that even a runner killed with SIGKILL leaves one
        try:
            while pending or running:
                if asked["signal"] or (end is not None and sweep.clock() >= end):
                    stopped = asked["signal"] or "deadline"
                    break
                while pending and len(running) < sweep.max_parallel:
                    run = pending.pop(0)
                    if end is not None and end - sweep.clock() < sweep.eval_reserve_s + sweep.min_train_s:
                        skipped.append(run.id)  # no time left to train and evaluate it
                        continue
                    run.train_deadline, run.deadline = (end - sweep.eval_reserve_s, end) if end else (None, None)
                    running[run.id] = _launch(run, env)
                for run_id, (proc, run, fh) in list(running.items()):
                    if proc.poll() is not None:
                        _signal_group(proc, signal.SIGKILL)  # whatever the worker started and left behind
                        fh.close()
                        del running[run_id]
                        status = _status(run)
                        late = end is not None and sweep.clock() >= end  # its own watchdog ended it at the deadline
                        if proc.returncode != 0 and status != "done" and not late:
                            failed[run_id] = _exit_reason(proc.returncode)
                            status = f"{status}, failed ({failed[run_id]}; see {Path(run.out) / 'log.txt'})"
                        bar.update(1)
                        bar.write(f"{run_id}: {status}")
                        write_summary(sweep, skipped, failed=failed)
                time.sleep(0.2)
        finally:  # the deadline, a signal, or an error in the runner: the workers go first, whatever they do
            if running:
                why = stopped or "the runner failed"
                # said before the grace: a second signal now ends the workers and the runner at once
                log(f"{why}: stopping {len(running)} workers (SIGTERM, SIGKILL after {sweep.grace_s:g} s; "
                    "a second Ctrl-C kills them at once)")
                stop_workers([proc for proc, _, _ in running.values()], sweep.grace_s)
                for run_id, (proc, run, fh) in running.items():
                    fh.close()
                    killed[run_id] = why
                    bar.write(f"{run_id}: killed ({why})")
                running.clear()
            bar.close()
        skipped.extend(r.id for r in pending)
        if skipped:
            log(f"not started (no time left before the deadline): {len(skipped)} runs")
        summary = write_summary(sweep, skipped, killed, stopped, failed)
    failures = sum(1 for r in summary["runs"] if r["status"] == "failed" or r.get("failed"))
    log(f"wrote {sweep.out / 'summary.json'} and {sweep.out / 'summary.png'} "
        f"({sum(1 for r in summary['runs'] if r['status'] == 'done')} of {len(sweep.runs)} runs done"
        f"{f', {failures} failed (see their log.txt)' if failures else ''}, "
        f"{sweep.clock() - start:.0f} s{f', stopped by {stopped}' if stopped else ''})")
    return summary


def crowding_warning(sweep: Sweep, pending: list[RunSpec]) -> Optional[str]:
    """A one-line warning when more than CROWDED workers would share one GPU at once (None: not so)."""
    per_gpu: dict[str, int] = {}
    for run in pending:
        if runs_on_cuda(run.device):
            gpu = run.device if run.device and ":" in run.device else "cuda:0"
            per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    at_once = max((min(sweep.max_parallel, n) for n in per_gpu.values()), default=0)
    if at_once <= CROWDED:
        return None
    cost = ("runs matched in steps may reach budget.run_s first and come out short" if sweep.match == "steps"
            else "runs matched in time get far fewer steps")
    return (f"warning: {at_once} workers share one GPU at once (more than {CROWDED}); each steps slower and "
            f"{cost}; lower --max-parallel")


def _exit_reason(code: int) -> str:
    """How a worker ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _finished(run: RunSpec) -> bool:
    return _status(run) == "done"


def _status(run: RunSpec) -> str:
    result = _read_json(Path(run.out) / "result.json")
    return result.get("status", "unknown") if result else "no result"


# + RUN.json: the command of one run. Not `python -m`, which puts the working folder first on sys.path (a spec's
# folder, often): the worker imports natsl and torch from the runner's PYTHONPATH and site-packages only.
WORKER = [sys.executable, "-c", "import runpy, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
          "runpy.run_module('natsl.cli.sweep', run_name='__main__', alter_sys=True)"]


def _launch(run: RunSpec, env: dict) -> tuple[subprocess.Popen, RunSpec, Any]:
    folder = Path(run.out)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "run.json", asdict(run))
    fh = open(folder / "log.txt", "a", encoding="utf-8")
    # its own session and process group: stop_workers signals the worker with everything it starts; its
    # system's env: passes the spec's check again here, whoever built the RunSpec
    proc = subprocess.Popen([*WORKER, str(folder / "run.json")], stdin=subprocess.DEVNULL, stdout=fh,
                            stderr=subprocess.STDOUT, env={**env, **check_env(run.env, run.system, folder / "run.json")},
                            start_new_session=True)
    return proc, run, fh


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    until = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < until:
        time.sleep(0.05)


def stop_workers(procs: list[subprocess.Popen], grace_s: float = 3.0, wait_s: float = 5.0) -> None:
    """End workers and whatever they started: SIGTERM to every worker's process group at once, SIGKILL to
    the groups after `grace_s`, then at most `wait_s` more for them to be gone. Never longer: a process
    stuck in the GPU driver dies when the driver lets it go, and the runner does not wait for that."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    _wait_all(procs, grace_s)
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)  # also a group whose leader has gone and left children
    _wait_all(procs, wait_s)


def _read_json(path: Path) -> Optional[dict]:
    """A run's result.json as its worker wrote it; None when missing, unreadable or not a JSON object (read
    through natsl.files.read_json: bounded, FIFO-safe, any nesting), as for a run that never wrote one."""
    try:
        data = read_json(path, "run the sweep again")
    except (OSError, NatslError):
        return None
    return data if isinstance(data, dict) else None


# ----------------------------------------------------------------------------- summary

def run_record(run: RunSpec) -> dict:
    """What is known about one run: its result.json, else what its metrics.jsonl holds. `short`: a run
    matched in steps that stopped (budget.run_s, the deadline, a signal) before its max_steps."""
    folder = Path(run.out)
    base = {"id": run.id, "system": run.system, "width": run.width, "lr": run.lr, "task": run.task,
            "seed": run.seed, "max_steps": run.max_steps, "kind": run.kind}
    result = _read_json(folder / "result.json")
    if result:  # its provenance stays in result.json (the same for every run of a sweep, mostly)
        record = {**base, **{key: value for key, value in result.items() if key != "provenance"}}
    else:
        metrics = folder / "train" / "metrics.jsonl"
        records = read_json_records(metrics) if metrics.is_file() else []
        evals = [r for r in records if "val_accuracy" in r]
        steps = [r for r in records if "loss" in r]
        record = {**base, "status": "cut off" if records else "not run", "steps": steps[-1]["step"] if steps else 0,
                  "val_accuracy": evals[-1]["val_accuracy"] if evals else None, "recall_accuracy": None}
        if run.kind == "lm":
            record.update(validation_of(records, run.tokens_per_step))
    steps = record.get("steps")
    record["short"] = bool(run.match == "steps" and isinstance(steps, int) and 0 < steps < run.max_steps)
    return record


def _finite(value) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def score(record: dict) -> Optional[float]:
    """The accuracy a run is ranked by: its recall evaluation, else its last validation accuracy."""
    for key in ("recall_accuracy", "val_accuracy"):
        value = _finite(record.get(key))
        if value is not None:
            return value
    return None


def finished_score(record: dict) -> Optional[float]:
    """The recall accuracy of a finished run (trained and evaluated on the whole grid), else None."""
    return _finite(record.get("recall_accuracy")) if record.get("status") == "done" else None


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def seed_point(records: list[dict]) -> Optional[dict]:
    """The runs of one (task, system, width, lr), one per seed, as one point: the mean, min and max over
    the seeds that finished (the others are missing, not zero). When none has finished, over the seeds'
    last validation accuracies instead (`accuracy_from: validation`). None: no seed has any score."""
    finished = [r for r in records if finished_score(r) is not None]
    value = finished_score if finished else score
    counted = [r for r in records if value(r) is not None]
    if not counted:
        return None
    accuracies = [value(r) for r in counted]
    keeps = [k for k in (_finite(r.get("keep_fraction")) for r in finished) if k is not None]
    mean = _mean(accuracies)
    return {"best_lr": records[0]["lr"], "accuracy": mean, "accuracy_min": min(accuracies),
            "accuracy_max": max(accuracies), "accuracy_from": "recall" if finished else "validation",
            "recall_accuracy": mean if finished else None,
            "val_accuracy": _mean([v for v in (_finite(r.get("val_accuracy")) for r in records) if v is not None]),
            "keep_fraction": _mean(keeps), "parameters": next((r["parameters"] for r in records if r.get("parameters")), None),
            "run": counted[0]["id"], "seeds_finished": len(finished), "seeds_total": len(records),
            "short": sum(r["short"] for r in counted),
            "seeds": [{"seed": r["seed"], "accuracy": value(r), "steps": r.get("steps"), "short": r["short"],
                       "status": r["status"], "run": r["id"]} for r in records]}


def best_points(records: list[dict]) -> list[dict]:
    """Per (task, system, width), the learning rate whose seeds score best on average: rates with a
    finished seed before rates without; the first rate listed wins a tie."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for r in records:
        groups.setdefault((r["task"], r["system"], r["width"]), {}).setdefault(r["lr"], []).append(r)
    points = []
    for (task, system, width), by_lr in sorted(groups.items()):
        best, rank = None, None
        for seeds in by_lr.values():
            point = seed_point(seeds)
            if point is None:
                continue
            mine = (point["accuracy_from"] == "recall", point["accuracy"])
            if best is None or mine > rank:
                best, rank = point, mine
        if best is not None:
            points.append({"task": task, "system": system, "width": width, **best})
    return points


def write_summary(sweep: Sweep, skipped: Optional[list[str]] = None, killed: Optional[dict[str, str]] = None,
                  stopped: Optional[str] = None, failed: Optional[dict[str, str]] = None) -> dict:
    """Rebuild OUT/summary.json and OUT/summary.png from whatever the runs have written. `killed`: run id
    -> why the runner killed it; `stopped`: what ended the sweep early (None: nothing, or not yet);
    `failed`: run id -> how its worker ended with an error of its own (exit_code counts them)."""
    records = [run_record(r) for r in sweep.runs]
    for r in records:
        if skipped and r["id"] in skipped and r["status"] == "not run":
            r["status"] = "skipped (deadline)"
        if killed and r["id"] in killed:
            r["killed"] = killed[r["id"]]
        if failed and r["id"] in failed:
            r["failed"] = failed[r["id"]]
    recall = [r for r in records if r.get("kind", "recall") == "recall"]
    lm = [r for r in records if r.get("kind") == "lm"]
    summary = {"name": sweep.name, "stopped": stopped, "match": sweep.match,
               "seeds": list(dict.fromkeys(r.seed for r in sweep.runs)), "runs": records, "best": best_points(recall),
               "note": "accuracy: the mean over the seeds that finished (seeds_finished of seeds_total; the others "
                       "are missing, not zero) of the MQAR answer accuracy over the eval grid, min and max beside "
                       "it; when no seed of a point finished, of their last validation accuracies (accuracy_from); "
                       "best_lr: the learning rate of the best mean. short: seeds that stopped before max_steps "
                       "in a sweep matched in steps"}
    if lm:
        summary["best_lm"] = best_lm_points(lm)
        summary["note_lm"] = LM_NOTE
    _write_json(sweep.out / "summary.json", summary)
    if lm and not recall:
        plot_lm_summary(summary, sweep.out / "summary.png")
    else:
        plot_summary(summary, sweep.out / "summary.png")
        if lm:  # a spec with both kinds of task: the language-model figure beside it
            plot_lm_summary(summary, sweep.out / "summary_lm.png")
    return summary


def plot_summary(summary: dict, path: Path) -> None:
    """Zoology's figure: accuracy vs model width per system (best LR per point, the mean over seeds with
    min-max bars; points with a short seed or ranked by validation accuracy are labelled), beside it the
    NAtS-L systems' kept fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({p["task"] for p in summary["best"]}) or ["(no results yet)"]
    colors = {name: f"C{i}" for i, name in enumerate(sorted({p["system"] for p in summary["best"]}))}
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.8 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        points = [p for p in summary["best"] if p["task"] == task]
        ax, kx = axes[row]
        for system in sorted({p["system"] for p in points}):
            mine = sorted((p for p in points if p["system"] == system), key=lambda p: p["width"])
            widths = [p["width"] for p in mine]
            means = [p["accuracy"] for p in mine]
            bars = [[p["accuracy"] - p.get("accuracy_min", p["accuracy"]) for p in mine],
                    [p.get("accuracy_max", p["accuracy"]) - p["accuracy"] for p in mine]]
            ax.errorbar(widths, means, yerr=bars, fmt="o-", capsize=3, label=system, color=colors[system])
            for p in mine:  # say which points do not compare like the others
                label = ", ".join(x for x in ("short" if p.get("short") else "",
                                              "val. acc." if p.get("accuracy_from") == "validation" else "") if x)
                if label:
                    ax.annotate(label, (p["width"], p["accuracy"]), textcoords="offset points", xytext=(4, -10),
                                fontsize=7, color=colors[system])
            keeps = [(p["width"], p["keep_fraction"]) for p in mine if p["keep_fraction"] is not None]
            if keeps:
                kx.plot(*zip(*keeps), "o-", label=system, color=colors[system])
        seeds = len(summary.get("seeds") or [0])
        for a, ylabel in ((ax, f"accuracy (best lr{f', mean of {seeds} seeds' if seeds > 1 else ''})"),
                          (kx, "kept fraction (softmax KV)")):
            a.set_xscale("log", base=2)
            a.set_xlabel("model width")
            a.set_ylabel(ylabel)
            a.set_ylim(-0.03, 1.03)
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=8)
        ax.set_title(f"{task}: recall accuracy")
        kx.set_title(f"{task}: NAtS-L kept fraction")
    fig.suptitle(f"{summary['name']} (matched in {summary.get('match', 'time')})")
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m natsl.training.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="sweep spec YAML, e.g. recipes/recall/sweep_h200.yaml")
    parser.add_argument("--out", required=True, help="folder for runs/, summary.json and summary.png")
    parser.add_argument("--max-parallel", type=int, default=None, help="worker processes at once (default: the spec's)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole sweep (default: the spec's budget.deadline_s); at it every worker is killed")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the spec's, else cuda when there is one)")
    parser.add_argument("--mps", action="store_true",
                        help=f"start the CUDA MPS daemon ({MPS_CONTROL} -d) while several workers share a GPU")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        sweep = load_spec(args.spec, args.out, args.max_parallel, args.deadline, args.device)
        summary = run_sweep(sweep, progress=not args.no_progress, mps=args.mps)
    except NatslError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return exit_code(summary)


if __name__ == "__main__":
    sys.exit(main())
