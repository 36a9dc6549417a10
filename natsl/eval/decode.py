"""Greedy decoding for the evaluations.

With the incremental cache of docs/spec.md section 5 (`model.new_cache`, `model(ids, cache=cache)`)
the prompt is prefilled once and each new token costs one cached step. `use_cache=False`
recomputes the full forward over prompt + generated tokens at every step instead; the spec
makes both compute the same function, so both give the same tokens (up to exact ties in the
logits), which the tests check.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from natsl.errors import NonFiniteError
from natsl.eval.common import final_hidden_states


def _pick(logits: torch.Tensor) -> int:
    token = int(logits.argmax(dim=-1).item())
    if not bool(torch.isfinite(logits).all()):  # argmax of NaN logits would silently "choose" token 0
        raise NonFiniteError("the model produced non-finite logits (nan or inf)")
    return token


@torch.inference_mode()
def last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, T] -> logits of the last position [1, vocab] (fp32), without the full [T, vocab]."""
    with final_hidden_states(model) as head:
        hidden = model(ids)
    return head(hidden[:, -1]).float()


@torch.inference_mode()
def greedy_generate(model, prompt: Sequence[int], max_new_tokens: int, eos_id: int | None = None,
                    use_cache: bool = True, device=None, stats: dict | None = None, runner=None) -> list[int]:
    """Greedy continuation of `prompt` (token ids): up to `max_new_tokens` ids, stopping after EOS.

    `use_cache` decodes through the incremental cache; False recomputes the full forward. `runner` (a
    natsl.inference.decode.DecodeRunner of this model, its cache of batch 1 with room for the prompt and
    `max_new_tokens`) decodes in its cache instead, emptied first, replaying its CUDA graphs on a GPU: many
    prompts of one length share its graphs instead of launching every kernel of every step from Python.
    `stats`, if given, receives the prefill and decode seconds and the decode steps. Non-finite logits
    raise NonFiniteError.
    """
    if max_new_tokens <= 0:
        return []
    if device is None:
        device = next(model.parameters()).device
    ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
    out: list[int] = []
    started = time.perf_counter()
    prefilled = None

    def done() -> list[int]:
        if stats is not None:
            end = time.perf_counter()
            stats.update(prefill_s=prefilled - started, decode_s=end - prefilled, decode_steps=len(out) - 1)
        return out

    if use_cache or runner is not None:
        if runner is not None:
            cache = runner.cache
            cache.reset()
        else:  # allocate only what this sequence needs: the cache takes its whole capacity up front
            cache = model.new_cache(1, max_len=ids.shape[1] + max_new_tokens)
        logits = model.forward_cached(ids, cache, last_only=True)[:, -1].float()
        while True:
            token = _pick(logits)
            prefilled = prefilled or time.perf_counter()
            out.append(token)
            if token == eos_id or len(out) >= max_new_tokens:
                return done()
            if runner is not None:
                logits = runner.step(torch.tensor([token], dtype=torch.long, device=device)).float()
            else:
                step = torch.tensor([[token]], dtype=torch.long, device=device)
                logits = model(step, cache=cache)[:, -1].float()
    seq = ids
    while True:
        token = _pick(last_logits(model, seq))
        prefilled = prefilled or time.perf_counter()
        out.append(token)
        if token == eos_id or len(out) >= max_new_tokens:
            return done()
        seq = torch.cat([seq, torch.tensor([[token]], dtype=torch.long, device=device)], dim=1)
