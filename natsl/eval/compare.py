"""`natsl compare`: quality against measured KV memory and latency, for checkpoints at KV budgets.

Each checkpoint gives one or more variants, by what it is:

- NAtS-L layers: the router's own choice, and each budget as the kept fraction forced on every
  NAtS-L layer (natsl.models.routing.force_keep_fraction);
- full softmax attention (Transformer, GDN Hybrid): the full cache, and each budget below 1 with
  each KV-eviction press (natsl.inference.evict: SnapKV, PyramidKV, AdaKV), the budget being the
  fraction of tokens kept;
- sliding-window attention (GDN + SWA): its window, as trained;
- GDN or Mamba2 only (a fixed-size memory): itself.

NAtS-L on a Mamba2 state (and its hybrid with Mamba2 layers) has NAtS-L layers: the first case.

For each variant: quality through the evaluation functions of eval-recall (MQAR / passkey accuracy)
and eval-ppl (perplexity over `--data`); a press runs them through `EvictingLM` (the cache read
`chunk` tokens at a time and pressed after each), so the model predicts from its evicted KV. Then
on the same device, through natsl.inference.bench: one prefill of `context` random tokens (with the
press after it), the softmax K/V bytes the cache then holds (`kv_bytes`: attention entries, NAtS-L
softmax memory; `cache_bytes` adds the GDN states and conv tails), prefill seconds and decode ms
per token over that cache.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from natsl.errors import NatslError
from natsl.eval.common import EvalModel
from natsl.inference import bench
from natsl.inference.evict import METHODS, EvictingLM, Press
from natsl.models.nsa import NO_CACHE
from natsl.models.routing import force_keep_fraction


@dataclass
class Variant:
    """One point of the comparison: a checkpoint with a budget (and how it is enforced)."""

    label: str
    family: str  # natsl, attention, swa, gdn, mamba2
    method: str  # router, keep_fraction, full, snapkv, pyramidkv, adakv, window, none
    budget: float | None = None
    window: int | None = None

    def press(self) -> Press | None:
        return Press(self.method, self.budget) if self.method in METHODS else None


def variants(config, budgets: list[float], methods: list[str]) -> list[Variant]:
    """The variants of a model of `config` (natsl.config.ModelConfig) at `budgets`."""
    types = set(config.layer_types())
    if "natsl" in types:
        return [Variant("router", "natsl", "router")] + \
            [Variant(f"keep {b:g}", "natsl", "keep_fraction", b) for b in budgets]
    if "attention" in types and config.attn_window:
        return [Variant(f"window {config.attn_window}", "swa", "window", window=config.attn_window)]
    if "attention" in types:
        return [Variant("full", "attention", "full", 1.0)] + \
            [Variant(f"{m} {b:g}", "attention", m, b) for b in budgets if b < 1 for m in methods]
    # GDN and / or Mamba2 layers only: a fixed-size memory, nothing to budget
    label = "+".join(sorted(types))
    return [Variant(label, "mamba2" if "mamba2" in types else "gdn", "none")]


def check_budgets(budgets: list[float], methods: list[str]) -> None:
    if not budgets:
        raise NatslError("--budgets is empty; pass fractions such as 0.125,0.25,0.5,1")
    bad = [b for b in budgets if not 0.0 < b <= 1.0]
    if bad:
        raise NatslError(f"--budgets: {bad[0]:g} is not a fraction in (0, 1]; pass e.g. 0.125,0.25,0.5,1")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise NatslError(f"--methods: unknown KV-eviction method {unknown[0]!r}; choose from {', '.join(METHODS)}")


def evaluated_model(em: EvalModel, variant: Variant, chunk: int, seed: int) -> EvalModel:
    """`em` set up for `variant`: a forced keep fraction, or the model wrapped in its press."""
    force_keep_fraction(em.model, variant.budget if variant.method == "keep_fraction" else None, seed)
    press = variant.press()
    return em if press is None else dataclasses.replace(em, model=EvictingLM(em.model, press, chunk))


def measure_quality(em: EvalModel, variant: Variant, *, recall=None, ppl=None, chunk: int, seed: int) -> dict:
    """Recall accuracy (`recall`: (spec, points, samples, batch_size)) and perplexity (`ppl`: (windows,
    bucket)) of the variant, through eval-recall's and eval-ppl's functions."""
    from natsl.eval.ppl import evaluate_windows
    from natsl.eval.recall import evaluate_recall

    model = evaluated_model(em, variant, chunk, seed)
    out = {}
    if recall is not None:
        spec, points, samples, batch_size = recall
        report = evaluate_recall(model, spec, points, samples, batch_size, seed, progress=False)
        out["recall_accuracy"] = report["mean_accuracy"]
        out["recall_points"] = [{k: p[k] for k in ("seq_len", "count", "accuracy")} for p in report["points"]]
    if ppl is not None:
        wins, bucket = ppl
        summary = evaluate_windows(model, wins, bucket, progress=False)
        out["ppl"], out["bits_per_byte"] = summary["ppl"], summary["bits_per_byte"]
    force_keep_fraction(em.model, None)
    return out


def measure_cost(em: EvalModel, variant: Variant, *, context: int, decode_tokens: int, repeats: int, seed: int,
                 rates: dict, cuda_graphs: bool) -> dict:
    """KV bytes, prefill seconds and decode ms per token of the variant at `context` (natsl.inference.bench)."""
    model = em.model
    force_keep_fraction(model, variant.budget if variant.method == "keep_fraction" else None, seed)
    try:
        point = bench.measure_point(model, context, batch=1, decode_tokens=decode_tokens, repeats=repeats,
                                    device=em.device, seed=seed, cuda_graphs=cuda_graphs, rates=rates,
                                    weights=bench.weight_bytes(model), press=variant.press())
    finally:
        force_keep_fraction(model, None)
    return {key: point[key] for key in ("kv_bytes", "cache_bytes", "prefill_s", "decode_ms", "keep_fraction")}


def run_compare(checkpoints: list[str], *, budgets: list[float], methods: list[str], context: int, recall_args=None,
                ppl_args=None, chunk: int | None = None, decode_tokens: int = 8, repeats: int = 2, seed: int = 0,
                device=None, dtype=None, backend=None, cuda_graphs: bool = True, progress: bool = True) -> dict:
    """Every variant of every checkpoint: quality, KV bytes, latency. `recall_args`: dict of
    recall_grid's task, lengths, pairs, vocab plus samples, batch_size (None: no recall);
    `ppl_args`: dict of data, max_len, windows, text_key (None: no perplexity)."""
    from tqdm import tqdm

    from natsl.eval.common import load_eval_model

    check_budgets(budgets, methods)
    models = [load_eval_model(path, device, dtype, backend) for path in checkpoints]
    for em in models:
        if "nsa" in em.recipe.model.layer_types():  # its KV bytes and latency need a cache (natsl.models.nsa)
            raise NatslError(f"{em.name}: {NO_CACHE}; natsl compare cannot measure it yet, leave it out")
        if context > em.recipe.model.max_seq_len:
            raise NatslError(f"--context {context} is beyond {em.name}'s max_seq_len {em.recipe.model.max_seq_len}; "
                             "pass a shorter --context")
    plans = [(em, v) for em in models for v in variants(em.recipe.model, budgets, methods)]
    rates = bench.measure_rates(models[0].device, models[0].dtype)
    result = {"device": torch.cuda.get_device_name(models[0].device) if models[0].device.type == "cuda" else "cpu",
              "dtype": str(models[0].dtype).replace("torch.", ""), "backend": getattr(models[0].model, "backend", None),
              "context": context, "budgets": budgets, "methods": methods, "seed": seed,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": rates, "entries": []}
    bar = tqdm(plans, desc="compare", unit="variant", disable=not progress)
    warmed = set()
    for em, variant in bar:
        bar.set_postfix_str(f"{em.name} {variant.label}")
        recall = ppl = None
        if recall_args is not None:
            from natsl.eval.recall import recall_grid

            spec, points = recall_grid(em, recall_args.get("task"), recall_args.get("lengths"),
                                       recall_args.get("pairs"), recall_args.get("vocab"))
            recall = (spec, points, recall_args["samples"], recall_args["batch_size"])
        if ppl_args is not None:
            ppl = ppl_windows(em, ppl_args)
        entry = {"checkpoint": str(em.folder), "name": em.name, "parameters": em.model.num_parameters(),
                 **dataclasses.asdict(variant)}
        entry.update(measure_quality(em, variant, recall=recall, ppl=ppl, seed=seed,
                                     chunk=chunk or em.recipe.model.block_size))
        if id(em) not in warmed:
            bench.warm_up_model(em.model, min(context, 256), 1, em.device)
            warmed.add(id(em))
        entry.update(measure_cost(em, variant, context=context, decode_tokens=decode_tokens, repeats=repeats,
                                  seed=seed, rates=rates, cuda_graphs=cuda_graphs))
        result["entries"].append(entry)
    bar.close()
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return result


def ppl_windows(em: EvalModel, args: dict):
    """(windows, bucket) of eval-ppl's data for `em` (its own tokenizer), the whole window one bucket."""
    from natsl.eval.data import check_vocab, load_token_data, windows

    data = load_token_data(args["data"], em.tokenizer, text_key=args.get("text_key", "text"),
                           max_tokens=args["windows"] * args["max_len"])
    check_vocab(data, em.recipe.model.vocab_size)
    wins = windows(data, args["max_len"], args["windows"], eos_id=em.tokenizer.eos_id if em.tokenizer else None)
    if not wins:
        raise NatslError(f"--data {args['data']!r} gives no window of at least 2 tokens; pass more text")
    return wins, args["max_len"]


def quality_key(result: dict) -> tuple[str, str, bool]:
    """(entry key, axis label, higher is better) of the quality the result holds."""
    if any(e.get("recall_accuracy") is not None for e in result["entries"]):
        return "recall_accuracy", "recall accuracy", True
    return "ppl", "perplexity", False


def pareto(points: list[tuple[float, float]], higher_better: bool) -> list[tuple[float, float]]:
    """The points no other point beats on both cost (lower) and quality, sorted by cost."""
    front, best = [], None
    for cost, quality in sorted(points, key=lambda p: (p[0], -p[1] if higher_better else p[1])):
        if best is None or (quality > best if higher_better else quality < best):
            front.append((cost, quality))
            best = quality
    return front


def plot(result: dict, path):
    """Quality against KV bytes and against decode latency, one marker per family, the Pareto front dashed."""
    from natsl.eval.common import pyplot, save_figure

    key, label, higher = quality_key(result)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    markers = {"natsl": "o", "attention": "s", "swa": "^", "gdn": "D", "mamba2": "P"}
    entries = [e for e in result["entries"] if e.get(key) is not None]
    for ax, cost, xlabel in ((axes[0], "kv_bytes", "softmax KV bytes at the context"),
                             (axes[1], "decode_ms", "decode ms per token at the context")):
        groups = {}
        for e in entries:
            groups.setdefault((e["name"], e["method"] if e["method"] in METHODS else e["family"]), []).append(e)
        for (name, kind), group in groups.items():
            ax.plot([e[cost] for e in group], [e[key] for e in group], marker=markers.get(group[0]["family"], "o"),
                    linestyle="-" if len(group) > 1 else "", label=f"{name} {kind}")
        front = pareto([(e[cost], e[key]) for e in entries], higher)
        if front:
            ax.step([p[0] for p in front], [p[1] for p in front], "k--", where="post", linewidth=1, alpha=0.6,
                    label="Pareto front")
        if cost == "kv_bytes" and any(e[cost] > 0 for e in entries):
            ax.set_xscale("symlog", linthresh=max(1, min(e[cost] for e in entries if e[cost] > 0)))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['device']}, {result['dtype']}, context {result['context']} tokens", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def format_table(result: dict) -> str:
    lines = [f"{'checkpoint':<20} {'variant':<16} {'recall':>7} {'ppl':>8} {'KV bytes':>10} {'cache':>10} "
             f"{'prefill s':>10} {'decode ms':>10}"]
    lines.append("-" * len(lines[0]))
    for e in result["entries"]:
        recall = "-" if e.get("recall_accuracy") is None else f"{e['recall_accuracy']:.3f}"
        ppl = "-" if e.get("ppl") is None else f"{e['ppl']:.2f}"
        lines.append(f"{e['name'][:20]:<20} {e['label']:<16} {recall:>7} {ppl:>8} {bench.human_bytes(e['kv_bytes']):>10} "
                     f"{bench.human_bytes(e['cache_bytes']):>10} {e['prefill_s']:>10.4f} {e['decode_ms']:>10.3f}")
    return "\n".join(lines)
