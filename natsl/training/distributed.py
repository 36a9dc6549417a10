"""Data parallelism, kept apart from the model: process group, DDP or FSDP2 wrapping, collectives.

`natsl train` runs as one process, or as N processes under `torchrun` (which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); NCCL on GPUs (rank r uses cuda:LOCAL_RANK), gloo
on the CPU. `train.parallel: ddp` (default): each rank holds a full replica wrapped in PyTorch DDP
(gradients all-reduced, averaged), so rank 0's copy is already the consolidated checkpoint.
`train.parallel: fsdp`: PyTorch's FSDP2, `fully_shard` on every block and on the root, so each rank
holds 1/N of the parameters, gradients and AdamW state; a checkpoint gathers the full tensors
(`full_tensors`, a collective) and rank 0 writes them in the same format as DDP, and loading shards
full tensors again (`shard_like`), so a run may resume under either scheme and any rank count.
Rank 0 alone writes checkpoints and logs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: torch.device) -> DistInfo:
    """Join the process group when started by torchrun; pick this rank's device."""
    if not launched_by_torchrun():
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return DistInfo(device=device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30), **kwargs)
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, info: DistInfo, parallel: str = "ddp", blocks=()) -> torch.nn.Module:
    """The module to train when there are several ranks: DDP around `model` (rank 0's weights
    broadcast), or, for "fsdp", `model` itself after fully_shard on each of `blocks` and on it (every
    rank must hold the same initial weights: the same seed or the same checkpoint)."""
    if not info.enabled:
        return model
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors: nothing is ever sharded
        return ()
    return DTensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP) tensor gathered whole; a plain tensor as it is. Collective for sharded ones:
    every rank must call it in the same order."""
    return t.full_tensor() if isinstance(t, _dtensor_type()) else t


def full_tensors(tensors: dict) -> dict:
    return {name: full_tensor(t) if torch.is_tensor(t) else t for name, t in tensors.items()}


def shard_like(reference: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `reference`: this rank's shard when reference is sharded, else full itself."""
    if isinstance(reference, _dtensor_type()):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(reference.device, reference.dtype), reference.device_mesh,
                                 reference.placements)
    return full


def no_sync(model: torch.nn.Module, skip: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP2) on all but the last micro-batch
    of an accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a switch, set for every micro-batch
        model.set_requires_gradient_sync(not skip)
    elif skip and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    """Rank 0's `obj` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out
