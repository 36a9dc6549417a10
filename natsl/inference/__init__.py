"""Incremental inference: caches, prefill and decode (docs/spec.md section 4), generation, latency.

- `cache`: the per-layer caches and `ModelCache` (`CausalLM.new_cache` builds one);
- `functional`: the token step, commit and cached attention the layers' cache paths use;
- `routing`: `force_keep_fraction`, a reproducible router override for measurements;
- `decode`: `DecodeRunner`, one token per sequence per call, replayed as a CUDA graph on CUDA;
- `sampling`, `generate`: the generation loop behind `natsl generate`;
- `bench`: the measurements behind `natsl bench-latency`.

See docs/inference.md.
"""

from natsl.inference.cache import ModelCache, new_model_cache
from natsl.inference.routing import force_keep_fraction

__all__ = ["ModelCache", "force_keep_fraction", "new_model_cache"]
