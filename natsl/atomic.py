"""Files and folders people keep, written atomically: a temporary sibling, then renames.

The temporary file is created with mode 0666 and the process umask (as `open` does), not with
`tempfile.mkstemp`'s 0600, so a result file gets the same permissions as any other file the user
writes. A crash or an error leaves the previous file (or none) and no temporary file behind, and an
operating-system error (a full disk, a read-only folder) names the target the user gave, not the
hidden temporary name they never typed.

A folder (`atomic_folder`) takes more than one rename to replace, so a kill can fall between them.
Each step leaves hidden siblings whose names say what they hold and which process made them:

    .NAME.tmp-PID-XXXX   being filled: incomplete
    .NAME.new-PID        filled and synced: complete, not yet in place
    .NAME.old-PID        the previous NAME, set aside for the new one

and the next write of NAME (or `recover_folder`) puts things right for writers no longer running: a
missing NAME gets the complete new copy, else the previous one back; whatever else they left is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from natsl.files import os_error_at


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", encoding: str = "utf-8"):
    """`with atomic_open(path) as fh: ...` writes `path` atomically; mode "w" (text) or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes with mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:  # another writer drew the same name
            continue
        except OSError as err:
            raise os_error_at(err, path) from None
    try:
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": encoding})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise os_error_at(err, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path, text: str) -> Path:
    with atomic_open(path) as fh:
        fh.write(text)
    return Path(path)


def write_json(path, obj, indent: int = 2) -> Path:
    return write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def write_jsonl(path, rows) -> Path:
    """One JSON object per line (UTF-8, not escaped)."""
    return write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def save_figure(fig, path, **savefig_kwargs) -> Path:
    """A matplotlib figure as a PNG, atomically; the figure is closed afterwards."""
    import matplotlib.pyplot as plt

    try:
        with atomic_open(path, "wb") as fh:
            fig.savefig(fh, format="png", **savefig_kwargs)
    finally:
        plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- folders

# What follows ".NAME.tmp-", ".NAME.new-", ".NAME.old-" in a leftover's name: the pid of the writer (and for
# tmp the random letters of mkdtemp; natsl before pids were written gave tmp those letters alone).
LEFTOVER_TAILS = {"tmp": re.compile(r"^(?:(\d+)-)?[a-z0-9_]{8}$"), "new": re.compile(r"^(\d+)$"),
                  "old": re.compile(r"^(\d+)$")}
# Tests set this to a function of the step name ("filled", "complete", "set_aside", "published") that
# kills the process there, to prove that the next run recovers; None otherwise.
crash_test_hook = None
_in_flight: set[str] = set()  # this process's own hidden siblings (real paths), which are not leftovers


def fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (a rename into it) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def usual_permissions(folder: Path) -> None:
    """mkdtemp makes the folder 0700 (and safetensors some files 0600); publish with the umask's modes."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~mask)


def atomic_folder(target, fill) -> Path:
    """Create or replace the folder `target` atomically and crash-safely (see the module doc): leftovers
    of a killed earlier write are recovered first, `fill(tmp_folder)` writes the files, renames publish them.

    Args:
        target: the folder to create or replace.
        fill: a function of the temporary folder that writes every file into it.
    Returns:
        `target` as a Path.
    Raises:
        OSError: naming `target`, not the hidden sibling; whatever `fill` raises. Either way the previous
        `target` (or none) is left as it was, with no hidden sibling.
    """
    target = Path(target)
    try:
        recover_folder(target)
        return _replace_folder(target, fill)
    except OSError as err:  # name what the user asked for, not the hidden temporary sibling
        raise os_error_at(err, target) from None


def _sibling(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}-{os.getpid()}")


def _step(name: str) -> None:
    if crash_test_hook is not None:
        crash_test_hook(name)


def _replace_folder(target: Path, fill) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    new, old = _sibling(target, "new"), _sibling(target, "old")
    mine = {os.path.realpath(path) for path in (tmp, new, old)}
    _in_flight.update(mine)
    set_aside = False
    try:
        fill(tmp)
        usual_permissions(tmp)
        fsync_tree(tmp)
        _step("filled")
        os.replace(tmp, new)  # from here on the new copy is known to be complete
        fsync_folder(target.parent)
        _step("complete")
        if target.exists() or target.is_symlink():
            os.replace(target, old)
            set_aside = True
            _step("set_aside")
        os.replace(new, target)
        fsync_folder(target.parent)
        _step("published")
        if set_aside:
            _remove(old)
    except BaseException:
        if set_aside and not (target.exists() or target.is_symlink()):
            os.replace(old, target)  # the new copy did not get in place: the previous one goes back
        for path in (tmp, new, old):
            _remove(path)
        raise
    finally:
        _in_flight.difference_update(mine)
    return target


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _writer_gone(path: Path, pid: str | None) -> bool:
    """Whether the process `pid` that made the hidden sibling `path` no longer runs; a name without a pid
    (natsl before pids were written) counts as gone."""
    if pid is None:
        return True
    pid = int(pid)
    if pid == os.getpid():
        return os.path.realpath(path) not in _in_flight
    if os.name != "posix":  # os.kill(pid, 0) would end the process elsewhere
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: running
        return False
    return False


def folder_leftovers(target) -> dict[str, list[Path]]:
    """The hidden siblings of `target` left by writers that no longer run, by kind (tmp, new, old)."""
    target = Path(target)
    found: dict[str, list[Path]] = {kind: [] for kind in LEFTOVER_TAILS}
    if not target.parent.is_dir():
        return found
    for path in sorted(target.parent.iterdir()):
        for kind, tail in LEFTOVER_TAILS.items():
            prefix = f".{target.name}.{kind}-"
            match = tail.match(path.name[len(prefix):]) if path.name.startswith(prefix) else None
            if match and _writer_gone(path, match.group(1)):
                found[kind].append(path)
    return found


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def recover_folder(target, log=_note, what: str = "write") -> None:
    """Put right what a killed `atomic_folder(target, ...)` left: a missing `target` gets the complete new
    copy, else the previous one it had set aside; every other leftover of a writer no longer running is
    removed. One `log` line per action.

    Args:
        target: the folder whose hidden siblings to look at.
        log: a function of one line of text (default: a note on stderr).
        what: what the writes were, for the lines (e.g. "checkpoint write").
    """
    target = Path(target)
    found = folder_leftovers(target)
    restored = None
    if not (target.exists() or target.is_symlink()):
        if found["new"]:
            restored = max(found["new"], key=lambda path: path.stat().st_mtime)
            os.replace(restored, target)
            log(f"{target}: put the new copy in place ({restored.name}), complete when an earlier {what} was "
                "killed while replacing it")
        elif found["old"]:
            restored = max(found["old"], key=lambda path: path.stat().st_mtime)
            os.replace(restored, target)
            log(f"{target}: restored the previous copy ({restored.name}) that an earlier {what}, killed while "
                "replacing it, had set aside")
    for kind, why in (("tmp", f"an unfinished {what} (the process writing it was killed)"),
                      ("new", f"a copy from an earlier {what} that was killed before it replaced {target.name}"),
                      ("old", f"the previous copy of {target.name}, already replaced")):
        for path in found[kind]:
            if path != restored:
                log(f"removing {path}: {why}")
                _remove(path)
    if restored is not None or any(found.values()):
        fsync_folder(target.parent)


def recover_folders_in(folder, log=_note, what: str = "write") -> None:
    """`recover_folder` for every folder whose hidden siblings lie in `folder`."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    targets = set()
    for path in folder.iterdir():
        for kind, tail in LEFTOVER_TAILS.items():
            name, sep, rest = path.name[1:].rpartition(f".{kind}-")
            if path.name.startswith(".") and sep and name and tail.match(rest):
                targets.add(folder / name)
    for target in sorted(targets):
        recover_folder(target, log, what)
