"""`natsl info RECIPE|CHECKPOINT`: the model a recipe builds (or a checkpoint holds), its parameter count, and
one forward pass's routing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Optional

import typer

from natsl.cli.app import command
from natsl.cli.options import threads_option, use_threads


def routing_map(keep) -> list[str]:
    """keep [NB, H] (0/1) -> one line per routing group: 'S' kept in softmax memory, '.' written to the
    linear memory (the GDN or Mamba2 state)."""
    return ["".join("S" if v > 0.5 else "." for v in keep[:, h].tolist()) for h in range(keep.shape[1])]


@command("info")
def info(
    recipe: str = typer.Argument(..., help="Recipe YAML file, the name of a shipped recipe (e.g. tiny_hybrid, "
                                           "recall/gdn), or a checkpoint or run folder (its recipe and weights)."),
    seq_len: int = typer.Option(256, help="Tokens in the forward pass (random ids)."),
    forward: bool = typer.Option(True, help="Run a forward pass and print the routing of every NAtS-L layer."),
    backend: Optional[str] = typer.Option(None, help="reference, chunked or fast (default: chunked; the forward pass "
                                                     "runs on the CPU, where fast needs TRITON_INTERPRET=1; with "
                                                     "--kernels, the commands' default on --device: fast on CUDA)."),
    seed: int = typer.Option(0, help="Seed for the weights (of a recipe) and the random tokens (0 to 2**63-1)."),
    threads: Optional[int] = threads_option(),
    kernels: bool = typer.Option(False, "--kernels", help="After the model summary, print which kernel each op "
                                 "runs on --device (training, prefill, decode) and the switch or rule that "
                                 "chose it, instead of the forward pass (docs/performance.md)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda: the device of the --kernels table (default: "
                                                    "cuda when there is one). The forward pass runs on the CPU."),
) -> None:
    """Print what a recipe builds or a checkpoint holds; with --forward, run random tokens through it and show
    the routing; with --kernels, which kernel each op runs and why."""
    import torch

    import natsl
    from natsl.runtime import check_length, checkpoint_recipe_of, pick_backend, pick_device
    from natsl.errors import NatslError
    from natsl.seeding import check_seed

    check_seed(seed, "--seed")
    folder = None
    if Path(recipe).is_dir():  # a checkpoint (or run) folder: its recipe, and its weights for the forward
        folder, rec = checkpoint_recipe_of(recipe)
    else:
        rec = natsl.load_recipe(recipe)
    if seq_len < 1:
        raise NatslError(f"--seq-len must be at least 1, got {seq_len}")
    source = f"checkpoint {str(folder)!r}" if folder else f"recipe {rec.name}"
    check_length("--seq-len", seq_len, rec.model.max_seq_len, source)
    cfg = rec.model
    rows = None
    if kernels:  # before any output: a backend this device cannot run is a one-line error
        from natsl.inference.kernel_table import format_table, kernel_table

        table_device = pick_device(device)
        rows = kernel_table(cfg, table_device, backend=backend, command=True)
    chosen_backend = None if kernels else pick_backend(backend, torch.device("cpu"))
    layout = Counter(cfg.layer_types())
    meta = natsl.build_model(rec, device="meta")
    print(f"{rec.name}: {meta.num_parameters() / 1e6:.1f}M parameters, {cfg.num_layers} layers "
          f"({', '.join(f'{n} {t}' for t, n in layout.items())}), width {cfg.hidden_size}, vocab {cfg.vocab_size}")
    from natsl.models.registry import kind_of, kinds_of, layer_type_names

    legend = {}  # letter -> meaning, one per layer type (its variant in this config)
    for layer_type in layer_type_names():
        kind = kind_of(cfg, layer_type)
        legend.setdefault(kind.letter, kind.legend)
    print("layers: " + " ".join(kind.letter for kind in kinds_of(cfg))
          + "   (" + ", ".join(f"{letter} = {meaning}" for letter, meaning in legend.items()) + ")")
    if rows is not None:
        print(f"kernels on {table_device} (natsl info --kernels; docs/performance.md, \"Which kernel runs\"):")
        print(format_table(rows))
        return
    if not forward:
        return
    use_threads(threads, torch.device("cpu"))
    torch.manual_seed(seed)
    model = natsl.load_checkpoint(folder, dtype=torch.float32)[0] if folder else natsl.build_model(rec)
    model.set_backend(chosen_backend)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len))
    with torch.no_grad():
        logits = model(ids)
    print(f"forward: {seq_len} random tokens -> logits {tuple(logits.shape)}, mean |logit| {logits.abs().mean():.4f}")
    for index, layer in model.natsl_layers().items():
        keep = layer.last_keep[0]
        print(f"layer {index} NAtS-L routing ({keep.shape[0]} blocks of {cfg.block_size} tokens x {keep.shape[1]} "
              f"routing groups), keep fraction {keep.mean():.2f}; S = softmax KV memory, . = "
              f"{model.layers[index].kind.state_title} state:")
        for group, line in enumerate(routing_map(keep)):
            print(f"  group {group}: {line}")
