"""Which device to run on, in which precision, and how much memory it used.

Used by every script. The one idea: the same training code runs on CUDA, Apple MPS and CPU; only
three decisions differ (where tensors live, whether matmuls run in 16-bit under autocast, and how
peak memory is read), and they are all made here.
"""

import contextlib
import os
import random
import resource
import sys

import numpy as np
import torch

from lib.errors import UserError


def pick_device(name: str = None) -> torch.device:
    """--device if given (checked: cuda, cuda:N, mps or cpu, and present here), else cuda, then mps, then cpu."""
    if name:
        try:
            dev = torch.device(name)
        except (RuntimeError, ValueError):
            dev = None
        if dev is None or dev.type not in ("cuda", "mps", "cpu"):
            raise UserError(f"--device {name!r} is not a device this script runs on; use cuda, cuda:N, mps or cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {name} was asked for but torch.cuda.is_available() is False; use --device cpu")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}; pick one of those")
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise UserError(f"--device {name} was asked for but MPS is not available here; use --device cpu")
        if dev.type in ("mps", "cpu") and dev.index not in (None, 0):
            raise UserError(f"--device {name}: there is one {dev.type} device; use --device {dev.type}")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the x86 instructions that compute in bf16 (AVX512-BF16, AMX)


def cpu_flags():
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo, or None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return None


def cpu_has_native_bf16(capability: str = None, flags=None):
    """(True or False, why): whether this CPU computes in bf16 natively, decided from what it supports,
    never from a timing, so a busy machine and a quiet one choose alike.

    Both must hold: torch runs its AVX-512 kernels here (torch.backends.cpu.get_cpu_capability() is
    "AVX512"; "AVX2", "DEFAULT", "NO AVX", "VSX", "Z VECTOR", "SVE256" are not), and the CPU has bf16
    units (flag avx512_bf16 or amx_bf16). Without them every bf16 op converts to fp32 and back: on an
    AVX2-only AMD EPYC (family 23) a square bf16 matmul ran 3x (256) to 27x (1024) slower than fp32. Arm CPUs and macOS
    (no /proc/cpuinfo) keep fp32: their bf16 support is not checked here. The arguments fake the inputs for tests.
    """
    capability = capability or torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags() if flags is None else set(flags)
    found = [flag for flag in BF16_FLAGS if flag in (flags or ())]
    seen = f"flag {found[0]}" if found else ("no /proc/cpuinfo" if flags is None else f"no {'/'.join(BF16_FLAGS)} flag")
    if capability.startswith("AVX512") and found:
        return True, f"this CPU has native bf16: capability {capability}, {seen}"
    return False, f"this CPU has no native bf16: capability {capability}, {seen}"


def amp_dtype(device: torch.device, requested: str = "auto"):
    """The autocast dtype, or None for plain fp32.

    auto: bf16 on CUDA when the GPU has it in hardware (Ampere and newer), else fp16 (which then needs
    a GradScaler, because fp16 gradients underflow); on a CPU bf16 where it is native (cpu_has_native_bf16),
    else fp32; fp32 on MPS. torch.cuda.is_bf16_supported() alone also says yes where bf16 is only emulated
    (a T4, a V100): including_emulation=False asks for the hardware.
    """
    if requested == "fp32":
        return None
    if requested == "bf16":
        return torch.bfloat16
    if requested == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "cpu" and cpu_has_native_bf16()[0]:
        return torch.bfloat16
    return None


def dtype_line(device: torch.device, requested: str, amp) -> str:
    """The line a script prints once: the dtype it computes in, and why."""
    name = {None: "fp32", torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast"}[amp]
    if requested != "auto":
        return f"dtype: {name} (--dtype {requested})"
    if device.type == "cpu":
        native, why = cpu_has_native_bf16()
        return f"dtype: {name} ({why}); --dtype {'fp32' if native else 'bf16'} forces {'fp32' if native else 'it'}"
    return f"dtype: {name} (auto on {device.type}; --dtype fp32 forces fp32)"


def autocast(device: torch.device, dtype):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_states() -> dict:
    """The random states dropout draws from, as a training state saves them for an exact --resume:
    the CPU's, every CUDA device's, and Apple's MPS generator where there is one."""
    states = {"rng_cpu": torch.get_rng_state(),
              "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    if torch.backends.mps.is_available():
        states["rng_mps"] = torch.mps.get_rng_state()
    return states


def restore_rng_states(state: dict):
    """Put back what rng_states saved (each device's states only where that device is here; a save made
    before the MPS state was kept has none, and then MPS dropout draws other masks after a resume)."""
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    if "rng_mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["rng_mps"])


def reset_peak_memory(device: torch.device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu" and os.path.exists("/proc/self/clear_refs"):
        # Linux: writing 5 resets the resident-set high-water mark (VmHWM), so the data
        # preparation before training does not count towards the training peak.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by tensors. MPS: driver-allocated now. CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if device.type == "mps":
        return torch.mps.driver_allocated_memory()
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, kilobytes on Linux


def resident_bytes() -> int:
    """The process's resident memory now (Linux: /proc; elsewhere the peak so far is the nearest figure)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_memory_bytes(torch.device("cpu"))


def memory_label(device: torch.device) -> str:
    return {"cuda": "max allocated", "mps": "driver allocated", "cpu": "peak RSS"}[device.type]


def synchronize(device: torch.device):
    # Timings are only honest once queued GPU work has finished.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


MMAP_THRESHOLD = 1 << 20  # steady_cpu_heap's default: blocks of 1 MiB or more are mapped on their own


def steady_cpu_heap(threshold: int = MMAP_THRESHOLD):
    """Linux (glibc): give every freed block of `threshold` bytes or more back to the system at once.

    By default glibc keeps freed blocks of up to 32 MiB in its heap for reuse (its mmap threshold
    rises to the largest block freed). A run whose big tensors change size every step (SPLADE's
    padded batches, WPO-SGM's chunks) rarely fits them into the blocks freed before, so the resident
    set creeps up, step after step, to well above what a step needs, and the measured CPU peak stops
    saying anything about the estimate. With the threshold fixed, the peak stays at what a step needs,
    for a few percent more system time (the kernel zeroes the fresh pages: docs/big_vocab_loss.md).
    Called by every script but onefile_train.py, for command-line runs only: a program that imports
    a script (a test, a notebook) keeps its own allocator settings.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).mallopt(-3, threshold)  # -3: M_MMAP_THRESHOLD in glibc's malloc.h
        except (OSError, AttributeError):
            pass  # not glibc (musl): nothing to set
