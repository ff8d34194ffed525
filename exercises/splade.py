"""Exercise splade: the SPLADE document representation and its FLOPS regulariser.

Read first: docs/splade_explained.md (sections 1 and 3: the max-pooled log-saturated weights, and FLOPS).
Reference solution: train_splade_unified.py (splade_max, flops).
Test:    python -m pytest exercises/test_splade.py
Run:     BYHAND_EXERCISE=splade python train_splade_unified.py   (your representation and regulariser train the
         real sparse retriever; train_splade_optimized.py uses them too)

Hint: mask the padded positions so that they can never be the max (-inf before the max, or a 0 after the
activation, since log(1 + relu(x)) >= 0), then reduce over the sequence dimension. FLOPS is one line.
"""

import torch  # noqa: F401

REFERENCE = {"splade_max": "train_splade_unified.splade_max", "flops": "train_splade_unified.flops"}


def splade_max(logits, attention_mask):
    """SPLADE-max: w_j = max over unmasked positions i of log(1 + ReLU(logit_ij)); [B, T, V] -> [B, V].

    logits: [B, T, V] masked-language-model logits (any float dtype; return float32); attention_mask: [B, T],
    1 for a real token, 0 for padding. Must be differentiable (training backpropagates through it).
    """
    raise NotImplementedError("exercise splade: splade_max")


def flops(reps):
    """naver/splade's FLOPS regulariser: sum over terms of (mean weight over the batch)^2. reps: [B, V] -> scalar."""
    raise NotImplementedError("exercise splade: flops")
