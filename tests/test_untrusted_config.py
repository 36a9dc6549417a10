"""Untrusted recipes, sweep specs, model configs and command arguments (issue 53): every bad input of each
class below is a one-line error with exit code 2, parametrized so that no later change reopens a class.

Classes: YAML alias bombs and self-containing aliases; recipes without the sections that would fall back to
the 800M defaults; run names and train.out_dir that leave runs/; JSON files from checkpoint, Hugging Face
and data folders that are nested too deeply, not UTF-8 or not JSON; model configs edited after natsl wrote
them (block_size, a newer format_version); an export run by another natsl; eval-lm's --limit,
--max-length and --num-fewshot; --keep-fraction on a model without NAtS-L layers."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import natsl
import natsl.config
from natsl.checkpoint import save_model_folder
from natsl.cli.main import app
from natsl.config import load_recipe, load_yaml_text, recipe_from_dict
from natsl.errors import NatslError
from natsl.eval.convert import HF_MODEL_TYPE

from cli_checks import assert_one_line_error

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
        "head_k_dim": 16, "head_v_dim": 32, "softmax_heads_per_group": 2, "attn_num_heads": 2, "attn_head_dim": 16,
        "block_size": 16, "natsl_rope": False, "max_seq_len": 256}
TRAIN = {"seq_len": 32, "tokens_per_step": 64, "micro_batch_size": 2, "total_tokens": 64, "dtype": "fp32"}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def write_recipe(path, text):
    path.write_text(text)
    return path


def model_folder(folder, **model):
    recipe = recipe_from_dict({"name": folder.name, "model": {**TINY, **model}, "train": TRAIN})
    torch.manual_seed(0)
    return save_model_folder(folder, natsl.build_model(recipe), recipe)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny NAtS-L Hybrid model folder (GDN, NAtS-L)."""
    return model_folder(tmp_path_factory.mktemp("ckpt") / "hybrid", natsl_layers=[1])


@pytest.fixture(scope="module")
def gdn(tmp_path_factory):
    """A tiny model folder without NAtS-L layers."""
    return model_folder(tmp_path_factory.mktemp("ckpt") / "gdn")


@pytest.fixture(scope="module")
def hf_export(hybrid, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "export"
    assert run("convert", hybrid, out, "--to", "hf").exit_code == 0
    return out


def edited_copy(src, dest, edit, name="config.json"):
    shutil.copytree(src, dest)
    data = json.loads((dest / name).read_text())
    edit(data)
    (dest / name).write_text(json.dumps(data))
    return dest


# ----------------------------------------------------------------------------- YAML: aliases

def laughs(levels: int, width: int = 9, key_style: bool = False) -> str:
    """The billion-laughs document: each level an anchored list (or mapping) of `width` aliases of the last."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        if key_style:
            items = ", ".join(f"k{j}: *l{i - 1}" for j in range(width))
            lines.append(f"l{i}: &l{i} {{{items}}}")
        else:
            lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


# The classic document: nine levels, 9^9 "lol"s from 342 bytes.
BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""
BOMBS = {
    "billion laughs": BILLION_LAUGHS,
    "twelve levels": laughs(12),
    "mappings of aliases": laughs(6, key_style=True),
    "six levels (0.5M values)": laughs(5),
    "merge keys": "a: &a {x: 1, y: 2, z: 3}\n" + "".join(
        f"m{i}: &m{i} {{<<: *{'a' if i == 0 else f'm{i - 1}'}, " + ", ".join(f"k{j}: *{'a' if i == 0 else f'm{i - 1}'}"
                                                                         for j in range(8)) + "}\n" for i in range(8)),
    "inside a model section": "model:\n  natsl_layers: &x [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"  k{i}: &x{i} [{', '.join(['*x' if i == 0 else f'*x{i - 1}'] * 10)}]\n" for i in range(6)),
}


@pytest.mark.parametrize("text", BOMBS.values(), ids=BOMBS.keys())
def test_alias_bombs_are_refused_as_recipes(tmp_path, text):
    path = write_recipe(tmp_path / "bomb.yaml", text)
    with pytest.raises(NatslError, match="expands to more than 100000 values") as err:
        load_recipe(path)
    assert "\n" not in str(err.value) and "bomb.yaml" in str(err.value)


@pytest.mark.parametrize("command", [["info"], ["train"]])
def test_the_billion_laughs_through_the_cli_is_one_line(tmp_path, command):
    path = write_recipe(tmp_path / "bomb.yaml", BILLION_LAUGHS)
    assert_one_line_error(run(*command, path), "'", "bomb.yaml", "expands to more than", "write the values out")


def test_an_alias_bomb_in_a_sweep_spec_is_refused(tmp_path):
    from natsl.training.sweep import load_spec

    path = write_recipe(tmp_path / "sweep.yaml", BILLION_LAUGHS)
    with pytest.raises(NatslError, match="sweep spec .*sweep.yaml' expands to more than"):
        load_spec(path, tmp_path / "out")


def test_an_alias_bomb_in_an_override_is_refused():
    recipe = recipe_from_dict({"model": TINY})
    bomb = "{a: &a [1,1,1,1,1,1,1,1,1,1], b: &b [" + ",".join(["*a"] * 10) + "], c: &c [" + ",".join(["*b"] * 10) + \
        "], d: &d [" + ",".join(["*c"] * 10) + "], e: &e [" + ",".join(["*d"] * 10) + "], f: [" + ",".join(["*e"] * 10) + "]}"
    with pytest.raises(NatslError, match="override value .* expands to more than"):
        natsl.config.apply_overrides(recipe, [f"model.natsl_layers={bomb}"])


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "a: &a {b: *a}\n", "a: &a [1, [2, *a]]\n"])
def test_an_alias_inside_what_it_names_is_refused(text):
    with pytest.raises(NatslError, match="alias inside the value it names"):
        load_yaml_text(text, "recipe file 'x.yaml'")


def test_the_bound_counts_every_alias_as_a_copy(monkeypatch):
    monkeypatch.setattr(natsl.config, "MAX_YAML_VALUES", 12)
    # root + key a + [ + 3 items] + key b + [ + 3 aliases counted as 4 each ] = 1 + 1 + 4 + 1 + 1 + 12 = 20
    text = "a: &a [1, 2, 3]\nb: [*a, *a, *a]\n"
    with pytest.raises(NatslError, match="expands to more than 12 values"):
        load_yaml_text(text, "spec")
    monkeypatch.setattr(natsl.config, "MAX_YAML_VALUES", 20)
    assert load_yaml_text(text, "spec") == {"a": [1, 2, 3], "b": [[1, 2, 3]] * 3}


def test_sensible_aliases_and_keys_in_two_mappings_still_load():
    text = "base: &base {lr: 0.1, seed: 1}\nfirst: *base\nsecond: {<<: *base, seed: 2}\n"
    assert load_yaml_text(text, "spec") == {"base": {"lr": 0.1, "seed": 1}, "first": {"lr": 0.1, "seed": 1},
                                            "second": {"lr": 0.1, "seed": 2}}


def test_yaml_is_read_only_through_the_bounded_loader():
    """No module of natsl parses YAML itself (yaml.safe_load, yaml.load, yaml.compose): everything goes
    through natsl.config.load_yaml_text."""
    from pathlib import Path

    root = Path(natsl.__file__).parent
    offenders = [str(path.relative_to(root)) for path in root.rglob("*.py") if path.name != "config.py"
                 for call in ("yaml.safe_load(", "yaml.load(", "yaml.compose(", "yaml.full_load(", "yaml.unsafe_load(")
                 if call in path.read_text(encoding="utf-8")]
    assert offenders == []


# ----------------------------------------------------------------------------- recipes without their sections

MISSING = {
    "no model": ("name: x\ntrain: {seed: 1}\n", "has no model section", "800M default model"),
    "model: null": ("name: x\nmodel:\n", "has an empty model section", "800M default model"),
    "model: {}": ("name: x\nmodel: {}\n", "has an empty model section", "800M default model"),
    "only a name": ("name: x\n", "has no model section", "800M default model"),
}


@pytest.mark.parametrize("text, problem, default", MISSING.values(), ids=MISSING.keys())
@pytest.mark.parametrize("command", ["info", "train"])
def test_a_recipe_without_a_model_section_is_refused(tmp_path, text, problem, default, command):
    path = write_recipe(tmp_path / "r.yaml", text)
    assert_one_line_error(run(command, path, "--out", tmp_path / "run") if command == "train" else run(command, path),
                          problem, default, "write the model section out")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("train", ["", "train:\n", "train: {}\n"], ids=["absent", "null", "empty"])
def test_train_refuses_a_recipe_without_a_train_section(tmp_path, train):
    path = write_recipe(tmp_path / "r.yaml", f"name: x\nmodel: {json.dumps(TINY)}\n{train}")
    assert_one_line_error(run("train", path, "--out", tmp_path / "run"), "train section", "50B tokens")
    assert not (tmp_path / "run").exists()
    assert load_recipe(path).model.hidden_size == 32  # a model-only recipe is fine where nothing trains


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_train_refuses_max_steps_below_one_before_any_output(tmp_path, steps):
    result = run("train", "tiny_hybrid", "--max-steps", steps, "--out", tmp_path / "run")  # it prints an estimate
    assert_one_line_error(result, f"--max-steps must be at least 1, got {steps}")
    assert result.stdout.strip() == ""  # no estimate first
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("clash", ["recipe", "init_from", "data"])
def test_train_refuses_an_out_folder_that_holds_what_it_reads(tmp_path, clash):
    """The run writes recipe.yaml, checkpoints/ and metrics into --out: never over or among its own inputs."""
    out = tmp_path / "out"
    out.mkdir()
    recipe = write_recipe((out if clash == "recipe" else tmp_path) / "r.yaml",
                          f"name: x\nmodel: {json.dumps(TINY)}\ntrain: {json.dumps(TRAIN)}\n")
    before = recipe.read_bytes()
    sets = []
    if clash == "init_from":
        save_model_folder(out, natsl.build_model(recipe_from_dict({"model": TINY})), recipe_from_dict({"model": TINY}))
        sets = ["--set", f"train.init_from={out}"]
    elif clash == "data":
        (out / "meta.json").write_text("{}")
        sets = ["--set", f"data.path={out}"]
    result = run("train", recipe, *sets, "--out", out, "--device", "cpu", "--max-steps", 1)
    assert_one_line_error(result, f"--out {str(out)!r}", "the input", "choose a --out path apart from the inputs")
    assert recipe.read_bytes() == before and not (out / "checkpoints").exists()


# ----------------------------------------------------------------------------- run folders outside runs/

BAD_NAMES = ["../escaped", "../../escaped", "/tmp/escaped", "a/b", "..", ".hidden", "two words", "", "x" * 200]
BAD_OUT_DIRS = ["/tmp/natsl-escaped/{name}", "../{name}", "runs/../../{name}", "elsewhere/{name}", "runs",
                "runs/{name}/../../..", "runs\\..\\{name}"]


def recipe_text(name=None, out_dir=None, **model):
    train = {**TRAIN, **({"out_dir": out_dir} if out_dir is not None else {})}
    return (f"name: {json.dumps(name)}\n" if name is not None else "") + \
        f"model: {json.dumps({**TINY, **model})}\ntrain: {json.dumps(train)}\n"


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_recipe_name_that_leaves_runs_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "r.yaml", recipe_text(name=name))
    assert_one_line_error(run("train", path), "cannot name a run folder", "set `name:`", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.parametrize("out_dir", BAD_OUT_DIRS)
def test_a_train_out_dir_outside_runs_is_refused(tmp_path, monkeypatch, out_dir):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "r.yaml", recipe_text(name="ok", out_dir=out_dir))
    assert_one_line_error(run("train", path), "train.out_dir", "not a folder inside runs/", "pass --out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_a_file_stem_that_is_no_run_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "my recipe.yaml", recipe_text())
    assert_one_line_error(run("train", path), "'my recipe' cannot name a run folder")


def test_a_plain_name_trains_into_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_recipe(tmp_path / "r.yaml", recipe_text(name="tiny-run_1.v2", vocab_size=512))  # the builtin corpus's tokenizer
    result = run("train", path, "--max-steps", "1", "--device", "cpu", "--no-progress")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "tiny-run_1.v2" / "checkpoints").is_dir()


# ----------------------------------------------------------------------------- JSON from folders

def nested(depth: int = 5000) -> bytes:
    return ('{"a": ' * depth + "1" + "}" * depth).encode()


BAD_JSON = {
    "nested 5000 deep": nested(),
    "nested lists": b"[" * 5000 + b"]" * 5000,
    "not utf-8": b'{"format": "natsl\xff\xfe"}',
    "an integer of 5000 digits": b'{"format": ' + b"1" * 5000 + b"}",
    "not JSON": b'{"format": "natsl",',
}


@pytest.mark.parametrize("content", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_a_bad_checkpoint_config_is_one_line(hybrid, tmp_path, content):
    bad = tmp_path / "bad"
    shutil.copytree(hybrid, bad)
    (bad / "config.json").write_bytes(content)
    for args in (["info", bad, "--no-forward"], ["convert", bad, tmp_path / "out"], ["convert", bad, tmp_path / "hf", "--to", "hf"]):
        assert_one_line_error(run(*args), "config.json", "use another checkpoint")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_a_bad_manifest_is_one_line(hybrid, tmp_path, content):
    bad = tmp_path / "bad"
    shutil.copytree(hybrid, bad)
    (bad / "manifest.json").write_bytes(content)
    assert_one_line_error(run("convert", bad, tmp_path / "out"), "manifest.json", "use another")


@pytest.mark.parametrize("content", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_a_bad_hf_config_is_one_line(hf_export, tmp_path, content):
    bad = tmp_path / "hf"
    shutil.copytree(hf_export, bad)
    (bad / "config.json").write_bytes(content)
    assert_one_line_error(run("convert", bad, tmp_path / "out", "--from-hf"), "config.json")


@pytest.mark.parametrize("content", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_a_bad_hf_weight_index_is_one_line(tmp_path, content):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "model_type": HF_MODEL_TYPE, "num_heads": 2, "head_dim": 32, "expand_v": 2.0, "num_attn_heads": 4,
        "num_hidden_layers": 4, "gdn_layers": [0, 2], "hidden_size": 64, "vocab_size": 1024, "nats_block_size": 64}))
    save_file({"x": torch.zeros(1)}, str(src / "model-00001.safetensors"))
    (src / "model.safetensors.index.json").write_bytes(content)
    assert_one_line_error(run("convert", src, tmp_path / "out", "--from-hf"), "index")


@pytest.mark.parametrize("content", BAD_JSON.values(), ids=BAD_JSON.keys())
def test_a_bad_data_meta_is_one_line(hybrid, tmp_path, content):
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_bytes(content)
    (data / "train_00000.bin").write_bytes(bytes(64))
    assert_one_line_error(run("eval-ppl", hybrid, "--data", data, "--device", "cpu", "--out", tmp_path / "o",
                              "--no-progress"), "meta.json")


JSONL_READERS = {
    "tokenize": lambda ckpt, docs, out: ["tokenize", docs, "--out", out, "--train-tokenizer", "--vocab-size", "300",
                                                     "--no-progress"],
    "generate": lambda ckpt, docs, out: ["generate", ckpt, "--prompt-file", docs, "--device", "cpu"],
}


@pytest.mark.parametrize("command", JSONL_READERS.values(), ids=JSONL_READERS.keys())
def test_a_deeply_nested_jsonl_line_is_one_line(hybrid, tmp_path, command):
    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(b'{"text": "hello", "prompt": "hello"}\n' + nested() + b"\n")
    assert_one_line_error(run(*command(hybrid, docs, tmp_path / "o")), "docs.jsonl", "2 is nested too deeply")


def test_json_files_are_bounded_in_size(tmp_path):
    from natsl.files import read_json

    path = tmp_path / "big.json"
    path.write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(NatslError, match="larger than 1000 bytes"):
        read_json(path, "fix it", max_bytes=1000)
    assert read_json(path, "fix it", max_bytes=4000)["pad"] == "x" * 2000


def test_a_fifo_is_never_opened(tmp_path):
    import os

    from natsl.files import read_json

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # open() would wait for a writer forever
    with pytest.raises(NatslError, match="not a regular file"):
        read_json(fifo, "fix it")


# ----------------------------------------------------------------------------- configs edited after natsl wrote them

CHECKPOINT_EDITS = {
    "block_size 16 -> 32": (lambda d: d["recipe"]["model"].update(block_size=32), "model section differs"),
    "natsl_rope flipped": (lambda d: d["recipe"]["model"].update(natsl_rope=True), "model section differs"),
    "format_version 999": (lambda d: d.update(format_version=999), "format_version 999, written by natsl"),
    "format_version 999 of a named natsl": (lambda d: d.update(format_version=999, natsl_version="2099.1.1.1"),
                                            "written by natsl 2099.1.1.1"),
    "format_version '1'": (lambda d: d.update(format_version="1"), "not a format version natsl wrote"),
    "format_version 0": (lambda d: d.update(format_version=0), "not a format version natsl wrote"),
    "no format_version": (lambda d: d.pop("format_version"), "format_version None"),
    "block_size 0": (lambda d: d["recipe"]["model"].update(block_size=0), "model.block_size"),
}


@pytest.mark.parametrize("edit, message", CHECKPOINT_EDITS.values(), ids=CHECKPOINT_EDITS.keys())
def test_an_edited_checkpoint_config_is_refused(hybrid, tmp_path, edit, message):
    bad = edited_copy(hybrid, tmp_path / "bad", edit)
    with pytest.raises(NatslError, match=message):
        natsl.load_checkpoint(bad)
    for args in (["info", bad, "--no-forward"], ["convert", bad, tmp_path / "out"]):
        assert_one_line_error(run(*args), "config.json")


def test_a_converted_folder_refuses_the_same_edits(hybrid, tmp_path):
    assert run("convert", hybrid, tmp_path / "conv").exit_code == 0
    bad = edited_copy(tmp_path / "conv", tmp_path / "bad", lambda d: d["recipe"]["model"].update(block_size=8))
    assert_one_line_error(run("info", bad, "--no-forward"), "model section differs", "block_size")


def test_a_newer_format_names_the_fix(hybrid, tmp_path):
    bad = edited_copy(hybrid, tmp_path / "bad", lambda d: d.update(format_version=999, natsl_version="2099.1.1.1"))
    assert_one_line_error(run("info", bad, "--no-forward"), "format_version 999", "written by natsl 2099.1.1.1",
                          f"this natsl ({natsl.__version__})", "pip install -U natsl")


HF_EDITS = {
    "block_size 16 -> 32": (lambda d: d["natsl_recipe"]["model"].update(block_size=32), "model section differs"),
    "natsl_format_version 999": (lambda d: d.update(natsl_format_version=999, natsl_version="2099.1.1.1"),
                                 "natsl_format_version 999, written by natsl 2099.1.1.1"),
    "natsl_format_version 'x'": (lambda d: d.update(natsl_format_version="x"), "not a format version natsl wrote"),
}


@pytest.mark.parametrize("edit, message", HF_EDITS.values(), ids=HF_EDITS.keys())
def test_an_edited_hf_export_is_refused(hf_export, tmp_path, edit, message):
    bad = edited_copy(hf_export, tmp_path / "bad", edit)
    assert_one_line_error(run("convert", bad, tmp_path / "out", "--from-hf"), "config.json")
    from natsl.hf.modeling_natsl import NatslConfig, NatslForCausalLM

    config = json.loads((bad / "config.json").read_text())
    with pytest.raises(NatslError, match=message):  # the remote code's path (transformers builds the same config)
        NatslForCausalLM(NatslConfig(**{k: v for k, v in config.items() if k not in ("auto_map", "architectures")}))


# ----------------------------------------------------------------------------- version skew

def test_exports_and_checkpoints_record_the_natsl_that_wrote_them(hybrid, hf_export):
    assert json.loads((hybrid / "config.json").read_text())["natsl_version"] == natsl.__version__
    config = json.loads((hf_export / "config.json").read_text())
    assert config["natsl_version"] == natsl.__version__ and config["natsl_format_version"] == 1


@pytest.mark.parametrize("missing", [("natsl.models.lm", "CausalLM"), ("natsl.hf.export", "check_export_record")])
def test_remote_code_on_another_natsl_says_which_to_install(hf_export, monkeypatch, missing):
    """The installed natsl lacks a name the exporting natsl had: natsl_runtime="installed" gives an
    ImportError that names both versions and the fix instead of only `cannot import name` (the default,
    "auto", runs the natsl code bundled with the export then: tests/test_hf_standalone.py)."""
    import importlib

    from natsl.hf.modeling_natsl import NatslConfig, NatslForCausalLM

    config = json.loads((hf_export / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("auto_map", "architectures")}
    monkeypatch.delattr(importlib.import_module(missing[0]), missing[1])
    with pytest.raises(ImportError) as err:
        NatslForCausalLM(NatslConfig(**{**config, "natsl_version": "2025.1.1.1", "natsl_runtime": "installed"}))
    assert str(err.value).startswith(f"this folder was exported by natsl 2025.1.1.1; installed natsl is "
                                     f"{natsl.__version__}; natsl_runtime='bundled' runs the code it was exported with")
    assert f"cannot import name '{missing[1]}'" in str(err.value)


def test_remote_code_on_the_same_natsl_builds_the_model(hf_export):
    from natsl.hf.modeling_natsl import NatslConfig, NatslForCausalLM

    config = json.loads((hf_export / "config.json").read_text())
    model = NatslForCausalLM(NatslConfig(**{k: v for k, v in config.items() if k not in ("auto_map", "architectures")}))
    assert model.model.config.block_size == 16


# ----------------------------------------------------------------------------- eval-lm arguments

EVAL_LM_BAD = {
    "--limit 0": (["--limit", "0"], "--limit 0 is neither"),
    "--limit -1": (["--limit", "-1"], "--limit -1 is neither"),
    "--limit 1.5": (["--limit", "1.5"], "--limit 1.5 is neither"),
    "--limit nan": (["--limit", "nan"], "--limit nan is neither"),
    "--limit inf": (["--limit", "inf"], "--limit inf is neither"),
    "--num-fewshot -1": (["--num-fewshot", "-1"], "--num-fewshot must be 0 or more"),
    "--max-length 0": (["--max-length", "0"], "--max-length must be at least 1"),
    "--max-length -4": (["--max-length", "-4"], "--max-length must be at least 1"),
    "--max-length beyond max_seq_len": (["--max-length", "100000"], "beyond the max_seq_len 256"),
}


@pytest.mark.parametrize("args, message", EVAL_LM_BAD.values(), ids=EVAL_LM_BAD.keys())
def test_eval_lm_refuses_bad_arguments(hybrid, tmp_path, args, message):
    assert_one_line_error(run("eval-lm", hybrid, "--tasks", "hellaswag", *args, "--out", tmp_path / "o"), message)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- --keep-fraction without NAtS-L layers

KEEP_COMMANDS = {
    "eval-ppl": lambda ckpt, tmp: ["eval-ppl", ckpt, "--data", tmp / "none.txt", "--keep-fraction", "0.5"],
    "eval-ruler": lambda ckpt, tmp: ["eval-ruler", ckpt, "--keep-fraction", "0.5", "--lengths", "64"],
    "eval-recall": lambda ckpt, tmp: ["eval-recall", ckpt, "--keep-fraction", "0.5"],
    "bench-latency --force-keep": lambda ckpt, tmp: ["bench-latency", "--checkpoint", ckpt, "--force-keep",
                                                     "--max-len", "64"],
}


@pytest.mark.parametrize("command", KEEP_COMMANDS.values(), ids=KEEP_COMMANDS.keys())
def test_keep_fraction_on_a_model_without_natsl_layers_is_refused(gdn, tmp_path, command):
    args = [*command(gdn, tmp_path), "--device", "cpu", "--out", tmp_path / "o"]
    flag = "--force-keep" if "--force-keep" in args else "--keep-fraction"
    assert_one_line_error(run(*args), f"{flag} forces the kept blocks of NAtS-L layers", "has none", f"drop {flag}")
    assert not (tmp_path / "o").exists()


def test_bench_latency_records_no_forced_fraction_for_a_model_without_natsl_layers(tmp_path):
    for name, model in (("gdn", TINY), ("hybrid", {**TINY, "natsl_layers": [1]})):
        write_recipe(tmp_path / f"{name}.yaml", f"name: {name}\nmodel: {json.dumps(model)}\n")
    result = run("bench-latency", "--recipe", tmp_path / "gdn.yaml", "--recipe", tmp_path / "hybrid.yaml",
                 "--min-len", "32", "--max-len", "32", "--decode-tokens", "1", "--repeats", "1", "--device", "cpu",
                 "--out", tmp_path / "b", "--no-progress")
    assert result.exit_code == 0, result.output
    models = json.loads((tmp_path / "b" / "latency.json").read_text())["models"]
    assert {m["name"]: m["forced_keep_fraction"] for m in models} == {"gdn": None, "hybrid": 0.5}


# ----------------------------------------------------------------------------- bytes that are not UTF-8

@pytest.mark.parametrize("args", [["generate", "runs/none", "--prompt", "a\udcffb"],
                                  ["train", "tiny_hybrid", "--out", "runs/r\udcffun"],
                                  ["train", "tiny_hybrid", "--set", "data.path=/x\udcff"],
                                  ["eval-ppl", "runs/none", "--data", "na\udcffme.txt"]],
                         ids=["prompt", "out", "set", "data"])
def test_an_argument_that_is_not_utf8_is_refused_before_any_work(tmp_path, monkeypatch, args):
    """A shell passes stray bytes as lone surrogates: refused up front, not after training when a record or
    tokenizer.json is written (UnicodeEncodeError)."""
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(run(*args), "is not UTF-8 text", "rename the file or pass the text as UTF-8")
    assert list(tmp_path.iterdir()) == []
