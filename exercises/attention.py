"""Exercise 1, attention: GPT-2's causal self-attention, the forward math written out.

Read first: lib/gpt.py, GPT and Block: where attention sits in a block. The reference solution is
lib/gpt.py, CausalSelfAttention (it calls PyTorch's fused F.scaled_dot_product_attention; write the steps
yourself, with plain matmuls and softmax).

Hint, for x [B, T, C] and n_head heads of width D = C / n_head:
  1. q, k, v = c_attn(x) split in three along the last dimension, each [B, T, C];
  2. each reshaped to [B, n_head, T, D]: every head attends on its own;
  3. scores = q @ k^T / sqrt(D), [B, n_head, T, T]: how much position t looks at position s;
  4. the causal mask: scores[..., t, s] = -inf where s > t, so no position sees a later token;
  5. softmax over s (the last dimension); dropout with p = self.dropout on it while training;
  6. y = weights @ v, [B, n_head, T, D], the heads put side by side again: [B, T, C];
  7. c_proj, then resid_dropout.

Check:  python -m pytest exercises/test_attention.py
Run:    BYHAND_EXERCISE=attention python train.py      (train.py's tiny GPT trains with your attention)
"""

import math  # noqa: F401  (sqrt for the scale)

import torch  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401

REFERENCE = {"CausalSelfAttention": "lib.gpt.CausalSelfAttention"}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        """Given, not part of the exercise: the layers, named and ordered as GPT-2's so that its weights load."""
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # queries, keys, values in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout  # the probability for the attention weights
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]: each position's output depends on positions 0..t only."""
        raise NotImplementedError("exercises/attention.py: write CausalSelfAttention.forward")
