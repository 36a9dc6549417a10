"""Untrusted files and paths in `natsl convert`, `natsl generate`, the other commands' outputs and folder
replacement (issue 53): a path read from a file never leads outside its folder; no command writes over
what it reads or into a training checkpoint, not even with --force; a folder replacement killed at any
step is put right by the next run; a full disk is one line and leaves no partial output."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import natsl
from natsl.atomic import atomic_folder, recover_folder
from natsl.checkpoint import check_replaceable, save_model_folder
from natsl.cli.main import app
from natsl.errors import NatslError
from natsl.eval.haystack import essay_text
from natsl.files import read_json_records, resolve_inside
from natsl.outputs import check_output
from natsl.tokenizer import train_bpe

from cli_checks import assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny NAtS-L Hybrid inference folder with a tokenizer (random weights)."""
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    tok = train_bpe([essay_text(60)], vocab_size=300)
    return save_model_folder(tmp_path_factory.mktemp("ckpt") / "tiny", natsl.build_model(recipe), recipe, tok)


def make_training_checkpoint(ckpt: Path, folder: Path) -> Path:
    """A step folder as `natsl train` leaves it: the model files plus the training state and its manifest."""
    import shutil

    shutil.copytree(ckpt, folder)
    save_file({"layers.0::exp_avg": torch.zeros(3)}, str(folder / "optimizer.safetensors"))
    save_file({"cpu_rank0": torch.zeros(4, dtype=torch.uint8)}, str(folder / "rng.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "tokens_seen": 512}))
    files = sorted(p for p in folder.iterdir() if p.is_file())
    (folder / "manifest.json").write_text(json.dumps({"files": {p.name: p.stat().st_size for p in files}}))
    return folder


# ----------------------------------------------------------------------------- paths read from a file

@pytest.fixture(scope="module")
def hf_folder(ckpt, tmp_path_factory):
    """natsl's own Hugging Face export of `ckpt` (`natsl convert --to hf`), which `--from-hf` reads back."""
    out = tmp_path_factory.mktemp("hf") / "export"
    result = run("convert", ckpt, out, "--to", "hf")
    assert result.exit_code == 0, result.output
    return out


def sharded_copy(hf_folder: Path, tmp_path: Path, weight_file) -> tuple[Path, Path]:
    """A copy of the export whose weights lie outside it (tmp_path/outside/model.safetensors, readable and
    complete: following the index there would import them) and whose index names `weight_file(outside)`."""
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    outside = tmp_path / "outside" / "model.safetensors"
    outside.parent.mkdir()
    os.replace(folder / "model.safetensors", outside)
    names = load_file(str(outside)).keys()
    name = weight_file(folder, outside)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in names}}))
    return folder, outside


def escape_by_dots(folder, outside):
    return "../outside/model.safetensors"


def escape_by_absolute_path(folder, outside):
    return str(outside)


def escape_through_a_subfolder(folder, outside):
    (folder / "sub").mkdir()
    return "sub/../../outside/model.safetensors"


def escape_by_a_link(folder, outside):
    (folder / "shard-1.safetensors").symlink_to(outside)
    return "shard-1.safetensors"


def escape_by_a_linked_folder(folder, outside):
    (folder / "shards").symlink_to(outside.parent, target_is_directory=True)
    return "shards/model.safetensors"


@pytest.mark.parametrize("weight_file, fragment", [
    (escape_by_dots, "leads outside the folder"),
    (escape_by_absolute_path, "is an absolute path"),
    (escape_through_a_subfolder, "leads outside the folder"),
    (escape_by_a_link, "is a link to a file outside the folder"),
    (escape_by_a_linked_folder, "is a link to a file outside the folder"),
])
def test_an_index_cannot_make_from_hf_read_outside_its_folder(hf_folder, tmp_path, weight_file, fragment):
    folder, _ = sharded_copy(hf_folder, tmp_path, weight_file)
    result = run("convert", folder, tmp_path / "out", "--from-hf")
    assert_one_line_error(result, "model.safetensors.index.json", fragment, "use another copy")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("weight_map", [{"embed.weight": 7}, {"embed.weight": ["a", "b"]}, ["model.safetensors"],
                                        {"embed.weight": ""}, {"embed.weight": "a\x00b"}])
def test_an_index_whose_weight_map_is_not_names_is_one_line(hf_folder, tmp_path, weight_map):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_one_line_error(run("convert", folder, tmp_path / "out", "--from-hf"), "model.safetensors.index.json")


def test_a_weights_file_linked_outside_is_refused_without_an_index(hf_folder, tmp_path):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folder, folder)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(folder / "model.safetensors", outside)
    (folder / "model.safetensors").symlink_to(outside)
    assert_one_line_error(run("convert", folder, tmp_path / "out", "--from-hf"), "is a link to a file outside")


def test_shards_inside_the_folder_and_a_hub_cache_snapshot_still_import(hf_folder, tmp_path):
    """The legitimate layouts: an index naming shards in a subfolder, and the Hugging Face cache, whose
    snapshot files link into the model's blobs/ folder."""
    import shutil

    folder = tmp_path / "sharded"
    shutil.copytree(hf_folder, folder)
    (folder / "weights").mkdir()
    os.replace(folder / "model.safetensors", folder / "weights" / "part-1.safetensors")
    names = load_file(str(folder / "weights" / "part-1.safetensors")).keys()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "weights/./part-1.safetensors" for k in names}}))
    assert run("convert", folder, tmp_path / "a", "--from-hf").exit_code == 0

    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot_folder = repo / "snapshots" / "0123abc"
    snapshot_folder.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for path in hf_folder.iterdir():
        blob = repo / "blobs" / f"sha-{path.name}"
        shutil.copyfile(path, blob)
        (snapshot_folder / path.name).symlink_to(os.path.relpath(blob, snapshot_folder))
    result = run("convert", snapshot_folder, tmp_path / "b", "--from-hf")
    assert result.exit_code == 0, result.output
    assert load_file(str(tmp_path / "b" / "model.safetensors")).keys() == load_file(str(tmp_path / "a" / "model.safetensors")).keys()


@pytest.mark.parametrize("name, fragment", [("../x", "leads outside"), ("/etc/passwd", "absolute path"),
                                            ("a/../../x", "leads outside"), (None, "not a file name"),
                                            (3, "not a file name"), ("", "not a file name"),
                                            ("  ", "not a file name")])
def test_resolve_inside_refuses_every_way_out(tmp_path, name, fragment):
    with pytest.raises(NatslError, match=fragment) as err:
        resolve_inside(tmp_path, name, "'meta.json'")
    assert "\n" not in str(err.value) and str(err.value).endswith("use another copy")


def test_resolve_inside_shows_a_large_value_cut_short(tmp_path):
    with pytest.raises(NatslError, match="is not a file name") as err:
        resolve_inside(tmp_path, {"x": "y" * 10_000}, "'meta.json'")
    assert len(str(err.value)) < 600 and "\n" not in str(err.value)


def test_resolve_inside_ends_with_the_callers_fix(tmp_path):
    with pytest.raises(NatslError, match="'meta.json' names '../x', which leads outside the folder") as err:
        resolve_inside(tmp_path, "../x", "'meta.json'", fix="tokenize the data again")
    assert str(err.value).endswith(": tokenize the data again") and "use another copy" not in str(err.value)


def test_json_records_skip_every_line_that_is_not_an_object(tmp_path):
    """metrics.jsonl as a kill or another program leaves it: the sweep, the trainer's resume and the miniature's
    report read it through read_json_records, which keeps the objects in order and skips the rest."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + b"[" * 100_000 + b"\n" + b'{"step": 2, "note": "\xff"}\n' + b"7\n\n"
                     + b'"text"\n' + b'{"step": 3}\n' + b'{"step": 4, "loss": 1.')
    records = read_json_records(path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["note"] == "\ufffd"  # a byte that is not UTF-8 is replaced, the record kept


def test_resolve_inside_keeps_paths_that_stay_inside(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.bin").write_bytes(b"")
    (tmp_path / "link.bin").symlink_to(tmp_path / "a" / "b.bin")  # a link that stays inside
    assert resolve_inside(tmp_path, "a/../a/b.bin", "x") == tmp_path / "a/../a/b.bin"
    assert resolve_inside(tmp_path, "link.bin", "x") == tmp_path / "link.bin"


# ----------------------------------------------------------------------------- outputs onto inputs

def test_convert_never_replaces_a_training_checkpoint_even_with_force(ckpt, tmp_path):
    step = make_training_checkpoint(ckpt, tmp_path / "run" / "checkpoints" / "step_000004")
    before = snapshot(step)
    assert_one_line_error(run("convert", ckpt, step, "--force"), "training checkpoint", "not even with --force")
    assert_one_line_error(run("convert", ckpt, step / "inference", "--force"), "lies inside the training checkpoint")
    # Recognised by its files wherever it lies, and by its place in a run folder whatever it holds.
    loose = make_training_checkpoint(ckpt, tmp_path / "copied_step")
    assert_one_line_error(run("convert", ckpt, loose, "--force"), "training checkpoint")
    bare = tmp_path / "run2" / "checkpoints" / "step_000002"
    bare.mkdir(parents=True)
    assert_one_line_error(run("convert", ckpt, bare, "--force"), "training checkpoint")
    assert_one_line_error(run("convert", ckpt, tmp_path / "run", "--force"), "is not a folder natsl convert wrote")
    assert snapshot(step) == before
    with pytest.raises(NatslError, match="training checkpoint"):
        check_replaceable(loose)


def test_convert_of_a_training_checkpoint_elsewhere_still_works(ckpt, tmp_path):
    step = make_training_checkpoint(ckpt, tmp_path / "run" / "checkpoints" / "step_000004")
    result = run("convert", tmp_path / "run", tmp_path / "inference")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "inference").iterdir()) == ["config.json", "model.safetensors",
                                                                          "recipe.yaml", "tokenizer.json"]
    assert (step / "optimizer.safetensors").is_file()


def clash_cases():
    """(name, arguments of a command whose output clashes with one of its inputs, fragment). Paths are
    relative to the test's folder: `ckpt` a model folder, `tok` a folder with a tokenizer.json, `prompts.jsonl`,
    `essay.txt`, `data.txt` files."""
    return [
        ("convert onto its source", ["convert", "ckpt", "ckpt", "--force"], "is the input"),
        ("convert into its source", ["convert", "ckpt", "ckpt/sub"], "lies inside the input"),
        ("convert over a folder holding its source", ["convert", "ckpt", ".", "--force"], "holds the input"),
        ("convert onto its tokenizer", ["convert", "ckpt", "tok", "--from-hf", "--tokenizer", "tok/tokenizer.json",
                                        "--force"], "holds the input"),
        ("generate onto the weights", ["generate", "ckpt", "--prompt", "hi", "--output", "ckpt/model.safetensors"],
         "lies inside the input"),
        ("generate onto the prompts", ["generate", "ckpt", "--prompt-file", "prompts.jsonl", "--output",
                                       "prompts.jsonl"], "is the input"),
        ("eval-ppl into the checkpoint", ["eval-ppl", "ckpt", "--data", "data.txt", "--out", "ckpt"], "is the input"),
        ("eval-ppl over its data", ["eval-ppl", "ckpt", "--data", "data.txt", "--out", "data.txt"], "is the input"),
        ("eval-ruler around its essays", ["eval-ruler", "ckpt", "--essay-file", "essay.txt", "--out", "."],
         "holds the input"),
        ("eval-recall into the checkpoint", ["eval-recall", "ckpt", "--out", "ckpt/eval"], "lies inside the input"),
        ("eval-lm into the checkpoint", ["eval-lm", "ckpt", "--tasks", "x", "--out", "ckpt"], "is the input"),
        ("inspect-routing over its data", ["inspect-routing", "ckpt", "data.txt", "--out", "data.txt"], "is the input"),
        ("bench-latency into the checkpoint", ["bench-latency", "--checkpoint", "ckpt", "--out", "ckpt"],
         "is the input"),
        ("compare into the checkpoint", ["compare", "ckpt", "--out", "ckpt/compare"], "lies inside the input"),
        ("tokenize around its input", ["tokenize", "data.txt", "--train-tokenizer", "--out", "."], "holds the input"),
        ("tokenize onto its tokenizer", ["tokenize", "data.txt", "--tokenizer", "ckpt/tokenizer.json", "--out",
                                         "ckpt"], "holds the input"),
    ]


@pytest.mark.parametrize("args, fragment", [case[1:] for case in clash_cases()], ids=[c[0] for c in clash_cases()])
def test_no_command_writes_over_its_inputs(ckpt, tmp_path, monkeypatch, args, fragment):
    import shutil

    shutil.copytree(ckpt, tmp_path / "ckpt")
    (tmp_path / "tok").mkdir()
    shutil.copyfile(ckpt / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
    (tmp_path / "essay.txt").write_text("An essay. It has sentences.\n")
    (tmp_path / "data.txt").write_text(essay_text(5))
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(*args), fragment, "choose a")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args", [
    ["generate", "ckpt", "--prompt", "hi", "--output", "run/checkpoints/step_000004/out.jsonl"],
    ["eval-recall", "ckpt", "--out", "run/checkpoints/step_000004"],
    ["bench-latency", "--checkpoint", "ckpt", "--out", "run/checkpoints/step_000004/bench"],
    ["compare", "ckpt", "--out", "run/checkpoints/step_000004"],
], ids=["generate", "eval-recall", "bench-latency", "compare"])
def test_no_command_writes_into_a_training_checkpoint(ckpt, tmp_path, monkeypatch, args):
    import shutil

    shutil.copytree(ckpt, tmp_path / "ckpt")
    step = make_training_checkpoint(ckpt, tmp_path / "run" / "checkpoints" / "step_000004")
    before = snapshot(step)
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(*args), "the training checkpoint")
    assert snapshot(step) == before


def test_check_output_follows_links_and_skips_names_that_are_not_paths(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "data", target_is_directory=True)
    with pytest.raises(NatslError, match="is the input"):
        check_output(tmp_path / "alias", [tmp_path / "data"], "--out")
    check_output(tmp_path / "out", [tmp_path / "data", None, "tiny_hybrid", "HuggingFaceFW/fineweb-edu"], "--out")
    check_output(tmp_path / "data2", [tmp_path / "data"], "--out")  # a sibling whose name starts the same


# ----------------------------------------------------------------------------- a kill during a replacement

KILL = """
import os, signal, sys
from pathlib import Path
import natsl.atomic as atomic

target, content, step = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

def hook(name):
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)

def fill(tmp):
    (tmp / "data.txt").write_text(content)

atomic.crash_test_hook = hook
atomic.atomic_folder(target, fill)
"""


def killed_replacement(target: Path, content: str, step: str) -> None:
    """`atomic_folder(target)` writing data.txt = `content`, in a process SIGKILLed right after `step`."""
    proc = subprocess.run([sys.executable, "-c", KILL, str(target), content, step], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def write(target: Path, content: str) -> Path:
    return atomic_folder(target, lambda tmp: (tmp / "data.txt").write_text(content))


@pytest.mark.parametrize("step, existed, left, after", [
    ("filled", True, [".out.tmp-"], "old"),  # the new copy was incomplete
    ("complete", True, [".out.new-"], "old"),  # killed before anything was replaced
    ("set_aside", True, [".out.new-", ".out.old-"], "new"),  # between the two renames: no out at all
    ("published", True, [".out.old-"], "new"),  # replaced, the old copy not yet removed
    ("filled", False, [".out.tmp-"], None),
    ("complete", False, [".out.new-"], "new"),
])
def test_a_kill_at_any_step_of_a_replacement_is_put_right(tmp_path, step, existed, left, after):
    target = tmp_path / "out"
    if existed:
        write(target, "old")
    killed_replacement(target, "new", step)
    assert [name.split("-")[0] + "-" for name in hidden(tmp_path)] == left
    notes = []
    recover_folder(target, log=notes.append)
    assert hidden(tmp_path) == [] and len(notes) == len(left)
    assert (target / "data.txt").read_text() == after if after else not target.exists()
    # and the next write goes through
    write(target, "next")
    assert (target / "data.txt").read_text() == "next" and hidden(tmp_path) == []


def test_the_leftovers_of_natsl_before_pids_are_put_right(tmp_path):
    """The state the issue found: a killed `convert --force` of an older natsl left `.out.old-PID` (the
    previous copy) and `.out.tmp-XXXXXXXX` (the new copy, not known to be complete) and no out."""
    old = tmp_path / f".out.old-{os.getpid()}"  # this process writes nothing there: a leftover
    old.mkdir()
    (old / "data.txt").write_text("old")
    (tmp_path / ".out.tmp-ab12cd_9").mkdir()
    write(tmp_path / "out", "next")  # the next write restores, then replaces
    assert (tmp_path / "out" / "data.txt").read_text() == "next" and hidden(tmp_path) == []
    old.mkdir()
    (old / "data.txt").write_text("old")
    recover_folder(tmp_path / "other")  # another folder's recovery leaves them alone
    recover_folder(tmp_path / "out")  # out exists: the previous copy was already replaced
    assert hidden(tmp_path) == [] and (tmp_path / "out" / "data.txt").read_text() == "next"


def test_the_siblings_of_a_running_writer_are_left_alone(tmp_path):
    running = os.getppid()  # the process that started this test runs on
    names = [f".out.tmp-{running}-abcdefgh", f".out.new-{running}", f".out.old-{running}", ".out.old-notapid",
             ".out.tmp-toolongforatemporaryname"]
    for name in names:
        (tmp_path / name).mkdir()
    recover_folder(tmp_path / "out")
    assert hidden(tmp_path) == sorted(names) and not (tmp_path / "out").exists()


def test_an_error_between_the_renames_puts_the_previous_copy_back(tmp_path, monkeypatch):
    import natsl.atomic as atomic

    write(tmp_path / "out", "old")

    def fail(name):
        if name == "set_aside":
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(atomic, "crash_test_hook", fail)
    with pytest.raises(OSError) as err:
        write(tmp_path / "out", "new")
    assert err.value.filename == str(tmp_path / "out")
    assert (tmp_path / "out" / "data.txt").read_text() == "old" and hidden(tmp_path) == []


CONVERT_KILLED = """
import os, signal, sys
import natsl.atomic as atomic

def hook(name):
    if name == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)

atomic.crash_test_hook = hook
from natsl.cli.main import app
app(sys.argv[2:])
"""


@pytest.mark.parametrize("step, kept_dtype", [("set_aside", torch.bfloat16), ("filled", torch.float32)])
def test_convert_force_killed_between_its_renames_loses_nothing(ckpt, tmp_path, step, kept_dtype):
    out = tmp_path / "out"
    assert run("convert", ckpt, out, "--dtype", "fp32").exit_code == 0
    proc = subprocess.run([sys.executable, "-c", CONVERT_KILLED, step, "convert", str(ckpt), str(out), "--force",
                           "--dtype", "bf16"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert hidden(tmp_path)  # what the kill left
    again = run("convert", ckpt, out)  # the next run puts it right first, then finds out there
    assert again.exit_code == 2 and "pass --force" in again.stderr and "note:" in again.stderr
    assert hidden(tmp_path) == []
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {kept_dtype}
    natsl.load_checkpoint(out)


def test_training_resume_restores_a_step_folder_caught_between_renames(tmp_path):
    from natsl.training.state import remove_partial_writes

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    aside = checkpoints / f".step_000004.old-{os.getpid()}"
    aside.mkdir()
    (aside / "manifest.json").write_text("{}")
    (checkpoints / f".step_000006.tmp-{os.getpid()}-abcdefgh").mkdir()
    lines = []
    remove_partial_writes(tmp_path / "run", lines.append)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004"]
    assert any("restored" in line for line in lines) and any("unfinished checkpoint write" in line for line in lines)


# ----------------------------------------------------------------------------- a full disk

def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def safetensors_io_error(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


def safetensors_other_error(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: something unforeseen")


@pytest.mark.parametrize("to", ["hf", "natsl"])
@pytest.mark.parametrize("writer, fragment", [(enospc, "no space left on device"),
                                              (safetensors_io_error, "no space left on device"),
                                              (safetensors_other_error, "could not write")])
def test_a_failed_weights_write_is_one_line_and_leaves_nothing(ckpt, tmp_path, monkeypatch, to, writer, fragment):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", writer)
    result = run("convert", ckpt, tmp_path / "out", "--to", to)
    assert_one_line_error(result, fragment, str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []
