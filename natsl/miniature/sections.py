"""The report's sections: each stage's results turned into the numbers of one table (Table 1, the sweep,
Fig. 3, routing, compare, latency, eval-lm, the ablations)."""

from __future__ import annotations

from pathlib import Path

from natsl.miniature.ladder import ABLATIONS, is_routed, ordered, seeds_of
from natsl.miniature.results import (HEAD_TOL, NOT_MEASURED, SOURCE_TOL, SYNTHETIC, as_number, eval_names, locate,
                                     loss_at, matched_tokens, read_result, seed_spread, system_of)


def table1(names, training: dict, sweep: dict | None) -> dict:
    """Table 1's rows (the ladder, its extra seeds and any other trained name; the ablations are the sweep's and go
    to their own section) with each run's loss at the token count every one of them reached (`matched`)."""
    best = {p.get("system"): p for p in (sweep or {}).get("best_lm") or [] if isinstance(p, dict)}
    rows = {}
    for name in names:
        if name in ABLATIONS:
            continue
        result, point = training.get(name, {}), best.get(name, {})
        rows[name] = {"parameters": result.get("parameters") or point.get("parameters"),
                      # the rate the run trained at (--rates may have overridden the sweep's), else the sweep's best
                      "best_lr": result.get("lr", point.get("best_lr")), "sweep_val_loss": as_number(point.get("val_loss")),
                      "val_loss": as_number(result.get("val_loss")), "perplexity": as_number(result.get("perplexity")),
                      "tokens": result.get("tokens"), "status": result.get("status"),
                      "val_curve": result.get("val_curve") or []}
    curves = {n: r["val_curve"] for n, r in rows.items() if r["val_curve"]}
    matched = matched_tokens(curves)
    for r in rows.values():
        r["val_loss_matched"] = loss_at(r["val_curve"], matched) if matched is not None else None
    return {"rows": rows, "matched_tokens": matched, "matched_runs": sorted(curves, key=list(rows).index),
            "cut_short": sorted((n for n, r in rows.items() if r["status"] not in (None, "done")), key=list(rows).index)}


def seeds_at(t1: dict, system: str = "natsl_hybrid") -> dict | None:
    """The mean over a system's seeds (itself and SYSTEM_sN) of their matched-token losses, with min, max and n."""
    rows = t1["rows"]
    return seed_spread([rows[n]["val_loss_matched"] for n in seeds_of(system, rows)
                        if rows[n]["val_loss_matched"] is not None])


# ----------------------------------------------------------------------------- the sweep


def _log_reason(log: Path) -> str | None:
    """A failed run's reason from its log.txt: the first line starting with 'natsl.errors.NatslError:' or 'error:'."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip() for line in lines if line.startswith(("natsl.errors.NatslError:", "error:"))), None)


def sweep_section(root: Path, sweep: dict | None) -> dict:
    """Per swept system: its rates' val losses (ranked), the best rate and whether it lies at the grid's edge; a
    system whose every sweep run failed: "failed" and the reason its first run's log gives.

    Args:
        root: the miniature's folder (sweep/runs/ID/log.txt).
        sweep: sweep/summary.json (best_lm and runs).
    Returns:
        name -> {"ranking": [{"lr", "val_loss"}...] lowest loss first, "best_lr", "val_loss", "grid": rates swept,
        "edge": None / "lower" / "higher", "failed": None or the reason, "tokens": the sweep's tokens}.
    """
    out: dict[str, dict] = {}
    runs = [r for r in (sweep or {}).get("runs") or [] if isinstance(r, dict) and r.get("system")]
    grids: dict[str, set] = {}
    for r in runs:
        if as_number(r.get("lr")) is not None:
            grids.setdefault(r["system"], set()).add(float(r["lr"]))
    for point in (sweep or {}).get("best_lm") or []:
        if not isinstance(point, dict) or not point.get("system"):
            continue
        name = point["system"]
        ranking = [{"lr": as_number(x.get("lr")), "val_loss": as_number(x.get("val_loss"))}
                   for x in point.get("ranking") or [] if isinstance(x, dict)]
        grid = sorted(grids.get(name, set()) | {x["lr"] for x in ranking if x["lr"] is not None})
        best = as_number(point.get("best_lr"))
        edge = None
        if best is not None and len(grid) > 1:
            edge = "lower" if best <= grid[0] else "higher" if best >= grid[-1] else None
        tokens = [s.get("tokens") for s in point.get("seeds") or [] if isinstance(s, dict) and as_number(s.get("tokens"))]
        out[name] = {"ranking": ranking, "best_lr": best, "val_loss": as_number(point.get("val_loss")), "grid": grid,
                     "edge": edge, "failed": None, "tokens": max(tokens) if tokens else None}
    by_system: dict[str, list] = {}
    for r in runs:
        by_system.setdefault(r["system"], []).append(r)
    for name, mine in by_system.items():
        if name in out or not all("failed" in r for r in mine):
            continue
        reasons = [_log_reason(root / "sweep" / "runs" / str(r.get("id")) / "log.txt") for r in mine]
        out[name] = {"ranking": [], "best_lr": None, "val_loss": None, "grid": sorted(grids.get(name, set())),
                     "edge": None, "failed": next((x for x in reasons if x), "failed"), "tokens": None}
    return {n: out[n] for n in ordered(out)}


def recipe_seq_len(folders, problems: list[str]) -> int | None:
    """train.seq_len of the first recipe.yaml found in `folders` (a step folder holds one, as does the training
    run's folder: natsl.checkpoint and natsl.training.trainer write them), else None."""
    from natsl.config import load_yaml_file
    from natsl.errors import NatslError

    for folder in folders:
        path = Path(folder) / "recipe.yaml"
        if not path.is_file():
            continue
        try:
            recipe = load_yaml_file(path, "the report reads its train.seq_len")
        except (NatslError, OSError) as err:
            problems.append(str(err))
            continue
        seq_len = ((recipe or {}).get("train") or {}).get("seq_len") if isinstance(recipe, dict) else None
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0:
            return seq_len
    return None


def ppl_section(ppl: dict | None, checkpoints, root: Path | None = None, problems: list[str] | None = None) -> dict:
    """name -> whole-window ppl, loss within the training length and in the last bucket (the longest context).

    The training length is ppl.json's train_seq_len, else the recipe.yaml of the step or its run folder.
    """
    out = {}
    for res in (ppl or {}).get("checkpoints") or []:
        name = system_of(res.get("path"), res.get("name"), checkpoints, root)
        train = res.get("train_seq_len")
        if not (isinstance(train, int) and train > 0) and res.get("path"):
            step = locate(res["path"], root) if root is not None else Path(res["path"])
            run = checkpoints.get(name)
            train = recipe_seq_len([step, step.parent.parent, *([run, run / "train"] if run else [])],
                                   problems if problems is not None else [])
        train = train or 0
        buckets = [b for b in res.get("buckets") or [] if isinstance(b, dict)]
        inside = [b for b in buckets if b.get("end", 0) <= train]
        tokens = sum(b["tokens"] for b in inside)
        loss_in = sum(b["loss"] * b["tokens"] for b in inside) / tokens if tokens else None
        last = buckets[-1] if buckets else {}
        beyond = train and (last.get("start") or 0) >= train  # the ratio speaks of extrapolation only then
        ratio = as_number(last.get("loss")) / loss_in if beyond and loss_in and as_number(last.get("loss")) is not None else None
        out[name] = {"ppl": as_number(res.get("ppl")), "loss": as_number(res.get("loss")), "bits_per_byte": as_number(res.get("bits_per_byte")),
                     "train_seq_len": train, "loss_within_train_len": loss_in, "loss_last_bucket": as_number(last.get("loss")),
                     "last_bucket": [last.get("start"), last.get("end")] if last else None,
                     "last_vs_within": ratio,
                     "curve": [[(b["start"] + b["end"]) / 2, b["loss"]] for b in buckets]}
    return out


def routing_verdict(datasets: list[dict]) -> dict:
    """Per block or per head: every group's kept fraction per (layer, source), and how they spread over sources."""
    fractions = [g for ds in datasets for layer in ds.get("layers", []) for g in layer.get("group_keep_fraction", [])]
    inner = [g for g in fractions if HEAD_TOL < g < 1 - HEAD_TOL]
    spread = 0.0
    if len(datasets) > 1:
        layers = datasets[0].get("layers", [])
        for li, layer in enumerate(layers):
            for gi in range(len(layer.get("group_keep_fraction", []))):
                vals = [ds["layers"][li]["group_keep_fraction"][gi] for ds in datasets
                        if li < len(ds.get("layers", [])) and gi < len(ds["layers"][li].get("group_keep_fraction", []))]
                if vals:
                    spread = max(spread, max(vals) - min(vals))
    if not fractions:
        kind = NOT_MEASURED
    elif not inner:
        kind = "per head (each group keeps ~all or ~none of its blocks)"
    elif spread > SOURCE_TOL:
        kind = "per block (fractions strictly between 0 and 1, differing by source)"
    else:
        kind = "per block, but alike across sources"
    if fractions:
        kind += (f"; {len(inner)} of {len(fractions)} (layer, group, source) fractions lie strictly between "
                 f"{HEAD_TOL:g} and {1 - HEAD_TOL:g}")
        if len(datasets) > 1:
            kind += f", the largest spread of one group over sources is {spread:.2f}"
    return {"routing": kind, "sources_compared": [ds.get("name") for ds in datasets],
            "groups_strictly_between": len(inner), "groups": len(fractions),
            "max_spread_over_sources": spread if len(datasets) > 1 else None}


def routing_section(root: Path, problems) -> dict:
    out = {}
    for name in ordered(n for n in eval_names(root, "routing")
                      if is_routed(n) and (root / "eval" / f"routing_{n}" / "routing.json").is_file()):
        data = read_result(root / "eval" / f"routing_{name}" / "routing.json", problems)
        if not isinstance(data, dict):
            continue
        datasets = data.get("datasets") or []
        # routing "per source" is about the held-out sources; the synthetic text is shown, not counted
        held = [ds for ds in datasets if SYNTHETIC not in str(ds.get("name"))]
        out[name] = {"seq_len": data.get("seq_len"), "natsl_layers": data.get("natsl_layers"),
                     "datasets": [{"name": ds.get("name"), "keep_fraction": as_number(ds.get("keep_fraction")),
                                   "kv_ratio": as_number((ds.get("memory") or {}).get("kv_ratio")),
                                   "layers": [{"layer": layer.get("layer"),
                                               "group_keep_fraction": layer.get("group_keep_fraction")}
                                              for layer in ds.get("layers", [])]} for ds in datasets],
                     **routing_verdict(held if len(held) > 1 else datasets)}
    return out


TRAINING_ROUTE_POINTS = 40  # columns of the routing-over-training map (logged steps are averaged into them)


def routing_over_training(checkpoints: dict[str, Path], training: dict[str, dict], problems) -> dict:
    """name -> the kept fraction of every routing group over training, from the run's metrics.jsonl (`keep_groups`,
    logged by natsl train): {"labels": ["L3 g0", ...], "tokens": [...], "keep": [[per label] per point]}, the
    logged steps averaged into at most TRAINING_ROUTE_POINTS equal spans of tokens (the last span ends at the
    run's last logged step). Only the NAtS-L checkpoints; a run without such lines is left out."""
    from natsl.files import read_json_records

    out = {}
    for name in ordered(n for n in {*checkpoints, *training} if is_routed(n)):
        places = [checkpoints.get(name), Path(training[name]["run"]) if name in training else None]
        path = next((pl / sub / "metrics.jsonl" for pl in places if pl is not None for sub in (".", "train")
                     if (pl / sub / "metrics.jsonl").is_file()), None)
        if path is None:
            continue
        try:
            records = read_json_records(path)
        except OSError as err:
            problems.append(f"{path}: {err}")
            continue
        points = [(float(row["tokens"]), row["keep_groups"]) for row in records
                  if isinstance(row.get("keep_groups"), dict) and as_number(row.get("tokens")) is not None]
        if not points:
            continue
        layers = sorted(points[-1][1], key=int)
        labels = [f"L{layer} g{g}" for layer in layers for g in range(len(points[-1][1][layer]))]
        rows = [[float(v) for layer in layers for v in groups.get(layer, [])] for _, groups in points]
        keep = [(t, r) for (t, _), r in zip(points, rows) if len(r) == len(labels)]
        last = keep[-1][0]
        spans = min(TRAINING_ROUTE_POINTS, len(keep))
        binned: dict[int, list] = {}
        for t, r in keep:
            binned.setdefault(min(spans - 1, int(t / last * spans)), []).append(r)
        columns = sorted(binned)
        out[name] = {"labels": labels, "tokens": [(c + 1) * last / spans for c in columns],
                     "keep": [[sum(col) / len(col) for col in zip(*binned[c])] for c in columns]}
    return out


def compare_section(compare: dict | None, checkpoints, root: Path | None = None) -> list[dict]:
    rows = []
    entries = (compare or {}).get("entries") or []
    full = {}  # context -> the Transformer's full-cache KV bytes
    for e in entries:
        name = system_of(e.get("checkpoint"), e.get("name"), checkpoints, root)
        e = {**e, "system": name}
        if name == "transformer" and e.get("method") == "full" and as_number(e.get("kv_bytes")):
            full[e.get("context")] = e["kv_bytes"]
        rows.append(e)
    for e in rows:
        ref = full.get(e.get("context"))
        e["kv_vs_transformer"] = e["kv_bytes"] / ref if ref and as_number(e.get("kv_bytes")) is not None else None
    return rows


def latency_section(latency: dict | None, checkpoints, root: Path | None = None) -> dict:
    out = {}
    for model in (latency or {}).get("models") or []:
        name = system_of(model.get("path"), model.get("name"), checkpoints, root)
        out[name] = {str(p.get("context")): ({"error": p["error"]} if "error" in p else
                                             {"prefill_s": p.get("prefill_s"), "decode_ms": p.get("decode_ms"),
                                              "kv_bytes": p.get("kv_bytes")}) for p in model.get("points", [])}
    return out


def lm_eval_section(root: Path, problems) -> dict:
    out = {}
    for folder in sorted((root / "eval").glob("lm_eval_*")):
        data = read_result(folder / "lm_eval.json", problems)
        if isinstance(data, dict):
            scores = {}
            for task, metrics in (data.get("results") or {}).items():
                for key, value in (metrics or {}).items():
                    metric, comma, _ = key.partition(",")
                    if comma and not metric.endswith("_stderr") and as_number(value) is not None:
                        scores[f"{task} {metric}"] = value
            out[folder.name[len("lm_eval_"):]] = scores
    return out


def ablation_section(swept: dict, ppl: dict, routing: dict) -> dict:
    """natsl_hybrid's best sweep point and each ablation's (the ablations are trained in the sweep only), with the
    ablation's loss less natsl_hybrid's, eval-ppl's ppl and the mean kept fraction of its checkpoint where measured.

    Args:
        swept: sweep_section's result; ppl, routing: the sections' results.
    Returns:
        name -> {"best_lr", "val_loss", "delta", "failed", "ppl_long", "kept"}, natsl_hybrid first.
    """
    base = (swept.get("natsl_hybrid") or {}).get("val_loss")
    out = {}
    for n in ("natsl_hybrid", *ABLATIONS):
        point = swept.get(n)
        if point is None and n not in ppl and n not in routing:
            continue
        point = point or {}
        loss = point.get("val_loss")
        kept = [d["keep_fraction"] for d in routing.get(n, {}).get("datasets", []) if d["keep_fraction"] is not None]
        out[n] = {"best_lr": point.get("best_lr"), "val_loss": loss, "failed": point.get("failed"),
                  "delta": loss - base if loss is not None and base is not None and n != "natsl_hybrid" else None,
                  "ppl_long": (ppl.get(n) or {}).get("ppl"), "kept": sum(kept) / len(kept) if kept else None}
        if n == "natsl_hybrid":  # its evaluated checkpoint is the full run's, not the sweep point compared here
            out[n].update(ppl_long=None, kept=None)
    return out
