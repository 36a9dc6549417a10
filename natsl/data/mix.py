"""The mix of a tokenized corpus: documents, bytes and tokens per split, per input and per `--include`
pattern, with the duplicates and bad files left out, as `meta.json` records it and the last line of
`natsl tokenize` prints it.

Counting happens per origin (a source's (input, pattern) cell); the split counts are committed with
the shards in `.progress.json`, so a resumed run continues them. Duplicates and skipped files are
counted again as a resumed run rereads its committed prefix, so they are never stored.
"""

from __future__ import annotations

from natsl.errors import NatslError

SPLITS = ("train", "validation")
COUNTS = ("documents", "bytes", "tokens")


def _zero_split() -> dict:
    return dict.fromkeys(COUNTS, 0)


def new_cells(origins: list) -> list[dict]:
    """One counter per origin: {split: {documents, bytes, tokens}}."""
    return [{name: _zero_split() for name in SPLITS} for _ in origins]


def check_cells(cells, origins: list, where: str, fix: str) -> list[dict]:
    """The split counters read from an unfinished run's progress file, checked before they are continued.

    Args:
        cells: the value read (any JSON).
        origins: the source's origins (one cell each).
        where: the file, for the message.
        fix: what the message tells the user to do.
    Returns:
        The cells.
    """
    def good(cell) -> bool:
        return isinstance(cell, dict) and set(cell) == set(SPLITS) and all(
            isinstance(cell[s], dict) and set(cell[s]) == set(COUNTS) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cell[s].values())
            for s in SPLITS)

    if not isinstance(cells, list) or len(cells) != len(origins) or not all(good(c) for c in cells):
        raise NatslError(f"{where} is damaged (its mix counters do not fit the inputs); {fix}")
    return cells


def _add(into: dict, cell: dict, duplicates: int, skipped: int) -> None:
    for name in SPLITS:
        for key in COUNTS:
            into[name][key] += cell[name][key]
    into["duplicates"] += duplicates
    into["skipped_files"] += skipped


def _empty_entry() -> dict:
    return {**{name: _zero_split() for name in SPLITS}, "duplicates": 0, "skipped_files": 0}


def build_mix(origins: list, cells: list[dict], duplicates: dict, skipped_by_origin: dict) -> dict:
    """meta.json's `mix`: the cells summed per input, per --include pattern (local files) and in total.

    Args:
        origins: (input, pattern or None) per origin.
        cells: the split counters per origin.
        duplicates: origin index -> duplicates dropped.
        skipped_by_origin: origin index -> bad files left out.
    Returns:
        {"by_input": {input: entry}, "by_include": {pattern: entry} (local files only), "total": entry}, each
        entry {train: {documents, bytes, tokens}, validation: {...}, duplicates, skipped_files}.
    """
    by_input: dict[str, dict] = {}
    by_include: dict[str, dict] = {}
    total = _empty_entry()
    for index, ((item, pattern), cell) in enumerate(zip(origins, cells)):
        counts = (duplicates.get(index, 0), skipped_by_origin.get(index, 0))
        _add(by_input.setdefault(item, _empty_entry()), cell, *counts)
        if pattern is not None:
            _add(by_include.setdefault(pattern, _empty_entry()), cell, *counts)
        _add(total, cell, *counts)
    mix = {"by_input": by_input}
    if by_include:
        mix["by_include"] = {k: v for k, v in by_include.items() if _tokens(v) or v["duplicates"] or v["skipped_files"]}
    mix["total"] = total
    return mix


def _tokens(entry: dict) -> int:
    return sum(entry[name]["tokens"] for name in SPLITS)


def describe_mix(mix: dict, skipped: dict) -> str:
    """The mix in a few words for the command's last line: token shares per input (and per pattern), the
    duplicates dropped and the files skipped by reason."""
    total = max(_tokens(mix["total"]), 1)
    parts = []
    for key, label in (("by_input", "by input"), ("by_include", "by --include")):
        entries = mix.get(key) or {}
        if len(entries) > 1:
            shares = ", ".join(f"{name} {100 * _tokens(e) / total:.1f}%" for name, e in entries.items())
            parts.append(f"{label}: {shares}")
    if mix["total"]["duplicates"]:
        parts.append(f"{mix['total']['duplicates']:,} duplicate(s) dropped")
    if skipped.get("files"):
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(skipped["reasons"].items()))
        parts.append(f"{skipped['files']:,} bad file(s) skipped ({reasons})")
    return "; ".join(parts)
