"""Exact-duplicate detection for `natsl tokenize --dedup`, in bounded memory.

A document is known by an 8-byte blake2b digest of its normalised text (line endings made `\\n`,
surrounding whitespace stripped), so the same file installed in two places, or saved with CRLF
line endings, counts once. Digests are kept in sorted numpy runs (8 bytes a document) plus a small
set of the newest (at most `buffer` of them), merged into the runs when it fills: memory stays
about 8 bytes per document, where a Python set of ints takes about 100. Two different documents
share a 64-bit digest with probability about n^2 / 2^65 (1 in 10^7 for a million documents).
"""

from __future__ import annotations

import hashlib

import numpy as np


def digest(text: str) -> int:
    """The 64-bit content hash of a document's normalised text."""
    normal = text.replace("\r\n", "\n").strip().encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(normal, digest_size=8).digest(), "little")


class SeenDocuments:
    """The digests of the documents seen so far; `add` says whether a document is new.

    Args:
        buffer: how many new digests are held in a Python set before they are merged into a sorted run.
    """

    def __init__(self, buffer: int = 1 << 16):
        self.buffer = buffer
        self.runs: list[np.ndarray] = []  # sorted uint64 arrays, each at least twice the size of the next
        self.recent: set[int] = set()

    def __len__(self) -> int:
        return len(self.recent) + sum(len(run) for run in self.runs)

    def __contains__(self, key: int) -> bool:
        if key in self.recent:
            return True
        value = np.uint64(key)
        for run in self.runs:
            at = int(np.searchsorted(run, value))
            if at < len(run) and run[at] == value:
                return True
        return False

    def add(self, text: str) -> bool:
        """True when `text` was not seen before (and remember it); False for a duplicate.

        Args:
            text: the document.
        Returns:
            Whether it is new.
        """
        key = digest(text)
        if key in self:
            return False
        self.recent.add(key)
        if len(self.recent) >= self.buffer:
            self._flush()
        return True

    def _flush(self) -> None:
        run = np.sort(np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent)))
        self.recent.clear()
        # merge while the newest run is at least half its predecessor: a few runs, each merge amortised
        while self.runs and len(self.runs[-1]) <= 2 * len(run):
            run = np.sort(np.concatenate([self.runs.pop(), run]), kind="stable")
        self.runs.append(run)
