"""`natsl eval-ruler CHECKPOINT`: the RULER needle-in-a-haystack subset (paper Table 2)."""

from __future__ import annotations

from typing import Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads
from natsl.cli.jobs import force_option


def ruler_estimate(facts, stats: dict, measured_length: int, prompt_lengths: list[int], max_new_tokens: int,
                   device, *, dtype=None, backend: str = "chunked", rates=None,
                   prefills_per_sample: int = 1) -> tuple[float, float]:
    """Seconds of every sample (prompts of `prompt_lengths`), from one warm sample measured at a prompt
    of `measured_length` tokens (`stats` of natsl.eval.decode.greedy_generate): (likely, at most).

    A prefill's time scales from the measured one as the estimate (natsl.estimate) of each length to
    that of the measured length; a decode step takes the measured step's time (the estimate's where the
    sample decoded no step). Likely: every answer as long as the measured one; at most: `max_new_tokens`
    each. Both count every sample, those done included. `prefills_per_sample`: 2 with the teacher-forced
    score, whose forward of the prompt costs about a prefill."""
    import torch

    from natsl import estimate as E

    def seconds(work):
        return E.estimate(facts, [work], device, dtype=dtype or torch.float32, backend=backend, rates=rates).seconds

    base = seconds(E.Work("prefill", 1, measured_length))
    prefill = prefills_per_sample * sum(stats["prefill_s"] * seconds(E.Work("prefill", 1, n)) / base
                                        for n in prompt_lengths)
    steps = stats["decode_steps"]
    per_step = stats["decode_s"] / steps if steps else seconds(E.Work("decode", 1, measured_length + 1))
    generated = steps + 1  # the first new token comes out of the prefill
    decode_likely = len(prompt_lengths) * min(generated, max_new_tokens) * per_step
    decode_most = len(prompt_lengths) * max_new_tokens * per_step
    return prefill + decode_likely, prefill + decode_most


@command("eval-ruler", stop_soon=True)
def eval_ruler(
    checkpoint: str = typer.Argument(..., help="Checkpoint folder (or a training run folder: newest step)."),
    lengths: Optional[str] = typer.Option(None, help="Context lengths in tokens, comma separated (4k = 4096; default: "
                                                     "1x, 2x and 4x the training length, at least 1024 -- the paper's "
                                                     "4k,8k,16k for 4096 -- and at most max_seq_len)."),
    tasks: str = typer.Option("all", help="Comma-separated RULER NIAH tasks, or 'all' (the 8 of Table 2)."),
    samples: Optional[int] = typer.Option(None, help="Samples per task and length (default: 20 on CUDA, 2 on the CPU)."),
    seed: int = typer.Option(0, help="Seed of the generated samples (same seed, same prompts; 0 to 2**63-1)."),
    max_new_tokens: int = typer.Option(128, help="Tokens generated per sample (RULER: 128)."),
    essay_file: Optional[str] = typer.Option(None, help="Plain-text essays for the essay haystack (default: generated prose)."),
    keep_fraction: Optional[float] = typer.Option(None, help="Force NAtS-L layers to keep this fraction of blocks "
                                                             "(a fixed KV budget; default: the router decides)."),
    answer_accuracy: bool = typer.Option(True, "--answer-accuracy/--no-answer-accuracy",
                                         help="Also score each sample teacher-forced: the fraction of the answer's "
                                              "tokens the model predicts after the prompt (one more prefill each)."),
    out: str = typer.Option("eval_ruler", help="Folder for ruler.json, ruler_samples.jsonl and ruler.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    threads: Optional[int] = threads_option(),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
    force: bool = force_option(),
) -> None:
    """Generate RULER's retrieval tasks with the checkpoint's tokenizer, decode greedily, score by string match.

    Beside RULER's string match, each sample is scored teacher-forced (`--answer-accuracy`, the default):
    the prompt followed by ": VALUE" in one forward, and the fraction of the value's tokens the model
    predicts exactly. Small models score 0 by string match at every length; this measure still ranks
    them by how much of a needle they retrieve.

    A run the estimate calls long or large says so first; one the device's memory cannot hold is refused
    (--force starts it anyway). Once a warm sample is decoded, the time of the whole run is said again,
    measured on it."""
    from pathlib import Path

    from natsl.atomic import write_json, write_jsonl
    from natsl.data.grid import parse_lengths
    from natsl.runtime import check_keeps_natsl, check_length, checkpoint_recipe_of, on_cuda, pick_backend, pick_device, pick_dtype
    from natsl.errors import NatslError
    from natsl.estimate import Work, model_facts
    from natsl.eval.common import human_count, human_duration, load_eval_model, prepare_out_dir, print_estimate
    from natsl.cli.jobs import check_job, decoding_works
    from natsl.eval.haystack import EssaySentences, split_sentences
    from natsl.eval.ruler import TASKS, format_table, plot_scores, run_ruler
    from natsl.outputs import check_output
    from natsl.models.routing import force_keep_fraction
    from natsl.seeding import check_seed

    check_output(out, [checkpoint, essay_file], "--out")
    if keep_fraction is not None and not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    check_seed(seed, "--seed")
    folder, recipe = checkpoint_recipe_of(checkpoint)  # config.json only: refuse before loading
    check_keeps_natsl(keep_fraction, recipe, folder)
    limit = recipe.model.max_seq_len
    if lengths is None:
        base = max(recipe.train.seq_len, 1024)
        length_list = sorted({min(n * base, limit) for n in (1, 2, 4)})
    else:
        length_list = parse_lengths(lengths)
    for n in length_list:
        check_length("--lengths", n, limit, folder)
    if samples is None:
        samples = 20 if on_cuda(device) else 2
    task_list = list(TASKS) if tasks.strip() == "all" else [t.strip() for t in tasks.split(",") if t.strip()]
    unknown = [t for t in task_list if t not in TASKS]
    if unknown or not task_list:
        raise NatslError(f"unknown RULER task {unknown[0] if unknown else tasks!r}; choose from {', '.join(TASKS)} or 'all'")
    if samples < 1:
        raise NatslError(f"--samples must be at least 1, got {samples}")
    if max_new_tokens < 1:
        raise NatslError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    essay = EssaySentences(seed)
    if essay_file is not None:
        path = Path(essay_file)
        if not path.is_file():
            raise NatslError(f"--essay-file {essay_file!r} does not exist")
        try:
            sentences = split_sentences(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise NatslError(f"--essay-file {essay_file!r} is not UTF-8 text (byte {err.start}); convert it "
                             "to UTF-8") from None
        if not sentences:
            raise NatslError(f"--essay-file {essay_file!r} holds no sentences")
        essay = EssaySentences(sentences=sentences)
    use_threads(threads, device)
    torch_device = pick_device(device)
    # a prompt fills its length less the new tokens (a length too short for them is refused with the samples)
    prompts = [max(n - max_new_tokens, 1) for n in length_list for _ in range(len(task_list) * samples)]
    works = decoding_works(prompts, max_new_tokens)
    if answer_accuracy:  # the teacher-forced score: a forward of each prompt and its answer, no cache
        works += [Work("forward", 1, n) for n in prompts]
    check_job(f"eval-ruler: {len(prompts)} prompts of up to {max(length_list):,} tokens", recipe.model,
              works, device=torch_device, dtype=pick_dtype(dtype, torch_device),
              backend=backend, force=force, fix="lower --lengths, --samples or --max-new-tokens",
              note=f"every sample decoding all {max_new_tokens} new tokens; answers that stop early take less")
    out_dir = prepare_out_dir(out)
    em = load_eval_model(folder, device, dtype, backend)
    force_keep_fraction(em.model, keep_fraction, 0)

    def on_first(stats, todo, measured):
        prompt_tokens = sum(len(s.prompt_ids) for s in todo)
        likely, most = ruler_estimate(model_facts(em.recipe.model), stats, len(measured.prompt_ids),
                                      [len(s.prompt_ids) for s in todo], max_new_tokens, em.device, dtype=em.dtype,
                                      backend=pick_backend(backend, em.device),
                                      prefills_per_sample=2 if answer_accuracy else 1)
        plan = (f"eval-ruler: {len(task_list)} tasks x {len(length_list)} lengths x {samples} samples = {len(todo)} "
                f"prompts, {human_count(prompt_tokens)} prompt tokens + up to {human_count(len(todo) * max_new_tokens)} "
                "generated")
        print_estimate(plan, likely, f"at most {human_duration(most)} if every answer takes all {max_new_tokens} "
                       f"tokens; measured on a {len(measured.prompt_ids)}-token prompt: {stats['prefill_s']:.1f} s "
                       f"prefill, {stats['decode_steps'] + 1} new tokens in {stats['decode_s']:.1f} s")

    summary, rows = run_ruler(em, task_list, length_list, samples, seed=seed, max_new_tokens=max_new_tokens,
                              essay=essay, progress=progress, teacher_forced=answer_accuracy,
                              on_first=on_first if samples * len(task_list) * len(length_list) > 1 else None)
    report = {"checkpoint": str(em.folder), "name": em.name, "seed": seed, "samples": samples,
              "max_new_tokens": max_new_tokens, "haystack_essay": essay_file or "generated",
              "forced_keep_fraction": keep_fraction,
              "decoding": "greedy, incremental cache" if hasattr(em.model, "new_cache") else "greedy, full recompute",
              **summary}
    print(format_table(summary, task_list, length_list))
    print(f"mean over tasks and lengths: {summary['mean']:.3f}")
    if answer_accuracy:
        teacher = summary["answer_accuracy"]
        print("teacher-forced answer-token accuracy:")
        print(format_table(teacher, task_list, length_list))
        print(f"mean over tasks and lengths: {teacher['mean']:.3f}")
        logprob = summary["answer_logprob"]["lengths"]
        print("answer tokens' mean log-probability (nats), by length: "
              + ", ".join(f"{n} {logprob[str(n)]:.3f}" for n in length_list))
    json_path = write_json(out_dir / "ruler.json", report)
    write_jsonl(out_dir / "ruler_samples.jsonl", rows)
    png_path = plot_scores(summary, task_list, length_list, out_dir / "ruler.png", f"RULER NIAH: {em.name}")
    print(f"wrote {json_path}, {out_dir / 'ruler_samples.jsonl'} and {png_path}")
