"""Every repository path and natsl module the docs name exists.

The README, docs/**/*.md and the comments of the shipped recipes name files (`natsl/ops/fused.py`,
`docs/kernels/mix.md`, `models/lm.py` relative to the package), folders and dotted module paths
(`natsl.ops.fused.gla_decode_step`). A rename that forgets a document leaves it pointing at nothing;
this test finds such a path and says where it is written.
"""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "natsl"

# Top-level folders of the checkout that documents name paths under.
REPO_ROOTS = ("natsl", "docs", "tests", "benchmarks", "recipes", ".ci")
# Folders a document names as places where commands write (run folders, corpora, results): not in git.
OUTPUT_ROOTS = ("runs", "data", "bench_results", "OUT", "out", "tmp")
# Names written as someone else's file, not natsl's (a user's own folder).
FOREIGN_NAMES = {"sitecustomize.py"}
FILE_SUFFIXES = {"py", "md", "yaml", "json", "sh", "toml", "txt", "png"}

# A path-like token: letters, digits, `_`, `-`, `.`, `/` and `*` (a glob), not starting inside another
# word or path (so `runs/x/natsl/y.py` is one token, not `natsl/y.py`).
TOKEN = re.compile(r"(?<![\w./*$~-])[\w.*-]+(?:/[\w.*-]*)+|(?<![\w./*$~-])[\w-]+\.(?:py|md|yaml|sh|toml)\b")
DOTTED = re.compile(r"(?<![\w./-])natsl(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(docs) > 5, "no documents found"
    return docs


def recipe_comments() -> list[tuple[Path, str]]:
    """The comment text of every shipped recipe (what follows a `#`)."""
    out = []
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        lines = [line.split("#", 1)[1] for line in path.read_text(encoding="utf-8").splitlines() if "#" in line]
        out.append((path, "\n".join(lines)))
    return out


def texts() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in documents()] + recipe_comments()


def is_placeholder(token: str) -> bool:
    """`runs/ID/model`, `OUT/latency.json`, `path/to/x`, `natsl.fast.<op>`, `recipes/...`: not a real path."""
    if "..." in token or "<" in token or "path/to" in token:
        return True
    return any(part.isupper() and len(part) > 1 for part in re.split(r"[/._-]", token))


def exists(path: str) -> bool:
    """A path (maybe a glob) relative to the checkout names at least one file or folder."""
    path = path.rstrip("/")
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


# Every file of the package and the checkout, for a path written relative to a folder of natsl
# (`models/lm.py`, `gated_delta/grad_qk.py`) or a bare file name (`kernel_set.py`).
def tracked_files() -> list[str]:
    files = []
    for root in REPO_ROOTS:
        base = ROOT / root
        if base.exists():
            files += [p.relative_to(ROOT).as_posix() for p in base.rglob("*") if "__pycache__" not in p.parts]
    return files


FILES = tracked_files()
PACKAGE_DIRS = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}


def missing_path(token: str) -> bool:
    """True when `token` reads as a path of this checkout that does not exist."""
    token = token.rstrip(".,;:")
    if not token or is_placeholder(token) or token.startswith(("http", "www.", "github.com")):
        return False
    parts = token.split("/")
    first = parts[0]
    if first in OUTPUT_ROOTS or first in ("", ".", "~") or token.startswith("./"):
        return False
    if first in REPO_ROOTS:
        if first == "natsl" and len(parts) > 1 and parts[1] == "recipes":
            # the wheel's copy of the top-level recipes/ (setup.py's build step)
            return not exists("recipes/" + "/".join(parts[2:]))
        return not exists(token)
    if "/" not in token:
        # a bare module name: some file of the checkout has it (its folder is said around it); a bare
        # `.md`, `.yaml` or `.json` name is most often a file a command writes (`compare.md`, `recipe.yaml`)
        if token in FOREIGN_NAMES or not token.endswith(".py") or "*" in token:
            return False
        return not any(f == token or f.endswith("/" + token) for f in FILES) and not (ROOT / token).exists()
    # relative to a folder of the package (`models/lm.py`, `fast/gated_delta/`): only code files and
    # folders under a folder name that natsl has; another project's path (`fla/ops/...`) is not ours.
    if first not in PACKAGE_DIRS or not (token.endswith(".py") or token.endswith("/")):
        return False
    if "*" in token:
        return not any(PACKAGE.rglob(token.rstrip("/")))
    stem = token.rstrip("/")
    return not any(f.endswith("/" + stem) for f in FILES)


def dotted_exists(name: str) -> bool:
    """`natsl.a.b.c`: the longest importable module prefix, then attributes for the rest."""
    parts = name.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and not err.name.startswith("natsl"):
                return True  # an optional dependency is missing here: cannot tell, do not fail
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                # a submodule not imported by its package is still a module
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                except (ModuleNotFoundError, AttributeError):
                    return False
            else:
                obj = getattr(obj, attr)
        return True
    return False


def where(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def test_the_scanner_sees_stale_paths():
    """The checks themselves: a removed module, a moved doc and a missing attribute are caught; placeholders,
    output folders and other projects' paths are not."""
    assert missing_path("natsl/ops.py") and missing_path("inference/overlap.py") and missing_path("docs/nothing.md")
    assert missing_path("natsl/fast/*/nothing.py") and missing_path("no_such_module_anywhere.py")
    for fine in ("natsl/ops/fused.py", "models/lm.py", "fast/gated_delta/", "docs/kernels/*.md", "kernel_set.py",
                 "runs/ID/result.json", "OUT/latency.json", "data/mini/tokenizer.json", "fla/ops/moba/parallel.py",
                 "path/to/tokenizer.json", "natsl/recipes/recall/sweep_h200.yaml", "recipes/...", "natsl/"):
        assert not missing_path(fine), fine
    assert dotted_exists("natsl.ops.fused.gla_decode_step") and dotted_exists("natsl.inference.decode")
    assert not dotted_exists("natsl.ops.no_such_function") and not dotted_exists("natsl.no_such_module")


def test_every_path_the_docs_name_exists():
    stale, checked = [], 0
    for path, text in texts():
        for match in TOKEN.finditer(text):
            checked += match.group(0).split("/")[0] in REPO_ROOTS
            if missing_path(match.group(0)):
                stale.append(f"{path.relative_to(ROOT)}:{where(text, match.start())}: {match.group(0)}")
    assert checked > 200, f"only {checked} repository paths found in the docs: is the pattern broken?"
    assert not stale, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(stale)))


@pytest.mark.filterwarnings("ignore")
def test_every_module_path_the_docs_name_exists():
    stale, checked = [], 0
    for path, text in texts():
        for match in DOTTED.finditer(text):
            checked += 1
            name = match.group(0).rstrip(".")
            if name.rsplit(".", 1)[1] in FILE_SUFFIXES or text[match.end() : match.end() + 1] in ("*", "<"):
                continue  # `natsl.yaml`: a file name, checked as a path; `natsl.cli.jobs.check_*`: a pattern
            if not dotted_exists(name):
                stale.append(f"{path.relative_to(ROOT)}:{where(text, match.start())}: {name}")
    assert checked > 100, f"only {checked} natsl names found in the docs: is the pattern broken?"
    assert not stale, "natsl names in the docs that do not import:\n" + "\n".join(sorted(set(stale)))
