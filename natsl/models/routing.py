"""A router override for measurements: keep a chosen fraction of blocks, at random but reproducibly.

An untrained router keeps all or nothing depending on its random weights, which says nothing about
the cost of a trained model. `force_keep_fraction(model, 0.5, seed)` makes every NAtS-L layer's
incremental path (prefill and decode) keep each (block, routing group) with probability 0.5, by a
hash of (seed, layer, block index, group): the same block gets the same route whether it is
prefilled or decoded, and the hash is plain integer tensor arithmetic, so it runs inside a CUDA
graph. The full-sequence forward applies the same rule to all its blocks (`NAtSL.route`), so a forced
budget gives the same outputs on either path (evaluations by full forward, such as eval-ppl and
eval-recall, and those that decode, such as eval-ruler); it carries no gradient, so never train with it.
"""

from __future__ import annotations

from natsl.reference.router import KeepFraction, keep_hash  # noqa: F401  (the override and its rule)


def force_keep_fraction(model, fraction: float | None, seed: int = 0) -> None:
    """Make every NAtS-L layer of `model` keep `fraction` of its blocks (None restores the router)."""
    for index, layer in model.natsl_layers().items():
        layer.route_override = None if fraction is None else KeepFraction(fraction, seed * 1000 + index)
