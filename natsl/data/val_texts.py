"""The held-out documents as text, one `.jsonl` file per input (`natsl tokenize --val-texts`).

`validation_texts/00_site-packages.jsonl`, `01_doc.jsonl`, ...: each line `{"text": ...}`, one held-out
document of that input. These are the validation split's own documents, never trained on, so
`natsl inspect-routing CKPT validation_texts/00_site-packages.jsonl validation_texts/01_doc.jsonl`
compares the routing on code and on prose with text the model has not seen.

The files grow with the shards: lines are appended at each commit and their committed lengths are
kept in `.progress.json`, so a resumed run cuts them back as it does the shards.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from natsl.data.shards import RETOKENIZE
from natsl.errors import NatslError
from natsl.files import resolve_inside

FOLDER = "validation_texts"


def file_names(inputs: list[str]) -> list[str]:
    """`NN_name.jsonl` per input: its index, then the last part of its path without glob characters."""
    names = []
    for index, item in enumerate(inputs):
        parts = [p for p in re.split(r"[\\/]+", item) if p and p not in (".", "..") and not set(p) <= set("*?")]
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", parts[-1] if parts else "").strip("-.") or "input"
        names.append(f"{index:02d}_{slug[:60]}.jsonl")
    return names


class ValTextWriter:
    """Buffers held-out documents per input and appends them to their files at each commit.

    Args:
        folder: the output folder.
        names: the file name per input (file_names()).
        committed: file name -> bytes committed (the progress file's record; updated in place).
    """

    def __init__(self, folder: Path, names: list[str], committed: dict):
        self.folder = Path(folder) / FOLDER
        self.names = names
        self.committed = committed
        self.pending: dict[int, list[str]] = {}

    def restore(self, where: str, fix: str) -> None:
        """Cut every file back to its committed length; remove files never committed."""
        resolve_inside(self.folder.parent, FOLDER, where, fix=RETOKENIZE)  # a link to another folder is refused, never emptied
        if not isinstance(self.committed, dict) or not all(
                name in self.names and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                for name, n in self.committed.items()):
            raise NatslError(f"{where} is damaged (its validation_texts record names other files); {fix}")
        for name, size in self.committed.items():
            path = resolve_inside(self.folder.parent, f"{FOLDER}/{name}", where, fix=RETOKENIZE)
            if not path.is_file() or path.stat().st_size < size:
                raise NatslError(f"the unfinished output is damaged ({FOLDER}/{name} is shorter than recorded); {fix}")
            os.truncate(path, size)
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                if path.name not in self.committed and path.is_file() and not path.is_symlink():
                    path.unlink()

    def add(self, input_index: int, text: str) -> None:
        self.pending.setdefault(input_index, []).append(json.dumps({"text": text}) + "\n")  # ASCII: any text survives

    def commit(self) -> None:
        """Append the buffered documents (and make sure every input's file exists, empty or not)."""
        self.folder.mkdir(exist_ok=True)
        for index, name in enumerate(self.names):
            lines = self.pending.pop(index, [])
            if name in self.committed and not lines:
                continue
            path = resolve_inside(self.folder.parent, f"{FOLDER}/{name}", "the validation text writer", fix=RETOKENIZE)
            data = "".join(lines).encode("ascii")
            with open(path, "ab") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            self.committed[name] = self.committed.get(name, 0) + len(data)
