"""`natsl tokenize`: shards round-trip to the text, EOS between documents, the split, idempotence,
resuming a killed run, and one-line errors for bad input."""

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import natsl.data.tokenize as T
from natsl.data import TokenData
from natsl.data.sources import FileSource, open_source
from natsl.errors import NatslError

from cli_checks import kill_after_commit

DOCS_TXT = ["Première ligne, avec des accents: é à ü.\nSecond line of the same file.\n\n漢字 and emoji 🙂 too."]
DOCS_JSONL = [f"record {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(9)]
DOCS_PARQUET = [f"row {i}\twith a tab and a newline\nand <b>markup</b> number {i ** 3}" for i in range(6)]


def make_inputs(folder: Path) -> list[str]:
    """A folder with one of each supported type; documents in the order natsl reads them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(DOCS_TXT[0], encoding="utf-8")
    with open(folder / "b.jsonl", "w", encoding="utf-8") as fh:
        for i, text in enumerate(DOCS_JSONL):
            fh.write(json.dumps({"id": i, "text": text}) + "\n")
    pq.write_table(pa.table({"text": DOCS_PARQUET, "n": list(range(len(DOCS_PARQUET)))}), folder / "c.parquet")
    return DOCS_TXT + DOCS_JSONL + DOCS_PARQUET


def settings(**kw):
    base = dict(train_tokenizer=True, vocab_size=300, val_fraction=0.25, shard_tokens=64)
    base.update(kw)
    return T.TokenizeSettings(**base)


def split_documents(data: TokenData, split: str) -> list[str]:
    stream = data.split(split)
    ids = stream.read(0, stream.n_tokens) if stream.n_tokens else np.zeros(0, dtype=np.int64)
    assert len(ids) == 0 or ids[-1] == data.eos_id  # every document ends with EOS
    tok = data.tokenizer()
    cuts = np.flatnonzero(ids == data.eos_id)
    docs, start = [], 0
    for cut in cuts:
        docs.append(tok.decode(ids[start:cut].tolist()))
        start = cut + 1
    return docs


def test_shards_round_trip_with_eos_and_split(tmp_path):
    docs = make_inputs(tmp_path / "in")
    meta = T.tokenize_corpus(FileSource([str(tmp_path / "in")]), tmp_path / "out", settings(), progress=False,
                             log=lambda *_: None)
    data = TokenData(tmp_path / "out")
    held_out = [T.is_validation(i, Fraction(1, 4)) for i in range(len(docs))]
    expected_val = [d for d, v in zip(docs, held_out) if v]
    expected_train = [d for d, v in zip(docs, held_out) if not v]
    assert split_documents(data, "train") == expected_train
    assert split_documents(data, "validation") == expected_val
    assert len(expected_val) == len(docs) // 4
    # meta.json: counts, dtype, shards of at most shard_tokens, tokenizer fingerprint
    assert meta["dtype"] == "uint16" and meta["documents"] == len(docs)
    assert meta["splits"]["validation"]["documents"] == len(expected_val)
    assert meta["total_tokens"] == sum(s["tokens"] for s in meta["splits"].values())
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 1 and all(s["tokens"] <= 64 for s in shards)
    assert all((tmp_path / "out" / s["file"]).stat().st_size == 2 * s["tokens"] for s in shards)
    assert data.tokenizer().sha256() == meta["tokenizer_sha256"]
    assert not (tmp_path / "out" / T.PROGRESS).exists()


def test_rerun_does_nothing_and_a_killed_run_resumes(tmp_path, monkeypatch):
    make_inputs(tmp_path / "in")
    src = lambda: FileSource([str(tmp_path / "in")])  # noqa: E731
    T.tokenize_corpus(src(), tmp_path / "clean", settings(), progress=False, log=lambda *_: None)
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "clean").iterdir()}
    lines = []
    T.tokenize_corpus(src(), tmp_path / "clean", settings(), progress=False, log=lines.append)
    assert "nothing to do" in lines[-1]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "clean").iterdir()} == stamps

    # Other settings into the same folder are refused rather than mixed in.
    with pytest.raises(NatslError, match="other inputs or settings"):
        T.tokenize_corpus(src(), tmp_path / "clean", settings(val_fraction=0.5), progress=False, log=lambda *_: None)

    # A run that dies after its second commit leaves .progress.json and no meta.json ...
    small = dict(batch_docs=2, commit_tokens=1)
    with pytest.raises(kill_after_commit(monkeypatch, T, 2)):
        T.tokenize_corpus(src(), tmp_path / "part", settings(**small), progress=False, log=lambda *_: None)
    monkeypatch.undo()
    assert (tmp_path / "part" / T.PROGRESS).is_file() and not (tmp_path / "part" / T.META).exists()
    with pytest.raises(NatslError, match="unfinished"):
        TokenData(tmp_path / "part")
    # ... and bytes written after the last commit (a half-finished append) are cut off on resume.
    first = sorted((tmp_path / "part").glob("train_*.bin"))[-1]
    with open(first, "ab") as fh:
        fh.write(b"\x07\x00" * 5)
    lines = []
    T.tokenize_corpus(src(), tmp_path / "part", settings(**small), progress=False, log=lines.append)
    assert any("resuming the interrupted run" in line for line in lines)
    clean_small = tmp_path / "clean_small"
    T.tokenize_corpus(src(), clean_small, settings(**small), progress=False, log=lambda *_: None)
    for path in sorted(clean_small.glob("*.bin")):
        assert (tmp_path / "part" / path.name).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in clean_small.glob("*.bin")) == sorted(p.name for p in (tmp_path / "part").glob("*.bin"))


def test_text_field_and_txt_modes(tmp_path):
    (tmp_path / "p.txt").write_text("one\ntwo\n\n\nthree\n", encoding="utf-8")
    docs = [t for t, _, _ in FileSource([str(tmp_path / "p.txt")], txt_docs="paragraph").documents() if t]
    assert docs == ["one\ntwo", "three"]
    docs = [t for t, _, _ in FileSource([str(tmp_path / "p.txt")], txt_docs="line").documents() if t]
    assert docs == ["one", "two", "three"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    assert [t for t, _, _ in FileSource([str(tmp_path / "b.jsonl")], text_field="body").documents()] == ["x"]
    with pytest.raises(NatslError, match="no string field 'text'"):
        list(FileSource([str(tmp_path / "b.jsonl")]).documents())
    # a name that is no local path is a Hub dataset; a path-like name that does not exist is a missing file
    assert open_source(["someone/some_dataset"]).describe()["kind"] == "hub"
    with pytest.raises(NatslError, match="does not exist"):
        open_source(["./missing.jsonl"])
    for folder in ("missing_dir/", "someone/missing_dir/"):  # a folder's trailing slash: never a dataset name
        with pytest.raises(NatslError, match="does not exist"):
            open_source([folder])


def run_cli(*args, env_extra=None):
    """The real CLI in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "NATSL_FAULT"}
    env.update({"OMP_NUM_THREADS": "1", **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "natsl.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def run_inproc(*args, env_extra=None):
    """The same CLI in this process: (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    from natsl.cli.main import app

    result = CliRunner().invoke(app, list(args), env=env_extra)
    return result.exit_code, result.stdout, result.stderr


def assert_one_line_error(code, stderr, *needles):
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    proc = run_cli("tokenize", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o1"), "--train-tokenizer",
                   "--vocab-size", "300", "--no-progress")
    assert "Traceback" not in proc.stderr
    assert_one_line_error(proc.returncode, proc.stderr, "latin1.txt", "not UTF-8", "line 1")
    code, _, err = run_inproc("tokenize", "HuggingFaceFW/fineweb-edu", "--out", str(tmp_path / "o2"),
                              "--train-tokenizer", "--no-progress", env_extra={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(code, err, "HuggingFaceFW/fineweb-edu", "Hugging Face Hub")
    code, _, err = run_inproc("tokenize", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o3"),
                              "--train-tokenizer")
    assert_one_line_error(code, err, "nope.txt", "does not exist")
    code, _, err = run_inproc("tokenize", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o4"))
    assert_one_line_error(code, err, "no tokenizer")
    code, _, err = run_inproc("tokenize", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "o5"),
                              "--train-tokenizer", "--tokenizer-train-docs", "0")
    assert_one_line_error(code, err, "--tokenizer-train-docs", "at least 1")
    code, _, err = run_inproc("tokenize", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "latin1.txt" / "o6"),
                              "--train-tokenizer", "--vocab-size", "300", "--no-progress")
    assert_one_line_error(code, err, "latin1.txt")  # an --out under a file: the OS error, in one line
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3, 4, 5))  # a rejected input leaves no folder


def test_cli_killed_before_meta_is_finished_by_a_rerun(tmp_path):
    docs = make_inputs(tmp_path / "in")
    args = ["tokenize", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--train-tokenizer", "--vocab-size",
            "300", "--val-fraction", "0.25", "--no-progress"]
    proc = run_cli(*args, env_extra={"NATSL_FAULT": "kill_after_commit:1"})
    assert proc.returncode == -9  # SIGKILL after the data was committed, before meta.json
    assert not (tmp_path / "out" / "meta.json").exists()
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "resuming the interrupted run" in proc.stdout
    data = TokenData(tmp_path / "out")
    assert len(split_documents(data, "train")) + len(split_documents(data, "validation")) == len(docs)
    code, out, _ = run_inproc(*args)
    assert code == 0 and "nothing to do" in out


def test_hub_datasets_are_streamed(tmp_path, monkeypatch):
    """The Hub path without a network: the reachability probe and `datasets.load_dataset` stand in."""
    # a dependency of natsl (pyproject.toml), so an install from it runs this; a bare environment skips
    datasets = pytest.importorskip("datasets", reason="the Hub path needs the datasets package")

    import natsl.data.sources as sources

    calls = []

    def fake_load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": text} for text in DOCS_JSONL])

    monkeypatch.setattr(sources, "hub_unreachable_reason", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    source = open_source(["someone/corpus"], hub_config="en", hub_split="train")
    meta = T.tokenize_corpus(source, tmp_path / "out", settings(val_fraction=0.0), progress=False, log=lambda *_: None)
    assert calls[-1] == ("someone/corpus", "en", "train", True)
    assert meta["source"]["kind"] == "hub" and meta["splits"]["validation"]["tokens"] == 0
    assert split_documents(TokenData(tmp_path / "out"), "train") == DOCS_JSONL


def test_out_naming_a_file_and_an_option_without_dashes_are_named(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "file").write_text("x")
    code, _, err = run_inproc("tokenize", str(tmp_path / "a.txt"), "--out", str(tmp_path / "file"),
                              "--train-tokenizer", "--vocab-size", "300", "--no-progress")
    assert_one_line_error(code, err, "--out", "names a file, not a folder")
    code, _, err = run_inproc("tokenize", str(tmp_path / "a.txt"), "shard_tokens", "5", "--out", str(tmp_path / "o"),
                              "--train-tokenizer", "--vocab-size", "300", "--no-progress")
    assert_one_line_error(code, err, "'shard_tokens'", "looks like the option --shard-tokens")
    assert (tmp_path / "file").read_text() == "x" and not (tmp_path / "o").exists()


def test_an_empty_validation_split_is_warned_about(tmp_path):
    (tmp_path / "a.txt").write_text("one small document\n\nand another\n")
    code, out, err = run_inproc("tokenize", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--txt-docs",
                                "paragraph", "--train-tokenizer", "--vocab-size", "300", "--no-progress")
    assert code == 0, err
    (warning,) = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert "validation split is empty: 2 document(s) at --val-fraction 0.01" in warning
    assert "the first held out is document 100" in warning
    assert TokenData(tmp_path / "o").meta["splits"]["validation"]["tokens"] == 0


def test_documents_start_with_bos_when_the_tokenizer_has_one(tmp_path):
    """Llama-2's tokenizer (as the paper trained) puts <s> before each document: so does natsl tokenize by
    default, `bos=False` (`--no-bos`) leaves it out, and meta.json and the data's tokenizer say which."""
    from natsl.data.sources import MemorySource
    from natsl.tokenizer import train_bpe

    docs = [f"document {i} about the quick brown fox" for i in range(8)]
    tok = train_bpe(docs, vocab_size=300, eos_token="</s>")
    assert tok.bos_id is None
    tok.inner.add_special_tokens(["<s>"])
    tok.save(tmp_path)
    tok = T.Tokenizer.from_file(tmp_path)
    body = [tok.encode(d) for d in docs]
    for bos in (True, False):
        out = tmp_path / f"bos_{bos}"
        meta = T.tokenize_corpus(MemorySource(docs, {"what": "test"}), out,
                                 settings(train_tokenizer=False, tokenizer=str(tmp_path), val_fraction=0.0, bos=bos),
                                 progress=False, log=lambda *_: None)
        data = TokenData(out)
        stream = data.split("train")
        ids = stream.read(0, stream.n_tokens).tolist()
        start = [tok.bos_id] if bos else []
        assert ids == [t for b in body for t in start + b + [tok.eos_id]]
        assert (meta["add_bos"], meta["bos_id"]) == ((True, tok.bos_id) if bos else (False, None))
        assert data.tokenizer().document_start() == start
    # a tokenizer without BOS (the trained BPE) is unchanged: documents followed by EOS only
    meta = T.tokenize_corpus(MemorySource(docs, {"what": "test"}), tmp_path / "bpe", settings(val_fraction=0.0),
                             progress=False, log=lambda *_: None)
    assert (meta["add_bos"], meta["bos_id"]) == (False, None)
    assert TokenData(tmp_path / "bpe").split("train").n_tokens == meta["total_tokens"]


def test_a_link_out_of_an_input_folder_is_left_out(tmp_path, capsys):
    """An input folder is read, not what its links point at (an untrusted folder could link to any file)."""
    from natsl.data.local_files import expand_inputs

    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", folder / "sub" / "b.txt")
    os.symlink(folder / "a.txt", folder / "c.txt")  # a link inside the folder stays
    files = [path.name for _, path in expand_inputs([str(folder)], include=("*.txt",))]
    assert files == ["a.txt", "c.txt"]
    assert "is a link out of" in capsys.readouterr().err
