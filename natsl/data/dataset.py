"""Reading a tokenized folder for training: memory-mapped shards and a resumable sample order.

A split's shards form one token stream. Training samples are windows of `seq_len + 1` tokens
(inputs and next-token targets) that start at multiples of `seq_len`; window order is a fresh
permutation of all windows each epoch, drawn from (seed, epoch). Global sample `i` is therefore a
pure function of (seed, i): the data position of a run is one integer, `samples_seen`, and it
needs no saved iterator to resume. Ranks take disjoint samples of each optimizer step, and the
set of samples that makes a step does not depend on the number of ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from natsl.data.tokenize import SPLITS, read_meta
from natsl.errors import NatslError


class TokenStream:
    """The concatenated shards of one split, read through numpy memmaps."""

    def __init__(self, folder: Path, shards: list[dict], dtype: np.dtype):
        self.arrays = []
        for shard in shards:
            path = folder / shard["file"]
            want = shard["tokens"] * dtype.itemsize
            if not path.is_file() or path.stat().st_size != want:
                raise NatslError(f"token shard {str(path)!r} is missing or has the wrong size (expected {want} bytes); "
                                 "tokenize the data again")
            if shard["tokens"]:
                self.arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.n_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64 (crossing shard boundaries where needed)."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            array = self.arrays[shard]
            offset = start + filled - int(self.starts[shard])
            take = min(length - filled, len(array) - offset)
            out[filled:filled + take] = array[offset:offset + take]
            filled += take
            shard += 1
        return out


class TokenData:
    """A folder written by `natsl tokenize` (or the embedded-corpus cache)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise NatslError(f"data folder {str(folder)!r} does not exist; run `natsl tokenize` to make it, "
                             "or set data.path: builtin for the embedded smoke-test corpus")
        meta = read_meta(self.folder)
        if meta is None:
            hint = (" (an unfinished `natsl tokenize` run: run the same command again to finish it)"
                    if (self.folder / ".progress.json").is_file() else "")
            raise NatslError(f"{str(folder)!r} has no meta.json, so it is not a finished `natsl tokenize` folder{hint}")
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.eos_id = meta["eos_id"]
        self.vocab_size = meta["vocab_size"]
        self._streams: dict[str, TokenStream] = {}

    def split(self, name: str) -> TokenStream:
        if name not in SPLITS:
            raise ValueError(name)
        if name not in self._streams:
            self._streams[name] = TokenStream(self.folder, self.meta["splits"][name]["shards"], self.dtype)
        return self._streams[name]

    def tokenizer(self):
        from natsl.tokenizer import Tokenizer

        tok = Tokenizer.from_file(self.folder / self.meta.get("tokenizer_file", "tokenizer.json"))
        if tok.sha256() != self.meta["tokenizer_sha256"]:
            raise NatslError(f"the tokenizer in {str(self.folder)!r} does not match meta.json (sha256 differs); "
                             "tokenize the data again")
        tok.eos_id = self.eos_id
        return tok


class WindowSampler:
    """Global sample index -> a window of `seq_len + 1` tokens; a new permutation every epoch."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int):
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.n_windows = (stream.n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise NatslError(f"the training split has {stream.n_tokens} tokens, fewer than train.seq_len + 1 = "
                             f"{seq_len + 1}; use more data or a shorter seq_len")
        self._epoch, self._order = -1, None

    def window(self, index: int) -> int:
        epoch, pos = divmod(index, self.n_windows)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._epoch = rng.permutation(self.n_windows), epoch
        return int(self._order[pos])

    def batch(self, indices: list[int]) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64 tokens."""
        rows = [self.stream.read(self.window(i) * self.seq_len, self.seq_len + 1) for i in indices]
        return torch.from_numpy(np.stack(rows))


def step_sample_indices(base: int, micro_batch: int, accum: int, rank: int, world: int) -> list[list[int]]:
    """The global sample indices of each of this rank's micro-batches in the step that starts at sample `base`.

    The step uses samples [base, base + G) with G = micro_batch * accum * world; micro-batch m of
    rank r holds the `micro_batch` samples starting at base + (m * world + r) * micro_batch.
    """
    return [[base + (m * world + rank) * micro_batch + b for b in range(micro_batch)] for m in range(accum)]


def eval_windows(stream: TokenStream, seq_len: int, max_tokens: int) -> int:
    """How many consecutive windows of the validation split the evaluation reads."""
    return min((stream.n_tokens - 1) // seq_len, max(1, max_tokens // seq_len)) if stream.n_tokens > seq_len else 0
