"""The report's PNG figures: validation curves, loss against position (Fig. 3), needle retrieval against
length (Table 2), the kept fraction per layer, group and source (Figs. 5/6) and during training."""

from __future__ import annotations

from pathlib import Path

from natsl.miniature.claims import TEACHER_FORCED
from natsl.miniature.ladder import is_seed, ordered
from natsl.miniature.results import as_number

# ----------------------------------------------------------------------------- figures


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> str:
    """Label, grid and legend one line plot, write it (atomically) and close it; its file name."""
    from natsl.eval.common import save_figure

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path).name


def write_figures(folder: Path, t1, ppl, ruler, routing, over_training=None) -> list[str]:
    """The report's PNGs (each where its numbers exist); returns their file names."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    written = []
    curves = {n: r["val_curve"] for n, r in t1["rows"].items() if r.get("val_curve")}
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name in ordered(curves):
            tokens, losses = zip(*curves[name])
            ax.plot([t / 1e6 for t in tokens], losses, marker=".", label=name)
        if t1["matched_tokens"] is not None:
            ax.axvline(t1["matched_tokens"] / 1e6, color="gray", linestyle=":",
                       label=f"reached by all ({t1['matched_tokens'] / 1e6:.1f}M)")
        written.append(_finish(fig, ax, "tokens trained (millions)", "validation loss",
                               "validation loss during training (Table 1 in miniature)", folder / "val_curves.png"))
    if ppl:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        train = None
        for name in ordered(ppl):
            xs, ys = zip(*ppl[name]["curve"]) if ppl[name]["curve"] else ((), ())
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
            train = train or ppl[name]["train_seq_len"]
        if train:
            ax.axvline(train, color="gray", linestyle=":", label=f"training length {train}")
        written.append(_finish(fig, ax, "position in window (tokens of context)", "loss (nats, per bucket)",
                               "loss against position (Fig. 3 in miniature)", folder / "loss_vs_position.png"))
    if ruler:
        # one panel per score (string match, then the teacher-forced ones), each on its own scale: a string match
        # at 0 everywhere would squash the others; one colour per system in every panel, one legend beside them
        panels = [(None, "string match")] + [(m.key, m.label) for m in TEACHER_FORCED
                                              if any(r.get(m.key) for r in ruler.values())]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 2.2, 4.2), squeeze=False)
        colours = {name: f"C{i % 10}" for i, name in enumerate(ordered(ruler))}
        for ax, (key, what) in zip(axes[0], panels):
            for name in ordered(ruler):
                part = ruler[name] if key is None else ruler[name].get(key) or {}
                pts = sorted((int(n), v) for n, v in (part.get("lengths") or {}).items() if as_number(v) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colours[name], label=name,
                            linestyle="--" if is_seed(name) else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("mean over tasks")
            ax.set_title(what, fontsize=10)
            ax.grid(alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=8)
        fig.suptitle("needle retrieval against length (Table 2 in miniature; seeds dashed)")
        fig.tight_layout(rect=(0, 0, 1 - 1.9 / (4.2 * len(panels) + 2.2), 1))
        from natsl.eval.common import save_figure

        written.append(save_figure(fig, folder / "ruler_by_length.png").name)
    if routing:
        names = ordered(routing)
        fig, axes = _map_panels(plt, len(names), max(3.6, 0.22 * max(
            sum(len(layer["group_keep_fraction"] or []) for layer in
                (routing[n]["datasets"] or [{"layers": []}])[0]["layers"]) for n in names)))
        image = None
        for ax, name in zip(axes.flat, names):
            datasets = routing[name]["datasets"]
            labels = [f"L{layer['layer']} g{g}" for layer in (datasets[0]["layers"] if datasets else [])
                      for g in range(len(layer["group_keep_fraction"] or []))]
            grid = [[frac for layer in ds["layers"] for frac in layer["group_keep_fraction"] or []] for ds in datasets]
            grid = [list(col) for col in zip(*grid)] if grid else [[0.0]]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
            ax.set_xticks(range(len(datasets)), [str(ds["name"])[:18] for ds in datasets], rotation=45, ha="right",
                          fontsize=9)
            ax.set_yticks(range(len(labels)), labels, fontsize=9)
            ax.set_title(name, fontsize=11)
        fig.suptitle("fraction of blocks kept per NAtS-L layer and group, per source (Figs. 5/6 in miniature)",
                     fontsize=12)
        fig.colorbar(image, ax=list(axes.flat), fraction=0.03, label="kept fraction")
        written.append(save_figure(fig, folder / "routing_by_source.png").name)
    if over_training:
        written.append(_routing_over_training_plot(plt, folder, over_training))
    return written


def _map_panels(plt, count: int, height: float):
    """A figure of `count` map panels, three a row, each `height` inches tall (enough for its (layer, group)
    labels at a readable size); the unused panels hidden. Returns (figure, axes array)."""
    cols = min(3, count)
    rows_n = -(-count // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(1.5 + 4.2 * cols, 1.4 + height * rows_n), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, axes


def _routing_over_training_plot(plt, folder: Path, over_training: dict) -> str:
    """Kept fraction per (layer, group) against tokens trained: one map per NAtS-L checkpoint."""
    from natsl.eval.common import save_figure

    names = ordered(over_training)
    fig, axes = _map_panels(plt, len(names), max(3.0, 0.22 * max(len(over_training[n]["labels"]) for n in names)))
    image = None
    for ax, name in zip(axes.flat, names):
        run = over_training[name]
        grid = [list(col) for col in zip(*run["keep"])]
        millions = [t / 1e6 for t in run["tokens"]]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto", interpolation="nearest",
                          extent=(0, millions[-1], len(run["labels"]) - 0.5, -0.5))
        ax.set_yticks(range(len(run["labels"])), run["labels"], fontsize=9)
        ax.set_xlabel("tokens trained (millions)")
        ax.set_title(name, fontsize=11)
    fig.suptitle("fraction of blocks kept per NAtS-L layer and group during training (Fig. 5 in miniature)",
                 fontsize=12)
    fig.colorbar(image, ax=list(axes.flat), fraction=0.03, label="kept fraction")
    return save_figure(fig, folder / "routing_over_training.png").name
