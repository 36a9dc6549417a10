"""Untrusted data folders and tokenizers (issue 53): each bad input is one line with exit code 2, or correct
behaviour; nothing crashes, reads outside its folder or overwrites what it reads.

Classes: memory-unsafe reads (dtypes that are not token ids, sizes that disagree with the declared counts,
.npy files of objects); paths read from a file that leave its folder; resuming on other data; a killed
`natsl tokenize` before its first progress file; a --vocab-size that would abort the BPE trainer; a
tokenizer bigger than its model; eval-ppl's checkpoints checked against the data before any work; bad files in a
corpus of local files (not UTF-8, binary, too large, gzip bombs, corrupt archives, unreadable), one line or skipped
and counted with --skip-bad-files; a progress file whose mix or validation_texts record is damaged."""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import natsl
import natsl.data.tokenize as T
from natsl.cli.main import app
from natsl.data.dataset import TokenData
from natsl.data.sources import MemorySource
from natsl.errors import NatslError
from natsl.eval.data import load_token_data
from natsl.eval.haystack import essay_text

from cli_checks import assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent
IDS = np.arange(1, 241, dtype=np.uint16) % 200  # 240 token ids of a 300-entry tokenizer


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"NATSL_FAULT": None, "OMP_NUM_THREADS": "1"})


def documents(n: int = 40) -> list[str]:
    from natsl.data.builtin import generated_documents

    return generated_documents(n)


def tokenize(out: Path, docs: list[str], name: str = "test", **settings) -> Path:
    base = dict(train_tokenizer=True, vocab_size=300, val_fraction=0.25, shard_tokens=512)
    T.tokenize_corpus(MemorySource(docs, {"name": name}), out, T.TokenizeSettings(**{**base, **settings}),
                      progress=False, log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tokenized folder, a checkpoint (tiny_hybrid, random weights) with that folder's tokenizer, and text."""
    root = tmp_path_factory.mktemp("untrusted")
    tokens = tokenize(root / "tokens", documents())
    recipe = natsl.load_recipe("tiny_hybrid")
    tok = TokenData(tokens).tokenizer()
    ckpt = natsl.checkpoint.save_model_folder(root / "ckpt", natsl.build_model(recipe), recipe, tok)
    text = root / "text.txt"
    text.write_text(essay_text(20, seed=3), encoding="utf-8")
    return {"root": root, "tokens": tokens, "ckpt": ckpt, "text": text}


def foreign(folder: Path, meta: dict, shards: dict) -> Path:
    """A token folder in another layout than natsl tokenize's: meta.json plus shard files."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in shards.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    edit(meta)
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


def npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


# -- memory-unsafe reads: only the unsigned token dtypes natsl tokenize writes -------------------------

# Zeros as the bytes: an object dtype reads them as null pointers (a TypeError, not a crash) where the
# check is missing, so this test fails plainly without it instead of taking the test process down.
BAD_DTYPES = ["object", "O", "float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint64",
              "complex64", "bool", "V4", "<U2", "uint12", 12, None, ["uint16"], {"kind": "u"}]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=[repr(d) for d in BAD_DTYPES])
def test_a_dtype_that_is_not_token_ids_is_refused(world, tmp_path, dtype):
    bad_foreign = foreign(tmp_path / "foreign", {"dtype": dtype}, {"shard_00000.bin": bytes(960)})
    bad_natsl = edited_copy(world["tokens"], tmp_path / "natsl", lambda m: m.update(dtype=dtype))
    for folder in (bad_foreign, bad_natsl):
        with pytest.raises(NatslError, match=r"dtype .* is not one of uint16, uint32"):
            load_token_data(folder)
    with pytest.raises(NatslError, match=r"dtype .* is not one of uint16, uint32"):
        TokenData(bad_natsl)


@pytest.mark.parametrize("command", ["eval-ppl", "inspect-routing", "compare"])
def test_the_commands_that_read_data_refuse_an_object_dtype_in_one_line(world, tmp_path, command):
    data = foreign(tmp_path / "data", {"dtype": "object"}, {"shard_00000.bin": bytes(960)})
    args = {"eval-ppl": ["eval-ppl", world["ckpt"], "--data", data, "--max-len", 64, "--no-progress"],
            "inspect-routing": ["inspect-routing", world["ckpt"], data, "--seq-len", 64, "--samples", 1],
            "compare": ["compare", world["ckpt"], "--data", data, "--no-recall", "--context", 64, "--budgets", 1,
                        "--max-len", 64, "--windows", 1, "--no-progress"]}[command]
    result = run(*args, "--device", "cpu", "--out", tmp_path / "out")
    assert_one_line_error(result, "dtype 'object' is not one of uint16, uint32")


def uint32_as_uint16_natsl(src: Path, dst: Path) -> Path:
    """A natsl tokenize folder whose shards hold uint32 ids while meta.json (counts unchanged) says uint16."""
    shutil.copytree(src, dst)
    for path in dst.glob("*.bin"):
        path.write_bytes(np.fromfile(path, dtype=np.uint16).astype(np.uint32).tobytes())
    return dst


def test_uint32_data_declared_as_uint16_is_caught_by_its_size(world, tmp_path):
    natsl_folder = uint32_as_uint16_natsl(world["tokens"], tmp_path / "natsl")
    listed = foreign(tmp_path / "listed", {"dtype": "uint16", "shards": [{"file": "a.bin", "tokens": len(IDS)}]},
                     {"a.bin": IDS.astype(np.uint32).tobytes()})
    total = foreign(tmp_path / "total", {"dtype": "uint16", "total_tokens": len(IDS)},
                    {"a.bin": IDS.astype(np.uint32).tobytes()})
    with pytest.raises(NatslError, match="its dtype or token count in meta.json is wrong"):
        TokenData(natsl_folder).split("train")
    for folder, needle in ((natsl_folder, "its dtype or token count"), (listed, "its dtype or token count"),
                           (total, "its dtype or counts are wrong")):
        with pytest.raises(NatslError, match=needle):
            load_token_data(folder)


def test_training_refuses_uint32_data_declared_as_uint16(world, tmp_path):
    data = uint32_as_uint16_natsl(world["tokens"], tmp_path / "data")
    result = run("train", ROOT / "recipes" / "tiny_hybrid.yaml", "--set", f"data.path={data}", "--max-steps", 1,
                 "--device", "cpu", "--backend", "chunked", "--no-progress", "--out", tmp_path / "run")
    assert_one_line_error(result, "train_00000.bin", "its dtype or token count in meta.json is wrong")


BAD_NPY = {
    "objects": (np.array([1, "x", None], dtype=object), "holds object values"),
    "float32": (IDS.astype(np.float32), "holds float32 values"),
    "int8": (IDS.astype(np.int8), "holds int8 values"),
    "two rows": (IDS.reshape(2, -1), "not one row of ids"),
}


@pytest.mark.parametrize("array, needle", BAD_NPY.values(), ids=BAD_NPY.keys())
def test_npy_shards_other_than_token_ids_are_refused_without_unpickling(tmp_path, array, needle):
    folder = foreign(tmp_path / "d", {}, {"shard.npy": npy_bytes(array)})
    with pytest.raises(NatslError, match=needle):
        load_token_data(folder)


def test_npy_headers_must_agree_with_the_size_and_the_declared_dtype(tmp_path):
    whole = npy_bytes(IDS)
    cut = foreign(tmp_path / "cut", {}, {"shard.npy": whole[:-10]})
    other = foreign(tmp_path / "other", {"dtype": "uint16"}, {"shard.npy": npy_bytes(IDS.astype(np.uint32))})
    junk = foreign(tmp_path / "junk", {}, {"shard.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': 1}"})
    with pytest.raises(NatslError, match="not the 240 ids its header declares"):
        load_token_data(cut)
    with pytest.raises(NatslError, match="holds uint32 ids but its folder's meta.json says uint16"):
        load_token_data(other)
    with pytest.raises(NatslError, match="is not a readable .npy file"):
        load_token_data(junk)


def test_good_shards_in_every_layout_still_read(world, tmp_path):
    """The checks refuse the bad, not the layouts: .bin, .npy, listed and found shards read their ids."""
    folders = [foreign(tmp_path / "bin", {"dtype": "uint16", "shards": [{"file": "a.bin", "tokens": 240}]},
                       {"a.bin": IDS.tobytes()}),
               foreign(tmp_path / "npy", {}, {"sub/a.npy": npy_bytes(IDS[:100]), "sub/b.npy": npy_bytes(IDS[100:])}),
               foreign(tmp_path / "u32", {"dtype": "uint32", "total_tokens": 240}, {"a.bin": IDS.astype(np.uint32).tobytes()})]
    for folder in folders:
        assert load_token_data(folder).docs[0].tolist() == IDS.tolist()
    stream = TokenData(world["tokens"]).split("train")
    assert load_token_data(world["tokens"], split="train").docs[0].tolist() == stream.read(0, stream.n_tokens).tolist()


# -- paths read from a data folder resolve inside it ------------------------------------------------------

def outside_names(folder: Path, victim: Path) -> dict:
    """Names for a shard that lead outside `folder` (to `victim`), and how they are made."""
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "link.bin").symlink_to(victim)
    (folder / "sub" / "dirlink").symlink_to(victim.parent, target_is_directory=True)
    return {"parent": f"../{victim.name}", "deep": f"sub/../../{victim.name}", "absolute": str(victim),
            "symlink": "link.bin", "symlinked folder": f"sub/dirlink/{victim.name}"}


NAMES = ["parent", "deep", "absolute", "symlink", "symlinked folder"]
# Why natsl.files.resolve_inside refuses each name, and the fix every data folder's refusal ends with.
WHY = {"parent": "leads outside the folder", "deep": "leads outside the folder", "absolute": "is an absolute path",
       "symlink": "is a link to a file outside the folder", "symlinked folder": "is a link to a file outside the folder"}
OUTSIDE = "natsl reads only files inside"
RETOKENIZE = "tokenize the data again with `natsl tokenize`"


@pytest.mark.parametrize("kind", NAMES)
def test_a_natsl_meta_naming_a_shard_outside_its_folder_is_refused(world, tmp_path, kind):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(IDS.tobytes())
    folder = tmp_path / "data" / "tokens"
    shutil.copytree(world["tokens"], folder)
    name = outside_names(folder, victim)[kind]

    def edit(meta):
        meta["splits"]["train"]["shards"][0].update(file=name, tokens=len(IDS))
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    for read in (TokenData, load_token_data):
        with pytest.raises(NatslError, match=WHY[kind]) as err:
            read(folder)
        assert OUTSIDE in str(err.value) and RETOKENIZE in str(err.value)
    result = run("train", ROOT / "recipes" / "tiny_hybrid.yaml", "--set", f"data.path={folder}", "--max-steps", 1,
                 "--device", "cpu", "--no-progress", "--out", tmp_path / "run")
    assert_one_line_error(result, f"names {name!r}, which {WHY[kind]}", OUTSIDE, RETOKENIZE)


@pytest.mark.parametrize("kind", NAMES)
def test_a_foreign_meta_naming_a_shard_outside_its_folder_is_refused(tmp_path, kind):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(IDS.tobytes())
    folder = tmp_path / "data" / "tokens"
    name = outside_names(folder, victim)[kind]
    foreign(folder, {"dtype": "uint16", "shards": [name]}, {})
    with pytest.raises(NatslError, match=WHY[kind]) as err:
        load_token_data(folder)
    assert OUTSIDE in str(err.value) and RETOKENIZE in str(err.value)


def test_shards_found_by_search_must_lie_inside_too(tmp_path):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(IDS.tobytes())
    folder = foreign(tmp_path / "data", {"dtype": "uint16"}, {"a.bin": IDS.tobytes()})
    (folder / "b.bin").symlink_to(victim)
    with pytest.raises(NatslError, match="'b.bin', which is a link to a file outside the folder"):
        load_token_data(folder)


def test_the_tokenizer_file_named_by_meta_must_lie_inside(world, tmp_path):
    shutil.copy(world["tokens"] / "tokenizer.json", tmp_path / "tokenizer.json")
    folder = edited_copy(world["tokens"], tmp_path / "data", lambda m: m.update(tokenizer_file="../tokenizer.json"))
    with pytest.raises(NatslError, match="'../tokenizer.json', which leads outside the folder"):
        TokenData(folder).tokenizer()


BAD_PROGRESS = {
    "shard outside": (lambda st: st["splits"]["train"]["shards"][0].update(file="../victim.bin"),
                      "'../victim.bin', which leads outside the folder"),
    "extra split": (lambda st: st["splits"].update(evil={"tokens": 0, "documents": 0,
                                                         "shards": [{"file": "../victim.bin", "tokens": 0}]}),
                    "is damaged"),
    "items not a count": (lambda st: st.update(items="many"), "is damaged"),
    "split tokens missing": (lambda st: st["splits"]["train"].pop("tokens"), "is damaged"),
    "another fingerprint": (lambda st: st.update(fingerprint=[1]), "unfinished run of other inputs"),
    "mix count negative": (lambda st: st["mix"][0]["train"].update(tokens=-1), "mix counters"),
    "mix of other inputs": (lambda st: st["mix"].append(st["mix"][0]), "mix counters"),
    "val text outside": (lambda st: st["val_texts"].update({"../../victim.bin": 0}), "validation_texts record"),
    "val text not a length": (lambda st: st["val_texts"].update({"00_test.jsonl": "all"}), "validation_texts record"),
}


@pytest.mark.parametrize("edit, needle", BAD_PROGRESS.values(), ids=BAD_PROGRESS.keys())
def test_a_damaged_progress_file_is_one_line_and_truncates_nothing(tmp_path, monkeypatch, edit, needle):
    """Resuming cuts shards back to their committed length and removes the others: a progress file must
    not aim that at other files, nor fail inside the resume."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"keep me" * 100)
    docs = documents()
    killed = kill_at(monkeypatch, "commit")
    with pytest.raises(killed):
        tokenize(tmp_path / "out", docs, commit_tokens=64, batch_docs=4, val_texts=True)
    progress = json.loads((tmp_path / "out" / T.PROGRESS).read_text())
    edit(progress)
    (tmp_path / "out" / T.PROGRESS).write_text(json.dumps(progress))
    monkeypatch.undo()
    with pytest.raises(NatslError, match=needle):
        tokenize(tmp_path / "out", docs, commit_tokens=64, batch_docs=4, val_texts=True)
    assert victim.read_bytes() == b"keep me" * 100


def test_a_validation_texts_link_to_another_folder_is_refused_and_left_alone(tmp_path, monkeypatch):
    """Resuming empties validation_texts/ of files it did not commit: a link there must not aim that elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim.txt").write_text("keep me")
    docs = documents()
    killed = kill_at(monkeypatch, "commit")
    with pytest.raises(killed):
        tokenize(tmp_path / "out", docs, commit_tokens=64, batch_docs=4, val_texts=True)
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "out" / "validation_texts")
    (tmp_path / "out" / "validation_texts").symlink_to(elsewhere)
    with pytest.raises(NatslError, match="'validation_texts', which is a link to a file outside the folder"):
        tokenize(tmp_path / "out", docs, commit_tokens=64, batch_docs=4, val_texts=True)
    assert (elsewhere / "victim.txt").read_text() == "keep me" and len(list(elsewhere.iterdir())) == 1


# -- meta.json that is not a JSON object, or nested too deep to parse -----------------------------------

@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "[1, 2]", "{not json", "\xff"])
def test_unreadable_meta_json_is_one_line(world, tmp_path, text):
    for folder, layout in ((tmp_path / "natsl", world["tokens"]), (tmp_path / "foreign", None)):
        if layout:
            shutil.copytree(layout, folder)
        else:
            foreign(folder, {}, {"a.bin": IDS.tobytes()})
        (folder / "meta.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff")
        with pytest.raises(NatslError, match="meta.json' is (corrupt|not a JSON object|not valid JSON|nested too deeply|not UTF-8)"):
            load_token_data(folder)


# -- resuming on other data ----------------------------------------------------------------------------

def test_resuming_on_other_data_is_refused_with_the_way_forward(world, tmp_path):
    other = tokenize(tmp_path / "other", documents(60)[20:], name="other")
    base = [ROOT / "recipes" / "tiny_hybrid.yaml", "--set", "train.seq_len=64", "train.micro_batch_size=2",
            "train.tokens_per_step=128", "--device", "cpu", "--backend", "chunked", "--no-progress",
            "--out", tmp_path / "run"]
    first = run("train", *base, f"data.path={world['tokens']}", "--max-steps", 1)
    assert first.exit_code == 0, first.output
    result = run("train", *base, f"data.path={other}", "--max-steps", 2)
    assert_one_line_error(result, "was trained on other data", f"data.path={world['tokens']}",
                          "--set train.init_from=")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000001"]


def test_the_way_forward_names_the_embedded_corpus_as_users_write_it(tmp_path):
    from natsl.data.builtin import cache_root
    from natsl.data.dataset import as_given

    assert as_given(str(cache_root() / "builtin-v1-vocab1024-abc")) == "builtin"  # not the cache's folder
    assert as_given(str(tmp_path / "builtin-v1-vocab1024-abc")) == str(tmp_path / "builtin-v1-vocab1024-abc")
    assert as_given("data/mycorpus") == "data/mycorpus"


# -- a killed `natsl tokenize` before its first progress file -------------------------------------------

def kill_at(monkeypatch, where: str):
    """Make tokenize die (a BaseException no cleanup catches, as SIGKILL runs none) at `where`:
    "tokenizer" right after tokenizer.json is written, "training" while the BPE trains, "commit" after
    the first committed chunk."""
    class Killed(BaseException):
        pass

    def die(*args, **kwargs):
        raise Killed()

    if where == "tokenizer":
        save = natsl.tokenizer.Tokenizer.save

        def save_then_die(self, folder):
            save(self, folder)
            raise Killed()
        monkeypatch.setattr(natsl.tokenizer.Tokenizer, "save", save_then_die)
    elif where == "training":
        monkeypatch.setattr(T, "train_bpe", die)
    else:
        monkeypatch.setattr(T, "fault_point", die)
    return Killed


@pytest.mark.parametrize("where", ["tokenizer", "training"])
def test_a_run_killed_before_its_first_progress_file_restarts(tmp_path, monkeypatch, where):
    docs = documents()
    clean = tokenize(tmp_path / "clean", docs)
    killed = kill_at(monkeypatch, where)
    with pytest.raises(killed):
        tokenize(tmp_path / "out", docs)
    monkeypatch.undo()
    tokenize(tmp_path / "out", docs)  # the same command: no refusal
    for name in ("train", "validation"):
        assert (TokenData(tmp_path / "out").split(name).read(0, TokenData(clean).split(name).n_tokens).tolist()
                == TokenData(clean).split(name).read(0, TokenData(clean).split(name).n_tokens).tolist())
    assert not (tmp_path / "out" / T.PROGRESS).exists()


def test_a_leftover_temporary_of_the_first_progress_file_is_no_obstacle(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / f".{T.PROGRESS}.1a2b3c4d.tmp").write_text("{")
    tokenize(out, documents())
    assert TokenData(out).meta["documents"] == 40 and not list(out.glob("*.tmp"))


def test_a_folder_of_someone_else_is_still_refused_and_kept(tmp_path):
    """Only a folder the run marked as its own is restarted: a tokenizer.json of the user's stays untouched."""
    out = tmp_path / "tokenizers"
    out.mkdir()
    (out / "tokenizer.json").write_text("mine")
    with pytest.raises(NatslError, match="is not a natsl tokenize folder"):
        tokenize(out, documents())
    assert (out / "tokenizer.json").read_text() == "mine"


def test_a_failing_start_leaves_a_folder_the_next_run_takes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NatslError, match="does not exist"):
        tokenize(out, documents(), train_tokenizer=False, tokenizer=str(tmp_path / "absent" / "tokenizer.json"))
    assert list(out.iterdir()) == []
    tokenize(out, documents())
    assert (out / "meta.json").is_file()


# -- --vocab-size within what the BPE trainer can allocate -----------------------------------------------

@pytest.mark.parametrize("vocab", [1_000_000_000, 2 ** 20 + 1, 2 ** 32, 2 ** 40, 257, 0])
def test_vocab_size_out_of_range_is_one_line_before_any_work(tmp_path, vocab):
    (tmp_path / "a.txt").write_text("hello world\n")
    result = run("tokenize", tmp_path / "a.txt", "--out", tmp_path / "o", "--train-tokenizer", "--vocab-size", vocab,
                 "--no-progress")
    assert_one_line_error(result, "--vocab-size must be between 258", "1,048,576")
    assert not (tmp_path / "o").exists()


def test_the_largest_vocab_size_is_accepted():
    T.TokenizeSettings(train_tokenizer=True, vocab_size=2 ** 20).validate()


# -- a tokenizer bigger than its model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model(world):
    """A checkpoint whose model has 280 vocabulary entries and whose tokenizer has 300."""
    recipe = natsl.load_recipe("tiny_hybrid")
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, vocab_size=280))
    tok = TokenData(world["tokens"]).tokenizer()
    return natsl.checkpoint.save_model_folder(world["root"] / "small", natsl.build_model(recipe), recipe, tok)


@pytest.mark.parametrize("command", ["generate", "eval-ruler", "eval-ppl"])
def test_a_tokenizer_bigger_than_the_model_is_refused_at_load(world, small_model, tmp_path, command):
    args = {"generate": ["generate", small_model, "--prompt", "Ada has", "--max-new-tokens", 2],
            "eval-ruler": ["eval-ruler", small_model, "--lengths", 256, "--tasks", "niah_single_1", "--samples", 1,
                           "--max-new-tokens", 2, "--no-progress", "--out", tmp_path / "o"],
            "eval-ppl": ["eval-ppl", small_model, "--data", world["text"], "--max-len", 64, "--no-progress",
                         "--out", tmp_path / "o"]}[command]
    result = run(*args, "--device", "cpu")
    assert_one_line_error(result, "the tokenizer has 300 entries but the model's vocabulary only 280")


def test_load_checkpoint_checks_before_reading_weights(small_model, tmp_path):
    shutil.copytree(small_model, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(NatslError, match="the tokenizer has 300 entries"):
        natsl.load_checkpoint(tmp_path / "m")


# -- eval-ppl: every checkpoint against the data before any work ------------------------------------------

@pytest.fixture(scope="module")
def other_tokenizer_ckpt(world):
    from natsl.tokenizer import train_bpe

    recipe = natsl.load_recipe("tiny_hybrid")
    tok = train_bpe([essay_text(30, seed=9)], vocab_size=400)
    return natsl.checkpoint.save_model_folder(world["root"] / "other_tok", natsl.build_model(recipe), recipe, tok)


def test_eval_ppl_checks_every_checkpoint_before_evaluating_the_first(world, other_tokenizer_ckpt, tmp_path):
    result = run("eval-ppl", world["ckpt"], other_tokenizer_ckpt, "--data", world["tokens"], "--max-len", 64,
                 "--windows", 1, "--device", "cpu", "--no-progress", "--out", tmp_path / "o")
    assert_one_line_error(result, "was tokenized with a different tokenizer")
    assert "ppl" not in result.stdout and not (tmp_path / "o").exists()


def test_eval_ppl_checks_for_a_tokenizer_before_evaluating_the_first(world, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(world["ckpt"], bare)
    (bare / "tokenizer.json").unlink()
    result = run("eval-ppl", world["ckpt"], bare, "--data", world["text"], "--max-len", 64, "--windows", 1,
                 "--device", "cpu", "--no-progress", "--out", tmp_path / "o")
    assert_one_line_error(result, "has no tokenizer.json")
    assert "ppl" not in result.stdout and not (tmp_path / "o").exists()


def test_converting_with_a_tokenizer_bigger_than_the_model_is_refused(world, small_model, tmp_path):
    from natsl.eval.convert import write_imported

    small = natsl.checkpoint.checkpoint_recipe(small_model, natsl.checkpoint.read_config(small_model))
    state = natsl.build_model(small).state_dict()
    with pytest.raises(NatslError, match="the tokenizer has 300 entries but the model's vocabulary only 280"):
        write_imported(small_model, tmp_path / "out", small, state, None, world["tokens"] / "tokenizer.json", "natsl")
    assert not (tmp_path / "out").exists()


# -- bad files in a corpus of local files: one line each, or left out and counted with --skip-bad-files --------

def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, mtime=0)


BAD_FILES = {  # name -> (file name, bytes, the error's words, the reason it is skipped for)
    "not utf8": ("latin1.txt", "caf\xe9 cr\xe8me\n".encode("latin-1"), "is not UTF-8 text (line 1", "not-utf8"),
    "binary": ("blob.md", b"text\x00\x01\x02", "is binary (a NUL byte at offset 4)", "binary"),
    "too large": ("big.md", b"x" * 100_001, "is larger than --max-file-bytes 100,000 bytes", "too-large"),
    "gzip bomb": ("bomb.1.gz", _gzip(b"a" * 800_001), "decompresses to more than 8x --max-file-bytes = 800,000",
                  "too-large"),
    "gzip bomb of zeros": ("zeros.1.gz", _gzip(bytes(64 << 20)), "decompresses to more than", "too-large"),
    "gzip of latin1": ("latin1.1.gz", _gzip("\xe9t\xe9\n".encode("latin-1")), "is not UTF-8 text", "not-utf8"),
    "gzip of binary": ("blob.1.gz", _gzip(b"\x00" * 10), "is binary", "binary"),
    "corrupt gzip": ("junk.1.gz", b"\x1f\x8b\x08junk" * 4, "is not a readable gzip file", "unreadable"),
    "truncated gzip": ("cut.1.gz", _gzip(b"some text\n" * 50)[:30], "is not a readable gzip file", "unreadable"),
    "corrupt parquet": ("rows.parquet", b"PAR1 not really", "is not a readable Parquet file", "unreadable"),
    "jsonl of non-objects": ("rows.jsonl", b"[1, 2]\n", "is not a JSON object", "unreadable"),
}


@pytest.mark.parametrize("name, data, words, reason", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_a_bad_file_is_one_line_or_skipped_and_counted(tmp_path, name, data, words, reason):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "good.txt").write_text(essay_text(3, seed=1), encoding="utf-8")
    (folder / name).write_bytes(data)
    args = ["tokenize", folder, "--include", "*.txt", "--include", "*.md", "--include", "*.gz", "--include",
            "*.parquet", "--include", "*.jsonl", "--max-file-bytes", "100000", "--train-tokenizer", "--vocab-size",
            "300", "--no-progress", "--out"]
    result = run(*args, tmp_path / "strict")
    assert_one_line_error(result, name, words)
    assert not (tmp_path / "strict").exists()
    result = run(*args, tmp_path / "lenient", "--skip-bad-files")
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "lenient" / "meta.json").read_text())
    assert meta["skipped"]["files"] == 1 and meta["skipped"]["reasons"] == {reason: 1}
    assert meta["skipped"]["examples"][reason] == [str(folder / name)] and meta["documents"] >= 1
    assert f"1 bad file(s) skipped ({reason} 1)" in result.stdout.strip().splitlines()[-1]


def test_an_unreadable_file_is_one_line_or_skipped(tmp_path, monkeypatch):
    """A file the operating system will not read (no permission: the tests may run as root, so open() fails here)."""
    import builtins

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "good.txt").write_text(essay_text(3, seed=1), encoding="utf-8")
    (folder / "secret.txt").write_text("private")
    real_open = builtins.open

    def guarded(path, *a, **kw):
        if str(path).endswith("secret.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", guarded)
    args = ["tokenize", folder, "--train-tokenizer", "--vocab-size", "300", "--no-progress", "--out"]
    assert_one_line_error(run(*args, tmp_path / "strict"), "secret.txt' cannot be read (Permission denied)",
                          "--skip-bad-files")
    result = run(*args, tmp_path / "lenient", "--skip-bad-files")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "lenient" / "meta.json").read_text())["skipped"]["reasons"] == {"unreadable": 1}


@pytest.mark.parametrize("name", ["fifo.txt", "fifo.jsonl"])
def test_a_fifo_given_as_evaluation_text_is_refused_not_waited_on(tmp_path, name):
    """eval-ppl, inspect-routing and compare read --data text through read_text_documents: open() on a FIFO
    would wait for a writer forever."""
    import os

    from natsl.eval.data import read_text_documents

    os.mkfifo(tmp_path / name)
    with pytest.raises(NatslError, match="is not a regular file"):
        read_text_documents(tmp_path / name)
