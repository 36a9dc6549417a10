"""Hugging Face `transformers` classes for natsl's GDN, GDN Hybrid, NAtS-L, NAtS-L Hybrid, sliding-window
and other attention layouts Llama cannot hold, and Mamba2 models (Mamba2, NAtS-L on a Mamba2 state and its
hybrid).

`natsl convert CKPT OUT --to hf` copies this file into OUT and names it in config.json's `auto_map`,
so `AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` builds `NatslForCausalLM`. It runs
with torch and transformers alone: beside it the export carries natsl's own model code as plain files
(`natsl_bundle.py` and the `natsl_*.py` it imports, generated from the exporting natsl by natsl.hf.bundle).
Which code runs (config.json's `natsl_runtime`, or `from_pretrained(OUT, ..., natsl_runtime=...)`):

- "auto" (default): the installed natsl where it imports and reads the export (its Triton kernels on
  CUDA, the `fast` backend; a natsl of another version than the exporting one is named in a warning),
  else the bundle;
- "installed": the installed natsl, or an ImportError saying why not;
  either way an installed natsl refuses an export whose model section was edited or whose format it
  cannot read (as `natsl convert --from-hf`), and the bundle an edited one;
- "bundled": the bundle, on natsl's pure-PyTorch `chunked` backend (one sequential step per block: the
  readable path, on any device; natsl's `reference` backend too, by `set_backend`).

Both give natsl's logits, cache and `generate()`.

Generation: `generate()` keeps a natsl cache (not a transformers `Cache`) sized for the call. Each
prompt is prefilled alone into its row of the cache (left padding, as `tokenizer.padding_side =
"left"` gives, is dropped: padding would run through the recurrent state), then the rows decode
together, each at its own position: what `natsl generate` does, so greedy decoding gives the same
tokens, and sampling on the CPU too when the global seed (`torch.manual_seed(seed)`) equals
`natsl generate --seed` and only temperature / top-k / top-p are set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput
from transformers.utils import logging

try:  # transformers >= 5
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4 spells it PretrainedConfig
    from transformers import PretrainedConfig as PreTrainedConfig

# Prompt tokens per prefill call on the CPU, as natsl.inference.generate (quadratic memory otherwise).
CPU_PREFILL_CHUNK = 2048
# The natsl keys of an export's config.json (natsl.hf.export.export_record).
EXPORT_KEYS = ("natsl_recipe", "natsl_version", "natsl_format_version", "natsl_model_sha256")
RUNTIMES = ("auto", "installed", "bundled")
BUNDLED_BACKENDS = ("chunked", "reference")
TRANSFORMERS_5 = int(__import__("transformers").__version__.split(".")[0]) >= 5

logger = logging.get_logger(__name__)


def version_skew(config) -> str | None:
    """What differs when the installed natsl is not the one that exported the folder (None: the same)."""
    exported = getattr(config, "natsl_version", None)
    try:  # natsl is optional: imports of it stay inside `try` (transformers' import check skips those)
        from natsl import __version__ as installed
    except ImportError:
        installed = "not installed"
    if exported == installed:
        return None
    if exported is None:
        return (f"this folder was exported by a natsl that did not record its version; installed natsl is {installed}; "
                "natsl_runtime='bundled' runs the code it was exported with")
    return (f"this folder was exported by natsl {exported}; installed natsl is {installed}; natsl_runtime='bundled' "
            "runs the code it was exported with")


@dataclass
class Runtime:
    """The natsl code a model runs on: the installed natsl or the export's bundle."""

    name: str  # "installed" or "bundled"
    causal_lm: type  # natsl.models.lm.CausalLM
    decode_runner: type  # natsl.inference.decode.DecodeRunner
    model_config: object  # natsl.config.ModelConfig of the export
    backend: str | None  # the backend set on the model (None: natsl's default)


class UnreadableExport(ImportError):
    """The installed natsl imports but cannot read the export."""


def installed_runtime(config) -> Runtime:
    """The installed natsl, where it imports and reads the export; ImportError otherwise (why not)."""
    try:
        import natsl  # noqa: F401
    except ImportError as err:
        raise ImportError(f"natsl is not importable ({err})") from err
    skew = version_skew(config)
    try:
        from natsl.errors import NatslError
        from natsl.hf.export import check_export_record, exported_recipe
        from natsl.inference.decode import DecodeRunner
        from natsl.models.lm import CausalLM
    except ImportError as err:  # a natsl of another version than the exporting one
        raise UnreadableExport(f"{skew or 'the installed natsl cannot run this folder'} ({err})") from err
    # An edited model section or a format this natsl cannot read is refused (NatslError), as --from-hf does.
    check_export_record({key: getattr(config, key, None) for key in EXPORT_KEYS}, "config.json")
    try:
        model = exported_recipe(config.natsl_recipe).model
    except NatslError as err:  # e.g. a model key of a newer natsl
        raise UnreadableExport(f"{err}; {skew}" if skew else str(err)) from None
    if skew:
        logger.warning(f"{skew}; running it as the installed natsl reads it")
    return Runtime("installed", CausalLM, DecodeRunner, model, None)


def bundled_runtime(config) -> Runtime:
    """The natsl code bundled with the export (natsl_bundle.py), on the chunked backend."""
    from .natsl_bundle import OLDER_EXPORT_FIELDS, CausalLM, DecodeRunner, ModelConfig, model_fingerprint

    recipe = getattr(config, "natsl_recipe", None) or {}
    recorded = getattr(config, "natsl_model_sha256", None)
    if recorded is not None and recorded != model_fingerprint(recipe.get("model", {})):
        raise ValueError("config.json's natsl_recipe model section differs from the one natsl exported (its "
                         "natsl_model_sha256 does not match: a value such as block_size was edited); restore it, or "
                         "export the checkpoint again with `natsl convert CKPT OUT --to hf`")
    fields = {**OLDER_EXPORT_FIELDS, **recipe.get("model", {})}
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown, missing = sorted(set(fields) - known), sorted(known - set(fields))
    if unknown or missing:
        raise ValueError(f"config.json's natsl_recipe model section does not match the bundled natsl code: "
                         f"{'unknown ' + ', '.join(unknown) if unknown else ''}"
                         f"{'; ' if unknown and missing else ''}{'missing ' + ', '.join(missing) if missing else ''}; "
                         "export the checkpoint again with `natsl convert CKPT OUT --to hf`")
    return Runtime("bundled", CausalLM, DecodeRunner, ModelConfig(**fields), "chunked")


def pick_runtime(config) -> Runtime:
    """The runtime config.natsl_runtime asks for (see the module doc)."""
    choice = getattr(config, "natsl_runtime", "auto") or "auto"
    if choice not in RUNTIMES:
        raise ValueError(f"natsl_runtime must be one of {', '.join(RUNTIMES)}, got {choice!r}")
    if choice == "bundled":
        return bundled_runtime(config)
    try:
        return installed_runtime(config)
    except ImportError as err:
        if choice == "installed":
            raise
        (logger.warning if isinstance(err, UnreadableExport) else logger.info)(
            f"running the natsl code bundled with this export: {err}")
        return bundled_runtime(config)


class NatslConfig(PreTrainedConfig):
    """`natsl_recipe`: the natsl recipe the model was trained with; its `model` section names every
    natsl `ModelConfig` field. `natsl_runtime`: which natsl code runs the model (the module doc)."""

    model_type = "natsl"

    def __init__(self, natsl_recipe: dict | None = None, natsl_runtime: str = "auto", **kwargs):
        self.natsl_recipe = dict(natsl_recipe or {})
        self.natsl_runtime = natsl_runtime
        m = self.natsl_recipe.get("model", {})
        kwargs.setdefault("vocab_size", m.get("vocab_size"))
        kwargs.setdefault("hidden_size", m.get("hidden_size"))
        kwargs.setdefault("num_hidden_layers", m.get("num_layers"))
        kwargs.setdefault("max_position_embeddings", m.get("max_seq_len"))
        kwargs.setdefault("tie_word_embeddings", bool(m.get("tie_embeddings", False)))
        for key, value in kwargs.items():
            setattr(self, key, value)
        super().__init__(**kwargs)


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
    # transformers 5 maps tied names to their source, 4 lists them
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"} if TRANSFORMERS_5 else ["model.lm_head.weight"]
    _is_stateful = True  # a recurrent state: no assisted decoding or cache cropping

    def __init__(self, config: NatslConfig):
        super().__init__(config)
        self.runtime = pick_runtime(config)
        self.model = self.runtime.causal_lm(self.runtime.model_config)
        if self.runtime.backend is not None:
            self.model.set_backend(self.runtime.backend)
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
        """natsl's backend for every op: "reference", "chunked", "fast" or None (natsl's default: fast on
        CUDA). The bundled code has no Triton kernels: "chunked" (its default, also for None) or "reference"."""
        if self.runtime.name == "bundled":
            backend = backend or "chunked"
            if backend not in BUNDLED_BACKENDS:
                raise ValueError(f"the natsl code bundled with this export runs backends {' and '.join(BUNDLED_BACKENDS)} "
                                 f"(PyTorch), not {backend!r}: install natsl for its Triton kernels")
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
            state.runner = self.runtime.decode_runner(self.model, state.cache)
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
