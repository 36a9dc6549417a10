"""natsl.provenance.source_hash names the package's sources: stable, and moved by any change."""

import shutil
from pathlib import Path

import pytest

import natsl
from natsl.provenance import provenance, source_hash

PACKAGE = Path(natsl.__file__).resolve().parent


def test_source_hash_is_stable_and_follows_every_source_change(tmp_path):
    copy = tmp_path / "natsl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = source_hash(copy)
    assert base == source_hash(PACKAGE) == source_hash(copy) and len(base) == 16
    module = copy / "fast" / "short_conv.py"
    module.write_text(module.read_text() + "\n# a comment\n")
    edited = source_hash(copy)
    assert edited != base
    module.rename(copy / "fast" / "short_conv2.py")  # same bytes, another name
    assert source_hash(copy) not in (base, edited)


def test_provenance_records_the_source_hash():
    assert provenance()["source_sha256"] == source_hash()


def test_every_environment_variable_natsl_reads_is_recorded_or_named_harmless(monkeypatch):
    """A result records the switches it ran under: every NATSL_ variable in the package's sources is a
    speed switch of natsl/switches.py (all recorded), in ENVIRONMENT (recorded where set) or in
    NOT_SWITCHES (paths, the crash-test hook)."""
    import re

    from natsl import switches
    from natsl.provenance import ENVIRONMENT, NOT_SWITCHES

    variables = {f.metadata["env"] for f in switches.FIELDS.values()} - {None}
    names = {m for f in PACKAGE.rglob("*.py") for m in re.findall(r"\bNATSL_[A-Z_]+\b", f.read_text())}
    names -= {"NATSL_TOKENS_FORMAT"}  # a constant's name (natsl.eval.data), not a variable
    known = variables | set(ENVIRONMENT) | set(NOT_SWITCHES)
    assert names and names <= known, sorted(names - known)
    with switches.override(short_conv_backward="two_pass", fused_loss=False):
        recorded = provenance()["switches"]
    assert recorded.keys() == switches.FIELDS.keys()
    assert recorded["short_conv_backward"] == "two_pass" and recorded["fused_loss"] is False
    monkeypatch.setenv("NATSL_BACKEND", "chunked")
    assert provenance()["environment"]["NATSL_BACKEND"] == "chunked"


def test_switches_read_the_environment_once_and_override_stacks(monkeypatch):
    from natsl import switches
    from natsl.errors import NatslError

    env = {"NATSL_FUSED_LOSS": "0", "NATSL_FOLD_CLIP": "1", "NATSL_COMPILE_POINTWISE": "all",
           "NATSL_CONCAT_LINEARS": "all"}
    read = switches.from_environ(env)
    assert (read.fused_loss, read.fold_clip, read.compile_pointwise, read.concat_linears) == (False, True, "all", "all")
    assert switches.from_environ({}) == switches.Switches()  # unset variables keep the defaults
    assert switches.from_environ({"NATSL_FUSED_MIX": "anything"}).fused_mix  # only "0" turns a switch off
    for variable, value in (("NATSL_FOLD_CLIP", "yes"), ("NATSL_COMPILE_POINTWISE", "2"),
                            ("NATSL_SHORT_CONV_BACKWARD", "fastest")):
        with pytest.raises(NatslError, match=f"{variable}='{value}' is not"):
            switches.from_environ({variable: value})
    before = switches.current()
    monkeypatch.setenv("NATSL_FUSED_LOSS", "0")
    assert switches.current() is before  # read once: a later change of the variable is not seen
    with switches.override(fused_loss=False) as outer:
        assert switches.current() is outer and not outer.fused_loss
        with switches.override(decode_pdl=False):
            assert not switches.current().fused_loss and not switches.current().decode_pdl
        assert switches.current().decode_pdl == before.decode_pdl
    assert switches.current() is before
    with pytest.raises(NatslError, match="no speed switch 'fused_los'"):
        with switches.override(fused_los=False):
            pass
    with pytest.raises(NatslError, match="fused_loss='no' is not one of True, False: see"):
        with switches.override(fused_loss="no"):
            pass
