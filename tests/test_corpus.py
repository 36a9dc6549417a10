"""`natsl tokenize` on a corpus of local files: glob inputs, --include, .gz documents, --skip-bad-files,
--dedup, the mix in meta.json, held-out texts per input (--val-texts), determinism and resuming a killed run."""

import gzip
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import natsl.data.tokenize as T
from natsl.cli.main import app
from natsl.data import TokenData
from natsl.data.dedup import SeenDocuments
from natsl.data.local_files import FileSource, expand_inputs
from natsl.data.sources import open_source
from natsl.errors import NatslError

from cli_checks import assert_one_line_error, kill_after_commit

CODE = [f"def f{i}(x):\n    return x * {i} + {i ** 2}  # step {i}\n" for i in range(12)]
PROSE = [f"Paragraph {i}: the package installs its files under /usr and reads them at start {i}.\n"
         for i in range(8)]
SHARED = "# installed twice\nVALUE = 1\n"
MAN = ".TH LS 1\n.SH NAME\nls \\- list directory contents\n.SH DESCRIPTION\nList information about files.\n"


def quiet(*_):
    pass


def make_tree(root: Path) -> dict:
    """Two sources in the shape of an installed system: Python code in two site-packages (one file installed in
    both), and documentation with a gzip-compressed man page. Returns the texts each source holds, in reading order."""
    for version in ("python3.10", "python3.11"):
        pkg = root / "lib" / version / "site-packages" / "pkg"
        pkg.mkdir(parents=True)
        (pkg / "shared.py").write_text(SHARED)
    pkg = root / "lib" / "python3.11" / "site-packages" / "pkg"
    for i, text in enumerate(CODE):
        (pkg / f"m{i:02d}.py").write_text(text)
    (pkg / "notes.bin").write_bytes(b"\x00\x01binary")  # not --include'd: never read
    (pkg / ".cache").mkdir()
    (pkg / ".cache" / "hidden.py").write_text("never read")
    doc = root / "share" / "doc" / "tool"
    doc.mkdir(parents=True)
    for i, text in enumerate(PROSE):
        (doc / f"README{i}.md").write_text(text)
    man = root / "share" / "man" / "man1"
    man.mkdir(parents=True)
    with gzip.open(man / "ls.1.gz", "wb") as fh:
        fh.write(MAN.encode())
    return {"code": [SHARED] + CODE + [SHARED], "prose": PROSE + [MAN]}


def inputs(root: Path) -> list[str]:
    return [f"{root}/lib/python3*/site-packages", f"{root}/share"]


INCLUDE = ["*.py", "*.md", "*.gz"]


def settings(**kw):
    base = dict(train_tokenizer=True, vocab_size=300, val_fraction=0.2, shard_tokens=64)
    base.update(kw)
    return T.TokenizeSettings(**base)


def documents_of(folder: Path, split: str) -> list[str]:
    data = TokenData(folder)
    stream = data.split(split)
    ids = stream.read(0, stream.n_tokens) if stream.n_tokens else np.zeros(0, dtype=np.int64)
    tok = data.tokenizer()
    docs, start = [], 0
    for cut in np.flatnonzero(ids == data.eos_id):
        docs.append(tok.decode(ids[start:cut].tolist()))
        start = cut + 1
    return docs


# -- which files count ------------------------------------------------------------------------------------

def test_globs_and_include_choose_the_files(tmp_path):
    make_tree(tmp_path)
    files = [p.relative_to(tmp_path).as_posix() for _, p in expand_inputs(inputs(tmp_path), INCLUDE)]
    assert files == (["lib/python3.10/site-packages/pkg/shared.py", "lib/python3.11/site-packages/pkg/m00.py"]
                     + [f"lib/python3.11/site-packages/pkg/m{i:02d}.py" for i in range(1, 12)]
                     + ["lib/python3.11/site-packages/pkg/shared.py"]
                     + [f"share/doc/tool/README{i}.md" for i in range(8)] + ["share/man/man1/ls.1.gz"])
    # a pattern naming files takes them whatever their suffix; one matching nothing is refused
    md = [p.name for _, p in expand_inputs([f"{tmp_path}/share/**/*.md"])]
    assert md == [f"README{i}.md" for i in range(8)]
    # `**` names folders and the files in them: each file is read once, if --include chooses it
    every = [p.relative_to(tmp_path).as_posix() for _, p in expand_inputs([f"{tmp_path}/share/**"], ["*.md"])]
    assert every == [f"share/doc/tool/README{i}.md" for i in range(8)]
    every = [p.relative_to(tmp_path).as_posix() for _, p in expand_inputs([f"{tmp_path}/share/**"])]
    assert every == [f"share/doc/tool/README{i}.md" for i in range(8)] + ["share/man/man1/ls.1.gz"]
    # a file whose name looks like a pattern is itself
    (tmp_path / "[draft].txt").write_text("draft")
    assert [p.name for _, p in expand_inputs([str(tmp_path / "[draft].txt")])] == ["[draft].txt"]
    with pytest.raises(NatslError, match="nowhere.*no file that counts"):
        expand_inputs([f"{tmp_path}/nowhere*/x"])
    with pytest.raises(NatslError, match="does not exist"):
        expand_inputs([f"{tmp_path}/share", f"{tmp_path}/nowhere"])
    # without --include a folder offers .txt/.jsonl/.parquet only
    with pytest.raises(NatslError, match="no file that counts.*--include"):
        expand_inputs([str(tmp_path / "share")])
    with pytest.raises(NatslError, match="not a file-name pattern"):
        expand_inputs([str(tmp_path)], ["pkg/*.py"])


def test_a_bare_glob_pattern_is_read_as_local_files(tmp_path, monkeypatch):
    """`**/*.md` has no `/` in front and one in all: still local files, never a Hugging Face dataset name."""
    make_tree(tmp_path)
    monkeypatch.chdir(tmp_path / "share")
    source = open_source(["**/*.md"])
    assert isinstance(source, FileSource) and [p.name for p in source.files] == [f"README{i}.md" for i in range(8)]


def test_an_input_without_files_is_a_warning_when_others_have_some(tmp_path):
    """One command for many hosts: a pattern matching nothing there (no CUDA headers, say) is named, not fatal."""
    make_tree(tmp_path / "in")
    lines = []
    meta = T.tokenize_corpus(FileSource([*inputs(tmp_path / "in"), f"{tmp_path}/cuda*/include"], include=INCLUDE),
                             tmp_path / "out", settings(), progress=False, log=lines.append)
    (warning,) = [line for line in lines if line.startswith("warning: ")]
    assert "cuda*/include' gives no file" in warning
    assert meta["mix"]["by_input"][f"{tmp_path}/cuda*/include"]["train"]["documents"] == 0
    assert meta["documents"] == len(CODE) + 2 + len(PROSE) + 1


def test_a_gz_file_is_one_decompressed_document_and_a_bomb_is_refused(tmp_path):
    texts = make_tree(tmp_path)
    man = tmp_path / "share" / "man"
    assert [t for t, _, _ in FileSource([str(man)], include=["*.gz"]).documents()] == [texts["prose"][-1]]
    bomb = man / "man1" / "bomb.1.gz"
    with gzip.open(bomb, "wb") as fh:
        fh.write(b"a" * 8001)  # 8x --max-file-bytes 1000 is 8000
    with pytest.raises(NatslError, match="bomb.1.gz' decompresses to more than 8x --max-file-bytes = 8,000 bytes"):
        list(FileSource([str(bomb)], max_file_bytes=1000).documents())
    source = FileSource([str(man)], include=["*.gz"], max_file_bytes=1000, skip_bad_files=True)
    assert [t for t, _, _ in source.documents() if t] == [texts["prose"][-1]]
    assert source.skipped["reasons"] == {"too-large": 1}


# -- the corpus: mix, dedup, split by document, determinism ------------------------------------------------

def test_the_mix_dedup_and_split_by_document(tmp_path):
    texts = make_tree(tmp_path / "in")
    crlf = PROSE[1].replace("\n", "\r\n")
    (tmp_path / "in" / "share" / "doc" / "tool" / "README1-crlf.md").write_bytes(crlf.encode())  # read before README1
    run = dict(include=INCLUDE, skip_bad_files=True)
    code, share = inputs(tmp_path / "in")
    meta = T.tokenize_corpus(FileSource([code, share], **run), tmp_path / "out", settings(dedup=True),
                             progress=False, log=quiet)
    mix = meta["mix"]
    # the file installed in both site-packages counts once, and so does the text saved with CRLF line endings
    assert mix["by_input"][code]["duplicates"] == 1 and mix["by_input"][share]["duplicates"] == 1
    assert mix["by_include"]["*.py"]["duplicates"] == 1 and mix["total"]["duplicates"] == 2
    kept = texts["code"][:-1] + [PROSE[0], crlf] + PROSE[2:] + [MAN]
    assert meta["documents"] == len(kept)
    train, val = documents_of(tmp_path / "out", "train"), documents_of(tmp_path / "out", "validation")
    held_out = [T.is_validation(i, Fraction(1, 5)) for i in range(len(kept))]
    assert val == [d for d, v in zip(kept, held_out) if v] and train == [d for d, v in zip(kept, held_out) if not v]
    assert not set(train) & set(val)  # one file, one document, in one split
    # the mix sums to the splits, per input and per --include pattern, and counts the text's bytes
    for view in ("by_input", "by_include"):
        for split in ("train", "validation"):
            for key in ("documents", "tokens"):
                assert sum(e[split][key] for e in mix[view].values()) == meta["splits"][split][key]
    assert set(mix["by_include"]) == {"*.py", "*.md", "*.gz"}
    assert mix["by_include"]["*.gz"]["train"]["bytes"] + mix["by_include"]["*.gz"]["validation"]["bytes"] == len(MAN)
    by_code = mix["by_input"][code]
    assert by_code["train"]["bytes"] + by_code["validation"]["bytes"] == sum(len(t.encode()) for t in texts["code"][:-1])
    assert meta["source"]["file_count"] == 24 and "files" not in meta["source"]
    # without --dedup every copy is kept
    meta = T.tokenize_corpus(FileSource([code, share], **run), tmp_path / "all", settings(), progress=False, log=quiet)
    assert meta["documents"] == len(kept) + 2 and meta["mix"]["total"]["duplicates"] == 0


def test_two_runs_write_the_same_bytes(tmp_path):
    make_tree(tmp_path / "in")
    metas = []
    for name in ("a", "b"):
        metas.append(T.tokenize_corpus(FileSource(inputs(tmp_path / "in"), include=INCLUDE), tmp_path / name,
                                       settings(dedup=True, val_texts=True), progress=False, log=quiet))
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for rel in files:
        if rel.name != "meta.json":
            assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert {k: v for k, v in metas[0].items() if k != "created"} == {k: v for k, v in metas[1].items() if k != "created"}


def test_held_out_texts_per_input(tmp_path):
    """--val-texts: each input's held-out documents, as .jsonl that inspect-routing reads, and none trained on."""
    from natsl.eval.data import read_text_documents

    make_tree(tmp_path / "in")
    meta = T.tokenize_corpus(FileSource(inputs(tmp_path / "in"), include=INCLUDE), tmp_path / "out",
                             settings(dedup=True, val_texts=True), progress=False, log=quiet)
    assert meta["validation_texts"] == ["validation_texts/00_site-packages.jsonl", "validation_texts/01_share.jsonl"]
    code, prose = (read_text_documents(tmp_path / "out" / name) for name in meta["validation_texts"])
    assert sorted(code + prose) == sorted(documents_of(tmp_path / "out", "validation"))
    assert all(text.startswith(("def ", "# installed")) for text in code) and code
    assert all(not text.startswith("def ") for text in prose) and prose
    assert len(code) == meta["mix"]["by_input"][inputs(tmp_path / "in")[0]]["validation"]["documents"]


# -- resuming ----------------------------------------------------------------------------------------------

def test_a_killed_run_resumes_to_the_same_corpus(tmp_path, monkeypatch):
    make_tree(tmp_path / "in")
    (tmp_path / "in" / "share" / "doc" / "tool" / "latin1.md").write_bytes("caf\xe9\n".encode("latin-1"))
    src = lambda: FileSource(inputs(tmp_path / "in"), include=INCLUDE, skip_bad_files=True)  # noqa: E731
    small = settings(dedup=True, val_texts=True, batch_docs=2, commit_tokens=1)
    clean = T.tokenize_corpus(src(), tmp_path / "clean", small, progress=False, log=quiet)

    with pytest.raises(kill_after_commit(monkeypatch, T, 4)):
        T.tokenize_corpus(src(), tmp_path / "part", small, progress=False, log=quiet)
    monkeypatch.undo()
    text_file = tmp_path / "part" / "validation_texts" / "01_share.jsonl"
    with open(text_file, "a") as fh:  # a half-written append after the last commit is cut off
        fh.write('{"text": "half')
    lines = []
    resumed = T.tokenize_corpus(src(), tmp_path / "part", small, progress=False, log=lines.append)
    assert any("resuming the interrupted run" in line for line in lines)
    for key in ("mix", "skipped", "splits", "documents", "total_tokens"):
        assert resumed[key] == clean[key], key
    assert clean["mix"]["total"]["duplicates"] == 1 and clean["skipped"]["reasons"] == {"not-utf8": 1}
    for path in sorted((tmp_path / "clean").rglob("*")):
        if path.is_file() and path.name != "meta.json":
            assert (tmp_path / "part" / path.relative_to(tmp_path / "clean")).read_bytes() == path.read_bytes()


# -- the command -------------------------------------------------------------------------------------------

def test_the_command_prints_the_token_count_and_the_mix(tmp_path):
    make_tree(tmp_path / "in")
    (tmp_path / "in" / "share" / "doc" / "tool" / "blob.md").write_bytes(b"\x00" * 10)
    args = ["tokenize", *inputs(tmp_path / "in"), "--out", str(tmp_path / "out"), "--train-tokenizer",
            "--vocab-size", "300", "--val-fraction", "0.2", "--dedup", "--skip-bad-files", "--val-texts",
            "--no-progress", *[x for pattern in INCLUDE for x in ("--include", pattern)]]
    result = CliRunner().invoke(app, args, env={"NATSL_FAULT": None})
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert f"into {meta['total_tokens']:,} tokens" in last
    total = meta["total_tokens"]
    shares = [f"{name} {100 * (e['train']['tokens'] + e['validation']['tokens']) / total:.1f}%"
              for name, e in meta["mix"]["by_input"].items()]
    assert f"by input: {', '.join(shares)};" in last
    assert "by --include: *.py" in last and "1 duplicate(s) dropped" in last
    assert "1 bad file(s) skipped (binary 1)" in last
    assert meta["skipped"]["examples"]["binary"][0].endswith("blob.md")
    # bad --include patterns are one line, before any work
    result = CliRunner().invoke(app, args[:-6] + ["--include", "pkg/*.py"], env={"NATSL_FAULT": None})
    assert_one_line_error(result, "--include 'pkg/*.py'", "file-name pattern")


def test_batch_encoding_gives_the_ids_of_one_by_one_encoding():
    from natsl.tokenizer import train_bpe

    texts = CODE + PROSE + [MAN, ""]
    tok = train_bpe(texts, 300)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_the_duplicate_record_stays_small():
    seen = SeenDocuments(buffer=64)
    texts = [f"document {i}" for i in range(1000)]
    assert all(seen.add(t) for t in texts)
    assert not any(seen.add(t) for t in texts[::7]) and not seen.add("  document 3\r\n")
    assert len(seen) == 1000 and len(seen.recent) < 64
    assert sum(run.nbytes for run in seen.runs) == 8 * (1000 - len(seen.recent))
