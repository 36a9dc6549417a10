"""The Typer application and the wrapper that turns user errors into one line and exit code 2."""

from __future__ import annotations

import functools
import sys

import typer

from natsl.errors import NatslError

app = typer.Typer(
    name="natsl",
    help="NAtS-L: train, run, evaluate and measure Neural Attention Search Linear models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str) -> None:
    """Print a one-line error and exit with code 2 (bad input, nothing was changed)."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code=2)


def command(*args, **kwargs):
    """`app.command` that reports NatslError (and missing files) as one line with exit code 2."""

    def register(fn):
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            try:
                return fn(*a, **kw)
            except NatslError as err:
                fail(str(err))
            except FileNotFoundError as err:
                fail(f"{err.filename or err}: no such file; check the path")
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr)
                raise typer.Exit(code=130) from None

        return app.command(*args, **kwargs)(wrapped)

    return register
