"""`natsl generate CHECKPOINT --prompt TEXT | --prompt-file FILE`: continue prompts with a trained model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads
from natsl.cli.jobs import force_option
from natsl.errors import NatslError, NonFiniteError
from natsl.files import parse_json


def read_prompts(prompt: str | None, prompt_file: str | None) -> list[str]:
    """The prompts of the command line: one `--prompt`, a text file (one prompt), or a .jsonl file
    with one JSON object per line holding the prompt under `prompt` or `text`."""
    if (prompt is None) == (prompt_file is None):
        raise NatslError("give exactly one of --prompt TEXT and --prompt-file FILE")
    if prompt is not None:
        if not prompt:
            raise NatslError("--prompt is empty; give some text")
        return [prompt]
    path = Path(prompt_file)
    if not path.is_file():
        raise NatslError(f"prompt file {str(path)!r} does not exist; check the path")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise NatslError(f"prompt file {str(path)!r} is not UTF-8 text") from None
    if not raw.strip():
        raise NatslError(f"prompt file {str(path)!r} is empty; put a prompt in it")
    if path.suffix != ".jsonl":
        return [raw.rstrip("\n")]
    prompts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"{path}:{number}", "write one object per line")
        text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
        if not isinstance(text, str) or not text:
            raise NatslError(f"{path}:{number} has no non-empty string field 'prompt' or 'text'")
        prompts.append(text)
    return prompts


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


@command("generate", stop_soon=True)
def generate(
    checkpoint: str = typer.Argument(..., help="Model folder written by `natsl train` or `natsl convert` (or a run folder)."),
    prompt: Optional[str] = typer.Option(None, help="The prompt text."),
    prompt_file: Optional[str] = typer.Option(None, help="A text file (one prompt) or .jsonl (field 'prompt' or 'text' per line)."),
    max_new_tokens: int = typer.Option(128, help="Tokens to generate at most per prompt."),
    temperature: float = typer.Option(1.0, help="Sampling temperature; 0 = greedy (so is anything below 1e-4)."),
    top_k: int = typer.Option(0, help="Sample from the k most likely tokens only (0 = all)."),
    top_p: float = typer.Option(1.0, help="Sample from the smallest set of tokens holding this probability (1 = all)."),
    seed: int = typer.Option(0, help="Seed of the sampler: the same seed gives the same text (0 to 2**63-1)."),
    stop: Optional[List[str]] = typer.Option(None, help="Stop when this string appears (not printed); repeatable."),
    ignore_eos: bool = typer.Option(False, help="Keep going past the end-of-text token."),
    batch_size: int = typer.Option(8, help="Prompts of a .jsonl file decoded together."),
    output: Optional[str] = typer.Option(None, help="Also write the completions as JSON lines to this file."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on CPU)."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda if present)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU)."),
    cuda_graphs: bool = typer.Option(True, help="Replay decode steps as CUDA graphs (CUDA only)."),
    threads: Optional[int] = threads_option(),
    force: bool = force_option(),
) -> None:
    """Continue prompts with a checkpoint; one prompt streams to the terminal as it is generated.

    Long prompts that the estimate calls long or large say so before generating; prompts the device's
    memory cannot hold are refused (--force starts anyway).

    The last line (stderr) gives the time to first token (from the start of generation, the model
    loaded, to the first sampled token of the first batch) and the decode rate in tokens/s; --output
    rows carry both for their batch (time_to_first_token_s, decode_tokens_per_s)."""
    from natsl.checkpoint import load_checkpoint
    from natsl.runtime import pick_backend, pick_device, pick_dtype
    from natsl.inference.generate import generate as run_generate
    from natsl.inference.sampling import SamplingConfig
    from natsl.inference.generate import CPU_PREFILL_CHUNK
    from natsl.cli.jobs import check_job, decoding_works, held_bytes

    texts = read_prompts(prompt, prompt_file)
    config = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=list(stop or []), stop_at_eos=not ignore_eos)
    config.validate()
    if batch_size < 1:
        raise NatslError(f"--batch-size must be at least 1, got {batch_size}")
    if output:  # refused before generating, not after
        from natsl.outputs import check_output

        check_output(output, [checkpoint, prompt_file], "--output")
        out_path = Path(output)
        if out_path.is_dir():
            raise NatslError(f"--output {output} is a folder; give a file path")
        blocker = next((p for p in out_path.parents if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise NatslError(f"--output {output}: {blocker} is a file, not a folder; give another path")
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    chosen_backend = pick_backend(backend, torch_device)
    threads_note = use_threads(threads, torch_device, say=False)
    model, tokenizer = load_checkpoint(checkpoint, device=torch_device, dtype=torch_dtype)
    if tokenizer is None:
        raise NatslError(f"checkpoint {checkpoint!r} has no tokenizer.json; generate needs one to read and write text")
    model.set_backend(chosen_backend)
    prompts = [tokenizer.document_start() + tokenizer.encode(t) for t in texts]
    limit = model.config.max_seq_len
    for i, ids in enumerate(prompts):
        where = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        if not ids:
            raise NatslError(f"{where} encodes to no tokens; give some text")
        if len(ids) >= limit:
            raise NatslError(f"{where} has {len(ids)} tokens but the model takes at most {limit} (max_seq_len) "
                             "including the new ones; shorten it")
    lengths = [len(ids) for ids in prompts]
    check_job(f"generate: {len(prompts)} prompt(s) of up to {max(lengths):,} tokens + {max_new_tokens} new",
              model.config, decoding_works(lengths, max_new_tokens, batch=batch_size,
                                           chunk=CPU_PREFILL_CHUNK if torch_device.type == "cpu" else None),
              device=torch_device, dtype=torch_dtype, backend=chosen_backend, force=force, held=held_bytes(model),
              fix="shorten the prompts, or lower --max-new-tokens or --batch-size")

    single = len(prompts) == 1
    rows = []
    totals = {"new_tokens": 0, "decode_s": 0.0, "prefill_s": 0.0, "prompt_tokens": 0}
    first_token_s = None  # of the first batch: what a user waits before any text appears
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first:first + batch_size]
        stats: dict = {}

        def stream(i: int, text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        try:
            completions = run_generate(model, tokenizer, chunk, config, on_text=stream if single else None,
                                       cuda_graphs=cuda_graphs, stats=stats)
        except NonFiniteError as err:
            if single:
                sys.stdout.write("\n")
            raise NatslError(f"checkpoint {checkpoint!r}: {err}: its weights hold NaN/inf or overflow in "
                             f"{str(torch_dtype).replace('torch.', '')}; check the checkpoint or try --dtype fp32") from None
        for key in totals:
            totals[key] += stats[key]
        if first_token_s is None:
            first_token_s = stats["first_token_s"]
        timing = {"time_to_first_token_s": stats["first_token_s"],
                  "decode_tokens_per_s": tokens_per_s(stats["new_tokens"], stats["decode_s"])}
        for offset, completion in enumerate(completions):
            index = first + offset
            if single:
                sys.stdout.write("\n")
            else:
                print(f"--- prompt {index + 1} ({completion.stop_reason}) ---")
                print(completion.text)
            if not completion.tokens:
                print(f"warning: {'the prompt' if single else f'prompt {index + 1}'}: the model produced no tokens "
                      "(its first choice was the end-of-text token; --ignore-eos goes on past it)", file=sys.stderr)
            rows.append({"prompt": texts[index], "completion": completion.text,
                         "prompt_tokens": completion.prompt_tokens, "new_tokens": len(completion.tokens),
                         "stop_reason": completion.stop_reason, **timing})
        sys.stdout.flush()
    if output:
        from natsl.atomic import write_jsonl

        write_jsonl(Path(output), rows)
    rate = tokens_per_s(totals["new_tokens"], totals["decode_s"])
    reason = f", stop: {rows[0]['stop_reason']}" if single else ""
    print(f"[{len(rows)} prompt(s), {totals['prompt_tokens']} prompt tokens prefilled in {totals['prefill_s']:.2f} s, "
          f"time to first token {first_token_s:.3f} s, "
          f"{totals['new_tokens']} new tokens in {totals['decode_s']:.2f} s ({rate:.1f} tok/s decode) on {torch_device}"
          f"{' with ' + threads_note if threads_note else ''}, "
          f"{str(torch_dtype).replace('torch.', '')}, backend {chosen_backend}{reason}]", file=sys.stderr)
