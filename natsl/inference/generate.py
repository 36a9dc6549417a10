"""Text generation with the cache: prefill each prompt into its own slot, then decode the batch.

Prompts of different lengths are never padded: padding would run through the recurrent state and
shift the block boundaries. Each prompt is prefilled alone into its row of one batch cache
(`cache.slot(i)`, chunk mode), and the decode steps then run the whole batch at once with a
position per sequence. A sequence that has stopped keeps stepping (its tokens are thrown away) until
every sequence has stopped or the longest budget is spent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from natsl.errors import NatslError
from natsl.inference.decode import DecodeRunner
from natsl.inference.prefill_graph import prefill
from natsl.inference.sampling import SamplingConfig, sample

# Prompt tokens per prefill call on the CPU (see generate).
CPU_PREFILL_CHUNK = 2048


@dataclass
class Completion:
    prompt_tokens: int
    tokens: list[int]
    text: str
    stop_reason: str  # "eos", "stop" (a stop string), "length" (max_new_tokens) or "max_seq_len"


class TextStream:
    """The text of one sequence as tokens arrive: what may be shown now, and whether a stop string ended it.

    Held back: a trailing incomplete character (byte-level BPE splits UTF-8) and a tail that could
    be the start of a stop string, so the terminal never shows text that a stop string then removes.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.text = ""
        self.shown = 0

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; return (text to show now, whether a stop string appeared)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text = text[:min(hits)]
            return self.flush(), True
        self.text = text
        safe = len(text.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    safe = min(safe, len(text) - k)
                    break
        if safe <= self.shown:
            return "", False
        delta, self.shown = text[self.shown:safe], safe
        return delta, False

    def flush(self) -> str:
        """Everything not shown yet (at the end of the sequence)."""
        delta = self.text[self.shown:]
        self.shown = len(self.text)
        return delta


def model_device(model) -> torch.device:
    return model.embed.weight.device


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], config: SamplingConfig, *,
             on_text: Callable[[int, str], None] | None = None, cuda_graphs: bool | None = None,
             stats: dict | None = None) -> list[Completion]:
    """Continue each token list in `prompts`; `on_text(i, text)` receives sequence i's text as it comes.

    `stats`, if given, is filled with prefill and decode seconds, token counts and `first_token_s`:
    seconds from the call to the first sampled token of every sequence (the time to first token).
    """
    config.validate()
    if not prompts:
        raise NatslError("no prompts to continue")
    max_seq_len = model.config.max_seq_len
    budgets = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise NatslError(f"prompt {i + 1} is empty (0 tokens); give it some text")
        if len(ids) >= max_seq_len:
            raise NatslError(f"prompt {i + 1} has {len(ids)} tokens; the model takes at most {max_seq_len} "
                             "(its max_seq_len) including the new ones: shorten the prompt")
        budgets.append(min(config.max_new_tokens, max_seq_len - len(ids)))
    device = model_device(model)
    eos = tokenizer.eos_id if config.stop_at_eos else None
    batch = len(prompts)
    cache = model.new_cache(batch, max_len=max(len(p) for p in prompts) + max(budgets))

    started = time.perf_counter()
    last = []
    # On the CPU the PyTorch backends' prefill memory grows with the square of its length (the dense
    # attention scores), so long prompts go in pieces; the cache makes that exact.
    piece = CPU_PREFILL_CHUNK if device.type == "cpu" else max_seq_len
    for i, ids in enumerate(prompts):
        tokens = torch.tensor([ids], dtype=torch.long, device=device)
        slot = cache.slot(i)
        for start in range(0, len(ids), piece):
            out = prefill(model, tokens[:, start:start + piece], slot)  # a short prompt replays a CUDA graph
        last.append(out[:, -1])
    logits = torch.cat(last, dim=0)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the prefill's GPU work belongs to prefill_s, not to the decode's time
    prefilled = time.perf_counter()

    runner = DecodeRunner(model, cache, cuda_graphs=cuda_graphs)
    generator = torch.Generator().manual_seed(config.seed)
    streams = [TextStream(tokenizer, config.stop) for _ in prompts]
    reasons: list[str | None] = [None] * batch
    steps = 0
    first_token = None
    while True:
        chosen = sample(logits, config, generator)
        if first_token is None:
            chosen = chosen.cpu()  # waits for the prefill's and the sampler's GPU work
            first_token = time.perf_counter()
        for i in range(batch):
            if reasons[i] is not None:
                continue
            token = int(chosen[i])
            if token == eos:
                reasons[i] = "eos"
            else:
                delta, stopped = streams[i].add(token)
                if delta and on_text is not None:
                    on_text(i, delta)
                if stopped:
                    reasons[i] = "stop"
                elif len(streams[i].ids) >= budgets[i]:
                    reasons[i] = "length" if budgets[i] == config.max_new_tokens else "max_seq_len"
            if reasons[i] is not None and on_text is not None:
                rest = streams[i].flush()
                if rest:
                    on_text(i, rest)
        if all(r is not None for r in reasons):
            break
        logits = runner.step(chosen.to(device))
        steps += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    finished = time.perf_counter()
    if stats is not None:
        stats.update(prefill_s=prefilled - started, decode_s=finished - prefilled, decode_steps=steps,
                     first_token_s=first_token - started,
                     prompt_tokens=sum(len(p) for p in prompts), new_tokens=sum(len(s.ids) for s in streams),
                     cuda_graphs=runner.cuda_graphs)
    return [Completion(len(p), s.ids, s.text, r) for p, s, r in zip(prompts, streams, reasons)]
