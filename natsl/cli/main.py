"""Entry point of the `natsl` console script: registers every subcommand module."""

from __future__ import annotations

from typing import Optional

from natsl.cli.app import app  # first: it installs the Ctrl-C handling before the heavier imports

import typer  # noqa: E402

from natsl import __version__  # noqa: E402

# Each import registers its subcommands on `app`.
from natsl.cli import info  # noqa: F401,E402
from natsl.cli import generate  # noqa: F401,E402
from natsl.cli import bench_latency  # noqa: F401,E402
from natsl.cli import tokenize  # noqa: F401,E402
from natsl.cli import train  # noqa: F401,E402
from natsl.cli import eval_ppl  # noqa: F401,E402
from natsl.cli import eval_ruler  # noqa: F401,E402
from natsl.cli import eval_recall  # noqa: F401,E402
from natsl.cli import sweep  # noqa: F401,E402
from natsl.cli import inspect_routing  # noqa: F401,E402
from natsl.cli import convert  # noqa: F401,E402
from natsl.cli import eval_lm  # noqa: F401,E402
from natsl.cli import warmup  # noqa: F401,E402
from natsl.cli import compare  # noqa: F401,E402
from natsl.cli import miniature  # noqa: F401,E402


def _print_version(value: bool) -> None:
    if value:
        print(f"natsl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Optional[bool] = typer.Option(None, "--version", callback=_print_version, is_eager=True,
                                           help="Print the version and exit."),
) -> None:
    """NAtS-L: train, run, evaluate and measure Neural Attention Search Linear models."""


if __name__ == "__main__":
    app()
