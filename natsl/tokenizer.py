"""A thin wrapper over a Hugging Face `tokenizers` tokenizer: encode, decode, EOS, save, train.

natsl stores a tokenizer as `tokenizer.json` (the `tokenizers` library's own format), so a
checkpoint folder is self-contained and nothing is fetched at run time.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from natsl.errors import NatslError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")


def _first_token(inner, candidates) -> int | None:
    return next((inner.token_to_id(t) for t in candidates if inner.token_to_id(t) is not None), None)


class Tokenizer:
    def __init__(self, inner):
        self.inner = inner
        # The ids it can emit run to its largest, not to its count of entries: a tokenizer.json with gaps in its
        # ids (an untrusted file) would otherwise pass the model's vocabulary check and index past the embedding.
        ids = inner.get_vocab(with_added_tokens=True).values()
        self._id_space = max(inner.get_vocab_size(), max(ids, default=-1) + 1)
        self.eos_id = _first_token(inner, EOS_CANDIDATES)
        self.bos_id = _first_token(inner, BOS_CANDIDATES)
        # Whether the model's documents start with BOS (set from the data's meta.json or the checkpoint's
        # config.json; `natsl tokenize` adds it when the tokenizer has one, as Llama-2's does).
        self.add_bos = False

    def document_start(self) -> list[int]:
        """What precedes a document's (or a prompt's) tokens: [BOS] when the model was trained so."""
        return [self.bos_id] if self.add_bos and self.bos_id is not None else []

    def conventions(self) -> dict:
        """The special-token use a model was trained with (kept in a checkpoint's config.json)."""
        return {"eos_id": self.eos_id, "bos_id": self.bos_id, "add_bos": self.add_bos}

    def apply_conventions(self, recorded: dict) -> "Tokenizer":
        """Take the special-token use a checkpoint's config.json records (untrusted: an EOS that is no id of
        this tokenizer is a one-line NatslError)."""
        eos = recorded.get("eos_id", self.eos_id)
        if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < self.vocab_size):
            raise NatslError(f"the tokenizer section records eos_id {eos!r}, which is no id of its tokenizer (0 to "
                             f"{self.vocab_size - 1}): the config.json is damaged; use another copy of the checkpoint")
        self.eos_id = eos
        self.add_bos = bool(recorded.get("add_bos", False)) and self.bos_id is not None
        return self

    @property
    def vocab_size(self) -> int:
        """The size of its id space: its largest id + 1 (at least its count of entries)."""
        return self._id_space

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.inner.id_to_token(self.eos_id)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts, encoded on all cores (the `tokenizers` library's threads).

        Args:
            texts: the texts.
        Returns:
            One id list per text, as `encode` gives.
        """
        return [e.ids for e in self.encodings(texts)]

    def encodings(self, texts: list[str]) -> list:
        """The `tokenizers` library's Encoding of each text (its ids in `.ids`), encoded on all cores. The
        library releases the GIL while it encodes, so a thread may run this beside Python work; reading
        `.ids` (a Python list built per token) is the part that holds it."""
        # encode_batch_fast skips the character offsets nobody here reads (tokenizers >= 0.21)
        encode = getattr(self.inner, "encode_batch_fast", self.inner.encode_batch)
        return encode(texts, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.inner.to_str()

    def sha256(self) -> str:
        """A fingerprint of the vocabulary and rules, stored beside tokenized data to catch mix-ups."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / "tokenizer.json"
        self.inner.save(str(path))
        return path

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """A `tokenizer.json` file, or a folder that holds one."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise NatslError(f"no tokenizer at {str(path)!r}: pass a tokenizer.json file or a folder holding one")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as err:  # the tokenizers library raises plain Exceptions on bad files
            raise NatslError(f"{str(path)!r} is not a valid tokenizer.json ({str(err).splitlines()[0]})") from None


def check_fits_model(tokenizer: Tokenizer, vocab_size: int, where: str) -> None:
    """NatslError when `tokenizer` has more entries than a model's vocabulary: its ids would index past the
    model's embedding (an IndexError deep in a forward pass). A smaller tokenizer is fine (models pad
    their vocabulary). The one check wherever a model is paired with a tokenizer.

    Args:
        tokenizer: the tokenizer.
        vocab_size: the model's `vocab_size`.
        where: what pairs them (a checkpoint folder, a --tokenizer), for the message.
    """
    if tokenizer.vocab_size > vocab_size:
        raise NatslError(f"{where}: the tokenizer has {tokenizer.vocab_size:,} entries but the model's vocabulary "
                         f"only {vocab_size:,}, so its ids would run past the embedding; use the tokenizer.json the "
                         "model was trained with")


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str = "<|endoftext|>") -> Tokenizer:
    """A byte-level BPE trained on `texts` with `vocab_size` entries, EOS included."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    inner.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(inner)
