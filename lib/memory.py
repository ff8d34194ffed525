"""Predicting training memory before a run, and printing it beside what the run measured.

Used by every script's --estimate-memory. The one idea: training memory is a short sum.
Weights, gradients and optimizer state scale with the parameter count (4 + 4 + 8 bytes per
parameter for fp32 AdamW); activations scale with batch x sequence x width x layers, because
backward needs what forward computed; the logits (batch x sequence x 50,257) are often the
single largest activation of a small GPT. Add what the runtime itself occupies and you have it.
"""

from lib.gpt import GPTConfig
from lib.metrics import format_bytes

# What the process holds before the model exists: the CPU figure is the resident set of Python
# with torch, numpy, tiktoken and the GPT-2 ranks loaded (measured on Linux x86-64, torch 2.13).
# CUDA's max_memory_allocated counts tensors only, so its baseline is 0 (the CUDA context,
# about 0.5 GB, sits outside it); MPS's driver figure includes Metal's own pools.
RUNTIME_BASELINE = {"cpu": 250 * 2**20, "cuda": 0, "mps": 100 * 2**20}


def activation_bytes(cfg: GPTConfig, batch_size: int, block_size: int, amp: bool = False,
                     checkpointing: bool = False) -> int:
    """Bytes autograd keeps from forward for backward, summed over the blocks (logits excluded).

    Per block and token, with fused (flash) attention so no T x T matrix is stored:
    the two LayerNorm inputs live on the fp32 residual stream (2 x n_embd x 4 bytes); the rest
    are matmul inputs and outputs: LN outputs (2), q/k/v (3), attention output and c_proj's
    copy of it (2), and the MLP's 4x-wide GELU input and output (8), 15 x n_embd values in the
    compute dtype (2 bytes under autocast, else 4).
    """
    tokens = batch_size * block_size
    per_block = tokens * cfg.n_embd * (2 * 4 + 15 * (2 if amp else 4))
    if cfg.dropout > 0:
        per_block += tokens * cfg.n_embd * 6  # three bool masks of n_embd, 4 n_embd, n_embd
    if checkpointing:
        # Only each block's input survives forward; one block is recomputed at a time in backward.
        return cfg.n_layer * tokens * cfg.n_embd * 4 + per_block
    return cfg.n_layer * per_block + tokens * cfg.n_embd * 4 * 3  # + embeddings out, ln_f in/out


def logits_bytes(cfg: GPTConfig, batch_size: int, block_size: int, amp: bool = False) -> int:
    """The [B, T, vocab] logits, their fp32 log-softmax for the loss, and the gradient."""
    per_value = (2 + 4 + 4 + 4 + 2) if amp else (4 + 4 + 4)
    return batch_size * block_size * cfg.vocab_size * per_value


def estimate_gpt_training(cfg: GPTConfig, n_params: int, batch_size: int, block_size: int,
                          device_type: str = "cpu", amp: bool = False, shards: int = 1,
                          checkpointing: bool = False) -> dict:
    """Predicted bytes per component for full-parameter AdamW training of a GPT.

    shards > 1 divides parameters, gradients and optimizer state (FSDP/ZeRO-3); activations are
    per rank and never sharded.
    """
    per_rank = n_params / shards
    return {
        "parameters (fp32)": int(per_rank * 4),
        "gradients (fp32)": int(per_rank * 4),
        "AdamW moments (2 x fp32)": int(per_rank * 8),
        "activations": activation_bytes(cfg, batch_size, block_size, amp, checkpointing),
        "logits + loss": logits_bytes(cfg, batch_size, block_size, amp),
        "runtime baseline": RUNTIME_BASELINE.get(device_type, 0),
    }


def format_table(estimate: dict, measured: int = None, measured_label: str = "measured peak") -> str:
    width = max(len(k) for k in estimate) + 2
    lines = ["memory estimate:"]
    for name, b in estimate.items():
        lines.append(f"  {name:<{width}}{format_bytes(b):>12}")
    total = sum(estimate.values())
    lines.append(f"  {'total (predicted peak)':<{width}}{format_bytes(total):>12}")
    if measured is not None:
        lines.append(f"  {measured_label:<{width}}{format_bytes(measured):>12}   ({measured / max(total, 1):.2f}x the estimate)")
    return "\n".join(lines)
