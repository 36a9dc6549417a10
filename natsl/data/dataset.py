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

from natsl.data.shards import RETOKENIZE, check_splits, open_shard, token_dtype_named
from natsl.data.tokenize import META, PROGRESS, SPLITS, read_meta
from natsl.errors import NatslError
from natsl.files import resolve_inside


class TokenStream:
    """The concatenated shards of one split, read through numpy memmaps."""

    def __init__(self, folder: Path, shards: list[dict], dtype: np.dtype, vocab_size: int):
        self.arrays, self.paths, self.vocab_size = [], [], vocab_size
        for shard in shards:
            path = resolve_inside(folder, shard["file"], f"{str(folder / META)!r}", fix=RETOKENIZE)
            array = open_shard(path, dtype, shard["tokens"])
            if len(array):
                self.arrays.append(array)
                self.paths.append(path)
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.n_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64 (crossing shard boundaries where needed), each
        checked against the vocabulary: an id beyond it (a damaged shard) would index past the
        embedding. The max of the ids read is a small cost next to the step that uses them."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while filled < length:
            array = self.arrays[shard]
            offset = start + filled - int(self.starts[shard])
            take = min(length - filled, len(array) - offset)
            out[filled:filled + take] = array[offset:offset + take]
            check_token_ids(out[filled:filled + take], self.vocab_size, f"token shard {str(self.paths[shard])!r}")
            filled += take
            shard += 1
        return out


def check_token_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    """NatslError if `ids` (non-negative: the shards are unsigned) hold an id >= vocab_size."""
    top = int(ids.max()) if ids.size else -1
    if top >= vocab_size:
        raise NatslError(f"{where} holds token id {top} but the vocabulary has {vocab_size} entries: the data is "
                         "damaged or was tokenized for another model; tokenize it again")


def check_meta(meta: dict, path: Path) -> None:
    """The fields of meta.json that reading relies on, with their types and ranges (a hand-edited or
    damaged file would otherwise fail deep inside numpy)."""
    def bad(what: str) -> NatslError:
        return NatslError(f"{str(path)!r} is damaged: {what}; tokenize the data again")

    token_dtype_named(meta.get("dtype"), repr(str(path)))
    for key in ("vocab_size", "eos_id"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 0:
            raise bad(f"{key} {meta.get(key)!r} is not a count")
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1 or meta["eos_id"] >= meta["vocab_size"]:
        raise bad(f"vocab_size {meta['vocab_size']} and eos_id {meta['eos_id']} do not fit dtype {meta['dtype']}")
    if not isinstance(meta.get("tokenizer_sha256"), str):
        raise bad("it names no tokenizer_sha256")
    check_splits(meta.get("splits"), path.parent, repr(str(path)), SPLITS)


def check_resumed_data(trainer_state: dict, meta: dict, folder, checkpoint: Path) -> None:
    """NatslError when a run resumes from `checkpoint` on data other than it trained on: its data position
    (`samples_seen`) means nothing in another corpus. Checkpoints and folders that record no fingerprint
    pass.

    Args:
        trainer_state: the checkpoint's trainer state (`data`, `data_fingerprint`).
        meta: the data now named (`fingerprint`).
        folder: that data's folder (or task spec), for the message.
        checkpoint: the checkpoint folder, for the message.
    """
    old, new = trainer_state.get("data_fingerprint"), meta.get("fingerprint")
    if old is None or new is None or old == new:
        return
    raise NatslError(f"checkpoint {checkpoint.name} was trained on other data ({trainer_state.get('data')!r}, "
                     f"fingerprint {str(old)[:12]}) than data.path {str(folder)!r} (fingerprint {str(new)[:12]}); "
                     f"resume with --set data.path={as_given(trainer_state.get('data'))}, or train on this data in "
                     f"a new run: --out NEW_FOLDER (from those weights: --set train.init_from={checkpoint})")


def as_given(data) -> str:
    """A recorded data path as a user writes it: the embedded corpus's cache folder is `builtin`."""
    from natsl.data.builtin import cache_root

    path = Path(str(data))
    return "builtin" if path.name.startswith("builtin-") and path.parent == cache_root() else str(data)


class TokenData:
    """A folder written by `natsl tokenize` (or the embedded-corpus cache)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise NatslError(f"data.path {str(folder)!r} is a file, not a folder; set data.path to the folder that "
                             "`natsl tokenize --out` wrote (it holds meta.json)")
        if not self.folder.is_dir():
            raise NatslError(f"data folder {str(folder)!r} does not exist; run `natsl tokenize` to make it, "
                             "or set data.path: builtin for the embedded smoke-test corpus")
        meta = read_meta(self.folder)
        if meta is None:
            hint = (" (an unfinished `natsl tokenize` run: run the same command again to finish it)"
                    if (self.folder / PROGRESS).is_file() else "")
            raise NatslError(f"{str(folder)!r} has no meta.json, so it is not a finished `natsl tokenize` folder{hint}")
        check_meta(meta, self.folder / META)
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.eos_id = meta["eos_id"]
        self.vocab_size = meta["vocab_size"]
        self._streams: dict[str, TokenStream] = {}

    def split(self, name: str) -> TokenStream:
        if name not in SPLITS:
            raise ValueError(name)
        if name not in self._streams:
            self._streams[name] = TokenStream(self.folder, self.meta["splits"][name]["shards"], self.dtype,
                                              self.vocab_size)
        return self._streams[name]

    def tokenizer(self):
        from natsl.tokenizer import Tokenizer

        where = repr(str(self.folder / META))
        name = self.meta.get("tokenizer_file", "tokenizer.json")
        tok = Tokenizer.from_file(resolve_inside(self.folder, name, where, fix=RETOKENIZE))
        if tok.sha256() != self.meta["tokenizer_sha256"]:
            raise NatslError(f"the tokenizer in {str(self.folder)!r} does not match meta.json (sha256 differs); "
                             "tokenize the data again")
        if tok.vocab_size != self.vocab_size:  # the ids are checked against meta.json's count as they are read
            raise NatslError(f"{where} is damaged: vocab_size {self.vocab_size} is not its tokenizer's "
                             f"{tok.vocab_size}; tokenize the data again")
        tok.eos_id = self.eos_id
        tok.add_bos = bool(self.meta.get("add_bos", False))  # folders from before the option: no BOS
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
