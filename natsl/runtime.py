"""Device, dtype, backend and CPU-thread choices shared by the commands, training and evaluation (below the CLI)."""

from __future__ import annotations

import os
from typing import Optional

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
    return pick_backend_why(name, device)[0]


def pick_backend_why(name: str | None, device: torch.device) -> tuple[str, str]:
    """`pick_backend` and what chose it (natsl.inference.kernel_table prints it).

    Args:
        name: the --backend option (None or "auto": the default).
        device: the command's device.

    Returns:
        (backend, why): why "--backend" or the default rule for commands.
    """
    from natsl.ops import default_backend

    why = "--backend"
    if name is None or name == "auto":
        name = default_backend(device, command=True)
        why = "default for commands: fast on CUDA, chunked on the CPU"
    # What the backend needs (Triton, on a CPU its interpreter) is checked here, before any work starts
    # and outside torch.compile, which never runs that check (natsl.ops.resolve_backend).
    return resolve_backend(name, device), why


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
    from natsl.models.registry import any_routed

    if keep_fraction is not None and not any_routed(recipe.model):
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


def cpu_threads(requested: Optional[int]) -> tuple[int, str]:
    """The CPU threads a command runs its model on: `--threads`, else OMP_NUM_THREADS, else 1.

    natsl's CPU runs are smoke runs of small models, whose ops are too small to gain from threads; on a
    shared machine OpenMP threads that wait for each other make a step or a decoded token many times
    slower, and their timings noise.

    Args:
        requested: `--threads` (None: not given).
    Returns:
        (count, where it came from: "--threads", "OMP_NUM_THREADS" or "default"); a count below 1 or
        above 4x the usable CPUs (OpenMP would start them all) is refused with a NatslError.
    """
    if requested is not None:
        if requested < 1:
            raise NatslError(f"--threads must be at least 1, got {requested}")
        count, source, fix = requested, "--threads", "pass"
    else:
        env = os.environ.get("OMP_NUM_THREADS", "")
        if not (env.isdigit() and int(env) > 0):
            return 1, "default"
        count, source, fix = int(env), "OMP_NUM_THREADS", "set OMP_NUM_THREADS to"
    limit = 4 * usable_cpus()
    if count > limit:
        raise NatslError(f"{source} {count} is more than 4x the {usable_cpus()} CPUs this process may use; "
                         f"{fix} at most {limit}")
    return count, source


def set_cpu_threads(requested: Optional[int], device: torch.device) -> str:
    """Set torch's CPU thread count (`cpu_threads`) where it matters: on the CPU always, on a GPU only
    when `--threads` asks.

    Args:
        requested: `--threads` (None: OMP_NUM_THREADS, else 1).
        device: the device the command runs its model on.
    Returns:
        What was set and why, for the command's output, e.g. "1 CPU thread of 8 (default; --threads N to
        change)"; "" where nothing was set.
    """
    if device.type != "cpu" and requested is None:
        return ""
    count, source = cpu_threads(requested)
    torch.set_num_threads(count)
    why = source if source == "--threads" else f"{source}; --threads N to change"
    return f"{count} CPU thread{'s' if count > 1 else ''} of {usable_cpus()} ({why})"


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share, not the whole machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
