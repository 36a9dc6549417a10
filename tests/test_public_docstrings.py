"""The public API (docs/spec.md section 5) documents every argument, what it returns, and the ops' shapes."""

import inspect
import re

import pytest

import natsl
import natsl.ops

OPS = ["gated_delta_rule", "gated_linear_rule", "routed_attention"]
TOP = [name for name in natsl.__all__ if name != "__version__" and inspect.isfunction(getattr(natsl, name))]


def sections(doc: str) -> dict[str, str]:
    """A Google-style docstring's sections: `Args:` and `Returns:` -> their indented text."""
    found, current = {}, None
    for line in doc.splitlines():
        header = re.fullmatch(r"(Args|Returns):", line.strip())
        if header and not line.startswith((" ", "\t")):
            current = header.group(1)
            found[current] = ""
        elif current and (line.startswith((" ", "\t")) or not line.strip()):
            found[current] += line + "\n"
        else:
            current = None
    return found


def check(fn) -> None:
    doc = inspect.getdoc(fn) or ""
    parts = sections(doc)
    assert {"Args", "Returns"} <= parts.keys(), f"{fn.__qualname__}: no Args: / Returns: section"
    assert parts["Returns"].strip(), f"{fn.__qualname__}: Returns: says nothing"
    for name in inspect.signature(fn).parameters:
        assert re.search(rf"^\s+{name}:", parts["Args"], re.M), f"{fn.__qualname__}: argument {name!r} undocumented"


def test_the_public_names_are_all_checked():
    assert set(TOP) == {"load_recipe", "build_model", "load_checkpoint"}
    assert all(hasattr(natsl.ops, op) for op in OPS)


@pytest.mark.parametrize("name", TOP)
def test_public_functions_document_args_and_returns(name):
    check(getattr(natsl, name))


@pytest.mark.parametrize("name", OPS)
def test_public_ops_document_args_returns_and_shapes(name):
    fn = getattr(natsl.ops, name)
    check(fn)
    parts = sections(inspect.getdoc(fn))
    # every tensor argument and the output carry a shape, as flash-linear-attention's ops do
    for arg in ("q", "k", "v"):
        line = re.search(rf"^\s+{arg}:.*$", parts["Args"], re.M).group(0)
        assert re.search(r"`\[B, T, \w+, \w+\]`", line), f"{name}: {arg} has no shape: {line.strip()}"
    assert re.search(r"`\[B, T, \w+, \w+\]`", parts["Returns"]), f"{name}: the output has no shape"


def test_the_checker_refuses_a_bare_docstring():
    def bare(x, y=1):
        """Does something with x."""

    def partial(x, y=1):
        """Does something.

        Args:
            x: the input.

        Returns:
            The result.
        """

    for fn in (bare, partial):
        with pytest.raises(AssertionError):
            check(fn)
