"""`natsl inspect-routing CHECKPOINT [DATA...]`: softmax-memory fractions per layer, group and position."""

from __future__ import annotations

from typing import List, Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads

KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@command("inspect-routing")
def inspect_routing(
    checkpoint: str = typer.Argument(..., help="Checkpoint folder (or a training run folder: newest step)."),
    data: Optional[List[str]] = typer.Argument(None, help="Datasets (`natsl tokenize` folders, .txt, .jsonl); "
                                                          "none: the embedded corpus and random tokens."),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per sample, the length the memory is reported at "
                                                     "(default: the checkpoint's training length; at most its "
                                                     "max_seq_len)."),
    samples: Optional[int] = typer.Option(None, help="Samples (windows) per dataset (default: 8 on CUDA, 2 on the CPU)."),
    bins: int = typer.Option(32, help="Position bins of the over-time view (Fig. 6)."),
    kv_dtype: str = typer.Option("bf16", help="Element type of the KV cache for the memory figures: fp32, bf16, fp16, fp8."),
    seed: int = typer.Option(0, help="Seed of the random tokens used when no DATA is given (0 to 2**63-1)."),
    text_key: str = typer.Option("text", help="Field holding the text in a .jsonl file."),
    split: str = typer.Option("auto", help="Split of a `natsl tokenize` folder: validation, train or auto."),
    out: str = typer.Option("routing", help="Folder for routing.json, routing_groups.png and routing_time.png."),
    device: Optional[str] = typer.Option(None, help="cpu, cuda or cuda:N (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on the CPU)."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: fast on CUDA, chunked on the CPU)."),
    threads: Optional[int] = threads_option(),
) -> None:
    """Fraction of blocks kept in softmax memory per NAtS-L layer and routing group, per dataset and over position."""
    import numpy as np

    from natsl.atomic import write_json
    from natsl.runtime import check_length, checkpoint_recipe_of, on_cuda
    from natsl.errors import NatslError
    from natsl.eval.common import human_count, load_eval_model, prepare_out_dir, print_estimate
    from natsl.eval.data import check_vocab, load_token_data, windows as make_windows
    from natsl.eval.routing import collect_keep, plot_groups, plot_time, summarize_dataset
    from natsl.outputs import check_output
    from natsl.seeding import check_seed

    check_output(out, [checkpoint, *(data or [])], "--out")
    check_seed(seed, "--seed")
    folder, recipe = checkpoint_recipe_of(checkpoint)  # config.json only: refuse before loading
    if seq_len is None:
        seq_len = min(recipe.train.seq_len, recipe.model.max_seq_len)
    if samples is None:
        samples = 8 if on_cuda(device) else 2
    if seq_len < 1 or samples < 1 or bins < 1:
        raise NatslError("--seq-len, --samples and --bins must be at least 1")
    check_length("--seq-len", seq_len, recipe.model.max_seq_len, folder)
    if kv_dtype not in KV_BYTES:
        raise NatslError(f"unknown --kv-dtype {kv_dtype!r}: use one of {', '.join(KV_BYTES)}")
    use_threads(threads, device)
    out_dir = prepare_out_dir(out)
    em = load_eval_model(folder, device, dtype, backend)
    config = em.recipe.model
    if not em.model.natsl_layers():
        raise NatslError(f"checkpoint {str(em.folder)!r} has no NAtS-L layers, so there is no routing to inspect")
    sources = []
    if data:
        for path in data:
            td = load_token_data(path, em.tokenizer, text_key=text_key, split=split, max_tokens=samples * seq_len)
            check_vocab(td, config.vocab_size)
            eos = em.tokenizer.eos_id if em.tokenizer is not None else None
            wins = make_windows(td, seq_len, samples, concat=True, eos_id=eos, min_len=seq_len)
            if not wins:
                raise NatslError(f"data {path!r} has fewer than --seq-len {seq_len} tokens; lower --seq-len")
            sources.append((td.name, wins))
    else:
        from natsl.eval.data import builtin_windows

        wins = builtin_windows(em.tokenizer, seq_len, samples, config.vocab_size)
        if wins:
            sources.append(("builtin corpus", wins))
        rng = np.random.default_rng(seed)
        sources.append(("random tokens", [rng.integers(0, config.vocab_size, seq_len) for _ in range(samples)]))
    summaries = []
    count = sum(len(wins) for _, wins in sources)

    def on_first(seconds):
        plan = (f"inspect-routing: {count} windows of {seq_len} tokens ({len(sources)} dataset(s)), "
                f"{human_count(count * seq_len)} forward tokens")
        print_estimate(plan, seconds * count, f"the first window took {seconds:.1f} s")

    for number, (name, wins) in enumerate(sources):
        keeps = collect_keep(em.model, wins, em.device, desc=f"routing {name}",
                             on_first=on_first if number == 0 and count > 1 else None)
        summary = summarize_dataset(name, keeps, seq_len, config, KV_BYTES[kv_dtype], bins)
        summaries.append(summary)
        mem = summary["memory"]
        print(f"{name}: {summary['windows']} x {seq_len} tokens, softmax-memory fraction {summary['keep_fraction']:.3f}; "
              f"KV {mem['kv_bytes'] / 2**20:.2f} MiB vs Transformer {mem['transformer_kv_bytes'] / 2**20:.2f} MiB "
              f"({mem['kv_ratio']:.3f}x) + GDN state {mem['gdn_state_bytes'] / 2**20:.2f} MiB")
        for layer in summary["layers"]:
            groups = " ".join(f"{g:.2f}" for g in layer["group_keep_fraction"])
            print(f"  layer {layer['layer']:>3}: keep {layer['keep_fraction']:.3f}  per group [{groups}]")
    report = {"checkpoint": str(em.folder), "name": em.name, "seq_len": seq_len, "samples": samples,
              "block_size": config.block_size, "routing_groups": config.num_heads,
              "softmax_heads_per_group": config.softmax_heads_per_group, "kv_dtype": kv_dtype,
              "natsl_layers": sorted(em.model.natsl_layers()), "datasets": summaries}
    json_path = write_json(out_dir / "routing.json", report)
    p1 = plot_groups(summaries, out_dir / "routing_groups.png", f"softmax-memory fraction per layer and group: {em.name}")
    p2 = plot_time(summaries, out_dir / "routing_time.png", f"softmax-memory fraction over position: {em.name}")
    print(f"wrote {json_path}, {p1} and {p2}")
