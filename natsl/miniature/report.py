"""The report of `natsl miniature`: the paper's tables and figures in miniature, from what the stages wrote.

`write_report(ROOT)` reads, each where present (a missing piece is "not measured", never an error):

- ROOT/sweep/summary.json: the learning-rate sweep (natsl.training.sweep_lm: `best_lm`, per system its
  best_lr and the ranking of its rates);
- ROOT/checkpoints.json (else ROOT/eval/checkpoints.json): name -> training run folder, and the training
  results beside them (RUN/result.json or a parent's, else ROOT/train/runs/ID/result.json whose run.json
  names the system: val_loss, perplexity, tokens, parameters, val_curve);
- ROOT/eval: ppl/ppl.json (natsl.cli.eval_ppl), ruler_NAME/ruler.json (natsl.cli.eval_ruler),
  routing_NAME/routing.json (natsl.cli.inspect_routing), compare/compare.json (natsl.eval.compare),
  latency/latency.json (natsl.inference.bench), lm_eval_NAME/lm_eval.json (natsl.eval.lm_eval_run) and
  eval_status.json (natsl.miniature.evaluate: why a job did not run);

and writes ROOT/report/report.md (the tables and the verdict on the issue's five claims), tables.json (the
same numbers) and PNG figures beside them. Runs stopped by deadlines train different token counts: Table 1 and
claim 1 compare losses at the largest validation point every ladder run reached; the ablations (trained in the
sweep only) are compared with the sweep's natsl_hybrid point; claims 2 and 3 are judged only where eval-ppl's
windows exceed the training length and RULER reached 4K; quick (smoke) evaluations are said at the top. Paths
the stages wrote relative to the project's folder are found again in a moved or copied ROOT (locate). Figures: validation curves, loss against position to 8x the training
length (Fig. 3), RULER accuracy against length (Table 2), the kept fraction per layer, group and
source of every NAtS-L checkpoint (Figs. 5/6), and the same per layer and group during training, from each NAtS-L
run's metrics.jsonl (`keep_groups`; Fig. 5).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import NamedTuple

from natsl.miniature.evaluate import ABLATIONS, LADDER, is_routed, is_seed, ordered, seeds_of, split_seed

NOT_MEASURED = "not measured"
# A routing group whose kept fraction is within this of 0 or 1 everywhere routes per head (it keeps all of
# its blocks or none); sources whose fractions differ by more than it are routed differently.
HEAD_TOL = 0.05
SOURCE_TOL = 0.05
SYNTHETIC = "synthetic"
# Two validation points within one optimizer step of tokens (the miniature's 65536) count as one token count.
TOKEN_TOL = 65536


# ----------------------------------------------------------------------------- reading


def _read(path: Path, problems: list[str]):
    """A JSON file's object, or None when it is missing; one that cannot be read is noted in `problems`."""
    from natsl.errors import NatslError
    from natsl.files import read_json

    if not path.is_file():
        return None
    try:
        data = read_json(path, "the report leaves it out")
    except (NatslError, OSError) as err:
        problems.append(str(err))
        return None
    return data if isinstance(data, (dict, list)) else None


def _num(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _existing(parts, base: Path | None) -> int:
    """How many leading parts of a relative path exist (under `base`, or from here when None)."""
    have = 0
    while have < len(parts) and (Path(*parts[:have + 1]) if base is None else base.joinpath(*parts[:have + 1])).exists():
        have += 1
    return have


def locate(path, root: Path) -> Path:
    """Where a path the stages wrote lies now. Absolute: as it is. Relative: the reading of it whose leading folders
    exist the furthest: under ROOT, from here, or (the folder was moved or copied: "runs/miniature/train/..." was
    written from the project's folder) a tail of it under ROOT; ties go in that order. A step folder since deleted
    still maps as its run folder does.
    """
    path = Path(path)
    if path.is_absolute():
        return path
    parts = path.parts
    best, depth = root / path, _existing(parts, root)
    here = _existing(parts, None)
    if here > depth:
        best, depth = path, here
    for i in range(1, len(parts)):
        have = _existing(parts[i:], root)
        if have > depth:
            best, depth = root.joinpath(*parts[i:]), have
    return best


def read_checkpoints(root: Path, problems: list[str]) -> dict[str, Path]:
    """name -> run folder, from ROOT/checkpoints.json ({name: path} or {"checkpoints": {...}}) or the eval copy."""
    for path in (root / "checkpoints.json", root / "eval" / "checkpoints.json"):
        data = _read(path, problems)
        if isinstance(data, dict):
            data = data.get("checkpoints", data) if isinstance(data.get("checkpoints"), dict) else data
            return {name: locate(folder, root) for name, folder in data.items() if isinstance(folder, str)}
    return {}


def read_training(root: Path, checkpoints: dict[str, Path], problems: list[str]) -> dict[str, dict]:
    """name -> its training result.json (with "run": the folder it came from)."""
    found: dict[str, dict] = {}
    for name, folder in checkpoints.items():
        for place in (folder, folder.parent, folder.parent.parent):
            result = _read(place / "result.json", problems)
            if isinstance(result, dict):
                found[name] = {**result, "run": str(place)}
                break
    runs = root / "train" / "runs"
    if runs.is_dir():
        for run in sorted(p for p in runs.iterdir() if p.is_dir()):
            spec = _read(run / "run.json", problems)
            name = spec.get("system") if isinstance(spec, dict) else None
            if name and isinstance(spec.get("seed"), int) and spec["seed"]:
                name = f"{name}_s{spec['seed']}"  # the ladder's extra seeds (natsl_hybrid_s1, ...)
            if name and name not in found:
                result = _read(run / "result.json", problems)
                if isinstance(result, dict):
                    found[name] = {**result, "run": str(run)}
            if name in found and isinstance(spec.get("lr"), (int, float)):
                found[name].setdefault("lr", spec["lr"])
    return found


def system_of(path, label, checkpoints: dict[str, Path], root: Path | None = None) -> str:
    """The checkpoint name whose run folder is `path` or holds it (the innermost), else `label`; `root`: find a
    relative `path` as read_checkpoints found the folders (see locate)."""
    try:
        where = (locate(path, root) if root is not None else Path(path)).resolve()
    except (TypeError, OSError):
        return str(label)
    best, depth = None, -1
    for name, folder in checkpoints.items():
        folder = folder.resolve()
        if (where == folder or folder in where.parents) and len(folder.parts) > depth:
            best, depth = name, len(folder.parts)
    return best or str(label)


def order(names) -> list[str]:
    """The ladder first (each system followed by its seeds), then the ablations, and any other name."""
    return ordered(names)


def eval_names(root: Path, kind: str) -> list[str]:
    """The checkpoint names with an evaluation folder root/eval/KIND_NAME."""
    folder = root / "eval"
    if not folder.is_dir():
        return []
    return [p.name[len(kind) + 1:] for p in folder.iterdir() if p.is_dir() and p.name.startswith(kind + "_")]


# ----------------------------------------------------------------------------- formatting


def fmt(value, digits: int = 3) -> str:
    value = _num(value)
    if value is None:
        return "-"
    if abs(value) >= 1e4 or (0 < abs(value) < 1e-3):
        return f"{value:.{digits}g}"
    return f"{value:.{digits}f}"


def human_bytes(n) -> str:
    n = _num(n)
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024


def md_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sections


def fmt_tokens(n) -> str:
    """A token count as people read it: 12,451,840 (12.5M)."""
    n = _num(n)
    if n is None:
        return "-"
    return f"{int(n):,} ({n / 1e6:.1f}M)" if n >= 1e6 else f"{int(n):,}"


def _curve(value) -> list[tuple[float, float]]:
    """A val_curve's [tokens, loss] points that are numbers, by tokens."""
    points = []
    for p in value or []:
        if isinstance(p, (list, tuple)) and len(p) == 2 and _num(p[0]) is not None and _num(p[1]) is not None:
            points.append((float(p[0]), float(p[1])))
    return sorted(points)


def loss_at(curve, tokens: float, tol: float = TOKEN_TOL) -> float | None:
    """The curve's loss at the point within `tol` tokens of `tokens` (the nearest), else None: nothing is interpolated."""
    near = [(abs(t - tokens), loss) for t, loss in _curve(curve) if abs(t - tokens) <= tol]
    return min(near)[1] if near else None


def matched_tokens(curves: dict[str, list], tol: float = TOKEN_TOL) -> float | None:
    """The largest token count at which every curve has a point (within `tol`): at most the smallest of their last
    points, snapped to a point each has. None when a curve is empty or no count is shared.

    Args:
        curves: name -> val_curve ([[tokens, loss], ...]).
        tol: tokens two points may differ by and count as one count (a step of tokens).
    Returns:
        The shared count (the first run's point's tokens), or None.
    """
    points = {n: _curve(c) for n, c in curves.items()}
    if not points or any(not c for c in points.values()):
        return None
    last = min(c[-1][0] for c in points.values())
    candidates = sorted({t for c in points.values() for t, _ in c if t <= last + tol}, reverse=True)
    for t in candidates:
        if all(loss_at(c, t, tol) is not None for c in points.values()):
            return t
    return None


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
                      "best_lr": result.get("lr", point.get("best_lr")), "sweep_val_loss": _num(point.get("val_loss")),
                      "val_loss": _num(result.get("val_loss")), "perplexity": _num(result.get("perplexity")),
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
    losses = [rows[n]["val_loss_matched"] for n in seeds_of(system, rows) if rows[n]["val_loss_matched"] is not None]
    if not losses:
        return None
    return {"mean": sum(losses) / len(losses), "min": min(losses), "max": max(losses), "n": len(losses)}


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
        if _num(r.get("lr")) is not None:
            grids.setdefault(r["system"], set()).add(float(r["lr"]))
    for point in (sweep or {}).get("best_lm") or []:
        if not isinstance(point, dict) or not point.get("system"):
            continue
        name = point["system"]
        ranking = [{"lr": _num(x.get("lr")), "val_loss": _num(x.get("val_loss"))}
                   for x in point.get("ranking") or [] if isinstance(x, dict)]
        grid = sorted(grids.get(name, set()) | {x["lr"] for x in ranking if x["lr"] is not None})
        best = _num(point.get("best_lr"))
        edge = None
        if best is not None and len(grid) > 1:
            edge = "lower" if best <= grid[0] else "higher" if best >= grid[-1] else None
        tokens = [s.get("tokens") for s in point.get("seeds") or [] if isinstance(s, dict) and _num(s.get("tokens"))]
        out[name] = {"ranking": ranking, "best_lr": best, "val_loss": _num(point.get("val_loss")), "grid": grid,
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
    return {n: out[n] for n in order(out)}


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
        ratio = _num(last.get("loss")) / loss_in if beyond and loss_in and _num(last.get("loss")) is not None else None
        out[name] = {"ppl": _num(res.get("ppl")), "loss": _num(res.get("loss")), "bits_per_byte": _num(res.get("bits_per_byte")),
                     "train_seq_len": train, "loss_within_train_len": loss_in, "loss_last_bucket": _num(last.get("loss")),
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
    for name in order(n for n in eval_names(root, "routing")
                      if is_routed(n) and (root / "eval" / f"routing_{n}" / "routing.json").is_file()):
        data = _read(root / "eval" / f"routing_{name}" / "routing.json", problems)
        if not isinstance(data, dict):
            continue
        datasets = data.get("datasets") or []
        # routing "per source" is about the held-out sources; the synthetic text is shown, not counted
        held = [ds for ds in datasets if SYNTHETIC not in str(ds.get("name"))]
        out[name] = {"seq_len": data.get("seq_len"), "natsl_layers": data.get("natsl_layers"),
                     "datasets": [{"name": ds.get("name"), "keep_fraction": _num(ds.get("keep_fraction")),
                                   "kv_ratio": _num((ds.get("memory") or {}).get("kv_ratio")),
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
    for name in order(n for n in {*checkpoints, *training} if is_routed(n)):
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
                  if isinstance(row.get("keep_groups"), dict) and _num(row.get("tokens")) is not None]
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
        if name == "transformer" and e.get("method") == "full" and _num(e.get("kv_bytes")):
            full[e.get("context")] = e["kv_bytes"]
        rows.append(e)
    for e in rows:
        ref = full.get(e.get("context"))
        e["kv_vs_transformer"] = e["kv_bytes"] / ref if ref and _num(e.get("kv_bytes")) is not None else None
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
        data = _read(folder / "lm_eval.json", problems)
        if isinstance(data, dict):
            scores = {}
            for task, metrics in (data.get("results") or {}).items():
                for key, value in (metrics or {}).items():
                    metric, comma, _ = key.partition(",")
                    if comma and not metric.endswith("_stderr") and _num(value) is not None:
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
    for n in ("natsl_hybrid",) + ABLATIONS:
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


# ----------------------------------------------------------------------------- claims


INCONCLUSIVE = "inconclusive"


def _verdict(ok: bool | None) -> str:
    return NOT_MEASURED if ok is None else ("holds" if ok else "fails")


class ForcedMeasure(NamedTuple):
    """One of eval-ruler's teacher-forced measures (natsl.eval.ruler.answer_accuracy)."""

    key: str  # its means in ruler.json
    sample_key: str  # its value per sample in ruler_samples.jsonl
    name: str  # in the claim's numbers
    label: str  # its panel in ruler_by_length.png
    heading: str  # of its table in the report


# In the order the needle claim falls back on them.
TEACHER_FORCED = (
    ForcedMeasure("answer_accuracy", "answer_token_accuracy", "teacher-forced answer-token accuracy",
                  "answer-token accuracy, teacher-forced",
                  "Teacher-forced answer-token accuracy (the prompt followed by the answer in one forward; the "
                  "fraction of the value's tokens predicted exactly; `natsl eval-ruler --answer-accuracy`):"),
    ForcedMeasure("answer_logprob", "answer_logprob", "the answer tokens' mean log-probability, teacher-forced (nats)",
                  "answer log-probability (nats), teacher-forced",
                  "The answer tokens' mean log-probability, teacher-forced (nats; higher retrieves more):"),
)


# eval-ruler's per-sample measures (ruler_samples.jsonl) in the order the needle claim judges on them: the
# first on which not every sample of both systems scores 0 (string match is 0 for every sample of a model too
# weak for the task; the log-probability is never 0). A difference counts where it exceeds NEEDLE_SE standard
# errors of the paired per-sample differences: the samples are the same prompts for every system (eval-ruler
# draws them from its --seed alone).
SAMPLE_MEASURES = (("score", "string match"), *((m.sample_key, m.name) for m in TEACHER_FORCED))
NEEDLE_SE = 2.0
MAX_SAMPLES_BYTES = 64 << 20


def read_ruler_samples(path: Path, problems: list[str]) -> dict | None:
    """(task, length, index) -> that sample's record (answers and SAMPLE_MEASURES) from eval-ruler's
    ruler_samples.jsonl; None when the file is missing or unreadable (noted in `problems`)."""
    from natsl.errors import NatslError
    from natsl.files import parse_json, read_small_text

    if not path.is_file():
        return None
    try:
        text = read_small_text(path, MAX_SAMPLES_BYTES, "the report leaves it out")
        records = [parse_json(line, f"{str(path)!r} line {i}", "the report leaves it out")
                   for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    except (NatslError, OSError) as err:
        problems.append(str(err))
        return None
    samples = {}
    for r in records:
        if isinstance(r, dict) and isinstance(r.get("task"), str) and type(r.get("length")) is int \
                and type(r.get("index")) is int:
            samples[(r["task"], r["length"], r["index"])] = {
                "answers": r.get("answers"), **{key: _num(r.get(key)) for key, _ in SAMPLE_MEASURES}}
    return samples


def paired_gap(mine: list[dict], theirs: list[dict], key: str, length: int) -> dict | None:
    """The samples of `length` that every one of `mine` (a system's seeds) and of `theirs` (the other's seeds)
    scored on `key`, for the same prompt (equal answers): the mean over samples of (my seeds' mean - their
    seeds' mean), its standard error, both sides' means and the count; None for fewer than two such samples."""
    diffs, ours, others = [], [], []
    for sample_key, first in theirs[0].items():
        if sample_key[1] != length:
            continue
        mine_at, theirs_at = [m.get(sample_key) for m in mine], [t.get(sample_key) for t in theirs]
        if any(s is None or s.get(key) is None or s.get("answers") != first.get("answers")
               for s in mine_at + theirs_at):
            continue
        ours.append(sum(s[key] for s in mine_at) / len(mine_at))
        others.append(sum(s[key] for s in theirs_at) / len(theirs_at))
        diffs.append(ours[-1] - others[-1])
    n = len(diffs)
    if n < 2:
        return None
    gap = sum(diffs) / n
    se = math.sqrt(sum((d - gap) ** 2 for d in diffs) / (n - 1) / n)
    return {"gap": gap, "se": se, "mine": sum(ours) / n, "theirs": sum(others) / n, "n": n}


def needle_claim_from_samples(samples: dict, lengths: list[int]) -> dict | None:
    """The needle claim judged on the paired per-sample differences between the NAtS-L Hybrid (the mean of
    its seeds) and the GDN Hybrid at every RULER length >= 4K, on the first SAMPLE_MEASURES that tells them
    apart: holds where the NAtS-L Hybrid is ahead by more than NEEDLE_SE standard errors at every length, fails
    where it is behind by more at some length, else inconclusive. None without both systems' samples."""
    mine = [samples[n] for n in seeds_of("natsl_hybrid", samples) if samples.get(n)]
    theirs = [samples[n] for n in seeds_of("gdn_hybrid", samples) if samples.get(n)]
    if not samples.get("natsl_hybrid") or not samples.get("gdn_hybrid") or not lengths:
        return None
    seeds = f"{len(mine)} seed(s)" + (f", gdn_hybrid of its {len(theirs)}" if len(theirs) > 1 else "")
    for i, (key, what) in enumerate(SAMPLE_MEASURES):
        gaps = {n: paired_gap(mine, theirs, key, n) for n in lengths}
        if any(g is None for g in gaps.values()):
            return None
        if all(g["mine"] == g["theirs"] == 0 and g["se"] == 0 for g in gaps.values()):
            continue  # a floor tells the systems apart no more than a ceiling: the next measure
        ahead = [g["gap"] > NEEDLE_SE * g["se"] for g in gaps.values()]
        behind = [g["gap"] < -NEEDLE_SE * g["se"] for g in gaps.values()]
        verdict = "holds" if all(ahead) else "fails" if any(behind) else INCONCLUSIVE
        skipped = [w for _, w in SAMPLE_MEASURES[:i]]
        numbers = ((f"{' and '.join(skipped)} {'is' if len(skipped) == 1 else 'are'} 0 for every sample of both: "
                    if skipped else "")
                   + f"judged on {what}, paired per sample (the same prompts), natsl_hybrid the mean of its {seeds}: "
                   + "; ".join(f"{n}: natsl_hybrid {fmt(g['mine'])} vs gdn_hybrid {fmt(g['theirs'])}, difference "
                               f"{g['gap']:+.3f} +- {g['se']:.3f} (standard error, {g['n']} samples)"
                               for n, g in gaps.items())
                   + f" (a difference counts beyond {NEEDLE_SE:g} standard errors)")
        return {"verdict": verdict, "numbers": numbers}
    return None


def claims(t1, ppl, ruler, routing, compare, window=None, samples=None) -> list[dict]:
    """The verdicts on the issue's five claims, each with the numbers it rests on.

    Args:
        t1: table1's result; ppl, ruler, routing, compare: the sections' results.
        window: eval-ppl's window (ppl.json max_len), for the extrapolation claim.
        samples: name -> read_ruler_samples, for the needle claim on paired samples (without them, on the
            means over samples in `ruler`).
    Returns:
        [{"claim", "verdict", "numbers"}] in the issue's order.
    """
    out = []
    rows = t1["rows"]
    # 1. validation perplexity, at the largest token count that the claim's runs (the NAtS-L Hybrid's seeds, the
    # Transformer, the GDN Hybrid) all reached: runs stopped by deadlines differ, and a slower system left out of
    # the claim need not hold it back
    # the Transformer and the GDN Hybrid over their own seeds where they trained several (--seed-systems), each
    # judged by its mean as the NAtS-L Hybrid is
    others = ("transformer", "gdn_hybrid")
    mine_names = seeds_of("natsl_hybrid", rows)
    their_names = {o: seeds_of(o, rows) for o in others}
    claim_rows = {n: rows[n] for n in (*mine_names, *[n for o in others for n in their_names[o]])}
    matched = matched_tokens({n: r["val_curve"] for n, r in claim_rows.items()}) if claim_rows and all(
        r["val_curve"] for r in claim_rows.values()) else None
    at = {n: (loss_at(r["val_curve"], matched) if matched is not None else None) for n, r in claim_rows.items()}

    def over_seeds(names: list[str]) -> dict | None:
        losses = [at[n] for n in names if at.get(n) is not None]
        return ({"mean": sum(losses) / len(losses), "min": min(losses), "max": max(losses), "n": len(losses),
                 "losses": losses} if losses else None)

    mine = over_seeds(mine_names)
    mine_losses = mine["losses"] if mine else []
    their = {o: over_seeds(their_names[o]) for o in others}
    theirs = {o: (t["mean"] if t else None) for o, t in their.items()}
    claim = "NAtS-L Hybrid's validation perplexity is at most the Transformer's and GDN Hybrid's"
    if matched is not None and mine and all(v is not None for v in theirs.values()):
        ok = mine["mean"] <= min(theirs.values())
        # judged on the seeds' mean, and said how many seeds hold it alone: one seed's run can move by more than
        # the systems differ (docs/miniature.md, Table 1)
        below = sum(v <= min(theirs.values()) for v in mine_losses)
        cut = t1["cut_short"]
        numbers = (f"validation loss at {fmt_tokens(matched)} tokens, the most these runs all reached"
                   + (" (runs cut short by deadlines; trained: " + ", ".join(
                       f"{n} {fmt_tokens(rows[n]['tokens'])}" for n in ("natsl_hybrid", *others) if n in rows) + ")"
                      if cut else "")
                   + f": natsl_hybrid {fmt(mine['mean'])} (ppl {fmt(math.exp(mine['mean']))}; mean of "
                   f"{mine['n']} seed(s), min {fmt(mine['min'])}, max {fmt(mine['max'])}; {below} of "
                   f"{mine['n']} seed(s) at most both), "
                   + ", ".join(f"{n} {fmt(v)} (ppl {fmt(math.exp(v))}"
                               + (f"; mean of {their[n]['n']} seeds, min {fmt(their[n]['min'])}, max "
                                  f"{fmt(their[n]['max'])}" if their[n]["n"] > 1 else "") + ")"
                               for n, v in theirs.items()))
        out.append({"claim": claim, "verdict": _verdict(ok), "numbers": numbers})
    else:
        systems = ("natsl_hybrid", *others)
        vals = {n: (rows.get(n) or {}).get("perplexity") for n in systems}
        source = "final validation perplexity of training (no validation curves to match tokens)"
        long = {n: (ppl.get(n) or {}).get("ppl") for n in systems}
        if any(v is None for v in vals.values()) and all(v is not None for v in long.values()):
            vals, source = long, "eval-ppl perplexity over the long windows (no training result for all three)"
        ok = None if any(v is None for v in vals.values()) else vals["natsl_hybrid"] <= min(vals["transformer"],
                                                                                               vals["gdn_hybrid"])
        out.append({"claim": claim, "verdict": _verdict(ok),
                    "numbers": f"{source}: " + ", ".join(f"{n} {fmt(v)}" for n, v in vals.items())})
    # 2. extrapolation: only a window longer than the training length measures it
    three = ("natsl_hybrid", "transformer", "gdn_hybrid")
    claim = "NAtS-L Hybrid extrapolates better than both (loss at 8x the training length)"
    lens = [(ppl.get(n) or {}).get("train_seq_len") or 0 for n in three if n in ppl]
    train = max(lens) if lens else 0
    missing = [n for n in three if (ppl.get(n) or {}).get("loss_last_bucket") is None]
    if missing:
        out.append({"claim": claim, "verdict": NOT_MEASURED,
                    "numbers": f"eval-ppl measured no {', '.join(missing)}"})
    elif not window or not train or window <= train:
        out.append({"claim": claim, "verdict": NOT_MEASURED,
                    "numbers": f"not measured (eval-ppl windows of {window or '?'} tokens are within the training "
                               f"length {train or '?'})"})
    else:
        # the NAtS-L Hybrid's seeds that eval-ppl measured too: judged on their mean, as claim 1
        # and the baselines' seeds, each baseline by its mean
        def runs_of(system: str) -> list[str]:
            return [n for n in seeds_of(system, ppl) if (ppl.get(n) or {}).get("loss_last_bucket") is not None]

        measured = runs_of("natsl_hybrid")
        their_runs = {o: runs_of(o) for o in three[1:]}
        last = {n: ppl[n]["loss_last_bucket"] for n in (*measured, *[n for o in three[1:] for n in their_runs[o]])}
        spans = {tuple(ppl[n]["last_bucket"] or ()) for n in last}
        beyond = all((ppl[n]["last_bucket"] or [0])[0] >= (ppl[n]["train_seq_len"] or 0) for n in last)
        mean = sum(last[n] for n in measured) / len(measured)
        their_mean = {o: sum(last[n] for n in runs) / len(runs) for o, runs in their_runs.items()}
        best_other = min(their_mean.values())
        ok = mean < best_other if beyond else None
        span = ppl["natsl_hybrid"]["last_bucket"]
        where = f"tokens {span[0]}-{span[1]}" if span else "the last bucket"
        seeds = ("" if len(measured) == 1 else
                 f"natsl_hybrid mean of {len(measured)} seeds {fmt(mean)} ({sum(last[n] < best_other for n in measured)}"
                 f" of {len(measured)} seeds below both); ")
        numbers = (f"loss at {where} ({window / train:g}x the training length {train}"
                   + ("" if beyond else "; the last bucket is not beyond it for all")
                   + ("" if len(spans) == 1 else "; the systems' last buckets differ") + "): " + seeds
                   + "".join(f"{o} mean of {len(runs)} seeds {fmt(their_mean[o])}; "
                             for o, runs in their_runs.items() if len(runs) > 1)
                   + ", ".join(f"{n} {fmt(last[n])} ({fmt(ppl[n]['last_vs_within'])}x its loss within the "
                               "training length)" for n in last))
        out.append({"claim": claim, "verdict": _verdict(ok), "numbers": numbers})
    # 3. needles at 4K and beyond
    mine, theirs = (ruler.get(n, {}).get("lengths") or {} for n in ("natsl_hybrid", "gdn_hybrid"))
    lengths = sorted(int(n) for n in mine if int(n) >= 4096 and str(n) in theirs)
    pairs = [(n, _num(mine[str(n)]), _num(theirs[str(n)])) for n in lengths]
    pairs = [p for p in pairs if p[1] is not None and p[2] is not None]
    ok = None if not pairs else all(a > b for _, a, b in pairs)
    ran = sorted({int(n) for n in mine} | {int(n) for n in theirs})
    if pairs:
        numbers = "; ".join(f"{n}: natsl_hybrid {fmt(a, 2)} vs gdn_hybrid {fmt(b, 2)}" for n, a, b in pairs)
    elif ran and max(ran) < 4096:
        numbers = f"not measured (RULER ran at {', '.join(map(str, ran))} only)"
    elif ran:
        numbers = "no RULER length >= 4096 for both natsl_hybrid and gdn_hybrid"
    else:
        numbers = "no RULER result for natsl_hybrid and gdn_hybrid"
    verdict = _verdict(ok)
    paired = needle_claim_from_samples(samples or {}, [n for n, _, _ in pairs]) if pairs else None
    if paired is not None:  # the per-sample records: paired, over the seeds, beyond their noise
        verdict, numbers = paired["verdict"], paired["numbers"]
    elif pairs and all(a == b == 0 for _, a, b in pairs):  # a floor tells the systems apart no more than a ceiling
        verdict = INCONCLUSIVE
        numbers += " (both score 0 at every length: the task is beyond these models and cannot tell them apart)"
        # the teacher-forced scores still rank them (natsl.eval.ruler.answer_accuracy): the answer tokens
        # predicted, and where both predict none, their log-probability; judged on the first that tells
        # them apart, and said so
        for measure in TEACHER_FORCED:
            mine, theirs = ((ruler.get(n, {}).get(measure.key) or {}).get("lengths") or {}
                            for n in ("natsl_hybrid", "gdn_hybrid"))
            forced = [(n, _num(mine.get(str(n))), _num(theirs.get(str(n)))) for n, _, _ in pairs]
            forced = [p for p in forced if p[1] is not None and p[2] is not None]
            if not forced or len(forced) != len(pairs):
                break
            numbers += (f"; judged instead by {measure.name}: "
                        + "; ".join(f"{n}: natsl_hybrid {fmt(a, 3)} vs gdn_hybrid {fmt(b, 3)}" for n, a, b in forced))
            if not all(a == b == 0 for _, a, b in forced):
                verdict = _verdict(all(a > b for _, a, b in forced))
                break
    out.append({"claim": "NAtS-L Hybrid beats GDN Hybrid on the needle tasks at 4K and beyond (RULER mean over tasks)",
                "verdict": verdict, "numbers": numbers})
    # 4. KV bytes
    mine = routing.get("natsl_hybrid")
    held = [d for d in (mine or {}).get("datasets", []) if d["kv_ratio"] is not None and SYNTHETIC not in str(d["name"])]
    whole = [e for e in compare if e.get("system") == "natsl_hybrid" and e.get("method") == "router"
             and e.get("kv_vs_transformer") is not None]
    parts = []
    if held:
        ok = max(d["kv_ratio"] for d in held) <= 0.5
        parts.append("NAtS-L layers' KV against a Transformer layer's on the held-out sources (inspect-routing): "
                     + ", ".join(f"{d['name']} {fmt(d['kv_ratio'])}" for d in held))
    elif whole:
        ok = max(e["kv_vs_transformer"] for e in whole) <= 0.5
    else:
        ok = None
    if whole:
        parts.append("whole model against the Transformer's full cache (compare, random prompt): "
                     + ", ".join(f"{e['context']} tokens {fmt(e['kv_vs_transformer'])}" for e in whole))
    out.append({"claim": "NAtS-L Hybrid keeps at most half of the Transformer's KV bytes", "verdict": _verdict(ok),
                "numbers": "; ".join(parts) or "neither inspect-routing nor compare measured natsl_hybrid"})
    # 5. routing per source in every seed
    seeds = seeds_of("natsl_hybrid", routing)
    spreads = {n: routing[n].get("max_spread_over_sources") for n in seeds}
    # the seeds trained (Table 1) that inspect-routing did not measure
    missing = [n for n in seeds_of("natsl_hybrid", {*rows, "natsl_hybrid"}) if n not in routing]
    ok = None if not seeds or any(v is None for v in spreads.values()) else all(v > SOURCE_TOL for v in spreads.values())
    if missing and ok:  # "every seed" is not shown by fewer seeds; a seed that fails it is shown
        ok = None
    out.append({"claim": "NAtS-L Hybrid routes differently per data source in every seed",
                "verdict": _verdict(ok),
                "numbers": (", ".join(f"{n}: largest spread of a group's kept fraction over sources {fmt(v)}"
                                      for n, v in spreads.items()) or "no seed's routing measured")
                + (f" (threshold {SOURCE_TOL}; not measured: {', '.join(missing)})" if missing else
                   f" (threshold {SOURCE_TOL})")})
    return out


# ----------------------------------------------------------------------------- figures


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> str:
    """Label, grid and legend one line plot, write it (atomically) and close it; its file name."""
    from natsl.eval.common import save_figure

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path).name


def _plots(folder: Path, t1, ppl, ruler, routing, over_training=None) -> list[str]:
    """The report's PNGs (each where its numbers exist); returns their file names."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    written = []
    curves = {n: r["val_curve"] for n, r in t1["rows"].items() if r.get("val_curve")}
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for name in order(curves):
            tokens, losses = zip(*curves[name])
            ax.plot([t / 1e6 for t in tokens], losses, marker=".", label=name)
        if t1["matched_tokens"] is not None:
            ax.axvline(t1["matched_tokens"] / 1e6, color="gray", linestyle=":",
                       label=f"reached by all ({t1['matched_tokens'] / 1e6:.1f}M)")
        written.append(_finish(fig, ax, "tokens trained (millions)", "validation loss",
                               "validation loss during training (Table 1 in miniature)", folder / "val_curves.png"))
    if ppl:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        train = None
        for name in order(ppl):
            xs, ys = zip(*ppl[name]["curve"]) if ppl[name]["curve"] else ((), ())
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
            train = train or ppl[name]["train_seq_len"]
        if train:
            ax.axvline(train, color="gray", linestyle=":", label=f"training length {train}")
        written.append(_finish(fig, ax, "position in window (tokens of context)", "loss (nats, per bucket)",
                               "loss against position (Fig. 3 in miniature)", folder / "loss_vs_position.png"))
    if ruler:
        # one panel per score (string match, then the teacher-forced ones), each on its own scale: a string match
        # at 0 everywhere would squash the others; one colour per system in every panel, one legend beside them
        panels = [(None, "string match")] + [(m.key, m.label) for m in TEACHER_FORCED
                                              if any(r.get(m.key) for r in ruler.values())]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 2.2, 4.2), squeeze=False)
        colours = {name: f"C{i % 10}" for i, name in enumerate(order(ruler))}
        for ax, (key, what) in zip(axes[0], panels):
            for name in order(ruler):
                part = ruler[name] if key is None else ruler[name].get(key) or {}
                pts = sorted((int(n), v) for n, v in (part.get("lengths") or {}).items() if _num(v) is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colours[name], label=name,
                            linestyle="--" if is_seed(name) else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("mean over tasks")
            ax.set_title(what, fontsize=10)
            ax.grid(alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=8)
        fig.suptitle("needle retrieval against length (Table 2 in miniature; seeds dashed)")
        fig.tight_layout(rect=(0, 0, 1 - 1.9 / (4.2 * len(panels) + 2.2), 1))
        from natsl.eval.common import save_figure

        written.append(save_figure(fig, folder / "ruler_by_length.png").name)
    if routing:
        names = order(routing)
        fig, axes = _map_panels(plt, len(names), max(3.6, 0.22 * max(
            sum(len(layer["group_keep_fraction"] or []) for layer in
                (routing[n]["datasets"] or [{"layers": []}])[0]["layers"]) for n in names)))
        image = None
        for ax, name in zip(axes.flat, names):
            datasets = routing[name]["datasets"]
            labels = [f"L{layer['layer']} g{g}" for layer in (datasets[0]["layers"] if datasets else [])
                      for g in range(len(layer["group_keep_fraction"] or []))]
            grid = [[frac for layer in ds["layers"] for frac in layer["group_keep_fraction"] or []] for ds in datasets]
            grid = [list(col) for col in zip(*grid)] if grid else [[0.0]]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto")
            ax.set_xticks(range(len(datasets)), [str(ds["name"])[:18] for ds in datasets], rotation=45, ha="right",
                          fontsize=9)
            ax.set_yticks(range(len(labels)), labels, fontsize=9)
            ax.set_title(name, fontsize=11)
        fig.suptitle("fraction of blocks kept per NAtS-L layer and group, per source (Figs. 5/6 in miniature)",
                     fontsize=12)
        fig.colorbar(image, ax=list(axes.flat), fraction=0.03, label="kept fraction")
        written.append(save_figure(fig, folder / "routing_by_source.png").name)
    if over_training:
        written.append(_routing_over_training_plot(plt, folder, over_training))
    return written


def _map_panels(plt, count: int, height: float):
    """A figure of `count` map panels, three a row, each `height` inches tall (enough for its (layer, group)
    labels at a readable size); the unused panels hidden. Returns (figure, axes array)."""
    cols = min(3, count)
    rows_n = -(-count // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(1.5 + 4.2 * cols, 1.4 + height * rows_n), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, axes


def _routing_over_training_plot(plt, folder: Path, over_training: dict) -> str:
    """Kept fraction per (layer, group) against tokens trained: one map per NAtS-L checkpoint."""
    from natsl.eval.common import save_figure

    names = order(over_training)
    fig, axes = _map_panels(plt, len(names), max(3.0, 0.22 * max(len(over_training[n]["labels"]) for n in names)))
    image = None
    for ax, name in zip(axes.flat, names):
        run = over_training[name]
        grid = [list(col) for col in zip(*run["keep"])]
        millions = [t / 1e6 for t in run["tokens"]]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="Blues", aspect="auto", interpolation="nearest",
                          extent=(0, millions[-1], len(run["labels"]) - 0.5, -0.5))
        ax.set_yticks(range(len(run["labels"])), run["labels"], fontsize=9)
        ax.set_xlabel("tokens trained (millions)")
        ax.set_title(name, fontsize=11)
    fig.suptitle("fraction of blocks kept per NAtS-L layer and group during training (Fig. 5 in miniature)",
                 fontsize=12)
    fig.colorbar(image, ax=list(axes.flat), fraction=0.03, label="kept fraction")
    return save_figure(fig, folder / "routing_over_training.png").name


# ----------------------------------------------------------------------------- the report


def _status_note(status: dict, job: str) -> str:
    entry = (status.get("jobs") or {}).get(job) if isinstance(status, dict) else None
    return f"{NOT_MEASURED} ({entry['status']})" if isinstance(entry, dict) and entry.get("status") not in (
        None, "done", "done already") else NOT_MEASURED


def quick_mode(status: dict) -> bool:
    """Whether the evaluations ran eval_jobs' quick settings: eval_status.json's "quick", else (a folder from before
    it was recorded) the ppl job's window or the RULER jobs' lengths differing from the full protocol's."""
    from natsl.miniature.evaluate import PPL_MAX_LEN, RULER_LENGTHS

    if not isinstance(status, dict):
        return False
    if isinstance(status.get("quick"), bool):
        return status["quick"]
    for name, job in (status.get("jobs") or {}).items():
        argv = [str(a) for a in (job or {}).get("argv") or []] if isinstance(job, dict) else []
        flag = "--max-len" if name == "ppl" else "--lengths" if name.startswith("ruler_") else None
        if flag and flag in argv[:-1]:
            value = argv[argv.index(flag) + 1]
            if value != (str(PPL_MAX_LEN) if name == "ppl" else RULER_LENGTHS):
                return True
    return False


def write_report(root) -> Path:
    """Write ROOT/report/report.md, tables.json and the figures from whatever the stages left (see the module doc).

    Args:
        root: the miniature's output folder (sweep/, train/, eval/, checkpoints.json).
    Returns:
        The path of report.md.
    """
    from natsl.atomic import write_json, write_text

    root = Path(root)
    folder = root / "report"
    folder.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    checkpoints = read_checkpoints(root, problems)
    training = read_training(root, checkpoints, problems)
    sweep = _read(root / "sweep" / "summary.json", problems)
    sweep = sweep if isinstance(sweep, dict) else None
    status = _read(root / "eval" / "eval_status.json", problems) or {}
    names = order([*checkpoints, *training, *[p.get("system") for p in (sweep or {}).get("best_lm") or []
                                              if isinstance(p, dict) and p.get("system")]])
    t1 = table1(names, training, sweep)
    swept = sweep_section(root, sweep)
    ppl_json = _read(root / "eval" / "ppl" / "ppl.json", problems)
    ppl_json = ppl_json if isinstance(ppl_json, dict) else None
    ppl = ppl_section(ppl_json, checkpoints, root, problems)
    window = (ppl_json or {}).get("max_len")
    quick = quick_mode(status)
    ruler = {}
    for name in order(n for n in eval_names(root, "ruler") if split_seed(n)[0] in LADDER
                      and (root / "eval" / f"ruler_{n}" / "ruler.json").is_file()):
        data = _read(root / "eval" / f"ruler_{name}" / "ruler.json", problems)
        if isinstance(data, dict):
            ruler[name] = {"tasks": data.get("tasks") or {}, "lengths": data.get("lengths") or {},
                           "mean": data.get("mean"), "samples": data.get("samples"),
                           **{m.key: data.get(m.key) if isinstance(data.get(m.key), dict) else None
                              for m in TEACHER_FORCED}}
    samples = {name: read_ruler_samples(root / "eval" / f"ruler_{name}" / "ruler_samples.jsonl", problems)
               for name in ruler}
    routing = routing_section(root, problems)
    over_training = routing_over_training(checkpoints, training, problems)
    compare_json = _read(root / "eval" / "compare" / "compare.json", problems)
    compare = compare_section(compare_json if isinstance(compare_json, dict) else None, checkpoints, root)
    latency_json = _read(root / "eval" / "latency" / "latency.json", problems)
    latency = latency_section(latency_json if isinstance(latency_json, dict) else None, checkpoints, root)
    lm = lm_eval_section(root, problems)
    verdicts = claims(t1, ppl, ruler, routing, compare, window, samples)
    figures = _plots(folder, t1, ppl, ruler, routing, over_training)

    md = [f"# The paper in miniature: report\n\nWritten {time.strftime('%Y-%m-%d %H:%M:%S')} from {root}. "
          f"\"{NOT_MEASURED}\": the stage left no result for it.\n"]
    if quick:
        md.append("**Evaluations in quick mode (smoke settings): not the paper's protocol.**\n")
    md.append("## Claims\n")
    md.append(md_table(["claim", "verdict", "numbers"], [[c["claim"], f"**{c['verdict']}**", c["numbers"]]
                                                          for c in verdicts]))
    rows, matched = t1["rows"], t1["matched_tokens"]
    md.append("\n## Table 1 in miniature: training" + (" (runs cut short)" if t1["cut_short"] else "") + "\n")
    if any(r["val_loss"] is not None or r["best_lr"] is not None for r in rows.values()):
        if t1["cut_short"]:
            md.append(f"Runs cut short (status other than done): {', '.join(t1['cut_short'])}. They trained different "
                      "token counts, so their final losses do not compare; the matched column does.\n")
        if matched is not None:
            md.append(f"\"val loss at {fmt_tokens(matched)}\": each run's validation loss at the largest token count "
                      f"every run with a validation curve reached ({', '.join(t1['matched_runs'])}; no "
                      "interpolation). \"sweep val loss\": the learning-rate sweep's, at its own (shorter) length.\n")
        matched_head = f"val loss at {matched / 1e6:.1f}M tokens" if matched is not None else "val loss at matched tokens"
        md.append(md_table(["system", "parameters", "best lr", "sweep val loss", "tokens trained", "status",
                            "final val loss", "final val ppl", matched_head],
                           [[n, f"{r['parameters'] / 1e6:.1f}M" if _num(r["parameters"]) else "-",
                             fmt(r["best_lr"], 3) if r["best_lr"] is not None else "-", fmt(r["sweep_val_loss"]),
                             fmt_tokens(r["tokens"]), str(r["status"] or "-").split(" (")[0], fmt(r["val_loss"]), fmt(r["perplexity"]),
                             fmt(r["val_loss_matched"])] for n, r in rows.items()]))
        for system in order(split_seed(n)[0] for n in rows):
            mine = seeds_at(t1, system)
            if mine and mine["n"] > 1:
                md.append(f"\n{system} over its {mine['n']} seeds at {fmt_tokens(matched)} tokens: mean "
                          f"{fmt(mine['mean'])}, min {fmt(mine['min'])}, max {fmt(mine['max'])}.")
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Learning-rate sweep\n")
    if swept:
        lengths = {fmt_tokens(x["tokens"]) for x in swept.values() if x["tokens"]}
        if lengths:
            md.append(f"Each rate's final validation loss after the sweep's {' / '.join(sorted(lengths))} tokens, "
                      "lowest first.\n")
        md.append(md_table(["system", "rates: val loss (lowest first)", "best rate", "best val loss", "note"],
                           [[n, "failed" if x["failed"] else ", ".join(f"{fmt(r['lr'], 3)}: {fmt(r['val_loss'])}"
                                                                       for r in x["ranking"]),
                             fmt(x["best_lr"], 3) if x["best_lr"] is not None else "-", fmt(x["val_loss"]),
                             x["failed"] if x["failed"] else (f"best at the grid's edge: sweep {x['edge']}"
                                                              if x["edge"] else "")]
                            for n, x in swept.items()]))
        grids = {", ".join(fmt(g, 3) for g in x["grid"]) for x in swept.values() if x["grid"]}
        if grids:
            md.append(f"\nRates swept: {' / '.join(sorted(grids))}.")
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Fig. 3 in miniature: loss against position\n")
    if ppl:
        train = max((r["train_seq_len"] or 0) for r in ppl.values())
        md.append(f"Windows of {window} tokens of the validation split (eval-ppl); the last bucket is the longest "
                  "context" + (f"; training length {train}." if train else ".")
                  + (" The windows are within the training length: nothing here measures extrapolation."
                     if train and window and window <= train else "") + "\n")
        md.append(md_table(["system", "ppl (whole window)", "loss within training length", "loss, last bucket",
                            "last / within", "bits/byte"],
                           [[n, fmt(r["ppl"]), fmt(r["loss_within_train_len"]), fmt(r["loss_last_bucket"]),
                             fmt(r["last_vs_within"]), fmt(r["bits_per_byte"])]
                            for n, r in ((n, ppl[n]) for n in order(ppl))]))
    else:
        md.append(_status_note(status, "ppl"))
    md.append("\n## Table 2 in miniature: RULER needle-in-a-haystack\n")
    if ruler:
        lengths = sorted({int(n) for r in ruler.values() for n in r["lengths"]})
        md.append(md_table(["system", *map(str, lengths), "mean"],
                           [[n, *[fmt(r["lengths"].get(str(x)), 2) for x in lengths], fmt(r["mean"], 2)]
                            for n, r in ruler.items()]))
        scores = [_num(v) for r in ruler.values() for v in r["lengths"].values()]
        if scores and all(v == 0 for v in scores):
            md.append("\nEvery system scores 0 at every length: the models are too weak for the task at this "
                      "training length.")
        for measure in TEACHER_FORCED:
            forced = {n: r[measure.key] for n, r in ruler.items() if r.get(measure.key)}
            if forced:
                md.append(f"\n{measure.heading}\n")
                md.append(md_table(["system", *map(str, lengths), "mean"],
                                   [[n, *[fmt((a.get("lengths") or {}).get(str(x)), 3) for x in lengths],
                                     fmt(a.get("mean"), 3)] for n, a in forced.items()]))
        tasks = list(dict.fromkeys(t for r in ruler.values() for t in r["tasks"]))
        for length in lengths:
            md.append(f"\nPer task at {length} tokens:\n")
            md.append(md_table(["task", *ruler], [[t, *[fmt((r["tasks"].get(t) or {}).get(str(length)), 2)
                                                        for r in ruler.values()]] for t in tasks]))
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Figs. 5/6 in miniature: routing per layer, group and source\n")
    if routing:
        for name, r in routing.items():
            md.append(f"\n**{name}** ({r['seq_len']}-token windows): routing {r['routing']}.\n")
            layers = [layer["layer"] for layer in (r["datasets"][0]["layers"] if r["datasets"] else [])]
            md.append(md_table(["source", "kept", "KV vs Transformer layer", *[f"layer {x} groups" for x in layers]],
                               [[d["name"], fmt(d["keep_fraction"]), fmt(d["kv_ratio"]),
                                 *[" / ".join(fmt(g, 2) for g in layer["group_keep_fraction"] or [])
                                   for layer in d["layers"]]] for d in r["datasets"]]))
        seeds = seeds_of("natsl_hybrid", routing)
        if len(seeds) > 1:
            md.append("\nAcross seeds (kept fraction per source):\n")
            sources = list(dict.fromkeys(d["name"] for n in seeds for d in routing[n]["datasets"]))
            md.append(md_table(["source", *seeds], [[s, *[fmt(next((d["keep_fraction"] for d in routing[n]["datasets"]
                                                                    if d["name"] == s), None)) for n in seeds]]
                                                    for s in sources]))
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Routing during training (Fig. 5 in miniature)\n")
    if over_training:
        md.append("Kept fraction of each routing group (training batches, from metrics.jsonl), at a quarter, half, "
                  "three quarters and the end of each run's logged tokens:\n")
        for name, run in over_training.items():
            picks = sorted({min(len(run["tokens"]) - 1, max(0, round(f * len(run["tokens"])) - 1))
                            for f in (0.25, 0.5, 0.75, 1.0)})
            md.append(f"\n**{name}**\n")
            md.append(md_table(["group", *[fmt_tokens(run["tokens"][i]) + " tokens" for i in picks]],
                               [[label, *[f"{run['keep'][i][j]:.2f}" for i in picks]]
                                for j, label in enumerate(run["labels"])]))
    else:
        md.append(NOT_MEASURED)
    md.append("\n## Quality at matched KV bytes (compare)\n")
    if compare:
        md.append(md_table(["system", "variant", "context", "ppl", "KV bytes", "KV vs Transformer", "decode ms",
                            "prefill s"],
                           [[e["system"], e.get("label"), e.get("context"), fmt(e.get("ppl")),
                             human_bytes(e.get("kv_bytes")), fmt(e.get("kv_vs_transformer")),
                             e["error"] if "error" in e else fmt(e.get("decode_ms")), fmt(e.get("prefill_s"))]
                            for e in compare]))
    else:
        md.append(_status_note(status, "compare"))
    md.append("\n## Latency (bench-latency, trained routers)\n")
    if latency:
        contexts = sorted({int(c) for r in latency.values() for c in r})
        md.append(md_table(["system", *[f"{c}: prefill s / decode ms" for c in contexts]],
                           [[n, *[(p.get("error") if "error" in p else f"{fmt(p.get('prefill_s'))} / "
                                   f"{fmt(p.get('decode_ms'))}") if (p := r.get(str(c))) else "-"
                                  for c in contexts]] for n, r in latency.items()]))
    else:
        md.append(_status_note(status, "latency"))
    md.append("\n## lm-eval on the local tasks\n")
    if lm:
        metrics = list(dict.fromkeys(k for scores in lm.values() for k in scores))
        md.append(md_table(["system", *metrics], [[n, *[fmt(lm[n].get(k)) for k in metrics]] for n in order(lm)]))
    else:
        skipped = [e["status"] for j, e in (status.get("jobs") or {}).items() if j.startswith("lm_eval_")
                   and isinstance(e, dict)] if isinstance(status, dict) else []
        md.append(f"{NOT_MEASURED} ({skipped[0]})" if skipped else NOT_MEASURED)
    md.append("\n## Ablations (against natsl_hybrid's sweep point)\n")
    ablations = ablation_section(swept, ppl, routing)
    if any(n != "natsl_hybrid" for n in ablations):
        tokens = next((x["tokens"] for x in swept.values() if x["tokens"]), None)
        md.append("The ablations are trained in the learning-rate sweep only: each is compared with natsl_hybrid's "
                  "best sweep point (the same tokens" + (f", {fmt_tokens(tokens)}" if tokens else "") + ", each at "
                  "its own best rate), not with the full training run. eval-ppl and the kept fraction are of the "
                  "ablations' sweep checkpoints, which have no natsl_hybrid counterpart evaluated (its evaluated "
                  "checkpoint is the full run's): they are shown, not compared.\n")
        md.append(md_table(["system", "best rate", "sweep val loss", "vs natsl_hybrid", "eval-ppl ppl",
                            "mean kept fraction"],
                           [[n, fmt(a["best_lr"], 3) if a["best_lr"] is not None else "-",
                             (a["failed"] if a["failed"].startswith("failed") else f"failed: {a['failed']}")
                             if a["failed"] else fmt(a["val_loss"]),
                             f"{a['delta']:+.3f}" if a["delta"] is not None else "-", fmt(a["ppl_long"]),
                             fmt(a["kept"])] for n, a in ablations.items()]))
    else:
        md.append(NOT_MEASURED)
    if figures:
        md.append("\n## Figures\n")
        md.extend(f"![{name}]({name})" for name in figures)
    if problems:
        md.append("\n## Files that could not be read\n")
        md.extend(f"- {p}" for p in problems)
    tables = {"checkpoints": {n: str(p) for n, p in checkpoints.items()}, "table1": t1, "ppl": ppl, "ruler": ruler,
              "routing": routing, "routing_over_training": over_training, "compare": compare, "latency": latency, "lm_eval": lm, "ablations": ablations,
              "sweep": swept, "quick": quick,
              "claims": verdicts, "figures": figures, "problems": problems}
    write_json(folder / "tables.json", tables)
    return write_text(folder / "report.md", "\n".join(md) + "\n")
