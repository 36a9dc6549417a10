"""Pieces the evaluation commands share: loading a checkpoint for evaluation, the final hidden
states without the full-vocabulary logits, and atomic JSON / PNG writers."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from natsl.errors import NatslError


@dataclass
class EvalModel:
    model: torch.nn.Module
    tokenizer: object | None
    folder: Path
    name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def recipe(self):
        return self.model.recipe


def checkpoint_name(folder: Path) -> str:
    """A short label for plots: `run/step_N` for a training step, else the folder name."""
    folder = Path(folder).resolve()
    if folder.name.startswith("step_"):
        run = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
        return f"{run.name}/{folder.name}"
    return folder.name


def load_eval_model(path, device=None, dtype=None, backend=None) -> EvalModel:
    """A checkpoint ready for evaluation: eval mode, on `device` in `dtype`, ops on `backend`
    (the `natsl.runtime` defaults: cuda/bf16/fast when there is a GPU, else cpu/fp32/chunked)."""
    from natsl.checkpoint import load_checkpoint, resolve_checkpoint_folder
    from natsl.runtime import pick_backend, pick_device, pick_dtype

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    chosen = pick_backend(backend, dev)
    folder = resolve_checkpoint_folder(path)
    model, tokenizer = load_checkpoint(folder, device=dev, dtype=dt)
    model.set_backend(chosen)
    model.eval()
    return EvalModel(model, tokenizer, folder, checkpoint_name(folder), dev, dt)


@contextlib.contextmanager
def final_hidden_states(model):
    """Within the block, `model(ids)` returns the final normed hidden states [B, T, d] instead of
    logits; the real output head is yielded so callers can apply it to the positions they need.
    (A 65536-token window of 32000-way logits is 8 GB in fp32; its hidden states are not.)"""
    head = model.lm_head
    model.lm_head = nn.Identity()
    try:
        yield head
    finally:
        model.lm_head = head


def _atomic_write(path: Path, write) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json(path, obj) -> Path:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=2)
            fh.write("\n")
    return _atomic_write(Path(path), write)


def write_jsonl(path, rows) -> Path:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return _atomic_write(Path(path), write)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> Path:
    plt = pyplot()
    try:
        return _atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))
    finally:
        plt.close(fig)


def prepare_out_dir(out) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NatslError(f"--out {str(out)!r} is a file; pass a folder for the results")
    out.mkdir(parents=True, exist_ok=True)
    return out
