"""natsl as an lm-evaluation-harness model (`lm-eval` 0.4.x), registered under the name `natsl`.

Installing natsl makes lm-eval's own command find it (docs/evaluation.md): the package declares the
`lm_eval.models` entry point, and for lm-eval releases that read none (0.4.13 and before)
`natsl-lm-eval.pth` registers the same placeholder when lm-eval fills its model registry
(`_natsl_lm_eval.py`). Importing this module registers the class itself. Ways in:

    lm_eval --model natsl --model_args pretrained=CKPT --tasks ...      # lm-eval's command line
    natsl eval-lm CKPT --tasks hellaswag,arc_easy            # natsl's wrapper: JSON, table and PNG
    python -m natsl.eval.lm_eval_adapter --model natsl ...   # the same as lm_eval, from a checkout
    lm_eval.simple_evaluate(model="natsl", model_args="pretrained=CKPT", ...)

`model_args`: pretrained
(a checkpoint or run folder), device, dtype, backend (natsl's defaults), batch_size, max_length
(default: natsl.config.context_length, the training length capped at max_seq_len, which a `--to hf`
export declares as max_position_embeddings, so `--model hf` scores the same windows), chunk (tokens per
cached forward, default 2048), add_bos
(prepend BOS; default: as the checkpoint trained -- documents start with BOS when its tokenizer has
one, e.g. Llama-2's; without BOS the EOS that ends the previous document starts a text). device
and batch_size may come in model_args or as lm-eval's --device and --batch_size (merge_model_args:
model_args wins over lm-eval's defaults; given both ways, they must agree).

Every request runs through natsl's cache: a scored sequence goes in pieces of `chunk` tokens
(`forward_cached`), which bounds the logits held at once, and generation is `natsl generate`'s
per-row prefill and batched decode. Sequences of one length are scored as one batch; natsl never
pads (padding would run through the recurrent state).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from natsl.errors import NatslError

DEFAULT_CHUNK = 2048
LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # EvaluatorConfig.device


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


# What lm-eval passes beside --model_args (simple_evaluate's additional_config) when its own option is not
# given: the command line's --device default and --batch_size default.
LM_EVAL_DEFAULTS = {"device": LM_EVAL_DEFAULT_DEVICE, "batch_size": 1}


def merge_model_args(model_args: dict, lm_eval_args: dict | None) -> dict:
    """The constructor arguments of NatslLM from lm-eval's two sources, which it would pass side by side
    (`cls(**model_args, **lm_eval_args)`, "got multiple values for keyword argument 'device'").

    The rule: a key given in --model_args wins over lm-eval's default for it (--device absent: cuda:0;
    --batch_size absent: 1); given both ways explicitly (`--model_args device=cpu --device cpu`), the
    two must agree, else the run is refused naming both. lm-eval's None means "not given".

    Args:
        model_args: the parsed --model_args (lm_eval.utils.simple_parse_args_string) or model_args dict.
        lm_eval_args: lm-eval's own values (batch_size, max_batch_size, device).

    Returns:
        One dict of keyword arguments.
    """
    merged = dict(model_args)
    for key, value in (lm_eval_args or {}).items():
        if value is None:
            continue
        if key not in merged:
            merged[key] = value
        elif str(merged[key]) != str(value) and str(value) != str(LM_EVAL_DEFAULTS.get(key)):
            raise NatslError(f"{key} is given twice and differently: {key}={merged[key]} in --model_args, "
                             f"{value} by lm-eval's --{key}; give it once")
    return merged


class NatslLM(TemplateLM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """`--model_args pretrained=CKPT,device=cpu,...` with lm-eval's own values (merge_model_args)."""
        from lm_eval.utils import simple_parse_args_string

        return cls(**merge_model_args(simple_parse_args_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """`simple_evaluate(model="natsl", model_args={...})` with lm-eval's own values (merge_model_args)."""
        return cls(**merge_model_args(arg_dict, additional_config))

    def __init__(self, pretrained: str, device: str | None = None, dtype: str | None = None,
                 backend: str | None = None, batch_size: int | str = 1, max_length: int | None = None,
                 chunk: int = DEFAULT_CHUNK, add_bos: bool | str | None = None, max_gen_toks: int = 256, **kwargs):
        super().__init__()
        from natsl.config import context_length
        from natsl.eval.common import load_eval_model

        if device == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
            # lm-eval's command line passes its own default (cuda:0) when --device is not given; like
            # its `hf` model, take the machine's device then instead of refusing a choice nobody made.
            device = None
        self.em = load_eval_model(pretrained, device, dtype, backend)
        if self.em.tokenizer is None:
            raise NatslError(f"checkpoint {pretrained!r} has no tokenizer.json; lm-eval feeds text: bundle one "
                             "with `natsl convert --tokenizer` or train with data.tokenizer set")
        self.model, self.tokenizer = self.em.model, self.em.tokenizer
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        # natsl.config.context_length: also the export's max_position_embeddings, which `--model hf` reads
        self.max_length = int(max_length or context_length(self.em.recipe))
        self.chunk = int(chunk)
        self.max_gen_toks = int(max_gen_toks)
        # default: as the model trained (the checkpoint records whether its documents started with BOS)
        self.add_bos = self.tokenizer.add_bos if add_bos is None else _flag(add_bos)
        self.bos_id = self.tokenizer.bos_id
        if self.add_bos and self.bos_id is None:
            raise NatslError("add_bos=true, but the tokenizer has no BOS token (<s>, <|begin_of_text|>, <bos>)")
        if self.tokenizer.eos_id is None:
            raise NatslError("the checkpoint's tokenizer has no EOS token; lm-eval needs one")

    # -- what TemplateLM asks for --------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.bos_id if self.add_bos else self.tokenizer.eos_id

    @property
    def device(self):
        return self.em.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.sha256()[:16]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string)
        if self.add_bos and add_special_tokens is not False and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    # -- scoring --------------------------------------------------------------------------------

    @torch.no_grad()
    def _score(self, inputs: torch.Tensor):
        """inputs [B, T] -> (log-probs [B, T, V] of the next token), fed through the cache in chunks."""
        cache = self.model.new_cache(inputs.shape[0], max_len=inputs.shape[1])
        pieces = [self.model.forward_cached(inputs[:, s:s + self.chunk], cache)
                  for s in range(0, inputs.shape[1], self.chunk)]
        return F.log_softmax(torch.cat(pieces, dim=1).float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation), context ids, continuation ids) -> (log p, greedy?)."""
        results: list = [None] * len(requests)
        groups: dict[int, list] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-(self.max_length + 1):]
            if len(continuation) > self.max_length:
                raise NatslError(f"a continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
            groups[len(whole) - 1].append((i, whole, len(continuation)))
        batches = [items[s:s + self.batch_size] for _, items in sorted(groups.items(), reverse=True)
                   for s in range(0, len(items), self.batch_size)]
        with tqdm(total=len(requests), desc="natsl loglikelihood", disable=disable_tqdm) as bar:
            for batch in batches:
                ids = torch.tensor([whole for _, whole, _ in batch], device=self.device)
                logp = self._score(ids[:, :-1])
                for row, (i, whole, n) in enumerate(batch):
                    target = ids[row, -n:]
                    scores = logp[row, -n:]
                    total = scores.gather(-1, target[:, None]).sum().item()
                    greedy = bool((scores.argmax(-1) == target).all())
                    results[i] = (total, greedy)
                    if self.cache_hook is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
                bar.update(len(batch))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for request in tqdm(requests, desc="natsl loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)]
            scored = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(logp for logp, _ in scored)
            out.append(total)
            if self.cache_hook is not None:
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    # -- generation -----------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False):
        from lm_eval.models.utils import normalize_gen_kwargs

        from natsl.inference.generate import generate
        from natsl.inference.sampling import SamplingConfig

        results: list = [None] * len(requests)
        groups: dict[str, list] = defaultdict(list)
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            groups[repr(sorted(gen_kwargs.items()))].append((i, context, gen_kwargs))
        with tqdm(total=len(requests), desc="natsl generate_until", disable=disable_tqdm) as bar:
            for items in groups.values():
                kw = normalize_gen_kwargs(items[0][2], self.max_gen_toks)
                until = [s for s in kw.get("until") or [] if s]
                budget = int(kw["max_gen_toks"])
                config = SamplingConfig(max_new_tokens=budget, temperature=float(kw.get("temperature") or 0.0),
                                        top_k=int(kw.get("top_k") or 0), top_p=float(kw.get("top_p") or 1.0),
                                        seed=int(kw.get("seed") or 0), stop=until)
                room = max(self.max_length - budget, 1)
                for s in range(0, len(items), self.batch_size):
                    chunk = items[s:s + self.batch_size]
                    prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-room:] for _, c, _ in chunk]
                    for (i, context, gen_kwargs), done in zip(chunk, generate(self.model, self.tokenizer, prompts,
                                                                              config)):
                        results[i] = done.text
                        if self.cache_hook is not None:
                            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), done.text)
                    bar.update(len(chunk))
        return results


def main() -> None:
    """lm-eval's own command line with natsl registered: `python -m natsl.eval.lm_eval_adapter --model natsl ...`."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    # Run as a script this file is `__main__`: register and run the importable module instead, whose
    # class is the one the `natsl` placeholder names.
    from natsl.eval.lm_eval_adapter import main as _main

    _main()
else:
    # lm-eval fills its registry with its own models (hf, vllm, ...) on first lookup only while it is empty:
    # import their (lazy) table first, or registering natsl alone would hide `--model hf` from this process.
    import lm_eval.models  # noqa: F401

    register_model("natsl")(NatslLM)
