"""Model zoo: GDN, softmax attention and NAtS-L layers in one causal LM (see docs/architecture.md)."""

__all__ = ["CausalLM", "build_model"]


def __getattr__(name: str):
    # CausalLM on first use: natsl.config's validation imports natsl.models.registry, which must not
    # pull in torch and every layer with it.
    if name == "CausalLM":
        from natsl.models.lm import CausalLM

        return CausalLM
    raise AttributeError(f"module 'natsl.models' has no attribute {name!r}")


def build_model(recipe_or_config, device=None):
    """A `CausalLM` for a `Recipe` or `ModelConfig`, freshly initialised.

    Args:
        recipe_or_config: a `Recipe` (its `model` section is used) or a `ModelConfig`; validated first.
        device: where the parameters live (a `torch.device` or its name); None: torch's default. `"meta"`
            builds the model without allocating.

    Returns:
        The `CausalLM`: `model(input_ids [B, T])` gives logits `[B, T, vocab_size]`, and
        `model(input_ids, cache=model.new_cache(B))` runs prefill and decode (docs/spec.md section 5).
    """
    from natsl.config import ModelConfig, Recipe
    from natsl.models.lm import CausalLM

    config = recipe_or_config.model if isinstance(recipe_or_config, Recipe) else recipe_or_config
    if not isinstance(config, ModelConfig):
        raise TypeError(f"build_model takes a Recipe or ModelConfig, got {type(recipe_or_config).__name__}")
    config.validate()
    return CausalLM(config, device=torch_device(device))


def torch_device(device):
    import torch

    return None if device is None else torch.device(device)
