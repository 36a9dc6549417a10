"""What a command may write: an output folder's path that is a folder (check_output_folder), and an output
that overwrites nothing the same command reads and no training checkpoint (check_output). Files themselves are
written by natsl.atomic."""

from __future__ import annotations

from pathlib import Path

from natsl.files import real_path


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
    from natsl.checkpoint import training_checkpoint_at  # (torch and the models load only once an output is checked)
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
