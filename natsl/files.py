"""Paths and the small files natsl reads from folders strangers hand it: output folders, paths read from
files (resolve_inside), outputs that must not overwrite inputs (check_output), operating-system errors that
name the user's path, and the bounded reading of small text and JSON files (checkpoints, Hugging Face
folders, data folders). Files themselves are written by natsl.atomic."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePath

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


def check_output(output, inputs, flag: str) -> None:
    """Refuse an output path that would overwrite what the same command reads, or a training checkpoint:
    the output must not be any input, lie inside one or hold one (links resolved), and must not be or lie
    inside a training checkpoint (natsl.checkpoint.training_checkpoint_at), whose optimizer state, RNG
    state and manifest nothing else can rebuild. Call it before any work.

    Args:
        output: the path the command writes (a file or a folder).
        inputs: the paths it reads; None and paths that do not exist (names of recipes, Hub datasets) are skipped.
        flag: the option or argument naming `output`, for the message (e.g. "--out").
    Raises:
        NatslError: one line naming the clash and the fix.
    """
    from natsl.checkpoint import training_checkpoint_at
    from natsl.errors import NatslError

    out = real_path(output)
    for given in inputs:
        if given is None or not (Path(given).exists() or Path(given).is_symlink()):
            continue
        source = real_path(given)
        if out == source:
            relation = "is"
        elif source in out.parents:
            relation = "lies inside"
        elif out in source.parents:
            relation = "holds"
        else:
            continue
        raise NatslError(f"{flag} {str(output)!r} {relation} the input {str(given)!r}, which this command reads: "
                         f"writing there would overwrite or mix with it; choose a {flag} path apart from the inputs")
    checkpoint = training_checkpoint_at(out)
    if checkpoint is not None:
        relation = "is" if checkpoint == out else "lies inside"
        raise NatslError(f"{flag} {str(output)!r} {relation} the training checkpoint {str(checkpoint)!r}; natsl never "
                         "writes into one, not even with --force (its optimizer and RNG state and manifest would be "
                         "lost): choose another path (`natsl convert` of it writes an inference folder elsewhere)")
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
