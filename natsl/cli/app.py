"""The Typer application and the wrapper that turns user errors into one line and exit code 2."""

from __future__ import annotations

import os
import sys


def _interrupted(exc_type, exc, tb, _previous=sys.excepthook):
    """Ctrl-C outside a command's body (e.g. while the interpreter imports typer or torch): one line
    and exit code 130, as a shell reports an interrupted command. Installed when the CLI's first
    module loads, before any heavy import (natsl/__init__ imports torch only on first use)."""
    if issubclass(exc_type, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)  # the interpreter would otherwise re-raise SIGINT on itself after a traceback
    _previous(exc_type, exc, tb)


sys.excepthook = _interrupted

import contextlib  # noqa: E402
import errno  # noqa: E402
import functools  # noqa: E402

import typer  # noqa: E402

from natsl import interrupts  # noqa: E402
from natsl.errors import NatslError  # noqa: E402

class _Commands(typer.core.TyperGroup):
    """`natsl --help` lists each command's whole first paragraph, wrapped (click cuts it at the terminal's
    width with '...')."""

    def format_commands(self, ctx, formatter) -> None:
        import inspect

        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, " ".join(inspect.cleandoc(cmd.help or "").split("\n\n")[0].split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    name="natsl",
    cls=_Commands,
    help="NAtS-L: train, run, evaluate and measure Neural Attention Search Linear models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help wraps every help text at the terminal's width; rich's tables cut long words and
    # option names with '…' in an 80-column terminal
    rich_markup_mode=None,
)


def fail(message: str) -> None:
    """Print a one-line error and exit with code 2 (bad input, nothing was changed)."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code=2)


def _out_of_memory(err: RuntimeError) -> bool:
    """torch's CUDA out-of-memory error, or its CPU allocator's (a plain RuntimeError)."""
    return type(err).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(err)


def _not_utf8(values) -> str | None:
    """The first string argument (or item of a list argument) that cannot be written as UTF-8: Python decodes
    a command line's stray bytes to lone surrogates, which fail later, when a record or a file name is written."""
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return item
    return None


def command(*args, stop_soon: bool = False, **kwargs):
    """`app.command` that reports NatslError, operating-system errors (a missing file, a path that
    cannot be written) and running out of memory as one line with exit code 2. `stop_soon`: the first
    Ctrl-C ends the command within about two seconds, even inside a long native call
    (natsl.interrupts.stop_soon)."""

    def register(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            odd = _not_utf8([*a, *kw.values()])
            if odd is not None:
                fail(f"the argument {odd!r} is not UTF-8 text (the shell passed bytes no UTF-8 text holds), and "
                     "natsl writes its records as UTF-8; rename the file or pass the text as UTF-8")
            try:
                with interrupts.stop_soon() if stop_soon else contextlib.nullcontext():
                    return fn(*a, **kw)
            except NatslError as err:
                fail(str(err))
            except FileNotFoundError as err:
                fail(f"{err.filename or err}: no such file; check the path")
            except OSError as err:  # permissions, a file where a folder should be, a full disk, ...
                where = f"{err.filename}: " if err.filename else ""
                if err.errno in (errno.ENOSPC, errno.EDQUOT):
                    fail(f"{where}no space left on device; free some space and run the command again (files "
                         "written completely before are kept)")
                fail(f"{where}{err.strerror or err}; check the path and its permissions")
            except RuntimeError as err:
                if not _out_of_memory(err):
                    raise
                fail(f"out of memory ({str(err).splitlines()[0][:120]}); lower the length, the batch or the "
                     "number of samples")
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                raise typer.Exit(code=130) from None

        return app.command(*args, **kwargs)(wrapped)

    return register
