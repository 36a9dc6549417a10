"""Where documents come from: local `.txt` / `.jsonl` / `.parquet` files or folders, a Hugging Face
dataset (streamed), or a list of strings held in memory (the embedded corpus).

Every source yields `(text, progress)` pairs: one document and how far the progress bar moves
(bytes read for files, one per document for the Hub). `describe()` is a JSON-able summary that
goes into `meta.json` and into the fingerprint that makes `natsl tokenize` idempotent.
Text must be UTF-8: anything else is refused with one line that names the file and the line.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from natsl.errors import NatslError
from natsl.files import parse_json

SUFFIXES = (".txt", ".jsonl", ".parquet")
TXT_DOCS = ("file", "paragraph", "line")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ----------------------------------------------------------------------------- local files

def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files and folders -> the sorted list of supported files (folders are searched recursively)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                           key=lambda p: p.relative_to(path).as_posix())
            if not found:
                raise NatslError(f"folder {item!r} holds no .txt, .jsonl or .parquet files; point at the data files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise NatslError(f"{item!r} is a {path.suffix or 'suffix-less'} file; natsl tokenize reads "
                                 ".txt, .jsonl (one JSON object per line) and .parquet files")
            files.append(path)
        else:
            raise NatslError(f"input {item!r} does not exist; pass .txt/.jsonl/.parquet files, folders of them, "
                             "or a Hugging Face dataset name")
    return files


def _not_utf8(path: Path, line: int, err: UnicodeDecodeError) -> NatslError:
    return NatslError(f"{str(path)!r} is not UTF-8 text (line {line}, byte {err.start} of that line: "
                      f"{err.object[err.start:err.start + 1]!r}); convert it, e.g. `iconv -f latin1 -t utf-8`")


def _utf8_lines(path: Path) -> Iterator[tuple[int, bytes, str]]:
    """(line number, raw bytes, decoded text) of each line; a non-UTF-8 line is a one-line error."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                yield number, raw, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, number, err) from None


def _read_txt(path: Path, mode: str) -> Iterator[tuple[str, int]]:
    """`file`: the whole file is one document; `paragraph`: blank lines separate documents; `line`: one per line."""
    pending: list[str] = []
    pending_bytes = 0
    for _, raw, line in _utf8_lines(path):
        pending_bytes += len(raw)
        if mode == "line":
            text = line.rstrip("\r\n")
            if text.strip():
                yield text, pending_bytes
                pending_bytes = 0
        elif mode == "paragraph" and not line.strip():
            if pending:
                yield "".join(pending).rstrip("\r\n"), pending_bytes
                pending, pending_bytes = [], 0
        else:
            pending.append(line)
    text = "".join(pending)
    if mode == "paragraph":
        text = text.rstrip("\r\n")
    if text.strip():
        yield text, pending_bytes
    elif pending_bytes:
        yield "", pending_bytes  # nothing left to tokenize, but the bar should reach the end


def _text_of(value, where: str, field: str):
    if isinstance(value, str):
        return value
    raise NatslError(f"{where} has no string field {field!r}; name the text field with --text-field")


def _read_jsonl(path: Path, field: str) -> Iterator[tuple[str, int]]:
    for number, raw, line in _utf8_lines(path):
        if not line.strip():
            yield "", len(raw)
            continue
        record = parse_json(line, f"{str(path)!r} line {number}", "a .jsonl file holds one JSON object per line")
        if not isinstance(record, dict):
            raise NatslError(f"{str(path)!r} line {number} is not a JSON object; expected {{\"{field}\": \"...\"}}")
        yield _text_of(record.get(field), f"{str(path)!r} line {number}", field), len(raw)


def _read_parquet(path: Path, field: str) -> Iterator[tuple[str, int]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise NatslError(f"{str(path)!r} is not a readable Parquet file ({_first_line(err)})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise NatslError(f"{str(path)!r} has no column {field!r} (columns: {', '.join(names[:10])}); "
                         "name the text column with --text-field")
    size, rows = path.stat().st_size, max(pf.metadata.num_rows, 1)
    done_rows = 0
    moved = 0
    try:
        for batch in pf.iter_batches(columns=[field], batch_size=1024):
            column = batch.column(0)
            for row, value in enumerate(column.to_pylist()):
                if isinstance(value, (bytes, bytearray)):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError as err:
                        raise _not_utf8(path, done_rows + row + 1, err) from None
                elif value is not None and not isinstance(value, str):
                    raise NatslError(f"{str(path)!r} column {field!r} holds {type(value).__name__}, not text; "
                                     "name the text column with --text-field")
                target = size * (done_rows + row + 1) // rows
                yield value or "", target - moved
                moved = target
            done_rows += len(column)
    except pyarrow.ArrowException as err:
        raise NatslError(f"{str(path)!r} could not be read ({_first_line(err)}); is it valid UTF-8 Parquet?") from None


class FileSource:
    """Local files, read in sorted order (a folder's files sorted by relative path)."""

    unit = "B"

    def __init__(self, inputs: list[str], text_field: str = "text", txt_docs: str = "file"):
        if txt_docs not in TXT_DOCS:
            raise NatslError(f"--txt-docs must be one of {', '.join(TXT_DOCS)}, got {txt_docs!r}")
        self.files = expand_inputs(inputs)
        self.text_field = text_field
        self.txt_docs = txt_docs
        self.total = sum(p.stat().st_size for p in self.files)

    def describe(self) -> dict:
        return {"kind": "files", "text_field": self.text_field, "txt_docs": self.txt_docs,
                "files": [{"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                          for p in self.files]}

    def documents(self) -> Iterator[tuple[str, int]]:
        for path in self.files:
            if path.suffix == ".txt":
                yield from _read_txt(path, self.txt_docs)
            elif path.suffix == ".jsonl":
                yield from _read_jsonl(path, self.text_field)
            else:
                yield from _read_parquet(path, self.text_field)


class MemorySource:
    """Documents held in memory (the embedded corpus); `info` describes where they came from."""

    unit = "doc"

    def __init__(self, texts: list[str], info: dict):
        self.texts = texts
        self.info = info
        self.total = len(texts)

    def describe(self) -> dict:
        return {"kind": "memory", **self.info}

    def documents(self) -> Iterator[tuple[str, int]]:
        for text in self.texts:
            yield text, 1


# ----------------------------------------------------------------------------- the Hugging Face Hub

def hub_unreachable_reason(timeout: float = 5.0) -> str | None:
    """None when the Hub answers a TCP connection; otherwise why not (checked before `datasets` retries for minutes)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return f"offline mode is on ({var}={os.environ[var]})"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a proxy decides; let the client try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host} cannot be reached ({err.strerror or _first_line(err)})"
    return None


def looks_like_local_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or name.endswith(SUFFIXES) or name.endswith(".json")
            or name.count("/") > 1 or os.sep != "/" and os.sep in name)


class HubSource:
    """A Hugging Face dataset, streamed with `datasets` (nothing is downloaded up front)."""

    unit = "doc"
    total = None

    def __init__(self, name: str, config: str | None = None, split: str = "train", text_field: str = "text"):
        self.name, self.config, self.split, self.text_field = name, config, split, text_field

    def describe(self) -> dict:
        return {"kind": "hub", "name": self.name, "config": self.config, "split": self.split,
                "text_field": self.text_field}

    def check(self) -> None:
        reason = hub_unreachable_reason()
        if reason:
            raise NatslError(f"{self.name!r} is not a local file or folder, and streaming it from the Hugging Face Hub "
                             f"is not possible here: {reason}; pass local .txt/.jsonl/.parquet files instead")

    def documents(self) -> Iterator[tuple[str, int]]:
        self.check()
        try:
            import datasets

            stream = datasets.load_dataset(self.name, self.config, split=self.split, streaming=True)
            for number, record in enumerate(stream, start=1):
                yield _text_of(record.get(self.text_field), f"{self.name!r} record {number}", self.text_field), 1
        except NatslError:
            raise
        except Exception as err:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
            raise NatslError(f"could not stream {self.name!r} (config {self.config}, split {self.split}) from the "
                             f"Hugging Face Hub: {_first_line(err)}") from None


def open_source(inputs: list[str], text_field: str = "text", txt_docs: str = "file",
                hub_config: str | None = None, hub_split: str = "train"):
    """Local paths -> FileSource; a single name that is not a local path -> HubSource."""
    if not inputs:
        raise NatslError("no input given; pass .txt/.jsonl/.parquet files, folders, or a Hugging Face dataset name")
    if len(inputs) == 1 and not Path(inputs[0]).exists() and not looks_like_local_path(inputs[0]):
        return HubSource(inputs[0], hub_config, hub_split, text_field)
    return FileSource(inputs, text_field, txt_docs)
