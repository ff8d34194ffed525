"""Exercise wpo_lse: the online log-sum-exp that lets WPO-SGM's loss see its K centres a chunk at a time.

Read first: docs/wpo_sgm_memory.md (the chunked strategy), then chunk_stats and mixture_stats in
train_wpo_sgm_memory_efficient.py, which call the function you write.
Reference solution: train_wpo_sgm_memory_efficient.py (combine).
Test:    python -m pytest exercises/test_wpo_lse.py
Run:     BYHAND_EXERCISE=wpo_lse python train_wpo_sgm_memory_efficient.py --strategy chunked --chunk_size 7
         (your merge inside the real chunked training, 7 centres at a time)

Hint: a chunk's statistics are sums of e^(a_k - m) terms, each chunk with its own shift m (its largest a_k, one
per sample). Two chunks' sums can only be added once they are relative to the same shift: rescale each by
e^(its m - the common m). Choose the common shift so that no exponent is positive (nothing can overflow), the
trick flash attention uses for its softmax.
"""

import torch  # noqa: F401

REFERENCE = {"combine": "train_wpo_sgm_memory_efficient.combine"}


def combine(first, second):
    """Merge two chunks' statistics exactly: rescale both to the larger shift (the flash-attention trick).

    first and second are tuples (m [B], s [B], G [B, D], H [B]) as chunk_stats returns them: for chunk c,
    s = sum_k e^(a_k - m), G = sum_k e^(a_k - m) g_k, H = sum_k e^(a_k - m) h_k over the chunk's centres k.
    Returns the same tuple for the union of the two chunks. Must be differentiable in s, G and H.
    """
    raise NotImplementedError("exercise wpo_lse: combine")
