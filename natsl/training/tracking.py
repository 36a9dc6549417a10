"""Experiment trackers (`train.tracker: tensorboard | wandb | none`): every number of each metrics.jsonl
record, as a scalar at the record's step.

The tracker knows nothing of the metrics themselves: nested records (a dict of per-layer or
per-group values, such as NAtS-L's kept fractions) become one scalar each, named by their path
(`kept_fraction/layer_3/group_1`), so whatever the trainer writes to metrics.jsonl can be watched
evolving. TensorBoard writes event files under OUT/tensorboard (offline by nature); wandb runs in
offline mode under OUT/wandb unless WANDB_MODE says otherwise (`wandb sync` uploads it later;
WANDB_DIR moves it, WANDB_PROJECT names the project, default natsl).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from natsl.errors import NatslError
from natsl.training.metrics import MetricsLog

TRACKERS = ("none", "tensorboard", "wandb")


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) record by path; `step` and booleans left out."""
    out: dict[str, float] = {}
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, bool) or name == "step":
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[name] = float(value)
        elif isinstance(value, (dict, list, tuple)):
            out.update(scalars(value, f"{name}/"))
    return out


class TensorBoardTracker:
    def __init__(self, out: Path, recipe):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise NatslError("train.tracker is tensorboard, but tensorboard is not installed; "
                             "`pip install 'natsl[tracking]'` or set train.tracker: none") from None
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("recipe", f"```\n{recipe.to_dict()}\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, out: Path, recipe):
        try:
            import wandb
        except ImportError:
            raise NatslError("train.tracker is wandb, but wandb is not installed; "
                             "`pip install 'natsl[tracking]'` or set train.tracker: none") from None
        self.wandb = wandb
        # wandb.init's `dir` outranks WANDB_DIR, so pass the run folder only when WANDB_DIR is not set
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "natsl"), name=recipe.name,
                              dir=os.environ.get("WANDB_DIR") or str(out),
                              config=recipe.to_dict(), mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackedMetricsLog(MetricsLog):
    """metrics.jsonl, with every record also sent to a tracker."""

    def __init__(self, path: Path, tracker):
        super().__init__(path)
        self.tracker = tracker

    def write(self, record: dict) -> None:
        super().write(record)
        if "step" in record:
            self.tracker.log(int(record["step"]), scalars(record))

    def close(self) -> None:
        super().close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def metrics_log(path: Path, kind: str, out: Path, recipe) -> MetricsLog:
    """metrics.jsonl, tracked by `kind` (one of TRACKERS; the main rank only should pass a tracker)."""
    if kind == "none":
        return MetricsLog(path)
    if kind not in TRACKERS:
        raise NatslError(f"unknown train.tracker {kind!r}: use one of {', '.join(TRACKERS)}")
    cls = TensorBoardTracker if kind == "tensorboard" else WandbTracker
    return TrackedMetricsLog(path, cls(Path(out), recipe))
