"""torchrun's environment -> a process group, and the few collectives the scripts need.

Used by train.py, onefile_train.py (its own copy) and train_fsdp.py. The one idea: torchrun starts
one process per device and tells each its RANK, LOCAL_RANK and WORLD_SIZE through environment
variables; a script started with plain `python` sees none of them and runs as rank 0 of 1.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device_type: str) -> DistInfo:
    """Join the process group if torchrun launched us (nccl on CUDA, gloo otherwise)."""
    if "RANK" not in os.environ:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return info


def device_for(info: DistInfo, device: torch.device) -> torch.device:
    # Under torchrun each process owns the GPU matching its local rank.
    return torch.device("cuda", info.local_rank) if device.type == "cuda" and info.enabled else device


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo):
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo, wait: bool = True):
    """Leave the process group. wait: first let every rank arrive, because a gloo rank that tears
    down while a peer is still busy (rank 0 saving, say) can abort the whole job at exit."""
    if info.enabled and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
