"""Perplexity over full-length windows, bucketed by position (paper Fig. 3), and bits per byte.

Each window is one forward pass from an empty context (no sliding, no carried state), so the loss
of the token at position p is the model's loss with exactly p tokens of context: the per-bucket
curve is the length-extrapolation curve. The first token of a window is only context.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from natsl.eval.common import EvalModel, final_hidden_states, require_finite

LN2 = math.log(2.0)


@torch.inference_mode()
def token_losses(model, ids: torch.Tensor, head_chunk: int = 4096) -> torch.Tensor:
    """ids [1, T] -> the cross-entropy (nats, fp32) of predicting ids[0, 1:] from their prefixes, [T-1].

    The same numbers as training's `cross_entropy(logits[:, :-1], ids[:, 1:])`, computed without
    materialising the [T, vocab] logits at once."""
    with final_hidden_states(model) as head:
        hidden = model(ids)
    t = ids.shape[1]
    out = []
    for start in range(0, t - 1, head_chunk):
        end = min(start + head_chunk, t - 1)
        logits = head(hidden[:, start:end]).float()
        out.append(F.cross_entropy(logits[0], ids[0, start + 1:end + 1], reduction="none"))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


@dataclass
class PplAccumulator:
    """Sums of losses per position bucket (fp64) plus the byte count for bits per byte."""

    bucket: int
    loss_sum: dict = field(default_factory=dict)
    count: dict = field(default_factory=dict)
    total_loss: float = 0.0
    total_tokens: int = 0
    total_bytes: int = 0
    windows: int = 0
    last_position: int = 0

    def add(self, losses: np.ndarray, num_bytes: int | None) -> None:
        """`losses[i]` is the loss of the token at position i + 1 of its window."""
        positions = np.arange(1, len(losses) + 1)
        self.last_position = max(self.last_position, len(losses))
        buckets = positions // self.bucket
        sums = np.bincount(buckets, weights=losses.astype(np.float64))
        counts = np.bincount(buckets)
        for b in np.nonzero(counts)[0]:
            self.loss_sum[int(b)] = self.loss_sum.get(int(b), 0.0) + float(sums[b])
            self.count[int(b)] = self.count.get(int(b), 0) + int(counts[b])
        self.total_loss += float(losses.astype(np.float64).sum())
        self.total_tokens += len(losses)
        if num_bytes is None or self.total_bytes is None:
            self.total_bytes = None
        else:
            self.total_bytes += num_bytes
        self.windows += 1

    def summary(self) -> dict:
        loss = self.total_loss / max(self.total_tokens, 1)
        buckets = []
        for b in sorted(self.count):
            mean = self.loss_sum[b] / self.count[b]
            # A bucket ends at the last position it holds, not past the longest window.
            end = min((b + 1) * self.bucket, self.last_position + 1)
            buckets.append({"start": b * self.bucket, "end": end, "tokens": self.count[b],
                            "loss": mean, "ppl": math.exp(mean)})
        bpb = None
        if self.total_bytes:
            bpb = self.total_loss / LN2 / self.total_bytes
        return {"windows": self.windows, "tokens": self.total_tokens, "loss": loss, "ppl": math.exp(loss),
                "bits_per_token": loss / LN2, "bytes": self.total_bytes, "bits_per_byte": bpb, "buckets": buckets}


def evaluate_windows(em: EvalModel, wins: list[np.ndarray], bucket: int, progress: bool = True,
                     head_chunk: int = 4096, on_first: Callable[[float, int], None] | None = None) -> dict:
    """Loss summary of `em` on `wins` (each a 1-D array of token ids). `on_first(seconds, tokens)` is
    called once the first window is done (for an estimate of the rest). Non-finite losses (NaN
    weights, an overflowing dtype) are refused with one line naming the checkpoint."""
    from tqdm import tqdm

    acc = PplAccumulator(bucket)
    total = sum(len(w) - 1 for w in wins)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"ppl {em.name}", disable=not progress, leave=False)
    started = time.perf_counter()
    try:
        for index, win in enumerate(wins):
            ids = torch.as_tensor(win, dtype=torch.long, device=em.device)[None]
            losses = token_losses(em.model, ids, head_chunk)
            require_finite(losses, em, "losses")
            losses = losses.cpu().numpy()
            if index == 0 and on_first is not None:
                on_first(time.perf_counter() - started, len(win))
            num_bytes = None
            if em.tokenizer is not None:
                # Bytes of the text the predicted tokens spell (the first token is context only).
                num_bytes = len(em.tokenizer.decode(win[1:].tolist()).encode("utf-8"))
            acc.add(losses, num_bytes)
            bar.update(len(win) - 1)
    finally:
        bar.close()
    return acc.summary()


def plot_curves(results: list[dict], path, train_len: int | None = None, title: str | None = None):
    """One line per checkpoint: perplexity per position bucket (x: tokens of context)."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for res in results:
        xs = [(b["start"] + b["end"]) / 2 for b in res["buckets"]]
        ys = [b["ppl"] for b in res["buckets"]]
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{res['name']} (ppl {res['ppl']:.2f})")
    if train_len:
        ax.axvline(train_len, color="gray", linestyle=":", linewidth=1, label=f"training length {train_len}")
    ax.set_xlabel("position in window (tokens of context)")
    ax.set_ylabel("perplexity (per bucket)")
    ax.set_title(title or "perplexity vs. context length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
