"""`natsl tokenize INPUT... --out DIR`: text -> token shards + meta.json + tokenizer for `natsl train`."""

from __future__ import annotations

from typing import List, Optional

import typer

from natsl.cli.app import command


@command("tokenize")
def tokenize(
    inputs: List[str] = typer.Argument(..., help="Local files, folders or quoted glob patterns ('/usr/lib/python3*/"
                                                 "site-packages', 'docs/**/*.md'; natsl expands them), or one Hugging "
                                                 "Face dataset name (streamed)."),
    out: str = typer.Option(..., "--out", help="Output folder (created; rerunning the same command resumes or "
                                               "does nothing)."),
    tokenizer: Optional[str] = typer.Option(None, help="tokenizer.json, a folder holding one, or a Hub tokenizer name."),
    train_tokenizer: bool = typer.Option(False, "--train-tokenizer", help="Train a byte-level BPE on the input."),
    vocab_size: int = typer.Option(32000, help="Vocabulary size of the trained BPE."),
    tokenizer_train_docs: Optional[int] = typer.Option(None, help="Train the BPE on the first N documents only."),
    eos_token: Optional[str] = typer.Option(None, help="End-of-document token (default: <|endoftext|>, </s>, ...)."),
    bos: bool = typer.Option(True, "--bos/--no-bos", help="Start each document with the tokenizer's BOS (<s>, ...) "
                                                          "when it has one, as Llama-2's tokenizer does."),
    text_field: str = typer.Option("text", help="Field (.jsonl, Hub) or column (.parquet) holding the text."),
    txt_docs: str = typer.Option("file", help="What a document is in a .txt file: file, paragraph or line."),
    include: Optional[List[str]] = typer.Option(None, "--include", help="File-name pattern of the files that count "
                                                "in folders and among a glob's matches (repeatable, e.g. --include "
                                                "'*.py' --include '*.gz'; default in folders *.txt, *.jsonl, *.parquet). A file that is not .jsonl or "
                                                ".parquet is one plain-text document; a .gz one is decompressed."),
    skip_bad_files: bool = typer.Option(False, "--skip-bad-files", help="Leave out (and count) files that are not "
                                        "UTF-8, binary, unreadable or larger than --max-file-bytes, instead of "
                                        "stopping."),
    max_file_bytes: Optional[int] = typer.Option(None, help="Largest file read as one document (default 1 MiB with "
                                                 "--skip-bad-files, else any); a .gz file may decompress to 8x it."),
    dedup: bool = typer.Option(False, "--dedup", help="Drop exact duplicate documents (same text), counted in "
                                                      "meta.json's mix."),
    val_texts: bool = typer.Option(False, "--val-texts", help="Also write the held-out documents as text, one "
                                   "validation_texts/NN_NAME.jsonl per input (for inspect-routing per source)."),
    val_fraction: float = typer.Option(0.01, help="Fraction of documents held out for validation."),
    shard_tokens: int = typer.Option(1 << 28, help="Tokens per shard file."),
    max_documents: Optional[int] = typer.Option(None, help="Stop after this many documents."),
    hf_config: Optional[str] = typer.Option(None, help="Hub dataset configuration (subset) name."),
    hf_split: str = typer.Option("train", help="Hub dataset split to stream."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Tokenize text into uint16/uint32 shards with EOS between documents and a train/validation split by document;
    the last line gives the token count and the mix (per input and --include pattern)."""
    from natsl.data.sources import open_source
    from natsl.data.tokenize import TokenizeSettings, tokenize_corpus
    from natsl.outputs import check_output

    check_output(out, [*inputs, tokenizer], "--out")
    settings = TokenizeSettings(tokenizer=tokenizer, train_tokenizer=train_tokenizer, vocab_size=vocab_size,
                                tokenizer_train_docs=tokenizer_train_docs, eos_token=eos_token, bos=bos,
                                val_fraction=val_fraction, shard_tokens=shard_tokens, max_documents=max_documents,
                                dedup=dedup, val_texts=val_texts)
    settings.validate()
    check_option_typos(inputs)
    source = open_source(inputs, text_field=text_field, txt_docs=txt_docs, hub_config=hf_config, hub_split=hf_split,
                         include=include, skip_bad_files=skip_bad_files, max_file_bytes=max_file_bytes)
    tokenize_corpus(source, out, settings, progress=progress)


def check_option_typos(inputs: List[str]) -> None:
    """An input that does not exist but is the name of an option without its dashes (`shard_tokens
    5` for `--shard-tokens 5`): say so, instead of "input 'shard_tokens' does not exist"."""
    import inspect
    from pathlib import Path

    from natsl.errors import NatslError

    options = set()
    for name, param in inspect.signature(tokenize).parameters.items():
        if isinstance(param.default, typer.models.OptionInfo):
            declared = [d for d in (param.default.param_decls or ()) if d.startswith("--")]
            options.update(declared or ["--" + name.replace("_", "-")])
    for item in inputs:
        guess = "--" + item.lstrip("-").replace("_", "-")
        if guess in options and not Path(item).exists():
            raise NatslError(f"input {item!r} does not exist, and it looks like the option {guess}: write "
                             f"{guess} VALUE")
