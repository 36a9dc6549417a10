"""`train.micro_batch_size: auto`: the largest micro-batch that fits the device, chosen before the first step.

The step keeps its tokens. The micro-batch is a divisor of the sequences each rank runs per step
(`tokens_per_step / (seq_len x ranks)`) and gradient accumulation makes up the rest, so every step
reads the same samples whatever the choice (`natsl.data.dataset.step_sample_indices`), and the loss,
a mean over equal micro-batches, changes only by rounding.

On CUDA each candidate is tried for real (`StepProbe`): one forward and backward of the training
loss at `[micro_batch, seq_len]` on random tokens, eager, with every gradient already allocated (as
in the second micro-batch of an accumulated step) and the AdamW state the first optimizer step will
allocate added as an estimate (`optimizer_state_bytes`), under `torch.cuda.max_memory_allocated`. A
candidate fits when that peak stays below the memory this process can have (free plus what PyTorch
already holds) less `MEMORY_MARGIN` of the card. Running out of memory is caught and the memory freed.
The probe leaves the weights, buffers (a keep bias moved by a forward), gradients and random number
generators as it found them, so it changes no loss and a resumed run stays bit-identical.

Candidates, largest first: the divisors of the per-rank sequences, halving down from all of them, then
bisecting between the last that failed and the first that fit (`largest_fitting`). A resumed run tries
its checkpoint's micro-batch first and keeps it where it fits (the same rounding as before). When not
even one sequence fits, activation checkpointing of every block turns on (`train.activation_checkpointing:
auto`, the default) and the search runs again; when that fails too, a one-line `NatslError` names the
fixes. On the CPU nothing is measured (a step there can take minutes): auto is the largest divisor of the
per-rank sequences up to `CPU_MICRO_BATCH`.

With `--compile` the probe still runs eagerly (compiling each candidate would cost minutes): the
compiled model runs the same custom ops, and Inductor's partitioner saves for the backward what eager
autograd saves or less (it recomputes cheap pointwise results instead of keeping them) and fuses
pointwise chains whose intermediates eager allocates, so the eager peak is expected to bound the compiled
one (`bash benchmarks/gpu.sh microbatch` with TRAIN_FLAGS=--compile measures the compiled peak at auto's
pick); the margin covers the allocator's fragmentation and the CUDA-graph pool's slack.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from natsl.errors import NatslError
from natsl.training import distributed as D

AUTO = "auto"
# The share of the card's memory a chosen micro-batch leaves unused: the allocator's fragmentation,
# the routes' data-dependent sizes, the compiled model's and the evaluation's own buffers.
MEMORY_MARGIN = 0.08
# auto on a device whose memory is not measured (the CPU): the largest divisor of the per-rank
# sequences up to this (the recipes' micro-batch before auto).
CPU_MICRO_BATCH = 8
GIB = 2**30


class MemoryProbe(Protocol):
    """How a micro-batch is tried: `StepProbe` on CUDA; tests pass a stand-in."""

    total_bytes: int  # the card's memory
    limit_bytes: int  # the most a step may use

    def peak_bytes(self, micro_batch: int, checkpointing: bool) -> Optional[int]:
        """The peak memory of one training micro-batch (optimizer state included), or None when it ran out."""


@dataclass
class Choice:
    """What auto picked, and the numbers behind it."""

    micro_batch: int
    accumulation: int
    checkpointing: bool
    seq_len: int
    peak_bytes: Optional[int] = None  # measured at the chosen micro-batch; None: nothing measured
    limit_bytes: Optional[int] = None
    total_bytes: Optional[int] = None
    device: str = "cpu"
    note: str = ""  # how it was picked, when not by the search

    def describe(self) -> str:
        """The one line `natsl train` prints."""
        head = (f"train.micro_batch_size auto: {self.micro_batch} x {self.seq_len} tokens, {self.accumulation} "
                f"accumulation step{'s' if self.accumulation != 1 else ''} per optimizer step")
        if self.peak_bytes is None:
            return f"{head} ({self.note})"
        ckpt = ", activation checkpointing on" if self.checkpointing else ""
        note = f"; {self.note}" if self.note else ""
        return (f"{head}{ckpt} (peak {self.peak_bytes / GIB:.1f} GiB measured, {self.limit_bytes / GIB:.1f} GiB "
                f"usable of {self.device}'s {self.total_bytes / GIB:.1f} GiB{note})")


def divisors(n: int) -> list[int]:
    """The divisors of n, largest first."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]), reverse=True)


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> Optional[int]:
    """The largest of `candidates` (largest first) for which `fits` holds, assuming that whatever fits,
    every smaller one fits too; None if none does. Halves from the top until one fits, then bisects
    between it and the last that failed, so few candidates run."""
    failed, at = -1, 0  # indices into candidates: the last that failed, the one to try
    while not fits(candidates[at]):
        failed = at
        if at == len(candidates) - 1:
            return None
        half = candidates[at] // 2
        at = next((i for i in range(at + 1, len(candidates)) if candidates[i] <= half), len(candidates) - 1)
    while at - failed > 1:  # every index between them is untried
        middle = (failed + at) // 2
        if fits(candidates[middle]):
            at = middle
        else:
            failed = middle
    return candidates[at]


def cpu_micro_batch(per_rank: int) -> int:
    """auto where memory is not measured: the largest divisor of the per-rank sequences up to CPU_MICRO_BATCH."""
    return next(d for d in divisors(per_rank) if d <= CPU_MICRO_BATCH)


def choose(per_rank: int, seq_len: int, probe: Optional[MemoryProbe], checkpointing: bool | str, *, prefer: Optional[int] = None,
           checkpointing_refused: str = "", device: str = "cpu", log: Callable[[str], None] = print) -> Choice:
    """Pick the micro-batch for `per_rank` sequences per rank and step.

    Args:
        per_rank: tokens_per_step / (seq_len x ranks).
        seq_len: tokens per sequence (for the messages).
        probe: how a micro-batch is tried; None (the CPU): no probe, `cpu_micro_batch`.
        checkpointing: train.activation_checkpointing (True, False or "auto").
        prefer: a resumed checkpoint's micro-batch, tried first and kept where it fits.
        checkpointing_refused: why checkpointing may not turn on ("" where it may).
        device: the device's name, for the messages.
        log: where the turn to activation checkpointing is said.

    Returns:
        The Choice. Raises NatslError (one line) when not even one sequence fits.
    """
    usable = prefer if prefer is not None and prefer >= 1 and per_rank % prefer == 0 else None
    if probe is None:
        micro = usable or cpu_micro_batch(per_rank)
        note = ("the checkpoint's micro-batch" if usable else
                f"nothing measured on {device}: the largest divisor of the step's {per_rank} sequences up to "
                f"{CPU_MICRO_BATCH}")
        return Choice(micro, per_rank // micro, checkpointing is True, seq_len, device=device, note=note)
    peaks: dict[tuple[int, bool], Optional[int]] = {}

    def fits(micro: int, ckpt: bool) -> bool:
        if (micro, ckpt) not in peaks:
            peaks[micro, ckpt] = probe.peak_bytes(micro, ckpt)
        peak = peaks[micro, ckpt]
        return peak is not None and peak <= probe.limit_bytes

    def search(ckpt: bool, note: str = "") -> Optional[Choice]:
        if usable is not None and fits(usable, ckpt):
            micro, note = usable, note or "the checkpoint's micro-batch"
        else:
            micro = largest_fitting(divisors(per_rank), lambda m: fits(m, ckpt))
        if micro is None:
            return None
        return Choice(micro, per_rank // micro, ckpt, seq_len, peaks[micro, ckpt], probe.limit_bytes,
                      probe.total_bytes, device, note)

    def need(ckpt: bool) -> str:
        one = peaks[1, ckpt]
        return f"needs {one / GIB:.1f} GiB" if one is not None else "runs out of memory"

    first = checkpointing is True
    choice = search(first)
    if choice is not None:
        return choice
    if checkpointing == AUTO and not checkpointing_refused:
        log(f"activation checkpointing on: one sequence of the step {need(False)} without it, more than the "
            f"{probe.limit_bytes / GIB:.1f} GiB usable on {device}; each block is recomputed in the backward "
            "(slower steps)")
        choice = search(True, "activation checkpointing turned on")
        if choice is not None:
            return choice
        why = f"{need(True)} even with activation checkpointing"
    elif checkpointing is False:
        why = f"{need(False)} (train.activation_checkpointing is false; auto or true recomputes the blocks)"
    elif checkpointing_refused:
        why = f"{need(False)} (activation checkpointing stays off: {checkpointing_refused})"
    else:
        why = f"{need(True)} with activation checkpointing"
    raise NatslError(f"micro-batch 1 x {seq_len} tokens {why}, more than the {probe.limit_bytes / GIB:.1f} "
                     f"GiB usable on {device} ({probe.total_bytes / GIB:.1f} GiB less a {MEMORY_MARGIN:.0%} margin); "
                     "lower train.seq_len, train a smaller model, or use a GPU with more memory")


def optimizer_state_bytes(model: torch.nn.Module) -> int:
    """AdamW's state, which the first optimizer step allocates: two tensors the size of each trainable parameter."""
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def is_out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory error, or cuBLAS / the CPU allocator failing to allocate (plain RuntimeErrors)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in text.lower() or "ALLOC_FAILED" in text
                                              or "can't allocate memory" in text)


@contextlib.contextmanager
def state_kept(model: torch.nn.Module, device: torch.device):
    """Run the body and leave the model's buffers, gradients, checkpointing flag and the random number
    generators as they were (a training forward may draw noise or move a keep bias)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    flag = getattr(model, "activation_checkpointing", False)
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        for name, p in model.named_parameters():
            p.grad = grads[name]
        model.activation_checkpointing = flag


class StepProbe:
    """`MemoryProbe` by one real training micro-batch on a CUDA device (see the module doc).

    Args:
        loss: the eager training loss module (`loss(inputs, targets)` -> scalar; the trainer's
            LanguageModelLoss around the unwrapped model, autocast included).
        model: the model whose parameters `loss` trains.
        seq_len: tokens per sequence.
        vocab_size: token ids are drawn below it.
        device: where it runs.
        memory: (total, free) bytes of the device; default torch.cuda.mem_get_info.
    """

    def __init__(self, loss: torch.nn.Module, model: torch.nn.Module, seq_len: int, vocab_size: int,
                 device: torch.device, memory: Optional[tuple[int, int]] = None):
        self.loss, self.model, self.seq_len, self.vocab_size, self.device = loss, model, seq_len, vocab_size, device
        self.extra_bytes = optimizer_state_bytes(model)
        if memory is None:
            free, total = torch.cuda.mem_get_info(device)
            memory = (total, free + torch.cuda.memory_reserved(device))
        self.total_bytes, available = memory
        self.limit_bytes = int(available - MEMORY_MARGIN * self.total_bytes)

    def run_step(self, micro_batch: int, checkpointing: bool) -> bool:
        """One forward and backward at [micro_batch, seq_len] with the gradients allocated first; False
        when it ran out of memory. The model's state is kept (state_kept) and the memory freed."""
        ran = False
        with state_kept(self.model, self.device):
            self.model.activation_checkpointing = checkpointing
            try:
                for p in self.model.parameters():  # as in an accumulated step's later micro-batches
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)
                generator = torch.Generator(self.device).manual_seed(0)
                tokens = torch.randint(0, self.vocab_size, (micro_batch, self.seq_len + 1), device=self.device,
                                       generator=generator)
                self.loss(tokens[:, :-1], tokens[:, 1:]).backward()
                ran = True
            except (torch.OutOfMemoryError, RuntimeError) as err:
                if not is_out_of_memory(err):
                    raise
            finally:
                tokens = None
        self.release()
        return ran

    def release(self) -> None:
        """Hand freed blocks back (what a failed try left is garbage once its frames are gone)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def peak_bytes(self, micro_batch: int, checkpointing: bool) -> Optional[int]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if not self.run_step(micro_batch, checkpointing):
            return None
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        return peak + self.extra_bytes


def device_probe(loss: torch.nn.Module, model: torch.nn.Module, seq_len: int, vocab_size: int,
                 device: torch.device) -> Optional[MemoryProbe]:
    """The probe for `device`: a StepProbe on CUDA, None elsewhere (auto then measures nothing)."""
    if device.type != "cuda":
        return None
    return StepProbe(loss, model, seq_len, vocab_size, device)


def agree(picks: list[tuple[int, bool]]) -> tuple[int, bool]:
    """One (micro-batch, checkpointing) from every rank's own: the smallest micro-batch (each is a divisor of
    the same per-rank count), with checkpointing where any rank needed it (the ranks run in lockstep)."""
    return min(m for m, _ in picks), any(c for _, c in picks)


def pick(per_rank: int, seq_len: int, probe: Optional[MemoryProbe], checkpointing: bool | str, info: D.DistInfo, *,
         checkpoint_state: Optional[dict] = None, checkpointing_refused: str = "",
         log: Callable[[str], None] = print) -> Choice:
    """`choose` on every rank, agreed: the smallest rank's micro-batch (each is a divisor of the same
    per-rank count), with checkpointing where any rank needed it; one rank's refusal stops them all.

    Args:
        per_rank, seq_len, probe, checkpointing, checkpointing_refused, log: as for `choose`.
        info: the ranks (natsl.training.distributed).
        checkpoint_state: a resumed checkpoint's trainer state, whose micro-batch is tried first when
            it ran on as many ranks.

    Returns:
        The Choice every rank trains with.
    """
    device = info.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    state = checkpoint_state or {}
    prefer = state.get("micro_batch_size") if state.get("world_size") == info.world_size else None
    choice, error = None, None
    try:
        choice = choose(per_rank, seq_len, probe, checkpointing, prefer=prefer if type(prefer) is int else None,
                        checkpointing_refused=checkpointing_refused, device=name, log=log)
    except NatslError as err:
        error = str(err)
    errors = [e for e in D.gather_objects(error, info) if e]
    if errors:
        raise NatslError(errors[0])
    micro, ckpt = agree(D.gather_objects((choice.micro_batch, choice.checkpointing), info))
    if (micro, ckpt) != (choice.micro_batch, choice.checkpointing):
        choice = Choice(micro, per_rank // micro, ckpt, seq_len, device=name, note="the smallest of the ranks' picks")
    if device.type == "cuda":  # what is read next (a benchmark's peak) is the training's, not the probe's
        torch.cuda.reset_peak_memory_stats(device)
    return choice
