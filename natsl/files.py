"""Paths and the small files natsl reads from folders strangers hand it: paths read from files
(resolve_inside), operating-system errors that name the user's path, and the bounded reading of small text and JSON files (checkpoints, Hugging Face
folders, data folders). Files themselves are written by natsl.atomic."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePath

# The largest JSON file natsl reads from such a folder: a sharded checkpoint's weight index lists
# every tensor (a few MB for the largest models); anything bigger is not a file natsl wrote.
MAX_JSON_BYTES = 64 << 20


def os_error_at(err: OSError, path) -> OSError:
    """The same operating-system error, naming `path` (e.g. the target instead of its temporary file)."""
    return type(err)(err.errno, err.strerror or str(err), str(path)) if err.errno else err


def real_path(path) -> Path:
    """`path` with every link and `..` resolved, as far as it exists (the rest is appended as written)."""
    return Path(os.path.realpath(path))


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def resolve_inside(folder, name, where: str, also_inside=(), fix: str = "use another copy") -> Path:
    """The path that a file inside `folder` names (a shard list, an index, a manifest), refused unless it
    resolves inside `folder`, links resolved: an untrusted file must not make natsl read or write elsewhere.

    Args:
        folder: the folder the naming file belongs to.
        name: the path as read from the file (relative to `folder`).
        where: what named it, for the message (e.g. "'x/model.safetensors.index.json'").
        also_inside: further folders a link may lead into (e.g. a Hugging Face cache's blobs/ folder).
        fix: what the user should do, ending the message (a data folder: tokenize the data again).
    Returns:
        `folder / name`.
    Raises:
        NatslError: `name` is not a non-empty string, is absolute, or leads (by `..` or by a link) outside.
    """
    from natsl.errors import NatslError

    folder = Path(folder)

    def refuse(why: str) -> NatslError:
        shown = repr(name) if len(repr(name)) <= 200 else repr(name)[:200] + "..."  # any JSON value, however large
        return NatslError(f"{where} names {shown}, which {why}; natsl reads only files inside {str(folder)!r} "
                          f"(links resolved), so this looks damaged or made to read other files: {fix}")

    if not isinstance(name, str) or not name.strip() or "\x00" in name:
        raise refuse("is not a file name")
    if PurePath(name).is_absolute() or name.startswith(("/", "\\")):
        raise refuse("is an absolute path")
    base = real_path(folder)
    if not _within(Path(os.path.normpath(base / name)), base):
        raise refuse("leads outside the folder")
    if not any(_within(real_path(folder / name), real_path(root)) for root in (folder, *also_inside)):
        raise refuse("is a link to a file outside the folder")
    return folder / name


def read_small_text(path, max_bytes: int, fix: str) -> str:
    """The UTF-8 text of the regular file `path`, at most `max_bytes` long.

    A FIFO or device (open would wait for a writer, or read forever), a file above the bound and
    bytes that are not UTF-8 are each a one-line NatslError ending in `fix`.

    Args:
        path: the file.
        max_bytes: the largest size accepted.
        fix: what the user should do, ending the error line (e.g. "use another checkpoint").

    Returns:
        The decoded text.
    """
    from natsl.errors import NatslError

    path = Path(path)
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise NatslError(f"{str(path)!r} is not a regular file; {fix}")
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)  # the stat size may be stale: never read past the bound
    if len(data) > max_bytes:
        raise NatslError(f"{str(path)!r} is larger than {max_bytes} bytes, more than such a file can be; {fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NatslError(f"{str(path)!r} is not UTF-8 text (byte {err.start}); {fix}") from None


def parse_json(text: str, where: str, fix: str):
    """json.loads, where every way a stranger's text can fail it is one NatslError naming `where`:
    bad syntax, nesting deep enough to exhaust the parser's recursion, an integer of too many digits.

    Args:
        text: the JSON text.
        where: what it is, for the error line (a quoted path, or a path and line number).
        fix: what the user should do, ending the error line.

    Returns:
        The parsed value.
    """
    from natsl.errors import NatslError

    try:
        return json.loads(text)
    except RecursionError:
        raise NatslError(f"{where} is nested too deeply to be data natsl reads; {fix}") from None
    except ValueError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise NatslError(f"{where} is not valid JSON ({reason}); {fix}") from None


def read_json_records(path) -> list[dict]:
    """The JSON objects of a .jsonl file, one a line (a run's metrics.jsonl). A line cut short by a kill, not
    UTF-8, nested past the parser or not an object is skipped: a crash, or another program, leaves such lines.

    Args:
        path: the file (the caller checks that it is a regular file: opening a FIFO would wait).

    Returns:
        The records, in file order.

    Raises:
        OSError: the file cannot be opened or read.
    """
    from natsl.errors import NatslError

    records = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                record = parse_json(line, str(path), "skipped")
            except NatslError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def read_json(path, fix: str, max_bytes: int = MAX_JSON_BYTES):
    """The parsed JSON of a file from a folder natsl was given (read_small_text, then parse_json).

    Args:
        path: the file.
        fix: what the user should do when it cannot be read, ending the error line.
        max_bytes: the largest size accepted.

    Returns:
        The parsed value (any JSON type: callers check that it is the object they expect).
    """
    return parse_json(read_small_text(path, max_bytes, fix), repr(str(path)), fix)
