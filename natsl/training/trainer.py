"""The training loop behind `natsl train`: one process or N torchrun ranks, resumable step for step.

Per optimizer step: `accum` micro-batches of `micro_batch_size x seq_len` tokens on each of `world`
ranks make `tokens_per_step`; the loss is the mean token cross-entropy (fp32), bf16 autocast on
GPUs, computed from the final hidden states by chunks of tokens (natsl.training.loss: the full
[tokens, vocab] logits never exist); gradients are clipped; the learning rate follows
`optim.lr_at(tokens seen)`. A step whose loss or gradient norm is not finite is skipped
(counted); `max_bad_steps` of them in a row stop the run. On the CPU with a fixed seed the run is
deterministic, and a run resumed from a checkpoint reproduces the uninterrupted run's losses
exactly (the data position is one integer, see natsl.data.dataset).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import yaml

from natsl import __version__, interrupts, switches
from natsl import checkpoint as C
from natsl.config import Recipe, run_folder
from natsl.errors import NatslError
from natsl.fast import op_check
from natsl.data.tasks import IGNORE, TaskData, answer_hits, is_task
from natsl.atomic import write_text as atomic_write_text
from natsl.files import read_json
from natsl.outputs import check_output, check_output_folder
from natsl.training import distributed as D
from natsl.training import micro_batch as M
from natsl.training import state as S
from natsl.training.faults import fault_point
from natsl.training.flops import flops_per_token, peak_flops
from natsl.training.loss import DEFAULT_CHUNK, linear_cross_entropy
from natsl.training.tracking import metrics_log
from natsl.training.optim import (build_optimizer, clip_and_step, fold_clip_requested, lr_at, no_decay_names,
                                  set_lr)


@dataclass
class TrainOptions:
    out_dir: Optional[str] = None  # default: recipe.train.out_dir with {name}
    resume: str = "auto"  # auto | never | a step folder
    device: Optional[str] = None  # default: cuda if there is one
    backend: Optional[str] = None  # default: fast on CUDA, chunked on the CPU
    compile: Optional[bool] = None  # default: recipe.train.compile
    max_steps: Optional[int] = None  # default: recipe.train.max_steps; an absolute step number
    threads: Optional[int] = None  # CPU threads (default: OMP_NUM_THREADS, else 1; natsl.runtime.cpu_threads)
    save_final: bool = True  # write a checkpoint at the last step (benchmarks turn it off)
    loss_chunk: int = DEFAULT_CHUNK  # tokens per chunk of logits in the loss; 0: the full logits (for checks)
    progress: bool = True
    log: Callable[[str], None] = print
    # called on every rank with each step's metrics record, right after the step (whose GPU work is then
    # done: the record's loss was read back); benchmarks hang their meters on it. Returning True ends the
    # run after this step with a checkpoint, as SIGTERM would (the sweep's workers stop at their budget so).
    on_step: Optional[Callable[[dict], Optional[bool]]] = None
    # called with the signal's name when SIGINT / SIGTERM arrives during training (the run then ends after
    # the current step): tells a caller that someone asked it to stop
    on_signal: Optional[Callable[[str], None]] = None
    # train.micro_batch_size auto: how a micro-batch is tried (natsl.training.micro_batch.MemoryProbe);
    # default a real step on CUDA and nothing on the CPU. Tests pass a stand-in.
    memory_probe: Optional[M.MemoryProbe] = None


@dataclass
class TrainResult:
    out_dir: Path
    step: int
    end_step: int
    loss: Optional[float]
    val_loss: Optional[float]
    checkpoint: Optional[Path]
    tokens_per_s: Optional[float]
    resumed_from: Optional[Path] = None
    skipped_steps: int = 0
    history: list = field(default_factory=list)
    micro_batch: Optional[int] = None  # the micro-batch the steps ran at (train.micro_batch_size, or auto's pick)
    accumulation: Optional[int] = None
    micro_batch_choice: Optional[M.Choice] = None  # auto's pick and its measurement; None for a fixed one


def train(recipe: Recipe, options: TrainOptions) -> TrainResult:
    """Run (or continue) the training a recipe describes; see the module doc."""
    from natsl.runtime import pick_device, set_cpu_threads

    # NATSL_CHECK_OPS=1: every fast kernel call checked for non-finite values (natsl/fast/op_check.py)
    op_check.install_from_env(options.log)
    info = D.setup(pick_device(options.device))
    threads = set_cpu_threads(options.threads, info.device)
    try:
        return Trainer(recipe, options, info, threads).run()
    finally:
        D.teardown()


def graphs_beside_op_check(graphs: bool, log) -> bool:
    """CUDA graphs off while NATSL_CHECK_OPS checks the ops: a replay launches the recorded kernels without
    running any Python, so no call could be checked, and a check's synchronisation would break the capture."""
    if graphs and op_check.installed() is not None:
        log(f"{op_check.ENV}: CUDA graphs off (a graph replay runs no Python: its kernels could not be checked); "
            "the compiled model runs as is")
        return False
    return graphs


def missing_data(recipe: Recipe) -> NatslError:
    """The one line for a `data.path` that does not exist: the command lines that make it, or that train
    on the embedded corpus instead, ready to paste."""
    import shlex

    data = recipe.data
    if data.tokenizer:
        tokenizer = f"--tokenizer {shlex.quote(data.tokenizer)}"
    elif recipe.model.vocab_size == 32000:  # the paper's Llama-2 tokenizer (docs/training.md, "The paper's tokenizer")
        tokenizer = "--tokenizer tokenizers/llama-2"
    else:
        tokenizer = f"--train-tokenizer --vocab-size {recipe.model.vocab_size}"
    return NatslError(f"data.path {data.path!r} does not exist: make it with `natsl tokenize YOUR_TEXT_FILES... --out "
                      f"{shlex.quote(data.path)} {tokenizer}` (docs/training.md), or add `--set data.path=builtin` "
                      "for a smoke run on the embedded corpus")


def check_before_work(recipe: Recipe, options: TrainOptions, recipe_file=None) -> None:
    """The checks of a run's input that need no model, data or checkpoint read, for `natsl train` to make
    before it prints its estimate: bad input then gets its one line alone (the estimate's lines depend on how
    fast this machine is now). The trainer makes the same checks again, for callers of `train`.

    Raises:
        NatslError: windows longer than model.max_seq_len, CUDA graphs without compile, --resume never onto
            a folder with checkpoints, a --resume folder that is not there, or a run folder that is, holds or lies
            inside what the run reads (`recipe_file`, train.init_from, the data folder): the run would write
            recipe.yaml, checkpoints and metrics over or among them.
    """
    check_window(recipe)
    data = None if recipe.data.path == "builtin" or is_task(recipe.data.path) else recipe.data.path
    check_output(out_folder(recipe, options), [recipe_file, recipe.train.init_from, data], "--out")
    compiled = options.compile if options.compile is not None else recipe.train.compile
    cuda_graphs_wanted(recipe.train.cuda_graphs, compiled, int(os.environ.get("WORLD_SIZE", "1")),
                       torch.device("cpu"))
    if options.resume == "never":
        out = out_folder(recipe, options)
        existing = S.list_checkpoints(out)
        if existing:
            raise onto_checkpoints(out, existing)
    elif options.resume != "auto" and not Path(options.resume).is_dir():
        raise S.missing_checkpoint(options.resume)
    elif options.resume != "auto" and (Path(options.resume) / S.STATE_FILE).is_file():
        # its counters before the estimate (the whole folder is read and hashed when the run loads it)
        S.check_trainer_state(read_json(Path(options.resume) / S.STATE_FILE, "the checkpoint is corrupt: use "
                                        "another one"), Path(options.resume) / S.STATE_FILE)


def check_window(recipe: Recipe) -> None:
    """Generation and the decode cache stop at max_seq_len: no model is trained on longer windows. (Checked
    when a run starts, not when a recipe loads: an inference checkpoint may carry a longer train section.)"""
    if recipe.train.seq_len > recipe.model.max_seq_len:
        raise NatslError(f"recipe key 'train.seq_len' = {recipe.train.seq_len} is more than model.max_seq_len = "
                         f"{recipe.model.max_seq_len}; lower train.seq_len or raise model.max_seq_len")


def onto_checkpoints(out: Path, existing) -> NatslError:
    """--resume never onto a run folder that has checkpoints: the one line."""
    return NatslError(f"{str(out)!r} already holds checkpoints (newest: {existing[-1][1].name}); "
                      "continue with --resume auto, or pass another --out")


def out_folder(recipe: Recipe, options: TrainOptions) -> Path:
    """The run folder: --out, else train.out_dir with the recipe's name, inside runs/."""
    if options.out_dir:
        return Path(options.out_dir)
    return run_folder(recipe)  # inside runs/, whatever the recipe's name and train.out_dir say


@contextlib.contextmanager
def stop_signals(enabled: bool, notify: Optional[Callable[[str], None]] = None):
    """Ctrl-C / SIGTERM (e.g. a scheduler's preemption) end the run after the current step, with a checkpoint.

    Yields {"signal": None or its name}; the loop checks it between steps, so the saved state is
    always that of a whole step. A second signal interrupts at once. Only for one-process runs
    (ranks of a torchrun job would see the signal at different steps). `notify(name)` is told of each signal.
    """
    flag = {"signal": None}
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if notify is not None:
            notify(signal.Signals(signum).name)
        if flag["signal"] is not None:
            raise KeyboardInterrupt
        flag["signal"] = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def run_lock(out: Path, enabled: bool):
    """One `natsl train` per output folder: an advisory lock on OUT/.train.lock, released when the
    process dies, and the file removed when the run ends (done, failed or interrupted; only a killed
    process leaves it, harmlessly: nobody holds its lock).

    Removing a lock file races with a run that opened it just before: that run would lock the removed
    file while a third locks a new one. So a run that gets the lock checks that the path still names
    the file it locked, and tries again otherwise."""
    if not enabled:
        yield
        return
    import fcntl

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".train.lock"
    while True:
        fh = open(lock, "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise NatslError(f"another `natsl train` is writing to {str(out)!r}; wait for it or pass another "
                             "--out") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fh.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        fh.close()  # the run before removed it after we opened it: lock the new file
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # while still holding the lock (see above)
        fh.close()
        # Bad input found after the lock (the data, a --resume checkpoint): leave no trace of a folder
        # this run made and wrote nothing into.
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()


# Models up to this many non-embedding parameters train compiled with CUDA-graphed steps by default
# (auto_compile): their steps are many small kernels whose launches the host cannot keep up with;
# the 800M recipes gained nothing from graphs (docs/training.md).
AUTO_COMPILE_MAX_PARAMS = 100_000_000


def auto_compile(model, ranks: int, device: torch.device) -> bool:
    """Whether a run that asks for neither compile nor CUDA graphs (recipe keys false, no --compile /
    --no-compile) gets both: one CUDA device, a model of at most AUTO_COMPILE_MAX_PARAMS parameters
    outside the embeddings and the head, and the switch train_auto_compile on (NATSL_TRAIN_AUTO_COMPILE=0
    turns the rule off)."""
    if not switches.current().train_auto_compile or device.type != "cuda" or ranks > 1:
        return False
    body = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("embed.", "lm_head.")))
    return body <= AUTO_COMPILE_MAX_PARAMS


def cuda_graphs_wanted(requested: bool, compiled: bool, ranks: int, device: torch.device) -> bool:
    """Whether the compiled body replays as CUDA graphs: train.cuda_graphs, checked against the rest."""
    if not requested:
        return False
    if not compiled:
        raise NatslError("train.cuda_graphs replays the compiled model: set train.compile=true or pass --compile")
    if ranks > 1:  # DDP's and FSDP's collectives between graphs: not tested (no two-GPU machine lent)
        raise NatslError(f"train.cuda_graphs is for one GPU and this run has {ranks} ranks; set "
                         "train.cuda_graphs=false")
    return device.type == "cuda"  # on the CPU there is nothing to replay: plain compiled code


class HiddenStates(torch.nn.Module):
    """`model.hidden_states` as a module's forward, so that torch.compile wraps it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, rope=None) -> torch.Tensor:
        return self.model.hidden_states(input_ids, rope)


class LanguageModelLoss(torch.nn.Module):
    """The token cross-entropy of a batch as one module's forward, which DDP or FSDP2 wraps: the
    hidden states (under bf16 autocast when `bf16`; `body` may be their compiled form) and the head
    by chunks of rows (natsl.training.loss, no full logits; the head's matmul in bf16 under bf16).
    The head runs inside the forward because FSDP2 gathers the root's sharded weights (embeddings,
    final norm, head) only there. Its parameters are the model's."""

    def __init__(self, model: torch.nn.Module, body, bf16: bool, chunk_size: int):
        super().__init__()
        self.model = model
        self.__dict__["body"] = body  # not a submodule: its parameters are already the model's
        self.bf16, self.chunk_size = bf16, chunk_size

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        # RoPE's angles made here, outside a compiled body (natsl.models.rope.RopeTable says why)
        rope = self.model.rope_table(input_ids.shape[1], input_ids.device)
        with autocast:
            hidden = self.body(input_ids, rope)
        loss = linear_cross_entropy(hidden, self.model.lm_head.weight, targets, chunk_size=self.chunk_size,
                                    reduction=reduction, compute_dtype=torch.bfloat16 if self.bf16 else None)
        if self.training:  # the routers' balance losses (model.router_balance > 0), part of the logged loss
            for layer in self.model.natsl_layers().values():
                if layer.aux_loss is not None:
                    loss = loss + layer.aux_loss
        return loss


class Trainer:
    def __init__(self, recipe: Recipe, options: TrainOptions, info: D.DistInfo, threads: str = ""):
        self.recipe, self.options, self.info = recipe, options, info
        self.threads = threads  # the CPU thread count and why, for the start line (natsl.runtime.set_cpu_threads)
        self.log = options.log if info.is_main else (lambda *_: None)
        self.device = info.device

    # ------------------------------------------------------------------------- setup

    def plan(self) -> None:
        tc = self.recipe.train
        # A recipe built in Python (dataclasses.replace) has not met the loader's rules.
        tc.validate()
        self.recipe.optim.validate()
        # micro_batch_size auto: both are picked on the device (pick_micro_batch), after the model is built
        self.accum = tc.accumulation(self.info.world_size)
        self.micro_batch = None if tc.micro_batch_size == M.AUTO else tc.micro_batch_size
        self.micro_batch_choice = None
        self.samples_per_step = tc.tokens_per_step // tc.seq_len
        self.total_steps = tc.total_tokens // tc.tokens_per_step
        if self.total_steps < 1:
            raise NatslError(f"train.total_tokens = {tc.total_tokens} is less than one step of "
                             f"train.tokens_per_step = {tc.tokens_per_step}")
        max_steps = self.options.max_steps if self.options.max_steps is not None else tc.max_steps
        if max_steps is not None and max_steps < 1:
            raise NatslError(f"--max-steps must be at least 1, got {max_steps}")
        self.end_step = min(self.total_steps, max_steps) if max_steps is not None else self.total_steps
        check_window(self.recipe)

    def choose_checkpoint(self) -> Optional[S.LoadedCheckpoint]:
        """Rank 0 picks (and loads) the checkpoint to continue from; the other ranks load the same one."""
        resume, out = self.options.resume, self.out
        chosen, error = None, None
        if self.info.is_main:
            try:
                S.remove_partial_writes(out, self.log)
                existing = S.list_checkpoints(out)
                if resume == "never":
                    if existing:
                        raise onto_checkpoints(out, existing)
                elif resume == "auto":
                    for _, path in reversed(existing):
                        try:
                            chosen = S.load_training_checkpoint(path)
                            break
                        except NatslError as err:
                            self.log(f"skipping checkpoint {path.name}: {err}")
                    if existing and chosen is None:  # starting over would prune them: refuse, lose nothing
                        raise NatslError(f"every checkpoint in {str(out)!r} is damaged (newest: "
                                         f"{existing[-1][1].name}); repair or remove them, or pass another --out")
                else:
                    given = Path(resume)
                    inside = S.list_checkpoints(given.parent if given.name == S.CHECKPOINTS else given)
                    if not (given / S.MANIFEST_FILE).exists() and inside:
                        chosen = S.load_training_checkpoint(inside[-1][1])  # a run folder: its newest step
                    else:
                        chosen = S.load_training_checkpoint(given)
            except NatslError as err:
                error = str(err)
        path, error = D.broadcast_object((str(chosen.folder) if chosen else None, error), self.info)
        if error:
            raise NatslError(error)
        if path and chosen is None:
            chosen = S.load_training_checkpoint(Path(path))
        return chosen

    def check_compatible(self, ckpt: S.LoadedCheckpoint) -> None:
        old, new = ckpt.recipe, self.recipe
        if old.model != new.model:
            diff = [k for k in vars(new.model) if getattr(old.model, k) != getattr(new.model, k)]
            raise NatslError(f"checkpoint {ckpt.folder.name} was trained with another model (model.{diff[0]} differs); "
                             "resume with the same recipe, or pass another --out / --resume never")
        if ckpt.trainer_state.get("seq_len", new.train.seq_len) != new.train.seq_len:
            raise NatslError(f"train.seq_len changed from {ckpt.trainer_state['seq_len']} to {new.train.seq_len} since "
                             f"checkpoint {ckpt.folder.name}; the data position would not carry over")

    def open_data(self) -> None:
        from natsl.data.builtin import builtin_data
        from natsl.data.dataset import TokenData, WindowSampler, eval_windows

        r = self.recipe
        if is_task(r.data.path):  # a synthetic recall task, made on the device (natsl.data.tasks)
            self.data = self.sampler = TaskData(r.data.path, r.model.vocab_size, r.train.seq_len, r.train.seed,
                                                self.device)
            self.tokenizer, self.val_stream = None, None
            self.val_windows = max(1, r.train.eval_tokens // r.train.seq_len)
            return
        if r.data.path == "builtin":
            if self.info.is_main:
                folder = builtin_data(r.model.vocab_size, r.data.tokenizer, self.options.progress, self.log, r.data.bos)
            D.barrier(self.info)
            if not self.info.is_main:
                folder = builtin_data(r.model.vocab_size, r.data.tokenizer, False, lambda *_: None, r.data.bos)
        else:
            folder = Path(r.data.path)
            if not folder.exists():
                raise missing_data(r)
        data = TokenData(folder)
        if data.vocab_size > r.model.vocab_size:
            raise NatslError(f"the data's tokenizer has {data.vocab_size} tokens but model.vocab_size is "
                             f"{r.model.vocab_size}; set model.vocab_size to at least {data.vocab_size}")
        self.tokenizer = data.tokenizer()
        if r.data.tokenizer and r.data.path != "builtin":
            from natsl.tokenizer import Tokenizer

            if Tokenizer.from_file(r.data.tokenizer).sha256() != data.meta["tokenizer_sha256"]:
                raise NatslError(f"data.tokenizer {r.data.tokenizer!r} is not the tokenizer {str(folder)!r} was "
                                 "tokenized with; drop data.tokenizer or tokenize again")
        self.data = data
        self.sampler = WindowSampler(data.split("train"), r.train.seq_len, r.train.seed)
        self.val_stream = data.split("validation")
        self.val_windows = eval_windows(self.val_stream, r.train.seq_len, r.train.eval_tokens)
        if self.val_windows == 0:  # said once, not silently skipped at every eval_every
            self.log(f"no validation: the validation split of {str(data.folder)!r} holds fewer than train.seq_len + 1 "
                     f"= {r.train.seq_len + 1} tokens (tokenize with a larger --val-fraction to get one)")

    def build(self, ckpt: Optional[S.LoadedCheckpoint]) -> None:
        from natsl.runtime import pick_backend
        from natsl.models import build_model

        r = self.recipe
        torch.manual_seed(r.train.seed)
        model = build_model(r, device=self.device)
        self.backend = pick_backend(self.options.backend, self.device)
        model.set_backend(self.backend)
        model.activation_checkpointing = r.train.activation_checkpointing is True
        model.train()
        self.model = model
        self.state = {"step": 0, "tokens_seen": 0, "samples_seen": 0, "bad_steps": 0, "bad_in_row": 0,
                      "elapsed_s": 0.0}
        if ckpt is not None:  # full tensors, before any sharding
            missing, unexpected = model.load_state_dict(ckpt.model_state, strict=False)
            missing = [m for m in missing if not (r.model.tie_embeddings and m == "lm_head.weight")]
            if missing or unexpected:
                raise NatslError(f"checkpoint {ckpt.folder.name} does not match the model (missing {missing[:2]}, "
                                 f"unexpected {unexpected[:2]})")
            if r.train.init_from:
                self.log(f"train.init_from not read: the run continues from its own checkpoint {ckpt.folder.name}")
        elif r.train.init_from:
            self.init_weights(model, r.train.init_from)
        if self.options.loss_chunk < 0:
            raise NatslError(f"loss_chunk must be at least 0, got {self.options.loss_chunk}")
        self.use_bf16 = self.device.type == "cuda" and r.train.dtype == "bf16"
        if self.micro_batch is None:  # before compiling and wrapping: the probe runs the plain model
            self.pick_micro_batch(ckpt)
        compile_ = self.options.compile if self.options.compile is not None else r.train.compile
        graphs_requested = r.train.cuda_graphs
        if self.options.compile is None and not compile_ and not graphs_requested \
                and auto_compile(model, self.info.world_size, self.device):
            compile_ = graphs_requested = True
            self.log("a small model on one GPU: compiled, CUDA-graphed steps (--no-compile or "
                     "NATSL_TRAIN_AUTO_COMPILE=0 trains eagerly)")
        graphs = cuda_graphs_wanted(graphs_requested, compile_, self.info.world_size, self.device)
        if r.train.cuda_graphs and not graphs:
            self.log(f"train.cuda_graphs: nothing to replay on {self.device.type}; the compiled model runs as is")
        graphs = graphs_beside_op_check(graphs, self.log)
        body = HiddenStates(model)
        if compile_:
            body = torch.compile(body, mode="reduce-overhead" if graphs else None)
        self.loss_module = LanguageModelLoss(model, body, self.use_bf16, self.options.loss_chunk)
        plain = no_decay_names(model)  # FSDP's sharded parameters lose the no-decay mark
        self.train_model = D.wrap(self.loss_module, self.info, r.train.parallel, blocks=model.layers)
        self.sharded = self.info.enabled and r.train.parallel == "fsdp"
        # A replayed backward writes its gradients into the graph's own memory, which the next replay
        # overwrites: autograd would hand that memory to .grad on a first micro-batch and add the
        # second one onto it (torch issue 169545). With accumulation the gradients are therefore kept
        # allocated, zeroed between steps, so that every micro-batch adds into them.
        self.keep_grads = graphs and self.accum > 1
        # on CUDA (NATSL_FOLD_CLIP decides): the fused AdamW clips and skips non-finite steps itself
        self.fold_clip = fold_clip_requested(self.device) and not self.sharded
        self.optimizer = build_optimizer(model, r.optim, self.device, plain, self.sharded,  # on the parameters as wrapped
                                         fused=True if self.fold_clip else None)
        if self.keep_grads:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        self.names = {id(p): n for n, p in model.named_parameters()}
        if ckpt is not None:
            params = dict(model.named_parameters())
            S.optimizer_from_tensors(self.optimizer, self.names, ckpt.optimizer_tensors,
                                     ckpt.trainer_state["optimizer_groups"], ckpt.folder.name,
                                     place=lambda name, t: D.shard_like(params[name], t) if t.dim() else t)
            S.restore_rng(ckpt.rng, self.info.rank, self.device)
            for key in self.state:
                self.state[key] = ckpt.trainer_state.get(key, self.state[key])
        self.natsl_layers = list(model.natsl_layers().items())
        self.n_params = model.num_parameters()
        self.peak = peak_flops(self.device)

    def pick_micro_batch(self, ckpt: Optional[S.LoadedCheckpoint]) -> None:
        """train.micro_batch_size auto: the largest micro-batch that fits (natsl.training.micro_batch), the
        same on every rank; sets micro_batch, accum and the model's activation checkpointing, and says so."""
        tc, model = self.recipe.train, self.model
        per_rank = tc.tokens_per_step // (tc.seq_len * self.info.world_size)
        probe = self.options.memory_probe
        if probe is None:
            eager = LanguageModelLoss(model, HiddenStates(model), self.use_bf16, self.options.loss_chunk)
            probe = M.device_probe(eager, model, tc.seq_len, self.recipe.model.vocab_size, self.device)
        refused = "model.router_keep_target is set (a recomputed block would route on the bias its forward " \
            "already moved)" if self.recipe.model.router_keep_target is not None else ""
        choice = M.pick(per_rank, tc.seq_len, probe, tc.activation_checkpointing, self.info,
                        checkpoint_state=ckpt.trainer_state if ckpt is not None else None,
                        checkpointing_refused=refused, log=self.log)
        model.activation_checkpointing = choice.checkpointing
        self.micro_batch, self.accum, self.micro_batch_choice = choice.micro_batch, choice.accumulation, choice
        self.log(choice.describe())

    def init_weights(self, model: torch.nn.Module, path: str) -> None:
        """train.init_from: the weights of another run, before any sharding; optimizer and step start afresh."""
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        state, folder, differing = C.initial_weights(path, self.recipe.model, expected)
        # every name and shape checked above; the copy casts a bf16 inference folder to the model's dtype
        model.load_state_dict(state, strict=False)
        changed = f"; model fields changed from it: {', '.join(differing)}" if differing else ""
        self.log(f"initialised from {folder}{changed}")

    # ------------------------------------------------------------------------- steps

    def train_step(self, step_samples: list[list[int]]) -> torch.Tensor:
        """Forward/backward every micro-batch, all-reduce; returns the stats [loss, then the keep
        fraction of each routing group of each NAtS-L layer] on the device."""
        stats = torch.zeros(1 + sum(layer.num_heads for _, layer in self.natsl_layers), dtype=torch.float64,
                            device=self.device)
        for m, indices in enumerate(step_samples):
            batch = self.sampler.batch(indices)
            if isinstance(batch, tuple):  # a task: (inputs, targets with -100 off the answers)
                inputs, targets = batch
            else:
                batch = batch.to(self.device, non_blocking=True)
                inputs, targets = batch[:, :-1], batch[:, 1:]
            with D.no_sync(self.train_model, m < self.accum - 1):
                loss = self.train_model(inputs, targets)
                (loss / self.accum).backward()
            stats[0] += loss.detach().double()
            at = 1
            for _, layer in self.natsl_layers:
                if layer.last_keep is not None:  # [B, NB, H]: the mean per routing group
                    stats[at:at + layer.num_heads] += layer.last_keep.double().mean(dim=(0, 1))
                at += layer.num_heads
        D.all_reduce_sum(stats, self.info)
        stats /= self.accum * self.info.world_size
        return stats

    def optimizer_step(self, samples: list[list[int]]) -> dict:
        """One optimizer step on these samples (skipped if not finite); advances the state; its metrics record."""
        r, tc = self.recipe, self.recipe.train
        t0 = time.perf_counter()
        lr = lr_at(self.state["tokens_seen"], r.optim, tc.total_tokens)
        set_lr(self.optimizer, lr)
        stats = self.train_step(samples)
        # clipped, and stepped only if the loss and the norm are finite (FSDP: the norm gathered)
        grad_norm = clip_and_step(self.optimizer, self.model.parameters(), r.optim.grad_clip, stats[0],
                                  self.fold_clip, D.full_tensor)
        values, grad_norm = stats.tolist(), float(grad_norm)
        loss, groups = values[0], values[1:]
        keep_groups, at = {}, 0
        for i, layer in self.natsl_layers:
            keep_groups[str(i)] = groups[at:at + layer.num_heads]
            at += layer.num_heads
        keep = [sum(g) / len(g) for g in keep_groups.values()]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        nonfinite = {}
        if finite:
            self.state["bad_in_row"] = 0
        else:
            self.state["bad_steps"] += 1
            self.state["bad_in_row"] += 1
            nonfinite = {"nonfinite_grads": self.nonfinite_grads()}
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.state["step"] += 1
        self.state["samples_seen"] += self.samples_per_step
        self.state["tokens_seen"] += tc.tokens_per_step
        self.state["elapsed_s"] += dt
        self.state["last_loss"] = loss if finite else None
        tokens_per_s = tc.tokens_per_step / dt
        fpt = flops_per_token(r.model, tc.seq_len, sum(keep) / len(keep) if keep else 1.0, self.n_params)
        return {"step": self.state["step"], "tokens": self.state["tokens_seen"], "loss": loss, "lr": lr,
                "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                "mfu": tokens_per_s * fpt / (self.peak * self.info.world_size) if self.peak else None,
                "keep": {str(i): k for (i, _), k in zip(self.natsl_layers, keep)}, "keep_groups": keep_groups,
                **self.router_bias_record(), **nonfinite, "skipped": not finite,
                "bad_steps": self.state["bad_steps"], "time_s": dt, "flops_per_token": fpt}

    def nonfinite_grads(self, limit: int = 8) -> list[str]:
        """Names of the first `limit` parameters whose gradient (this rank's shard) holds a NaN or an
        infinity, in the model's order: a skipped step's record says where a non-finite gradient
        starts, which the loss and the norm alone do not. Called only on skipped steps (one host sync
        per parameter)."""
        names = []
        for name, param in self.model.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: this rank's shard
            if not bool(torch.isfinite(grad).all()):
                names.append(name)
                if len(names) == limit:
                    break
        return names

    def router_bias_record(self) -> dict:
        """{"router_bias": {layer: [bias per routing group]}} after this step's forwards, for the NAtS-L
        layers with a keep bias (model.router_keep_target; this rank's copy); {} without one."""
        biases = {str(i): layer.router_keep_bias.tolist() for i, layer in self.natsl_layers
                  if layer.router_keep_bias is not None}
        return {"router_bias": biases} if biases else {}

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        if self.val_windows == 0:
            return None
        if isinstance(self.data, TaskData):
            return self.evaluate_task()
        seq, mbs, world = self.recipe.train.seq_len, self.micro_batch, self.info.world_size
        mine = list(range(self.info.rank, self.val_windows, world))
        # FSDP gathers each block's weights inside the forward, a collective: every rank must run as
        # many forwards as the busiest one. A rank out of windows runs window 0 again, uncounted.
        per_rank = -(-self.val_windows // world) if self.sharded else len(mine)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.loss_module.eval()
        try:
            for start in range(0, per_rank, mbs):
                windows = mine[start:start + mbs]
                rows = [self.val_stream.read(w * seq, seq + 1) for w in windows or [0]]
                batch = torch.from_numpy(np.stack(rows)).to(self.device)
                loss = self.train_model(batch[:, :-1], batch[:, 1:], reduction="sum").double()
                if windows:
                    totals[0] += loss
                    totals[1] += batch[:, 1:].numel()
        finally:
            self.loss_module.train()
        D.all_reduce_sum(totals, self.info)
        return (totals[0] / totals[1]).item()

    @torch.no_grad()
    def evaluate_task(self) -> float:
        """Loss over the answers of held-out task samples; the answer accuracy goes to
        self.task_accuracy (one process: the sweep's runs; under several ranks it is left None)."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        hits, counted = 0, 0
        self.loss_module.eval()
        try:
            for inputs, targets in self.data.eval_batches(self.val_windows, self.micro_batch):
                totals[0] += self.train_model(inputs, targets, reduction="sum").double()
                totals[1] += (targets != IGNORE).sum()
                if not self.info.enabled:
                    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.use_bf16 \
                        else contextlib.nullcontext()
                    with autocast:
                        hidden = self.model.hidden_states(inputs)
                    h, c = answer_hits(hidden, self.model.lm_head.weight, targets)
                    hits, counted = hits + h, counted + c
        finally:
            self.loss_module.train()
        D.all_reduce_sum(totals, self.info)
        self.task_accuracy = hits / counted if counted else None
        return (totals[0] / totals[1].clamp(min=1)).item()

    def save(self, step: int) -> Path:
        rng = D.gather_objects(S.capture_rng(self.device), self.info)
        path = None
        # FSDP: every rank takes part in gathering the full tensors; DDP: rank 0's replica is whole.
        if self.sharded or self.info.is_main:
            model_state = D.full_tensors(self.model.state_dict())
            optimizer_state = S.optimizer_to_tensors(self.optimizer, self.names, gather=D.full_tensor)
        error = None
        if self.info.is_main:
            tc = self.recipe.train
            trainer_state = {**self.state, "seq_len": tc.seq_len, "tokens_per_step": tc.tokens_per_step,
                             "micro_batch_size": self.micro_batch, "world_size": self.info.world_size,
                             "seed": tc.seed, "data": str(self.data.folder),
                             "data_fingerprint": self.data.meta.get("fingerprint"), "natsl_version": __version__}
            try:
                path = S.save_checkpoint(self.out, step, model_state, optimizer_state, self.recipe, self.tokenizer,
                                         trainer_state, S.rng_tensors(rng), tc.keep_last)
            except NatslError as err:  # e.g. non-finite weights: every rank stops with the same message
                error = str(err)
            else:
                self.metrics.plot(self.out / "metrics.png", title=f"{self.recipe.name} ({self.out})")
        error = D.broadcast_object(error, self.info)
        if error:
            raise NatslError(error)
        D.barrier(self.info)
        return path

    def _data_size(self) -> str:
        if isinstance(self.data, TaskData):
            return "generated on the fly"
        return f"{self.sampler.stream.n_tokens:,} train tokens"

    # ------------------------------------------------------------------------- the loop

    def run(self) -> TrainResult:
        self.plan()
        self.out = out_folder(self.recipe, self.options)
        check_output_folder(self.out, "--out")
        with run_lock(self.out, self.info.is_main):
            return self._run()

    def _run(self) -> TrainResult:
        from tqdm import tqdm

        from natsl.data.dataset import check_resumed_data, step_sample_indices

        r, tc, info = self.recipe, self.recipe.train, self.info
        ckpt = self.choose_checkpoint()
        if ckpt is not None:
            self.check_compatible(ckpt)
        self.open_data()
        if ckpt is not None:
            check_resumed_data(ckpt.trainer_state, self.data.meta, self.data.folder, ckpt.folder)
        self.build(ckpt)
        self.metrics = metrics_log(self.out / "metrics.jsonl", tc.tracker if info.is_main else "none", self.out, r)
        start = self.state["step"]
        if info.is_main:
            aside = S.set_aside_later(self.out, start)
            if aside is not None:
                self.log(f"branching at step {start}: the later checkpoints and their metrics moved to {aside} "
                         "(--resume auto now continues this branch)")
            self.metrics.truncate(start)
            atomic_write_text(self.out / "recipe.yaml", yaml.safe_dump(r.to_dict(), sort_keys=False))
        if ckpt is not None:
            self.log(f"resuming from {ckpt.folder} (step {start}, {self.state['tokens_seen']:,} tokens seen)")
        if self.device.type == "cpu" and tc.dtype == "bf16":
            self.log("note: train.dtype bf16 means bf16 autocast on GPUs; the CPU trains in fp32")
        world = info.world_size
        self.log(f"{r.name}: {self.n_params / 1e6:.2f}M parameters; steps {start} -> {self.end_step} of "
                 f"{self.total_steps}, {tc.tokens_per_step:,} tokens each ({self.micro_batch} x {tc.seq_len} x "
                 f"{self.accum} accum x {world} rank{'s' if world > 1 else ''}"
                 f"{', ' + tc.parallel if world > 1 else ''}); {self.device.type}{', ' + self.threads if self.threads else ''}, backend "
                  f"{self.backend}; data {self.data.folder} ({self._data_size()}); out {self.out}")
        debug_dir = os.environ.get("NATSL_DEBUG_DIR")
        seen_samples: list[int] = []
        result = TrainResult(self.out, start, self.end_step, None, None, ckpt.folder if ckpt else None, None,
                             resumed_from=ckpt.folder if ckpt else None, skipped_steps=self.state["bad_steps"],
                             micro_batch=self.micro_batch, accumulation=self.accum,
                             micro_batch_choice=self.micro_batch_choice)
        if start >= self.end_step:
            self.log(f"already at step {start} (the end is {self.end_step}); nothing to train")
            result.loss = ckpt.trainer_state.get("last_loss") if ckpt else None
            return result

        bar = tqdm(total=self.end_step, initial=start, unit="step", desc="train", dynamic_ncols=True,
                   disable=not (self.options.progress and info.is_main), mininterval=1.0)
        say = bar.write if not bar.disable else self.log  # lines that do not break the bar
        step = start
        window_tokens, window_time = 0, 0.0
        last_saved = start if ckpt is not None else None
        tokens_per_s = None

        def say_dropped() -> None:  # a Ctrl-C's deadline ended the process in a step (natsl.interrupts)
            kept = f"the newest checkpoint is step {last_saved}'s" if last_saved is not None else "no checkpoint written"
            say(f"SIGINT: step {step + 1} was not finished and is not saved; {kept}; continue with --resume auto")

        with stop_signals(world == 1, self.options.on_signal) as stop, interrupts.keep(say_dropped):
            try:
                while step < self.end_step:
                    samples = step_sample_indices(self.state["samples_seen"], self.micro_batch, self.accum,
                                                  info.rank, world)
                    if debug_dir:
                        seen_samples.extend(i for mb in samples for i in mb)
                    record = self.optimizer_step(samples)
                    step = record["step"]
                    result.history.append(record)
                    if self.options.on_step is not None and self.options.on_step(record):
                        stop["signal"] = stop["signal"] or "on_step"
                    if info.is_main:
                        self.metrics.write(record)
                    if not record["skipped"]:
                        result.loss = record["loss"]
                    elif self.state["bad_in_row"] >= tc.max_bad_steps:
                        good = S.list_checkpoints(self.out)
                        where = f"; the newest checkpoint is {good[-1][1]}" if good else ""
                        grads = record.get("nonfinite_grads")
                        first = f" (non-finite gradients first in {', '.join(grads[:3])})" if grads else ""
                        raise NatslError(f"stopped at step {step}: {self.state['bad_in_row']} steps in a row had a "
                                         f"non-finite loss or gradient{first}{where}; lower optim.lr or check the data")
                    fault_point("kill_after_step", step)

                    window_tokens += tc.tokens_per_step
                    window_time += record["time_s"]
                    if step % tc.log_every == 0 or step == self.end_step or step == start + 1:
                        tokens_per_s = window_tokens / window_time
                        mfu = f"{tokens_per_s * record['flops_per_token'] / (self.peak * world):.1%}" \
                            if self.peak else "n/a"
                        bar.set_postfix_str(f"loss {record['loss']:.4f}, {tokens_per_s:,.0f} tok/s, MFU {mfu}",
                                            refresh=False)
                        window_tokens, window_time = 0, 0.0
                    bar.update(1)
                    if step % tc.eval_every == 0 or step == self.end_step:
                        val_loss = self.evaluate()
                        if val_loss is not None:
                            if info.is_main:
                                self.metrics.write({"step": step, "val_loss": val_loss,
                                                    **({"val_accuracy": self.task_accuracy}
                                                       if getattr(self, "task_accuracy", None) is not None else {})})
                            say(f"step {step}: validation loss {val_loss:.4f}")
                            result.val_loss = val_loss
                    if step % tc.save_every == 0 or (step == self.end_step and self.options.save_final):
                        with interrupts.saving():  # a Ctrl-C's deadline (natsl.interrupts) waits for it
                            result.checkpoint = self.save(step)
                        last_saved = step
                    if stop["signal"]:
                        if last_saved != step:
                            with interrupts.saving():
                                result.checkpoint = self.save(step)
                        say(f"{stop['signal']}: stopped after step {step} with a checkpoint; "
                            "continue with --resume auto")
                        raise KeyboardInterrupt
            finally:
                bar.close()
                self.metrics.close()
        result.step = step
        result.tokens_per_s = tokens_per_s
        result.skipped_steps = self.state["bad_steps"]
        if debug_dir:
            digest = hashlib.sha256()
            for _, p in sorted(D.full_tensors(self.model.state_dict()).items()):  # FSDP: gathered whole
                digest.update(p.detach().float().cpu().numpy().tobytes())
            Path(debug_dir).mkdir(parents=True, exist_ok=True)
            (Path(debug_dir) / f"rank{info.rank}.json").write_text(json.dumps(
                {"rank": info.rank, "world_size": world, "samples": seen_samples, "weights_sha256": digest.hexdigest()}))
        return result
