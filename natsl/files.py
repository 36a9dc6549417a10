"""Small files written atomically, and operating-system errors that name the user's path.

A file people keep is written to a hidden temporary sibling and renamed into place. When that
fails (a full disk, a read-only folder) the temporary file is removed and the error names the
target the user gave, not the hidden name they never typed.
"""

from __future__ import annotations

import os
from pathlib import Path


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


def atomic_write_text(path, text: str, fsync: bool = False) -> None:
    """Write `text` to `path` through a temporary sibling and one rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise os_error_at(err, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
