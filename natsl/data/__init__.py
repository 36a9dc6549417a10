"""Data: tokenizing corpora into token shards (`natsl tokenize`) and reading them for training.

- `sources`: documents from local files, a Hugging Face dataset, or memory; `local_files`: which local
  files count (folders, globs, --include) and how each is read (.gz, bad files).
- `tokenize`: the resumable, idempotent shard writer (`tokenize_corpus`) and its `meta.json`; `dedup`
  (exact duplicates), `mix` (its per-input counts), `val_texts` (held-out documents as text).
- `dataset`: memory-mapped shards and the (seed, sample index) -> window order used by training.
- `builtin`: the embedded smoke-test corpus (Python standard-library source) behind `data.path: builtin`.
"""

from natsl.data.dataset import TokenData, WindowSampler, step_sample_indices
from natsl.data.tokenize import TokenizeSettings, tokenize_corpus

__all__ = ["TokenData", "WindowSampler", "step_sample_indices", "TokenizeSettings", "tokenize_corpus"]
