"""User-facing errors: one line that names the problem and the fix; the CLI exits with code 2."""


class NatslError(Exception):
    """A problem with the user's input (recipe, file, checkpoint, flag), not a bug in natsl."""
