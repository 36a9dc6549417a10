"""The nested model section (natsl.config: flatten_model, nest_model): one section per layer kind, read into
ModelConfig's flat fields. Every shipped recipe loads the same in either form, old flat recipes and
checkpoints still load, and overrides of the flat names and of the nested ones set the same field."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from natsl.config import (ModelConfig, apply_overrides, flatten_model, load_recipe, model_sections, nest_model,
                          recipe_from_dict, recipe_names)
from natsl.errors import NatslError

ROOT = Path(__file__).resolve().parent.parent
FLAT_CHECKPOINT = Path(__file__).with_name("data") / "flat_checkpoint_config.json"
# The ModelConfig fields of no section: they configure the whole model, not one layer kind.
COMMON = {"vocab_size", "hidden_size", "intermediate_size", "num_layers", "conv_size", "rope_theta", "norm_eps",
          "init_std", "tie_embeddings", "max_seq_len", "backend"}


def test_every_field_has_one_place():
    owners = [name for table in model_sections().values() for name in table.values()]
    assert len(owners) == len(set(owners)), "a field in two sections"
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(owners) | COMMON == fields and not set(owners) & COMMON


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_loads_the_same_in_both_forms(name, tmp_path):
    recipe = load_recipe(name)
    data = recipe.to_dict()
    flat = load_recipe(write(tmp_path / "flat.yaml", data))
    nested = load_recipe(write(tmp_path / "nested.yaml", {**data, "model": nest_model(data["model"])}))
    assert flat.model == recipe.model == nested.model
    assert flatten_model(nest_model(data["model"]))[0] == data["model"]


def test_shipped_recipes_read_nested_except_the_flat_smoke_recipe():
    """The user-facing recipes are written in the nested form; tiny_hybrid keeps the flat form (the tests'
    base recipe, which they edit by flat key), so a shipped flat recipe is read on every run too."""
    for name in recipe_names():
        model = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())["model"]
        sectioned = [key for key in model if key in model_sections()]
        assert (not sectioned) == (name == "tiny_hybrid"), name
    mini = yaml.safe_load((ROOT / "recipes/mini/natsl_hybrid.yaml").read_text())["model"]
    assert mini["layers"] == {"base": "gdn", "natsl": [3, 7, 11]} and mini["natsl"]["block_size"] == 64


def test_an_old_flat_checkpoint_loads(tmp_path):
    """config.json as natsl wrote it before the nested form (flat model fields), with weights saved beside it."""
    from natsl.checkpoint import load_checkpoint, save_tensors

    config = json.loads(FLAT_CHECKPOINT.read_text())
    recipe = recipe_from_dict(config["recipe"])
    assert "natsl" not in config["recipe"]["model"] and config["recipe"]["model"]["natsl_layers"] == [1, 3]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    from natsl.models import build_model

    torch.manual_seed(3)
    built = build_model(recipe)
    save_tensors({k: v.contiguous() for k, v in built.state_dict().items()}, folder / "model.safetensors")
    shutil.copy(FLAT_CHECKPOINT, folder / "config.json")
    model, _ = load_checkpoint(folder)
    assert model.config == recipe.model and model.config.router_keep_budget == 0.5
    ids = torch.randint(0, recipe.model.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.equal(model(ids), built.eval()(ids))


@pytest.mark.parametrize("flat, nested", [
    ("model.block_size=128", "model.natsl.block_size=128"),
    ("model.mix_input=x", "model.natsl.mix_input=x"),
    ("model.intra_block_output=gdn", "model.natsl.intra_block_output=gdn"),
    ("model.natsl_rope=true", "model.natsl.rope=true"),
    ("model.router_keep_budget=0.25", "model.natsl.router.keep_budget=0.25"),
    ("model.router_keep_budget=0.25", "model.natsl.router={keep_budget: 0.25}"),
    ("model.attn_window=32", "model.attention.window=32"),
    ("model.natsl_layers=[3]", "model.layers.natsl=[3]"),
])
def test_overrides_of_flat_and_nested_names_agree(flat, nested):
    recipe = load_recipe("mini/natsl_hybrid")
    by_flat, by_nested = apply_overrides(recipe, [flat]), apply_overrides(recipe, [nested])
    assert by_flat.model == by_nested.model != recipe.model


def test_the_pipeline_ablation_overrides_still_apply():
    from natsl.miniature.pipeline import ABLATIONS

    recipe = load_recipe("mini/natsl_hybrid")
    chunk = apply_overrides(recipe, ["model.block_size=128", "model.backend=chunked"])
    assert (chunk.model.block_size, chunk.model.backend) == (128, "chunked")
    for overrides in ABLATIONS.values():
        changed = apply_overrides(recipe, overrides)
        for item in overrides:
            key, value = item.split("=", 1)
            assert str(getattr(changed.model, key.split(".")[1])).lower() == value.lower(), item


@pytest.mark.parametrize("model, message", [
    ({"natsl": {"bogus": 1}}, "unknown recipe key 'model.natsl.bogus'; allowed keys here: softmax_heads_per_group"),
    ({"natsl": {"router": {"nois": 0.1}}}, "unknown recipe key 'model.natsl.router.nois'; allowed keys here: noise"),
    ({"natsl": 3}, "recipe key 'model.natsl' is a section"),
    ({"block_size": 32, "natsl": {"block_size": 16}}, "'model.block_size' both set the model's block_size; keep one"),
    ({"natsl": {"rope": "yes"}}, "recipe key 'model.natsl.rope' must be true or false"),
    ({"natsl": {"block_size": 0}}, "recipe key 'model.natsl.block_size' must be"),
    ({"layers": {"natsl": [9]}}, "recipe key 'model.layers.natsl' has layer index 9"),
    ({"gdn": {"head_k_dim": 33}}, "'model.gdn.head_k_dim' = 33 is not divisible"),
])
def test_errors_name_the_nested_key(model, message):
    base = nest_model(load_recipe("tiny_hybrid").to_dict()["model"])
    for section, values in model.items():
        if isinstance(values, dict) and isinstance(base.get(section), dict):
            base[section] = {**base[section], **values}
        else:
            base[section] = values
    if "block_size" in model:  # both forms at once
        base["natsl"]["block_size"] = model["natsl"]["block_size"]
    with pytest.raises(NatslError) as err:
        recipe_from_dict({"name": "x", "model": base})
    assert message in str(err.value)
