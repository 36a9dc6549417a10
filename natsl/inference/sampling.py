"""Next-token choice: greedy at temperature 0, else temperature, top-k and top-p (nucleus) sampling.

Sampling draws on the CPU with an explicit `torch.Generator`, so a seed gives the same tokens on
any device (the logits of one step are a few hundred kilobytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from natsl.errors import NatslError, NonFiniteError

# Temperatures below this count as greedy (0): logits / T overflows float32 for T near its smallest
# numbers, and long before that the softmax puts all its mass on the most likely token.
GREEDY_BELOW = 1e-4


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # 1 = no limit
    seed: int = 0  # 0 to 2**63-1 (natsl.seeding)
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_at_eos: bool = True

    def validate(self) -> None:
        from natsl.seeding import check_seed

        check_seed(self.seed, "--seed")
        if self.max_new_tokens < 1:
            raise NatslError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature < math.inf:  # also refuses nan
            raise NatslError(f"--temperature must be a finite number, 0 (greedy) or more, got {self.temperature}")
        if self.top_k < 0:
            raise NatslError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise NatslError(f"--top-p must lie in (0, 1], got {self.top_p}")
        if any(s == "" for s in self.stop):
            raise NatslError("--stop needs a non-empty string")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [B, V] -> the same with everything outside the top-k / top-p set at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """logits [B, V] (any device) -> next tokens [B] (int64, on the CPU).

    Non-finite logits (NaN weights, an overflowing dtype) raise NonFiniteError rather than letting
    argmax pick token 0 or multinomial fail on a NaN distribution."""
    logits = logits.detach().float().cpu()
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteError("the model produced non-finite logits (nan or inf)")
    if config.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / config.temperature, config.top_k, config.top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
