"""Checks for exercises/lm_loss.py: the loss and the gradients of hidden and weight against F.cross_entropy on
the full logits and against lib/lm_loss, ignored targets included, and that no [N, V] tensor is ever made."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lib import exercise, lm_loss

impl = exercise.load("lm_loss")
N, C, V, CHUNK = 64, 8, 96, 8  # 8 chunks of 8 rows; the full logits would be 64 x 96
TOL = dict(atol=1e-5, rtol=1e-4)  # fp32: the sums run in another order than F.cross_entropy's


def problem(seed=0, ignored=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, generator=g).requires_grad_()
    weight = torch.randn(V, C, generator=g).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.randperm(N, generator=g)[:ignored]] = -100
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets, **kw):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, targets, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def full_logits(h, w, t, reduction="mean", **_):
    return F.cross_entropy(h @ w.T, t, ignore_index=-100, reduction=reduction)


@pytest.mark.parametrize("recompute", [False, True])
def test_loss_and_gradients_match_full_logits(recompute):
    hidden, weight, targets = problem()
    yours = loss_and_grads(impl.linear_cross_entropy, hidden, weight, targets, chunk_size=CHUNK, recompute=recompute)
    full = loss_and_grads(full_logits, hidden, weight, targets)
    for got, want, what in zip(yours, full, ("loss", "d_hidden", "d_W")):
        torch.testing.assert_close(got, want, **TOL, msg=what)


def test_ignored_targets_count_for_nothing():
    hidden, weight, targets = problem(seed=1, ignored=20)
    yours = loss_and_grads(impl.linear_cross_entropy, hidden, weight, targets, chunk_size=CHUNK)
    for got, want in zip(yours, loss_and_grads(full_logits, hidden, weight, targets)):
        torch.testing.assert_close(got, want, **TOL)  # the mean over the 44 targets that count
    assert (yours[1][targets == -100] == 0).all(), "an ignored row got a gradient"
    # Every target ignored: the mean is 0 with zero gradients (F.cross_entropy would give nan).
    loss, d_hidden, d_weight = loss_and_grads(impl.linear_cross_entropy, hidden, weight, torch.full((N,), -100),
                                              chunk_size=CHUNK)
    assert loss.item() == 0 and not d_hidden.any() and not d_weight.any()


def test_sum_and_batched_shapes_match_the_reference():
    hidden, weight, targets = problem(seed=2, ignored=5)
    shaped = hidden.detach().view(4, 16, C), weight, targets.view(4, 16)  # [B, T, C] as a GPT's forward passes
    for kw in (dict(reduction="sum"), dict()):
        yours = loss_and_grads(impl.linear_cross_entropy, *shaped, chunk_size=CHUNK, **kw)
        ref = loss_and_grads(lm_loss.linear_cross_entropy, *shaped, chunk_size=CHUNK, **kw)
        for got, want in zip(yours, ref):
            torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(impl.linear_cross_entropy(*shaped), full_logits(hidden, weight, targets), **TOL)


class Largest(TorchDispatchMode):
    """Sees every tensor any operation makes (forward and backward) and keeps the largest size."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("recompute", [False, True])
def test_no_tensor_as_large_as_the_logits(recompute):
    hidden, weight, targets = problem(seed=3)
    with Largest() as seen:
        impl.linear_cross_entropy(hidden, weight, targets, chunk_size=CHUNK, recompute=recompute).backward()
    assert hidden.grad is not None and weight.grad is not None
    # A chunk's logits are 8 x 96; all of them, 64 x 96, must never be made (half of them neither).
    assert seen.numel < N * V // 2, f"a tensor of {seen.numel} elements was made; the full logits have {N * V}"
