"""`OUT/metrics.jsonl` (one JSON record per step, plus eval records) and the `metrics.png` loss curve
(beside it, the kept fraction per NAtS-L layer and routing group, and the router keep bias when it is on)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from natsl.atomic import write_text as atomic_write_text
from natsl.files import os_error_at, read_json_records


class MetricsLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = None

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return read_json_records(self.path)  # lines cut short by a crash (or not natsl's) are skipped

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
        """Training loss per step and validation loss, and (with NAtS-L layers) the kept fraction per
        layer and routing group over training, so a router that collapses to constant routes shows;
        written atomically as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        train = [(r["step"], r["loss"]) for r in records if "loss" in r and _finite(r["loss"])]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and _finite(r["val_loss"])]
        routes = keep_series(records)
        biases = group_series(records, "router_bias")
        panels = 1 + bool(routes) + bool(biases)
        fig, axes = plt.subplots(1, panels, figsize=(2 + 5 * panels, 4), dpi=100, squeeze=False)
        ax = axes[0][0]
        if train:
            ax.plot(*zip(*train), label="train loss", linewidth=1)
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        if routes:
            ax = axes[0][1]
            for label, points in routes.items():
                ax.plot(*zip(*points), label=label, linewidth=1)
            ax.set_xlabel("step")
            ax.set_ylabel("kept fraction (softmax KV)")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title("routing per NAtS-L layer / group")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
        if biases:  # the keep bias that holds each group near model.router_keep_target
            ax = axes[0][-1]
            for label, points in biases.items():
                ax.plot(*zip(*points), label=label, linewidth=1)
            ax.set_xlabel("step")
            ax.set_ylabel("keep-score bias")
            ax.set_title("router keep bias per layer / group")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
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


def keep_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{"layer L group G": [(step, kept fraction)]} from the step records' `keep_groups` (or, for
    records written before it existed, {"layer L": ...} from `keep`)."""
    out = group_series(records, "keep_groups")
    for r in records:
        if "loss" in r and not isinstance(r.get("keep_groups"), dict) and isinstance(r.get("keep"), dict):
            for layer, value in r["keep"].items():
                if _finite(value):
                    out.setdefault(f"layer {layer}", []).append((r["step"], value))
    return out


def group_series(records: list[dict], field: str) -> dict[str, list[tuple[int, float]]]:
    """{"layer L group G": [(step, value)]} from the step records' per-layer, per-group `field`
    (`keep_groups`; `router_bias`, logged when model.router_keep_target is set)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if "loss" in r and isinstance(r.get(field), dict):
            for layer, groups in r[field].items():
                for g, value in enumerate(groups):
                    if _finite(value):
                        out.setdefault(f"layer {layer} group {g}", []).append((r["step"], value))
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
