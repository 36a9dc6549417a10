"""natsl.provenance.source_hash names the package's sources: stable, and moved by any change."""

import shutil
from pathlib import Path

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
    """A result records the switches it ran under: every NATSL_ variable in the package's sources is
    in SWITCHES (recorded) or NOT_SWITCHES (paths, the crash-test hook); a set one shows up."""
    import re

    from natsl.provenance import NOT_SWITCHES, SWITCHES

    names = {m for f in PACKAGE.rglob("*.py") for m in re.findall(r"\bNATSL_[A-Z_]+\b", f.read_text())}
    names -= {"NATSL_TOKENS_FORMAT"}  # a constant's name (natsl.eval.data), not a variable
    assert names and names <= set(SWITCHES) | set(NOT_SWITCHES), sorted(names - set(SWITCHES) - set(NOT_SWITCHES))
    monkeypatch.setenv("NATSL_SHORT_CONV_BACKWARD", "two_pass")
    assert provenance()["switches"]["NATSL_SHORT_CONV_BACKWARD"] == "two_pass"
