"""Incremental inference: caches, prefill and decode (docs/spec.md section 4), generation, latency.

- `ModelCache` and `force_keep_fraction`, re-exported from the model side (`natsl.models.cache`,
  `natsl.models.routing`): the caches and the cached paths belong to the layers;
- `decode`: `DecodeRunner`, one token per sequence per call, replayed as a CUDA graph on CUDA;
- `sampling`, `generate`: the generation loop behind `natsl generate`;
- `bench`: the measurements behind `natsl bench-latency`.

See docs/inference.md.
"""

from natsl.models.cache import ModelCache, new_model_cache
from natsl.models.routing import force_keep_fraction

__all__ = ["ModelCache", "force_keep_fraction", "new_model_cache"]
