"""Options that every command running a model shares, declared once: `--threads`."""

from __future__ import annotations

from typing import Optional

import typer

THREADS_HELP = ("CPU threads (default: OMP_NUM_THREADS, else 1: small models gain nothing from more, and "
                "threads that share a busy CPU slow each other many times over).")


def threads_option():
    """`--threads N` for a command's signature: `threads: Optional[int] = threads_option()`."""
    return typer.Option(None, "--threads", metavar="N", help=THREADS_HELP)


def use_threads(threads: Optional[int], device, say: bool = True) -> str:
    """Set the CPU thread count (natsl.runtime.cpu_threads) for a command that runs a model on `device`
    and say it: on stdout (stderr must keep to one line when a later check fails), or, with say=False,
    in a line of the caller's. On a GPU only `--threads` changes it.

    Args:
        threads: the `--threads` value (None: OMP_NUM_THREADS, else 1).
        device: `--device` (None / auto: cuda when there is one) or a torch.device.
        say: print the note on a line of its own.
    Returns:
        The note, e.g. "1 CPU thread of 8 (default; --threads N to change)"; "" where nothing was set.
    """
    import torch

    from natsl.runtime import pick_device, set_cpu_threads

    note = set_cpu_threads(threads, device if isinstance(device, torch.device) else pick_device(device))
    if say and note:
        print(note, flush=True)
    return note


def comma_list(text: str, option: str, cast, what: str, example: str) -> list:
    """A comma-separated option value as a list of `cast` values (empty items skipped).

    Args:
        text: the option's value as typed.
        option: the option's name, for the message (e.g. "--budgets").
        cast: float or int.
        what: what the items are, for the message (e.g. "numbers", "token counts").
        example: a value that works, for the message.
    Returns:
        The values, in order.
    Raises:
        NatslError: an item that `cast` refuses (one line naming the option and an example).
    """
    from natsl.errors import NatslError

    try:
        return [cast(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise NatslError(f"{option} {text!r} is not a comma-separated list of {what}; pass e.g. {example}") from None
