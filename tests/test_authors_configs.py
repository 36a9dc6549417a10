"""`natsl convert --from-hf` reads the authors' config.json in every form it is found in: as
transformers >= 5 saves their config classes (every key written, infinity as {"__float__": "Infinity"}),
as transformers 4 saves them (the bare literal Infinity), and hand-written with keys left out (their
published experiments/configs/*.json), where each absent key takes their config class's default.

The config texts below are copied from github.com/automl/NeuralAttentionSearchLinear at commit 90b4315
(experiments/configs/natsl_340M.json, natsl_760M.json) and from `save_pretrained` of their config classes
(configuration_natsl_attn_gdn.py, configuration_nats_mamba2.py) under transformers 5.25.0; they are
kept here as text, independent of natsl's own table of those defaults (natsl.eval.convert)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from natsl.cli.main import app
from natsl.errors import NatslError
from natsl.eval.convert import (AUTHORS_GDN_DEFAULTS, AUTHORS_MAMBA2_DEFAULTS, decode_special_floats, hf_recipe,
                                read_hf_config)

from cli_checks import assert_one_line_error

PUBLISHED_340M = json.loads("""{
    "name": "Neural Attention Search 340M", "attn_mode": "chunk", "bos_token_id": 1, "conv_size": 4,
    "eos_token_id": 2, "expand_v": 2, "fuse_cross_entropy": false, "head_dim": 128, "hidden_act": "swish",
    "hidden_ratio": 4, "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": null,
    "model_type": "neural_attention_search_linear_attn_gdn", "norm_eps": 1e-06, "num_heads": 6,
    "num_attn_heads": 12, "num_hidden_layers": 21, "n_ops": 2, "nats_block_size": 64,
    "compute_dnats_for_invalid_blocks_linear_att": false, "compute_dnats_for_invalid_blocks_att": false,
    "ops_for_incomplete_chunks": "all", "tie_word_embeddings": false, "attn_qk_norm": true,
    "attn_with_short_conv": true, "use_cache": true, "use_gate": true, "use_short_conv": true,
    "gdn_layers": [0,1,2, 4,5,6, 8,9,10, 12,13,14, 16,17,18], "attn_apply_pos_encoding": false,
    "decay_for_non_gdn_blocks": true
}""")
# natsl_760M.json differs from natsl_340M.json in these keys only.
PUBLISHED_760M = {**PUBLISHED_340M, "name": "Neural Attention Search 760M", "head_dim": 192, "hidden_size": 1536,
                  "num_attn_heads": 18}

# NeuralAttentionSearchLineraAttnGDNConfig().save_pretrained(...) under transformers 5.25.0.
SAVED_GDN_DEFAULT = """{
    "allow_neg_eigval": false, "attn": null, "attn_apply_pos_encoding": true,
    "attn_max_position_embeddings": null, "attn_mode": "chunk", "attn_qk_norm": false,
    "attn_rope_theta": 10000.0, "attn_with_short_conv": false, "bos_token_id": 1,
    "compute_dnats_for_invalid_blocks_attn": false, "compute_dnats_for_invalid_blocks_linear_att": false,
    "conv_bias": false, "conv_size": 4, "decay_for_non_gdn_blocks": false, "eos_token_id": 2,
    "expand_v": 2.0, "fuse_cross_entropy": true, "fuse_norm": true, "fuse_swiglu": true, "gdn_layers": [],
    "head_dim": 256, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 2048,
    "incomplete_block_start_with_ht": true, "initializer_range": 0.02, "intermediate_size": null,
    "max_position_embeddings": 2048, "model_type": "neural_attention_search_linear_attn_gdn", "n_ops": 2,
    "nats_block_agg_type": "mean", "nats_block_size": 64, "nats_sample_strategy": "argmax",
    "norm_eps": 1e-06, "num_attn_heads": 12, "num_heads": 6, "num_hidden_layers": 21, "num_nats_head": null,
    "num_v_heads": null, "ops_for_incomplete_chunks": "all", "outputs_are_wighted": true,
    "pad_token_id": null, "tie_word_embeddings": false, "transformers_version": "5.25.0", "use_cache": true,
    "use_gate": true, "use_l2warp": false, "use_short_conv": true, "vocab_size": 32000
}"""

# NATSMamba2Config().save_pretrained(...) under transformers 5.25.0: its default time_step_limit (0.0, inf).
SAVED_MAMBA2_DEFAULT = """{
    "attn_apply_pos_encoding": true, "attn_max_position_embeddings": null, "attn_mode": "chunk",
    "attn_qk_norm": false, "attn_rope_theta": 10000.0, "attn_with_short_conv": false, "bos_token_id": 1,
    "chunk_size": 256, "compute_dnats_for_invalid_blocks_attn": false,
    "compute_dnats_for_invalid_blocks_linear_att": false, "conv_kernel": 4,
    "decay_for_non_mamba_blocks": false, "eos_token_id": 2, "expand": 2, "expand_v": 1,
    "fuse_cross_entropy": true, "fuse_linear_cross_entropy": false, "fuse_norm": true, "head_dim": 64,
    "head_dim_nats": 128, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 2048,
    "incomplete_block_start_with_ht": true, "initializer_range": 0.02, "intermediate_size": null,
    "mamba_hidden_act": "silu", "mamba_layers": [], "max_position_embeddings": 16384,
    "model_type": "nats_mamba", "n_groups": 1, "n_ops": 2, "nats_block_agg_type": "mean",
    "nats_block_size": 64, "nats_sample_strategy": "argmax", "norm_eps": 1e-06, "num_attn_heads": 16,
    "num_heads": 64, "num_hidden_layers": 24, "num_mamba_heads": 8, "num_nats_head": 8,
    "ops_for_incomplete_chunks": "all", "outputs_are_wighted": true, "pad_token_id": 0,
    "rescale_prenorm_residual": true, "residual_in_fp32": true, "rms_norm": true, "state_size": 128,
    "tie_word_embeddings": false, "time_step_floor": 0.0001,
    "time_step_limit": [0.0, {"__float__": "Infinity"}], "time_step_max": 0.1, "time_step_min": 0.001,
    "time_step_rank": 128, "transformers_version": "5.25.0", "use_bias": false, "use_cache": true,
    "use_conv_bias": true, "use_gate": true, "use_l2warp": false, "vocab_size": 32000
}"""

GDN_LAYERS = PUBLISHED_340M["gdn_layers"]
NATSL_LAYERS = [i for i in range(21) if i not in GDN_LAYERS]  # 3, 7, 11, 15, 19, 20


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def mlp_width(hidden: int) -> int:
    """flash-linear-attention's GatedMLP width for hidden_ratio 4 and intermediate_size null."""
    width = int(hidden * 4 * 2 / 3)
    return 256 * ((width + 255) // 256)


def gdn_tensors(hidden: int) -> dict:
    # hf_recipe reads the MLP width off the first block's gate_proj; a meta tensor holds only the shape.
    return {"model.layers.0.mlp.gate_proj.weight": torch.empty(mlp_width(hidden), hidden, device="meta")}


def saved(base_text: str, values: dict) -> dict:
    """What transformers 5 writes for the authors' config class built from `values`: every key, the
    class's defaults where `values` has none."""
    return {**json.loads(base_text), **values}


def test_natsl_defaults_are_those_of_the_authors_config_classes():
    gdn = json.loads(SAVED_GDN_DEFAULT)
    mamba = decode_special_floats(json.loads(SAVED_MAMBA2_DEFAULT))
    assert {k: gdn[k] for k in AUTHORS_GDN_DEFAULTS} == AUTHORS_GDN_DEFAULTS
    # num_nats_head: their Mamba2 class stores num_mamba_heads for None; natsl reads None as that too.
    assert mamba["num_nats_head"] == mamba["num_mamba_heads"] and AUTHORS_MAMBA2_DEFAULTS["num_nats_head"] is None
    assert {k: mamba[k] for k in AUTHORS_MAMBA2_DEFAULTS if k != "num_nats_head"} == {
        k: v for k, v in AUTHORS_MAMBA2_DEFAULTS.items() if k != "num_nats_head"}
    assert mamba["time_step_limit"] == [0.0, float("inf")]
    # The four keys where natsl's earlier assumptions differed from the classes.
    assert AUTHORS_GDN_DEFAULTS["attn_apply_pos_encoding"] is True
    assert AUTHORS_GDN_DEFAULTS["decay_for_non_gdn_blocks"] is False
    assert AUTHORS_GDN_DEFAULTS["attn_qk_norm"] is False and AUTHORS_GDN_DEFAULTS["attn_with_short_conv"] is False


def test_decode_special_floats():
    encoded = {"a": [0.0, {"__float__": "Infinity"}], "b": {"c": {"__float__": "-Infinity"}},
               "d": {"__float__": "NaN"}, "e": {"__float__": "huge"}, "f": {"__float__": ["Infinity"]},
               "g": {"__float__": "Infinity", "other": 1}}
    out = decode_special_floats(encoded)
    assert out["a"] == [0.0, float("inf")] and out["b"] == {"c": float("-inf")} and out["d"] != out["d"]
    # What transformers would not decode stays as written.
    assert out["e"] == {"__float__": "huge"} and out["f"] == {"__float__": ["Infinity"]} and out["g"] == encoded["g"]


def omit_defaults(config: dict, base_text: str) -> dict:
    """`config` with every key left out whose value is the authors' class default."""
    defaults = decode_special_floats(json.loads(base_text))
    return {k: v for k, v in config.items() if k == "model_type" or k not in defaults or defaults[k] != v}


@pytest.mark.parametrize("published", [PUBLISHED_340M, PUBLISHED_760M], ids=["340M", "760M"])
@pytest.mark.parametrize("form", ["as published", "saved by transformers 5", "defaults left out"])
def test_the_published_gdn_configs_in_every_form(published, form):
    config = {"as published": published, "saved by transformers 5": saved(SAVED_GDN_DEFAULT, published),
              "defaults left out": omit_defaults(published, SAVED_GDN_DEFAULT)}[form]
    if form == "defaults left out":  # vocab_size, head counts, conv_size, ... are gone; the four keys stay
        assert "num_heads" not in config and "vocab_size" not in config and config["decay_for_non_gdn_blocks"]
    hidden = published["hidden_size"]
    m = hf_recipe(config, gdn_tensors(hidden), "published").model
    group = published["num_attn_heads"] // 6
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.intermediate_size) == (32000, hidden, 21, mlp_width(hidden))
    assert (m.num_heads, m.head_k_dim, m.head_v_dim) == (6, published["head_dim"], 2 * published["head_dim"])
    assert (m.attn_num_heads, m.softmax_heads_per_group, m.attn_head_dim) == (published["num_attn_heads"], group, 64)
    assert (m.block_size, m.conv_size, m.norm_eps, m.rope_theta) == (64, 4, 1e-6, 10000.0)
    assert m.gdn_layers == GDN_LAYERS and [i for i, t in enumerate(m.layer_types()) if t == "natsl"] == NATSL_LAYERS
    assert not m.natsl_rope and m.decay_skipped_blocks  # both set explicitly in the published configs
    assert m.intra_block_output == "both" and m.mix_weights == "softmax" and not m.tie_embeddings


def test_absent_keys_take_the_authors_class_defaults():
    tensors = gdn_tensors(1024)

    def without(*keys):
        return {k: v for k, v in PUBLISHED_340M.items() if k not in keys}

    m = hf_recipe(without("attn_apply_pos_encoding", "decay_for_non_gdn_blocks"), tensors, "x").model
    assert m.natsl_rope and not m.decay_skipped_blocks  # their class: RoPE on, no decay across skipped blocks
    # Their class defaults attn_qk_norm and attn_with_short_conv to false: a softmax branch natsl does not
    # have, refused with the key named (and that the value is the default of an absent key).
    for key in ("attn_qk_norm", "attn_with_short_conv"):
        with pytest.raises(NatslError, match=rf"{key} = false \(absent from config.json: the authors' default\)") as err:
            hf_recipe(without(key), tensors, "x")
        assert "\n" not in str(err.value)
    with pytest.raises(NatslError, match=r"attn_qk_norm = false \(the softmax"):  # written explicitly
        hf_recipe({**PUBLISHED_340M, "attn_qk_norm": False}, tensors, "x")
    # The authors' code reads only the misspelled outputs_are_wighted: a spelled-out key that disagrees is refused.
    assert hf_recipe({**PUBLISHED_340M, "outputs_are_weighted": True}, tensors, "x").model.mix_weights == "softmax"
    with pytest.raises(NatslError, match="outputs_are_wighted"):
        hf_recipe({**PUBLISHED_340M, "outputs_are_weighted": False}, tensors, "x")
    assert hf_recipe({**PUBLISHED_340M, "outputs_are_wighted": False}, tensors, "x").model.mix_weights == "none"


# The authors' Mamba2 defaults with the softmax branch natsl has (q/k norm, q/k after the conv) and Mamba2
# blocks where the published GDN configs have GDN layers.
MAMBA2_SETTINGS = {"attn_qk_norm": True, "attn_with_short_conv": True, "mamba_layers": GDN_LAYERS,
                   "num_hidden_layers": 21}


def mamba2_folder(tmp_path, name: str, text: str):
    """A folder holding only config.json (hf_recipe needs no more than the MLP width's shape)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return folder


def mamba2_tensors():
    return {f"backbone.layers.{NATSL_LAYERS[0]}.mlp.gate_proj.weight": torch.empty(mlp_width(2048), 2048, device="meta")}


@pytest.mark.parametrize("form", ["transformers 5", "transformers 4", "left out", "-Infinity"])
def test_the_authors_mamba2_defaults_in_every_form(tmp_path, form):
    config = saved(SAVED_MAMBA2_DEFAULT, MAMBA2_SETTINGS)
    if form == "transformers 5":  # {"__float__": "Infinity"}, as save_pretrained wrote it
        text = json.dumps(config)
    elif form == "transformers 4":  # Python's json.dumps: the bare literal Infinity
        text = json.dumps({**config, "time_step_limit": [0.0, float("inf")]})
        assert "Infinity" in text and "__float__" not in text
    elif form == "left out":  # the class default applies: (0.0, inf)
        text = json.dumps(omit_defaults(decode_special_floats(config), SAVED_MAMBA2_DEFAULT))
        assert "time_step_limit" not in text and "use_conv_bias" not in text
    else:  # a lower bound of -inf clamps nothing either (dt = softplus(...) >= 0)
        text = json.dumps({**config, "time_step_limit": [{"__float__": "-Infinity"}, {"__float__": "Infinity"}]})
    m = hf_recipe(read_hf_config(mamba2_folder(tmp_path, "m", text)), mamba2_tensors(), "mamba2").model
    assert m.natsl_state == "mamba2" and m.base_layer == "mamba2" and m.natsl_layers == NATSL_LAYERS
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.norm_eps) == (32000, 2048, 21, 1e-6)
    assert (m.num_heads, m.head_k_dim, m.head_v_dim, m.attn_num_heads) == (8, 128, 128, 16)
    assert (m.mamba2_head_dim, m.mamba2_state_size, m.mamba2_expand, m.mamba2_groups) == (64, 128, 2, 1)
    assert m.mamba2_conv_bias and m.conv_size == 4 and m.block_size == 64
    assert m.natsl_rope and not m.decay_skipped_blocks  # their class: RoPE on, no decay across skipped blocks


def test_the_authors_mamba2_refusals_name_the_key(tmp_path):
    def refusal(name, config):
        with pytest.raises(NatslError) as err:
            hf_recipe(read_hf_config(mamba2_folder(tmp_path, name, json.dumps(config))), mamba2_tensors(), name)
        assert "\n" not in str(err.value)
        return str(err.value)

    config = saved(SAVED_MAMBA2_DEFAULT, MAMBA2_SETTINGS)
    assert "time_step_limit" in refusal("nan", {**config, "time_step_limit": [0.0, {"__float__": "NaN"}]})
    assert "time_step_limit" in refusal("clamped", {**config, "time_step_limit": [0.0, 0.1]})
    assert "time_step_limit" in refusal("text", {**config, "time_step_limit": ["0", "inf"]})
    assert "norm_eps" in refusal("inf_eps", {**config, "norm_eps": {"__float__": "Infinity"}})
    # The class defaults unchanged (attn_qk_norm false): refused, naming the key.
    assert "attn_qk_norm = false" in refusal("default", json.loads(SAVED_MAMBA2_DEFAULT))


def test_a_mamba2_config_key_their_model_does_not_read_is_ignored(tmp_path):
    """Their Mamba2 model passes its NAtS-L layers use_short_conv=True, conv_bias=False and a swish MLP
    whatever config.json says (modeling_nats_mamba2.py)."""
    config = {**saved(SAVED_MAMBA2_DEFAULT, MAMBA2_SETTINGS), "use_short_conv": False, "conv_bias": True,
              "hidden_act": "gelu"}
    folder = mamba2_folder(tmp_path, "m", json.dumps(config))
    assert hf_recipe(read_hf_config(folder), mamba2_tensors(), "m").model.conv_size == 4


def test_the_cli_imports_a_transformers_5_config(tmp_path):
    """Through `natsl convert --from-hf`: an encoded infinity elsewhere than time_step_limit is named in one line."""
    folder = mamba2_folder(tmp_path, "hf", json.dumps({**saved(SAVED_MAMBA2_DEFAULT, MAMBA2_SETTINGS),
                                                       "intermediate_size": 64,
                                                       "hidden_size": {"__float__": "Infinity"}}))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    assert_one_line_error(run("convert", folder, tmp_path / "out", "--from-hf"), "'hidden_size'", "inf")
