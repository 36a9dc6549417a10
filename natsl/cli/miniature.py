"""`natsl miniature`: the paper in miniature (docs/miniature.md) as one command: a local corpus, a learning-rate
sweep per system, the ladder trained at the best rates, the paper's evaluations and the report. Resumable:
the same command again continues where a deadline or a kill stopped it."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import comma_list
from natsl.miniature.pipeline import EVALS, LADDER


def _floats(text: str, flag: str) -> tuple[float, ...]:
    from natsl.errors import NatslError

    values = tuple(comma_list(text, flag, float, "numbers", "0.001,0.002,0.004"))
    if not values or not all(0 < v < 1 for v in values):
        raise NatslError(f"{flag} {text!r}: give learning rates between 0 and 1, e.g. {flag} 0.002,0.004")
    return values


def _ints(text: str, flag: str) -> tuple[int, ...]:
    from natsl.errors import NatslError

    values = tuple(comma_list(text, flag, int, "whole numbers", "0,1,2"))
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise NatslError(f"{flag} {text!r}: give distinct seeds from 0, e.g. {flag} 0,1,2")
    return values


def _rates(text: str) -> dict[str, float]:
    """--rates gdn=0.002,transformer=0.004: a learning rate per swept system (each named once)."""
    from natsl.errors import NatslError
    from natsl.miniature.pipeline import SWEPT

    rates: dict[str, float] = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        name, _, value = item.partition("=")
        try:
            rate = float(value)
        except ValueError:
            rate = float("nan")
        if name.strip() not in SWEPT or name.strip() in rates or not 0 < rate < 1:
            raise NatslError(f"--rates {text!r}: {item!r} is not SYSTEM=RATE with a rate between 0 and 1 and a "
                             f"system named once, of {','.join(SWEPT)} (gdn_swa takes gdn_hybrid's)")
        rates[name.strip()] = rate
    if not rates:
        raise NatslError(f"--rates {text!r}: give SYSTEM=RATE items, e.g. --rates gdn=0.002,transformer=0.004")
    return rates


def _names(text: str, flag: str, allowed: tuple, noun: str, fix: str, distinct: bool = False) -> tuple[str, ...]:
    """A comma list of names from `allowed` (at least one; each once where `distinct`), else one line naming
    the first unknown one and `fix` followed by the allowed names."""
    from natsl.errors import NatslError

    chosen = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in chosen if n not in allowed]
    if unknown or not chosen or (distinct and len(set(chosen)) != len(chosen)):
        raise NatslError(f"{flag} {text!r}: " + (f"unknown {noun} {unknown[0]!r}; " if unknown else "")
                         + f"{fix} {','.join(allowed)}")
    return chosen


@command("miniature")
def miniature(
    out: str = typer.Option("runs/miniature", help="Folder of the miniature: specs/, sweep/, train/, eval/, report/."),
    data: str = typer.Option("data/mini", help="Corpus (a natsl tokenize folder); built from this machine's "
                                               "installed sources and docs when it has no meta.json."),
    tokenizer: Optional[str] = typer.Option(
        None, help="The corpus stage's tokenizer.json (or a folder holding one) instead of training a BPE, e.g. an "
                   "earlier build's data/mini/tokenizer.json: the same corpus without the BPE's minutes."),
    lrs: str = typer.Option("0.001,0.002,0.004,0.008", help="Learning rates swept for every system."),
    sweep_tokens: int = typer.Option(10_000_000, help="Tokens per sweep run."),
    train_tokens: int = typer.Option(100_000_000, help="Tokens per full run."),
    seeds: str = typer.Option("0,1,2", help="Seeds of the full runs of --seed-systems."),
    seed_systems: str = typer.Option("natsl_hybrid", help="Systems trained over --seeds, comma separated, or all "
                                                          "(the baselines' spread over seeds measured too); the "
                                                          "others train seed 0."),
    rates: Optional[str] = typer.Option(None, metavar="SYSTEM=RATE,...",
                                        help="Learning rates for the train stage in place of the sweep's best, "
                                             "e.g. from docs/miniature.md's sweep (training then needs no sweep)."),
    systems: str = typer.Option(",".join(LADDER), show_default="all seven",
                                help="Systems of recipes/mini to sweep and train, comma separated, of " + ", ".join(LADDER)
                                     + " (a subset for a smaller budget; the report shows what was trained)."),
    micro_batch: int = typer.Option(8, help="Sequences per micro-batch (steps stay 64K tokens, accumulated)."),
    sweep_micro_batch: Optional[int] = typer.Option(None, help="The sweep stage's micro-batch (default: "
                                                               "--micro-batch), e.g. a kept sweep's own."),
    max_parallel: Optional[int] = typer.Option(None, help="Training workers at once (default: one per 6 GiB "
                                                          "of GPU memory)."),
    stages: str = typer.Option("corpus,sweep,train,eval,report", help="Stages to run, comma separated."),
    evals: str = typer.Option(",".join(EVALS), show_default="all six",
                              help="The eval stage's evaluations, comma separated, of " + ", ".join(EVALS)
                                   + " (the others are left as they are)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="SECTION.KEY=VALUE",
                                             help="Override every run's recipe (repeatable), e.g. a smaller model."),
    deadline: Optional[float] = typer.Option(None, help="Seconds for this command; the running stage stops "
                                                        "resumably at it."),
    eval_reserve: Optional[float] = typer.Option(
        None, help="With --deadline: training stops this many seconds before it, and the evaluations and the "
                   "report run on the runs as they are (evaluations of older checkpoints are redone next time)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when there is one)."),
    compile_: bool = typer.Option(False, "--compile/--no-compile", help="torch.compile + CUDA graphs in training."),
    quick: bool = typer.Option(False, help="The evaluations' small settings (a smoke run)."),
) -> None:
    """Reproduce the paper in miniature: corpus, LR sweeps, training, evaluations, report (resumable)."""
    from natsl.errors import NatslError
    from natsl.miniature.pipeline import STAGES, MiniatureOptions, describe, run_miniature

    chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
    unknown = [s for s in chosen if s not in STAGES]
    if unknown or not chosen:
        raise NatslError(f"--stages {stages!r}: unknown stage {unknown[0] if unknown else ''!r}; "
                         f"choose from {','.join(STAGES)}")
    for flag, value in (("--sweep-tokens", sweep_tokens), ("--train-tokens", train_tokens),
                        ("--micro-batch", micro_batch), ("--sweep-micro-batch", sweep_micro_batch),
                        ("--max-parallel", max_parallel)):
        if value is None:  # the option's default
            continue
        if value < 1:
            raise NatslError(f"{flag} {value}: give a positive whole number")
    if deadline is not None and not deadline > 0:
        raise NatslError(f"--deadline {deadline}: give a positive number of seconds")
    if eval_reserve is not None and (deadline is None or not 0 < eval_reserve < deadline):
        raise NatslError(f"--eval-reserve {eval_reserve}: give it with --deadline, a number of seconds between 0 "
                         "and the deadline")
    chosen_systems = _names(systems, "--systems", LADDER, "system", "give distinct names from", distinct=True)
    chosen_evals = _names(evals, "--evals", EVALS, "evaluation", "choose from")
    seeded = LADDER if seed_systems.strip() == "all" else _names(seed_systems, "--seed-systems", LADDER, "system",
                                                                 "give all or distinct names from", distinct=True)
    if tokenizer is not None:
        from natsl.files import real_path

        folder, given = real_path(data), real_path(tokenizer)
        if given == folder or folder in given.parents:
            raise NatslError(f"--tokenizer {tokenizer!r} lies inside --data {data!r}, which the corpus stage writes; "
                             "copy it out first (e.g. to mini_tokenizer.json) and pass the copy")
        if not given.exists():
            raise NatslError(f"--tokenizer {tokenizer!r} does not exist; pass a tokenizer.json or a folder holding one "
                             "(e.g. an earlier build's data/mini/tokenizer.json), or leave it out to train the BPE")
    if device not in (None, "cpu", "cuda"):
        raise NatslError(f"--device {device!r}: give cpu or cuda")
    opts = MiniatureOptions(out=Path(out), data=Path(data), tokenizer=Path(tokenizer) if tokenizer else None,
                            lrs=_floats(lrs, "--lrs"), sweep_tokens=sweep_tokens,
                            train_tokens=train_tokens, seeds=_ints(seeds, "--seeds"), seed_systems=seeded,
                            rates=_rates(rates) if rates is not None else {}, systems=chosen_systems, micro_batch=micro_batch,
                            sweep_micro_batch=sweep_micro_batch, max_parallel=max_parallel, device=device, deadline_s=deadline,
                            eval_reserve_s=eval_reserve, stages=chosen, evals=chosen_evals,
                            sets=tuple(set_ or ()), compile=compile_, quick=quick)
    print(describe(opts), flush=True)
    result = run_miniature(opts)
    line = ", ".join(f"{stage} {state}" for stage, state in result["stages"].items())
    print(f"done: {line}" + (f"; report {result['report']}" if result["report"] else ""), flush=True)
