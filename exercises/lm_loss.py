"""Exercise 2, lm_loss: the language-model loss that never holds the full logits.

Read first: docs/big_vocab_loss.md (why the logits are a small model's largest tensor, and the arithmetic
below). The reference solution is lib/lm_loss.py, linear_cross_entropy and _LinearCrossEntropy.

The loss is F.cross_entropy(hidden @ weight.T, targets), but [N, V] logits (tokens x vocabulary) must never
exist at once: take chunk_size rows at a time. Per row i with target t_i and logits z_i = h_i W^T:
    loss_i = logsumexp(z_i) - z_i[t_i]              (subtract the row max before exp, for fp32's range)
    dloss_i/dz_i = softmax(z_i) - onehot(t_i)        (divided by the number of counted targets, for the mean)
    d_hidden[rows] = dz @ W        d_W += dz^T @ hidden[rows]
Two ways to write it, both fine here: a torch.autograd.Function (skeleton below) whose forward makes each
chunk's gradients while its logits exist (or keeps one log-sum-exp per row and makes the logits again in
backward: recompute); or a loop of torch.utils.checkpoint calls, one per chunk, so autograd recomputes.
Rows whose target is ignore_index count for nothing; when none counts the mean is 0 (not nan).

Check:  python -m pytest exercises/test_lm_loss.py
Run:    BYHAND_EXERCISE=lm_loss python train.py        (train.py's tiny GPT trains with your loss)
"""

import torch
import torch.nn.functional as F  # noqa: F401

REFERENCE = {"linear_cross_entropy": "lib.lm_loss.linear_cross_entropy"}


class LinearCrossEntropy(torch.autograd.Function):
    """A skeleton if you take the autograd.Function road (you may also delete it and recompute by checkpoint)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_size, reduction):
        """hidden [N, C], weight [V, C], targets [N] -> the loss, a 0-dim tensor; save for backward what it
        needs (ctx.save_for_backward), never [N, V]."""
        raise NotImplementedError("exercises/lm_loss.py: write LinearCrossEntropy.forward")

    @staticmethod
    def backward(ctx, grad_loss):
        """-> one gradient per forward input: d_hidden, d_weight, then None for the four that are not tensors."""
        raise NotImplementedError("exercises/lm_loss.py: write LinearCrossEntropy.backward")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_size: int | None = None,
                         reduction: str = "mean", recompute: bool = False) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, targets) without ever holding all the logits.

    hidden [N, C] or [..., C] (the final, normalised hidden states); weight [V, C] (the LM head's,
    e.g. the tied embedding); targets [N] or [...] of class ids, ignore_index for "no target".
    reduction "mean" (over the targets that count; 0 when none does) or "sum". chunk_size: rows per
    chunk (None: your choice, e.g. lib.lm_loss.default_chunk_size(V, C)). recompute: make the gradients
    in backward from logits made again instead of in forward (you may ignore it and always do one).
    Gradients flow to hidden and weight as F.linear's would; the head has no bias.
    """
    raise NotImplementedError("exercises/lm_loss.py: write linear_cross_entropy")
