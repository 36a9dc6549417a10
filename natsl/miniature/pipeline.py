"""`natsl miniature`: the paper in miniature, from text to tables, as one resumable command.

Stages, each a natsl command run as a subprocess (so that each is exactly what a user would type, and a
killed stage resumes as that command does):

    corpus  natsl tokenize (the local corpus of docs/training.md, "A corpus from local files") -> DATA
    sweep   natsl sweep: every system of recipes/mini (and the three Table 4 ablations of the NAtS-L Hybrid)
            at each learning rate of --lrs, --sweep-tokens each                      -> OUT/sweep
    train   natsl sweep: the ladder at each system's best rate, --train-tokens each, the NAtS-L Hybrid
            over --seeds                                                               -> OUT/train
    eval    the paper's evaluations with natsl's commands (natsl.miniature.evaluate)  -> OUT/eval
    report  tables, plots and the claims checked against the numbers (natsl.miniature.report) -> OUT/report

Every stage skips what is done, so the same command again continues where a deadline, a kill or a lost
machine stopped it (the sweep runner resumes runs from their checkpoints). The specs the sweep and train
stages run are written to OUT/specs/, readable and runnable on their own with `natsl sweep`.

Choices the paper does not fix at this size (docs/miniature.md):
- GDN + SWA (the compare baseline, not one of the six systems) is not swept: it trains at the GDN Hybrid's
  best rate, the same network but for the window.
- The ablations are compared at the sweep's length, each at its own best rate, against the NAtS-L Hybrid's
  best sweep run: a learning-rate sweep per variant, as for every system, at a fraction of the full cost.
- Runs train eagerly (no torch.compile) with a micro-batch of --micro-batch (accumulated to the recipes'
  64K-token steps): many small workers share one GPU under MPS, and none waits for Inductor.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from natsl.errors import NatslError
from natsl.miniature.ladder import ABLATIONS, LADDER, RATE_OF, SWEPT, natsl_command

STAGES = ("corpus", "sweep", "train", "eval", "report")
# the eval stage's job families (natsl.miniature.evaluate): a job is named FAMILY or FAMILY_CHECKPOINT
EVALS = ("ppl", "compare", "latency", "routing", "ruler", "lm_eval")
REPORT_RESERVE_S = 30.0  # with --eval-reserve: the eval stage ends this long before the deadline, for the report

# The local corpus of a GPU host (docs/training.md, "A corpus from local files"): sources and docs installed.
CORPUS_INPUTS = ("{purelib}", "/usr/lib/python3*", "/usr/include", "/usr/local/cuda*/include", "/usr/share/doc",
                 "/usr/share/man")
CORPUS_PATTERNS = ("*.py", "*.h", "*.hpp", "*.cuh", "*.c", "*.cc", "*.cpp", "*.cu", "*.md", "*.rst", "*.txt",
                   "README*", "copyright", "*.gz")


@dataclass
class MiniatureOptions:
    """What `natsl miniature` runs. Paths are read from the working folder, as recipes' data.path are.

    Args:
        out: the miniature's folder (specs/, sweep/, train/, eval/ with its checkpoints.json, report/).
        data: the corpus, a `natsl tokenize` folder; built by the corpus stage when it has no meta.json.
        corpus_inputs / corpus_patterns: what the corpus stage tokenizes (files, folders, globs; --include).
        vocab_size: the trained BPE's vocabulary (the recipes' model.vocab_size).
        val_fraction: the share of documents held out for validation (whole files).
        tokenizer_train_docs: the BPE trains on the first N documents (None: all; the longest step).
        tokenizer: a tokenizer.json (or a folder holding one) the corpus stage uses instead of training a BPE,
            e.g. the data/mini/tokenizer.json of an earlier build: the same corpus without the BPE's minutes. Its
            vocabulary must fit the recipes' model.vocab_size (32000; else --set model.vocab_size=N).
        lrs: the sweep's learning rates (every system, every ablation).
        sweep_tokens / train_tokens: tokens a sweep run / a full run trains (each cosine schedule ends there).
        seeds: the train stage's seeds of the seed_systems (every other system trains seed 0).
        seed_systems: the systems (LADDER names) trained over `seeds`: the NAtS-L Hybrid by default, every
            system for a comparison whose baselines' spread over seeds is measured too (runs SYSTEM_sN).
        rates: system (a SWEPT name) -> the learning rate the train stage gives it in place of the sweep's best:
            rates found by a sweep elsewhere (docs/miniature.md's table), so that training needs no sweep folder;
            a system it leaves out takes the sweep's.
        systems: the ladder's systems the sweep and train stages run (LADDER names); the sweep runs what their
            rates need (GDN + SWA's is the GDN Hybrid's) and the ablations only with the NAtS-L Hybrid. A subset
            is for a budget that cannot hold the whole ladder: the report shows what was trained.
        micro_batch: sequences per micro-batch (the step stays the recipe's 64K tokens, accumulated).
        sweep_micro_batch: the sweep stage's micro-batch (None: micro_batch); a sweep folder grown by more
            rates keeps the micro-batch its runs had.
        max_parallel: training workers at once (None: from the GPU's memory).
        device: cpu or cuda (None: cuda when there is one).
        deadline_s: seconds for this command; at it the running stage stops resumably.
        eval_reserve_s: with deadline_s, the seconds kept for the eval and report stages: the sweep and train
            stages stop that long before the deadline, and a train stage stopped so goes on to the evaluations
            of the runs as they are (the report says which were cut short; the next call resumes training and
            evaluates the new checkpoints again). None: a stopped stage ends the command.
        stages: the stages to run, in STAGES order.
        evals: the eval stage's job families to run (EVALS names); the others are left as they are.
        sets: section.key=value items for every run (after the pipeline's own), e.g. a smaller model.
        recipes: the folder of the ladder's recipes.
        compile: torch.compile + CUDA graphs in the training workers.
        quick: the evaluations' small settings (a smoke run).
    """
    out: Path = Path("runs/miniature")
    data: Path = Path("data/mini")
    corpus_inputs: tuple = CORPUS_INPUTS
    corpus_patterns: tuple = CORPUS_PATTERNS
    vocab_size: int = 32000
    val_fraction: float = 0.005
    tokenizer_train_docs: Optional[int] = 30000
    tokenizer: Optional[Path] = None
    lrs: tuple = (0.001, 0.002, 0.004, 0.008)
    sweep_tokens: int = 10_000_000
    train_tokens: int = 100_000_000
    seeds: tuple = (0, 1, 2)
    seed_systems: tuple = ("natsl_hybrid",)
    rates: dict = field(default_factory=dict)
    systems: tuple = LADDER
    micro_batch: int = 8
    sweep_micro_batch: Optional[int] = None
    max_parallel: Optional[int] = None
    device: Optional[str] = None
    deadline_s: Optional[float] = None
    eval_reserve_s: Optional[float] = None
    stages: tuple = STAGES
    evals: tuple = EVALS
    sets: tuple = ()
    recipes: Path = field(default_factory=lambda: _recipes_folder())
    compile: bool = False
    quick: bool = False


def _recipes_folder() -> Path:
    from natsl.config import recipes_root

    return Path(recipes_root()) / "mini"


def corpus_command(opts: MiniatureOptions) -> list[str]:
    """The `natsl tokenize` command of the corpus stage (docs/training.md's, with this Python's site-packages)."""
    import sysconfig

    inputs = [i.format(purelib=sysconfig.get_paths()["purelib"]) for i in opts.corpus_inputs]
    includes = [arg for pattern in opts.corpus_patterns for arg in ("--include", pattern)]
    if opts.tokenizer is not None:
        tokenizer = ["--tokenizer", str(opts.tokenizer)]
    else:
        tokenizer = ["--train-tokenizer", "--vocab-size", str(opts.vocab_size),
                     *(["--tokenizer-train-docs", str(opts.tokenizer_train_docs)] if opts.tokenizer_train_docs else [])]
    return natsl_command("tokenize", *inputs, *includes, "--skip-bad-files", "--dedup", "--val-fraction", str(opts.val_fraction),
                         "--val-texts", *tokenizer, "--out", str(opts.data))


def default_parallel(device: Optional[str]) -> int:
    """Workers at once: about one per 6 GiB of GPU memory (a mini model at micro-batch 8 peaks at a few
    GiB, eager), at most 32; 2 on the CPU."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return 2
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return max(1, min(32, int(total // 6)))


def swept_systems(opts: MiniatureOptions) -> list[str]:
    """The sweep's systems for opts.systems, in spec order: the SWEPT ones whose rates they need (GDN + SWA
    needs the GDN Hybrid's), then the ablations where the NAtS-L Hybrid is among them."""
    needed = {RATE_OF.get(name, name) for name in opts.systems}
    return [name for name in SWEPT if name in needed] + (list(ABLATIONS) if "natsl_hybrid" in opts.systems else [])


def sweep_spec(opts: MiniatureOptions) -> dict:
    """The sweep stage's spec: every swept system and ablation at every rate, sweep_tokens each. Recipes are
    named recipes/NAME.yaml, beside the spec (the runner reads recipes only there: copy_recipes)."""
    systems = {name: ({"recipe": "recipes/natsl_hybrid.yaml", "set": list(ABLATIONS[name])} if name in ABLATIONS
                      else f"recipes/{name}.yaml") for name in swept_systems(opts)}
    # four validations a run, of half a million tokens (a tenth of the run's compute at most), the last at its end
    return _spec("mini_sweep", systems, list(opts.lrs), opts.sweep_tokens, opts, evals=4, eval_tokens=524288,
                 micro_batch=opts.sweep_micro_batch or opts.micro_batch)


def best_rates(sweep_summary: dict) -> dict[str, float]:
    """system -> its best learning rate from a sweep's summary.json (`best_lm`)."""
    return {point["system"]: float(point["best_lr"]) for point in sweep_summary.get("best_lm") or []}


def train_spec(opts: MiniatureOptions, rates: dict[str, float]) -> dict:
    """The train stage's spec: the ladder (opts.systems of it) at each system's best rate, train_tokens each;
    opts.seed_systems over opts.seeds.

    Raises:
        NatslError: a system without a best rate (its sweep runs have no validation loss).
    """
    systems: dict = {}
    lrs = {}
    for name in (n for n in LADDER if n in opts.systems):
        source = RATE_OF.get(name, name)
        if source not in rates:
            raise NatslError(f"the sweep has no validation loss for {source}; run the sweep stage to its end "
                             f"(natsl miniature --stages sweep) before training, or give its rate: --rates {source}=0.002")
        recipe = f"recipes/{name}.yaml"
        systems[name] = {"recipe": recipe, "seeds": list(opts.seeds)} if name in opts.seed_systems else recipe
        lrs[name] = [rates[source]]
    return _spec("mini_train", systems, lrs, opts.train_tokens, opts, evals=8, eval_tokens=None)


def _spec(name: str, systems: dict, lrs, tokens: int, opts: MiniatureOptions, evals: int,
          eval_tokens: Optional[int], micro_batch: Optional[int] = None) -> dict:
    """A spec of the ladder's recipes: `evals` validations a run (the recipes' eval_tokens, or these), a
    checkpoint a quarter of the way (a deadline writes one too), `micro_batch` (None: opts.micro_batch)
    sequences a micro-batch, opts.sets last."""
    steps = max(1, tokens // 65536)
    sets = [f"train.micro_batch_size={micro_batch or opts.micro_batch}", f"train.eval_every={max(1, steps // evals)}",
            f"train.save_every={max(1, steps // 4)}", *([f"train.eval_tokens={eval_tokens}"] if eval_tokens else []),
            *opts.sets]
    spec = {"name": name, "systems": systems, "lrs": lrs, "tasks": {"mini": str(opts.data)},
            "budget": {"max_tokens": int(tokens)}, "set": sets, "compile": bool(opts.compile)}
    if opts.device:
        spec["device"] = opts.device
    return spec


def finished_runs(summary: dict, failed_final: bool = True) -> tuple[int, int]:
    """(runs finished, runs in all) of a sweep's summary.json. A run is finished when done, and with
    `failed_final` also when it failed: within one command a failure is final (the next stage goes on without
    it), while the next command tries it again (natsl sweep reruns every run not done)."""
    runs = summary.get("runs") or []
    return sum(r.get("status") == "done" or (failed_final and bool(r.get("failed"))) for r in runs), len(runs)


def checkpoint_folders(root: Path) -> dict[str, str]:
    """Name -> training run folder of every model with weights: the train stage's runs (the NAtS-L Hybrid's
    seeds as natsl_hybrid_s1, ...; done or stopped with a checkpoint) and each ablation's best sweep run. A run
    whose folder holds no checkpoints/ (results copied off a machine without the weights) is left out: there
    is nothing to evaluate."""
    from natsl.files import resolve_inside

    def run_folder(stage: str, run_id) -> Path:  # a run id read from a summary names a folder of its runs/
        runs = root / stage / "runs"
        return resolve_inside(runs, run_id, f"{root / stage / 'summary.json'}'s run",
                              fix=f"remove {root / stage} and run natsl miniature again") / "train"

    found: dict[str, str] = {}
    train = _summary(root / "train")
    for r in (train or {}).get("runs") or []:
        folder = run_folder("train", r["id"])
        if (folder / "checkpoints").is_dir():
            found[r["system"] + (f"_s{r['seed']}" if r.get("seed") else "")] = str(folder)
    sweep = _summary(root / "sweep") or {}
    for point in sweep.get("best_lm") or []:
        if point["system"] in ABLATIONS and point.get("run"):
            folder = run_folder("sweep", point["run"])
            if (folder / "checkpoints").is_dir():
                found[point["system"]] = str(folder)
    return found


def _summary(folder: Path) -> Optional[dict]:
    path = folder / "summary.json"
    if not path.is_file():
        return None
    from natsl.files import read_json

    return read_json(path, f"remove {folder} and run natsl miniature again")


def check_sets(opts: MiniatureOptions) -> None:
    """NatslError (one line) when an item of --set does not apply to every system of the ladder that will train,
    said before the corpus stage's minutes of tokenizing rather than when the sweep's spec is checked."""
    from natsl.config import apply_overrides, load_recipe
    from natsl.errors import NatslError

    if not opts.sets:
        return
    for name in opts.systems or LADDER:
        source = opts.recipes / f"{name}.yaml"
        if source.is_file():
            try:
                apply_overrides(load_recipe(str(source)), list(opts.sets))
            except NatslError as err:
                raise NatslError(f"--set does not fit the {name} recipe: {err}") from None


def copy_recipes(opts: MiniatureOptions, folder: Path) -> None:
    """Copy the ladder's recipes to folder/recipes/ (the specs beside them read them there), as they are:
    a later edit of recipes/mini does not change a miniature under way."""
    from natsl.atomic import write_text
    from natsl.errors import NatslError

    for name in LADDER:
        source = opts.recipes / f"{name}.yaml"
        if not source.is_file():
            raise NatslError(f"recipe {source} does not exist; pass the folder of the mini recipes (recipes/mini)")
        target = folder / "recipes" / f"{name}.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.is_file():
            write_text(target, source.read_text(encoding="utf-8"))


def _spec_text(spec: dict) -> str:
    import yaml

    return ("# written by natsl miniature (natsl.miniature.pipeline); natsl sweep runs it alone too\n"
            + yaml.safe_dump(spec, sort_keys=False))


def _write_spec(path: Path, spec: dict) -> Path:
    from natsl.atomic import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, _spec_text(spec))


class Stopped(Exception):
    """The deadline came before a stage finished; the same command again continues."""


def run_miniature(opts: MiniatureOptions, log: Callable[[str], None] = print) -> dict:
    """Run the stages of opts.stages in order, each skipping what is done.

    Returns:
        {"stages": {stage: "done" | "stopped" | "skipped"}, "checkpoints": {name: run folder},
         "report": path of report.md or None}.
    """
    start = time.monotonic()
    check_sets(opts)

    def left() -> Optional[float]:
        return None if opts.deadline_s is None else opts.deadline_s - (time.monotonic() - start)

    status: dict[str, str] = {}
    result = {"stages": status, "checkpoints": {}, "report": None}
    for stage in STAGES:
        if stage not in opts.stages:
            status[stage] = "skipped"
            continue
        remaining = left()
        if remaining is not None and opts.eval_reserve_s:  # the time kept for what comes after this stage
            remaining -= opts.eval_reserve_s if stage in ("sweep", "train") else REPORT_RESERVE_S if stage == "eval" else 0
        # with a reserve, training cut short is still evaluated and reported
        go_on = bool(opts.eval_reserve_s) and stage in ("train", "eval")
        if remaining is not None and remaining < 20:
            status[stage] = "stopped"
            log(f"miniature: the deadline leaves no time for the {stage} stage; run the same command again")
            if go_on:
                continue
            break
        log(f"miniature: {stage} stage" + ("" if remaining is None else f" ({remaining:.0f} s left)"))
        try:
            STAGE_RUNNERS[stage](opts, remaining, log, result)
        except Stopped as why:
            status[stage] = "stopped"
            log(f"miniature: {why}; run the same command again to continue"
                + ("; evaluating the runs as they are" if go_on and stage == "train" else ""))
            if go_on:
                continue
            break
        status[stage] = "done"
    result["checkpoints"] = checkpoint_folders(opts.out)
    return result


def _run(argv: list[str], log_path: Path, log) -> int:
    """Run one natsl command, its output to the terminal and to log_path (appended)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log("  $ " + " ".join(argv[2:]))
    with open(log_path, "a", encoding="utf-8") as sink:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
        return proc.wait()


def _stage_corpus(opts: MiniatureOptions, remaining, log, result) -> None:
    if (opts.data / "meta.json").is_file():
        log(f"  {opts.data} holds a corpus (meta.json): kept")
        return
    code = _run(corpus_command(opts), opts.out / "logs" / "corpus.log", log)
    if code:
        raise NatslError(f"natsl tokenize exited with {code} (log: {opts.out / 'logs' / 'corpus.log'})")


def _sweep_stage(name: str, spec: dict, opts: MiniatureOptions, remaining, log) -> dict:
    """Run one sweep spec to its end or the deadline; its summary."""
    folder = opts.out / name
    spec_path = opts.out / "specs" / f"{name}.yaml"
    previous = _summary(folder)
    same_spec = spec_path.is_file() and spec_path.read_text(encoding="utf-8") == _spec_text(spec)
    if previous is not None and not same_spec:
        # natsl sweep keeps a finished run by its id, which does not name every setting: runs of another spec
        # (other --sweep-tokens, --train-tokens, --set, --micro-batch) would be taken as this one's. A spec
        # that only adds rates, systems or seeds grows the stage (natsl sweep checks each kept run's settings too).
        why = _grows(folder, spec)
        if why is not None:
            raise NatslError(f"{folder} holds runs of another spec than {spec_path} now asks for ({why}: --lrs, "
                             f"--seeds, --sweep-tokens, --train-tokens, --micro-batch or --set changed); pass another "
                             f"--out, or remove {folder} to run the stage again (more --lrs, --systems or seeds alone grow it)")
        log(f"  {folder}: the spec adds learning rates, systems or seeds; its finished runs are kept")
    done, total = finished_runs(previous or {}, failed_final=False)
    if same_spec and done == total > 0:  # a grown spec's new runs are not in the summary yet
        log(f"  {folder}: all {total} runs done: kept")
        return previous
    failed = finished_runs(previous or {})[0] - done
    if failed:
        log(f"  {folder}: {failed} failed run(s) of an earlier command: trying them again")
    copy_recipes(opts, opts.out / "specs")
    spec_path = _write_spec(spec_path, spec)
    parallel = opts.max_parallel or default_parallel(opts.device)
    argv = natsl_command("sweep", spec_path, "--out", folder, "--max-parallel", str(parallel))
    if opts.device != "cpu" and _has_cuda():
        argv.append("--mps")
    if remaining is not None:
        argv += ["--deadline", f"{max(10.0, remaining - 15):.0f}"]
    code = _run(argv, opts.out / "logs" / f"{name}.log", log)
    summary = _summary(folder) or {}
    done, total = finished_runs(summary)
    if code == 2 and not total:
        raise NatslError(f"natsl sweep refused the {name} spec (log: {opts.out / 'logs' / f'{name}.log'})")
    if done < total or not total:
        raise Stopped(f"{name}: {done} of {total} runs done")
    return summary


def _grows(folder: Path, spec: dict) -> Optional[str]:
    """None where `spec` grows the sweep recorded in folder/sweep.json (natsl.training.sweep_checks.spec_grows),
    else why not."""
    from natsl.files import read_json
    from natsl.training.sweep_checks import spec_grows

    try:
        old = read_json(folder / "sweep.json", "remove it")
    except (OSError, NatslError):  # missing, unreadable, too large, not JSON, nested too deeply
        return "no readable sweep.json"
    if not isinstance(old, dict) or not isinstance(old.get("spec"), dict):
        return "no readable sweep.json"
    return spec_grows(old["spec"], spec)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _stage_sweep(opts: MiniatureOptions, remaining, log, result) -> None:
    _sweep_stage("sweep", sweep_spec(opts), opts, remaining, log)


def _stage_train(opts: MiniatureOptions, remaining, log, result) -> None:
    summary = _summary(opts.out / "sweep")
    needed = {RATE_OF.get(name, name) for name in opts.systems}
    if summary is None and not needed <= set(opts.rates):
        missing = ",".join(sorted(needed - set(opts.rates)))
        raise NatslError(f"{opts.out / 'sweep'} holds no sweep; run the sweep stage first, or give the rates of "
                         f"{missing} with --rates (e.g. --rates gdn=0.002,transformer=0.004)")
    swept = best_rates(summary) if summary is not None else {}
    rates = {**swept, **opts.rates}
    log("  learning rates: " + ", ".join(f"{s} {r:g}" + (" (--rates)" if s in opts.rates else " (sweep)")
                                         for s, r in sorted(rates.items()) if s in needed))
    _sweep_stage("train", train_spec(opts, rates), opts, remaining, log)


def _stage_eval(opts: MiniatureOptions, remaining, log, result) -> None:
    from natsl.miniature.evaluate import eval_jobs, run_jobs

    jobs = eval_jobs({k: Path(v) for k, v in checkpoint_folders(opts.out).items()}, opts.data, opts.out / "eval",
                     device=opts.device or ("cuda" if _has_cuda() else "cpu"), quick=opts.quick)
    jobs = [j for j in jobs if eval_family(j.name) in opts.evals]
    parallel = opts.max_parallel or default_parallel(opts.device)
    statuses = run_jobs(jobs, max_parallel=min(parallel, 8), deadline_s=None if remaining is None else remaining - 10,
                        log=log)
    cut = [n for n, s in statuses.items() if "deadline" in s or s == "pending"]
    if cut:
        raise Stopped(f"eval: {len(cut)} of {len(statuses)} jobs not done before the deadline")
    failed = [n for n, s in statuses.items() if s.startswith("failed")]
    if failed:
        log(f"  eval: {len(failed)} jobs failed ({', '.join(failed)}); see {opts.out / 'eval' / 'logs'}")


def eval_family(job_name: str) -> str:
    """The EVALS family of an eval job's name (routing_natsl_hybrid -> routing, lm_eval_gdn -> lm_eval)."""
    return next((f for f in EVALS if job_name == f or job_name.startswith(f + "_")), job_name)


def _stage_report(opts: MiniatureOptions, remaining, log, result) -> None:
    from natsl.miniature.report import write_report

    result["report"] = str(write_report(opts.out))
    log(f"  report: {result['report']}")


STAGE_RUNNERS = {"corpus": _stage_corpus, "sweep": _stage_sweep, "train": _stage_train, "eval": _stage_eval,
                 "report": _stage_report}


def estimate_tokens(opts: MiniatureOptions) -> dict[str, float]:
    """Tokens each training stage of this command has left to train (the time estimate printed before work):
    every run of the spec, less what the stage folders' summaries say their runs of this spec trained already
    (a grown or resumed stage trains only the rest); 0 for a stage that --stages leaves out."""
    sweep = train = 0
    if "sweep" in opts.stages:
        swept = swept_systems(opts)
        sweep = len(swept) * len(opts.lrs) * opts.sweep_tokens
        sweep -= _trained(opts.out / "sweep", opts.sweep_tokens,
                          lambda r: r.get("system") in swept and r.get("lr") in opts.lrs)
    if "train" in opts.stages:
        runs = sum(len(opts.seeds) if name in opts.seed_systems else 1 for name in opts.systems)
        train = runs * opts.train_tokens
        train -= _trained(opts.out / "train", opts.train_tokens,
                          lambda r: r.get("system") in opts.systems and (r.get("system") not in opts.seed_systems
                                                                          or r.get("seed") in opts.seeds))
    return {"sweep": float(sweep), "train": float(train), "total": float(sweep + train)}


def _trained(folder: Path, budget: int, counts) -> int:
    """Tokens the runs of folder/summary.json that `counts` accepts trained already, each at most `budget`
    (a done run: all of it; a failed one: none, as the next sweep trains it again). 0 without a summary."""
    from natsl.files import read_json

    try:
        summary = read_json(folder / "summary.json", "remove it")
    except (OSError, NatslError):  # none yet, or unreadable: the stage itself says so when it runs
        return 0
    runs = summary.get("runs") if isinstance(summary, dict) else None
    total = 0
    for run in runs if isinstance(runs, list) else []:
        if not isinstance(run, dict) or run.get("failed") or not counts(run):
            continue
        tokens = budget if run.get("status") == "done" else run.get("tokens")
        if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
            total += int(min(max(tokens, 0), budget))
    return total


# Tokens per second of all workers together on one H100 80GB, in the sweep (13 at once) and in training (9 at
# once) under MPS: eager at micro-batch 8, and compiled (the sweep with its compilation at micro-batch 8, training
# at micro-batch 16), the figures of docs/miniature.md, for the estimate printed before work. Training's are the
# ladder's rate to its end, which its slowest run (pure NAtS-L) sets, not the workers' summed rate: the ladder
# ends with that run, well after the sum would say (docs/miniature.md, the paragraph after the claims); the eager figure
# assumes the same ratio.
H100_TOKENS_PER_S = {"sweep": 0.47e6, "train": 0.53e6}
H100_TOKENS_PER_S_COMPILED = {"sweep": 0.64e6, "train": 0.95e6}


def describe(opts: MiniatureOptions) -> str:
    """What the run trains, with a time estimate, for the start of the command's output."""
    tokens = estimate_tokens(opts)
    swept = len(swept_systems(opts))
    seeded = [name for name in opts.systems if name in opts.seed_systems]
    seeds = ("" if not seeded or len(opts.seeds) < 2 else f" (NAtS-L Hybrid x {len(opts.seeds)} seeds)"
             if seeded == ["natsl_hybrid"] else f" ({len(seeded)} of them x {len(opts.seeds)} seeds)")
    parts = []
    if "sweep" in opts.stages:
        parts.append(f"{swept} systems x {len(opts.lrs)} rates x {opts.sweep_tokens / 1e6:g}M tokens")
    if "train" in opts.stages:
        parts.append(f"{len(opts.systems)} systems{seeds} x {opts.train_tokens / 1e6:g}M tokens")
    line = (f"miniature: {', then '.join(parts) or 'no training stage'}: "
            f"{tokens['total'] / 1e9:.2f}B tokens left to train")
    rates = H100_TOKENS_PER_S_COMPILED if opts.compile else H100_TOKENS_PER_S
    minutes = sum(tokens[k] / rates[k] for k in ("sweep", "train")) / 60
    line += (f"; training alone takes about {minutes:.0f} min on one H100 at the recipes' size"
             + (" (compiled)" if opts.compile else ""))
    if opts.device == "cpu" or not _has_cuda():
        line += (" (on this machine's CPU, many times longer: use a GPU, or --set a smaller model as "
                 "tests/test_miniature.py does)")
    return line
