"""One rule for random seeds, shared by every command and the recipe's `train.seed`.

torch.manual_seed takes any integer up to 2**64 - 1, but numpy's legacy generator, Python's
`random` round trips and torch.Generator.initial_seed() (an int64 in some paths) do not; 0 to
2**63 - 1 fits all of them, so a seed that one command takes is taken by every other.
"""

from __future__ import annotations

from natsl.errors import NatslError

SEED_MAX = 2**63 - 1


def check_seed(seed: int, what: str = "seed") -> int:
    """Return `seed` if it is an integer from 0 to 2**63-1, else raise a one-line NatslError.

    `what` names the value in the message (e.g. "--seed" or "recipe key 'train.seed'")."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise NatslError(f"{what} must be an integer from 0 to 2**63-1; got {seed!r}")
    return seed
