"""Evaluation data: token shards written by `natsl tokenize`, or raw `.txt` / `.jsonl` tokenized on
the fly with the checkpoint's own tokenizer.

Token shards carry the sha256 of the tokenizer that produced them; evaluating them with a checkpoint
whose tokenizer differs would score the wrong symbols, so that is refused with one line.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from natsl.errors import NatslError
from natsl.files import parse_json

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
SHARD_SUFFIXES = (".bin", ".npy")
NATSL_TOKENS_FORMAT = "natsl-tokens"  # meta.json "format" of folders written by `natsl tokenize`


@dataclass
class TokenData:
    """Documents as arrays of token ids. `stream` data (token shards) has one long document."""

    name: str
    path: str
    docs: list[np.ndarray]
    kind: str  # "text" or "tokens"
    tokenizer_sha256: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(d) for d in self.docs))


def data_name(path: Path) -> str:
    path = Path(path)
    return path.name if path.is_dir() else path.stem


def read_text_documents(path: Path, text_key: str = "text") -> list[str]:
    """`.txt`: the whole file is one document; `.jsonl`: one document per line (an object with
    `text_key`, or a bare JSON string). A FIFO or device (open would wait for a writer) is a one-line
    NatslError."""
    path = Path(path)
    if not stat.S_ISREG(path.stat().st_mode):
        raise NatslError(f"{str(path)!r} is not a regular file; pass a .txt, a .jsonl or a `natsl tokenize` folder")
    if path.suffix in JSONL_SUFFIXES:
        docs = []
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = parse_json(line, f"{str(path)!r} line {number}",
                                 f"each line must be an object with a {text_key!r} field")
                if isinstance(row, str):
                    docs.append(row)
                elif isinstance(row, dict) and isinstance(row.get(text_key), str):
                    docs.append(row[text_key])
                else:
                    raise NatslError(f"{str(path)!r} line {number} has no string field {text_key!r}; "
                                     f"pass --text-key with the field that holds the text")
        return docs
    try:
        return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError:
        raise NatslError(f"{str(path)!r} is not UTF-8 text; pass a .txt, a .jsonl or a `natsl tokenize` folder") from None


def _find_sha(meta: dict) -> str | None:
    """The tokenizer fingerprint in a meta.json, wherever the writer put it."""
    for key, value in meta.items():
        if isinstance(value, str) and "sha256" in key.lower() and "tokenizer" in key.lower():
            return value
    for key in ("tokenizer", "tokenizer_info"):
        sub = meta.get(key)
        if isinstance(sub, dict):
            for k, v in sub.items():
                if isinstance(v, str) and "sha256" in k.lower():
                    return v
    for key, value in meta.items():
        if isinstance(value, str) and key.lower() == "sha256":
            return value
    return None


def _foreign_shards(folder: Path, meta: dict) -> list[tuple[Path, int | None]]:
    """(path, declared token count or None) of each shard of a folder in another layout: those listed
    under "shards" / "files" (a name, or an object with "path" / "file" / "name" and "tokens"), else
    every *.bin / *.npy below the folder in name order; each one inside the folder."""
    from natsl.data.shards import RETOKENIZE
    from natsl.files import resolve_inside

    where = repr(str(folder / "meta.json"))
    listed = meta.get("shards") or meta.get("files")
    shards = []
    if isinstance(listed, list):
        for item in listed:
            if isinstance(item, dict):
                name = item.get("path") or item.get("file") or item.get("name")
                tokens = item.get("tokens")
                if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0):
                    raise NatslError(f"{where} gives shard {name!r} the token count {tokens!r}, not a count >= 0; "
                                     "re-run `natsl tokenize`")
            else:
                name, tokens = item, None
            shards.append((resolve_inside(folder, name, where, fix=RETOKENIZE), tokens))
    if not shards:
        found = sorted(p for p in folder.rglob("*") if p.suffix in SHARD_SUFFIXES and p.is_file())
        search = f"the search of {str(folder)!r}"
        shards = [(resolve_inside(folder, str(p.relative_to(folder)), search, fix=RETOKENIZE), None)
                  for p in found]
    return shards


def read_natsl_tokens(folder: Path, split: str = "auto", max_tokens: int | None = None):
    """(stream, meta, sha256, split used) of a folder in `natsl tokenize`'s own format, read through
    `natsl.data`; "auto" takes the validation split when it has tokens, else train."""
    from natsl.data.dataset import TokenData as TokenFolder

    data = TokenFolder(folder)
    names = ("validation", "train") if split == "auto" else (split,)
    if split not in ("auto", "train", "validation"):
        raise NatslError(f"unknown --split {split!r}: use auto, train or validation")
    for name in names:
        stream = data.split(name)
        if stream.n_tokens:
            n = stream.n_tokens if max_tokens is None else min(stream.n_tokens, max_tokens)
            return stream.read(0, n), data.meta, data.meta.get("tokenizer_sha256"), name
    raise NatslError(f"{str(folder)!r} has no tokens in split {names[0]!r}; pick another --split")


def read_token_folder(folder: Path, max_tokens: int | None = None, split: str = "auto") -> tuple[np.ndarray, dict, str | None]:
    """(the token ids of a `natsl tokenize` folder as one stream, at most `max_tokens` of them when
    given; its meta.json; the sha256 of the tokenizer that made them), every shard checked before it
    is read (natsl.data.shards)."""
    from natsl.data.shards import RETOKENIZE, open_shard, read_json_object, token_dtype_named
    from natsl.files import resolve_inside

    folder = Path(folder)
    meta_path = folder / "meta.json"
    meta = read_json_object(meta_path)
    if meta.get("format") == NATSL_TOKENS_FORMAT:
        stream, meta, sha, used = read_natsl_tokens(folder, split, max_tokens)
        return np.asarray(stream, dtype=np.int64), {**meta, "split_used": used}, sha
    # Another layout of token shards: meta.json with a dtype (and the tokenizer's sha256), shards
    # listed under "shards"/"files" or found as *.bin / *.npy, read in name order.
    if split not in ("auto", "train"):
        raise NatslError(f"--split {split!r} needs a folder in `natsl tokenize`'s format; {str(folder)!r} is another layout")
    sha = _find_sha(meta)
    if sha is None and (folder / "tokenizer.json").is_file():
        from natsl.tokenizer import Tokenizer

        sha = Tokenizer.from_file(resolve_inside(folder, "tokenizer.json", f"{str(folder)!r}", fix=RETOKENIZE)).sha256()
    dtype = token_dtype_named(meta["dtype"], repr(str(meta_path))) if "dtype" in meta else None
    shards = _foreign_shards(folder, meta)
    if not shards:
        raise NatslError(f"{str(folder)!r} has a meta.json but no token shards (*.bin / *.npy); re-run `natsl tokenize`")
    arrays = [open_shard(path, dtype, tokens) for path, tokens in shards]  # every shard checked before any is read
    total = meta.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool) and total != sum(len(a) for a in arrays):
        raise NatslError(f"{str(meta_path)!r} says total_tokens {total} but its shards hold "
                         f"{sum(len(a) for a in arrays)} ids of their dtype: its dtype or counts are wrong; "
                         "re-run `natsl tokenize`")
    parts, taken = [], 0
    for array in arrays:
        take = len(array) if max_tokens is None else min(len(array), max_tokens - taken)
        parts.append(np.asarray(array[:take], dtype=np.int64))
        taken += take
        if max_tokens is not None and taken >= max_tokens:
            break
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return stream, meta, sha


def split_at_eos(stream: np.ndarray, eos_id: int | None) -> list[np.ndarray]:
    """A token stream of `natsl tokenize` (every document followed by EOS) -> the documents, EOS dropped."""
    if eos_id is None:
        return [stream]
    ends = np.flatnonzero(stream == eos_id)
    docs, start = [], 0
    for end in ends:
        if end > start:
            docs.append(stream[start:end])
        start = end + 1
    if start < len(stream):
        docs.append(stream[start:])
    return docs


def load_token_data(path, tokenizer=None, *, text_key: str = "text", max_docs: int | None = None,
                    max_tokens: int | None = None, split: str = "auto") -> TokenData:
    """Evaluation data at `path` as token ids of `tokenizer` (the checkpoint's).

    Raises a one-line NatslError for a missing path, an unknown format, text without a tokenizer,
    and token shards made by another tokenizer.
    """
    path = Path(path)
    if not path.exists():
        raise NatslError(f"data {str(path)!r} does not exist; pass a .txt, a .jsonl or a folder written by `natsl tokenize`")
    if path.is_dir():
        if not (path / "meta.json").is_file():
            raise NatslError(f"{str(path)!r} is a folder without meta.json; pass a folder written by `natsl tokenize`, "
                             "a .txt or a .jsonl file")
        stream, meta, sha = read_token_folder(path, max_tokens, split)
        if tokenizer is not None and sha is not None and sha != tokenizer.sha256():
            raise NatslError(f"data {str(path)!r} was tokenized with a different tokenizer (sha256 {sha[:12]}...) than "
                             f"the checkpoint's ({tokenizer.sha256()[:12]}...); re-tokenize it with the checkpoint's "
                             "tokenizer.json or pass the raw .txt/.jsonl")
        eos = meta.get("eos_id") if isinstance(meta, dict) else None
        return TokenData(data_name(path), str(path), [stream], "tokens", sha,
                         {"meta": meta, "eos_id": eos if isinstance(eos, int) else None})
    if path.suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
        raise NatslError(f"unknown data format {path.suffix or '(no suffix)'!r} for {str(path)!r}; pass a .txt, a .jsonl "
                         "or a folder written by `natsl tokenize`")
    if tokenizer is None:
        raise NatslError("the checkpoint has no tokenizer.json, so raw text cannot be tokenized; pass token shards "
                         "made with its tokenizer or re-save the checkpoint with one")
    texts = read_text_documents(path, text_key)
    if max_docs is not None:
        texts = texts[:max_docs]
    texts = [t for t in texts if t]
    if not texts:
        raise NatslError(f"{str(path)!r} holds no text")
    docs, total = [], 0
    head = tokenizer.document_start()  # [BOS] for a model whose documents started so, as in its training data
    for start in range(0, len(texts), 64):  # stop tokenizing once `max_tokens` are in hand
        for ids in tokenizer.encode_batch(texts[start:start + 64]):
            ids = head + ids
            docs.append(np.asarray(ids, dtype=np.int64))
            total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return TokenData(data_name(path), str(path), docs, "text", tokenizer.sha256())


def check_vocab(data: TokenData, vocab_size: int) -> None:
    top = max((int(d.max()) for d in data.docs if len(d)), default=-1)
    if top >= vocab_size:
        raise NatslError(f"data {data.path!r} has token id {top} but the model's vocabulary has {vocab_size} entries; "
                         "it was tokenized for another model")


def windows(data: TokenData, length: int, max_windows: int | None = None, *, concat: bool = False,
            eos_id: int | None = None, min_len: int = 2) -> list[np.ndarray]:
    """Consecutive, non-overlapping windows of up to `length` tokens.

    Each document is cut on its own (a window never spans two documents) unless `concat`, which
    joins the documents (with EOS between them when the tokenizer has one) into one stream first.
    Windows shorter than `min_len` are dropped.
    """
    if length < 2:
        raise NatslError(f"window length must be at least 2 tokens, got {length}")
    docs = data.docs
    if data.kind == "tokens" and not concat:
        # A token stream holds documents separated by EOS: cut it back into them, as for text.
        docs = [d for stream in docs for d in split_at_eos(stream, data.extra.get("eos_id"))]
    if concat and len(docs) > 1:
        parts = []
        for d in docs:
            parts.append(d)
            if eos_id is not None:
                parts.append(np.asarray([eos_id], dtype=np.int64))
        docs = [np.concatenate(parts)]
    out = []
    for doc in docs:
        for start in range(0, len(doc), length):
            piece = doc[start:start + length]
            if len(piece) >= min_len:
                out.append(np.asarray(piece, dtype=np.int64))
                if max_windows is not None and len(out) >= max_windows:
                    return out
    return out


def builtin_windows(tokenizer, seq_len: int, samples: int, vocab_size: int) -> list[np.ndarray]:
    """`samples` windows of `seq_len` tokens of natsl's embedded corpus (`natsl.data.builtin`),
    tokenized with `tokenizer`; empty when there is no tokenizer, no corpus, or too little of it."""
    if tokenizer is None:
        return []
    try:
        from natsl.data.builtin import builtin_documents
    except ImportError:
        return []
    texts, _ = builtin_documents()
    need = seq_len * samples
    ids: list[int] = []
    eos = tokenizer.eos_id
    for text in texts:
        ids.extend(tokenizer.document_start() + tokenizer.encode(text))
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < seq_len or max(ids) >= vocab_size:
        return []
    stream = np.asarray(ids, dtype=np.int64)
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(min(samples, len(stream) // seq_len))]
