"""`natsl convert`: training checkpoint -> inference folder, and the import of the authors' HF format."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli import convert, eval_ppl, eval_ruler, inspect_routing  # noqa: F401  (register the commands)
from natsl.cli.app import app
from natsl.config import apply_overrides
from natsl.eval.haystack import essay_text
from natsl.tokenizer import train_bpe


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def logits(model, ids):
    model.set_backend("chunked")
    with torch.no_grad():
        return model(ids)


@pytest.fixture(scope="module")
def tok():
    return train_bpe([essay_text(100)], vocab_size=300)


def test_training_checkpoint_round_trip(tmp_path, tok):
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    step = save_model_folder(tmp_path / "run" / "checkpoints" / "step_20", model, recipe, tok)
    save_file({"exp_avg": torch.zeros(3)}, str(step / "optimizer.safetensors"))  # training state stays behind
    (step / "trainer_state.json").write_text("{}")
    result = run("convert", tmp_path / "run", tmp_path / "inference")
    assert result.exit_code == 0, result.output
    out = tmp_path / "inference"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "recipe.yaml", "tokenizer.json"]
    assert json.loads((out / "config.json").read_text())["converted_from"].endswith("step_20")
    loaded, tok2 = natsl.load_checkpoint(out)
    ids = torch.randint(0, 1024, (2, 150))
    assert torch.equal(logits(model, ids), logits(loaded, ids))
    assert tok2.sha256() == tok.sha256()
    # bf16 copy: stored as bf16, and loading it in bf16 computes what the bf16 model computes.
    assert run("convert", step, tmp_path / "bf16", "--dtype", "bf16").exit_code == 0
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values())
    half, _ = natsl.load_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(logits(model.to(torch.bfloat16), ids), logits(half, ids))
    # An existing target is not replaced silently.
    again = run("convert", step, tmp_path / "bf16")
    assert again.exit_code == 2 and "--force" in again.stderr


# ---------------------------------------------------------------------------- the authors' layout

def authors_config(recipe):
    m = recipe.model
    return {
        "model_type": "neural_attention_search_linear_attn_gdn", "architectures": ["NeuralAttentionSearchLinearAttnGDNForCausalLM"],
        "attn_mode": "chunk", "hidden_size": m.hidden_size, "expand_v": m.head_v_dim / m.head_k_dim, "use_gate": True,
        "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "conv_bias": False, "head_dim": m.head_k_dim,
        "num_heads": m.num_heads, "num_attn_heads": m.num_heads * m.softmax_heads_per_group, "num_v_heads": None,
        "n_ops": 2, "num_nats_head": None, "nats_block_size": m.block_size, "nats_block_agg_type": "mean",
        "nats_sample_strategy": "argmax", "ops_for_incomplete_chunks": "all", "hidden_ratio": 4,
        "intermediate_size": m.intermediate_size, "hidden_act": "swish", "outputs_are_wighted": True,
        "attn_qk_norm": True, "attn_with_short_conv": True, "decay_for_non_gdn_blocks": True,
        "attn_apply_pos_encoding": m.natsl_rope, "attn_rope_theta": m.rope_theta, "num_hidden_layers": m.num_layers,
        "norm_eps": m.norm_eps, "tie_word_embeddings": False, "initializer_range": 0.02, "vocab_size": m.vocab_size,
        "gdn_layers": [i for i, t in enumerate(m.layer_types()) if t == "gdn"],
    }


def authors_block_tensors(block, p: str, decays: bool = True) -> dict:
    """One block's tensors every authors' GDN-based layer shares, under their names (by hand, independently of
    the converter): norms, MLP, projections, convs, gate and output, and the decay where the state has one."""
    mx, a = block.mixer, p + "attn."
    out = {p + "attn_norm.weight": block.mixer_norm.weight, p + "mlp_norm.weight": block.mlp_norm.weight,
           p + "mlp.gate_proj.weight": block.mlp.gate_proj.weight, p + "mlp.up_proj.weight": block.mlp.up_proj.weight,
           p + "mlp.down_proj.weight": block.mlp.down_proj.weight, a + "q_proj.weight": mx.proj.q_proj.weight,
           a + "k_proj.weight": mx.proj.k_proj.weight, a + "v_proj.weight": mx.proj.v_proj.weight,
           a + "b_proj.weight": mx.proj.b_proj.weight, a + "q_conv1d.weight": mx.proj.q_conv.weight,
           a + "k_conv1d.weight": mx.proj.k_conv.weight, a + "v_conv1d.weight": mx.proj.v_conv.weight,
           a + "g_proj.weight": mx.g_proj.weight, a + "o_proj.weight": mx.o_proj.weight}
    if decays:
        out.update({a + "a_proj.weight": mx.proj.a_proj.weight, a + "A_log": mx.proj.A_log,
                    a + "dt_bias": mx.proj.dt_bias})
    if block.layer_type == "gdn":
        out[a + "o_norm.weight"] = mx.o_norm.weight
    else:
        out.update({a + "nats_layer.weight": mx.router.weight,  # rows (head, option): option 0 softmax, 1 GDN
                    a + "q_norm.weight": mx.q_norm.weight, a + "k_norm.weight": mx.k_norm.weight})
    return out


def authors_tensors(model):
    """The natsl model's weights under the authors' names: flash-linear-attention's GatedDeltaNet for GDN
    layers, their NAtS-L layer otherwise."""
    out = {"model.embeddings.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.layers):
        p, mx = f"model.layers.{i}.", block.mixer
        out.update(authors_block_tensors(block, p))
        if block.layer_type == "gdn":
            continue
        a = p + "attn."
        out[a + "o_norm.weight1"] = mx.la_norm.weight  # their x1 is the GDN output
        out[a + "o_norm.weight2"] = mx.nla_norm.weight
        # Their mixing rows are (softmax head, [GDN weight, softmax weight]); natsl's are [softmax, GDN].
        w = mx.mix_proj.weight
        out[a + "nats_out_weights_layer.weight"] = torch.stack([w[1::2], w[0::2]], dim=1).reshape(w.shape)
        if model.config.natsl_rope:
            out[a + "rotary.inv_freq"] = torch.ones(model.config.softmax_k_dim // 2)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def write_authors_folder(folder, overrides, seed, config_of, tensors_of):
    """A tiny natsl model of tiny_hybrid with `overrides`, its weights moved off their init (so any swapped
    or dropped tensor shows in the logits), written to `folder` in an authors' layout."""
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), overrides)
    torch.manual_seed(seed)
    model = natsl.build_model(recipe)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_of(recipe)))
    save_file(tensors_of(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model, folder


@pytest.fixture(scope="module")
def authors_checkpoint(tmp_path_factory, tok):
    model, folder = write_authors_folder(tmp_path_factory.mktemp("hf") / "NAtS-L-tiny", ["model.natsl_rope=true"], 5,
                                         authors_config, authors_tensors)
    tok.save(folder)
    return model, folder


def test_hf_import_maps_every_tensor(authors_checkpoint, tmp_path):
    model, folder = authors_checkpoint
    result = run("convert", folder, tmp_path / "natsl", "--from-hf")
    assert result.exit_code == 0, result.output
    imported, tok = natsl.load_checkpoint(tmp_path / "natsl")
    assert tok is not None
    assert imported.config.layer_types() == model.config.layer_types()
    assert imported.config.natsl_rope and imported.config.decay_skipped_blocks
    ids = torch.randint(0, 1024, (2, 200))  # four blocks: routing, decay and both memories all matter
    assert torch.equal(logits(model, ids), logits(imported, ids))
    # The imported folder is an ordinary natsl checkpoint for the evaluation commands.
    text = tmp_path / "t.txt"
    text.write_text(essay_text(20, seed=3))
    ppl = run("eval-ppl", tmp_path / "natsl", "--data", text, "--max-len", 128, "--windows", 1, "--out", tmp_path / "p")
    assert ppl.exit_code == 0, ppl.output


def authors_delta_config(recipe):
    """config.json of the authors' NAtS-L on DeltaNet: their GDN model's keys without the decay; their
    model passes outputs_are_weighted, which the layer never reads (it sums)."""
    config = {key: value for key, value in authors_config(recipe).items() if key != "decay_for_non_gdn_blocks"}
    config.pop("outputs_are_wighted")
    return {**config, "model_type": "neural_attention_search_linear_attn_delta",
            "architectures": ["NeuralAttentionSearchLinearAttnDeltaForCausalLM"], "outputs_are_weighted": True}


def authors_delta_tensors(model):
    """The natsl model's weights under the names of the authors' natsl_attn_delta model (by hand): GatedDeltaNet
    layers as above; NAtS-L layers without a_proj, A_log, dt_bias, with one o_norm over each DeltaNet head's V
    and no mixing projection."""
    out = {"model.embeddings.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}."
        out.update(authors_block_tensors(block, p, decays=block.layer_type == "gdn"))
        if block.layer_type != "gdn":
            out[p + "attn.o_norm.weight"] = block.mixer.out_norm.weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def test_hf_import_of_the_authors_natsl_on_deltanet(tmp_path):
    overrides = ["model.natsl_rope=true", "model.natsl_state=delta", "model.branch_norm=after_sum_state_head",
                 "model.mix_weights=none"]
    model, folder = write_authors_folder(tmp_path / "delta", overrides, 6, authors_delta_config, authors_delta_tensors)
    assert "model.layers.1.attn.A_log" not in load_file(str(folder / "model.safetensors"))
    result = run("convert", folder, tmp_path / "natsl", "--from-hf")
    assert result.exit_code == 0, result.output
    imported, _ = natsl.load_checkpoint(tmp_path / "natsl")
    c = imported.config
    assert (c.natsl_state, c.branch_norm, c.mix_weights) == ("delta", "after_sum_state_head", "none")
    assert imported.config.layer_types() == model.config.layer_types()
    ids = torch.randint(0, 1024, (2, 200))
    assert torch.equal(logits(model, ids), logits(imported, ids))
    # natsl's own delta layer (separate norms, softmax mixing) has no tensors in their format
    from natsl.eval.convert import hf_name_map

    with pytest.raises(natsl.errors.NatslError, match="which the authors' format does not have"):
        hf_name_map(natsl.load_recipe("380m_natsl_delta"))


def test_hf_import_refusals(authors_checkpoint, tmp_path):
    model, folder = authors_checkpoint
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))

    def variant(name, cfg=config, ts=tensors, pickled=False):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        if pickled:
            (d / "pytorch_model.bin").write_bytes(b"not read")
        else:
            save_file(ts, str(d / "model.safetensors"))
        r = run("convert", d, tmp_path / f"{name}-out", "--from-hf")
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert len(r.stderr.strip().splitlines()) == 1
        return r.stderr

    assert "never unpickles" in variant("pickled", pickled=True)
    assert "model type 'mistral'" in variant("mistral", cfg={**config, "model_type": "mistral"})
    # model_type llama goes to natsl's own Llama import (natsl.hf.export), which names what it lacks.
    assert "Llama checkpoint" in variant("llama", cfg={**config, "model_type": "llama"})
    assert "no place in natsl" in variant("extra", ts={**tensors, "model.layers.1.attn.mystery": torch.zeros(2)})
    partial = dict(tensors)
    partial.pop("model.layers.3.attn.nats_layer.weight")
    assert "lacks 1 tensor" in variant("partial", ts=partial)
    assert "num_v_heads" in variant("gva", cfg={**config, "num_v_heads": 4})
    assert "attn_with_short_conv" in variant("noconv", cfg={**config, "attn_with_short_conv": False})
    missing = run("convert", tmp_path / "absent", tmp_path / "o")
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


# ------------------------------------------------------------- the authors' NAtS-L on Mamba2 (nats_mamba)

# Their default: Mamba2 blocks with a conv bias (use_conv_bias, absent from the config below: their default).
MAMBA2_HYBRID = ["model.base_layer=mamba2", "model.natsl_state=mamba2", "model.natsl_rope=true",
                 "model.mamba2_head_dim=16", "model.mamba2_state_size=8", "model.block_size=16",
                 "model.mamba2_conv_bias=true"]


def authors_mamba2_config(recipe):
    m = recipe.model
    return {
        "model_type": "nats_mamba", "architectures": ["NAtSMamba2ForCausalLM"], "attn_mode": "chunk", "use_gate": True,
        "num_mamba_heads": m.num_heads, "num_attn_heads": m.num_heads * m.softmax_heads_per_group,
        "head_dim_nats": m.head_k_dim, "expand_v": m.head_v_dim // m.head_k_dim, "n_ops": 2, "num_nats_head": None,
        "nats_block_size": m.block_size, "nats_block_agg_type": "mean", "nats_sample_strategy": "argmax",
        "ops_for_incomplete_chunks": "all", "hidden_ratio": 4, "intermediate_size": m.intermediate_size,
        "hidden_act": "swish", "outputs_are_wighted": True, "attn_qk_norm": True, "attn_with_short_conv": True,
        "attn_apply_pos_encoding": m.natsl_rope, "attn_rope_theta": m.rope_theta, "head_dim": m.mamba2_head_dim,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "state_size": m.mamba2_state_size,
        "num_hidden_layers": m.num_layers, "norm_eps": m.norm_eps, "expand": m.mamba2_expand, "conv_kernel": 4,
        "n_groups": m.mamba2_groups, "use_bias": False, "mamba_hidden_act": "silu",
        "rms_norm": True, "time_step_limit": [0.0, float("inf")], "tie_word_embeddings": False,
        "mamba_layers": [i for i, t in enumerate(m.layer_types()) if t == "mamba2"],
    }  # decay_for_non_mamba_blocks and use_conv_bias are absent: their config's defaults, false and true


def authors_mamba2_tensors(model):
    """The natsl model's weights under the authors' nats_mamba names, written out by hand: `backbone.`,
    flash-linear-attention's Mamba2 blocks (norm, mixer, no MLP), their NAtS-L layer without b_proj."""
    out = {"backbone.embeddings.weight": model.embed.weight, "backbone.norm_f.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.layers):
        p, mx = f"backbone.layers.{i}.", block.mixer
        if block.layer_type == "mamba2":
            assert block.mlp is None
            out[p + "norm.weight"] = block.mixer_norm.weight
            for name in ("in_proj.weight", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
                out[p + "mixer." + name] = mx.get_parameter(name)
            out[p + "mixer.conv1d.weight"], out[p + "mixer.conv1d.bias"] = mx.conv.weight, mx.conv.bias
            continue
        out[p + "attn_norm.weight"] = block.mixer_norm.weight
        out[p + "mlp_norm.weight"] = block.mlp_norm.weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{name}.weight"] = block.mlp.get_parameter(f"{name}.weight")
        a = p + "attn."
        assert mx.proj.D is None and not hasattr(mx.proj, "b_proj")  # their layer: no D, no beta
        for name in ("q_proj", "k_proj", "v_proj", "a_proj"):
            out[f"{a}{name}.weight"] = mx.proj.get_parameter(f"{name}.weight")
        for name in ("q", "k", "v"):
            out[f"{a}{name}_conv1d.weight"] = mx.proj.get_parameter(f"{name}_conv.weight")
        out[a + "A_log"], out[a + "dt_bias"] = mx.proj.A_log, mx.proj.dt_bias
        out[a + "g_proj.weight"], out[a + "o_proj.weight"] = mx.g_proj.weight, mx.o_proj.weight
        out[a + "nats_layer.weight"] = mx.router.weight
        out[a + "q_norm.weight"], out[a + "k_norm.weight"] = mx.q_norm.weight, mx.k_norm.weight
        out[a + "o_norm.weight1"], out[a + "o_norm.weight2"] = mx.la_norm.weight, mx.nla_norm.weight
        w = mx.mix_proj.weight
        out[a + "nats_out_weights_layer.weight"] = torch.stack([w[1::2], w[0::2]], dim=1).reshape(w.shape)
        out[a + "rotary.inv_freq"] = torch.ones(model.config.softmax_k_dim // 2)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def authors_mamba2_checkpoint(tmp_path_factory):
    return write_authors_folder(tmp_path_factory.mktemp("hf") / "NAtS-L-Mamba2-tiny",
                                [*MAMBA2_HYBRID, "model.decay_skipped_blocks=false"], 6,
                                authors_mamba2_config, authors_mamba2_tensors)


def test_hf_import_of_the_authors_nats_mamba(authors_mamba2_checkpoint, tmp_path):
    model, folder = authors_mamba2_checkpoint
    result = run("convert", folder, tmp_path / "natsl", "--from-hf")
    assert result.exit_code == 0, result.output
    imported, _ = natsl.load_checkpoint(tmp_path / "natsl")
    c = imported.config
    assert c.layer_types() == ["mamba2", "natsl", "mamba2", "natsl"] and c.natsl_state == "mamba2"
    assert c.mamba2_state_l2 and not c.mamba2_state_skip and not c.mamba2_mlp and not c.decay_skipped_blocks
    assert c.mamba2_conv_bias and model.layers[0].mixer.conv.bias.abs().min() > 0  # their default, set off zero
    ids = torch.randint(0, 1024, (2, 70))  # five blocks of 16: routing, decay and both memories all matter
    assert torch.equal(logits(model, ids), logits(imported, ids))
    assert json.loads((tmp_path / "natsl" / "config.json").read_text())["source_model_type"] == "nats_mamba"


def test_hf_import_of_nats_mamba_refuses_what_natsl_computes_otherwise(authors_mamba2_checkpoint, tmp_path):
    _, folder = authors_mamba2_checkpoint
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))

    def refusal(name, cfg=config, ts=tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        save_file(ts, str(d / "model.safetensors"))
        r = run("convert", d, tmp_path / f"{name}-out", "--from-hf")
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
        return r.stderr

    # use_conv_bias = false: the biases have no place, and without them the config's model imports
    assert "no place in natsl" in refusal("conv_bias", cfg={**config, "use_conv_bias": False})
    plain = {k: v for k, v in tensors.items() if not k.endswith("conv1d.bias")}
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**config, "use_conv_bias": False}))
    save_file(plain, str(tmp_path / "plain" / "model.safetensors"))
    assert run("convert", tmp_path / "plain", tmp_path / "plain-out", "--from-hf").exit_code == 0
    assert not natsl.load_checkpoint(tmp_path / "plain-out")[0].config.mamba2_conv_bias
    assert "n_groups" in refusal("groups", cfg={**config, "n_groups": 2})
    assert "time_step_limit" in refusal("dt_limit", cfg={**config, "time_step_limit": [0.001, 0.1]})
    # A D on the NAtS-L layer (natsl's first form) is not in their layer: no place for it.
    assert "no place in natsl" in refusal("state_d", ts={**tensors, "backbone.layers.1.attn.D": torch.ones(2)})


def test_hf_import_of_configs_as_transformers_5_saves_them(authors_checkpoint, authors_mamba2_checkpoint, tmp_path):
    """transformers >= 5 writes the Mamba2 default time_step_limit as [0.0, {"__float__": "Infinity"}]; a config
    that leaves attn_apply_pos_encoding out means their class's default, true (tests/test_authors_configs.py
    covers every form and key)."""
    model, folder = authors_mamba2_checkpoint
    config = json.loads((folder / "config.json").read_text())
    encoded = tmp_path / "encoded"
    encoded.mkdir()
    (encoded / "config.json").write_text(json.dumps({**config, "time_step_limit": [0.0, {"__float__": "Infinity"}]}))
    (encoded / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    result = run("convert", encoded, tmp_path / "mamba2", "--from-hf")
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 1024, (1, 40))
    assert torch.equal(logits(model, ids), logits(natsl.load_checkpoint(tmp_path / "mamba2")[0], ids))

    model, folder = authors_checkpoint  # built with natsl_rope=true
    config = json.loads((folder / "config.json").read_text())
    config.pop("attn_apply_pos_encoding")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    (plain / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    assert run("convert", plain, tmp_path / "gdn", "--from-hf").exit_code == 0
    imported = natsl.load_checkpoint(tmp_path / "gdn")[0]
    assert imported.config.natsl_rope
    ids = torch.randint(0, 1024, (1, 140))
    assert torch.equal(logits(model, ids), logits(imported, ids))
