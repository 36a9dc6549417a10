"""Greedy decoding for the evaluations.

With the incremental cache of docs/spec.md section 5 (`model.new_cache`, `model(ids, cache=cache)`)
the prompt is prefilled once and each new token costs one cached step. `use_cache=False`
recomputes the full forward over prompt + generated tokens at every step instead; the spec
makes both compute the same function, so both give the same tokens (up to exact ties in the
logits), which the tests check.
"""

from __future__ import annotations

from typing import Sequence

import torch

from natsl.eval.common import final_hidden_states


@torch.inference_mode()
def last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, T] -> logits of the last position [1, vocab] (fp32), without the full [T, vocab]."""
    with final_hidden_states(model) as head:
        hidden = model(ids)
    return head(hidden[:, -1]).float()


@torch.inference_mode()
def greedy_generate(model, prompt: Sequence[int], max_new_tokens: int, eos_id: int | None = None,
                    use_cache: bool = True, device=None) -> list[int]:
    """Greedy continuation of `prompt` (token ids): up to `max_new_tokens` ids, stopping after EOS.

    `use_cache` decodes through the incremental cache; False recomputes the full forward.
    """
    if max_new_tokens <= 0:
        return []
    if device is None:
        device = next(model.parameters()).device
    ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
    out: list[int] = []
    if use_cache:
        # Allocate only what this sequence needs: the cache takes its whole capacity up front.
        cache = model.new_cache(1, max_len=ids.shape[1] + max_new_tokens)
        logits = model.forward_cached(ids, cache, last_only=True)[:, -1].float()
        while True:
            token = int(logits.argmax(dim=-1).item())
            out.append(token)
            if token == eos_id or len(out) >= max_new_tokens:
                return out
            step = torch.tensor([[token]], dtype=torch.long, device=device)
            logits = model(step, cache=cache)[:, -1].float()
    seq = ids
    while True:
        token = int(last_logits(model, seq).argmax(dim=-1).item())
        out.append(token)
        if token == eos_id or len(out) >= max_new_tokens:
            return out
        seq = torch.cat([seq, torch.tensor([[token]], dtype=torch.long, device=device)], dim=1)
