"""Where NAtS-L keeps its KV: per layer and routing group (paper Fig. 5), over the position in
the sequence (Fig. 6), and the KV memory that follows compared with a Transformer.

Each NAtS-L layer stores `last_keep [B, NB, H]` of its last forward: 1 where block b of routing
group h stays in softmax memory. Memory is counted as the incremental cache holds it after
reading T tokens: the KV of the kept complete blocks plus the tokens of the current (unfinished)
block, for every softmax head of the layer, against T tokens of KV for a Transformer layer with the
same softmax heads.
"""

from __future__ import annotations

import numpy as np
import torch

from natsl.errors import NatslError
from natsl.eval.common import final_hidden_states


@torch.inference_mode()
def collect_keep(model, wins: list[np.ndarray], device, progress: bool = True, desc: str = "routing",
                 on_first=None) -> dict[int, np.ndarray]:
    """Run every window through the model; {layer index: keep [num_windows, NB, H]} (float 0/1).
    `on_first(seconds)` is called once the first window is done (for an estimate of the rest)."""
    import time

    from tqdm import tqdm

    layers = model.natsl_layers()
    if not layers:
        raise NatslError("the checkpoint has no NAtS-L layers, so there is no routing to inspect")
    lengths = {len(w) for w in wins}
    if len(lengths) != 1:
        raise NatslError(f"routing windows must share one length, got {sorted(lengths)}")
    keeps: dict[int, list[np.ndarray]] = {i: [] for i in layers}
    started = time.perf_counter()
    for number, win in enumerate(tqdm(wins, desc=desc, unit="window", disable=not progress, leave=False)):
        ids = torch.as_tensor(win, dtype=torch.long, device=device)[None]
        for layer in layers.values():
            layer.last_keep = None
        with final_hidden_states(model):
            model(ids)
        for i, layer in layers.items():
            if layer.last_keep is None:
                raise NatslError(f"NAtS-L layer {i} recorded no routing (last_keep) in its forward")
            keeps[i].append(layer.last_keep.float().cpu().numpy())
        if number == 0 and on_first is not None:
            on_first(time.perf_counter() - started)
    return {i: np.concatenate(v, axis=0) for i, v in keeps.items()}


def time_bins(num_blocks: int, bins: int) -> list[tuple[int, int]]:
    """Split block indices 0..num_blocks-1 into at most `bins` contiguous, near-equal ranges."""
    bins = max(1, min(bins, num_blocks))
    edges = np.linspace(0, num_blocks, bins + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def kv_memory(keep: np.ndarray, seq_len: int, config, elem_bytes: int) -> dict:
    """Cache bytes of one NAtS-L layer after `seq_len` tokens, mean over windows.

    keep [N, NB, H]. Per token, a routing group holds R softmax heads of key dim K/R and value dim
    V/R, i.e. K + V numbers; the Transformer with the same H*R softmax heads holds H*(K+V) per token."""
    c = config.block_size
    complete = seq_len // c
    current = seq_len - complete * c
    per_token_group = (config.head_k_dim + config.head_v_dim) * elem_bytes
    kept_blocks = keep[:, :complete, :].sum(axis=1)  # [N, H]
    kv_tokens = kept_blocks * c + current  # [N, H] tokens of KV per group
    natsl_bytes = float((kv_tokens * per_token_group).sum(axis=1).mean())
    transformer_bytes = float(seq_len * config.num_heads * per_token_group)
    state_bytes = float(config.num_heads * config.head_k_dim * config.head_v_dim * 4)  # fp32 GDN state
    return {"kv_bytes": natsl_bytes, "transformer_kv_bytes": transformer_bytes,
            "kv_ratio": natsl_bytes / transformer_bytes if transformer_bytes else None,
            "kept_tokens_per_group": [float(x) for x in kv_tokens.mean(axis=0)],
            "gdn_state_bytes": state_bytes}


def summarize_dataset(name: str, keeps: dict[int, np.ndarray], seq_len: int, config, elem_bytes: int,
                      bins: int) -> dict:
    layers = sorted(keeps)
    nb = next(iter(keeps.values())).shape[1]
    ranges = time_bins(nb, bins)
    c = config.block_size
    out = {"name": name, "windows": int(next(iter(keeps.values())).shape[0]), "layers": []}
    totals = {"kv_bytes": 0.0, "transformer_kv_bytes": 0.0, "gdn_state_bytes": 0.0}
    for i in layers:
        keep = keeps[i]
        groups = keep.mean(axis=(0, 1))  # [H]
        over_time = [[float(keep[:, a:b, h].mean()) for (a, b) in ranges] for h in range(keep.shape[2])]
        mem = kv_memory(keep, seq_len, config, elem_bytes)
        for key in totals:
            totals[key] += mem[key]
        out["layers"].append({"layer": i, "keep_fraction": float(keep.mean()),
                              "group_keep_fraction": [float(g) for g in groups],
                              "keep_over_time": over_time, "memory": mem})
    out["keep_fraction"] = float(np.mean([keeps[i].mean() for i in layers]))
    out["time_bins"] = [[a * c, min(b * c, seq_len)] for a, b in ranges]
    totals["kv_ratio"] = totals["kv_bytes"] / totals["transformer_kv_bytes"] if totals["transformer_kv_bytes"] else None
    out["memory"] = totals
    return out


def plot_groups(datasets: list[dict], path, title: str):
    """Fig. 5 as heatmaps: one panel per dataset, rows = NAtS-L layers, columns = routing groups."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    n = len(datasets)
    rows = len(datasets[0]["layers"])
    cols = len(datasets[0]["layers"][0]["group_keep_fraction"])
    fig, axes = plt.subplots(1, n, figsize=(2.0 + (0.8 * cols + 1.6) * n, 1.6 + 0.45 * rows), squeeze=False,
                             layout="constrained")
    image = None
    for ax, ds in zip(axes[0], datasets):
        grid = [layer["group_keep_fraction"] for layer in ds["layers"]]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
        ax.set_xticks(range(cols), [str(h) for h in range(cols)])
        ax.set_yticks(range(rows), [f"layer {layer['layer']}" for layer in ds["layers"]])
        for r, row in enumerate(grid):
            for col, v in enumerate(row):
                ax.text(col, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v > 0.6 else "black")
        ax.set_xlabel("routing group")
        ax.set_title(f"{ds['name']} (keep {ds['keep_fraction']:.2f})", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.colorbar(image, ax=list(axes[0]), fraction=0.03, label="fraction of blocks in softmax memory")
    return save_figure(fig, path)


def plot_time(datasets: list[dict], path, title: str):
    """Fig. 6 as heatmaps: one panel per dataset, rows = (layer, group), columns = position bins."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    n = len(datasets)
    labels = [f"L{layer['layer']} g{h}" for layer in datasets[0]["layers"] for h in range(len(layer["keep_over_time"]))]
    fig, axes = plt.subplots(1, n, figsize=(1.5 + 4.5 * n, 1.6 + 0.3 * len(labels)), squeeze=False,
                             layout="constrained")
    image = None
    for ax, ds in zip(axes[0], datasets):
        grid = [row for layer in ds["layers"] for row in layer["keep_over_time"]]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto", interpolation="nearest")
        ticks = list(range(len(ds["time_bins"])))
        step = max(1, len(ticks) // 6)
        ax.set_xticks(ticks[::step], [str(ds["time_bins"][t][0]) for t in ticks[::step]])
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("position (token where the bin starts)")
        ax.set_title(ds["name"], fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.colorbar(image, ax=list(axes[0]), fraction=0.03, label="fraction of blocks in softmax memory")
    return save_figure(fig, path)
