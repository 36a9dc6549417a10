"""The miniature's ladder by name: its systems, the Table 4 ablations, and the names of their checkpoints
(SYSTEM_sN for a system's seed N), shared by the stages (natsl.miniature.pipeline), the evaluations
(natsl.miniature.evaluate) and the report."""

from __future__ import annotations

import sys

# The paper's six systems (Table 1) and GDN + SWA, the compare baseline: recipes/mini/NAME.yaml.
LADDER = ("gdn", "mamba2", "transformer", "gdn_hybrid", "natsl", "natsl_hybrid", "gdn_swa")
SWEPT = tuple(s for s in LADDER if s != "gdn_swa")
RATE_OF = {"gdn_swa": "gdn_hybrid"}  # a system trained at another's best rate
# Table 4's ablations of the NAtS-L Hybrid that the miniature runs: mixing weights from x instead of q, blocks
# (chunks) of 128 tokens, and no softmax inside the current block (the GDN state alone reads it).
ABLATIONS = {
    "natsl_hybrid_mix_x": ["model.mix_input=x"],
    # on the fast kernels: 128-token blocks are two 64-token chunks sharing a route (natsl/fast/gated_delta/spans.py)
    "natsl_hybrid_chunk128": ["model.block_size=128"],
    "natsl_hybrid_no_intra_softmax": ["model.intra_block_output=gdn"],
}
ROUTED_SYSTEMS = ("natsl", "natsl_hybrid")  # the ladder's systems with NAtS-L layers (and every ablation)


def natsl_command(*args: str) -> list[str]:
    """argv of a natsl subcommand run by this Python (the installed `natsl` script may be another's)."""
    return [sys.executable, "-m", "natsl.cli.main", *map(str, args)]


def split_seed(name: str) -> tuple[str, int]:
    """(system, seed) of a checkpoint name: SYSTEM_sN names seed N > 0 of a ladder system (the train stage's
    runs over --seeds, e.g. natsl_hybrid_s1); any other name is seed 0 of itself."""
    base, sep, digits = name.rpartition("_s")
    if sep and base in LADDER and digits.isdigit() and digits == str(int(digits)) and int(digits) > 0:
        return base, int(digits)
    return name, 0


def is_known(name: str) -> bool:
    """Whether the evaluation stage evaluates this checkpoint name: a ladder system, one's seed, an ablation."""
    return split_seed(name)[0] in LADDER or name in ABLATIONS


def is_routed(name: str) -> bool:
    """Whether the checkpoint has NAtS-L layers (a router to inspect)."""
    return split_seed(name)[0] in ROUTED_SYSTEMS or name in ABLATIONS


def is_seed(name: str) -> bool:
    """Whether the name is an extra seed (N > 0) of a ladder system."""
    return split_seed(name)[1] > 0


def seeds_of(system: str, names) -> list[str]:
    """The names among `names` that are `system` or one of its seeds, seed 0 first."""
    return sorted((n for n in names if split_seed(n)[0] == system), key=lambda n: split_seed(n)[1])


def ordered(names) -> list[str]:
    """The ladder first, each system followed by its seeds, then the ablations, then any other name."""
    known = [*LADDER, *ABLATIONS]

    def key(name: str):
        system, seed = split_seed(name)
        return (known.index(system) if system in known else len(known), system, seed)
    return sorted(set(names), key=key)
