"""Local lm-evaluation-harness tasks built from a corpus's held-out texts, for `natsl eval-lm --include-path`.

Nothing is downloaded: the tasks read two .jsonl files written beside their YAMLs (lm-eval's `dataset_path:
json` with `data_files`), from `CORPUS/validation_texts/NN_source.jsonl` (the documents `natsl tokenize
--val-texts` held out of training, one file per input source):

- `natsl_mini_next_line` (multiple choice, acc / acc_norm): "which line really comes next in this file".
  The context is a window of up to `context_lines` lines of a held-out document, exactly as it runs up to
  the answer; the four choices are the line that follows it and three non-blank lines drawn from other
  documents (of any source). A line longer than MAX_LINE_CHARS (prose written a paragraph a line) counts
  as its sentences, so prose gives items too. A choice is scored as the continuation of the context with
  no delimiter (`target_delimiter: ""`: the context ends in the line break or space before the answer), so
  a model picks the true line by knowing the file, not by the spacing. Chance is 0.25.
- `natsl_mini_docs` (loglikelihood_rolling: word and byte perplexity, bits per byte): up to `docs_per_source`
  held-out documents of every source, each cut at a line boundary to at most `max_chars` characters.

Every choice is drawn from a generator seeded with `seed`, and the sources and documents are read in a
fixed order, so the same corpus and seed give the same files, byte for byte.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

NEXT_LINE = "natsl_mini_next_line"
DOCS = "natsl_mini_docs"
MAX_LINE_CHARS = 200  # a longer line (minified code, a table) is a poor choice: its length gives it away


SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def segments(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the units a next-line item is made of: each line, or, for a line
    longer than MAX_LINE_CHARS (a paragraph of prose on one line), each of its sentences; blank units are
    left out. A unit never holds its line break or the spaces after it."""
    out = []
    pos = 0
    for line in text.split("\n"):
        if len(line) <= MAX_LINE_CHARS:
            pieces = [(pos, pos + len(line))]
        else:
            pieces, start = [], pos
            for match in SENTENCE_END.finditer(line):
                pieces.append((start, pos + match.start()))
                start = pos + match.end()
            pieces.append((start, pos + len(line)))
        out.extend((a, b) for a, b in pieces if text[a:b].strip() and b - a <= MAX_LINE_CHARS)
        pos += len(line) + 1
    return out


def _cut(text: str, max_chars: int) -> str:
    """`text` cut at the last line break within `max_chars` characters (at `max_chars` when it has none)."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    at = head.rfind("\n")
    return head[:at] if at > 0 else head


def read_sources(validation_texts) -> list[tuple[str, list[str]]]:
    """(source name, its non-empty documents) per `NN_source.jsonl` of a folder (sorted by name), or of
    the given list of files; sources without documents are left out.

    Args:
        validation_texts: a `validation_texts` folder, or a list of .jsonl files.
    Returns:
        [(name, [text, ...]), ...] in file-name order.
    """
    from natsl.eval.data import read_text_documents

    if isinstance(validation_texts, (str, Path)):
        files = sorted(Path(validation_texts).glob("*.jsonl"))
    else:
        files = sorted(Path(p) for p in validation_texts)
    sources = []
    for path in files:
        docs = [d for d in read_text_documents(path, "text") if d.strip()]
        if docs:
            sources.append((path.stem, docs))
    return sources


def next_line_items(sources: list[tuple[str, list[str]]], *, items: int = 400, context_lines: int = 24,
                    max_context_chars: int = 4000, seed: int = 0) -> list[dict]:
    """The multiple-choice items: sources taken in turn, a random unit (segments(): a line or a sentence of
    a long line) of one of the source's documents, with at least one unit before it, as the answer.

    Args:
        sources: read_sources' list.
        items: how many items at most (fewer when the documents hold fewer distinct positions).
        context_lines: lines of the document before the answer shown as the context (at most).
        max_context_chars: the context's characters at most (its first lines are dropped to fit).
        seed: the seed of every draw.
    Returns:
        [{"source", "context", "choices" (4 strings), "answer" (index of the true line), "doc"}, ...].
    """
    rng = random.Random(f"natsl-mini-next-line/{seed}")
    units = [[segments(doc) for doc in docs] for _, docs in sources]
    positions = []  # per source: (document, unit index) of every unit that can be an answer (one unit before it)
    pool = []  # (source, document, text) of every unit that can be a wrong choice
    for s, per_doc in enumerate(units):
        here = [(d, i) for d, segs in enumerate(per_doc) for i in range(1, len(segs))]
        pool.extend((s, d, sources[s][1][d][a:b]) for d, segs in enumerate(per_doc) for a, b in segs)
        rng.shuffle(here)
        positions.append(here)
    out: list[dict] = []
    turn = 0
    while len(out) < items and any(positions):
        s = turn % len(sources)
        turn += 1
        if not positions[s]:
            continue
        d, i = positions[s].pop()
        doc, segs = sources[s][1][d], units[s][d]
        start, end = segs[i]
        truth = doc[start:end]
        first = max(0, i - context_lines)
        while first < i - 1 and start - segs[first][0] > max_context_chars:
            first += 1
        # the document exactly as it runs up to the answer: the context ends in the line break (or the
        # space after a sentence) before it
        context = doc[segs[first][0]:start]
        if not context.strip() or len(context) > max_context_chars:
            continue
        wrong: list[str] = []
        for _ in range(200):  # draws from other documents, distinct from the truth and each other
            s2, d2, text = pool[rng.randrange(len(pool))]
            if (s2, d2) != (s, d) and text != truth and text not in wrong:
                wrong.append(text)
                if len(wrong) == 3:
                    break
        if len(wrong) < 3:
            continue
        choices = [truth, *wrong]
        rng.shuffle(choices)
        out.append({"source": sources[s][0], "doc": d, "context": context, "choices": choices,
                    "answer": choices.index(truth)})
    return out


def doc_rows(sources: list[tuple[str, list[str]]], *, docs_per_source: int = 25, max_chars: int = 16000) -> list[dict]:
    """The rolling-perplexity documents: the first `docs_per_source` of each source, cut to `max_chars`."""
    return [{"source": name, "text": _cut(doc, max_chars)} for name, docs in sources for doc in docs[:docs_per_source]]


MC_YAML = """task: {task}
output_type: multiple_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""

ROLLING_YAML = """task: {task}
output_type: loglikelihood_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def build_lm_tasks(validation_texts, out, *, seed: int = 0, items: int = 400, context_lines: int = 24,
                   docs_per_source: int = 25, max_chars: int = 16000) -> dict:
    """Write the task folder `out` (two YAMLs and their .jsonl data) for `natsl eval-lm --include-path out`.

    Args:
        validation_texts: the corpus's `validation_texts` folder, or a list of its .jsonl files.
        out: the task folder (created; its files are replaced atomically).
        seed: the seed of the multiple-choice draws.
        items: multiple-choice items at most.
        context_lines: context lines per item at most.
        docs_per_source: rolling-perplexity documents per source at most.
        max_chars: characters per rolling-perplexity document at most.
    Returns:
        {"tasks": the task names with data (for --tasks), "include_path": str(out), "items": n, "docs": n,
         "sources": [names]}.
    Raises:
        NatslError: no source holds a document.
    """
    from natsl.atomic import write_jsonl, write_text
    from natsl.errors import NatslError

    out = Path(out)
    sources = read_sources(validation_texts)
    if not sources:
        raise NatslError(f"{str(validation_texts)!r} holds no held-out document to build the lm-eval tasks from; "
                         "tokenize the corpus with --val-texts")
    mc = next_line_items(sources, items=items, context_lines=context_lines, seed=seed)
    docs = doc_rows(sources, docs_per_source=docs_per_source, max_chars=max_chars)
    tasks = []
    if mc:
        data = write_jsonl(out / "next_line.jsonl", mc)
        write_text(out / f"{NEXT_LINE}.yaml", MC_YAML.format(task=NEXT_LINE, data=json.dumps(str(data.resolve()))))
        tasks.append(NEXT_LINE)
    data = write_jsonl(out / "docs.jsonl", docs)
    write_text(out / f"{DOCS}.yaml", ROLLING_YAML.format(task=DOCS, data=json.dumps(str(data.resolve()))))
    tasks.append(DOCS)
    return {"tasks": tasks, "include_path": str(out), "items": len(mc), "docs": len(docs),
            "sources": [name for name, _ in sources]}
