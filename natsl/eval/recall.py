"""`natsl eval-recall`: answer accuracy of a checkpoint on synthetic recall (MQAR, passkey) per
(sequence length, number of pairs), and the kept fraction of each NAtS-L layer and routing group on
the same inputs.

Samples come from the task generator of natsl.data.tasks on its evaluation stream (never a training
sample), a function of --seed: two checkpoints see the same inputs. Accuracy counts argmax
predictions at the answer positions (Zoology's accuracy), plus the fraction of samples with every
answer right. One full-sequence forward per batch; logits only at the answers.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from natsl.data.grid import eval_grid
from natsl.data.tasks import EVAL_STREAM, IGNORE, Part, TaskSpec, answer_hits, batch_generator, make_batch
from natsl.eval.common import final_hidden_states


def recall_grid(em, task: str | None, length_list: list[int] | None, count_list: list[int] | None,
                vocab: int | None) -> tuple[TaskSpec, list[tuple[int, int]]]:
    """The task and (length, count) points to evaluate `em` on (natsl.data.grid.eval_grid of its recipe)."""
    return eval_grid(em.recipe, task, length_list, count_list, vocab)


@torch.inference_mode()
def evaluate_point(model, spec: TaskSpec, length: int, count: int, samples: int, batch_size: int, seed: int,
                   device) -> dict:
    """Accuracy at one (length, count) and the kept fraction per NAtS-L layer and group."""
    part = Part(length, count)
    task = TaskSpec(spec.name, spec.vocab, [part], spec.power_a, spec.random_non_queries)
    layers = model.natsl_layers()
    keep_sums = {i: None for i in layers}
    hits = counted = all_right = 0
    for start in range(0, samples, batch_size):
        n = min(batch_size, samples - start)
        indices = list(range(EVAL_STREAM + start, EVAL_STREAM + start + n))
        inputs, targets = make_batch(task, n, length, batch_generator(seed, indices, device), device)
        with final_hidden_states(model) as head:
            hidden = model(inputs)
            h, c = answer_hits(hidden, head.weight, targets)
            mask = targets != IGNORE
            pred = torch.full_like(targets, IGNORE)
            pred[mask] = (hidden[mask].to(head.weight.dtype) @ head.weight.t()).argmax(-1)
        hits, counted = hits + h, counted + c
        all_right += int(((pred == targets) | ~mask).all(dim=1).sum())
        for i, layer in layers.items():
            if layer.last_keep is not None:
                per_group = layer.last_keep.float().sum(dim=(0, 1)).cpu().numpy()  # [H] kept blocks
                blocks = layer.last_keep.shape[0] * layer.last_keep.shape[1]
                prev = keep_sums[i]
                keep_sums[i] = (per_group, blocks) if prev is None else (prev[0] + per_group, prev[1] + blocks)
    keep = {}
    for i, value in keep_sums.items():
        if value is not None:
            groups = value[0] / value[1]
            keep[str(i)] = {"keep_fraction": float(groups.mean()), "group_keep_fraction": [float(g) for g in groups]}
    return {"seq_len": length, "count": count, "samples": samples, "answers": counted,
            "accuracy": hits / counted if counted else None, "sample_accuracy": all_right / samples,
            "keep": keep}


def evaluate_recall(em, spec: TaskSpec, points: list[tuple[int, int]], samples: int, batch_size: int, seed: int,
                    progress: bool = True, deadline: Optional[float] = None) -> dict:
    """Accuracy and kept fractions at each (length, count) point. `deadline` (a time.time()): no point is
    started after it; the report's `complete` says whether every point was evaluated."""
    import time

    from tqdm import tqdm

    results = []
    bar = tqdm(points, desc="recall", unit="point", disable=not progress, leave=False)
    for length, count in bar:
        if deadline is not None and time.time() >= deadline:
            break
        bar.set_postfix_str(f"T={length} n={count}")
        results.append(evaluate_point(em.model, spec, length, count, samples, batch_size, seed, em.device))
    accs = [r["accuracy"] for r in results if r["accuracy"] is not None]
    keeps = [layer["keep_fraction"] for r in results for layer in r["keep"].values()]
    return {"task": spec.name, "vocab": spec.vocab, "count_name": "pairs" if spec.name == "mqar" else "digits",
            "power_a": spec.power_a if spec.name == "mqar" else None, "points": results,
            "complete": len(results) == len(points),
            "mean_accuracy": float(np.mean(accs)) if accs else None,
            "mean_keep_fraction": float(np.mean(keeps)) if keeps else None}


def format_table(report: dict) -> str:
    name = report["count_name"]
    lines = [f"{'seq_len':>8} {name:>6} {'accuracy':>9} {'all-right':>9}  kept fraction per layer [groups]"]
    for p in report["points"]:
        keep = "  ".join(f"L{i} {k['keep_fraction']:.2f} [{' '.join(f'{g:.2f}' for g in k['group_keep_fraction'])}]"
                         for i, k in p["keep"].items()) or "-"
        lines.append(f"{p['seq_len']:>8} {p['count']:>6} {p['accuracy']:>9.3f} {p['sample_accuracy']:>9.3f}  {keep}")
    return "\n".join(lines)


def plot_recall(report: dict, path, title: str):
    """Accuracy heatmap over (seq_len, count) and the kept fraction per layer/group at each point."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    points = report["points"]
    lengths = sorted({p["seq_len"] for p in points})
    counts = sorted({p["count"] for p in points})
    grid = np.full((len(lengths), len(counts)), np.nan)
    for p in points:
        grid[lengths.index(p["seq_len"]), counts.index(p["count"])] = p["accuracy"]
    labels = sorted({(i, g) for p in points for i, k in p["keep"].items() for g in range(len(k["group_keep_fraction"]))},
                    key=lambda t: (int(t[0]), t[1]))
    cols = 2 if labels else 1
    fig, axes = plt.subplots(1, cols, figsize=(5.5 * cols, 4), squeeze=False)
    ax = axes[0][0]
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(counts)), [str(c) for c in counts])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel(report["count_name"])
    ax.set_ylabel("sequence length")
    for (r, c), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
    ax.set_title(f"{report['task']} accuracy")
    fig.colorbar(im, ax=ax)
    if labels:
        ax = axes[0][1]
        xs = np.arange(len(points))
        width = 0.8 / len(labels)
        for j, (i, g) in enumerate(labels):
            ys = [p["keep"].get(i, {"group_keep_fraction": [np.nan] * (g + 1)})["group_keep_fraction"][g] for p in points]
            ax.bar(xs + j * width, ys, width, label=f"layer {i} group {g}")
        ax.set_xticks(xs + 0.4 - width / 2, [f"{p['seq_len']}/{p['count']}" for p in points], rotation=45, fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("kept fraction (softmax KV)")
        ax.set_title("routing on the same inputs")
        # beside the bars, not over them (a kept fraction near 1 fills the axes to the top); a long list of
        # layers and groups wraps into columns; the saved figure grows to hold it (save_figure's tight box)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                  ncol=-(-len(labels) // 16))
    fig.suptitle(title)
    return save_figure(fig, path)
