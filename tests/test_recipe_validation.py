"""Every number of the optim and train sections is range-checked when a recipe is built, and an empty
recipe file is refused, with one-line errors instead of tracebacks or silent defaults."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import natsl
from natsl.config import recipe_from_dict
from natsl.errors import NatslError

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"


def _tiny_with(**values):
    """tiny_hybrid as a dict, with dotted keys (`optim.lr`) set to the given values."""
    data = yaml.safe_load((RECIPES / "tiny_hybrid.yaml").read_text())
    for dotted, value in values.items():
        section, key = dotted.split(".")
        data[section][key] = value
    return data


NAN, INF = float("nan"), float("inf")

# (overrides, the key the error must name)
BAD = {
    "micro_batch_size zero": ({"train.micro_batch_size": 0}, "train.micro_batch_size"),
    "micro_batch_size negative": ({"train.micro_batch_size": -4}, "train.micro_batch_size"),
    "seq_len zero": ({"train.seq_len": 0}, "train.seq_len"),
    "seq_len negative": ({"train.seq_len": -128}, "train.seq_len"),
    "tokens_per_step zero": ({"train.tokens_per_step": 0}, "train.tokens_per_step"),
    "total_tokens zero": ({"train.total_tokens": 0}, "train.total_tokens"),
    "log_every zero": ({"train.log_every": 0}, "train.log_every"),
    "eval_every zero": ({"train.eval_every": 0}, "train.eval_every"),
    "save_every zero": ({"train.save_every": 0}, "train.save_every"),
    "eval_tokens zero": ({"train.eval_tokens": 0}, "train.eval_tokens"),
    "max_bad_steps zero": ({"train.max_bad_steps": 0}, "train.max_bad_steps"),
    "max_steps zero": ({"train.max_steps": 0}, "train.max_steps"),
    "keep_last negative": ({"train.keep_last": -1}, "train.keep_last"),
    "seed negative": ({"train.seed": -1}, "train.seed"),
    "seed too large": ({"train.seed": 2**63}, "train.seed"),
    "beta1 above 1": ({"optim.betas": [1.5, 0.9]}, "optim.betas"),
    "beta2 equal 1": ({"optim.betas": [0.9, 1.0]}, "optim.betas"),
    "beta negative": ({"optim.betas": [-0.1, 0.9]}, "optim.betas"),
    "beta nan": ({"optim.betas": [NAN, 0.9]}, "optim.betas"),
    "three betas": ({"optim.betas": [0.9, 0.95, 0.99]}, "optim.betas"),
    "eps negative": ({"optim.eps": -1}, "optim.eps"),
    "eps zero": ({"optim.eps": 0}, "optim.eps"),
    "lr negative": ({"optim.lr": -1}, "optim.lr"),
    "lr zero": ({"optim.lr": 0}, "optim.lr"),
    "lr nan": ({"optim.lr": NAN}, "optim.lr"),
    "lr inf": ({"optim.lr": INF}, "optim.lr"),
    "min_lr above lr": ({"optim.lr": 1e-3, "optim.min_lr": 2e-3}, "optim.min_lr"),
    "min_lr negative": ({"optim.min_lr": -1e-5}, "optim.min_lr"),
    "weight_decay negative": ({"optim.weight_decay": -0.1}, "optim.weight_decay"),
    "weight_decay nan": ({"optim.weight_decay": NAN}, "optim.weight_decay"),
    "grad_clip negative": ({"optim.grad_clip": -1}, "optim.grad_clip"),
    "grad_clip inf": ({"optim.grad_clip": INF}, "optim.grad_clip"),
    "warmup_tokens negative": ({"optim.warmup_tokens": -5}, "optim.warmup_tokens"),
    # the model section: values that trained on NaN or ran for minutes per step
    "norm_eps negative": ({"model.norm_eps": -1}, "model.norm_eps"),
    "norm_eps nan": ({"model.norm_eps": NAN}, "model.norm_eps"),
    "rope_theta zero": ({"model.rope_theta": 0}, "model.rope_theta"),
    "rope_theta negative": ({"model.rope_theta": -10000}, "model.rope_theta"),
    "init_std negative": ({"model.init_std": -1}, "model.init_std"),
    "init_std nan": ({"model.init_std": NAN}, "model.init_std"),
    "init_std inf": ({"model.init_std": INF}, "model.init_std"),
    "conv_size huge": ({"model.conv_size": 100000}, "model.conv_size"),
    "conv_size zero": ({"model.conv_size": 0}, "model.conv_size"),
    "vocab_size beyond uint32": ({"model.vocab_size": 2**32 + 1}, "model.vocab_size"),
}


@pytest.mark.parametrize("values, key", BAD.values(), ids=BAD.keys())
def test_bad_numbers_are_refused_naming_the_key(values, key):
    with pytest.raises(NatslError) as err:
        recipe_from_dict(_tiny_with(**values))
    message = str(err.value)
    assert f"'{key}'" in message and "\n" not in message, message


def test_the_message_names_the_value_and_what_is_allowed():
    with pytest.raises(NatslError) as err:
        recipe_from_dict(_tiny_with(**{"optim.lr": -1}))
    assert str(err.value) == "recipe key 'optim.lr' must be a finite number > 0, got -1.0"


def test_boundary_values_that_mean_something_are_accepted():
    # grad_clip 0 = no clipping, keep_last 0 = keep every checkpoint, min_lr = lr = a constant rate.
    recipe = recipe_from_dict(_tiny_with(**{
        "optim.grad_clip": 0, "optim.warmup_tokens": 0, "optim.min_lr": 0.003, "optim.betas": [0.0, 0.999],
        "optim.weight_decay": 0, "train.keep_last": 0, "train.seed": 0, "train.max_steps": 1,
        "model.max_seq_len": 256}))
    assert (recipe.optim.grad_clip, recipe.train.keep_last, recipe.optim.min_lr) == (0.0, 0, 0.003)


@pytest.mark.parametrize("path", sorted(glob.glob(str(RECIPES / "*.yaml"))), ids=lambda p: Path(p).stem)
def test_every_shipped_recipe_still_loads(path):
    assert natsl.load_recipe(path).name == Path(path).stem


@pytest.mark.parametrize("text", ["", "null\n", "# only a comment\n"])
def test_an_empty_recipe_file_is_refused(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(NatslError, match=r"empty\.yaml' is empty; a recipe needs at least a model section"):
        natsl.load_recipe(path)


def test_a_folder_given_as_the_recipe_is_named_as_a_folder(tmp_path):
    with pytest.raises(NatslError, match="is a folder; pass a recipe file"):
        natsl.load_recipe(tmp_path)


def test_train_on_an_empty_recipe_exits_2_without_a_traceback(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("NATSL_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "natsl.cli.main", "train", str(path), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [f"error: recipe file {str(path)!r} is empty; a recipe needs at "
                                                "least a model section (see recipes/tiny_hybrid.yaml)"]
    assert not (tmp_path / "run").exists()


def test_every_numeric_model_and_optim_field_has_a_range_rule():
    from natsl.config import MODEL_RULES, OPTIM_RULES, ModelConfig, OptimConfig
    import dataclasses
    import typing

    def is_numeric(hint) -> bool:  # a number, or an optional one (model.router_keep_target)
        return hint in (int, float) or (typing.get_origin(hint) is typing.Union
                                         and set(typing.get_args(hint)) in ({int, type(None)}, {float, type(None)}))

    for cls, rules in ((ModelConfig, MODEL_RULES), (OptimConfig, OPTIM_RULES)):
        hints = typing.get_type_hints(cls)
        numeric = {f.name for f in dataclasses.fields(cls) if is_numeric(hints[f.name])}
        assert numeric == set(rules), (cls.__name__, numeric ^ set(rules))


def test_a_key_given_twice_in_a_recipe_is_refused_with_its_lines(tmp_path):
    text = (RECIPES / "tiny_hybrid.yaml").read_text().replace("  lr: 0.003\n", "  lr: 0.003\n  lr: 0.1\n")
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    line = text.splitlines().index("  lr: 0.003") + 1
    with pytest.raises(NatslError) as err:
        natsl.load_recipe(path)
    assert str(err.value) == (f"recipe file {str(path)!r} gives key 'lr' twice (lines {line} and {line + 1}); "
                              "keep one")


def test_the_same_key_in_two_sections_is_fine(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("model: {vocab_size: 300, hidden_size: 8}\ntrain: {seed: 1}\noptim: {lr: 0.1}\ndata: {}\n")
    assert natsl.load_recipe(path).train.seed == 1


def test_a_recipe_nested_thousands_deep_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(NatslError, match="nested too deeply"):
        natsl.load_recipe(path)


def test_an_override_nested_thousands_deep_is_one_line():
    from natsl.config import apply_overrides

    recipe = recipe_from_dict(_tiny_with())
    with pytest.raises(NatslError, match="nested too deeply"):
        apply_overrides(recipe, ["model.natsl_layers=" + "[" * 5000 + "]" * 5000])
