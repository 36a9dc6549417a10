"""A sweep's language-model tasks (a `natsl tokenize` folder rather than task:...): each (task, system,
width)'s learning rates ranked by their final validation loss, and the figure of them.

A run's record (natsl.training.sweep.run_record) holds `val_loss` (its last validation loss: the one at
its final step when it trained to its end), `perplexity` and `val_curve` ([[tokens trained, loss], ...]).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

LM_NOTE = ("best_lm: per (task, system, width), the learning rates ranked by val_loss, the mean over the seeds "
           "that finished (seeds_finished of seeds_total; when none has, over their last validation losses, "
           "loss_from) of the final validation loss; lowest first, best_lr the lowest. short: seeds that stopped "
           "before max_steps in a sweep matched in steps")


def _finite(value) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def validation_of(records: list[dict], tokens_per_step: int) -> dict:
    """A language-model run's validation from its metrics.jsonl records.

    Args:
        records: the run's metrics.jsonl lines, parsed.
        tokens_per_step: its recipe's train.tokens_per_step.
    Returns:
        {"val_loss": the last validation loss (None: none yet), "perplexity": exp of it,
         "val_curve": [[tokens trained, validation loss], ...]}.
    """
    curve = [[r["step"] * tokens_per_step, float(r["val_loss"])] for r in records
             if _finite(r.get("val_loss")) is not None and isinstance(r.get("step"), int)]
    loss = curve[-1][1] if curve else None
    return {"val_loss": loss, "perplexity": perplexity(loss), "val_curve": curve}


def perplexity(loss: Optional[float]) -> Optional[float]:
    """exp(loss), inf past what a float holds; None for no loss."""
    if loss is None:
        return None
    return math.exp(loss) if loss < 700 else math.inf


def lr_point(records: list[dict]) -> Optional[dict]:
    """The runs of one (task, system, width, lr), one per seed, as one point: the mean, min and max final
    validation loss over the seeds that finished (others are missing, not counted); when none has
    finished, over the seeds' last validation losses (`loss_from: last evaluation`). None: no loss yet."""
    finished = [r for r in records if r.get("status") == "done" and _finite(r.get("val_loss")) is not None]
    counted = finished or [r for r in records if _finite(r.get("val_loss")) is not None]
    if not counted:
        return None
    losses = [float(r["val_loss"]) for r in counted]
    mean = sum(losses) / len(losses)
    return {"lr": records[0]["lr"], "val_loss": mean, "val_loss_min": min(losses), "val_loss_max": max(losses),
            "perplexity": perplexity(mean), "loss_from": "final" if finished else "last evaluation",
            "seeds_finished": len(finished), "seeds_total": len(records),
            "short": sum(bool(r.get("short")) for r in counted), "run": counted[0]["id"],
            "val_curve": counted[0].get("val_curve") or [],
            "parameters": next((r["parameters"] for r in records if r.get("parameters")), None),
            "seeds": [{"seed": r["seed"], "val_loss": _finite(r.get("val_loss")), "steps": r.get("steps"),
                       "tokens": r.get("tokens"), "short": bool(r.get("short")), "status": r.get("status"),
                       "run": r["id"]} for r in records]}


def best_lm_points(records: list[dict]) -> list[dict]:
    """Per (task, system, width), its learning rates ranked by mean final validation loss, lowest first
    (rates with a finished seed before rates without; the first rate listed wins a tie).

    Args:
        records: run records of language-model runs (run_record's).
    Returns:
        [{"task", "system", "width", "best_lr", "val_loss", "perplexity", "run", "val_curve", ...,
          "ranking": [lr_point, ...]}], one per (task, system, width) with a loss, the best rate's point
        spread into it.
    """
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for r in records:
        groups.setdefault((r["task"], r["system"], r["width"]), {}).setdefault(r["lr"], []).append(r)
    points = []
    for (task, system, width), by_lr in sorted(groups.items()):
        ranked = [p for p in (lr_point(seeds) for seeds in by_lr.values()) if p is not None]
        # sorted is stable: equal keys keep the order the rates were listed in
        ranked.sort(key=lambda p: (p["loss_from"] != "final", p["val_loss"]))
        if ranked:
            best = ranked[0]
            points.append({"task": task, "system": system, "width": width, "best_lr": best["lr"], **best,
                           "ranking": [{k: v for k, v in p.items() if k not in ("val_curve", "seeds")}
                                       for p in ranked]})
    return points


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure as a PNG atomically (natsl.atomic.save_figure) and close it; legends placed outside
    the axes are kept (bbox_inches="tight")."""
    from natsl.atomic import save_figure as save

    fig.tight_layout()
    save(fig, path, dpi=110, bbox_inches="tight")


def plot_lm_summary(summary: dict, path: Path) -> None:
    """Per language-model task, validation loss against learning rate (log axis, one line per system,
    the best rate ringed) and, beside it, the validation-loss curve over tokens of each system's best rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = summary.get("best_lm") or []
    tasks = sorted({p["task"] for p in best}) or ["(no results yet)"]
    colors = {name: f"C{i}" for i, name in enumerate(sorted({p["system"] for p in best}))}
    widths = {p["width"] for p in best}
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4.2 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        ax, cx = axes[row]
        for p in sorted((p for p in best if p["task"] == task), key=lambda p: (p["system"], p["width"])):
            label = p["system"] + (f" (d{p['width']})" if len(widths) > 1 else "")
            color = colors[p["system"]]
            ranked = sorted(p["ranking"], key=lambda q: q["lr"])
            ax.plot([q["lr"] for q in ranked], [q["val_loss"] for q in ranked], "o-", color=color, label=label)
            ax.plot([p["best_lr"]], [p["val_loss"]], "o", markersize=12, markerfacecolor="none", color=color)
            if p["val_curve"]:
                tokens, losses = zip(*p["val_curve"])
                cx.plot([t / 1e6 for t in tokens], losses, "-", marker=".", color=color,
                        label=f"{label}, lr {p['best_lr']:g}")
        ax.set_xscale("log")
        rates = sorted({q["lr"] for p in best if p["task"] == task for q in p["ranking"]})
        if rates:  # a tick at each swept rate, labelled (a log axis labels only its decades)
            ax.set_xticks(rates, [f"{r:.0e}".replace("e-0", "e-") for r in rates])
            ax.minorticks_off()
        ax.set_xlabel("learning rate")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{task}: validation loss by learning rate (best ringed)")
        cx.set_xlabel("tokens trained (millions)")
        cx.set_ylabel("validation loss")
        cx.set_title(f"{task}: each system at its best learning rate")
        for a in (ax, cx):
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:  # below the axes: inside, it hid points and curves
                a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    seeds = len(summary.get("seeds") or [0])
    fig.suptitle(f"{summary['name']}: learning-rate sweep{f' (mean of {seeds} seeds)' if seeds > 1 else ''}")
    save_figure(fig, path)
