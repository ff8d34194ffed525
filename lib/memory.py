"""Predicting training memory before a run, and printing it beside what the run measured.

Used by every script's --estimate-memory. The one idea: training memory is a short sum.
Weights, gradients and optimizer state scale with the parameter count (4 + 4 + 8 bytes per
parameter for fp32 AdamW); activations scale with batch x sequence x width x layers, because
backward needs what forward computed. The logits (batch x sequence x 50,257) would be a small
GPT's largest tensor, but lib/lm_loss never makes them: only one chunk of rows at a time
(lm_loss_bytes). Add what the runtime itself occupies and you have it.
"""

import torch

from lib.gpt import Block, GPTConfig
from lib.lm_loss import chunk_rows, default_chunk_size
from lib.metrics import format_bytes

# What the process holds before the model exists: the CPU figure is the resident set of Python
# with torch, numpy, tiktoken and the GPT-2 ranks loaded (measured on Linux x86-64, torch 2.13).
# CUDA's max_memory_allocated counts tensors only, so its baseline is 0 (the CUDA context,
# about 0.5 GB, sits outside it); MPS's driver figure includes Metal's own pools. A script that can
# measure its own CPU process does (cpu_runtime_bytes); this is the figure before it can.
RUNTIME_BASELINE = {"cpu": 250 * 2**20, "cuda": 0, "mps": 100 * 2**20}
# What a CPU process's resident set grows by in its first training step whatever the model, beyond
# the runtime measured before it: the OpenMP worker threads (a stack each) and the kernels and caches
# that forward, backward and AdamW load on first use (measured: 14-18 MiB for a 64-wide MLP and for a
# 2-layer GPT with LoRA, 1 or 2 threads, Linux x86-64, torch 2.13). torch._dynamo, which torch's
# optimizers import on their first step (71 MiB), is imported before the runtime is measured, so it
# counts there (cpu_runtime_bytes). CUDA's max_memory_allocated counts tensors only: nothing added.
CPU_FIRST_STEP = 20 * 2**20
RUNTIME_LABEL = "runtime (measured: Python, torch, the data)"  # fine-tuning measures after reading its data
PRETRAIN_RUNTIME_LABEL = "runtime (measured: Python, torch)"  # pretraining measures before preparing its data
FIRST_STEP_LABEL = "runtime: first step's kernels and threads"


# --- what every CPU run pays besides its tensors ----------------------------------------------------
# One accounting for all the scripts, in three parts a learner can check with `ps` or /proc/self/status:
# 1. the runtime: Python, torch, tokenizer and (where read by then; train.py reads it later) the data,
#    measured as the resident set before the model is built (cpu_runtime_bytes), not assumed;
# 2. the first step's kernels and threads (CPU_FIRST_STEP);
# 3. the allocator: glibc keeps the blocks a step frees (up to 32 MiB each) in its heap for reuse, and
#    as tensors of other sizes fail to fit in them, the resident set grows step after step past what
#    the tensors need (GPT-2 124M LoRA: 5.35 GiB after the first step, 6.39 GiB after the third).
#    lib/device.steady_cpu_heap() fixes glibc's mmap threshold, so every block of 1 MiB or more is
#    mapped on its own and returned when freed: the peak is then the tensors, and nothing is added.
#    Every script calls it for its command-line runs. The blocks under the threshold still come from
#    the heap: where a step's activations are such small blocks (one short conversation a step, as
#    the judge's default batch of 1 on SmolLM2) and each step's differ in size, the heap keeps up to
#    one more step's worth of them (cpu_heap_kept_bytes).
from lib.device import MMAP_THRESHOLD  # noqa: E402  (lib/device.steady_cpu_heap's default)


def cpu_heap_kept_bytes(device_type: str, blocks, threshold: int = MMAP_THRESHOLD) -> int:
    """The freed blocks under the mmap threshold that glibc keeps in its heap, on a CPU: one step's
    worth of the small ones. blocks: (bytes of one tensor, how many a step keeps for backward).

    Measured (SmolLM2-135M, batch 1, conversations of about 155 tokens, 2 threads): the resident set
    grows by about 0.3 GiB in the first ten steps with the threshold at 1 MiB, and stays flat at 256 KiB,
    where the hidden states (0.4 MB each) are mapped instead; mapping them costs a third more time
    (the kernel zeroes every fresh page), so the scripts keep 1 MiB and count the blocks here. Where a
    step makes many small temporaries besides (judge_train_cuda.py's NF4 dequantisation, each layer
    twice under checkpointing) the holes they leave are not counted by this rule: that script maps
    from 128 KiB on a CPU instead (20% more time, measured; 1.28x the estimate at 1 MiB, 1.07x at 128 KiB)."""
    if device_type != "cpu":
        return 0
    return sum(size * count for size, count in blocks if size < threshold)


def cpu_runtime_bytes(device_type: str):
    """The CPU process's resident set now (None elsewhere), to be called just before the model is built.

    torch's optimizers import torch._dynamo (and sympy) on their first use, about 70 MiB that would
    otherwise arrive after the measurement: it is imported first, so it counts."""
    if device_type != "cpu":
        return None
    import torch._dynamo  # noqa: F401
    from lib.device import resident_bytes
    return resident_bytes()


def runtime_terms(device_type: str, measured: int = None, label: str = RUNTIME_LABEL) -> dict:
    """The estimate's runtime rows: on a CPU with the resident set measured, that figure and the first
    step's kernels and threads; otherwise the device's RUNTIME_BASELINE."""
    if device_type == "cpu" and measured is not None:
        return {label: measured, FIRST_STEP_LABEL: CPU_FIRST_STEP}
    return {"runtime baseline": RUNTIME_BASELINE.get(device_type, 0)}


def activation_bytes(cfg: GPTConfig, batch_size: int, block_size: int, amp: bool = False,
                     checkpointing: bool = False) -> int:
    """Bytes autograd keeps from forward for backward, summed over the blocks (logits excluded).

    Per block and token, with fused (flash) attention so no T x T matrix is stored (on a CPU, SDPA falls back
    to the plain kernel, which stores it, when --dropout is above 0: not counted here):
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
    """What the plain loss, F.cross_entropy over the whole [B, T, vocab] logits, would hold: no
    estimate uses it since lib/lm_loss; kept to show what the chunked loss saves (docs/big_vocab_loss.md).

    fp32: logits, log-probabilities, their gradient and the logits' gradient, 16 bytes per value, with
    the logits still held by the caller. Under 16-bit autocast, an upper count of 16: the 16-bit logits, the fp32
    log-probabilities and their gradient, the logits' fp32 gradient and the 16-bit one the matmul
    receives (the fp32 copy the loss makes of the logits is freed after forward: log-softmax's
    backward needs only its output).
    """
    per_value = (2 + 4 + 4 + 4 + 2) if amp else (4 + 4 + 4 + 4)
    return batch_size * block_size * cfg.vocab_size * per_value


def lm_loss_bytes(tokens: int, vocab_size: int, hidden_size: int, chunk_size: int | None = None,
                  compute_bytes: int = 4, train_head: bool = True, hidden_bytes: int = 4) -> int:
    """What lib/lm_loss.linear_cross_entropy adds at its peak, for any model (GPT, Llama, ...).

    tokens: rows of the loss (batch x sequence); compute_bytes: 4 in fp32, 2 under 16-bit autocast
    or for a 16-bit model; train_head: the head weight gets a gradient; hidden_bytes: the dtype of the
    hidden states. Counted: one chunk's logits in fp32, plus under 16 bits the 16-bit matmul output
    or gradient beside it (6 bytes a value); d_hidden [tokens, hidden], made in forward and handed to
    backward; and, for a trained head under 16 bits, the 16-bit copy of the weight and the 16-bit
    partial d_W of a chunk. The fp32 d_W itself becomes the head's gradient: count it with the
    gradients (as estimate_gpt_training does), not here.
    """
    rows = chunk_rows(tokens, chunk_size or default_chunk_size(vocab_size, hidden_size)) if tokens else 0
    chunk = rows * vocab_size * (4 if compute_bytes >= 4 else 4 + compute_bytes)
    d_hidden = tokens * hidden_size * hidden_bytes
    head_copies = 2 * vocab_size * hidden_size * compute_bytes if train_head and compute_bytes < 4 else 0
    return chunk + d_hidden + head_copies


def gpt_loss_bytes(cfg: GPTConfig, batch_size: int, block_size: int, amp: bool = False, train_head: bool = True) -> int:
    """lm_loss_bytes for a GPT batch: the tied head is the embedding, the hidden states are fp32."""
    return lm_loss_bytes(batch_size * block_size, cfg.vocab_size, cfg.n_embd, compute_bytes=2 if amp else 4,
                         train_head=train_head)


LOSS_LABEL = "loss (one chunk of logits)"


def estimate_gpt_training(cfg: GPTConfig, n_params: int, batch_size: int, block_size: int,
                          device_type: str = "cpu", amp: bool = False, ddp: bool = False,
                          checkpointing: bool = False, runtime: int = None) -> dict:
    """Predicted bytes per component for full-parameter AdamW training of a GPT on one device.

    ddp adds DDP's gradient buckets: DDP copies gradients into flat buckets to all-reduce them,
    a second fp32 copy of every gradient. Activations are per device and never shared.
    """
    estimate = {
        "parameters (fp32)": int(n_params * 4),
        "gradients (fp32)": int(n_params * 4),
        "AdamW moments (2 x fp32)": int(n_params * 8),
        "activations": activation_bytes(cfg, batch_size, block_size, amp, checkpointing),
        LOSS_LABEL: gpt_loss_bytes(cfg, batch_size, block_size, amp),
        # The embedding's backward makes a dense [vocab, n_embd] gradient, which autograd adds to the
        # tied head's: for a moment the tied weight has two gradients.
        "tied embedding's second gradient": cfg.vocab_size * cfg.n_embd * 4,
    }
    if ddp:
        estimate["DDP gradient buckets (fp32)"] = int(n_params * 4)
    # runtime: the CPU's resident set, measured before the model and the data (train.py, train_fsdp.py)
    estimate.update(runtime_terms(device_type, runtime, PRETRAIN_RUNTIME_LABEL))
    return estimate


def format_table(estimate: dict, measured: int = None, measured_label: str = "measured peak") -> str:
    width = max(len(k) for k in estimate) + 2
    lines = ["memory estimate:"]
    for name, b in estimate.items():
        lines.append(f"  {name:<{width}}{format_bytes(b):>12}")
    total = sum(estimate.values())
    lines.append(f"  {'total (predicted peak)':<{width}}{format_bytes(total):>12}")
    if measured is not None:
        lines.append(f"  {measured_label:<{width}}{format_bytes(measured):>12}   ({measured / max(total, 1):.2f}x the "
                     "estimate)")
    return "\n".join(lines)


def estimate_fsdp_training(cfg: GPTConfig, n_params: int, batch_size: int, block_size: int, world_size: int,
                           device_type: str = "cpu", mixed_precision: bool = False,
                           reshard_after_forward: bool = True, grad_accum: int = 1,
                           checkpointing: bool = False, runtime: int = None) -> dict:
    """Predicted bytes on ONE of world_size FSDP2 ranks (train_fsdp.py), per component.

    The fp32 parameters, gradients and AdamW moments are sharded: each rank keeps 1/world_size.
    Three things are not: activations (each rank runs its own micro-batch); the parameters FSDP
    all-gathers to compute with (the root unit, i.e. the tied embedding, wpe and ln_f, for the whole
    step, plus about two blocks at a time: the one computing and the one prefetched; every block
    from forward until its backward when reshard_after_forward is False, i.e. ZeRO-2); and the
    unsharded gradients waiting for their reduce-scatter (the root's, which backward produces first
    and reduces last, plus one block; the whole model while gradient accumulation skips the sync).
    """
    with torch.device("meta"):  # shapes only
        per_block = sum(p.numel() for p in Block(cfg).parameters())
    root = n_params - cfg.n_layer * per_block
    shard = n_params / world_size
    compute_bytes = 2 if mixed_precision else 4  # bf16 all-gathers under MixedPrecisionPolicy
    if reshard_after_forward:
        gathered_label, gathered = "all-gathered params (root + 2 blocks)", root + min(2, cfg.n_layer) * per_block
    else:
        gathered_label, gathered = "all-gathered params (all blocks)", n_params
    if grad_accum > 1:
        unsharded_label, unsharded = "unsharded grads (all, accumulating)", n_params
    else:
        unsharded_label, unsharded = "unsharded grads (root + 1 block)", root + per_block
    return {
        "parameters (fp32)": int(shard * 4),
        "gradients (fp32)": int(shard * 4),
        "AdamW moments (2 x fp32)": int(shard * 8),
        gathered_label: gathered * compute_bytes,
        unsharded_label: unsharded * 4,
        "activations": activation_bytes(cfg, batch_size, block_size, mixed_precision, checkpointing),
        LOSS_LABEL: gpt_loss_bytes(cfg, batch_size, block_size, mixed_precision),
        **runtime_terms(device_type, runtime, PRETRAIN_RUNTIME_LABEL),  # this rank's resident set, on a CPU
    }


def format_columns(columns: dict, title: str = "memory estimate per rank:") -> str:
    """Several estimates side by side ({column label: estimate}); a row a column lacks shows '-'."""
    rows = list(dict.fromkeys(k for est in columns.values() for k in est))
    width = max(len(k) for k in rows + ["total (predicted peak)"]) + 2
    col = max(12, *(len(label) + 2 for label in columns))
    lines = [title, f"  {'':<{width}}" + "".join(f"{label:>{col}}" for label in columns)]
    for name in rows:
        cells = (format_bytes(est[name]) if name in est else "-" for est in columns.values())
        lines.append(f"  {name:<{width}}" + "".join(f"{c:>{col}}" for c in cells))
    totals = (format_bytes(sum(est.values())) for est in columns.values())
    lines.append(f"  {'total (predicted peak)':<{width}}" + "".join(f"{t:>{col}}" for t in totals))
    return "\n".join(lines)


# --- LoRA and QLoRA fine-tuning (finetune_lora.py, finetune_qlora.py) ----------------------------
# The four linears of a GPT-2 block: name -> (in_features, out_features) in units of n_embd.
BLOCK_LINEAR_SHAPES = {"attn.c_attn": (1, 3), "attn.c_proj": (1, 1), "mlp.c_fc": (1, 4), "mlp.c_proj": (4, 1)}


def nf4_bytes(numel: int, block_size: int = 64, double_quant: bool = True) -> int:
    """What lib/nf4.py stores for one weight: 4-bit codes (padded to whole blocks) and the absmaxes,
    int8 + one fp32 scale per 256 + one fp32 mean when double-quantised, else fp32 each."""
    n_blocks = -(-numel // block_size)
    codes = n_blocks * block_size // 2
    return codes + (n_blocks + -(-n_blocks // 256) * 4 + 4 if double_quant else n_blocks * 4)


def lora_layers_in_block(targets) -> list:
    """The block linears a target list selects, by PEFT's rule (equal, or ending in "." + target); a full
    path such as transformer.h.0.attn.c_attn counts as its kind in every block (an upper bound)."""
    return [n for n in BLOCK_LINEAR_SHAPES if any(n == t or n.endswith("." + t)
                                                  or t.endswith("." + n) for t in targets)]


def lora_activation_bytes(cfg: GPTConfig, batch_size: int, block_size: int, amp: bool, targets, r: int,
                          lora_dropout: float = 0.0, device_type: str = "cpu", checkpointing: bool = False) -> int:
    """Bytes autograd keeps from forward for backward when the base is frozen (the loss's excluded).

    A frozen linear needs only its weight in backward (dx = dy W), not its input, so less is kept
    than in full training (activation_bytes). An op keeps its inputs only if a gradient must pass
    through it: per block and token, the two LayerNorm inputs on the fp32 residual stream (n_embd x 4
    bytes each, plus a mean and a reciprocal std), q, k, v and the attention output, which SDPA keeps
    (4 n_embd, plus one log-sum-exp per head), and the GELU input (4 n_embd) in the compute dtype.
    Each adapted layer keeps the r-wide A x (for dB) and A's input (for dA): x itself, except that
    attn.c_proj's input is the very storage SDPA keeps as its output (flash attention returns it in
    the [B, T, heads, head_dim] layout the transpose wants, so .contiguous() copies nothing); with
    LoRA dropout, dropout(x) instead, and the mask when a gradient must go on down to x: a float
    tensor of x's dtype on CPU and MPS, one byte on CUDA (its fused kernel). LayerNorm outputs are
    fp32 even under autocast, so c_attn's and c_fc's x are; attn.c_proj's and mlp.c_proj's are in the
    compute dtype. In the first block nothing below the lowest adapted layer needs a gradient, so only
    what lies above it is kept; ln_f's input is kept once.

    checkpointing (--grad-checkpoint, torch.utils.checkpoint around each block): forward keeps only
    each block's input, the fp32 residual stream (n_embd x 4 bytes a token, for every block); backward
    runs one block's forward again and holds what that block keeps until its backward is done.
    """
    s = 2 if amp else 4
    C = cfg.n_embd
    adapted = lora_layers_in_block(targets)
    x_bytes = {"attn.c_attn": 4, "attn.c_proj": s, "mlp.c_fc": 4, "mlp.c_proj": s}  # the dtype of each input x
    ops = [("ln_1", C * 4 + 8), ("attn.c_attn", 0), ("attention", 4 * C * s + cfg.n_head * 4), ("attn.c_proj", 0),
           ("ln_2", C * 4 + 8), ("mlp.c_fc", 0), ("gelu", 4 * C * s), ("mlp.c_proj", 0)]  # forward order

    def block(first: bool) -> int:
        kept_total, grad_below = 0, not first  # grad_below: does anything below this op need a gradient?
        for name, kept in ops:
            if name in adapted:
                fan_in = BLOCK_LINEAR_SHAPES[name][0] * C
                kept = r * s
                if lora_dropout > 0:
                    kept += fan_in * s + (fan_in * (1 if device_type == "cuda" else x_bytes[name]) if grad_below else 0)
                elif not (name == "attn.c_proj" and grad_below):  # else SDPA keeps it already
                    kept += fan_in * s
            grad_below = grad_below or name in adapted
            kept_total += kept if grad_below else 0
        return kept_total

    tokens = batch_size * block_size
    if checkpointing:
        return tokens * (cfg.n_layer * C * 4 + block(False) + C * 4 + 8)
    return tokens * ((cfg.n_layer - 1) * block(False) + block(True) + C * 4 + 8)


def estimate_lora_finetuning(cfg: GPTConfig, batch_size: int, block_size: int, device_type: str = "cpu",
                             amp: bool = False, base: str = "fp32", targets=("c_attn",), r: int = 8,
                             lora_bytes: int = 4, lora_dropout: float = 0.0, nf4_block_size: int = 64,
                             double_quant: bool = True, checkpointing: bool = False, runtime: int = None) -> dict:
    """Predicted bytes per component for LoRA (base "fp32", "bf16" or "fp16") or QLoRA (base "nf4").

    Arithmetic only, no model is built. The block linears are stored as `base` says; embeddings,
    LayerNorms (and, with NF4, the biases) stay fp32. Only the LoRA matrices have gradients and AdamW
    moments, in the LoRA dtype (lora_bytes). Under autocast two more things live until backward:
    the 16-bit copy autocast makes of the tied embedding for the LM head, and (fp32 base only) a
    16-bit copy of every block weight. QLoRA dequantises one layer at a time: the int32 index copy
    and fp32 values (6 bytes per weight), plus the cast when computing in 16 bits.
    """
    C, L = cfg.n_embd, cfg.n_layer
    linears = [(a * C, b * C) for a, b in BLOCK_LINEAR_SHAPES.values()]
    linear_weights = L * sum(i * o for i, o in linears)
    linear_biases = L * sum(o for _, o in linears) if cfg.bias else 0
    other = cfg.vocab_size * C + cfg.block_size * C + (2 * L + 1) * C * (2 if cfg.bias else 1)
    if base == "nf4":
        base_label = "base weights (NF4 blocks, fp32 embeddings)"
        base_bytes = (L * sum(nf4_bytes(i * o, nf4_block_size, double_quant) for i, o in linears)
                      + (linear_biases + other) * 4)
    else:
        width = 4 if base == "fp32" else 2
        base_label = f"base weights ({base} blocks, fp32 embeddings)"
        base_bytes = (linear_weights + linear_biases) * width + other * 4
    n_lora = L * r * sum(BLOCK_LINEAR_SHAPES[n][0] * C + BLOCK_LINEAR_SHAPES[n][1] * C
                         for n in lora_layers_in_block(targets))
    lora_name = {4: "fp32", 2: "bf16"}.get(lora_bytes, f"{lora_bytes} B")
    estimate = {
        base_label: base_bytes,
        f"LoRA parameters ({lora_name})": n_lora * lora_bytes,
        f"LoRA gradients ({lora_name})": n_lora * lora_bytes,
        f"AdamW moments (2 x {lora_name})": 2 * n_lora * lora_bytes,
        "activations" + (" (checkpointed: block inputs + one block)" if checkpointing else ""):
            lora_activation_bytes(cfg, batch_size, block_size, amp, targets, r, lora_dropout,
                                  device_type, checkpointing),
        LOSS_LABEL: gpt_loss_bytes(cfg, batch_size, block_size, amp, train_head=False),
    }
    # The peak comes in backward, at the top block's MLP, while its gradients are in flight: the residual
    # stream's (n_embd, fp32), then c_proj's input gradient and GELU's (4 n_embd each, compute dtype). By
    # then ln_f's saved input and the loss's d_hidden (n_embd fp32 each) are freed. (Counted on the tensors
    # alive in a step: tests/test_memory_estimates.py.)
    s = 2 if amp else 4
    estimate["backward: gradients in flight (top MLP)"] = batch_size * block_size * max(0, 8 * C * s - 4 * C - 8)
    if amp:
        estimate["autocast copy of the tied LM head"] = cfg.vocab_size * C * 2
        if base == "fp32":
            estimate["autocast copies of the block weights"] = linear_weights * 2
    if base == "nf4":
        largest = max(i * o for i, o in linears)
        estimate["dequantised weight (one layer at a time)"] = largest * (6 + (2 if amp else 0))
    estimate.update(runtime_terms(device_type, runtime))  # runtime: the CPU's resident set, measured (above)
    return estimate
