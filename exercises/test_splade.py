"""exercises/splade.py against train_splade_unified.py (python -m pytest exercises/test_splade.py)."""

import math

import pytest
import torch

import train_splade_unified as ref
from lib import exercise

impl = exercise.load("splade")


def test_splade_max_by_hand():
    # one text of 3 positions (the last one padding), 2 terms: term 0's max over the real positions is e - 1,
    # log(1 + e - 1) = 1; term 1 is negative everywhere it counts, relu -> 0. The padding's 5 and 3 are ignored.
    logits = torch.tensor([[[1.0, -1.0], [math.e - 1, -2.0], [5.0, 3.0]]])
    got = impl.splade_max(logits, torch.tensor([[1, 1, 0]]))
    assert got.dtype == torch.float32 and got.shape == (1, 2)
    assert got.tolist() == [pytest.approx([1.0, 0.0], abs=1e-6)]


def test_splade_max_values_and_gradients_match_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g) * 2
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    weights = torch.randn(3, 7, generator=g)
    grads = []
    for fn in (impl.splade_max, ref.splade_max):
        x = logits.clone().requires_grad_()
        out = fn(x, mask)
        (out * weights).sum().backward()
        grads.append((out.detach(), x.grad))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)  # only the max position of each term gets any
    assert grads[0][1][mask == 0].abs().sum() == 0
    with torch.no_grad():  # encoding for search: the same weights without a graph; bf16 logits give float32
        assert torch.allclose(impl.splade_max(logits.clone(), mask), grads[1][0], atol=1e-6)
        assert impl.splade_max(logits.bfloat16(), mask).dtype == torch.float32


def test_flops_by_hand_and_gradient():
    # rows (1, 0, 2) and (3, 2, 0): means (2, 1, 1), FLOPS 4 + 1 + 1 = 6; d/dw_bj = 2 mean_j / B = mean_j
    reps = torch.tensor([[1.0, 0.0, 2.0], [3.0, 2.0, 0.0]], requires_grad=True)
    value = impl.flops(reps)
    assert value.item() == pytest.approx(6.0)
    value.backward()
    assert torch.allclose(reps.grad, torch.tensor([[2.0, 1.0, 1.0], [2.0, 1.0, 1.0]]))
    x = torch.rand(4, 9, generator=torch.Generator().manual_seed(1))
    assert impl.flops(x).item() == pytest.approx(ref.flops(x).item(), rel=1e-6)
