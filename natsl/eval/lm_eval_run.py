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


def run_tasks(checkpoint, tasks: list[str], out, *, include_path=None, num_fewshot=None, limit=None,
              batch_size: int = 1, model_args: dict | None = None) -> dict:
    adapter = import_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    from natsl.atomic import write_json
    from natsl.eval.common import prepare_out_dir, pyplot, save_figure

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
    from lm_eval.utils import make_table

    table = make_table(results)
    report = {"checkpoint": str(model.em.folder), "tasks": tasks, "num_fewshot": num_fewshot, "limit": limit,
              "results": results["results"], "n-shot": results.get("n-shot"), "versions": results.get("versions"),
              "config": {k: v for k, v in results.get("config", {}).items() if k != "model"}}
    json_path = write_json(out_dir / "lm_eval.json", _plain(report))
    md = out_dir / "lm_eval.md"
    tmp = md.with_name(f".{md.name}.tmp")
    tmp.write_text(table, encoding="utf-8")
    tmp.replace(md)
    plt = pyplot()
    bars = [(f"{task}\n{metric.split(',')[0]}", value) for task, metrics in results["results"].items()
            for metric, value in metrics.items()
            if isinstance(value, (int, float)) and "stderr" not in metric and metric != "alias"]
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(bars)), 3.5))
    ax.bar([b[0] for b in bars], [b[1] for b in bars])
    ax.set_title(f"lm-eval: {model.em.name}")
    ax.tick_params(axis="x", labelsize=8)
    save_figure(fig, out_dir / "lm_eval.png")
    return {"table": table, "json": json_path, "results": results["results"]}


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
