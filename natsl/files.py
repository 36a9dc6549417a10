"""Output folders and operating-system errors that name the user's path (files themselves are
written by natsl.atomic)."""

from __future__ import annotations

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
