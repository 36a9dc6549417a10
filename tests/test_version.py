"""natsl's version moves with every change: it is the date of CHANGELOG.md's newest heading and the
number of entries under it (docs/development.md, "Versions"), so that two natsl builds that differ
never call themselves the same (an HF export records the version that wrote it)."""

import re
from pathlib import Path

import pytest

import natsl

ROOT = Path(__file__).resolve().parent.parent


def changelog_version(text: str) -> str:
    """YEAR.MONTH.DAY.N of the newest `## YYYY-MM-DD` heading and its N entries (`- ` lines)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## "))
    year, month, day = re.fullmatch(r"## (\d{4})-(\d{2})-(\d{2})", lines[start].strip()).groups()
    entries = 0
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        entries += line.startswith("- ")
    return f"{int(year)}.{int(month)}.{int(day)}.{entries}"


def test_changelog_version_counts_the_newest_section():
    text = "# Changelog\n\n## 2026-12-07\n- b\n- a\n  more of a\n\n## 2026-12-06\n- c\n"
    assert changelog_version(text) == "2026.12.7.2"


def test_the_version_is_the_changelogs_newest_date_and_entry_count():
    expected = changelog_version((ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    assert natsl.__version__ == expected, (
        f"natsl.__version__ is {natsl.__version__!r}; CHANGELOG.md's newest section makes it {expected!r}: "
        "set it in natsl/__init__.py")


def test_the_package_version_is_read_from_natsl():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "natsl.__version__"}
