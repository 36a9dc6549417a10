"""Device, dtype and backend choices shared by the commands, training and evaluation (below the CLI)."""

from __future__ import annotations

import torch

from natsl.errors import NatslError
from natsl.ops import resolve_backend

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def pick_device(name: str | None) -> torch.device:
    """`--device`: cuda when there is one, else cpu."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NatslError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NatslError(f"--device {name} asked for, but this machine has no CUDA GPU; use --device cpu")
    return device


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`--dtype`: bf16 on CUDA, fp32 on the CPU by default."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise NatslError(f"unknown dtype {name!r}: use one of fp32, bf16, fp16")
    return DTYPES[name]


def pick_backend(name: str | None, device: torch.device) -> str:
    """`--backend`: Triton kernels on CUDA, the chunked PyTorch form on the CPU by default
    (`natsl.ops.default_backend`)."""
    from natsl.ops import default_backend

    if name is None or name == "auto":
        name = default_backend(device, command=True)
    # What the backend needs (Triton, on a CPU its interpreter) is checked here, before any work starts
    # and outside torch.compile, which never runs that check (natsl.ops.resolve_backend).
    return resolve_backend(name, device)


def check_length(option: str, length: int, limit: int, source) -> None:
    """One rule for every command: a length beyond the model's `max_seq_len` is refused before any work."""
    if length > limit:
        raise NatslError(f"{option} {length} is beyond the max_seq_len {limit} of {source}; lower {option}")


def check_keeps_natsl(keep_fraction: float | None, recipe, source, flag: str = "--keep-fraction") -> None:
    """Refuse --keep-fraction for a model without NAtS-L layers: it forces their kept blocks only, and a
    report would record a budget that nothing applied.

    Args:
        keep_fraction: the option's value (None: not given).
        recipe: the model's recipe (natsl.config.Recipe).
        source: the checkpoint or recipe, for the error line.
        flag: the option that asked for it.
    """
    if keep_fraction is not None and "natsl" not in recipe.model.layer_types():
        kinds = ", ".join(sorted(set(recipe.model.layer_types())))
        raise NatslError(f"{flag} forces the kept blocks of NAtS-L layers, and {str(source)!r} has none "
                         f"(its layers: {kinds}); drop {flag}")


def checkpoint_recipe_of(path):
    """(folder, recipe) of a checkpoint or run folder, read from its config.json without loading weights."""
    from natsl.checkpoint import checkpoint_recipe, read_config, resolve_checkpoint_folder

    folder = resolve_checkpoint_folder(path)
    return folder, checkpoint_recipe(folder, read_config(folder))


def on_cuda(device: str | None) -> bool:
    """Whether `--device` (None / auto: cuda when there is one) runs on a GPU; for the defaults that
    fit the device."""
    return pick_device(device).type == "cuda"
