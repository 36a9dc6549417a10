"""One seed rule (natsl.seeding.check_seed) for every command and the recipe's train.seed."""

import pytest

from natsl.errors import NatslError
from natsl.seeding import SEED_MAX, check_seed


@pytest.mark.parametrize("seed", [0, 1, 1234, SEED_MAX])
def test_seeds_in_range_are_returned(seed):
    assert check_seed(seed) == seed


@pytest.mark.parametrize("seed", [-1, SEED_MAX + 1, 2**70, True, 1.5, "3"])
def test_seeds_out_of_range_are_one_line_errors(seed):
    with pytest.raises(NatslError) as err:
        check_seed(seed)
    assert str(err.value) == f"seed must be an integer from 0 to 2**63-1; got {seed!r}"


def test_the_message_names_what_was_given():
    with pytest.raises(NatslError, match=r"^--seed must be an integer from 0 to 2\*\*63-1; got -1$"):
        check_seed(-1, "--seed")
