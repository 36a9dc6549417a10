"""Documents from local files: which files count (folders, globs, `--include`) and how each is read.

An input is a file, a folder (searched recursively, hidden entries left out) or a glob pattern
(expanded by natsl with `glob.glob(recursive=True)`, so a quoted pattern means the same on every
shell). A file that is named is read whatever its name; of the files a pattern matches, those
that match an `--include` pattern (fnmatch on the name) count, or all when no --include is given;
inside a folder, those that match an `--include` pattern (default `*.txt`, `*.jsonl`, `*.parquet`). `.jsonl` and `.parquet` files hold records (the `--text-field`); a `.txt` file is
split by `--txt-docs`; any other file is one plain-text document, and a `.gz` file is that document
compressed (a man page, a changelog), decompressed in memory up to a bound.

Bad files (not UTF-8, binary, unreadable, too large) stop the run with one line, or, with
`skip_bad_files`, are left out and counted by reason (`FileSource.skipped`). Every document comes
with its origin, an index into `FileSource.origins`: (the input argument, the `--include` pattern
that chose the file), the cells of the mix that `natsl tokenize` records.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Iterator

from natsl.errors import NatslError
from natsl.files import parse_json

RECORD_SUFFIXES = (".jsonl", ".parquet")
DEFAULT_INCLUDE = ("*.txt", "*.jsonl", "*.parquet")
TXT_DOCS = ("file", "paragraph", "line")
OTHER = "other"  # the mix cell of a named (or glob-matched) file that no --include pattern matches
# The largest one-document file under --skip-bad-files unless --max-file-bytes says otherwise: larger
# files in source trees are generated tables and data, not text anyone wrote.
SKIP_MODE_MAX_FILE_BYTES = 1 << 20
# A .gz file may decompress to this many times the largest file (--max-file-bytes, else the default above):
# text compresses 3-5x, so more is a decompression bomb or not text, and it is never held in memory.
GZIP_EXPANSION = 8
SKIP_REASONS = ("not-utf8", "binary", "too-large", "unreadable")
SKIP_EXAMPLES = 5  # paths kept per reason in meta.json
SKIP_HINT = "or pass --skip-bad-files to leave such files out"


class BadFile(NatslError):
    """A file that cannot be a document: one line naming it and the fix; `reason` is one of SKIP_REASONS."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ----------------------------------------------------------------------------- which files count

def has_glob(item: str) -> bool:
    return glob.has_magic(item)


def check_include(patterns) -> tuple[str, ...]:
    """The --include patterns, checked: they match file names, so a '/' could never match."""
    patterns = tuple(patterns or ())
    for pattern in patterns:
        if not pattern or "/" in pattern or os.sep in pattern:
            raise NatslError(f"--include {pattern!r} is not a file-name pattern; --include matches file names "
                             "(e.g. '*.py'), and folders and globs choose where to look")
    return patterns or DEFAULT_INCLUDE


def _folder_files(folder: Path, include: tuple[str, ...]) -> list[Path]:
    """The files under `folder` that `include` chooses (hidden entries left out); a link that leads out of the
    folder is left out with a warning (an input folder is read, not what its links point at)."""
    import sys

    from natsl.files import real_path

    root = real_path(folder)
    found = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not any(fnmatch.fnmatch(path.name, p) for p in include):
            continue
        if path.is_file():
            if root not in real_path(path).parents:
                print(f"warning: {str(path)!r} is a link out of {str(folder)!r}; left out", file=sys.stderr)
                continue
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def expand_inputs(inputs: list[str], include=None) -> list[tuple[int, Path]]:
    """Files, folders and glob patterns -> (input index, file) pairs in reading order.

    A file named by its path always counts; a file that a pattern matches counts when it matches an
    --include pattern, or always when none is given; a folder's files when they match one (default
    DEFAULT_INCLUDE). A path that does not exist is an error; a pattern that matches nothing, or a
    folder without a file that counts, only when no input gives a file (`empty_inputs` names them:
    one command serves hosts that lack some folders).

    Args:
        inputs: the command's input arguments.
        include: the --include patterns (None or empty: none given).
    Returns:
        Every file once per input that names it, in input order; a folder's files sorted by relative path,
        a pattern's matches sorted.
    """
    chosen = bool(include)  # --include given: it chooses among what patterns match too
    include = check_include(include)
    files: list[tuple[int, Path]] = []
    for index, item in enumerate(inputs):
        pattern = has_glob(item) and not Path(item).exists()  # a file named `[draft].txt` is itself
        matches = [Path(p) for p in sorted(glob.glob(item, recursive=True))] if pattern else [Path(item)]
        found: dict[Path, None] = {}  # `dir/**` names folders and the files in them: each file once per input
        for path in matches:
            if path.is_dir():
                found.update(dict.fromkeys(_folder_files(path, include)))
            elif path.is_file() and (not pattern or not chosen or include_of(path.name, include) != OTHER):
                found[path] = None
            elif not pattern:
                raise NatslError(f"input {item!r} does not exist; pass files, folders, quoted glob patterns, "
                                 "or a Hugging Face dataset name")
        files.extend((index, path) for path in found)
    if not files:
        where = "an --include pattern" if include != DEFAULT_INCLUDE else ".txt, .jsonl or .parquet"
        raise NatslError(f"{', '.join(repr(i) for i in inputs)} hold(s) no file that counts ({where}); point at the "
                         "data files, or name the files to read with --include PATTERN")
    return files


def empty_inputs(inputs: list[str], files: list[tuple[int, Path]]) -> list[str]:
    """The inputs that gave no file (a pattern matching nothing, a folder without a file that counts)."""
    used = {index for index, _ in files}
    return [item for index, item in enumerate(inputs) if index not in used]


def include_of(name: str, include: tuple[str, ...]) -> str:
    """The first --include pattern matching a file name (its mix cell), else OTHER."""
    return next((p for p in include if fnmatch.fnmatch(name, p)), OTHER)


# ----------------------------------------------------------------------------- reading one file

def _not_utf8(path: Path, line: int, start: int, raw: bytes) -> BadFile:
    return BadFile(f"{str(path)!r} is not UTF-8 text (line {line}, byte {start} of that line: {raw[start:start + 1]!r}); "
                   f"convert it, e.g. `iconv -f latin1 -t utf-8`, {SKIP_HINT}", "not-utf8")


def _utf8_lines(path: Path) -> Iterator[tuple[int, bytes, str]]:
    """(line number, raw bytes, decoded text) of each line; a non-UTF-8 line is a one-line error."""
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                yield number, raw, raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, number, err.start, raw) from None


def _too_large(path: Path, what: str, limit: int) -> BadFile:
    return BadFile(f"{str(path)!r} {what} {limit:,} bytes; raise --max-file-bytes, {SKIP_HINT}", "too-large")


def read_document_bytes(path: Path, max_bytes: int | None) -> bytes:
    """A whole file's bytes (a .gz file's decompressed), at most `max_bytes` (None: any size on disk; a .gz
    file then decompresses to at most GZIP_EXPANSION x SKIP_MODE_MAX_FILE_BYTES)."""
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise _too_large(path, "is larger than --max-file-bytes", max_bytes)
    if path.suffix != ".gz":
        with open(path, "rb") as fh:
            return fh.read()
    cap = GZIP_EXPANSION * (max_bytes or SKIP_MODE_MAX_FILE_BYTES)
    try:
        with gzip.open(path, "rb") as fh:
            data = fh.read(cap + 1)  # decompresses no further than the bound
    except (OSError, EOFError, zlib.error) as err:
        raise BadFile(f"{str(path)!r} is not a readable gzip file ({_first_line(err)}); {SKIP_HINT}",
                      "unreadable") from None
    if len(data) > cap:
        raise _too_large(path, f"decompresses to more than {GZIP_EXPANSION}x --max-file-bytes =", cap)
    return data


def decode_document(path: Path, data: bytes) -> str:
    """UTF-8 text of a whole file, or BadFile: binary (a NUL byte) or not UTF-8 (naming the line)."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise BadFile(f"{str(path)!r} is binary (a NUL byte at offset {nul:,}), not text; leave it out, {SKIP_HINT}",
                      "binary")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = data.rfind(b"\n", 0, err.start) + 1
        raise _not_utf8(path, data.count(b"\n", 0, err.start) + 1, err.start - line_start,
                        data[line_start:data.find(b"\n", err.start) + 1 or len(data)]) from None


def _read_document(path: Path, max_bytes: int | None) -> Iterator[tuple[str, int]]:
    """The whole file as one document."""
    text = decode_document(path, read_document_bytes(path, max_bytes))
    yield (text if text.strip() else ""), path.stat().st_size


def _read_txt_split(path: Path, mode: str) -> Iterator[tuple[str, int]]:
    """`paragraph`: blank lines separate documents; `line`: one per line."""
    pending: list[str] = []
    pending_bytes = 0
    for _, raw, line in _utf8_lines(path):
        pending_bytes += len(raw)
        if mode == "line":
            text = line.rstrip("\r\n")
            if text.strip():
                yield text, pending_bytes
                pending_bytes = 0
        elif not line.strip():
            if pending:
                yield "".join(pending).rstrip("\r\n"), pending_bytes
                pending, pending_bytes = [], 0
        else:
            pending.append(line)
    text = "".join(pending).rstrip("\r\n")
    if text.strip():
        yield text, pending_bytes
    elif pending_bytes:
        yield "", pending_bytes  # nothing left to tokenize, but the bar should reach the end


def text_of(value, where: str, field: str):
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
        yield text_of(record.get(field), f"{str(path)!r} line {number}", field), len(raw)


def _read_parquet(path: Path, field: str) -> Iterator[tuple[str, int]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise BadFile(f"{str(path)!r} is not a readable Parquet file ({_first_line(err)})", "unreadable") from None
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
                        raise _not_utf8(path, done_rows + row + 1, err.start, value) from None
                elif value is not None and not isinstance(value, str):
                    raise NatslError(f"{str(path)!r} column {field!r} holds {type(value).__name__}, not text; "
                                     "name the text column with --text-field")
                target = size * (done_rows + row + 1) // rows
                yield value or "", target - moved
                moved = target
            done_rows += len(column)
    except pyarrow.ArrowException as err:
        raise BadFile(f"{str(path)!r} could not be read ({_first_line(err)}); is it valid UTF-8 Parquet?",
                      "unreadable") from None


# ----------------------------------------------------------------------------- the source

class FileSource:
    """Local files, read in order (see the module doc).

    Args:
        inputs: files, folders and glob patterns.
        text_field: the field (.jsonl) or column (.parquet) holding the text.
        txt_docs: what a document is in a .txt file: file, paragraph or line.
        include: fnmatch patterns of the file names that count inside folders (default DEFAULT_INCLUDE).
        skip_bad_files: leave bad files out (counted in `skipped`) instead of stopping.
        max_file_bytes: the largest file read as one document (default: SKIP_MODE_MAX_FILE_BYTES with
            skip_bad_files, else any size); a .gz file decompresses to at most GZIP_EXPANSION times it.
    """

    unit = "B"

    def __init__(self, inputs: list[str], text_field: str = "text", txt_docs: str = "file", include=None,
                 skip_bad_files: bool = False, max_file_bytes: int | None = None):
        if txt_docs not in TXT_DOCS:
            raise NatslError(f"--txt-docs must be one of {', '.join(TXT_DOCS)}, got {txt_docs!r}")
        if max_file_bytes is not None and max_file_bytes < 1:
            raise NatslError(f"--max-file-bytes must be at least 1, got {max_file_bytes}")
        self.inputs = list(inputs)
        self.include = check_include(include)
        self.custom_include = bool(include)
        self.skip_bad_files = skip_bad_files
        self.given_max_file_bytes = max_file_bytes
        self.max_file_bytes = max_file_bytes or (SKIP_MODE_MAX_FILE_BYTES if skip_bad_files else None)
        self.text_field = text_field
        self.txt_docs = txt_docs
        self.origins = [(item, pattern) for item in dict.fromkeys(self.inputs) for pattern in (*self.include, OTHER)]
        cell = {origin: i for i, origin in enumerate(self.origins)}
        self.entries = []  # (path, os.stat_result, origin index)
        found = expand_inputs(self.inputs, include)
        for index, path in found:
            self.entries.append((path, path.stat(), cell[(self.inputs[index], include_of(path.name, self.include))]))
        self.empty_inputs = empty_inputs(self.inputs, found)
        self.files = [path for path, _, _ in self.entries]
        self.total = sum(st.st_size for _, st, _ in self.entries)
        self.skipped = new_skip_counts()

    def describe(self) -> dict:
        """Everything that decides the documents (it goes into the fingerprint); the options appear only when set,
        so that a folder tokenized before they existed keeps its fingerprint."""
        info = {"kind": "files", "text_field": self.text_field, "txt_docs": self.txt_docs,
                "files": [{"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
                          for path, st, _ in self.entries]}
        if self.custom_include:
            info["include"] = list(self.include)
        if self.skip_bad_files:
            info["skip_bad_files"] = True
        if self.given_max_file_bytes is not None:
            info["max_file_bytes"] = self.given_max_file_bytes
        return info

    def summary(self) -> dict:
        """What meta.json records of the source: the describe() above without the per-file list (a source tree
        has 10^5 files), which is summed up by count, bytes and a sha256."""
        info = self.describe()
        listing = info.pop("files")
        info.update(inputs=self.inputs, include=list(self.include), file_count=len(listing), bytes=self.total,
                    files_sha256=hashlib.sha256(json.dumps(listing).encode("utf-8")).hexdigest())
        if self.max_file_bytes is not None:
            info["max_file_bytes"] = self.max_file_bytes
        return info

    def _read(self, path: Path) -> Iterator[tuple[str, int]]:
        if path.suffix == ".jsonl":
            return _read_jsonl(path, self.text_field)
        if path.suffix == ".parquet":
            return _read_parquet(path, self.text_field)
        if path.suffix == ".txt" and self.txt_docs != "file":
            return _read_txt_split(path, self.txt_docs)
        return _read_document(path, self.max_file_bytes)

    def documents(self) -> Iterator[tuple[str, int, int]]:
        """(text, bytes the progress bar moves, origin index) of every document; `skipped` counts this pass's
        bad files (a file that fails part-way keeps the documents read before the failure)."""
        self.skipped = new_skip_counts()
        for path, st, origin in self.entries:
            moved = 0
            try:
                try:
                    for text, step in self._read(path):
                        moved += step
                        yield text, step, origin
                except OSError as err:
                    raise BadFile(f"{str(path)!r} cannot be read ({err.strerror or _first_line(err)}); {SKIP_HINT}",
                                  "unreadable") from None
            except NatslError as err:
                if not self.skip_bad_files:
                    raise
                reason = err.reason if isinstance(err, BadFile) else "unreadable"
                count_skip(self.skipped, reason, str(path), origin)
                if st.st_size > moved:
                    yield "", st.st_size - moved, origin  # the bar still reaches the end of the file


def new_skip_counts() -> dict:
    return {"files": 0, "reasons": {}, "examples": {}, "by_origin": {}}


def count_skip(skipped: dict, reason: str, path: str, origin: int) -> None:
    skipped["files"] += 1
    skipped["reasons"][reason] = skipped["reasons"].get(reason, 0) + 1
    examples = skipped["examples"].setdefault(reason, [])
    if len(examples) < SKIP_EXAMPLES:
        examples.append(path)
    skipped["by_origin"][origin] = skipped["by_origin"].get(origin, 0) + 1
