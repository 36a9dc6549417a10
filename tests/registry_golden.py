"""The numbers the layer registry (natsl.models.registry) must keep: for a tiny model of every layer
type, recorded once with the code from before the registry (`python tests/registry_golden.py` rewrote
tests/registry_golden.json then) and checked by tests/test_registry.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("registry_golden.json")

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=2, head_k_dim=16,
            head_v_dim=32, softmax_heads_per_group=2, attn_num_heads=2, attn_head_dim=16, block_size=16,
            mamba2_head_dim=16, mamba2_state_size=8, nsa_num_heads=16, nsa_kv_heads=1, nsa_head_dim=16,
            nsa_block_size=16, nsa_block_counts=4, nsa_window=16, max_seq_len=256)

# One model per layer type (and per variant of one: NAtS-L on each state, SWA, Mamba2 blocks with an MLP).
CASES = {
    "natsl_gdn": dict(base_layer="gdn", natsl_layers=[1, 3]),
    "natsl_gdn_rope_ablations": dict(base_layer="natsl", gdn_layers=[0], natsl_rope=True, mix_weights="none",
                                     branch_norm="after_sum", mix_input="x", router_keep_budget=0.5),
    "natsl_mamba2": dict(base_layer="mamba2", natsl_layers=[1, 3], natsl_state="mamba2"),
    "natsl_mamba2_plain": dict(base_layer="natsl", natsl_state="mamba2", mamba2_state_l2=False,
                               mamba2_state_skip=True, mamba2_layers_mlp=None),
    "mamba2_mlp_bias": dict(base_layer="mamba2", mamba2_mlp=True, mamba2_conv_bias=True),
    "transformer": dict(base_layer="attention"),
    "gdn_swa": dict(base_layer="gdn", attention_layers=[1, 3], attn_window=8),
    "nsa_hybrid": dict(base_layer="gdn", nsa_layers=[1]),
}


def config_of(name: str):
    from natsl.config import ModelConfig

    fields = {**TINY, **CASES[name]}
    fields.pop("mamba2_layers_mlp", None)
    config = ModelConfig(**fields)
    config.validate()
    return config


def digest(tensors) -> str:
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def sample(t: torch.Tensor) -> list[float]:
    flat = t.detach().double().flatten()
    return [float(flat.abs().mean()), float(flat.sum())] + [float(v) for v in flat[:: max(1, flat.numel() // 16)][:16]]


def cache_layout(cache) -> list:
    import dataclasses

    out = []
    for layer in cache.layers:
        fields = {}
        for f in dataclasses.fields(layer):
            value = getattr(layer, f.name)
            if isinstance(value, torch.Tensor):
                fields[f.name] = [list(value.shape), str(value.dtype)]
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                fields[f.name] = [[list(v.shape), str(v.dtype)] for v in value]
            elif isinstance(value, (int, float, str, bool)) or value is None:
                fields[f.name] = value
        out.append([type(layer).__name__, fields])
    return out


def measure(name: str) -> dict:
    """Everything the registry's users compute for the model of case `name`."""
    from natsl.errors import NatslError
    from natsl.inference.bench import prefill_flops
    from natsl.models import build_model
    from natsl.models.lm import has_mlp, rope_table_for
    from natsl.models.state_cost import state_flops_per_token
    from natsl.training.flops import flops_per_token

    config = config_of(name)
    torch.manual_seed(0)
    model = build_model(config)
    out = {"params": digest(model.state_dict().items()), "n_params": model.num_parameters(),
           "mlp": [has_mlp(config, t) for t in config.layer_types()]}
    rope = rope_table_for(config, 40, torch.device("cpu"))
    out["rope_dims"] = None if rope is None else sorted(int(d) for d in rope._angles)
    out["flops"] = [flops_per_token(config, 200, 0.5), flops_per_token(config, 7, 1.0)]
    out["prefill_flops"] = [prefill_flops(model, 300, 2, 0.5), prefill_flops(model, 5)]
    out["state_flops"] = {t: state_flops_per_token(config, t, 16.0) for t in sorted(set(config.layer_types()))
                          if t in ("gdn", "mamba2", "natsl")}
    if name == "nsa_hybrid":
        try:
            model.new_cache(2, 64)
        except NatslError as err:
            out["cache_error"] = str(err)
        return out
    model.set_backend("chunked")
    ids = torch.randint(0, config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out["logits"] = sample(model(ids))
        cache = model.new_cache(2, 64)
        out["cache"] = cache_layout(cache)
        steps = [model(ids[:, :33], cache=cache)[:, -1]]
        for i in range(33, 37):
            steps.append(model(ids[:, i:i + 1], cache=cache)[:, -1])
        out["cached_logits"] = sample(torch.stack(steps, 1))
    return out


def measure_hf_names() -> dict:
    from natsl.config import Recipe
    from natsl.eval.convert import hf_name_map

    return {name: hf_name_map(Recipe(name=name, model=config_of(name)), root=root)
            for name, root in (("natsl_gdn", "model"), ("natsl_mamba2", "backbone"))}


def measure_info(name: str, folder: Path) -> list[str]:
    """`natsl info RECIPE --no-forward`'s lines for the model of case `name`."""
    import dataclasses
    import os
    import subprocess
    import sys

    import yaml

    recipe = folder / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump({"name": name, "model": dataclasses.asdict(config_of(name))}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run([sys.executable, "-m", "natsl.cli.main", "info", str(recipe), "--no-forward"],
                          capture_output=True, text=True, env=env, check=True)
    return done.stdout.splitlines()


def measure_kernels(name: str) -> list:
    from natsl.inference.kernel_table import kernel_table

    return kernel_table(config_of(name), "cpu", backend="reference")


def measure_all(folder: Path) -> dict:
    return {"cases": {name: measure(name) for name in CASES}, "hf_names": measure_hf_names(),
            "info": {name: measure_info(name, folder) for name in CASES},
            "kernels": {name: measure_kernels(name) for name in CASES}}


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        GOLDEN.write_text(json.dumps(measure_all(Path(tmp)), indent=1, sort_keys=True) + "\n")
