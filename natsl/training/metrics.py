"""`OUT/metrics.jsonl` (one JSON record per step, plus eval records) and the `metrics.png` loss curve."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from natsl.files import atomic_write_text, os_error_at


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = None

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        return out

    def truncate(self, last_step: int) -> None:
        """Drop the records after `last_step` (written by a run that died before its next checkpoint)."""
        kept = [r for r in self.records() if r.get("step", 0) <= last_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def plot(self, png: Path, title: str = "") -> None:
        """Training loss per step and validation loss, written atomically as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        train = [(r["step"], r["loss"]) for r in records if "loss" in r and _finite(r["loss"])]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and _finite(r["val_loss"])]
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        if train:
            ax.plot(*zip(*train), label="train loss", linewidth=1)
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = png.with_name(f".{png.stem}.tmp-{os.getpid()}.png")
        try:
            fig.savefig(tmp)
            os.replace(tmp, png)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise os_error_at(err, png) from None
        finally:
            plt.close(fig)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
