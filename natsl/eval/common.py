"""Pieces the evaluation commands share: loading a checkpoint for evaluation, the final hidden
states without the full-vocabulary logits, and the PNG writer of the evaluation figures."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from natsl.errors import NatslError, NonFiniteError


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
    """A short label for plots: `run/step_N` for a training step, the parent's name for a folder called
    `model` (a sweep run's export RUN/model, natsl.cli.sweep.export_model: they all share that name),
    else the folder name."""
    folder = Path(folder).resolve()
    if folder.name.startswith("step_"):
        run = folder.parent.parent if folder.parent.name == "checkpoints" else folder.parent
        return f"{run.name}/{folder.name}"
    if folder.name == "model":
        return folder.parent.name
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


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> Path:
    """The evaluation figures' PNG, written atomically (`natsl.atomic`); closes the figure."""
    from natsl.atomic import save_figure as save

    return save(fig, path, dpi=120, bbox_inches="tight")


def prepare_out_dir(out) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NatslError(f"--out {str(out)!r} is a file; pass a folder for the results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def human_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def human_count(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return f"{n:.0f}"


def print_estimate(plan: str, total_s: float, measured: str) -> None:
    """The one line a long evaluation prints once its first piece is done: what runs, about how long
    in all (extrapolated from that measured piece, which also carries the start-up), and what was measured."""
    from tqdm import tqdm

    # tqdm.write keeps the line off a progress bar that is being drawn.
    tqdm.write(f"{plan}; about {human_duration(total_s)} in all on this device ({measured})", file=sys.stderr)


def require_finite(values: torch.Tensor, em: EvalModel, what: str) -> None:
    """Refuse non-finite numbers from a model with one line naming its checkpoint."""
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteError(f"checkpoint {str(em.folder)!r} gives non-finite {what} (nan or inf): its weights hold "
                         f"NaN/inf or overflow in {str(em.dtype).replace('torch.', '')}; check the checkpoint or "
                         "try --dtype fp32")
