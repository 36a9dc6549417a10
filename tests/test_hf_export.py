"""`natsl convert --to hf` / `--from-hf`: Llama and remote-code folders that `transformers` loads."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import natsl
from natsl.checkpoint import save_model_folder
from natsl.cli import convert, generate as _generate_command  # noqa: F401  (register the commands)
from natsl.cli.app import app
from natsl.config import apply_overrides
from natsl.eval.haystack import essay_text
from natsl.inference.generate import generate
from natsl.inference.sampling import SamplingConfig
from natsl.tokenizer import train_bpe

transformers = pytest.importorskip("transformers")

VOCAB = 300
TINY_MAMBA2 = ["model.mamba2_head_dim=16", "model.mamba2_state_size=8", "model.mamba2_groups=2"]
SYSTEMS = {
    "transformer": ["model.base_layer=attention", "model.natsl_layers=[]"],
    "natsl_hybrid": [],  # tiny_hybrid: GDN + NAtS-L layers
    "gdn_hybrid": ["model.natsl_layers=[]", "model.attention_layers=[1]", "model.tie_embeddings=true"],
    # The Mamba2 systems at tiny sizes: 8 heads of 16 channels, state 8, two B/C groups.
    "mamba2": [*TINY_MAMBA2, "model.base_layer=mamba2", "model.natsl_layers=[]", "model.intermediate_size=0"],
    "natsl_mamba2": [*TINY_MAMBA2, "model.base_layer=natsl", "model.natsl_layers=[]", "model.natsl_state=mamba2",
                     "model.natsl_rope=true"],
    # with the Mamba2 convs' bias (the authors' default)
    "hybrid_mamba2": [*TINY_MAMBA2, "model.base_layer=mamba2", "model.natsl_state=mamba2", "model.mamba2_conv_bias=true"],
}


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def tok():
    return train_bpe([essay_text(100)], vocab_size=VOCAB)


def checkpoint(tmp_path, tok, system, systems=None):
    """tiny_hybrid as `system` (an entry of `systems`, default SYSTEMS), saved to tmp_path/system; the model on
    the chunked backend and the folder."""
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"),
                             [f"model.vocab_size={VOCAB}", *(systems or SYSTEMS)[system]])
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("conv.bias"):  # off its zero init, so a bias lost on the way shows in the logits
                p.uniform_(-1.0, 1.0)
    save_model_folder(tmp_path / system, model, recipe, tok)
    model.set_backend("chunked")
    return model, tmp_path / system


def load_hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    if hasattr(model, "set_backend"):
        model.set_backend("chunked")
    return model.eval()


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_export_logits_and_round_trip(tmp_path, tok, system):
    model, ckpt = checkpoint(tmp_path, tok, system)
    result = run("convert", ckpt, tmp_path / "hf", "--to", "hf")
    assert result.exit_code == 0, result.output
    assert "verified:" in result.output  # read back as an import reads it, every tensor compared
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf = load_hf(tmp_path / "hf")
    if system == "transformer":  # plain Llama: no remote code, transformers' own classes
        assert config["model_type"] == "llama" and "auto_map" not in config
        assert type(hf).__name__ == "LlamaForCausalLM" and type(hf).__module__.startswith("transformers.models.llama")
    else:
        assert config["model_type"] == "natsl" and (tmp_path / "hf" / "modeling_natsl.py").is_file()
        assert isinstance(hf, transformers.GenerationMixin) and isinstance(hf, transformers.PreTrainedModel)
    ids = torch.randint(0, VOCAB, (2, 140))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert ((ours - theirs).norm() / ours.norm()).item() < 1e-5
    # The tokenizer: same ids, EOS named, nothing added that natsl did not train with.
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    text = essay_text(3)[:300]
    assert hf_tok(text).input_ids == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eos_id == config["eos_token_id"]
    # Back to natsl: the same tensors, bit for bit, and the same recipe.
    result = run("convert", tmp_path / "hf", tmp_path / "back", "--from-hf")
    assert result.exit_code == 0, result.output
    before, after = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["recipe"]["model"] == json.loads((ckpt / "config.json").read_text())["recipe"]["model"]
    assert back["source_model_type"] == config["model_type"]


@pytest.mark.parametrize("system", ["transformer", "gdn_hybrid"])  # a Llama folder; a tied head stored once
def test_export_verification_finds_a_changed_or_missing_tensor(tmp_path, tok, system):
    from safetensors.torch import save_file

    from natsl.errors import NatslError
    from natsl.hf.export import verify_hf_export

    _, ckpt = checkpoint(tmp_path, tok, system)
    result = run("convert", ckpt, tmp_path / "hf", "--to", "hf", "--no-verify")
    assert result.exit_code == 0 and "verified:" not in result.output, result.output
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    assert verify_hf_export(ckpt, tmp_path / "hf") == len(tensors)
    name = sorted(tensors)[-1]
    changed = dict(tensors, **{name: tensors[name] + 1})
    save_file(changed, str(weights), metadata={"format": "pt"})
    with pytest.raises(NatslError, match="verification failed"):
        verify_hf_export(ckpt, tmp_path / "hf")
    save_file({k: v for k, v in tensors.items() if k != name}, str(weights), metadata={"format": "pt"})
    with pytest.raises(NatslError):  # a tensor gone: the import's own shape check or the comparison says so
        verify_hf_export(ckpt, tmp_path / "hf")


def test_an_import_of_nan_weights_says_so(tmp_path, tok):
    from safetensors.torch import save_file

    from cli_checks import assert_one_line_error

    _, ckpt = checkpoint(tmp_path, tok, "transformer")
    assert run("convert", ckpt, tmp_path / "hf", "--to", "hf").exit_code == 0
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert_one_line_error(run("convert", tmp_path / "hf", tmp_path / "back", "--from-hf"), "holds NaN or infinite")
    assert not (tmp_path / "back").exists()


GREEDY, SAMPLING = dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=3)


@pytest.mark.parametrize("system, sampling", [("natsl_hybrid", GREEDY), ("natsl_hybrid", SAMPLING), ("mamba2", GREEDY),
                                              ("natsl_mamba2", GREEDY), ("hybrid_mamba2", SAMPLING)])
def test_remote_code_generate_matches_natsl_generate(tmp_path, tok, system, sampling):
    model, ckpt = checkpoint(tmp_path, tok, system)
    assert run("convert", ckpt, tmp_path / "hf", "--to", "hf").exit_code == 0
    hf = load_hf(tmp_path / "hf")
    prompts = [tok.encode(essay_text(2)[:400]), tok.encode("The garden")]  # two lengths: left padding
    config = SamplingConfig(max_new_tokens=12, stop_at_eos=False, **sampling)
    ours = generate(model, tok, prompts, config)
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.eos_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = (dict(do_sample=False) if config.temperature == 0 else
               dict(do_sample=True, temperature=config.temperature, top_k=config.top_k, top_p=1.0))
    torch.manual_seed(config.seed)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=tok.eos_id,
                      **options)
    assert [row[width:].tolist() for row in out] == [c.tokens for c in ours]


def test_from_hf_tells_the_formats_apart(tmp_path, tok):
    model, ckpt = checkpoint(tmp_path, tok, "transformer")
    assert run("convert", ckpt, tmp_path / "hf", "--to", "hf").exit_code == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # A Llama from elsewhere (no natsl_recipe) imports from its Llama settings alone.
    del config["natsl_recipe"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert run("convert", tmp_path / "hf", tmp_path / "plain", "--from-hf").exit_code == 0
    loaded, _ = natsl.load_checkpoint(tmp_path / "plain")
    loaded.set_backend("chunked")
    ids = torch.randint(0, VOCAB, (1, 50))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    # What natsl's Transformer cannot be is refused with the reason.
    config["num_key_value_heads"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = run("convert", tmp_path / "hf", tmp_path / "gqa", "--from-hf")
    assert result.exit_code == 2 and "grouped-query" in result.stderr


def test_bos_the_model_trained_with_travels_to_hf_and_back(tmp_path):
    """A model whose documents started with <s> (Llama-2's convention): the checkpoint records it, the
    export's tokenizer adds it (`add_bos_token`), and the import back keeps it."""
    from natsl.checkpoint import load_checkpoint

    bos_tok = train_bpe([essay_text(20)], vocab_size=VOCAB - 1, eos_token="</s>")
    bos_tok.inner.add_special_tokens(["<s>"])
    bos_tok = type(bos_tok).from_file(bos_tok.save(tmp_path))
    bos_tok.add_bos = True
    recipe = apply_overrides(natsl.load_recipe("tiny_hybrid"), [f"model.vocab_size={VOCAB}", *SYSTEMS["transformer"]])
    save_model_folder(tmp_path / "ckpt", natsl.build_model(recipe), recipe, bos_tok)
    _, loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.add_bos and loaded.document_start() == [bos_tok.bos_id]
    assert run("convert", tmp_path / "ckpt", tmp_path / "hf", "--to", "hf").exit_code == 0
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["add_bos_token"] is True
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = essay_text(2)[:200]
    assert hf_tok(text).input_ids == [bos_tok.bos_id] + bos_tok.encode(text)
    assert run("convert", tmp_path / "hf", tmp_path / "back", "--from-hf").exit_code == 0
    _, back = load_checkpoint(tmp_path / "back")
    assert back.add_bos and back.bos_id == bos_tok.bos_id
    # A checkpoint from before the record (no "tokenizer" in config.json) trained without BOS.
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["tokenizer"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert not load_checkpoint(tmp_path / "ckpt")[1].add_bos


def test_an_export_older_than_the_mamba2_fields_loads_as_the_model_it_was(tmp_path, tok):
    """Exports written before `attn_window` and the Mamba2 fields existed name neither: both ways in
    (transformers' remote code and --from-hf) build the model they were, a GDN-state NAtS-L Hybrid; a
    field missing for another reason is refused."""
    model, ckpt = checkpoint(tmp_path, tok, "natsl_hybrid")
    assert run("convert", ckpt, tmp_path / "hf", "--to", "hf").exit_code == 0
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    for key in ("attn_window", "natsl_state", "mamba2_head_dim", "mamba2_state_size", "mamba2_expand", "mamba2_groups",
                "mamba2_state_l2", "mamba2_state_skip", "mamba2_mlp", "mamba2_conv_bias"):
        del config["natsl_recipe"]["model"][key]
    for key in ("natsl_version", "natsl_format_version", "natsl_model_sha256"):  # recorded by later exports only
        del config[key]
    path.write_text(json.dumps(config))
    ids = torch.randint(0, VOCAB, (1, 90))
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "hf")(ids).logits, model(ids))
    assert run("convert", tmp_path / "hf", tmp_path / "back", "--from-hf").exit_code == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["recipe"]["model"]["natsl_state"] == "gdn"
    del config["natsl_recipe"]["model"]["head_v_dim"]
    path.write_text(json.dumps(config))
    result = run("convert", tmp_path / "hf", tmp_path / "bad", "--from-hf")
    assert result.exit_code == 2 and "lacks head_v_dim" in result.stderr
