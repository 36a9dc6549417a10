"""Where documents come from: local files, folders and glob patterns (`natsl.data.local_files`), a
Hugging Face dataset (streamed), or a list of strings held in memory (the embedded corpus).

Every source yields `(text, progress, origin)`: one document, how far the progress bar moves (bytes
read for files, one per document otherwise) and its origin, an index into the source's `origins`
((input, --include pattern or None) pairs: the cells of the mix that `natsl tokenize` records).
`describe()` is a JSON-able summary that goes into the fingerprint that makes `natsl tokenize`
idempotent, `summary()` what `meta.json` records of it. Text must be UTF-8: anything else is refused
with one line that names the file and the line (or skipped, for local files with --skip-bad-files).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from natsl.data.local_files import (  # noqa: F401 (the local-file source lives there; re-exported)
    DEFAULT_INCLUDE, TXT_DOCS, FileSource, expand_inputs, has_glob, text_of)
from natsl.errors import NatslError

SUFFIXES = (".txt", ".jsonl", ".parquet")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class MemorySource:
    """Documents held in memory (the embedded corpus); `info` describes where they came from."""

    unit = "doc"

    def __init__(self, texts: list[str], info: dict):
        self.texts = texts
        self.info = info
        self.total = len(texts)

    @property
    def origins(self) -> list[tuple[str, None]]:
        return [(str(self.info.get("name", "memory")), None)]

    def describe(self) -> dict:
        return {"kind": "memory", **self.info}

    summary = describe

    def documents(self) -> Iterator[tuple[str, int, int]]:
        for text in self.texts:
            yield text, 1, 0


# ----------------------------------------------------------------------------- the Hugging Face Hub

def hub_unreachable_reason(timeout: float = 5.0) -> str | None:
    """None when the Hub answers a TCP connection; otherwise why not (checked before `datasets` retries for minutes)."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return f"offline mode is on ({var}={os.environ[var]})"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a proxy decides; let the client try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"{host} cannot be reached ({err.strerror or _first_line(err)})"
    return None


def looks_like_local_path(name: str) -> bool:
    """Whether a name that is not on disk is meant as a path (so: a missing file), not a Hub dataset's name; a
    trailing slash names a folder, never a dataset."""
    return (name.startswith((".", "/", "~")) or name.endswith(("/", *SUFFIXES)) or name.endswith(".json") or has_glob(name)
            or name.count("/") > 1 or os.sep != "/" and os.sep in name)


class HubSource:
    """A Hugging Face dataset, streamed with `datasets` (nothing is downloaded up front)."""

    unit = "doc"
    total = None

    def __init__(self, name: str, config: str | None = None, split: str = "train", text_field: str = "text"):
        self.name, self.config, self.split, self.text_field = name, config, split, text_field
        self.origins = [(name, None)]

    def describe(self) -> dict:
        return {"kind": "hub", "name": self.name, "config": self.config, "split": self.split,
                "text_field": self.text_field}

    summary = describe

    def check(self) -> None:
        reason = hub_unreachable_reason()
        if reason:
            raise NatslError(f"{self.name!r} is not a local file or folder, and streaming it from the Hugging Face Hub "
                             f"is not possible here: {reason}; pass local .txt/.jsonl/.parquet files instead")

    def documents(self) -> Iterator[tuple[str, int, int]]:
        self.check()
        try:
            import datasets

            stream = datasets.load_dataset(self.name, self.config, split=self.split, streaming=True)
            for number, record in enumerate(stream, start=1):
                yield text_of(record.get(self.text_field), f"{self.name!r} record {number}", self.text_field), 1, 0
        except NatslError:
            raise
        except Exception as err:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ...)
            raise NatslError(f"could not stream {self.name!r} (config {self.config}, split {self.split}) from the "
                             f"Hugging Face Hub: {_first_line(err)}") from None


def open_source(inputs: list[str], text_field: str = "text", txt_docs: str = "file",
                hub_config: str | None = None, hub_split: str = "train", include=None, skip_bad_files: bool = False,
                max_file_bytes: int | None = None):
    """Local paths and glob patterns -> FileSource; a single name that is not a local path -> HubSource.

    Args:
        inputs: the command's input arguments.
        text_field: the field (.jsonl, Hub) or column (.parquet) holding the text.
        txt_docs: what a document is in a .txt file: file, paragraph or line.
        hub_config, hub_split: the Hub dataset's configuration and split.
        include, skip_bad_files, max_file_bytes: local files only (see FileSource).
    Returns:
        The source.
    """
    if not inputs:
        raise NatslError("no input given; pass .txt/.jsonl/.parquet files, folders, or a Hugging Face dataset name")
    if len(inputs) == 1 and not Path(inputs[0]).exists() and not looks_like_local_path(inputs[0]):
        if include or skip_bad_files or max_file_bytes is not None:
            raise NatslError(f"{inputs[0]!r} is not a local file or folder; --include, --skip-bad-files and "
                             "--max-file-bytes choose local files (check the path)")
        return HubSource(inputs[0], hub_config, hub_split, text_field)
    return FileSource(inputs, text_field, txt_docs, include=include, skip_bad_files=skip_bad_files,
                      max_file_bytes=max_file_bytes)
