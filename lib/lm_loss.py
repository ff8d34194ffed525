"""The language-model loss without the logits: cross-entropy over the LM head, chunk by chunk.

Used by lib/gpt.py (so train.py, train_fsdp.py, finetune_lora.py and finetune_qlora.py) and
lib/llama.py (the judge scripts); onefile_train.py carries a compact copy. docs/big_vocab_loss.md
tells the story with numbers.

The one idea: a small model's largest tensor is its logits, tokens x vocabulary (8 x 128 x 50,257
floats = 206 MB for this repo's tiny GPT, whose weights are 29 MB), yet the loss needs only one
number per token from them: log-sum-exp over the vocabulary minus the target's logit. And the
gradient needs them only for a moment, per row:

    dL/dz = softmax(z) - onehot(target)              (times 1 / number of targets, for the mean)
    d_hidden[rows] = dL/dz @ W          d_W += dL/dz^T @ hidden[rows]

So take a few rows at a time: make their logits, take what the loss and the gradients need, and
throw the rows away before the next ones. Nothing of size tokens x vocabulary ever exists.

When are the gradients made? Two ways, both here, both in one torch.autograd.Function:
- recompute=False (the default): in forward, while the chunk's logits are there (as Liger's fused
  linear cross-entropy does). Three matmuls per chunk, as many as the plain loss needs. What waits
  for backward is d_hidden ([tokens, hidden], the size of the hidden states the plain loss keeps)
  and d_W ([vocab, hidden] in fp32, the weight gradient, which backward would make anyway);
  backward only multiplies them by its incoming gradient.
- recompute=True: forward keeps only the hidden states and one log-sum-exp per row; backward makes
  each chunk's logits again (a fourth matmul) and turns them into the gradients. Nothing the size of
  the weight is held between forward and backward: the choice when they are far apart (a loop that
  runs several forwards before one backward). The loss then costs more CPU time (docs/big_vocab_loss.md
  measures how much), and in this repo's tiny default the head is most of a step: so it is not the default.
Checkpointing (torch.utils.checkpoint around a per-chunk F.cross_entropy) would also recompute,
but it rebuilds each chunk's autograd graph, holds three chunk-sized fp32 tensors at once in its
backward (the log-softmax, its gradient and the logits' gradient), and hands autograd one
[vocab, hidden] weight gradient per chunk to add.
Written by hand, one [chunk, vocab] buffer becomes the softmax and then the gradient in place, and
what is not needed is never computed: no d_W when the head is frozen (LoRA, the judge), no
d_hidden when the hidden states need none, no gradient at all under torch.no_grad (evaluation).

Numbers: the matmuls run in the autocast dtype when autocast is on (as nn.Linear's would), the
chunk's logits are turned into fp32 for the log-sum-exp, d_W is accumulated in fp32, and the 1/N
of the mean is applied in fp32 after the 16-bit matmuls (so fp16 gradients cannot underflow); the
gradients come back in the dtypes of the inputs. A target equal to ignore_index (-100) counts for
nothing. When every target of a call is ignored the mean is 0 with zero gradients, not
F.cross_entropy's nan (0 / 0): a batch whose answers were all cut off must not stop a run that
stops on a non-finite loss.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib import exercise

# Rows per chunk: at least MIN_CHUNK_ROWS, more while the chunk's fp32 logits fit CHUNK_BYTES. Fewer
# rows make the three matmuls slow: each chunk reads the whole [vocab, hidden] weight twice and adds
# into the whole d_W once, so small chunks cost passes: for 1,024 tokens of Qwen2's 151,936 words, 54 rows
# (what 32 MiB alone would give) make 19 chunks where 256 rows make 4. 128 MiB is 2 chunks of 512 rows for
# the default GPT-2 batch of 1,024 tokens, and 256 rows (148 MiB) at Qwen2's vocabulary: a quarter of
# 1,024 rows' logits.
CHUNK_BYTES = 128 * 2**20
MIN_CHUNK_ROWS = 256


def default_chunk_size(vocab_size: int, hidden_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Most rows (tokens) per chunk: as many as fit chunk_bytes of fp32 logits plus the rows' hidden
    states and gradients, and at least MIN_CHUNK_ROWS so that the matmuls run at full speed."""
    return max(MIN_CHUNK_ROWS, chunk_bytes // (4 * (vocab_size + 2 * hidden_size)))


def chunk_rows(n: int, chunk_size: int) -> int:
    """Rows per chunk for n rows and chunks of at most chunk_size, as few chunks as that allows, all of this
    size but a last one that may be shorter: 1,024 tokens with at most 664 rows are two chunks of 512, not
    664 and 360 (the buffer is sized for 512 rows); 20 rows with at most 7 are 7, 7 and 6."""
    return -(-n // -(-n // chunk_size))


# The chunk buffers are kept between calls, one per device, dtype and vocabulary (the largest asked for
# so far). A fresh [rows, vocab] buffer of tens of MB every step would be fresh pages from the kernel
# every step, each 4 KiB zeroed on its first touch: most of the system time of the plain loss (docs/big_vocab_loss.md).
# On CUDA the caching allocator would reuse the block anyway; on a CPU this is what reuses it.
_WORKSPACE = {}


def _workspace(rows: int, vocab: int, dtype, device) -> torch.Tensor:
    key = (str(device), dtype, vocab)
    buffer = _WORKSPACE.get(key)
    if buffer is None or buffer.shape[0] < rows:
        _WORKSPACE.pop(key, None)  # the smaller one goes first
        buffer = _WORKSPACE[key] = torch.empty(rows, vocab, dtype=dtype, device=device)
    return buffer[:rows]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would compute in: autocast's when autocast is on, else the input's."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind) and hidden.is_floating_point():
        return torch.get_autocast_dtype(kind)
    return hidden.dtype


class _ChunkBuffers:
    """The one [rows, vocab] buffer every chunk reuses (fp32), plus a 16-bit one for the matmul's
    output and the gradient's input under autocast: from the workspace kept between calls."""

    def __init__(self, rows, vocab, acc, compute_dtype, device):
        self.acc = _workspace(rows, vocab, acc, device)
        self.low = None if compute_dtype == acc else _workspace(rows, vocab, compute_dtype, device)

    def logits(self, h, w):
        """The chunk's logits h @ w.T in the compute dtype, as an fp32 view of the buffer."""
        z = self.acc[:h.shape[0]]
        if self.low is None:
            return torch.mm(h, w.t(), out=z)
        return z.copy_(torch.mm(h, w.t(), out=self.low[:h.shape[0]]))

    def to_compute(self, z):
        """z in the compute dtype, for the gradient matmuls (itself in fp32)."""
        return z if self.low is None else self.low[:z.shape[0]].copy_(z)


def _chunk_softmax_minus_onehot(z, sumexp, safe, valid):
    """z holds exp(logits - a row constant) of a chunk and sumexp its row sums (None: z is the
    softmax already); turn z, in place, into softmax - onehot(target) on the rows that count and 0
    on the ignored ones (the 1/N of the mean comes later, in fp32)."""
    z.mul_((valid if sumexp is None else valid / sumexp)[:, None])
    z.scatter_add_(1, safe[:, None], -valid[:, None])
    return z


class _LinearCrossEntropy(torch.autograd.Function):
    """loss = reduce_i(logsumexp(h_i W^T) - (h_i W^T)[t_i]) over the rows i whose target counts."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, compute_dtype, reduction,
                recompute, grad_hidden, grad_weight):
        n, device = hidden.shape[0], hidden.device
        acc = torch.promote_types(compute_dtype, torch.float32)  # fp32 (fp64 stays fp64)
        counts = targets != ignore_index
        valid = counts.to(acc)
        safe = torch.where(counts, targets, 0)  # a gatherable index for ignored rows; they count 0
        count = counts.sum()
        fused = (grad_hidden or grad_weight) and not recompute
        lse = torch.empty(n, dtype=acc, device=device)
        total = torch.zeros((), dtype=acc, device=device)
        d_hidden = torch.empty_like(hidden) if fused and grad_hidden else None
        d_weight = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=device)
                    if fused and grad_weight else None)
        with torch.autocast(device.type, enabled=False):
            w = weight.to(compute_dtype)
            chunk_size = chunk_rows(n, chunk_size) if n else chunk_size
            buffers = _ChunkBuffers(min(chunk_size, n), weight.shape[0], acc, compute_dtype, device)
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                h = hidden[s:e].to(compute_dtype)
                z = buffers.logits(h, w)  # the chunk's logits, [rows, vocab], fp32
                target_logit = z.gather(1, safe[s:e, None]).squeeze(1)
                # log-sum-exp, in place: subtract the row max, exp, sum, log, add the max back.
                m = z.amax(dim=1, keepdim=True)
                sumexp = z.sub_(m).exp_().sum(dim=1)
                lse[s:e] = sumexp.log() + m.squeeze(1)
                total += ((lse[s:e] - target_logit) * valid[s:e]).sum()
                if fused:
                    g = buffers.to_compute(_chunk_softmax_minus_onehot(z, sumexp, safe[s:e], valid[s:e]))
                    if grad_hidden:
                        d_hidden[s:e] = g @ w
                    if grad_weight:
                        _add_weight_grad(d_weight, g, h)
            del buffers, w
        if fused:
            ctx.save_for_backward(d_hidden, d_weight, count)
        else:
            ctx.save_for_backward(hidden, weight, safe, valid, lse, count)
        ctx.fused, ctx.chunk_size, ctx.compute_dtype, ctx.reduction = fused, chunk_size, compute_dtype, reduction
        ctx.acc, ctx.weight_dtype, ctx.done = acc, weight.dtype, False
        # The mean over no targets at all is 0, not nan: see the module docstring.
        return total / count.clamp(min=1) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss):
        none = (None,) * 8
        if ctx.fused:
            if ctx.done:  # the gradients made in forward are scaled in place: twice would be wrong
                raise RuntimeError("linear_cross_entropy: a second backward through the same loss; "
                                   "compute the loss again (or pass recompute=True)")
            ctx.done = True
            d_hidden, d_weight, count = ctx.saved_tensors
            scale = _scale(grad_loss, count, ctx.reduction, ctx.acc)
            if d_hidden is not None:
                d_hidden.mul_(scale)
            if d_weight is not None:
                d_weight = d_weight.mul_(scale).to(ctx.weight_dtype)
            return d_hidden, d_weight, *none
        hidden, weight, safe, valid, lse, count = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_hidden or need_weight):
            return None, None, *none
        n, dt, acc = hidden.shape[0], ctx.compute_dtype, lse.dtype
        d_hidden = torch.empty_like(hidden) if need_hidden else None
        d_weight = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                device=weight.device) if need_weight else None)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dt)
            buffers = _ChunkBuffers(min(ctx.chunk_size, n), weight.shape[0], acc, dt, hidden.device)
            for s in range(0, n, ctx.chunk_size):
                e = min(s + ctx.chunk_size, n)
                h = hidden[s:e].to(dt)
                z = buffers.logits(h, w)  # the chunk's logits, made again
                z.sub_(lse[s:e, None]).exp_()  # softmax
                g = buffers.to_compute(_chunk_softmax_minus_onehot(z, None, safe[s:e], valid[s:e]))
                if need_hidden:
                    d_hidden[s:e] = g @ w
                if need_weight:
                    _add_weight_grad(d_weight, g, h)
            del buffers, w
        scale = _scale(grad_loss, count, ctx.reduction, acc)
        if need_hidden:
            d_hidden.mul_(scale)
        if need_weight:
            d_weight = d_weight.mul_(scale).to(weight.dtype)
        return d_hidden, d_weight, *none


def _scale(grad_loss, count, reduction, dtype):
    """What each row's softmax - onehot is multiplied by: the incoming gradient, / N for the mean."""
    g = grad_loss.to(dtype)
    return g / count.clamp(min=1) if reduction == "mean" else g


def _add_weight_grad(d_weight, g, h):
    """d_weight (fp32) += g^T h. There is no mixed-dtype addmm on every device, so a 16-bit product is
    made first and added in fp32: one [vocab, hidden] 16-bit temporary per chunk."""
    if g.dtype == d_weight.dtype:
        d_weight.addmm_(g.t(), h)
    else:
        d_weight += g.t() @ h


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_size: int | None = None,
                         reduction: str = "mean", recompute: bool = False) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, targets) without ever holding all the logits.

    hidden [N, C] or [..., C] (the final, normalised hidden states); weight [V, C] (the LM head's,
    e.g. the tied embedding); targets [N] or [...] of class ids, ignore_index for "no target".
    reduction "mean" (over the targets that count; 0 when none does) or "sum". chunk_size: rows per
    chunk, default default_chunk_size(V, C). recompute: make the gradients in backward from logits
    made again (less held between forward and backward, a fourth matmul) instead of in forward.
    Gradients flow to hidden and weight as F.linear's would (a tied weight's add to the embedding's);
    the head has no bias (GPT-2 and Llama have none). One backward per call (as for any loss).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    c = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != c:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match hidden size {c}")
    hidden2d, flat_targets = hidden.reshape(-1, c), targets.reshape(-1)
    if flat_targets.shape[0] != hidden2d.shape[0]:
        raise ValueError(f"{flat_targets.shape[0]} targets for {hidden2d.shape[0]} hidden rows")
    chunk = chunk_size or default_chunk_size(weight.shape[0], c)
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, not {chunk}")
    # Function.forward runs with gradients off, so what will need a gradient is decided here.
    grad_on = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(hidden2d, weight, flat_targets, ignore_index, chunk, _compute_dtype(hidden2d),
                                     reduction, recompute, grad_on and hidden2d.requires_grad,
                                     grad_on and weight.requires_grad)


linear_cross_entropy = exercise.swap("lm_loss", linear_cross_entropy)  # BYHAND_EXERCISE=lm_loss: exercises/


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels [B, T] moved one to the left, the last position ignored: position t then predicts label
    t + 1. The labels are shifted, not the hidden states, so no copy of [B, T-1, C] is made."""
    return torch.cat((labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)), dim=1)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                   chunk_size: int | None = None, recompute: bool = False) -> torch.Tensor:
    """Next-token loss as Hugging Face's `model(ids, labels=labels).loss`: position t predicts label
    t + 1 (hidden [B, T, C], labels [B, T], -100 ignored)."""
    return linear_cross_entropy(hidden, weight, shift_labels(labels, ignore_index), ignore_index, chunk_size,
                                recompute=recompute)


def head_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The loss of a model's head module: the chunked loss above for a plain bias-free nn.Linear;
    any other head (LoRA-adapted, quantised) makes its logits and gets the plain loss."""
    if type(head) is nn.Linear and head.bias is None:
        return linear_cross_entropy(hidden, head.weight, targets, ignore_index)
    return logits_cross_entropy(head(hidden), targets, ignore_index)


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The plain loss from logits already made (a head that is not a plain nn.Linear, e.g. a LoRA-
    adapted one), in fp32, with the same convention: the mean over the targets that count, 0 if none."""
    flat = targets.reshape(-1)
    logits = logits.reshape(flat.shape[0], -1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit logits in fp32
    total = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction="sum")
    return total / (flat != ignore_index).sum().clamp(min=1)
