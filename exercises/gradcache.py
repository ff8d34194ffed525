"""Exercise gradcache: GradCache, the exact gradient of a big contrastive batch, one micro-batch of activations
at a time.

Read first: docs/gradcache_explained.md (why naive accumulation loses negatives; the two passes).
Reference solution: train_splade_optimized.py (gradcache_step).
Test:    python -m pytest exercises/test_gradcache.py
Run:     BYHAND_EXERCISE=gradcache python train_splade_optimized.py --grad-accum 2   (your step trains the real
         SPLADE retriever, 2 micro-batches per update)

Hint: use unified.encode_batch(model, ids, mask, amp) for the representations and unified.splade_loss(q, d,
lam_q, lam_d, positives) for the loss; torch.autograd.backward(tensors, grad_tensors) backpropagates given
gradients. Dropout: save the random-number state before each micro-batch's pass-1 encoding and restore it before
its pass-2 encoding (on a CPU torch.get_rng_state / torch.set_rng_state; train_splade_optimized.rng_state shows
every device), and restore the state pass 1 ended with when you are done.
"""

import torch  # noqa: F401

import train_splade_unified as unified  # noqa: F401  (encode_batch, splade_loss)

REFERENCE = {"gradcache_step": "train_splade_optimized.gradcache_step"}


def gradcache_step(model, micro_batches, lam_q, lam_d, amp, scaler):
    """Loss and gradient of the whole effective batch, one micro-batch of activations at a time.

    micro_batches: train_splade_unified.Batch objects (q_ids, q_mask, d_ids, d_mask); micro-batch j's documents
    are its queries' positives (document i for query i), then hard negatives. Every query is ranked against the
    documents of ALL micro-batches, laid out micro-batch by micro-batch.
    1. Encode every micro-batch (its queries, then its documents) without building a graph; keep only the
       [rows, vocab] representations (and the random-number state each micro-batch started from).
    2. Compute the loss of the whole batch on those representations (as float32, requires_grad) and
       backpropagate scaler.scale(loss) to them: d loss / d rep for every query and document.
    3. Encode each micro-batch again, with a graph and the same dropout masks, and backpropagate its slice of
       those gradients into the weights.
    Leaves the gradients in the parameters' .grad; returns {"loss": float, and each of splade_loss's stats as a
    float}.
    """
    raise NotImplementedError("exercise gradcache: gradcache_step")
