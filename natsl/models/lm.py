"""The causal language model: embeddings, pre-RMSNorm blocks (mixer + SwiGLU), final norm, head."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from natsl.config import ModelConfig
from natsl.models.attention import SoftmaxAttention
from natsl.models.gated_deltanet import GatedDeltaNet
from natsl.models.mlp import SwiGLU
from natsl.models.natsl_layer import NAtSL
from natsl.models.norms import RMSNorm

MIXERS = {"gdn": GatedDeltaNet, "attention": SoftmaxAttention, "natsl": NAtSL}


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, device=None):
        super().__init__()
        self.layer_type = layer_type
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps, device=device)
        self.mixer = MIXERS[layer_type](config, device=device)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, device=device)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(Block(config, t, device=device) for t in config.layer_types())
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, device=device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.activation_checkpointing = False
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) for every linear map and the embeddings; layers reset their own extras."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def set_backend(self, backend: str | None) -> None:
        """Run every NAtS-L / GDN op on `backend` ("reference", "fast" or None for auto)."""
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = backend

    def natsl_layers(self) -> dict[int, NAtSL]:
        return {i: blk.mixer for i, blk in enumerate(self.layers) if isinstance(blk.mixer, NAtSL)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]."""
        x = self.embed(input_ids)
        for block in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
