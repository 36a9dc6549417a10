"""`natsl eval-ppl CHECKPOINT... --data DATA`: perplexity vs. context length (paper Fig. 3)."""

from __future__ import annotations

from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads
from natsl.cli.jobs import force_option


@command("eval-ppl", stop_soon=True)
def eval_ppl(
    checkpoints: List[str] = typer.Argument(..., help="One or more checkpoint folders (or training run folders: newest step)."),
    data: str = typer.Option(..., "--data", help="A `natsl tokenize` folder, or a .txt / .jsonl file tokenized on the fly."),
    max_len: Optional[int] = typer.Option(None, help="Window length in tokens (default: 16x the training length on "
                                                     "CUDA, as the paper's 65536 for 4096, 4x on the CPU; at most "
                                                     "the checkpoint's max_seq_len)."),
    bucket: Optional[int] = typer.Option(None, help="Position bucket width of the curve, in tokens (default: "
                                                    "--max-len / 32; at most --max-len)."),
    windows: int = typer.Option(8, help="Evaluate at most this many windows per checkpoint (0 = all)."),
    concat: bool = typer.Option(False, help="Join all documents (EOS between) before cutting windows, as for "
                                            "collections of short files; default: each document on its own."),
    text_key: str = typer.Option("text", help="Field holding the text in a .jsonl file."),
    split: str = typer.Option("auto", help="Split of a `natsl tokenize` folder: validation, train, or auto "
                                           "(validation when it has tokens)."),
    keep_fraction: Optional[float] = typer.Option(None, help="Force NAtS-L layers to keep this fraction of blocks "
                                                             "(a fixed KV budget; default: the router decides)."),
    out: str = typer.Option("eval_ppl", help="Folder for ppl.json and ppl.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    threads: Optional[int] = threads_option(),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
    force: bool = force_option(),
) -> None:
    """Per-token loss over full-length windows, bucketed by position; perplexity and bits per byte.

    A run the estimate calls long or large says so before the first window; one the device's memory cannot
    hold is refused (--force starts it anyway)."""
    import sys

    from natsl.atomic import write_json
    from natsl.checkpoint import checkpoint_tokenizer, read_config
    from natsl.runtime import check_keeps_natsl, check_length, checkpoint_recipe_of, on_cuda
    from natsl.errors import NatslError
    from natsl.eval.common import human_count, load_eval_model, prepare_out_dir, print_estimate
    from natsl.eval.data import check_vocab, load_token_data, windows as make_windows
    from natsl.eval.ppl import evaluate_windows, plot_curves
    from natsl.outputs import check_output
    from natsl.models.routing import force_keep_fraction
    from natsl.cli.jobs import check_job, held_bytes
    from natsl.estimate import Work

    check_output(out, [*checkpoints, data], "--out")
    if keep_fraction is not None and not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    if windows < 0:
        raise NatslError(f"--windows must be 0 (all) or more, got {windows}")
    recipes = [checkpoint_recipe_of(path) for path in checkpoints]  # config.json only: refuse before loading
    if max_len is None:
        factor = 16 if on_cuda(device) else 4
        max_len = min(min(factor * r.train.seq_len, r.model.max_seq_len) for _, r in recipes)
    if max_len < 2:
        raise NatslError(f"--max-len must be at least 2, got {max_len}")
    for folder, r in recipes:
        check_length("--max-len", max_len, r.model.max_seq_len, folder)
        check_keeps_natsl(keep_fraction, r, folder)
    if bucket is None:
        bucket = max(1, max_len // 32)
    if bucket < 1:
        raise NatslError(f"--bucket must be at least 1, got {bucket}")
    if bucket > max_len:
        print(f"note: --bucket {bucket} is wider than --max-len {max_len}; using one bucket of {max_len} tokens",
              file=sys.stderr)
        bucket = max_len
    limit = windows or None
    use_threads(threads, device)
    # Every checkpoint's tokenizer against the data, and its windows, before any model is loaded: a
    # mismatch of the second checkpoint is refused before the first one's evaluation, not after.
    cache, plans = {}, []
    for folder, r in recipes:
        tokenizer = checkpoint_tokenizer(folder, read_config(folder), r.model.vocab_size)
        key = tokenizer.sha256() if tokenizer is not None else None
        if key not in cache:
            cache[key] = load_token_data(data, tokenizer, text_key=text_key, split=split,
                                         max_tokens=limit * max_len if limit else None)
        token_data = cache[key]
        check_vocab(token_data, r.model.vocab_size)
        wins = make_windows(token_data, max_len, limit, concat=concat,
                            eos_id=tokenizer.eos_id if tokenizer is not None else None)
        if not wins:
            raise NatslError(f"data {data!r} has no window of at least 2 tokens")
        plans.append(wins)
    out_dir = prepare_out_dir(out)
    results, train_lens = [], set()
    for number, (path, wins) in enumerate(zip(checkpoints, plans)):
        em = load_eval_model(path, device, dtype, backend)
        force_keep_fraction(em.model, keep_fraction, 0)
        if number == 0:
            check_job(f"eval-ppl: {len(checkpoints)} checkpoint(s) x {len(wins)} windows of up to {max_len} tokens",
                      em.recipe.model, [Work("forward", 1, max_len, calls=len(wins) * len(checkpoints))],
                      device=em.device, dtype=em.dtype, backend=backend, force=force,
                      fix="lower --max-len or --windows", held=held_bytes(em.model))
        on_first = None
        if number == 0 and (len(wins) > 1 or len(checkpoints) > 1):
            tokens = sum(len(w) for w in wins)

            def on_first(seconds, first_tokens, tokens=tokens):
                plan = (f"eval-ppl: {len(checkpoints)} checkpoint(s) x {len(wins)} windows of up to {max_len} tokens, "
                        f"{human_count(tokens * len(checkpoints))} forward tokens")
                print_estimate(plan, seconds * tokens / first_tokens * len(checkpoints),
                               f"the first window of {first_tokens} tokens took {seconds:.1f} s")

        summary = evaluate_windows(em, wins, bucket, progress=progress, on_first=on_first)
        summary.update(name=em.name, path=str(em.folder), train_seq_len=em.recipe.train.seq_len)
        train_lens.add(em.recipe.train.seq_len)
        results.append(summary)
        bpb = f"{summary['bits_per_byte']:.4f}" if summary["bits_per_byte"] is not None else "n/a"
        print(f"{em.name}: ppl {summary['ppl']:.3f}  loss {summary['loss']:.4f}  bits/byte {bpb}  "
              f"({summary['tokens']} tokens in {summary['windows']} windows)")
        for b in summary["buckets"]:
            print(f"  tokens {b['start']:>6}-{b['end']:<6} ppl {b['ppl']:9.3f}  ({b['tokens']} tokens)")
        del em
    report = {"data": str(data), "max_len": max_len, "bucket": bucket, "windows": limit, "concat": concat,
              "forced_keep_fraction": keep_fraction, "checkpoints": results}
    json_path = write_json(out_dir / "ppl.json", report)
    png_path = plot_curves(results, out_dir / "ppl.png", train_len=train_lens.pop() if len(train_lens) == 1 else None,
                           title=f"perplexity vs. context length: {token_data.name}")
    print(f"wrote {json_path} and {png_path}")
