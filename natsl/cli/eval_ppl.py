"""`natsl eval-ppl CHECKPOINT... --data DATA`: perplexity vs. context length (paper Fig. 3)."""

from __future__ import annotations

from typing import List, Optional

import typer

from natsl.cli.app import command


@command("eval-ppl")
def eval_ppl(
    checkpoints: List[str] = typer.Argument(..., help="One or more checkpoint folders (or training run folders: newest step)."),
    data: str = typer.Option(..., "--data", help="A `natsl tokenize` folder, or a .txt / .jsonl file tokenized on the fly."),
    max_len: int = typer.Option(65536, help="Window length in tokens (paper: 65536; training length 4096)."),
    bucket: int = typer.Option(2048, help="Position bucket width of the curve, in tokens."),
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
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Per-token loss over full-length windows, bucketed by position; perplexity and bits per byte."""
    from natsl.errors import NatslError
    from natsl.eval.common import load_eval_model, prepare_out_dir, write_json
    from natsl.eval.data import check_vocab, load_token_data, windows as make_windows
    from natsl.eval.ppl import evaluate_windows, plot_curves
    from natsl.inference.routing import force_keep_fraction

    if keep_fraction is not None and not 0.0 <= keep_fraction <= 1.0:
        raise NatslError(f"--keep-fraction must lie in [0, 1], got {keep_fraction}")
    if max_len < 2:
        raise NatslError(f"--max-len must be at least 2, got {max_len}")
    if bucket < 1:
        raise NatslError(f"--bucket must be at least 1, got {bucket}")
    if windows < 0:
        raise NatslError(f"--windows must be 0 (all) or more, got {windows}")
    limit = windows or None
    out_dir = prepare_out_dir(out)
    results, train_lens, cache = [], set(), {}
    for path in checkpoints:
        em = load_eval_model(path, device, dtype, backend)
        force_keep_fraction(em.model, keep_fraction, 0)
        key = em.tokenizer.sha256() if em.tokenizer is not None else None
        if key not in cache:
            cache[key] = load_token_data(data, em.tokenizer, text_key=text_key, split=split,
                                         max_tokens=limit * max_len if limit else None)
        token_data = cache[key]
        check_vocab(token_data, em.recipe.model.vocab_size)
        eos = em.tokenizer.eos_id if em.tokenizer is not None else None
        wins = make_windows(token_data, max_len, limit, concat=concat, eos_id=eos)
        if not wins:
            raise NatslError(f"data {data!r} has no window of at least 2 tokens")
        summary = evaluate_windows(em, wins, bucket, progress=progress)
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
