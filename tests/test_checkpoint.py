"""Model folders round-trip exactly and refuse what is not theirs."""

import json

import pytest
import torch

import natsl
from natsl.checkpoint import save_model_folder
from natsl.errors import NatslError
from natsl.tokenizer import train_bpe


def test_round_trip_gives_identical_logits(tmp_path):
    recipe = natsl.load_recipe("tiny_hybrid")
    torch.manual_seed(0)
    model = natsl.build_model(recipe)
    model.set_backend("chunked")
    tok = train_bpe(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    save_model_folder(tmp_path / "m", model, recipe, tok)
    loaded, tok2 = natsl.load_checkpoint(tmp_path / "m")
    loaded.set_backend("chunked")
    ids = torch.randint(0, 1024, (2, 100))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert tok2.encode("quick fox") == tok.encode("quick fox") and tok2.sha256() == tok.sha256()


def test_bad_folders_are_refused(tmp_path):
    with pytest.raises(NatslError, match="does not exist"):
        natsl.load_checkpoint(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NatslError, match="not a natsl checkpoint"):
        natsl.load_checkpoint(tmp_path / "empty")
    other = tmp_path / "hf"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NatslError, match=r"another model type \(model type 'llama'"):
        natsl.load_checkpoint(other)
    recipe = natsl.load_recipe("tiny_hybrid")
    save_model_folder(tmp_path / "m", natsl.build_model(recipe), recipe)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(NatslError, match="corrupt"):
        natsl.load_checkpoint(tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "format": "natsk"}))  # ours, one field damaged
    with pytest.raises(NatslError, match="has format 'natsk', not 'natsl': the file is damaged"):
        natsl.load_checkpoint(tmp_path / "m")
