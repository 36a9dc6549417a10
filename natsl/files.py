"""Output folders, operating-system errors that name the user's path (files themselves are
written by natsl.atomic), and the bounded reading of the small text and JSON files that natsl takes
from folders strangers hand it (checkpoints, Hugging Face folders, data folders)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

# The largest JSON file natsl reads from such a folder: a sharded checkpoint's weight index lists
# every tensor (a few MB for the largest models); anything bigger is not a file natsl wrote.
MAX_JSON_BYTES = 64 << 20


def check_output_folder(path, flag: str) -> None:
    """NatslError when an output folder's path is a file, or runs through one (mkdir would say
    "File exists" or "Not a directory" about a path the user may not recognise)."""
    from natsl.errors import NatslError

    path = Path(path)
    for part in (path, *path.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                where = "" if part == path else f" (its part {str(part)!r} is a file)"
                raise NatslError(f"{flag} {str(path)!r} names a file, not a folder{where}; pass a folder path "
                                 "(it is created)")
            return


def os_error_at(err: OSError, path) -> OSError:
    """The same operating-system error, naming `path` (e.g. the target instead of its temporary file)."""
    return type(err)(err.errno, err.strerror or str(err), str(path)) if err.errno else err


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
