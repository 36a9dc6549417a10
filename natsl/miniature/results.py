"""What the miniature's stages wrote, read back, and the numbers' formatting: the ground the report's
sections, claims and figures share (natsl.miniature.report)."""

from __future__ import annotations

import math
from pathlib import Path

NOT_MEASURED = "not measured"
# A routing group whose kept fraction is within this of 0 or 1 everywhere routes per head (it keeps all of
# its blocks or none); sources whose fractions differ by more than it are routed differently.
HEAD_TOL = 0.05
SOURCE_TOL = 0.05
SYNTHETIC = "synthetic"
# Two validation points within one optimizer step of tokens (the miniature's 65536) count as one token count.
TOKEN_TOL = 65536


# ----------------------------------------------------------------------------- reading


def read_result(path: Path, problems: list[str]):
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


def as_number(value) -> float | None:
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
        data = read_result(path, problems)
        if isinstance(data, dict):
            data = data.get("checkpoints", data) if isinstance(data.get("checkpoints"), dict) else data
            return {name: locate(folder, root) for name, folder in data.items() if isinstance(folder, str)}
    return {}


def read_training(root: Path, checkpoints: dict[str, Path], problems: list[str]) -> dict[str, dict]:
    """name -> its training result.json (with "run": the folder it came from)."""
    found: dict[str, dict] = {}
    for name, folder in checkpoints.items():
        for place in (folder, folder.parent, folder.parent.parent):
            result = read_result(place / "result.json", problems)
            if isinstance(result, dict):
                found[name] = {**result, "run": str(place)}
                break
    runs = root / "train" / "runs"
    if runs.is_dir():
        for run in sorted(p for p in runs.iterdir() if p.is_dir()):
            spec = read_result(run / "run.json", problems)
            name = spec.get("system") if isinstance(spec, dict) else None
            if name and isinstance(spec.get("seed"), int) and spec["seed"]:
                name = f"{name}_s{spec['seed']}"  # the ladder's extra seeds (natsl_hybrid_s1, ...)
            if name and name not in found:
                result = read_result(run / "result.json", problems)
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


def seed_spread(values: list[float]) -> dict | None:
    """Mean, min, max and count of one system's values over its seeds; None for none."""
    if not values:
        return None
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def eval_names(root: Path, kind: str) -> list[str]:
    """The checkpoint names with an evaluation folder root/eval/KIND_NAME."""
    folder = root / "eval"
    if not folder.is_dir():
        return []
    return [p.name[len(kind) + 1:] for p in folder.iterdir() if p.is_dir() and p.name.startswith(kind + "_")]


# ----------------------------------------------------------------------------- formatting


def fmt(value, digits: int = 3) -> str:
    value = as_number(value)
    if value is None:
        return "-"
    if abs(value) >= 1e4 or (0 < abs(value) < 1e-3):
        return f"{value:.{digits}g}"
    return f"{value:.{digits}f}"


def human_bytes(n) -> str:
    n = as_number(n)
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
    n = as_number(n)
    if n is None:
        return "-"
    return f"{int(n):,} ({n / 1e6:.1f}M)" if n >= 1e6 else f"{int(n):,}"


def _curve(value) -> list[tuple[float, float]]:
    """A val_curve's [tokens, loss] points that are numbers, by tokens."""
    points = []
    for p in value or []:
        if isinstance(p, (list, tuple)) and len(p) == 2 and as_number(p[0]) is not None and as_number(p[1]) is not None:
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
