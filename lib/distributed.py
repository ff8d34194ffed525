"""torchrun's environment -> a process group, and the few collectives the scripts need.

Used by train.py, onefile_train.py (its own copy) and train_fsdp.py. The one idea: torchrun starts
one process per device and tells each its RANK, LOCAL_RANK and WORLD_SIZE through environment
variables; a script started with plain `python` sees none of them and runs as rank 0 of 1.
"""

import atexit
import datetime
import gc
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lib.errors import UserError


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
    leave_before_exit()  # also for a group a script makes itself (train_fsdp.py's group of one)
    if "RANK" not in os.environ:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", **restart_store(info))
    return info


def restart_store(info: DistInfo) -> dict:
    """After torchrun --max-restarts starts the group again, a store of the new launch's own.

    torchrun's agent keeps one key-value store for the whole job, and the ranks of every launch find
    each other through it. The first launch's keys are still there when the second launch starts, and
    (in torch 2.13 at least) a new rank may read a dead rank's address from them: its init_process_group
    then fails (gloo: "connectFullMesh ... Connection refused") and the launch is lost, a restart spent;
    or, by the luck of timing, it works. Prefixing every key with the launch's number
    (TORCHELASTIC_RESTART_COUNT) gives each launch a clean namespace. The first launch, or a plain
    `python` run, uses torch's default."""
    launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if not launch or "MASTER_ADDR" not in os.environ:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"byhand/launch-{launch}", store), "rank": info.rank,
            "world_size": info.world_size}


_leave_registered = False


def leave_before_exit():
    """Make sure the process group is gone, with every object that holds it, before Python tears down.

    destroy_process_group() only drops torch's own references to the group. A DDP model's reducer (or any
    other holder) keeps the C++ ProcessGroupGloo, and its worker threads, alive; when that model is cyclic
    garbage it is freed only by the collection Python runs while finalizing the interpreter, and a gloo
    group destroyed then can abort the process with "terminate called without an active exception"
    (SIGABRT): a run that trained and saved, then crashed. So at exit, while the interpreter is still whole
    (atexit runs after main() has returned and its frames are gone), destroy the group if a path left it
    and collect the garbage that holds it."""
    global _leave_registered
    if not _leave_registered:
        atexit.register(_leave)
        _leave_registered = True


def _leave():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


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
    # What still holds the group (a DDP model the caller keeps) goes at exit: leave_before_exit.


# The signal that asked this process to stop: SIGINT (Ctrl-C) or SIGTERM (a scheduler), once one has.
# lib/rundir.save_on_interrupt reads it for the exit code: 130 or 143.
STOP = {"signal": None}


def catch_ctrl_c(info: DistInfo) -> dict:
    """Under torchrun, make Ctrl-C and SIGTERM a request that the ranks agree on (see stop_requested), not
    an exception that strikes each rank at a different point (one inside an all-reduce the others never
    reach). The terminal's SIGINT, the copy torchrun forwards, and a scheduler's SIGTERM (to every rank,
    or forwarded by torchrun) only set the flag. A single process keeps Python's KeyboardInterrupt, and
    lib/rundir.catch_sigterm's Terminated, which stop it at once, but for a step's update and its counting
    (lib/rundir.whole_update): there they wait for its end."""
    flag = {"requested": 0}
    if info.enabled:
        def request(signum, frame):
            flag["requested"] = max(flag["requested"], signum)  # SIGTERM (15) outranks SIGINT (2)
        signal.signal(signal.SIGINT, request)
        signal.signal(signal.SIGTERM, request)
    return flag


def stop_requested(flag: dict, info: DistInfo, device) -> bool:
    """True on every rank once any rank saw Ctrl-C or SIGTERM: one tiny all-reduce per step, only under
    torchrun. The ranks agree on the signal too (the largest number: SIGTERM), so all exit with one code."""
    if not info.enabled:
        return False
    t = torch.tensor(float(flag["requested"]), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t.item():
        STOP["signal"] = int(t.item())
    return bool(t.item())


def local_rank_0_first(info: DistInfo, fn):
    """fn() on one process per machine first (a download or a tokenisation, cached on disk), then on the
    others, which find the cache: two processes writing the same cache file would tear it."""
    error = None
    if info.local_rank == 0:
        try:
            result = fn()
        except UserError as e:  # a user's mistake (no such --data, say): every rank must hear of it
            error = e
    if info.enabled:  # the barrier, carrying each machine's error: one line on every rank, no rank left waiting
        errors = [None] * info.world_size
        dist.all_gather_object(errors, str(error) if error else None)
        first = next((e for e in errors if e), None)
        if first and error is None:
            error = UserError(first)
    if error:
        raise error
    if info.local_rank != 0:
        result = fn()
    return result
