"""The embedded corpus behind `data.path: builtin`: text that ships with Python, for smoke runs only.

It is the source code (docstrings and comments included) of the Python standard library that
runs natsl: the `.py` files under `sysconfig.get_paths()["stdlib"]` in sorted order, leaving out
test suites, `encodings` tables and files over 300 kB, up to about 4 MB of text (roughly 1.5M
tokens with a 1024-token BPE), headed by the Zen of Python (decoded from `this.py`). Nothing is
downloaded. If the interpreter ships no sources, generated arithmetic sentences stand in.
It is code-heavy English of a single origin: good enough to see a loss fall and to test the
machinery, useless for judging a model.

The first use tokenizes it into a cache folder (`$NATSL_CACHE_DIR`, else `~/.cache/natsl`) with
a BPE tokenizer trained on it at the model's vocabulary size; later uses read the cache.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import hashlib
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

from natsl.data.sources import MemorySource
from natsl.data.tokenize import META, TokenizeSettings, tokenize_corpus
from natsl.errors import NatslError

CORPUS_VERSION = 1
MAX_BYTES = 4_000_000
MAX_FILE_BYTES = 300_000
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "__pycache__"}
VAL_FRACTION = 0.05


def zen_of_python(stdlib: Path) -> str | None:
    """The Zen of Python, decoded from the rot13 string in `this.py` (importing `this` would print it)."""
    try:
        tree = ast.parse((stdlib / "this.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and len(node.value.value) > 200):
            return codecs.decode(node.value.value, "rot_13")
    return None


def generated_documents(n_docs: int = 2000, seed: int = 0) -> list[str]:
    """Stand-in text when no stdlib sources exist: short arithmetic stories with a fixed seed."""
    rng = random.Random(seed)
    names = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken"]
    things = ["apples", "books", "stones", "coins", "letters", "shells", "keys", "cards"]
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(3, 12)):
            who, what = rng.choice(names), rng.choice(things)
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            if rng.random() < 0.5:
                lines.append(f"{who} has {a} {what} and finds {b} more, so {who} has {a + b} {what}.")
            else:
                lines.append(f"{who} had {a + b} {what} and gave away {b}, leaving {a}.")
        docs.append(" ".join(lines))
    return docs


def builtin_documents() -> tuple[list[str], dict]:
    """(documents, description) of the embedded corpus on this interpreter."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    zen = zen_of_python(stdlib)
    if zen:
        docs.append(zen)
    total = 0
    files = sorted((p for p in stdlib.rglob("*.py") if not (set(p.relative_to(stdlib).parts[:-1]) & SKIP_DIRS)),
                   key=lambda p: p.relative_to(stdlib).as_posix()) if stdlib.is_dir() else []
    for path in files:
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        docs.append(text)
        total += len(text)
        if total >= MAX_BYTES:
            break
    what = "Python standard library source"
    if total < 200_000:
        docs.extend(generated_documents())
        what = "generated arithmetic sentences (no standard library sources found)"
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(hashlib.sha256(doc.encode("utf-8")).digest())
    info = {"name": "builtin", "corpus_version": CORPUS_VERSION, "what": what,
            "python": sys.version.split()[0], "documents": len(docs), "sha256": digest.hexdigest(),
            "note": "embedded smoke-test corpus: only for quick starts and tests"}
    return docs, info


def cache_root() -> Path:
    if os.environ.get("NATSL_CACHE_DIR"):
        return Path(os.environ["NATSL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "natsl"


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock (two processes building the same cache wait for each other)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def builtin_data(vocab_size: int, tokenizer: str | None = None, progress: bool = True, log=print,
                 bos: bool = True) -> Path:
    """The cached, tokenized embedded corpus for a model of `vocab_size` (built on first use)."""
    if tokenizer is None and vocab_size < 258:  # the BPE needs 256 bytes + EOS + 1
        raise NatslError(f"recipe key 'model.vocab_size' = {vocab_size} is too small for the embedded corpus's "
                         "BPE tokenizer; use at least 258")
    docs, info = builtin_documents()
    key_data = {"corpus": info["sha256"], "vocab_size": vocab_size, "val_fraction": VAL_FRACTION}
    if tokenizer is not None:
        from natsl.tokenizer import Tokenizer

        key_data["tokenizer"] = Tokenizer.from_file(tokenizer).sha256()
        if not bos:
            key_data["bos"] = False
    key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    folder = cache_root() / f"builtin-v{CORPUS_VERSION}-vocab{vocab_size}-{key}"
    if (folder / META).is_file():
        return folder
    with file_lock(folder.with_name(folder.name + ".lock")):
        if (folder / META).is_file():
            return folder
        log(f"building the embedded corpus ({info['what']}, {len(docs)} documents, smoke runs only) in {folder}")
        settings = TokenizeSettings(tokenizer=tokenizer, train_tokenizer=tokenizer is None, vocab_size=vocab_size,
                                    val_fraction=VAL_FRACTION, commit_tokens=1 << 22, bos=bos)
        tokenize_corpus(MemorySource(docs, info), folder, settings, progress=progress, log=log)
    return folder
