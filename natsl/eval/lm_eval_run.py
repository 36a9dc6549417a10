"""`natsl eval-lm`: lm-evaluation-harness tasks on a natsl checkpoint (natsl.eval.lm_eval_adapter),
written as `lm_eval.json` (lm-eval's results), `lm_eval.md` (its table) and `lm_eval.png`."""

from __future__ import annotations

from natsl.errors import NatslError


def import_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise NatslError("lm-evaluation-harness is not installed; install it with `pip install 'natsl[lm-eval]'`") from None
    from natsl.eval import lm_eval_adapter

    return lm_eval_adapter


CODE_TAGS = ("!function",)  # lm-eval's YAML tag that imports a Python file of the task folder and runs it
MAX_TASK_FILES = 10_000


def check_task_folder(folder) -> None:
    """Refuse a --include-path task folder whose YAMLs would run code: lm-eval's `!function` tag imports a Python
    file beside them, and natsl runs no code from a file's contents. A folder (or file) that does not exist, or
    YAML that is not UTF-8, is a one-line NatslError too.

    Args:
        folder: the --include-path folder (a YAML file is accepted as lm-eval accepts it).
    """
    from pathlib import Path

    from natsl.errors import NatslError

    folder = Path(folder)
    if not folder.exists():
        raise NatslError(f"--include-path {str(folder)!r} does not exist; pass a folder of lm-eval task YAMLs")
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))
    if len(files) > MAX_TASK_FILES:
        raise NatslError(f"--include-path {str(folder)!r} holds {len(files):,} YAML files; pass the folder of the "
                         "tasks alone")
    for path in files:
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as err:
            raise NatslError(f"task file {str(path)!r} cannot be read as UTF-8 text ({type(err).__name__}); fix or "
                             "remove it") from None
        tag = next((t for t in CODE_TAGS if t in text), None)
        if tag:
            raise NatslError(f"task file {str(path)!r} uses {tag}, which makes lm-eval import and run a Python file "
                             "of that folder; natsl runs no code from a task folder: write the task without it (or "
                             "run lm_eval yourself on a folder you trust)")


def run_tasks(checkpoint, tasks: list[str], out, *, include_path=None, num_fewshot=None, limit=None,
              batch_size: int = 1, model_args: dict | None = None) -> dict:
    adapter = import_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    from natsl.atomic import write_json
    from natsl.eval.common import prepare_out_dir

    out_dir = prepare_out_dir(out)
    manager = None
    if include_path:  # indexing lm-eval's own task tree takes long: skip it when the local folder has them all
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if any(not manager.match_tasks([t]) for t in tasks):
            manager = None
    manager = manager or TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" (nor in {include_path})" if include_path else "; pass --include-path for a local task folder"
        raise NatslError(f"unknown lm-eval task {unknown[0]!r}{where}")
    model = adapter.NatslLM(pretrained=str(checkpoint), batch_size=batch_size, **(model_args or {}))
    results = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, batch_size=batch_size, log_samples=False)
    report = {"checkpoint": str(model.em.folder), "tasks": tasks, "num_fewshot": num_fewshot, "limit": limit,
              "results": results["results"], "n-shot": results.get("n-shot"), "versions": results.get("versions"),
              "config": {k: v for k, v in results.get("config", {}).items() if k != "model"}}
    # the scores first: lm-eval's table pulls in more packages (pytablewriter, typepy, pytz), and an environment
    # that lacks one must not lose the evaluation that ran
    json_path = write_json(out_dir / "lm_eval.json", _plain(report))
    from lm_eval.utils import make_table

    table = make_table(results) + samples_line(results)
    md = out_dir / "lm_eval.md"
    tmp = md.with_name(f".{md.name}.tmp")
    tmp.write_text(table, encoding="utf-8")
    tmp.replace(md)
    plot_scores(results, out_dir / "lm_eval.png", f"lm-eval: {model.em.name}")
    return {"table": table, "json": json_path, "results": results["results"]}


def sample_counts(results: dict) -> dict[str, int]:
    """Documents scored per task (lm-eval's `n-samples`, else its `sample_len`)."""
    counts = {task: entry.get("effective") for task, entry in (results.get("n-samples") or {}).items()
              if isinstance(entry, dict)}
    for task, metrics in results["results"].items():
        if counts.get(task) is None and isinstance(metrics.get("sample_len"), int):
            counts[task] = metrics["sample_len"]
    return {task: n for task, n in counts.items() if isinstance(n, int)}


def samples_line(results: dict) -> str:
    """The documents scored per task, under lm-eval's table (which leaves them out)."""
    counts = sample_counts(results)
    return "\nsamples: " + ", ".join(f"{task} {n}" for task, n in counts.items()) + "\n" if counts else ""


def score_bars(results: dict) -> list[dict]:
    """The scores to plot: lm-eval's metric entries ("metric,filter" keys; not their stderr, nor
    `sample_len`, `alias` and the other bookkeeping), with stderr and direction where lm-eval gives them."""
    higher = results.get("higher_is_better") or {}
    bars = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")
            if not comma or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            bars.append({"task": task, "metric": metric if filt in ("none", "") else f"{metric} ({filt})",
                         "value": float(value), "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                         "higher_is_better": (higher.get(task) or {}).get(metric)})
    return bars


def score_panels(bars: list[dict]) -> list[tuple[str, list[dict]]]:
    """(y-axis label, bars) per panel: scores between 0 and 1 (accuracies, exact match) together on a
    0-1 axis; the others (perplexities, bits per byte) on their own log axis, each on its own scale."""
    unit = [b for b in bars if 0.0 <= b["value"] <= 1.0 and b["higher_is_better"] is not False]
    panels = [("score (0 to 1)", unit)] if unit else []
    for metric in dict.fromkeys(b["metric"] for b in bars if b not in unit):
        group = [b for b in bars if b["metric"] == metric and b not in unit]
        direction = {True: "; higher is better", False: "; lower is better"}.get(group[0]["higher_is_better"], "")
        panels.append((f"{metric}{direction}", group))
    return panels


def plot_scores(results: dict, path, title: str):
    """lm_eval.png: one labelled panel per kind of score (score_panels), one bar per task and metric, the
    stderr as an error bar; each bar's name gives its value and the documents scored."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    counts = sample_counts(results)
    panels = score_panels(score_bars(results))
    if not panels:
        return None
    widths = [max(2, len(bars)) for _, bars in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(min(13, 1.5 + 1.6 * sum(widths)), 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, (label, bars) in zip(axes[0], panels):
        names = [f"{b['task']}\n{b['metric']} {b['value']:.3g}" + (f" ± {b['stderr']:.2g}" if b["stderr"] else "")
                 + (f"\nn={counts[b['task']]}" if b["task"] in counts else "") for b in bars]
        errors = [b["stderr"] or 0.0 for b in bars]
        ax.bar(range(len(bars)), [b["value"] for b in bars], yerr=errors if any(errors) else None, capsize=4)
        ax.set_xticks(range(len(bars)), names, fontsize=9)
        pad = max(0.0, (2 - len(bars)) / 2)  # a lone bar stays bar-wide
        ax.set_xlim(-0.5 - pad, len(bars) - 0.5 + pad)
        ax.set_ylabel(label)
        ax.set_xlabel("task, metric and value, documents scored")
        if label.startswith("score (0 to 1"):
            ax.set_ylim(0, 1)
        elif all(b["value"] > 0 for b in bars):
            ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def _plain(obj):
    """JSON-safe copy (lm-eval's results hold numpy numbers and, at times, callables)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)
