"""AdamW with weight-decay groups, and the warmup + cosine learning-rate schedule.

Used by train.py, train_fsdp.py and the fine-tuning scripts. The one idea: weight decay pulls
weights towards zero, which regularises the matrices but only hurts biases and LayerNorm gains;
so parameters with two or more dimensions (matmul weights and, as in nanoGPT, embeddings) decay
and 1-D ones do not.
"""

import inspect
import math

import torch


def make_adamw(params, lr, weight_decay=0.1, betas=(0.9, 0.95), device_type="cpu", eps=1e-8):
    """AdamW over `params` (an iterable of parameters that require grad), fused where available."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one launch instead of one per tensor.
    fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu", "mps")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def lr_at(step: int, max_lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Linear warmup to max_lr, then cosine decay to min_lr_ratio * max_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return max_lr * min_lr_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    return max_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * coeff)
