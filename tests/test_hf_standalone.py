"""HF exports that run without natsl: the bundle of natsl's PyTorch code beside modeling_natsl.py
(natsl.hf.bundle), loaded in a process that cannot import natsl.

NATSL_STANDALONE_PYTHON names the interpreter of that process (default: this one), e.g. a virtual
environment with only torch and an older transformers, to check the `hf` extra's floor."""

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from natsl.cli import convert, generate as _generate_command  # noqa: F401  (register the commands)
from natsl.eval.haystack import essay_text
from natsl.hf.bundle import MODELING_FILE, export_sources
from natsl.inference.generate import generate
from natsl.inference.sampling import SamplingConfig
from natsl.tokenizer import train_bpe

pytest.importorskip("transformers")
from test_hf_export import checkpoint, run  # noqa: E402

VOCAB = 300
TINY_MAMBA2 = ["model.mamba2_head_dim=16", "model.mamba2_state_size=8", "model.mamba2_groups=2"]
# Every system that exports as a `model_type: natsl` folder (a plain Transformer is a Llama folder).
SYSTEMS = {
    "gdn": ["model.natsl_layers=[]"],
    "natsl_hybrid": [],  # tiny_hybrid: GDN + NAtS-L layers
    "gdn_hybrid_swa": ["model.natsl_layers=[]", "model.attention_layers=[1]", "model.attn_window=24",
                       "model.tie_embeddings=true"],
    "swa": ["model.base_layer=attention", "model.natsl_layers=[]", "model.attn_window=24"],
    "attention_no_rope": ["model.base_layer=attention", "model.natsl_layers=[]", "model.attn_rope=false"],
    "mamba2": [*TINY_MAMBA2, "model.base_layer=mamba2", "model.natsl_layers=[]", "model.intermediate_size=0"],
    "natsl_mamba2": [*TINY_MAMBA2, "model.base_layer=natsl", "model.natsl_layers=[]", "model.natsl_state=mamba2",
                     "model.natsl_rope=true"],
    "hybrid_mamba2": [*TINY_MAMBA2, "model.base_layer=mamba2", "model.natsl_state=mamba2",
                      "model.mamba2_conv_bias=true"],
}
NEW_TOKENS = 10

# The other process: natsl cannot be imported there (a meta path finder refuses it, and no sys.path
# entry holding it remains); for each export it writes logits and greedy generate() tokens.
NO_NATSL = r"""
import importlib.abc, json, os, sys

class NoNatsl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "natsl" or name.startswith("natsl."):
            raise ImportError(f"No module named {name!r} (blocked: this test runs without natsl)", name=name)
        return None

sys.meta_path.insert(0, NoNatsl())
sys.path[:] = [p for p in sys.path if p and not os.path.isdir(os.path.join(p, "natsl"))]
try:
    import natsl  # noqa: F401
    raise SystemExit("natsl is importable")
except ImportError:
    pass

import torch, transformers

job = json.load(open(sys.argv[1]))
out = {"transformers": transformers.__version__}
for name, folder in job["folders"].items():
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(job["ids"])
    with torch.no_grad():
        logits = model(ids).logits
    prompts = job["prompts"]
    width = max(map(len, prompts))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    tokens = model.generate(padded, attention_mask=mask, max_new_tokens=job["new_tokens"], do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    torch.save(logits, os.path.join(job["out"], name + ".pt"))
    out[name] = {"runtime": model.runtime.name, "module": type(model.model).__module__,
                 "tokens": [row[width:].tolist() for row in tokens]}
assert not any(m == "natsl" or m.startswith("natsl.") for m in sys.modules)
json.dump(out, open(os.path.join(job["out"], "result.json"), "w"))
"""


@pytest.fixture(scope="module")
def tok():
    return train_bpe([essay_text(100)], vocab_size=VOCAB)


def export(tmp_path, tok, system):
    model, folder = checkpoint(tmp_path / "ckpt", tok, system, SYSTEMS)
    result = run("convert", folder, tmp_path / "hf" / system, "--to", "hf")
    assert result.exit_code == 0, result.output
    return model.eval()


def without_natsl(tmp_path, folders: dict, ids: torch.Tensor, prompts: list) -> dict:
    """Load each export in a process that cannot import natsl; its logits and generate() tokens."""
    out = tmp_path / "out"
    out.mkdir()
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"folders": {k: str(v) for k, v in folders.items()}, "ids": ids.tolist(),
                               "prompts": prompts, "new_tokens": NEW_TOKENS, "out": str(out)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "NATSL_"))}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    python = os.environ.get("NATSL_STANDALONE_PYTHON") or sys.executable
    done = subprocess.run([python, "-c", NO_NATSL, str(job)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    for name in folders:
        result[name]["logits"] = torch.load(out / f"{name}.pt")
    return result


def test_exports_run_with_torch_and_transformers_alone(tmp_path, tok):
    """Every natsl system: the export's logits are natsl's (fp32) and its greedy generate() (left-padded
    prompts of two lengths, one past a routing block) gives natsl generate's tokens, in a process
    without natsl, on the bundled chunked PyTorch code."""
    models = {system: export(tmp_path, tok, system) for system in SYSTEMS}
    ids = torch.randint(0, VOCAB, (2, 150))
    prompts = [tok.encode(essay_text(2)[:400])[:90], tok.encode("The garden")]
    theirs = without_natsl(tmp_path, {s: tmp_path / "hf" / s for s in SYSTEMS}, ids, prompts)
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, stop_at_eos=False, temperature=0.0)
    for system, model in models.items():
        got = theirs[system]
        assert got["runtime"] == "bundled" and ".natsl_models_lm" in got["module"], system
        with torch.no_grad():
            ours = model(ids)
        assert ((ours - got["logits"]).norm() / ours.norm()).item() < 1e-5, system
        assert got["tokens"] == [c.tokens for c in generate(model, tok, prompts, config)], system


def test_bundle_imports_only_torch_transformers_and_the_standard_library():
    """Every bundled file imports torch, the standard library and other files of the bundle (the NSA
    layer also flash-linear-attention, inside a function, as in natsl); the modeling file imports natsl
    only inside `try` blocks, which transformers' import check skips."""
    files = export_sources()
    modeling = files.pop(MODELING_FILE.name)
    allowed = {"torch", "transformers"} | set(sys.stdlib_module_names)
    stems = {name[:-3] for name in files}
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1, (name, ast.unparse(node))
                targets = [node.module] if node.module else [a.name for a in node.names]
                assert set(targets) <= stems, (name, ast.unparse(node))
                continue
            else:
                continue
            extra = roots - allowed - ({"fla"} if name == "natsl_models_nsa.py" else set())
            assert not extra, (name, ast.unparse(node))
    # transformers 4 copies the files the modeling file names in `from .X import` lines: all of them.
    named = {line.split()[1][1:] for line in modeling.splitlines() if line.strip().startswith("from .")}
    assert named == stems
    tree = ast.parse(modeling)
    tries = [n for n in ast.walk(tree) if isinstance(n, ast.Try)]
    inside = {id(n) for t in tries for n in ast.walk(t)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level == 0):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if any(n.split(".")[0] == "natsl" for n in names):
                assert id(node) in inside, ast.unparse(node)


def test_runtime_choice_in_process(tmp_path, tok):
    """With natsl installed the export runs natsl itself by default; `natsl_runtime="bundled"` runs the
    bundle (the same logits), and the bundle refuses the Triton backend with the fix."""
    import transformers

    model = export(tmp_path, tok, "natsl_hybrid")
    folder = tmp_path / "hf" / "natsl_hybrid"
    ids = torch.randint(0, VOCAB, (1, 100))
    installed = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    bundled = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32,
                                                                natsl_runtime="bundled")
    assert installed.runtime.name == "installed" and type(installed.model) is type(model)
    assert bundled.runtime.name == "bundled" and type(bundled.model).__module__.endswith(".natsl_models_lm")
    installed.set_backend("chunked")
    with torch.no_grad():
        assert torch.equal(installed(ids).logits, model(ids))
        assert torch.equal(bundled(ids).logits, model(ids))
    with pytest.raises(ValueError, match="install natsl"):
        bundled.set_backend("fast")
    # An edited model section: refused by the bundle as by natsl (a value no weight shape shows).
    config = json.loads((folder / "config.json").read_text())
    config["natsl_recipe"]["model"]["block_size"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block_size was edited"):
        transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, natsl_runtime="bundled")


def test_auto_runs_the_bundle_where_the_installed_natsl_cannot(tmp_path, tok, monkeypatch):
    """The installed natsl lacks a name the exporting one had (another version): the default runtime
    runs the bundle, with the same logits."""
    import natsl.models.lm
    import transformers

    model = export(tmp_path, tok, "natsl_hybrid")
    monkeypatch.delattr(natsl.models.lm, "CausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "natsl_hybrid", trust_remote_code=True,
                                                           dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (1, 100))
    assert hf.runtime.name == "bundled"
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids))
