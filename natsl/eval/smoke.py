"""A tiny, briefly trained checkpoint for smoke runs and the evaluation tests.

`tiny_trained(...)` trains `recipes/tiny_hybrid.yaml` for a few dozen AdamW steps on generated
essay prose with a small byte-level BPE, so the evaluation commands have a real model (finite,
better-than-uniform perplexity, non-trivial routing) in seconds on one CPU core.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from natsl.eval.haystack import essay_text


def tiny_trained(steps: int = 30, *, seed: int = 0, seq_len: int = 128, batch: int = 4, vocab_size: int = 512,
                 text: str | None = None, backend: str = "chunked"):
    """(model, recipe, tokenizer): tiny_hybrid trained `steps` steps on `text` (default: generated essays)."""
    import natsl
    from natsl.tokenizer import train_bpe

    text = text or essay_text(600, seed=seed)
    tokenizer = train_bpe([text], vocab_size=vocab_size)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(seed)
    model = natsl.build_model(recipe)
    model.set_backend(backend)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.optim.lr, betas=tuple(recipe.optim.betas), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optim.grad_clip)
        opt.step()
    model.eval()
    return model, recipe, tokenizer


def save_tiny_checkpoint(path, steps: int = 30, **kwargs) -> Path:
    """Train as `tiny_trained` and write the model folder at `path`."""
    from natsl.checkpoint import save_model_folder

    model, recipe, tokenizer = tiny_trained(steps, **kwargs)
    return save_model_folder(path, model, recipe, tokenizer)
