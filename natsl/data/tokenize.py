"""Tokenize documents into a folder of token shards that `natsl train` reads.

Output folder:

    meta.json              written last: format, dtype, EOS id, tokenizer sha256, split sizes, source
    tokenizer.json         the tokenizer the ids belong to
    train_00000.bin ...    token ids (numpy dtype from meta.json, uint16 when the vocabulary fits),
    validation_00000.bin   every document followed by the EOS id, and preceded by the BOS id when the
                           tokenizer has one (Llama-2's <s>, as the paper trained; `bos=False` /
                           `--no-bos` leaves it out); meta.json's `add_bos` and `bos_id` say which
    validation_texts/      with `val_texts`: the held-out documents as text, one .jsonl per input
                           (natsl.data.val_texts)

meta.json's `mix` counts documents, bytes and tokens per split, per input and per --include pattern,
with the exact duplicates dropped (`dedup`, natsl.data.dedup) and the bad files skipped.

Documents go to the validation split at an even rate of `val_fraction` (document i is held out
when floor((i+1) f) > floor(i f)), so the split is deterministic and needs no shuffle buffer.

Idempotent and resumable: a fresh run first writes `.progress.json` with its fingerprint alone
(the folder is this run's from then on), then the tokenizer and a progress file that names it; the
output grows in committed chunks; after each chunk the shard lengths and the number of source items
consumed are written to `.progress.json` (atomically). A rerun with the same inputs and settings
(the fingerprint) finds `meta.json` and does nothing, or finds `.progress.json` and either starts
over (no tokenizer saved yet) or cuts every shard back to its committed length and continues.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from natsl.errors import NatslError
from natsl.atomic import write_text as atomic_write_text
from natsl.data.dedup import SeenDocuments
from natsl.data.mix import build_mix, check_cells, describe_mix, new_cells
from natsl.data.shards import RETOKENIZE, check_splits, read_json_object
from natsl.data.val_texts import FOLDER as VAL_TEXTS, ValTextWriter, file_names as val_file_names
from natsl.files import resolve_inside
from natsl.outputs import check_output_folder
from natsl.tokenizer import Tokenizer, train_bpe
from natsl.training.faults import fault_point

FORMAT = "natsl-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "validation")
META = "meta.json"
PROGRESS = ".progress.json"


MIN_VOCAB = 258
# The BPE trainer reserves memory by the vocabulary size and aborts the process (a Rust allocation failure,
# no exception) when it cannot; 2^20 ids is four times the largest vocabulary of a published model.
MAX_VOCAB = 1 << 20


@dataclass
class TokenizeSettings:
    tokenizer: Optional[str] = None  # tokenizer.json, a folder holding one, or a Hub name
    train_tokenizer: bool = False  # train a byte-level BPE on the input instead
    vocab_size: int = 32000
    tokenizer_train_docs: Optional[int] = None  # train the BPE on the first N documents (None: all)
    eos_token: Optional[str] = None  # default: the first of <|endoftext|>, </s>, <eos>, <|end_of_text|>
    bos: bool = True  # start every document with the tokenizer's BOS, when it has one
    val_fraction: float = 0.01
    shard_tokens: int = 1 << 28
    max_documents: Optional[int] = None
    commit_tokens: int = 1 << 24
    batch_docs: int = 512
    dedup: bool = False  # drop exact duplicates (same normalised text), counted in meta.json's mix
    val_texts: bool = False  # also write the held-out documents as text, one .jsonl per input

    def validate(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise NatslError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.train_tokenizer and self.tokenizer:
            raise NatslError("pass either --tokenizer or --train-tokenizer, not both")
        if not self.train_tokenizer and not self.tokenizer:
            raise NatslError("no tokenizer: pass --tokenizer PATH_OR_NAME, or --train-tokenizer --vocab-size N")
        if self.train_tokenizer and not MIN_VOCAB <= self.vocab_size <= MAX_VOCAB:
            raise NatslError(f"--vocab-size must be between {MIN_VOCAB} (256 bytes + EOS + 1) and {MAX_VOCAB:,} "
                             f"(2^20), got {self.vocab_size:,}")
        for name in ("shard_tokens", "commit_tokens", "batch_docs"):
            if getattr(self, name) < 1:
                raise NatslError(f"{name} must be at least 1, got {getattr(self, name)}")
        for flag, value in (("--max-documents", self.max_documents), ("--tokenizer-train-docs", self.tokenizer_train_docs)):
            if value is not None and value < 1:
                raise NatslError(f"{flag} must be at least 1, got {value}")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def resolve_tokenizer(spec: str) -> Tokenizer:
    """A local tokenizer.json / folder, else a Hugging Face Hub tokenizer name."""
    from natsl.data.sources import hub_unreachable_reason, looks_like_local_path

    if Path(spec).exists():
        return Tokenizer.from_file(spec)
    if looks_like_local_path(spec):
        raise NatslError(f"tokenizer {spec!r} does not exist; pass a tokenizer.json file, a folder holding one, "
                         "or --train-tokenizer")
    reason = hub_unreachable_reason()
    if reason:
        raise NatslError(f"tokenizer {spec!r} is not a local file and fetching it from the Hugging Face Hub is not "
                         f"possible here: {reason}; pass a local tokenizer.json or --train-tokenizer")
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return Tokenizer(HFTokenizer.from_pretrained(spec))
    except Exception as err:  # the tokenizers library raises plain Exceptions
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise NatslError(f"could not fetch tokenizer {spec!r} from the Hugging Face Hub ({first}); check the name") from None


def set_eos(tok: Tokenizer, eos_token: str | None) -> Tokenizer:
    if eos_token is not None:
        eos_id = tok.inner.token_to_id(eos_token)
        if eos_id is None:
            raise NatslError(f"--eos-token {eos_token!r} is not in the tokenizer's vocabulary")
        tok.eos_id = eos_id
    if tok.eos_id is None:
        raise NatslError("the tokenizer has no end-of-text token (looked for <|endoftext|>, </s>, <eos>, "
                         "<|end_of_text|>); name one with --eos-token")
    return tok


def _write_json_atomic(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2))


def read_meta(folder: Path) -> dict | None:
    path = Path(folder) / META
    if not path.is_file():
        return None
    meta = read_json_object(path, "delete the folder and tokenize again")
    if meta.get("format") != FORMAT:
        raise NatslError(f"{str(folder)!r} is not a folder written by `natsl tokenize` (meta.json has another format)")
    return meta


class ShardWriter:
    """Appends token ids to `{split}_{k:05d}.bin` files of at most `shard_tokens` ids each."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, splits: dict):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.splits = splits  # name -> {"tokens", "documents", "shards": [{"file", "tokens"}]}

    def restore(self) -> None:
        """Cut every shard back to its committed length; remove shards that were never committed."""
        keep = set()
        for info in self.splits.values():
            for shard in info["shards"]:
                path = resolve_inside(self.folder, shard["file"], repr(str(self.folder / PROGRESS)), fix=RETOKENIZE)
                want = shard["tokens"] * self.dtype.itemsize
                if not path.is_file() or path.stat().st_size < want:
                    raise NatslError(f"the unfinished output in {str(self.folder)!r} is damaged ({shard['file']} is "
                                     "shorter than recorded); delete the folder and run again")
                os.truncate(path, want)
                keep.add(shard["file"])
        for path in self.folder.glob("*.bin"):
            if path.name not in keep:
                path.unlink()

    def append(self, split: str, ids: np.ndarray) -> list[Path]:
        info = self.splits[split]
        touched = []
        pos = 0
        while pos < len(ids):
            if not info["shards"] or info["shards"][-1]["tokens"] >= self.shard_tokens:
                info["shards"].append({"file": f"{split}_{len(info['shards']):05d}.bin", "tokens": 0})
            shard = info["shards"][-1]
            take = min(len(ids) - pos, self.shard_tokens - shard["tokens"])
            path = self.folder / shard["file"]
            with open(path, "ab") as fh:
                fh.write(ids[pos:pos + take].astype(self.dtype, copy=False).tobytes())
                fh.flush()
                os.fsync(fh.fileno())
            shard["tokens"] += take
            info["tokens"] += take
            pos += take
            touched.append(path)
        return touched


def _fingerprint(source_info: dict, tokenizer_info: dict, settings: TokenizeSettings) -> str:
    data = {"format_version": FORMAT_VERSION, "source": source_info, "tokenizer": tokenizer_info,
            "eos_token": settings.eos_token, "val_fraction": settings.val_fraction,
            "shard_tokens": settings.shard_tokens, "max_documents": settings.max_documents}
    if not settings.bos:  # only when set: folders made before the option keep their fingerprint
        data["bos"] = False
    for name in ("dedup", "val_texts"):  # likewise
        if getattr(settings, name):
            data[name] = True
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode("utf-8")).hexdigest()


def _tokenizer_info(settings: TokenizeSettings) -> tuple[dict, Tokenizer | None]:
    """What identifies the tokenizer before any work is done (and the tokenizer itself when local)."""
    if settings.train_tokenizer:
        return {"train_bpe": settings.vocab_size, "train_docs": settings.tokenizer_train_docs}, None
    if Path(settings.tokenizer).exists():
        tok = Tokenizer.from_file(settings.tokenizer)
        return {"sha256": tok.sha256()}, tok
    return {"hub": settings.tokenizer}, None


def is_validation(index: int, fraction: Fraction) -> bool:
    return (index + 1) * fraction.numerator // fraction.denominator > index * fraction.numerator // fraction.denominator


def tokenize_corpus(source, out: str | Path, settings: TokenizeSettings, progress: bool = True,
                    log: Callable[[str], None] = print) -> dict:
    """Tokenize `source` into `out` (see the module doc); returns the meta.json contents.

    Bad input (NatslError) removes the folder if this call created it, so a rejected input leaves
    nothing behind; an interrupted run keeps its committed work for the next call.
    """
    out = Path(out)
    check_output_folder(out, "--out")
    created = not out.exists()
    try:
        return _tokenize(source, out, settings, progress, log)
    except NatslError:
        if created and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _tokenize(source, out: Path, settings: TokenizeSettings, progress: bool, log) -> dict:
    from tqdm import tqdm

    settings.validate()
    source_info = source.describe()
    tok_info, tok = _tokenizer_info(settings)
    fingerprint = _fingerprint(source_info, tok_info, settings)

    meta = read_meta(out) if out.is_dir() else None
    if meta is not None:
        if meta.get("fingerprint") == fingerprint:
            log(f"{out} already holds these inputs tokenized ({meta['total_tokens']:,} tokens); nothing to do")
            return meta
        raise NatslError(f"{str(out)!r} already holds tokenized data of other inputs or settings; choose another "
                         "--out or delete that folder")
    progress_path = out / PROGRESS
    state = read_progress(out, fingerprint)
    if state is None and out.exists() and (not out.is_dir() or any(p not in _own_temporaries(out) for p in out.iterdir())):
        raise NatslError(f"{str(out)!r} exists and is not a natsl tokenize folder; choose another --out")

    if hasattr(source, "check"):
        source.check()  # fail fast (one line) when the Hub cannot be reached
    for item in getattr(source, "empty_inputs", ()):
        log(f"warning: input {item!r} gives no file (a pattern that matches nothing, or a folder without a file that "
            "--include chooses); the other inputs are tokenized, and the mix records it with 0 documents")
    out.mkdir(parents=True, exist_ok=True)
    if state is not None and "tokenizer_sha256" in state:
        tok = set_eos(Tokenizer.from_file(out / "tokenizer.json"), settings.eos_token)
        if tok.sha256() != state["tokenizer_sha256"]:
            raise NatslError(f"the tokenizer in the unfinished run {str(out)!r} was changed; delete the folder and run again")
        log(f"resuming the interrupted run in {out}: {state['items']:,} source items "
            f"({sum(s['tokens'] for s in state['splits'].values()):,} tokens) already done")
    else:
        if state is not None:
            log(f"restarting the interrupted run in {out}: it stopped before its tokenizer was saved")
        tok = _start(out, source, settings, fingerprint, tok, progress, log)
        state = {"fingerprint": fingerprint, "tokenizer_sha256": tok.sha256(), "items": 0, "commits": 0,
                 "splits": {name: {"tokens": 0, "documents": 0, "shards": []} for name in SPLITS},
                 "mix": new_cells(source.origins)}
        if settings.val_texts:
            state["val_texts"] = {}
        _write_json_atomic(progress_path, state)

    fix = f"delete {str(out)!r} and run again"
    cells = check_cells(state.setdefault("mix", new_cells(source.origins)), source.origins, repr(str(progress_path)), fix)
    inputs = list(dict.fromkeys(item for item, _ in source.origins))
    input_of = [inputs.index(item) for item, _ in source.origins]
    val_writer = None
    if settings.val_texts:
        val_writer = ValTextWriter(out, val_file_names(inputs), state.setdefault("val_texts", {}))
        val_writer.restore(repr(str(progress_path)), fix)
    dtype = token_dtype(tok.vocab_size)
    writer = ShardWriter(out, dtype, settings.shard_tokens, state["splits"])
    writer.restore()
    fraction = Fraction(settings.val_fraction).limit_denominator(1_000_000)
    eos = np.array([tok.eos_id], dtype=np.int64)
    tok.add_bos = settings.bos and tok.bos_id is not None
    start = np.array(tok.document_start(), dtype=np.int64)
    skip = state["items"]
    documents = sum(s["documents"] for s in state["splits"].values())
    pending: list[tuple[str, int]] = []  # (text, origin)
    buffers: dict[str, list[np.ndarray]] = {name: [] for name in SPLITS}
    buffered = 0
    items = 0
    seen = SeenDocuments() if settings.dedup else None
    duplicates: dict[int, int] = {}  # origin -> exact duplicates dropped

    def is_new(text: str, origin: int) -> bool:
        if seen is None or seen.add(text):
            return True
        duplicates[origin] = duplicates.get(origin, 0) + 1
        return False

    # The encoding of one batch runs on a thread (the library's own threads, without the GIL) while this one
    # reads the next batch and turns the last one's ids into arrays: on a many-core host that Python work per
    # token was as long as the encoding itself. `in_flight` is (its documents, the encoding, the items read up to
    # it): a commit records only the items of batches already written, so a resume rereads the rest.
    encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="natsl-tokenize")
    in_flight: list[tuple[list[tuple[str, int]], Future, int]] = []
    done_items = items

    def submit_pending() -> None:
        in_flight.append((list(pending), encoder.submit(tok.encodings, [text for text, _ in pending]), items))
        pending.clear()

    def finish_one() -> int:
        nonlocal documents, done_items
        batch, future, mark = in_flight.pop(0)
        count = 0
        for (text, origin), encoding in zip(batch, future.result()):
            ids = encoding.ids
            split = "validation" if is_validation(documents, fraction) else "train"
            buffers[split] += [start, np.asarray(ids, dtype=np.int64), eos]
            state["splits"][split]["documents"] += 1
            documents += 1
            length = len(start) + len(ids) + 1
            cell = cells[origin][split]
            cell["documents"] += 1
            cell["bytes"] += len(text.encode("utf-8", "surrogatepass"))
            cell["tokens"] += length
            if val_writer is not None and split == "validation":
                val_writer.add(input_of[origin], text)
            count += length
        done_items = mark
        return count

    def queued() -> int:
        return sum(len(batch) for batch, _, _ in in_flight)

    def commit() -> None:
        nonlocal buffered
        for name in SPLITS:
            if buffers[name]:
                writer.append(name, np.concatenate(buffers[name]))
                buffers[name].clear()
        if val_writer is not None:
            val_writer.commit()
        buffered = 0
        state["items"] = done_items
        state["commits"] += 1
        _write_json_atomic(progress_path, state)
        fault_point("kill_after_commit", state["commits"])

    bar = tqdm(total=source.total, unit=source.unit, unit_scale=True, desc="tokenize", disable=not progress,
               dynamic_ncols=True, mininterval=1.0)
    try:
        for text, moved, origin in source.documents():
            bar.update(moved)
            if items < skip:  # done before the interruption; rereading it rebuilds the duplicate record
                items += 1
                if text and seen is not None:
                    is_new(text, origin)
                continue
            if settings.max_documents is not None and documents + queued() + len(pending) >= settings.max_documents:
                break
            items += 1
            if text and is_new(text, origin):
                pending.append((text, origin))
            if len(pending) >= settings.batch_docs:
                submit_pending()
                if len(in_flight) > 1:  # the batch before it, while it encodes
                    buffered += finish_one()
                    bar.set_postfix_str(f"{documents:,} docs", refresh=False)
                    if buffered >= settings.commit_tokens:
                        commit()
        submit_pending()
        while in_flight:
            buffered += finish_one()
        commit()
    finally:
        bar.close()
        encoder.shutdown(wait=True, cancel_futures=True)

    splits = state["splits"]
    total = sum(s["tokens"] for s in splits.values())
    skipped = getattr(source, "skipped", None) or {"files": 0, "reasons": {}, "examples": {}, "by_origin": {}}
    if splits["train"]["tokens"] == 0:
        bad = f", bad files skipped: {skipped['files']}" if skipped["files"] else ""
        raise NatslError(f"the input produced no training tokens (documents: {documents}{bad}); check the input files "
                         f"(and --text-field, --include)")
    mix = build_mix(source.origins, cells, duplicates, skipped["by_origin"])
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype.name,
        "eos_id": tok.eos_id, "eos_token": tok.eos_token, "add_bos": tok.add_bos,
        "bos_id": tok.bos_id if tok.add_bos else None, "vocab_size": tok.vocab_size,
        "tokenizer_file": "tokenizer.json", "tokenizer_sha256": tok.sha256(),
        "total_tokens": total, "documents": documents, "val_fraction": settings.val_fraction,
        "splits": splits, "mix": mix,
        "skipped": {key: skipped[key] for key in ("files", "reasons", "examples")},
        "source": getattr(source, "summary", source.describe)(), "settings": asdict(settings),
        "fingerprint": fingerprint,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if val_writer is not None:
        meta["validation_texts"] = [f"{VAL_TEXTS}/{name}" for name in val_writer.names]
    _write_json_atomic(out / META, meta)
    progress_path.unlink()
    if splits["validation"]["tokens"] == 0 and settings.val_fraction > 0:
        needed = math.ceil(1 / fraction) if fraction else 0
        log(f"warning: the validation split is empty: {documents} document(s) at --val-fraction "
            f"{settings.val_fraction} hold out none (the first held out is document {needed}), so `natsl train` "
            "will report no validation loss; give more documents, a larger --val-fraction, or --txt-docs "
            "paragraph/line to cut .txt files into more documents")
    described = describe_mix(mix, skipped)
    log(f"tokenized {documents:,} documents into {total:,} tokens ({dtype.name}): train "
        f"{splits['train']['tokens']:,} tokens in {len(splits['train']['shards'])} shard(s), validation "
        f"{splits['validation']['tokens']:,}; {described + '; ' if described else ''}wrote {out}")
    return meta


def read_progress(out: Path, fingerprint: str) -> dict | None:
    """The state of an unfinished run in `out` (None: there is none), checked before it is trusted: its
    shard list names the files that resuming cuts back and removes. A state without `tokenizer_sha256`
    is a run that stopped before its tokenizer was saved (it starts over)."""
    path = out / PROGRESS
    if not path.is_file():
        return None
    fix = f"delete {str(out)!r} and run again"
    state = read_json_object(path, fix)
    if state.get("fingerprint") != fingerprint:
        raise NatslError(f"{str(out)!r} holds an unfinished run of other inputs or settings; delete it or "
                         "choose another --out")
    if "tokenizer_sha256" in state:
        splits = state.get("splits")
        check_splits(splits, out, repr(str(path)), SPLITS)
        counts = [state.get("items"), state.get("commits")]
        counts += [splits[name].get(key) for name in SPLITS for key in ("tokens", "documents")]
        if not isinstance(state["tokenizer_sha256"], str) or set(splits) != set(SPLITS) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            raise NatslError(f"{str(path)!r} is damaged; {fix}")
    return state


def _own_temporaries(out: Path) -> set[Path]:
    """What a run killed while writing its first progress file leaves: that file's temporary copy
    (natsl.atomic's `.NAME.RANDOM.tmp`)."""
    return set(out.glob(f".{PROGRESS}.*.tmp"))


def _start(out: Path, source, settings: TokenizeSettings, fingerprint: str, tok: Tokenizer | None, progress: bool,
           log) -> Tokenizer:
    """A fresh run: a progress file first, naming the folder this run's (a kill from here on leaves a folder
    the same command restarts), then the tokenizer, saved in `out`."""
    for path in _own_temporaries(out) | set(out.glob("*.bin")) | {out / "tokenizer.json"}:  # a run killed this early
        path.unlink(missing_ok=True)
    if (out / VAL_TEXTS).is_dir() and not (out / VAL_TEXTS).is_symlink():
        shutil.rmtree(out / VAL_TEXTS)
    progress_path = out / PROGRESS
    _write_json_atomic(progress_path, {"fingerprint": fingerprint})
    try:
        if settings.train_tokenizer:
            tok = _train_tokenizer(source, settings, progress, log)
        elif tok is None:
            tok = resolve_tokenizer(settings.tokenizer)
        set_eos(tok, settings.eos_token)
    except NatslError:  # nothing done: leave the folder empty, as a fresh run finds it
        progress_path.unlink()
        raise
    tok.save(out)
    return tok


def _train_tokenizer(source, settings: TokenizeSettings, progress: bool, log) -> Tokenizer:
    from tqdm import tqdm

    limit = settings.tokenizer_train_docs

    def texts():
        bar = tqdm(total=source.total, unit=source.unit, unit_scale=True, desc="train BPE", disable=not progress,
                   dynamic_ncols=True, mininterval=1.0)
        count = 0
        seen = SeenDocuments() if settings.dedup else None  # the tokenizer sees each text once, as the model does
        try:
            for text, moved, _ in source.documents():
                bar.update(moved)
                if text and (seen is None or seen.add(text)):
                    yield text
                    count += 1
                    if limit is not None and count >= limit:
                        break
        finally:
            bar.close()

    tok = train_bpe(texts(), settings.vocab_size)
    log(f"trained a byte-level BPE tokenizer with {tok.vocab_size:,} tokens on the input")
    return tok
