"""Damaged or foreign checkpoints and bad Hugging Face configs give one-line errors (exit 2, no
traceback); `natsl convert --force` never deletes what is not a natsl checkpoint; converted folders
get the usual permissions."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli.main import app
from natsl.errors import NatslError
from natsl.eval.convert import HF_MODEL_TYPE, hf_recipe

from cli_checks import assert_one_line_error


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny NAtS-L Hybrid model folder as natsl writes it (random weights, no tokenizer)."""
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    return save_model_folder(tmp_path_factory.mktemp("ckpt") / "tiny", natsl.build_model(recipe), recipe)


def variant(ckpt, folder, config=None, tensors=None):
    """A copy of `ckpt` with `config(dict)` / `tensors(dict)` applied in place."""
    shutil.copytree(ckpt, folder)
    if config:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))
    if tensors:
        state = load_file(str(folder / "model.safetensors"))
        tensors(state)
        save_file(state, str(folder / "model.safetensors"))
    return folder


# ----------------------------------------------------------------------------- config.json without a full recipe

@pytest.mark.parametrize("edit", [lambda d: d.pop("recipe"), lambda d: d.update(recipe=None),
                                  lambda d: d["recipe"].pop("model")], ids=["absent", "null", "no-model"])
def test_config_without_recipe(ckpt, tmp_path, edit):
    bad = variant(ckpt, tmp_path / "bad", config=edit)
    with pytest.raises(NatslError, match="no recipe with a model section"):
        natsl.load_checkpoint(bad)
    assert_one_line_error(run("convert", bad, tmp_path / "out"), "no recipe")
    assert_one_line_error(run("bench-latency", "--checkpoint", bad, "--device", "cpu", "--out", tmp_path / "b"),
                          "no recipe")
    assert_one_line_error(run("eval-ruler", bad, "--device", "cpu", "--out", tmp_path / "r"), "no recipe")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keys", [["hidden_size"], ["natsl_rope"], ["block_size", "natsl_rope"]])
def test_incomplete_model_section(ckpt, tmp_path, keys):
    """A missing shape key would end in a size mismatch; a missing non-shape key (natsl_rope) would
    load silently with its default: another model."""
    bad = variant(ckpt, tmp_path / "bad", config=lambda d: [d["recipe"]["model"].pop(k) for k in keys])
    assert_one_line_error(run("convert", bad, tmp_path / "out"), f"lacks {', '.join(keys)}", "config.json")


# ----------------------------------------------------------------------------- weights that do not fit the config

def test_wrong_shaped_weights(ckpt, tmp_path):
    name = "layers.1.mixer.proj.q_proj.weight"

    def widen(state):
        state[name] = torch.zeros(state[name].shape[0] + 2, state[name].shape[1])

    bad = variant(ckpt, tmp_path / "bad", tensors=widen)
    assert_one_line_error(run("convert", bad, tmp_path / "out"), name, "shape (66, 64)", "needs (64, 64)")


def test_missing_and_unexpected_tensors(ckpt, tmp_path):
    gone = variant(ckpt, tmp_path / "gone", tensors=lambda s: s.pop("norm.weight"))
    with pytest.raises(NatslError, match=r"lacks tensor norm.weight \(the config needs shape \(64,\)\)"):
        natsl.load_checkpoint(gone)
    extra = variant(ckpt, tmp_path / "extra", tensors=lambda s: s.update(mystery=torch.zeros(3)))
    with pytest.raises(NatslError, match="has tensor mystery that the config's model does not have"):
        natsl.load_checkpoint(extra)


def test_vocab_size_not_matching_the_weights(ckpt, tmp_path):
    def edit(config):  # a folder from before model_sha256, which would refuse any edit first
        config["recipe"]["model"].update(vocab_size=1000)
        del config["model_sha256"]

    bad = variant(ckpt, tmp_path / "bad", config=edit)
    assert_one_line_error(run("convert", bad, tmp_path / "out"), "embed.weight", "(1024, 64)", "(1000, 64)")


# ----------------------------------------------------------------------------- --from-hf with bad config values

HF_BASE = {"model_type": HF_MODEL_TYPE, "num_heads": 2, "head_dim": 32, "expand_v": 2.0, "num_attn_heads": 4,
           "num_hidden_layers": 4, "gdn_layers": [0, 2], "attn_qk_norm": True, "attn_with_short_conv": True,
           "hidden_size": 64, "vocab_size": 1024, "nats_block_size": 64}
HF_TENSORS = {"model.layers.1.attn.q_norm.weight": torch.zeros(16),
              "model.layers.0.mlp.gate_proj.weight": torch.zeros(192, 64)}


def test_hf_base_config_is_accepted():
    assert hf_recipe(HF_BASE, HF_TENSORS, "base").model.num_heads == 2  # the cases below change one key each


@pytest.mark.parametrize("key, value", [("num_heads", "abc"), ("num_heads", 0), ("gdn_layers", ["x"]),
                                        ("gdn_layers", "0"), ("hidden_size", "64x"), ("num_hidden_layers", 2.5),
                                        ("expand_v", 0), ("norm_eps", "tiny"), ("use_gate", "false"),
                                        ("ops_for_incomplete_chunks", ["all"])])
def test_hf_config_bad_values(key, value):
    with pytest.raises(NatslError, match=key) as err:
        hf_recipe({**HF_BASE, key: value}, HF_TENSORS, "bad")
    assert "\n" not in str(err.value)


def test_hf_config_bad_value_through_the_cli(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**HF_BASE, "num_heads": "abc"}))
    save_file(HF_TENSORS, str(src / "model.safetensors"))
    assert_one_line_error(run("convert", src, tmp_path / "out", "--from-hf"), "'num_heads'", "'abc'")
    (src / "config.json").write_text(json.dumps({**HF_BASE, "num_heads": 0}))
    assert_one_line_error(run("convert", src, tmp_path / "out", "--from-hf"), "'num_heads'")


# ----------------------------------------------------------------------------- --force and permissions

def test_force_refuses_what_is_not_a_checkpoint(ckpt, tmp_path):
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    assert_one_line_error(run("convert", ckpt, unrelated, "--force"), "not a folder natsl convert wrote", "notes.txt")
    assert (unrelated / "notes.txt").read_text() == "keep me"

    plain = tmp_path / "plain.txt"
    plain.write_text("keep me too")
    assert_one_line_error(run("convert", ckpt, plain, "--force"), "names a file, not a folder")
    assert plain.read_text() == "keep me too"

    # A checkpoint folder with one extra file of the user's, and a Hugging Face folder, are not ours either.
    mixed = variant(ckpt, tmp_path / "mixed")
    (mixed / "notes.txt").write_text("mine")
    assert_one_line_error(run("convert", ckpt, mixed, "--force"), "notes.txt")
    assert (mixed / "notes.txt").exists()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"x": torch.zeros(1)}, str(hf / "model.safetensors"))
    assert_one_line_error(run("convert", ckpt, hf, "--force"), "not a natsl config")
    assert json.loads((hf / "config.json").read_text()) == {"model_type": "llama"}


def test_force_replaces_a_previous_convert_output_or_an_empty_folder(ckpt, tmp_path):
    out = tmp_path / "out"
    assert run("convert", ckpt, out).exit_code == 0
    result = run("convert", ckpt, out, "--force", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("convert", ckpt, empty, "--force").exit_code == 0
    assert (empty / "model.safetensors").is_file()


def test_converted_folder_has_the_usual_permissions(ckpt, tmp_path):
    old = os.umask(0o022)
    try:
        assert run("convert", ckpt, tmp_path / "out").exit_code == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == 0o755
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name


# ----------------------------------------------------------------------------- issue 31

def test_an_integer_weight_is_refused_not_cast(ckpt, tmp_path):
    name = "embed.weight"
    bad = variant(ckpt, tmp_path / "bad", tensors=lambda s: s.update({name: s[name].to(torch.int64)}))
    with pytest.raises(NatslError, match=rf"tensor {name} is int64, not a floating-point type"):
        natsl.load_checkpoint(bad)


@pytest.mark.parametrize("value", [None, [1, 2]], ids=["null", "list"])
def test_a_config_that_is_not_an_object_is_called_damaged(ckpt, tmp_path, value):
    bad = variant(ckpt, tmp_path / "bad")
    (bad / "config.json").write_text(json.dumps(value))
    with pytest.raises(NatslError) as err:
        natsl.load_checkpoint(bad)
    assert "not a natsl config (a JSON object): the file is damaged" in str(err.value)
    assert "another model type" not in str(err.value)


def test_a_step_folder_is_checked_against_its_manifest_on_load(tmp_path):
    """A flipped byte in a training step folder's weights: refused for inference too, not only on resume."""
    from natsl.training import state as S

    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    folder = S.save_checkpoint(tmp_path, 3, model.state_dict(), ({}, []), recipe, None,
                               {"step": 3, "tokens_seen": 0}, {}, keep_last=0)
    natsl.load_checkpoint(folder)  # intact
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(NatslError, match="model.safetensors' is damaged: its SHA-256 differs"):
        natsl.load_checkpoint(folder)
    assert_one_line_error(run("convert", folder, tmp_path / "out"), "SHA-256")


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.txt", "sub/../../outside.txt"])
def test_a_manifest_naming_files_outside_its_folder_is_refused_unread(tmp_path, name):
    """A manifest is untrusted: its names stay inside the step folder (no size or hash of other files)."""
    from natsl.training import state as S

    recipe = natsl.load_recipe("tiny_hybrid")
    model = natsl.build_model(recipe)
    folder = S.save_checkpoint(tmp_path / "run", 3, model.state_dict(), ({}, []), recipe, None,
                               {"step": 3, "tokens_seen": 0}, {}, keep_last=0)
    (tmp_path / "run" / "checkpoints" / "outside.txt").write_text("x")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = 1
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(NatslError, match="natsl reads only files inside"):
        natsl.load_checkpoint(folder)
    assert_one_line_error(run("convert", folder, tmp_path / "out"), "natsl reads only files inside")


def test_write_errors_name_the_target_not_the_hidden_temporary(tmp_path, monkeypatch):
    import errno
    import tempfile

    from natsl.checkpoint import atomic_folder
    from natsl.atomic import write_text as atomic_write_text

    def read_only(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(dir) / ".x.tmp-abc"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(PermissionError) as err:
        atomic_folder(tmp_path / "model", lambda tmp: None)
    assert err.value.filename == str(tmp_path / "model")
    monkeypatch.undo()

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(src))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError) as err:
        atomic_write_text(tmp_path / "notes.json", "{}")
    assert err.value.filename == str(tmp_path / "notes.json") and err.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


# ----------------------------------------------------------------------------- a checkpoint's tokenizer, untrusted

def tokenizer_folder(ckpt, folder, vocab: dict, section):
    """`ckpt` with a word-level tokenizer.json of `vocab` and config.json's tokenizer section `section`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    variant(ckpt, folder, config=lambda d: d.update(tokenizer=section))
    inner.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_with_an_id_past_the_vocabulary_is_refused_though_it_has_few_entries(ckpt, tmp_path):
    """Four entries, one of them id 70000: its id space, not its count, is checked against the embedding."""
    from natsl.tokenizer import Tokenizer

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "cat": 50, "the": 70000}
    folder = tokenizer_folder(ckpt, tmp_path / "sparse", vocab, {"eos_id": 0})
    assert Tokenizer.from_file(folder).vocab_size == 70001
    with pytest.raises(NatslError, match="70,001 entries but the model's vocabulary only 1,024"):
        natsl.load_checkpoint(folder)
    assert_one_line_error(run("generate", folder, "--prompt", "the cat", "--device", "cpu"), "70,001 entries")


@pytest.mark.parametrize("section", [{"eos_id": 100000}, {"eos_id": -1}, {"eos_id": "x"}, {"eos_id": 1.5},
                                     {"eos_id": True}, [1]], ids=str)
def test_a_tokenizer_section_naming_no_id_is_refused(ckpt, tmp_path, section):
    folder = tokenizer_folder(ckpt, tmp_path / "eos", {"<|endoftext|>": 0, "[UNK]": 1, "cat": 2}, section)
    with pytest.raises(NatslError, match="config.json'.*(no id of its tokenizer|not an object)"):
        natsl.load_checkpoint(folder)


# ----------------------------------------------------------------------------- a training step's state, untrusted

def trained_step(tmp_path):
    """A real step folder of tiny_hybrid after one optimizer step: model, AdamW state, RNG, trainer state."""
    from natsl.training import state as S

    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (1, 32))).float().mean().backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    folder = S.save_checkpoint(tmp_path / "run", 1, model.state_dict(), S.optimizer_to_tensors(opt, names), recipe,
                               None, {"step": 1, "tokens_seen": 32, "samples_seen": 1},
                               S.rng_tensors([S.capture_rng(torch.device("cpu"))]), keep_last=0)
    return folder, model, opt, names


def rewrite(folder, name, write):
    """Change one file of a step folder and its manifest entry, as someone editing the folder can."""
    import hashlib

    write(folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = (folder / name).stat().st_size
    manifest["sha256"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit", [{"step": "4"}, {"step": -5}, {"step": 4.5}, {"step": 10**30}, {"tokens_seen": "x"},
                                  {"samples_seen": -100}, {"samples_seen": 1.5}, {"bad_steps": "x"},
                                  {"optimizer_groups": "x"}, {"optimizer_groups": [1]}], ids=str)
def test_a_trainer_state_that_cannot_resume_is_refused(tmp_path, edit):
    from natsl.training import state as S

    folder, *_ = trained_step(tmp_path)
    rewrite(folder, "trainer_state.json",
            lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), **edit})))
    with pytest.raises(NatslError, match="trainer_state.json' is corrupt"):
        S.load_training_checkpoint(folder)
    result = run("train", "tiny_hybrid", "--resume", folder, "--out", tmp_path / "again", "--device", "cpu")
    assert_one_line_error(result, "trainer_state.json' is corrupt")


@pytest.mark.parametrize("change", ["cut", "float", "missing"])
def test_an_rng_state_that_is_not_one_is_refused(tmp_path, change):
    from natsl.training import state as S

    folder, *_ = trained_step(tmp_path)

    def write(path):
        tensors = load_file(str(path))
        if change == "cut":
            tensors["cpu_rank0"] = tensors["cpu_rank0"][:10].clone()
        elif change == "float":
            tensors["cpu_rank0"] = tensors["cpu_rank0"].float()
        else:
            tensors = {"other": tensors["cpu_rank0"]}
        save_file(tensors, str(path))

    rewrite(folder, "rng.safetensors", write)
    with pytest.raises(NatslError, match="rng.safetensors'"):
        S.load_training_checkpoint(folder)


@pytest.mark.parametrize("change", ["shape", "int", "missing"])
def test_optimizer_moments_that_do_not_fit_their_parameter_are_refused(tmp_path, change):
    from natsl.training import state as S

    folder, model, opt, names = trained_step(tmp_path)
    loaded = S.load_training_checkpoint(folder)
    tensors = dict(loaded.optimizer_tensors)
    key = "embed.weight::exp_avg" if "embed.weight::exp_avg" in tensors else sorted(k for k in tensors
                                                                                     if k.endswith("::exp_avg"))[0]
    if change == "shape":
        tensors[key] = torch.zeros(3)
    elif change == "int":
        tensors[key] = tensors[key].to(torch.int32)
    else:
        del tensors[key]
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NatslError, match="the optimizer state in"):
        S.optimizer_from_tensors(fresh, names, tensors, loaded.trainer_state["optimizer_groups"], str(folder))
    S.optimizer_from_tensors(fresh, names, dict(loaded.optimizer_tensors), loaded.trainer_state["optimizer_groups"],
                             str(folder))  # the intact state loads


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_checkpoint_file_linked_from_outside_its_folder_is_not_read(ckpt, tmp_path, name):
    import os

    folder = variant(ckpt, tmp_path / "linked")
    outside = tmp_path / f"outside-{name}"
    (folder / name).rename(outside)
    os.symlink(outside, folder / name)
    with pytest.raises(NatslError, match="is a link to a file outside the folder"):
        natsl.load_checkpoint(folder)
    os.unlink(folder / name)
    os.symlink(os.path.relpath(tmp_path / "linked" / "inner", folder), folder / name)  # a link inside is fine
    outside.rename(folder / "inner")
    natsl.load_checkpoint(folder)
