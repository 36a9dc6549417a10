"""`natsl compare`: quality against measured KV memory and latency, for models at KV budgets.

A model is a checkpoint (trained weights) or a recipe (seeded random weights, built as
`natsl bench-latency --recipe` builds it: natsl.inference.bench.load_model), for the latency and
memory of models no one has trained (the 800M recipes at 32K-128K). Each gives variants, by what
it is:

- NAtS-L layers: the router's own choice (a checkpoint's only), and each budget as the kept
  fraction forced on every NAtS-L layer (natsl.models.routing.force_keep_fraction);
- full softmax attention (Transformer, GDN Hybrid): the full cache, and each budget below 1 with
  each KV-eviction press (natsl.inference.evict: SnapKV, PyramidKV, AdaKV), the budget being the
  fraction of tokens kept;
- sliding-window attention (GDN + SWA): its window, as trained;
- GDN or Mamba2 only (a fixed-size memory): itself.

NAtS-L on a Mamba2 state (and its hybrid with Mamba2 layers) has NAtS-L layers: the first case.

For each variant of a checkpoint: quality through the evaluation functions of eval-recall (MQAR /
passkey accuracy) and eval-ppl (perplexity over `--data`); a press runs them through `EvictingLM`
(the cache read `chunk` tokens at a time and pressed after each), so the model predicts from its
evicted KV. A recipe's random weights predict nothing, so it gets no quality (nor does any model
with `quality` off). Then, at each context, on the same device, through natsl.inference.bench:
one prefill of `context` random tokens (with the press after it), the softmax K/V bytes the cache
then holds (`kv_bytes`: attention entries, NAtS-L softmax memory; `cache_bytes` adds the GDN
states and conv tails), prefill seconds and decode ms per token over that cache. A press on random
weights evicts all the same (by random scores), so its bytes and times are those of a trained one.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from natsl.errors import NatslError
from natsl.eval.common import EvalModel
from natsl.inference import bench
from natsl.inference.evict import METHODS, EvictingLM, Press
from natsl.models.nsa import NO_CACHE
from natsl.models.registry import KINDS, present
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


def variants(config, budgets: list[float], methods: list[str], trained: bool = True) -> list[Variant]:
    """The variants of a model of `config` (natsl.config.ModelConfig) at `budgets`; an untrained
    model (a recipe) has no router of its own to compare."""
    kinds = present(config)  # natsl.models.registry: each kind's family names its points
    routed = next((k for k in kinds if k.routed), None)
    if routed is not None:
        return [Variant("router", routed.family, "router")] * trained + \
            [Variant(f"keep {b:g}", routed.family, "keep_fraction", b) for b in budgets]
    kv = next((k for k in kinds if k.softmax_memory), None)
    if kv is not None and config.attn_window:
        return [Variant(f"window {config.attn_window}", kv.family, "window", window=config.attn_window)]
    if kv is not None:
        return [Variant("full", kv.family, "full", 1.0)] + \
            [Variant(f"{m} {b:g}", kv.family, m, b) for b in budgets if b < 1 for m in methods]
    # linear-memory layers only (GDN and / or Mamba2): a fixed-size memory, nothing to budget; named after
    # the SSD family where there is one
    label = "+".join(sorted({k.layer_type for k in kinds}))
    return [Variant(label, max(kinds, key=lambda k: k.state_rule == "gated_linear_rule").family, "none")]


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
        # what a router kept on the recall inputs themselves (KV bytes come from a random prompt)
        out["recall_keep_fraction"] = report["mean_keep_fraction"]
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


QUALITY_KEYS = ("recall_accuracy", "recall_keep_fraction", "recall_points", "ppl", "bits_per_byte")


@dataclass
class Source:
    """A model to compare: a checkpoint folder (its trained weights) or a recipe (random weights, as
    `natsl bench-latency --recipe` builds it)."""

    kind: str  # "checkpoint" or "recipe"
    path: str
    name: str
    recipe: object  # natsl.config.Recipe

    @property
    def trained(self) -> bool:
        return self.kind == "checkpoint"


def resolve_source(path: str) -> Source:
    """A folder is a checkpoint (or a run folder: its newest step); a YAML file or a shipped recipe's
    name (800m_hybrid, recall/gdn) is a recipe. Read and checked without building the model."""
    import natsl
    from natsl.config import shipped_recipe
    from natsl.eval.common import checkpoint_name
    from natsl.runtime import checkpoint_recipe_of

    where = Path(path)
    if where.is_dir():
        folder, recipe = checkpoint_recipe_of(path)
        return Source("checkpoint", path, checkpoint_name(folder), recipe)
    if where.is_file() or shipped_recipe(where.as_posix()) is not None:
        recipe = natsl.load_recipe(path)
        return Source("recipe", path, recipe.name, recipe)
    raise NatslError(f"{path!r} is neither a checkpoint folder nor a recipe; pass a folder written by `natsl train`, "
                     "a recipe YAML file or a shipped recipe's name such as 800m_hybrid")


def check_contexts(contexts: list[int]) -> None:
    if not contexts:
        raise NatslError("--context is empty; pass token counts such as 32768,65536,131072")
    bad = [c for c in contexts if c < 1]
    if bad:
        raise NatslError(f"--context must be at least 1 token, got {bad[0]}")


def check_sources(sources: list[Source], contexts: list[int]) -> None:
    """What would stop a model's measurement, before any model is built."""
    for source in sources:
        config = source.recipe.model
        if not all(k.has_cache for k in present(config)):  # its KV bytes and latency need a cache (natsl.models.nsa)
            raise NatslError(f"{source.name}: {NO_CACHE}; natsl compare cannot measure it yet, leave it out")
        if max(contexts) > config.max_seq_len:
            raise NatslError(f"--context {max(contexts)} is beyond {source.name}'s max_seq_len {config.max_seq_len}; "
                             "pass a shorter --context")


def load_source(source: Source, device, dtype, backend, seed: int) -> EvalModel:
    """The model of `source` in eval mode: a checkpoint as every evaluation loads it, a recipe with
    seeded random weights through natsl.inference.bench (as bench-latency builds it)."""
    from natsl.eval.common import load_eval_model
    from natsl.runtime import pick_backend, pick_device, pick_dtype

    if source.trained:
        return load_eval_model(source.path, device, dtype, backend)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    model, _, _ = bench.load_model(bench.BenchModel("recipe", source.path), dev, dt, pick_backend(backend, dev), seed)
    model.recipe = source.recipe  # as a loaded checkpoint's model carries its recipe (EvalModel.recipe)
    return EvalModel(model, None, Path(source.path), source.name, dev, dt)


def notes(sources: list[Source], plans: list[list[Variant]], quality: bool) -> list[str]:
    """The lines that say what the numbers are not: no quality, random-weight scores and routes."""
    lines = []
    recipes = [s.name for s in sources if not s.trained]
    if not quality:
        lines.append("latency and memory only (--no-quality): the quality columns are empty")
    elif recipes:
        lines.append(f"latency and memory only for {', '.join(recipes)}: a recipe has random weights, so no quality "
                     "is measured and its quality columns are empty")
    pressed = [s.name for s, plan in zip(sources, plans) if not s.trained and any(v.press() for v in plan)]
    if pressed:
        lines.append(f"the presses on {', '.join(pressed)} (random weights) still evict to their budget: their "
                     "scores are random, the KV bytes and times are what count")
    routers = [s.name for s, plan in zip(sources, plans) if s.trained and any(v.method == "router" for v in plan)]
    if routers and quality:
        lines.append(f"{', '.join(routers)}: a router's KV bytes and times are those of a random prompt at the context; "
                     "`kept` is what it kept on the recall inputs")
    routed = [s.name for s, plan in zip(sources, plans) if not s.trained and any(v.method == "keep_fraction" for v in plan)]
    if routed:
        lines.append(f"{', '.join(routed)}: an untrained router, so each kept fraction is forced by a seeded random "
                     "mask (no router variant)")
    return lines


def run_compare(models: list[str], *, budgets: list[float], methods: list[str], contexts: list[int],
                quality: bool = True, recall_args=None, ppl_args=None, chunk: int | None = None, decode_tokens: int = 8,
                repeats: int = 2, seed: int = 0, device=None, dtype=None, backend=None, cuda_graphs: bool = True,
                progress: bool = True, time_budget_s: float | None = None, on_update=None) -> dict:
    """Every variant of every model (checkpoint or recipe) at every context: quality, KV bytes,
    latency. `recall_args`: dict of recall_grid's task, lengths, pairs, vocab plus samples,
    batch_size (None: no recall); `ppl_args`: dict of data, max_len, windows, text_key (None: no
    perplexity); quality is measured on checkpoints only, and not at all when `quality` is false.

    One entry per (model, variant, context), the variant's quality repeated in each. The models are
    built one at a time; a point that runs out of memory is recorded as such and that variant's
    longer contexts are skipped. With `time_budget_s`, each model's share is in proportion to its
    variants (a Transformer's ten press variants against GDN's one), and a model may run until its
    share and those of the models before it have passed (time one leaves unused goes to the next),
    its first point as long as the whole budget is not spent; the points after that are recorded
    as skipped.
    `on_update(result)` is called after each point (to save it)."""
    from tqdm import tqdm

    from natsl.provenance import provenance
    from natsl.runtime import pick_device, pick_dtype

    check_budgets(budgets, methods)
    contexts = sorted(set(contexts))
    check_contexts(contexts)
    sources = [resolve_source(m) for m in models]
    check_sources(sources, contexts)
    quality = quality and (recall_args is not None or ppl_args is not None)
    plans = [variants(s.recipe.model, budgets, methods, trained=s.trained) for s in sources]
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    rates = bench.measure_rates(dev, dt)
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "dtype": str(dt).replace("torch.", ""), "backend": None, "contexts": contexts, "budgets": budgets,
              "methods": methods, "seed": seed, "quality": quality, "notes": notes(sources, plans, quality),
              "decode_tokens": decode_tokens, "repeats": repeats, "torch": torch.__version__,
              "provenance": provenance(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rates": rates, "entries": []}
    bar = tqdm(total=sum(len(plan) for plan in plans) * len(contexts), desc="compare", unit="point",
               disable=not progress)
    shares = [len(plan) for plan in plans]
    began = time.monotonic()
    for index, (source, plan) in enumerate(zip(sources, plans)):
        deadline = None if time_budget_s is None else began + time_budget_s * sum(shares[:index + 1]) / sum(shares)
        em = load_source(source, device, dtype, backend, seed)
        result["backend"] = result["backend"] or getattr(em.model, "backend", None)
        head = {"checkpoint": str(em.folder), "source": source.kind, "name": em.name,
                "parameters": em.model.num_parameters()}
        scores = {}
        for variant in plan:
            scores[variant.label] = dict.fromkeys(QUALITY_KEYS)  # null: not measured
            if quality and source.trained:
                bar.set_postfix_str(f"{em.name} {variant.label} quality")
                scores[variant.label].update(variant_quality(em, variant, recall_args, ppl_args, chunk, seed))
        bench.warm_up_model(em.model, min(contexts[0], 256), 1, em.device)
        failed, first = {}, True
        for context in contexts:
            for variant in plan:
                bar.set_postfix_str(f"{em.name} {variant.label} @ {context}")
                entry = {**head, **dataclasses.asdict(variant), "context": context, **scores[variant.label]}
                if deadline is not None and time.monotonic() > (began + time_budget_s if first else deadline):
                    failed.setdefault(variant.label, "time budget spent")
                if variant.label in failed:
                    entry["error"] = f"skipped: {failed[variant.label]}"
                else:
                    try:
                        entry.update(measure_cost(em, variant, context=context, decode_tokens=decode_tokens,
                                                  repeats=repeats, seed=seed, rates=rates, cuda_graphs=cuda_graphs))
                    except NatslError:
                        raise
                    except Exception as err:  # noqa: BLE001 - record the point and go on, as bench-latency does
                        oom = bench.is_oom(err)
                        first_line = str(err).splitlines()[0] if str(err) else ""
                        entry["error"] = "out of memory" if oom else f"{type(err).__name__}: {first_line}"
                        if oom:
                            failed[variant.label] = "out of memory at a shorter context"
                        bench.free_memory(em.device)
                    first = False
                result["entries"].append(entry)
                bar.update(1)
                if on_update is not None:
                    on_update(result)
        del em
        bench.free_memory(dev)
    bar.close()
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return result


def variant_quality(em: EvalModel, variant: Variant, recall_args, ppl_args, chunk, seed: int) -> dict:
    """measure_quality with the checkpoint's recall grid and perplexity windows."""
    recall = ppl = None
    if recall_args is not None:
        from natsl.eval.recall import recall_grid

        spec, points = recall_grid(em, recall_args.get("task"), recall_args.get("lengths"),
                                   recall_args.get("pairs"), recall_args.get("vocab"))
        recall = (spec, points, recall_args["samples"], recall_args["batch_size"])
    if ppl_args is not None:
        ppl = ppl_windows(em, ppl_args)
    return measure_quality(em, variant, recall=recall, ppl=ppl, seed=seed, chunk=chunk or em.recipe.model.block_size)


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


def quality_key(result: dict) -> tuple[str, str, bool] | None:
    """(entry key, axis label, higher is better) of the quality the result holds (None: none)."""
    if any(e.get("recall_accuracy") is not None for e in result["entries"]):
        return "recall_accuracy", "recall accuracy", True
    if any(e.get("ppl") is not None for e in result["entries"]):
        return "ppl", "perplexity", False
    return None


def pareto(points: list[tuple[float, float]], higher_better: bool) -> list[tuple[float, float]]:
    """The points no other point beats on both cost (lower) and quality, sorted by cost."""
    front, best = [], None
    for cost, quality in sorted(points, key=lambda p: (p[0], -p[1] if higher_better else p[1])):
        if best is None or (quality > best if higher_better else quality < best):
            front.append((cost, quality))
            best = quality
    return front


MARKERS = {kind.family: kind.marker for kind in KINDS}  # one per family (natsl.models.registry)


def series(entries: list[dict]) -> dict:
    """Entries grouped into the plotted lines: a model's budgets of one kind (kept fraction, a press)."""
    kinds = {"keep_fraction": "kept fraction", "router": "router", "full": "full cache", "window": "window"}
    groups = {}
    for e in entries:
        groups.setdefault(f"{e['name']} {kinds.get(e['method'], e['method'] if e['method'] in METHODS else e['family'])}",
                          []).append(e)
    return groups


def panel(ax, entries: list[dict], x: str, y: str, higher_better: bool, colors: dict) -> None:
    """y against x, one line per series, the Pareto front (lower x, better y) dashed."""
    for label, group in series(entries).items():
        group = sorted(group, key=lambda e: e[x])
        ax.plot([e[x] for e in group], [e[y] for e in group], marker=MARKERS.get(group[0]["family"], "o"),
                linestyle="-" if len(group) > 1 else "", color=colors[label], label=label)
    front = pareto([(e[x], e[y]) for e in entries], higher_better)
    if front:
        ax.step([p[0] for p in front], [p[1] for p in front], "k--", where="post", linewidth=1, alpha=0.6,
                label="Pareto front")
    positive = [e[x] for e in entries if e[x] > 0]
    if x == "kv_bytes" and positive:  # symlog keeps GDN's zero bytes on the axis
        # powers of two: the budgets halve the bytes, and the ticks read as whole KB / MB / GB
        if len(positive) < len(entries):
            ax.set_xscale("symlog", base=2, linthresh=min(positive))
        else:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_bytes_label)
        ax.xaxis.set_minor_formatter("")
    ax.grid(True, alpha=0.3)


def _bytes_label(value: float, _position=None) -> str:
    """A byte count as a tick label: 0, 512 B, 16 KB, 1.5 MB."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1024 or unit == "GB":
            return f"{value:.3g} {unit}" if value else "0"
        value /= 1024


def plot(result: dict, path):
    """Per context, decode ms and prefill s against KV bytes, and where quality was measured, quality
    against KV bytes and against decode ms: two panels a row (a context takes one or two rows), 11 pt
    text, at most 12.4 in (1488 px) wide; one marker per family, the Pareto front dashed, one legend
    above the panels."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    measured = [e for e in result["entries"] if "error" not in e]
    quality = quality_key(result)
    axes_spec = [("kv_bytes", "decode_ms", False, "softmax KV bytes", "decode ms per token"),
                 ("kv_bytes", "prefill_s", False, "softmax KV bytes", "prefill s")]
    if quality is not None:
        key, label, higher = quality
        axes_spec += [("kv_bytes", key, higher, "softmax KV bytes", label), ("decode_ms", key, higher,
                                                                            "decode ms per token", label)]
    rows = [(context, axes_spec[i:i + 2]) for context in result["contexts"] for i in range(0, len(axes_spec), 2)]
    palette = plt.get_cmap("tab20").colors
    colors = {label: palette[i % len(palette)] for i, label in enumerate(series(measured))}
    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(len(rows), 2, figsize=(12.4, 4.4 * len(rows)), squeeze=False)
        for row, (context, specs) in zip(axes, rows):
            at = [e for e in measured if e["context"] == context]
            for ax, (x, y, higher, xlabel, ylabel) in zip(row, specs):
                panel(ax, [e for e in at if e.get(y) is not None], x, y, higher, colors)
                ax.set_xlabel(xlabel)
                ax.set_ylabel(ylabel)
                ax.set_title(f"context {context} tokens")
        legend = {}
        for ax in axes.flat:
            legend.update(zip(*reversed(ax.get_legend_handles_labels())))
        fig.tight_layout(h_pad=2.0)
        title = f"{result['device']}, {result['dtype']}" + ("" if result.get("quality", True) else
                                                           ", latency and memory only")
        # as many columns as fit the figure's width: run folders of a sweep make long labels
        longest = max([len(label) for label in legend] + [1])
        fig.legend(list(legend.values()), list(legend), loc="lower center", bbox_to_anchor=(0.5, 1.0),
                   ncol=max(1, min(3, len(legend), int(12 / (1.0 + 0.085 * longest)))), title=title, frameon=False)
        return save_figure(fig, path)


def format_table(result: dict) -> str:
    """The notes, then one row per (model, variant, context); the model column fits the longest name (run
    folders of one sweep differ only at their ends, so a cut name would hide which is which)."""
    width = max([20] + [len(e["name"]) for e in result["entries"]])
    header = (f"{'model':<{width}} {'variant':<16} {'context':>8} {'recall':>7} {'kept':>5} {'ppl':>8} {'KV bytes':>10} "
              f"{'cache':>10} {'prefill s':>10} {'decode ms':>10}")
    lines = [f"note: {line}" for line in result.get("notes", [])] + [header, "-" * len(header)]
    for e in result["entries"]:
        recall = "-" if e.get("recall_accuracy") is None else f"{e['recall_accuracy']:.3f}"
        kept = "-" if e.get("recall_keep_fraction") is None else f"{e['recall_keep_fraction']:.2f}"
        ppl = "-" if e.get("ppl") is None else f"{e['ppl']:.2f}"
        row = f"{e['name']:<{width}} {e['label']:<16} {e['context']:>8} {recall:>7} {kept:>5} {ppl:>8} "
        if "error" in e:
            lines.append(row + e["error"])
        else:
            lines.append(row + f"{bench.human_bytes(e['kv_bytes']):>10} {bench.human_bytes(e['cache_bytes']):>10} "
                               f"{e['prefill_s']:>10.4f} {e['decode_ms']:>10.3f}")
    return "\n".join(lines)
