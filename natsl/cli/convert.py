"""`natsl convert SRC OUT`: training checkpoint -> inference folder; `--to hf`: a Hugging Face folder;
`--from-hf`: import a Hugging Face folder (natsl's own export, a Llama checkpoint or the authors' release)."""

from __future__ import annotations

from typing import Optional

import typer

from natsl.cli.app import command


@command("convert")
def convert(
    src: str = typer.Argument(..., help="A training checkpoint or run folder; with --from-hf, the authors' HF folder."),
    out: str = typer.Argument(..., help="Folder to write (weights, config.json, tokenizer.json)."),
    from_hf: bool = typer.Option(False, "--from-hf", help="SRC is a Hugging Face folder (safetensors): one that "
                                 "`--to hf` wrote (model type natsl or llama) or the authors' release (model type "
                                 "neural_attention_search_linear_attn_gdn, _delta or nats_mamba); config.json's "
                                 "model_type tells them apart."),
    to: str = typer.Option("natsl", "--to", help="natsl: an inference folder; hf: a Hugging Face folder (a Llama "
                           "checkpoint for the Transformer, model type natsl with remote code otherwise)."),
    dtype: Optional[str] = typer.Option(None, help="Store the weights as fp32, bf16 or fp16 (default: as in SRC)."),
    tokenizer: Optional[str] = typer.Option(None, help="With --from-hf: tokenizer.json to bundle (default: SRC/tokenizer.json)."),
    force: bool = typer.Option(False, help="Replace OUT if it is a folder natsl convert wrote (an inference or HF "
                                "folder) or an empty one; a training checkpoint is never replaced."),
    verify: bool = typer.Option(True, help="Load the written folder back and check every tensor."),
) -> None:
    """Write a clean inference folder that `natsl.load_checkpoint`, generation and every eval command read."""
    from pathlib import Path

    import torch

    from natsl.runtime import DTYPES
    from natsl.errors import NatslError
    from natsl.eval.convert import convert_checkpoint, import_hf
    from natsl.atomic import recover_folder
    from natsl.outputs import check_output, check_output_folder

    target = Path(out)
    check_output_folder(target, "OUT")
    check_output(target, [src, tokenizer], "OUT")
    recover_folder(target)  # a convert killed while replacing OUT: its previous (or complete new) copy first
    if target.exists() and not force:
        raise NatslError(f"{out!r} exists; pass --force to replace it or choose another folder")
    if dtype is not None and dtype not in DTYPES:
        raise NatslError(f"unknown dtype {dtype!r}: use one of fp32, bf16, fp16")
    chosen = DTYPES[dtype] if dtype else None
    if to not in ("natsl", "hf"):
        raise NatslError(f"unknown --to {to!r}: use natsl or hf")
    if to == "hf":
        from natsl.hf.export import export_hf

        if from_hf or tokenizer is not None:
            raise NatslError("--to hf writes a natsl checkpoint as a Hugging Face folder; drop --from-hf and --tokenizer")
        written = export_hf(src, target, chosen)
        if verify:
            from natsl.hf.export import verify_hf_export

            print(f"verified: {verify_hf_export(src, written)} tensors read back as an import reads them")
        print(f"wrote {written}")
        return
    if from_hf:
        from natsl.hf.export import OWN_MODEL_TYPES, hf_model_type, import_own_hf

        own = hf_model_type(Path(src)) in OWN_MODEL_TYPES
        written = (import_own_hf if own else import_hf)(src, target, chosen, tokenizer)
    else:
        if tokenizer is not None:
            raise NatslError("--tokenizer is only for --from-hf; a natsl checkpoint keeps its own tokenizer")
        written = convert_checkpoint(src, target, chosen)
    if verify:
        from safetensors.torch import load_file

        import natsl

        model, tok = natsl.load_checkpoint(written)
        stored = load_file(str(written / "model.safetensors"))
        state = model.state_dict()
        bad = [k for k, v in stored.items() if not torch.equal(state[k].to(v.dtype), v)]
        if bad:
            raise NatslError(f"verification failed: {bad[:3]} changed on reload")
        params = model.num_parameters()
        print(f"verified: {len(stored)} tensors, {params / 1e6:.1f}M parameters"
              + ("" if tok is not None else "; no tokenizer bundled (text commands will need one)"))
    print(f"wrote {written}")
