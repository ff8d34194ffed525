"""Progress lines, the metrics.jsonl log, throughput and MFU.

Used by every script. The one idea: model FLOPs utilisation (MFU) compares the arithmetic the
model needs per second (about 6 FLOPs per parameter per token, plus attention) with what the chip
could do at peak; it says how much of the hardware the training loop actually uses.
"""

import json
import math
import os
import time

import torch

# Dense bf16/fp16 tensor-core peak FLOP/s (no sparsity), from the vendors' data sheets.
# Matched against torch.cuda.get_device_name(); the first key found in the name wins.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "A6000": 155e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops_for(device: torch.device, override: float = None):
    """Peak FLOP/s of the device, or None when unknown (CPU and MPS unless --peak-flops is given)."""
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS.items():
            if key in name:
                return flops
    return None


def flops_per_token(n_params: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (2 forward + 4 backward per parameter) plus
    12 * n_layer * n_embd * T for attention's scores and weighted sum (PaLM appendix B)."""
    return 6 * n_params + 12 * n_layer * n_embd * block_size


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def progress_line(step: int, total: int, loss: float, lr: float, tok_s: float, mfu, mem: int, eta: float,
                  mem_note: str = "") -> str:
    """The line every training script prints every --log-interval steps."""
    mfu_text = f"{mfu:.1%}" if mfu is not None else "n/a"
    return (f"step {step:5d}/{total} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:8,.0f} tok/s | MFU {mfu_text} | "
            f"mem {format_bytes(mem)}{mem_note} | ETA {format_seconds(eta)}")


class MetricsLog:
    """Appends one JSON object per line to OUT/metrics.jsonl (only on the main rank).

    Appending, not rewriting, means a resumed run continues the same file; each record is
    flushed so that a crash loses at most the line being written.
    """

    def __init__(self, path: str, enabled: bool = True):
        self.path, self.enabled = path, enabled
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def log(self, **record):
        if not self.enabled:
            return
        record.setdefault("time", round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class Throughput:
    """Tokens per second since the last report, and an ETA from the steady-state steps only.

    The first step pays for warm-up (allocator growth, kernel selection, torch.compile), which can
    take longer than ten ordinary steps; an ETA that includes it overestimates a short run badly.
    So the ETA clock starts when the first step is done (the first add()): until a second step has
    finished there is no steady-state figure and the ETA shows "?".
    """

    def __init__(self, total_steps: int, start_step: int = 0):
        self.total = total_steps
        self.t0 = self.t_last = time.perf_counter()
        self.step_last = self.start = start_step
        self.tokens = 0
        self.t_steady, self.steady_steps = None, 0

    def add(self, tokens: int):
        """Call once per finished optimizer step."""
        self.tokens += tokens
        if self.t_steady is None:
            self.t_steady = time.perf_counter()
        else:
            self.steady_steps += 1

    def report(self, step: int):
        """(tokens/s since the last report, seconds per step since the last report, ETA in seconds)."""
        now = time.perf_counter()
        dt = max(now - self.t_last, 1e-9)
        tok_s = self.tokens / dt
        sec_per_step = dt / max(1, step - self.step_last)
        if self.steady_steps:
            eta = (now - self.t_steady) / self.steady_steps * (self.total - step)
        else:
            eta = 0.0 if step >= self.total else float("inf")  # format_seconds shows inf as "?"
        self.t_last, self.step_last, self.tokens = now, step, 0
        return tok_s, sec_per_step, eta
