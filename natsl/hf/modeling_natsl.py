"""Hugging Face `transformers` classes for natsl's GDN, GDN Hybrid, NAtS-L, NAtS-L Hybrid and Mamba2 models
(Mamba2, NAtS-L on a Mamba2 state and its hybrid).

`natsl convert CKPT OUT --to hf` copies this file into OUT and names it in config.json's `auto_map`,
so `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` builds `NatslForCausalLM`.
The file holds no model code of its own: it imports the installed natsl (`pip install natsl`) and
runs natsl's layers, kernels and cache, so its logits and `generate()` are natsl's. config.json
records the natsl that exported it (`natsl_version`); where the installed natsl lacks a name this file
imports, the ImportError says which natsl to install (or to re-export), and a different version that
runs is named in a warning.

Generation: `generate()` keeps a natsl cache (not a transformers `Cache`) sized for the call. Each
prompt is prefilled alone into its row of the cache (left padding, as `tokenizer.padding_side =
"left"` gives, is dropped: padding would run through the recurrent state), then the rows decode
together, each at its own position: what `natsl generate` does, so greedy decoding gives the same
tokens, and sampling on the CPU too when the global seed (`torch.manual_seed(seed)`) equals
`natsl generate --seed` and only temperature / top-k / top-p are set.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from transformers.utils import logging

# Prompt tokens per prefill call on the CPU, as natsl.inference.generate (quadratic memory otherwise).
CPU_PREFILL_CHUNK = 2048
# The natsl keys of an export's config.json (natsl.hf.export.export_record).
EXPORT_KEYS = ("natsl_recipe", "natsl_version", "natsl_format_version", "natsl_model_sha256")

logger = logging.get_logger(__name__)


def version_skew(config) -> str | None:
    """What to do when the installed natsl is not the one that exported the folder (None: the same)."""
    exported = getattr(config, "natsl_version", None)
    try:
        from natsl import __version__ as installed
    except ImportError:
        installed = "not installed"
    if exported == installed:
        return None
    if exported is None:
        return (f"this folder was exported by a natsl that did not record its version; installed natsl is {installed}; "
                "install the natsl that exported it, or re-export the checkpoint with `natsl convert CKPT OUT --to hf`")
    return (f"this folder was exported by natsl {exported}; installed natsl is {installed}; install natsl {exported} "
            f"(pip install natsl=={exported}) or re-export the checkpoint with `natsl convert CKPT OUT --to hf`")


@contextlib.contextmanager
def installed_natsl(config):
    """Around every import of natsl: a name the installed natsl lacks (an older or newer one than the
    exporting natsl) becomes an ImportError that names both versions and the fix."""
    try:
        yield
    except ImportError as err:
        raise ImportError(f"{version_skew(config) or 'natsl cannot run this folder'} ({err})") from err


class NatslConfig(PreTrainedConfig):
    """`natsl_recipe`: the natsl recipe the model was trained with; its `model` section names every
    natsl `ModelConfig` field."""

    model_type = "natsl"

    def __init__(self, natsl_recipe: dict | None = None, **kwargs):
        self.natsl_recipe = dict(natsl_recipe or {})
        m = self.natsl_recipe.get("model", {})
        kwargs.setdefault("vocab_size", m.get("vocab_size"))
        kwargs.setdefault("hidden_size", m.get("hidden_size"))
        kwargs.setdefault("num_hidden_layers", m.get("num_layers"))
        kwargs.setdefault("max_position_embeddings", m.get("max_seq_len"))
        kwargs.setdefault("tie_word_embeddings", bool(m.get("tie_embeddings", False)))
        for key, value in kwargs.items():
            setattr(self, key, value)
        super().__init__(**kwargs)

    def natsl_model_config(self):
        """The natsl ModelConfig; an export older than a model field gets the value that reproduces its
        model (older exports lack the Mamba2 fields and attn_window), any other missing field is refused."""
        with installed_natsl(self):
            from natsl.errors import NatslError
            from natsl.hf.export import check_export_record, exported_recipe

        skew = version_skew(self)
        try:
            check_export_record({key: getattr(self, key, None) for key in EXPORT_KEYS}, "config.json")
            model = exported_recipe(self.natsl_recipe).model
        except NatslError as err:  # e.g. a model key of a newer natsl
            raise NatslError(f"{err}; {skew}" if skew else str(err)) from None
        if skew:
            logger.warning(f"{skew}; running it as this natsl reads it")
        return model


@dataclass
class _GenerationState:
    """natsl's cache for one `generate()` call (created by _prepare_cache_for_generation)."""

    max_len: int
    cache: object = None
    runner: object = None


class NatslForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NatslConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
    _is_stateful = True  # a recurrent state: no assisted decoding or cache cropping

    def __init__(self, config: NatslConfig):
        super().__init__(config)
        with installed_natsl(config):
            from natsl.models import build_model

        self.model = build_model(config.natsl_model_config())
        self.post_init()

    def _init_weights(self, module):
        pass  # natsl's CausalLM initialises itself; loaded weights replace everything

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_backend(self, backend: str | None) -> None:
        """natsl's backend for every op: "reference", "chunked", "fast" or None (fast on CUDA)."""
        self.model.set_backend(backend)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # natsl keeps its own cache (prepare_inputs_for_generation)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, natsl_state: _GenerationState | None = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutput:
        """Full-sequence logits [B, T, vocab] (`attention_mask` may only mark left padding, whose
        positions get no logits worth reading), or one generation step with `natsl_state`."""
        if input_ids is None:
            raise ValueError("natsl models take input_ids (inputs_embeds are not supported)")
        if natsl_state is not None:
            logits = self._generation_step(input_ids, attention_mask, natsl_state)
        elif attention_mask is not None and not bool(attention_mask.all()):
            logits = self._padded_forward(input_ids, attention_mask)
        else:
            logits = self.model(input_ids)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                     ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def _padded_forward(self, input_ids, attention_mask):
        logits = None
        for i, row in enumerate(_unpadded_rows(input_ids, attention_mask)):
            out = self.model(row[None])
            if logits is None:
                logits = out.new_zeros(input_ids.shape[0], input_ids.shape[1], out.shape[-1])
            logits[i, input_ids.shape[1] - row.numel():] = out[0]
        return logits

    # -- generation on natsl's cache -------------------------------------------------------------

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        limit = self.model.config.max_seq_len
        model_kwargs["natsl_state"] = _GenerationState(max_len=min(int(generation_config.max_length), limit))

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, natsl_state=None, **kwargs):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "natsl_state": natsl_state}
        if natsl_state is not None and natsl_state.cache is not None:
            inputs["input_ids"] = input_ids[:, -1:]  # the cache holds everything before the newest token
        return inputs

    def _generation_step(self, input_ids, attention_mask, state: _GenerationState) -> torch.Tensor:
        with installed_natsl(self.config):
            from natsl.inference.decode import DecodeRunner

        if state.cache is None:  # the prompts: each into its own row, as natsl.inference.generate
            rows = _unpadded_rows(input_ids, attention_mask)
            if max(r.numel() for r in rows) >= self.model.config.max_seq_len:
                raise ValueError(f"a prompt reaches the model's max_seq_len ({self.model.config.max_seq_len})")
            state.cache = self.model.new_cache(len(rows), max_len=max(state.max_len, input_ids.shape[1] + 1))
            piece = CPU_PREFILL_CHUNK if input_ids.device.type == "cpu" else self.model.config.max_seq_len
            last = []
            with torch.no_grad():
                for i, row in enumerate(rows):
                    for start in range(0, row.numel(), piece):
                        out = self.model.forward_cached(row[None, start:start + piece], state.cache.slot(i),
                                                        last_only=True)
                    last.append(out[:, -1])
            state.runner = DecodeRunner(self.model, state.cache)
            return torch.cat(last, dim=0)[:, None]
        return state.runner.step(input_ids[:, -1])[:, None]


def _unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row without its left padding; right padding or holes are refused (they would run through
    the recurrent state)."""
    if attention_mask is None:
        return list(input_ids)
    rows = []
    for ids, mask in zip(input_ids, attention_mask.bool()):
        n = int(mask.sum())
        if n == 0 or not bool(mask[mask.numel() - n:].all()):
            raise ValueError("natsl models take left padding only (tokenizer.padding_side = 'left'): padding "
                             "inside or after a prompt would run through the recurrent state")
        rows.append(ids[ids.numel() - n:])
    return rows
