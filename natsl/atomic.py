"""Files people keep, written atomically: a temporary file beside the target, then one rename.

The temporary file is created with mode 0666 and the process umask (as `open` does), not with
`tempfile.mkstemp`'s 0600, so a result file gets the same permissions as any other file the user
writes. A crash or an error leaves the previous file (or none) and no temporary file behind, and an
operating-system error (a full disk, a read-only folder) names the target the user gave, not the
hidden temporary name they never typed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
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
