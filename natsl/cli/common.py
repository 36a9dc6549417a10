"""Helpers shared by the subcommands: device, dtype and backend choices."""

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
    """`--backend`: Triton kernels on CUDA, the chunked PyTorch form on the CPU by default."""
    if name is None or name == "auto":
        name = "fast" if device.type == "cuda" else "chunked"
    if name not in ("reference", "chunked", "fast"):
        raise NatslError(f"unknown backend {name!r}: use reference, chunked or fast")
    # What the backend needs (Triton, on a CPU its interpreter) is checked here, before any work starts
    # and outside torch.compile, which never runs that check (natsl.ops.resolve_backend).
    return resolve_backend(name, device)
