"""Token shards from data folders that strangers hand over: every check made before a byte is mapped.

numpy maps a file as whatever dtype it is told, so a data folder decides what its bytes mean: an
`object` dtype turns them into pointers (a crash), a float or signed dtype into ids no tokenizer
made. Every reader of token shards (training's `natsl.data.dataset`, the evaluation commands'
`natsl.eval.data`) therefore opens them here, where
- the dtype is one that `natsl tokenize` writes (`TOKEN_DTYPES`, unsigned integers), named as a string;
- a shard's path, read from a file or found by a search, resolves inside its data folder (symlinks
  resolved too; `natsl.files.resolve_inside`), so a `meta.json` cannot point the reader at `../..` or `/etc`;
- a shard's size is its declared token count times the dtype's width (uint32 data declared as
  uint16 would otherwise read as twice as many wrong ids), and a `.npy` shard's header, parsed
  without unpickling, agrees with its size and the declared dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from natsl.errors import NatslError
from natsl.files import read_json, resolve_inside

TOKEN_DTYPES = ("uint16", "uint32")  # what `natsl tokenize` writes, and all that a reader takes
RETOKENIZE = "tokenize the data again with `natsl tokenize`"


def token_dtype_named(value, where: str) -> np.dtype:
    """The numpy dtype a data folder names (`"uint16"` or `"uint32"`), or a NatslError naming `where`.

    Args:
        value: the `dtype` field as read from the file (any JSON value).
        where: the file it came from, for the message.
    Returns:
        The dtype.
    """
    if not isinstance(value, str) or value not in TOKEN_DTYPES:
        raise NatslError(f"{where} is damaged: dtype {value!r} is not one of {', '.join(TOKEN_DTYPES)} "
                         f"(token ids are unsigned integers); {RETOKENIZE}")
    return np.dtype(value)


def read_json_object(path: Path, fix: str = RETOKENIZE) -> dict:
    """The JSON object in `path`, or a one-line NatslError (not JSON, not an object, nested too deep).

    Args:
        path: the file (meta.json, .progress.json).
        fix: what the message tells the user to do.
    Returns:
        The parsed object.
    """
    data = read_json(path, f"the file is corrupt: {fix}")
    if not isinstance(data, dict):
        raise NatslError(f"{str(path)!r} is not a JSON object; {fix}")
    return data


def open_shard(path: Path, dtype: np.dtype | None, tokens: int | None) -> np.ndarray:
    """A read-only memory map of one token shard (`.bin`: raw ids; `.npy`: numpy's format), checked first.

    Args:
        path: the shard, already checked to lie inside its folder (`natsl.files.resolve_inside`).
        dtype: the dtype its folder declares (None: a `.npy` shard's own header decides).
        tokens: the token count its folder declares (None: not declared; the size must still be whole ids).
    Returns:
        A 1-D array of `dtype` (empty for an empty shard).
    """
    if not path.is_file():
        raise NatslError(f"token shard {str(path)!r} is missing; {RETOKENIZE}")
    size = path.stat().st_size
    offset = 0
    if path.suffix == ".npy":
        offset, dtype = _npy_layout(path, dtype, size)
    elif dtype is None:
        raise NatslError(f"token shard {str(path)!r} is raw ids but its folder's meta.json names no dtype; add "
                         f"\"dtype\": one of {', '.join(TOKEN_DTYPES)}, or {RETOKENIZE}")
    count, rest = divmod(size - offset, dtype.itemsize)
    if rest or (tokens is not None and count != tokens):
        declared = f"{tokens} tokens" if tokens is not None else "whole ids"
        raise NatslError(f"token shard {str(path)!r} has {size - offset} bytes of ids, not {declared} of {dtype.name}: "
                         f"its dtype or token count in meta.json is wrong; {RETOKENIZE}")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def _npy_layout(path: Path, declared: np.dtype | None, size: int) -> tuple[int, np.dtype]:
    """(offset of the data, dtype) of a `.npy` shard, read from its header alone (never unpickled)."""
    from numpy.lib import format as npy

    def bad(what: str) -> NatslError:
        return NatslError(f"token shard {str(path)!r} {what}; {RETOKENIZE}")

    try:
        with open(path, "rb") as fh:
            version = npy.read_magic(fh)
            read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, fortran_order, dtype = read_header(fh)
            offset = fh.tell()
    except (ValueError, OSError, SyntaxError, TypeError):
        raise bad("is not a readable .npy file") from None
    if dtype.hasobject or dtype.kind != "u" or dtype.name not in TOKEN_DTYPES:
        raise bad(f"holds {dtype} values, not token ids ({', '.join(TOKEN_DTYPES)})")
    if declared is not None and dtype != declared:
        raise bad(f"holds {dtype.name} ids but its folder's meta.json says {declared.name}")
    if len(shape) != 1:
        raise bad(f"has shape {shape}, not one row of ids")
    if size - offset != shape[0] * dtype.itemsize:
        raise bad(f"has {size - offset} bytes of data, not the {shape[0]} ids its header declares")
    return offset, dtype


def check_splits(splits, folder: Path, where: str, names: tuple[str, ...]) -> None:
    """The split table of a meta.json or a `natsl tokenize` progress file: for each of `names`, a list of
    shards, each a file name inside `folder` with a token count >= 0.

    Args:
        splits: the `splits` field as read (any JSON value).
        folder: the data folder.
        where: the file it came from, for the message.
        names: the splits that must be there.
    """
    for name in names:
        entry = splits.get(name) if isinstance(splits, dict) else None
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list):
            raise NatslError(f"{where} is damaged: it lists no shards for the {name} split; {RETOKENIZE}")
        for shard in shards:
            tokens = shard.get("tokens") if isinstance(shard, dict) else None
            if not (isinstance(shard, dict) and isinstance(shard.get("file"), str) and isinstance(tokens, int)
                    and not isinstance(tokens, bool) and tokens >= 0):
                raise NatslError(f"{where} is damaged: a {name} shard entry {json.dumps(shard)[:80]} is not a file "
                                 f"name with a token count >= 0; {RETOKENIZE}")
            resolve_inside(folder, shard["file"], where, fix=RETOKENIZE)
