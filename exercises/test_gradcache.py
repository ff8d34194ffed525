"""exercises/gradcache.py against one full-batch step and train_splade_optimized.py
(python -m pytest exercises/test_gradcache.py)."""

import pytest
import torch

import train_splade_optimized as ref
import train_splade_unified as unified
from lib import bert, exercise

impl = exercise.load("gradcache")
SCALER = torch.amp.GradScaler("cpu", enabled=False)
LAM_Q, LAM_D = 0.3, 0.1


def model_and_batches(dropout=0.0):
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=dropout,
                          attention_probs_dropout_prob=dropout)
    model = bert.init_weights(bert.build_model(cfg), std=0.5)
    micro = []
    for _ in range(2):  # 2 micro-batches of 2 queries (length 4) and 3 documents (2 positives, 1 negative; length 6)
        q_ids, d_ids = torch.randint(1, 40, (2, 4)), torch.randint(1, 40, (3, 6))
        q_mask, d_mask = torch.ones(2, 4, dtype=torch.long), torch.ones(3, 6, dtype=torch.long)
        q_mask[1, 3:], d_mask[2, 4:] = 0, 0
        micro.append(unified.Batch(q_ids * q_mask, q_mask, d_ids * d_mask, d_mask))
    return model, micro


def grads_of(step, dropout=0.0, seed=1):
    model, micro = model_and_batches(dropout)
    torch.manual_seed(seed)
    out = step(model, micro, LAM_Q, LAM_D, None, SCALER)
    return out, [p.grad.clone() for p in model.parameters()]


def full_batch(model, micro, *rest):
    """One big batch: every representation with its graph, the loss over all of them, one backward."""
    q = torch.cat([unified.encode_batch(model, mb.q_ids, mb.q_mask) for mb in micro])
    d = torch.cat([unified.encode_batch(model, mb.d_ids, mb.d_mask) for mb in micro])
    positives = torch.tensor([0, 1, 3, 4])  # micro-batch 1's documents start at row 3
    loss, stats = unified.splade_loss(q, d, LAM_Q, LAM_D, positives)
    loss.backward()
    return {"loss": loss.item(), **{k: v.item() for k, v in stats.items()}}


def test_same_loss_and_gradients_as_one_full_batch():
    out, grads = grads_of(impl.gradcache_step)
    want, want_grads = grads_of(full_batch)
    assert out["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert out["rank_loss"] == pytest.approx(want["rank_loss"], abs=1e-5)
    assert out["d_flops"] == pytest.approx(want["d_flops"], abs=1e-5)
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-5)


def test_differs_from_naive_accumulation():
    out, grads = grads_of(impl.gradcache_step)
    naive, naive_grads = grads_of(unified.naive_step)  # each query sees only its own micro-batch's 3 documents
    assert abs(out["rank_loss"] - naive["rank_loss"]) > 1e-2
    assert max((g - n).abs().max().item() for g, n in zip(grads, naive_grads)) > 1e-3


def test_dropout_masks_are_replayed():
    # With dropout, pass 2 must see the masks pass 1 saw: the same gradients as the reference from the same seed,
    # which differ from those without dropout (so the masks matter) and leave the random state where pass 1 did.
    out, grads = grads_of(impl.gradcache_step, dropout=0.3)
    after = torch.get_rng_state()
    want, want_grads = grads_of(ref.gradcache_step, dropout=0.3)
    assert torch.equal(after, torch.get_rng_state())
    _, no_dropout = grads_of(full_batch)
    assert out["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert max((w - n).abs().max().item() for w, n in zip(want_grads, no_dropout)) > 1e-3
    for g, w in zip(grads, want_grads):
        assert torch.allclose(g, w, atol=1e-5)
