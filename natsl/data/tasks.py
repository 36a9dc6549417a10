"""Synthetic recall tasks as training data: `data.path: task:NAME?key=value&...`, made on the fly.

Two tasks, each a batch of (inputs [B, T], targets [B, T]) where `targets` is -100 everywhere except
at the answers, so the trainer's loss (natsl.training.loss, `ignore_index=-100`) counts the answers
only:

- `mqar`: multi-query associative recall as Zoology defines it (Arora et al. 2023, "Zoology:
  measuring and improving recall in efficient language models", their `_mqar` generator): with V
  the task vocabulary, `pairs` distinct keys from [1, V/2) and distinct values from [V/2, V) are
  written first as k1 v1 k2 v2 ...; then every key is asked once, at the position 2*pairs + 2*gap,
  the gaps drawn without replacement from 0..(seq_len - 2*pairs)/2 - 1 with probability proportional
  to (gap + 1)^(power_a - 1) (a power law: most queries come soon after the pairs, a few far away);
  the target at a query's position is its value; every other position holds a random token of
  [0, V) (`random_non_queries`, Zoology's default) or 0. A mixture of difficulties is a list of
  (seq_len, pairs) parts with weights; each row draws its part, rows shorter than the batch are
  padded with 0 and target -100. `mix=zoology` is Zoology's training mixture (its Based figure 2:
  100K examples of (64, 4) and 20K each of (128, 8), (256, 16), (256, 32), (256, 64)).
      task:mqar?seq_len=512&pairs=64
      task:mqar?seq_len=256,512&pairs=32,64&weights=1,1
      task:mqar?mix=zoology&vocab=8192
- `passkey`: a needle in random filler at long context. Token 1 marks the needle, token 2 the
  question, tokens 3..12 are the ten digits, filler is random from [13, V). The needle (marker and
  `digits` digits) sits at a uniformly random depth; the sequence ends with the question marker and
  the digits again, which are the targets.
      task:passkey?seq_len=4096&digits=5

Keys common to both: `vocab` (default: the model's vocabulary size; must not exceed it), `seq_len`
(default: train.seq_len; must not exceed it). A batch is a pure function of (train.seed, the global
indices of its samples): it is drawn from a generator seeded with their hash, on the training
device, so a resumed run sees the same data. Evaluation samples come from another stream (seed
offset EVAL_STREAM), never seen in training.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import torch

from natsl.errors import NatslError

PREFIX = "task:"
IGNORE = -100
EVAL_STREAM = 1 << 40  # sample indices of evaluation batches start here (disjoint from training)
# Zoology's training mixture (seq_len, pairs, examples): the relative weights of its parts.
ZOOLOGY_MIX = ((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000), (256, 32, 20_000), (256, 64, 20_000))
# passkey's reserved tokens
NEEDLE, QUESTION, DIGIT0, FILLER0 = 1, 2, 3, 13


def is_task(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


@dataclass
class Part:
    seq_len: int
    pairs: int = 0  # mqar: key-value pairs; passkey: digits
    weight: float = 1.0


@dataclass
class TaskSpec:
    name: str
    vocab: int
    parts: list[Part] = field(default_factory=list)
    power_a: float = 0.01
    random_non_queries: bool = True

    @property
    def max_len(self) -> int:
        return max(p.seq_len for p in self.parts)

    def canonical(self) -> str:
        """One string per task (the checkpoint's data fingerprint)."""
        lens = ",".join(str(p.seq_len) for p in self.parts)
        counts = ",".join(str(p.pairs) for p in self.parts)
        weights = ",".join(f"{p.weight:g}" for p in self.parts)
        if self.name == "passkey":
            return f"{PREFIX}passkey?vocab={self.vocab}&seq_len={lens}&digits={counts}&weights={weights}"
        return (f"{PREFIX}mqar?vocab={self.vocab}&seq_len={lens}&pairs={counts}&weights={weights}"
                f"&power_a={self.power_a:g}&random_non_queries={int(self.random_non_queries)}")


def _ints(key: str, text: str, spec: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise NatslError(f"task {spec!r}: {key}={text!r} must be integers separated by commas") from None
    if not out or min(out) < 1:
        raise NatslError(f"task {spec!r}: {key}={text!r} must be positive integers separated by commas")
    return out


def parse_task(spec: str, vocab_size: int, seq_len: int) -> TaskSpec:
    """`task:NAME?key=value&...` -> TaskSpec, checked against the model's vocabulary and train.seq_len."""
    if not is_task(spec):
        raise NatslError(f"{spec!r} is not a task; write e.g. task:mqar?seq_len=512&pairs=64")
    name, _, query = spec[len(PREFIX):].partition("?")
    if name not in ("mqar", "passkey"):
        raise NatslError(f"unknown task {name!r} in {spec!r}; choose mqar or passkey")
    args = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    allowed = {"mqar": {"vocab", "seq_len", "pairs", "weights", "power_a", "random_non_queries", "mix"},
               "passkey": {"vocab", "seq_len", "digits", "weights"}}[name]
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise NatslError(f"task {spec!r}: unknown key {unknown[0]!r}; allowed for {name}: {', '.join(sorted(allowed))}")
    vocab = _ints("vocab", args["vocab"], spec)[0] if "vocab" in args else vocab_size
    if vocab > vocab_size:
        raise NatslError(f"task {spec!r}: vocab={vocab} is more than model.vocab_size = {vocab_size}; lower vocab "
                         "or raise model.vocab_size")
    task = TaskSpec(name, vocab)
    if name == "mqar" and "mix" in args:
        if args["mix"] != "zoology" or {"seq_len", "pairs", "weights"} & set(args):
            raise NatslError(f"task {spec!r}: mix=zoology is the only mixture preset and replaces seq_len, pairs "
                             "and weights; drop them or drop mix")
        task.parts = [Part(n, p, float(w)) for n, p, w in ZOOLOGY_MIX]
    else:
        count_key = "pairs" if name == "mqar" else "digits"
        lens = _ints("seq_len", args["seq_len"], spec) if "seq_len" in args else [seq_len]
        if count_key not in args and name == "mqar":
            raise NatslError(f"task {spec!r} needs pairs=N (key-value pairs per sequence), e.g. &pairs=64")
        counts = _ints(count_key, args[count_key], spec) if count_key in args else [5]
        n = max(len(lens), len(counts))
        if {len(lens), len(counts)} - {1, n}:
            raise NatslError(f"task {spec!r}: seq_len and {count_key} must list the same number of values (or one)")
        lens, counts = lens * (n // len(lens)), counts * (n // len(counts))
        weights = [1.0] * n
        if "weights" in args:
            try:
                weights = [float(w) for w in args["weights"].split(",")]
            except ValueError:
                weights = []
            if len(weights) != n or not all(math.isfinite(w) and w > 0 for w in weights):
                raise NatslError(f"task {spec!r}: weights must be {n} positive numbers separated by commas")
        task.parts = [Part(a, b, w) for a, b, w in zip(lens, counts, weights)]
    if name == "mqar":
        if "power_a" in args:
            try:
                task.power_a = float(args["power_a"])
            except ValueError:
                task.power_a = -1.0
            if not 0 < task.power_a <= 1:
                raise NatslError(f"task {spec!r}: power_a must lie in (0, 1] (1 = uniform gaps), got {args['power_a']!r}")
        if "random_non_queries" in args:
            value = args["random_non_queries"].lower()
            if value not in ("0", "1", "true", "false"):
                raise NatslError(f"task {spec!r}: random_non_queries must be 1/0 or true/false")
            task.random_non_queries = value in ("1", "true")
    for part in task.parts:
        _check_part(task, part, spec)
    if task.max_len > seq_len:
        raise NatslError(f"task {spec!r}: seq_len {task.max_len} is more than train.seq_len = {seq_len}; "
                         f"set train.seq_len to at least {task.max_len}")
    return task


def _check_part(task: TaskSpec, part: Part, spec: str) -> None:
    if task.name == "mqar":
        # Zoology's own limits: room for every query at an even gap, keys and values both distinct
        if part.seq_len % 2 or 4 * part.pairs > part.seq_len:
            raise NatslError(f"task {spec!r}: seq_len {part.seq_len} must be even and at least 4 x pairs = "
                             f"{4 * part.pairs}")
        if part.pairs > task.vocab // 2 - 1:
            raise NatslError(f"task {spec!r}: {part.pairs} pairs need at least {2 * part.pairs + 2} vocabulary "
                             f"tokens (distinct keys and values), vocab is {task.vocab}")
    else:
        if part.seq_len < 2 * part.pairs + 3:
            raise NatslError(f"task {spec!r}: seq_len {part.seq_len} is too short for {part.pairs} digits "
                             f"(at least {2 * part.pairs + 3})")
        if task.vocab <= FILLER0:
            raise NatslError(f"task {spec!r}: passkey needs vocab > {FILLER0} (markers, digits and filler)")


# ----------------------------------------------------------------------------- generation

def batch_generator(seed: int, indices: list[int], device) -> torch.Generator:
    """A generator on `device` seeded by (seed, the samples' global indices)."""
    digest = hashlib.blake2b(repr((int(seed), int(indices[0]), len(indices), int(indices[-1]))).encode(),
                             digest_size=8).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def _distinct(n: int, low: int, high: int, count: int, gen, device) -> torch.Tensor:
    """[n, count] distinct integers from [low, high) per row, uniformly (top-k of uniform noise)."""
    return torch.rand(n, high - low, generator=gen, device=device).topk(count, dim=1).indices + low


def mqar_rows(task: TaskSpec, part: Part, n: int, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """n MQAR examples of one (seq_len, pairs): (inputs, targets) [n, seq_len] int64."""
    length, pairs, vocab = part.seq_len, part.pairs, task.vocab
    half = vocab // 2
    keys = _distinct(n, 1, half, pairs, gen, device)
    values = _distinct(n, half, vocab, pairs, gen, device)
    space = (length - 2 * pairs) // 2
    # Sampling `pairs` gaps without replacement with weights p: the top-k of log p + Gumbel noise
    # has the same law as drawing one at a time and renormalising (numpy's choice(replace=False, p)).
    logp = (task.power_a - 1.0) * torch.log(torch.arange(1, space + 1, device=device, dtype=torch.float32))
    uniform = torch.rand(n, space, generator=gen, device=device).clamp_(min=1e-20)
    gaps = (logp - torch.log(-torch.log(uniform))).topk(pairs, dim=1).indices
    inputs = torch.zeros(n, length, dtype=torch.long, device=device)
    inputs[:, 0:2 * pairs:2] = keys
    inputs[:, 1:2 * pairs:2] = values
    where = 2 * pairs + 2 * gaps
    inputs.scatter_(1, where, keys)
    targets = torch.full_like(inputs, IGNORE)
    targets.scatter_(1, where, values)
    if task.random_non_queries:
        noise = torch.randint(0, vocab, inputs.shape, generator=gen, device=device)
        inputs = torch.where(inputs == 0, noise, inputs)
    return inputs, targets


def passkey_rows(task: TaskSpec, part: Part, n: int, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """n passkey examples: (inputs, targets) [n, seq_len] int64, the digits at the end as targets."""
    length, digits = part.seq_len, part.pairs
    seq = torch.randint(FILLER0, task.vocab, (n, length + 1), generator=gen, device=device)
    code = torch.randint(0, 10, (n, digits), generator=gen, device=device) + DIGIT0
    # the needle (marker + digits) lies wholly before the question
    depth = torch.randint(0, length - 2 * digits - 1, (n, 1), generator=gen, device=device)
    span = torch.arange(digits + 1, device=device)[None]
    seq.scatter_(1, depth + span, torch.cat([torch.full((n, 1), NEEDLE, device=device), code], 1))
    seq[:, length - digits] = QUESTION
    seq[:, length - digits + 1:] = code
    inputs, targets = seq[:, :-1].clone(), torch.full((n, length), IGNORE, dtype=torch.long, device=device)
    targets[:, length - digits:] = seq[:, length - digits + 1:]  # input j predicts token j + 1
    return inputs, targets


def make_batch(task: TaskSpec, n: int, width: int, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows, each from a part drawn by weight, padded to `width`: (inputs, targets) [n, width]."""
    inputs = torch.zeros(n, width, dtype=torch.long, device=device)
    targets = torch.full((n, width), IGNORE, dtype=torch.long, device=device)
    if len(task.parts) == 1:
        which = torch.zeros(n, dtype=torch.long)
    else:
        weights = torch.tensor([p.weight for p in task.parts], dtype=torch.float64, device=device)
        which = torch.multinomial(weights, n, replacement=True, generator=gen).cpu()
    rows = mqar_rows if task.name == "mqar" else passkey_rows
    for i, part in enumerate(task.parts):
        picked = (which == i).nonzero().flatten()
        if len(picked) == 0:
            continue
        x, y = rows(task, part, len(picked), gen, device)
        picked = picked.to(device)
        inputs[picked, :part.seq_len] = x
        targets[picked, :part.seq_len] = y
    return inputs, targets


class TaskData:
    """The trainer's data source for `data.path: task:...`: `batch(indices)` -> (inputs, targets)
    on the device; `eval_batches` for the validation loss and answer accuracy."""

    def __init__(self, spec: str, vocab_size: int, seq_len: int, seed: int, device):
        self.task = parse_task(spec, vocab_size, seq_len)
        self.seq_len, self.seed, self.device = seq_len, seed, torch.device(device)
        self.folder = spec  # what the checkpoint's trainer state records as its data
        self.meta = {"fingerprint": self.task.canonical()}

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        gen = batch_generator(self.seed, indices, self.device)
        return make_batch(self.task, len(indices), self.seq_len, gen, self.device)

    def eval_batches(self, samples: int, micro_batch: int):
        """Held-out batches covering `samples` examples (from the evaluation stream)."""
        for start in range(0, samples, micro_batch):
            count = min(micro_batch, samples - start)
            yield self.batch(list(range(EVAL_STREAM + start, EVAL_STREAM + start + count)))


@torch.no_grad()
def answer_hits(hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(correct, counted) argmax predictions at the answer positions (targets != -100), computing
    logits for those rows only."""
    mask = targets != IGNORE
    rows = hidden[mask]
    if rows.shape[0] == 0:
        return 0, 0
    pred = (rows.to(head_weight.dtype) @ head_weight.t()).argmax(-1)
    return int((pred == targets[mask]).sum()), int(mask.sum())
