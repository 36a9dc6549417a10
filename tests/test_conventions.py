"""The paper's training conventions that natsl follows by default."""

import torch

import natsl
from natsl.models.conv import ShortConv


def test_short_conv_init_is_normal_with_init_std():
    recipe = natsl.load_recipe("tiny_hybrid")
    recipe.model.init_std = 0.05
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, ShortConv)])
    assert weights.numel() > 1000
    # Normal(0, init_std) as flash-linear-attention initialises its ShortConvolution; PyTorch's Conv1d
    # default (uniform within +-1/sqrt(4) = 0.5) would give a std near 0.29.
    assert abs(weights.std().item() - 0.05) < 0.005
    assert weights.abs().max().item() > 0.1  # unbounded (normal), not a narrow uniform
