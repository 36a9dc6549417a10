"""User-facing errors: one line that names the problem and the fix; the CLI exits with code 2."""


class NatslError(Exception):
    """A problem with the user's input (recipe, file, checkpoint, flag), not a bug in natsl."""


class NonFiniteError(NatslError):
    """A model produced NaN or inf (logits, losses): its weights hold NaN/inf or its dtype overflows.
    Raised where it is seen; the command that loaded the checkpoint adds the checkpoint's name."""
