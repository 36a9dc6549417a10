"""Each long command's job as the estimate sees it (natsl.estimate), and the `--force` option they share.

A command calls one `check_*` before its work: the estimate of the job's peak memory and time is said when
the job is long or large, and a job the device's memory cannot hold is refused with exit code 2 unless
`--force` is given (natsl.estimate.check_fits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import typer

if TYPE_CHECKING:  # torch loads when a command runs, not when the CLI starts (natsl.cli.app)
    import torch

    from natsl.estimate import Estimate


def force_option():
    return typer.Option(False, "--force", help="Start even when the estimate says the device's memory cannot hold "
                                                "the job (it is refused otherwise, before any work).")


def held_bytes(model: "torch.nn.Module") -> int:
    """Bytes of a model's weights, which a check after loading it counts as already held."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def combine(estimates: Sequence["Estimate"]) -> "Estimate":
    """Jobs run one after another (models built one at a time): the highest peak, the sum of the times."""
    from natsl import estimate as E

    top = max(estimates, key=lambda e: e.peak_bytes)
    return E.Estimate(top.peak_bytes, sum(e.seconds for e in estimates), top.parts)


def check_training(recipe, *, device: Optional[str], backend: Optional[str], threads: Optional[int],
                   max_steps: Optional[int], force: bool) -> None:
    """`natsl train`: the steps to run at the recipe's micro-batch (with `auto`: the CPU's pick, or on a GPU
    the smallest, 1, which the probe falls back to), with their activations, the fp32 weights, gradients and AdamW moments. The ranks of
    a torchrun job only warn (rank 0): one refusing alone would leave the others waiting."""
    import os

    from natsl import estimate as E
    from natsl.runtime import pick_backend, pick_device
    from natsl.training.distributed import launched_by_torchrun
    from natsl.training.micro_batch import cpu_micro_batch
    from natsl.runtime import cpu_threads

    tc = recipe.train
    dev = pick_device(device)
    chosen = pick_backend(backend, dev)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = tc.micro_batch_size
    if not isinstance(micro, int):  # auto: the CPU's pick (no probe there); on a GPU the smallest the probe can take
        per_rank = max(tc.tokens_per_step // (tc.seq_len * world), 1)
        micro = cpu_micro_batch(per_rank) if dev.type == "cpu" else 1
    accum = max(tc.tokens_per_step // (micro * tc.seq_len * world), 1)
    steps = max(tc.total_tokens // tc.tokens_per_step, 1)
    limit = max_steps if max_steps is not None else tc.max_steps
    if limit is not None and limit >= 1:
        steps = min(steps, limit)
    work = E.Work("train", micro, tc.seq_len, calls=steps, micro_batches=accum)
    rates = None
    if dev.type == "cpu":  # at the thread count the trainer will use
        rates = E.device_rates(dev, threads=cpu_threads(threads)[0])
    # "auto" recomputes blocks only where a GPU's probe finds that not even one sequence fits (and never on the
    # CPU), so the estimate takes it as off: the peak the step will have
    est = E.estimate(recipe.model, [work], dev, backend=chosen, checkpointing=tc.activation_checkpointing is True,
                     rates=rates)
    what = (f"train {recipe.name}: up to {steps:,} steps of {tc.tokens_per_step:,} tokens ({micro} x {tc.seq_len} x "
            f"{accum} accum{f' x {world} ranks' if world > 1 else ''})")
    fix = ("lower train.micro_batch_size or train.seq_len (e.g. --set train.micro_batch_size=1), set "
           "train.activation_checkpointing=true, or train on a GPU")
    if launched_by_torchrun():
        if int(os.environ.get("RANK", "0")) == 0:
            E.check_fits(what, est, dev, force=True, fix=fix)
        return
    E.check_fits(what, est, dev, force=force, fix=fix)


def latency_works(lengths: Sequence[int], *, batch: int, decode_tokens: int, repeats: int, times: int = 1) -> list:
    """bench-latency's measurement at each context (natsl.inference.bench.measure_point), `times` times:
    `1 + repeats` prefills and the decode steps, a few untimed ones first."""
    from natsl.estimate import Work

    works = []
    for length in lengths:
        works.append(Work("prefill", batch, length, calls=(1 + repeats) * times))
        works.append(Work("decode", batch, length + decode_tokens, calls=(6 + decode_tokens) * times))
    return works


def check_models(what: str, models: Sequence[tuple], *, device: "torch.device", dtype: "torch.dtype", backend: str,
                 force: bool, fix: str) -> None:
    """Models (config, keep fraction, works) built and measured one at a time (bench-latency, compare, warmup)."""
    from natsl import estimate as E

    estimates = [E.estimate(config, works, device, dtype=dtype, backend=backend, keep=keep)
                 for config, keep, works in models]
    E.check_fits(what, combine(estimates), device, force=force, fix=fix)


def check_bench(specs, lengths: Sequence[int], *, batch: int, decode_tokens: int, repeats: int,
                device: "torch.device", dtype: "torch.dtype", backend: str, force: bool) -> None:
    """bench-latency: every model (natsl.inference.bench.BenchModel) at every context length."""
    import natsl
    from natsl.runtime import checkpoint_recipe_of

    models = []
    for spec in specs:
        config = natsl.load_recipe(spec.path).model if spec.kind == "recipe" else checkpoint_recipe_of(spec.path)[1].model
        keep = 1.0 if spec.force_keep is None else spec.force_keep
        models.append((config, keep, latency_works(lengths, batch=batch, decode_tokens=decode_tokens, repeats=repeats)))
    check_models(f"bench-latency: {len(specs)} model(s) x {len(lengths)} context(s) up to {max(lengths):,} tokens",
                 models, device=device, dtype=dtype, backend=backend, force=force,
                 fix="lower --max-len or --batch-size, measure fewer models (--recipe NAME), or run on a GPU")


def check_compare(models: Sequence[str], *, budgets: list, methods: list, contexts: Sequence[int], decode_tokens: int,
                  repeats: int, ppl_args: Optional[dict], chunk: Optional[int], device: Optional[str],
                  dtype: Optional[str], backend: Optional[str], force: bool) -> None:
    """compare: every variant (budget, press) of every model at every context as bench-latency measures a
    point, and the perplexity windows of the checkpoints' variants (recall's grid is known only once a
    checkpoint loads: not counted)."""
    from natsl.estimate import Work
    from natsl.eval import compare as logic
    from natsl.runtime import pick_backend, pick_device, pick_dtype

    dev = pick_device(device)
    plan = []
    for source in (logic.resolve_source(m) for m in models):
        variants = logic.variants(source.recipe.model, budgets, methods, trained=source.trained)
        works = latency_works(contexts, batch=1, decode_tokens=decode_tokens, repeats=repeats, times=len(variants))
        if ppl_args and source.trained:
            works.append(Work("prefill", 1, ppl_args["max_len"], calls=ppl_args["windows"] * len(variants),
                              chunk=chunk or source.recipe.model.block_size))
        plan.append((source.recipe.model, 1.0, works))
    check_models(f"compare: {len(plan)} model(s) x {len(contexts)} context(s) up to {max(contexts):,} tokens", plan,
                 device=dev, dtype=pick_dtype(dtype, dev), backend=pick_backend(backend, dev), force=force,
                 fix="lower --context, compare fewer models or budgets, or run on a GPU")


def decoding_works(prompt_lengths: Sequence[int], new_tokens: int, *, batch: int = 1,
                   chunk: Optional[int] = None) -> list:
    """Prompts prefilled one by one (each into its row of a batch cache), then decoded `batch` at a time
    for up to `new_tokens` steps at the longest context of the batch."""
    from natsl import estimate as E

    works = [E.Work("prefill", 1, n, chunk=chunk) for n in prompt_lengths]
    for start in range(0, len(prompt_lengths), batch):
        group = prompt_lengths[start:start + batch]
        works.append(E.Work("decode", len(group), max(group) + new_tokens, calls=new_tokens))
    return works


def check_job(what: str, config, works: list, *, device: "torch.device", dtype: "torch.dtype",
              backend: Optional[str], force: bool, fix: str, held: int = 0, note: str = "") -> "Estimate":
    """One model's `works` (natsl.estimate.Work: evaluation forwards, prefills and decode steps) on `device`
    (`backend`: the command's option, resolved here); `held`: bytes of the model when it is already loaded."""
    from natsl import estimate as E
    from natsl.runtime import pick_backend

    est = E.estimate(config, works, device, dtype=dtype, backend=pick_backend(backend, device))
    E.check_fits(what, est, device, force=force, fix=fix, held=held, note=note)
    return est
