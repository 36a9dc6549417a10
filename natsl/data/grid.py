"""The evaluation grid of a synthetic recall task: which (sequence length, pairs) points a model is
evaluated on. Shared by `natsl eval-recall` (natsl.eval.recall) and the sweep runner, which checks
every run's grid before any worker starts (natsl.training.sweep), so both read it the same way."""

from __future__ import annotations

from natsl.data.tasks import Part, TaskSpec, _check_part, is_task, parse_task
from natsl.errors import NatslError


def parse_lengths(text: str, what: str = "--lengths", noun: str = "length",
                  example: str = "4k,8k,16k or 4096,8192") -> list[int]:
    """"4k,8k,16k" or "4096,8192" -> [4096, 8192, ...]; `what` names the value in errors.

    Args:
        text: comma-separated positive integers, each optionally with a `k` suffix (x 1024).
        what: how the error messages name the value (an option, or a spec key).
        noun, example: what one value is and a good value, for the error messages (pairs are counts, not lengths).
    Returns:
        the values, in the order given.
    """
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1
        if part.endswith("k"):
            part, scale = part[:-1], 1024
        try:
            value = int(float(part) * scale)
        except (ValueError, OverflowError):  # "abc", "nan", "inf"
            raise NatslError(f"{what} {text!r}: {part!r} is not a {noun}; use e.g. {example}") from None
        if value < 1:
            raise NatslError(f"{what} {text!r}: {noun}s must be positive; use e.g. {example}")
        out.append(value)
    if not out:
        raise NatslError(f"{what} is empty; use e.g. {example}")
    return out


def parse_pairs(text: str, what: str = "--pairs") -> list[int]:
    """"16,64,256" -> [16, 64, 256]: the key-value pairs (MQAR) or digits (passkey) of a recall grid, read as
    parse_lengths reads lengths (a `k` suffix too), its errors naming counts."""
    return parse_lengths(text, what, noun="count", example="16,64,256")


def grid_points(task: str, lengths: list[int], counts: list[int], vocab: int) -> list[tuple[int, int]]:
    """Every (length, count) that the task can make (MQAR: 4 x pairs <= length), in order."""
    spec = TaskSpec(task, vocab)
    points = []
    for n in lengths:
        for p in counts:
            try:
                _check_part(spec, Part(n, p), f"task:{task}")
            except NatslError:
                continue
            points.append((n, p))
    if not points:
        raise NatslError(f"no (length, {'pairs' if task == 'mqar' else 'digits'}) point of the grid fits the {task} "
                         f"task (MQAR needs length >= 4 x pairs and pairs < vocab/2); pass other --lengths/--pairs")
    return points


def check_vocab(vocab) -> None:
    """A task vocabulary asked for (--vocab, a sweep's eval.vocab): None (the default) or a positive integer."""
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1):
        raise NatslError(f"--vocab must be a positive integer (the task's vocabulary), got {vocab!r}; "
                         "leave it out for the trained task's vocabulary")


def eval_grid(recipe, task: str | None, length_list: list[int] | None, count_list: list[int] | None,
              vocab: int | None) -> tuple[TaskSpec, list[tuple[int, int]]]:
    """The task and (length, count) points to evaluate a model of `recipe` on.

    Args:
        recipe: the model's recipe (natsl.config.Recipe); its data.path, when a task, gives the defaults:
            task, vocabulary, grid, power law.
        task: mqar or passkey (None: the trained task, else mqar).
        length_list, count_list: the grid's sequence lengths and pair (digit) counts (None: the trained task's).
        vocab: the task vocabulary (None: the trained task's, else the model's); at least 1, at most the model's.
    Returns:
        (the task, its points in order).
    """
    model_vocab = recipe.model.vocab_size
    trained = recipe.data.path
    base = parse_task(trained, model_vocab, 1 << 30) if is_task(trained) else None
    name = task or (base.name if base else "mqar")
    if name not in ("mqar", "passkey"):
        raise NatslError(f"unknown --task {name!r}; choose mqar or passkey")
    check_vocab(vocab)
    same = base is not None and base.name == name
    spec = TaskSpec(name, vocab if vocab is not None else (base.vocab if same else model_vocab))
    if same:
        spec.power_a, spec.random_non_queries = base.power_a, base.random_non_queries
    if spec.vocab > model_vocab:
        raise NatslError(f"--vocab {spec.vocab} is more than the model's vocabulary {model_vocab}")
    length_list = length_list or (sorted({p.seq_len for p in base.parts}) if same else None)
    count_list = count_list or (sorted({p.pairs for p in base.parts}) if same else None)
    if not length_list or not count_list:
        raise NatslError(f"the checkpoint was not trained on a {name} task; pass --lengths and --pairs "
                         "(e.g. --lengths 512,1024 --pairs 32,64)")
    too_long = [n for n in length_list if n > recipe.model.max_seq_len]
    if too_long:
        raise NatslError(f"--lengths: {too_long[0]} is beyond the model's max_seq_len {recipe.model.max_seq_len}")
    return spec, grid_points(name, length_list, count_list, spec.vocab)
