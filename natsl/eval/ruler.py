"""The RULER retrieval subset (needle in a haystack), generated locally, scored by string match.

Task definitions follow RULER (Hsieh et al. 2024, NVIDIA/RULER `synthetic.yaml` and `niah.py`):

| task            | haystack | key   | value   | keys | values | queries |
|-----------------|----------|-------|---------|------|--------|---------|
| niah_single_1   | noise    | words | numbers | 1    | 1      | 1       |
| niah_single_2   | essay    | words | numbers | 1    | 1      | 1       |
| niah_single_3   | essay    | words | uuids   | 1    | 1      | 1       |
| niah_multikey_1 | essay    | words | numbers | 4    | 1      | 1       |
| niah_multikey_2 | needle   | words | numbers | 1    | 1      | 1       |
| niah_multikey_3 | needle   | uuids | uuids   | 1    | 1      | 1       |
| niah_multivalue | essay    | words | numbers | 1    | 4      | 1       |
| niah_multiquery | essay    | words | numbers | 4    | 1      | 4       |

A needle reads "One of the special magic {numbers|uuids} for {key} is: {value}."; the noise haystack
repeats "The grass is green. ..."; the needle haystack is made of distractor needles with other
keys. The prompt is RULER's base-model form (task template + answer prefix), the haystack is sized
with the checkpoint's own tokenizer so that prompt + `max_new_tokens` fits the length, and each
needle sits at a depth drawn (seeded) from RULER's 40-point grid 0..100 %. The model continues the
prompt greedily; a sample scores the fraction of its expected values found in the output
(case-insensitive substring, RULER's `string_match_all`), on the paper's 0..1 scale.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import asdict, dataclass, field

from natsl.errors import NatslError, NonFiniteError
from natsl.eval.haystack import KEY_WORDS, EssaySentences

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEMPLATE_PLURAL = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                   "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
PREFIX_PLURAL = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
# RULER turns the plural wording singular when exactly one value is asked for.
TEMPLATE_SINGULAR = ("A special magic {type_needle_v} is hidden within the following text. Make sure to memorize it. "
                     "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                     "What is the special magic {type_needle_v} for {query} mentioned in the provided text?")
PREFIX_SINGULAR = " The special magic {type_needle_v} for {query} mentioned in the provided text is"
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER: round(linspace(0, 100, 40))
TOKENS_TO_GENERATE = 128  # RULER's budget for the NIAH tasks


@dataclass(frozen=True)
class NiahTask:
    haystack: str  # "noise", "essay" or "needle"
    key_type: str  # "words" or "uuids"
    value_type: str  # "numbers" or "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


TASKS: dict[str, NiahTask] = {
    "niah_single_1": NiahTask("noise", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahTask("needle", "words", "numbers"),
    "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", num_keys=4, num_queries=4),
}


def random_item(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))  # seven digits, as RULER
    if kind == "words":
        return rng.choice(KEY_WORDS)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


@dataclass
class RulerSample:
    task: str
    length: int
    index: int
    prompt: str
    answers: list[str]
    query: str
    depths: list[int]  # stated depth (percent of the haystack) of each inserted needle, in order
    needles: list[str]
    needle_token_positions: list[int] = field(default_factory=list)  # first prompt token of each needle
    needle_token_ends: list[int] = field(default_factory=list)  # one past the last token of each needle
    context_token_span: tuple[int, int] = (0, 0)  # prompt tokens [start, end) of the haystack
    prompt_ids: list[int] = field(default_factory=list)
    haystack_units: int = 0

    def token_depths(self) -> list[float]:
        """Where each needle actually sits: the fraction of the haystack's own tokens (the needles'
        tokens left out) that come before it."""
        start, end = self.context_token_span
        lengths = [e - p for p, e in zip(self.needle_token_positions, self.needle_token_ends)]
        hay = max(end - start - sum(lengths), 1)
        return [(p - start - sum(lengths[:i])) / hay for i, p in enumerate(self.needle_token_positions)]

    def to_json(self, with_prompt: bool = False) -> dict:
        row = asdict(self)
        row.pop("prompt_ids")
        if not with_prompt:
            row.pop("prompt")
        row["prompt_tokens"] = len(self.prompt_ids)
        row["token_depths"] = [round(d, 4) for d in self.token_depths()]
        return row


class _Builder:
    """The random parts of one sample, drawn once; `build(n)` lays them into a haystack of n units."""

    def __init__(self, task: NiahTask, rng: random.Random, essay: EssaySentences, distractor_rng: random.Random):
        self.task, self.essay, self._drng = task, essay, distractor_rng
        num_keys = max(task.num_keys, task.num_queries)
        keys: list[str] = []
        while len(keys) < num_keys:  # distinct keys, so every query has one answer set
            key = random_item(rng, task.key_type)
            if key not in keys:
                keys.append(key)
        values = [[random_item(rng, task.value_type) for _ in range(task.num_values)] for _ in keys]
        needles = [NEEDLE.format(type_needle_v=task.value_type, key=k, value=v)
                   for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        self.depths = sorted(rng.sample(DEPTHS, len(needles)))
        self.needles = needles
        chosen = rng.sample(range(num_keys), task.num_queries)
        queries = [keys[i] for i in chosen]
        self.answers = [v for i in chosen for v in values[i]]
        self.query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
        self._keys = set(keys)
        self._distractors: list[str] = []
        single = task.num_queries * task.num_values == 1
        type_v = task.value_type[:-1] if single else task.value_type
        template = TEMPLATE_SINGULAR if single else TEMPLATE_PLURAL
        prefix = PREFIX_SINGULAR if single else PREFIX_PLURAL
        # Split the prompt around the context so the needle offsets are known exactly.
        head, tail = (template + prefix).split("{context}")
        self.head = head.format(type_needle_v=type_v, query=self.query)
        self.tail = tail.format(type_needle_v=type_v, query=self.query)

    def _units(self, n: int) -> list[str]:
        kind = self.task.haystack
        if kind == "noise":
            return [NOISE] * n
        if kind == "essay":
            return self.essay.take(n)
        while len(self._distractors) < n:  # needle haystack: distractors with keys not asked about
            key = random_item(self._drng, self.task.key_type)
            if key in self._keys:
                continue
            value = random_item(self._drng, self.task.value_type)
            self._distractors.append(NEEDLE.format(type_needle_v=self.task.value_type, key=key, value=value))
        return self._distractors[:n]

    def build(self, n: int) -> tuple[str, list[int], tuple[int, int]]:
        """(prompt, char offset of each needle, char span of the context)."""
        units = self._units(n)
        n = len(units)
        slots = [int(n * d / 100) for d in self.depths]
        sep = " " if self.task.haystack == "essay" else "\n"
        pieces, offsets, pos, k = [], [], len(self.head), 0
        for i in range(n + 1):
            while k < len(slots) and slots[k] == i:
                if pieces:
                    pos += len(sep)
                offsets.append(pos)
                pieces.append(self.needles[k])
                pos += len(self.needles[k])
                k += 1
            if i < n:
                if pieces:
                    pos += len(sep)
                pieces.append(units[i])
                pos += len(units[i])
        context = sep.join(pieces)
        assert pos == len(self.head) + len(context)
        return self.head + context + self.tail, offsets, (len(self.head), len(self.head) + len(context))


def _encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer.inner.encode(text, add_special_tokens=False)
    return list(enc.ids), [tuple(o) for o in enc.offsets]


def _token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """Index of the first token that ends after `char` (the token holding that character)."""
    lo, hi = 0, len(offsets)
    while lo < hi:
        mid = (lo + hi) // 2
        if offsets[mid][1] <= char:
            lo = mid + 1
        else:
            hi = mid
    return lo


def make_sample(task_name: str, length: int, index: int, tokenizer, *, seed: int = 0,
                max_new_tokens: int = TOKENS_TO_GENERATE, essay: EssaySentences | None = None) -> RulerSample:
    """Sample `index` of `task_name` at `length` tokens (prompt + max_new_tokens <= length).

    Everything random is drawn from a generator seeded with (seed, task, length, index), so a
    sample is the same on every run and independent of the other samples."""
    if task_name not in TASKS:
        raise NatslError(f"unknown RULER task {task_name!r}; choose from {', '.join(TASKS)}")
    task = TASKS[task_name]
    rng = random.Random(f"natsl-ruler/{seed}/{task_name}/{length}/{index}")
    drng = random.Random(f"natsl-ruler/{seed}/{task_name}/{length}/{index}/distractors")
    builder = _Builder(task, rng, essay or EssaySentences(seed), drng)
    budget = length - max_new_tokens

    def size(n: int) -> int:
        return len(tokenizer.encode(builder.build(n)[0]))

    if size(0) > budget:
        raise NatslError(f"--lengths {length} is too short for {task_name}: the prompt alone takes {size(0)} tokens "
                         f"plus {max_new_tokens} to generate")
    cap = essay.available() if (essay is not None and task.haystack == "essay") else None
    lo, hi = 0, 1  # the largest n with size(n) <= budget: double, then bisect
    while True:
        if cap is not None and hi >= cap:
            hi = cap
            if size(cap) <= budget:  # the whole essay file fits
                lo = cap
            break
        if size(hi) > budget:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if size(mid) <= budget:
            lo = mid
        else:
            hi = mid
    prompt, char_offsets, (c0, c1) = builder.build(lo)
    ids, offsets = _encode_with_offsets(tokenizer, prompt)
    return RulerSample(
        task=task_name, length=length, index=index, prompt=prompt, answers=builder.answers, query=builder.query,
        depths=builder.depths, needles=builder.needles,
        needle_token_positions=[_token_at(offsets, c) for c in char_offsets],
        needle_token_ends=[_token_at(offsets, c + len(n) - 1) + 1 for c, n in zip(char_offsets, builder.needles)],
        context_token_span=(_token_at(offsets, c0), _token_at(offsets, c1)),
        prompt_ids=ids, haystack_units=lo)


def answer_text(answers: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """The continuation that states `answers` as the needles do ("...is: 4821937."): ": v1, v2" and the
    character span of each value in it."""
    text, spans = ":", []
    for i, answer in enumerate(answers):
        text += ("," if i else "") + " "
        spans.append((len(text), len(text) + len(answer)))
        text += answer
    return text, spans


def answer_accuracy(model, tokenizer, sample: RulerSample, device) -> dict:
    """Teacher-forced needle retrieval: the prompt followed by `answer_text(sample.answers)` in one forward;
    of the tokens that spell the values, the fraction the model predicts exactly (argmax) and their mean
    log-probability (nats).

    Greedy generation scores 0 whenever the first token of a value is wrong or the model does not
    start the answer at once, which small models trained on little text do at every length; this
    measure still tells which of two such models retrieves more of a needle. The continuation is
    encoded on its own and appended, as lm-eval scores a target.

    Returns: {"answer_token_accuracy": float in [0, 1], "answer_logprob": float, "answer_tokens": int}."""
    import torch

    from natsl.eval.common import final_hidden_states

    text, spans = answer_text(sample.answers)
    ids, offsets = _encode_with_offsets(tokenizer, text)
    # the tokens that overlap a value (the separators ": " and ", " are free to predict)
    wanted = [i for i, (a, b) in enumerate(offsets) if any(a < end and b > start for start, end in spans)]
    if not wanted:
        raise NatslError(f"the tokenizer spells RULER's answer {text!r} with no tokens")
    full = torch.tensor([sample.prompt_ids + ids], device=device)
    at = torch.tensor([len(sample.prompt_ids) - 1 + i for i in wanted], device=device)  # each predicts at + 1
    with torch.inference_mode(), final_hidden_states(model) as head:
        logits = head(model(full)[0, at]).float()
    if not torch.isfinite(logits).all():
        raise NonFiniteError("non-finite logits")
    targets = full[0, at + 1]
    logprob = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    return {"answer_token_accuracy": float((logits.argmax(-1) == targets).float().mean()),
            "answer_logprob": float(logprob.mean()), "answer_tokens": len(wanted)}


def postprocess(prediction: str) -> str:
    """RULER's clean-up of a model output: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: list[str]) -> float:
    """Fraction of `answers` found in the prediction (case-insensitive substring), in [0, 1]."""
    if not answers:
        raise ValueError("a RULER sample needs at least one expected answer")
    text = postprocess(prediction).lower()
    return sum(1.0 for a in answers if a.lower() in text) / len(answers)


def run_ruler(em, tasks: list[str], lengths: list[int], samples: int, *, seed: int = 0,
              max_new_tokens: int = TOKENS_TO_GENERATE, essay: EssaySentences | None = None,
              use_cache: bool = True, progress: bool = True, on_first=None,
              teacher_forced: bool = True) -> tuple[dict, list[dict]]:
    """Generate, decode greedily and score every (length, task, sample). Returns (summary, rows).

    With `teacher_forced`, each sample is also scored by `answer_accuracy` (one more forward of its
    prompt): the summary's "answer_accuracy" and "answer_logprob" (nats per answer token) hold those means
    as "tasks" / "lengths" / "mean" do the string-match scores.

    `on_first(stats, samples, sample)` is called once, after a warm sample is decoded (the second: the
    first pays the compiles of a new length), with its timings (see `greedy_generate`), every sample to
    run and the sample measured (for an estimate of the whole run)."""
    from tqdm import tqdm

    from natsl.eval.decode import greedy_generate
    from natsl.inference.decode import DecodeRunner

    tokenizer = em.tokenizer
    if tokenizer is None:
        raise NatslError(f"checkpoint {str(em.folder)!r} has no tokenizer.json; RULER prompts are text, so it needs one")
    essay = essay or EssaySentences(seed)
    # All prompts first: cheap, and a length that cannot hold a task fails before any decoding.
    todo = [make_sample(task, length, index, tokenizer, seed=seed, max_new_tokens=max_new_tokens, essay=essay)
            for length in lengths for task in tasks for index in range(samples)]
    rows = []
    runner, runner_length = None, None  # one decode cache per length, reused by its samples (and on a GPU their
    # decode graphs: a graph per new cache would be captured again for every prompt)
    bar = tqdm(total=len(todo), desc=f"ruler {em.name}", unit="sample", disable=not progress, leave=False)
    try:
        for number, sample in enumerate(todo):
            stats: dict = {}
            if use_cache and runner_length != sample.length:
                runner = None  # the last length's cache goes before the next one is allocated
                runner = DecodeRunner(em.model, em.model.new_cache(1, max_len=sample.length))
                runner_length = sample.length
            try:
                out = greedy_generate(em.model, sample.prompt_ids, max_new_tokens, tokenizer.eos_id,
                                      use_cache=use_cache, device=em.device, stats=stats, runner=runner)
                forced = answer_accuracy(em.model, tokenizer, sample, em.device) if teacher_forced else {}
            except NonFiniteError as err:
                raise NatslError(f"checkpoint {str(em.folder)!r}: {err}; check its weights or try --dtype fp32") from None
            if number == min(1, len(todo) - 1) and on_first is not None:
                on_first(stats, todo, sample)
            if out and out[-1] == tokenizer.eos_id:
                out = out[:-1]
            prediction = tokenizer.decode(out)
            row = sample.to_json()
            row.update(prediction=prediction, score=string_match_all(prediction, sample.answers), **forced)
            rows.append(row)
            bar.update(1)
    finally:
        bar.close()
    summary = summarize(rows, tasks, lengths)
    if teacher_forced:
        summary["answer_accuracy"] = summarize(rows, tasks, lengths, key="answer_token_accuracy")
        summary["answer_logprob"] = summarize(rows, tasks, lengths, key="answer_logprob")
    return summary, rows


def summarize(rows: list[dict], tasks: list[str], lengths: list[int], key: str = "score") -> dict:
    """Mean of each row's `key` per task and length, per length over tasks (Table 2), and overall."""
    per_task = {t: {} for t in tasks}
    for t in tasks:
        for n in lengths:
            scores = [r[key] for r in rows if r["task"] == t and r["length"] == n]
            per_task[t][str(n)] = sum(scores) / len(scores) if scores else None
    per_length = {}
    for n in lengths:
        vals = [per_task[t][str(n)] for t in tasks if per_task[t][str(n)] is not None]
        per_length[str(n)] = sum(vals) / len(vals) if vals else None
    vals = [v for v in per_length.values() if v is not None]
    return {"tasks": per_task, "lengths": per_length, "mean": sum(vals) / len(vals) if vals else None}


def format_table(summary: dict, tasks: list[str], lengths: list[int]) -> str:
    width = max(len(t) for t in tasks + ["mean"])
    head = " " * width + "".join(f"{n:>9}" for n in lengths)
    lines = [head]
    for t in tasks:
        lines.append(t.ljust(width) + "".join(f"{summary['tasks'][t][str(n)]:9.2f}" for n in lengths))
    lines.append("mean".ljust(width) + "".join(f"{summary['lengths'][str(n)]:9.2f}" for n in lengths))
    return "\n".join(lines)


def plot_scores(summary: dict, tasks: list[str], lengths: list[int], path, title: str):
    """Heat maps of the mean score per task and length: string match, and beside it the teacher-forced
    answer-token accuracy where the summary holds it."""
    from natsl.eval.common import pyplot, save_figure

    plt = pyplot()
    panels = [(summary, "string match", "values found")]
    if summary.get("answer_accuracy"):
        panels.append((summary["answer_accuracy"], "teacher-forced", "answer tokens right"))
    rows = len(tasks) + 1
    fig, axes = plt.subplots(1, len(panels), squeeze=False, layout="constrained",
                             figsize=(len(panels) * (3.4 + 1.1 * len(lengths)), 1.4 + 0.42 * rows))
    for ax, (part, label, scale) in zip(axes[0], panels):
        grid = [[part["tasks"][t][str(n)] for n in lengths] for t in tasks]
        grid.append([part["lengths"][str(n)] for n in lengths])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(rows), tasks + ["mean"])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="white" if v < 0.6 else "black",
                        fontsize=8)
        ax.set_xlabel("context length (tokens)")
        ax.set_title(label, fontsize=10)
        fig.colorbar(image, ax=ax, fraction=0.05, label=f"score ({scale})")
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
