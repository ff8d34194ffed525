"""exercises/wpo_lse.py against train_wpo_sgm_memory_efficient.py (python -m pytest exercises/test_wpo_lse.py)."""

import math

import pytest
import torch

import train_wpo_sgm_memory_efficient as ref
from lib import exercise

impl = exercise.load("wpo_lse")
EPS = 0.01


def test_two_chunks_by_hand():
    # chunk 1: shift 0, s 1, G (1, 0), H 1; chunk 2: shift ln 2, s 1, G (0, 2), H 4. Common shift ln 2: chunk 1
    # is rescaled by e^(0 - ln 2) = 1/2, chunk 2 by 1: s = 1.5, G = (0.5, 2), H = 0.5 + 4 = 4.5, either order.
    first = (torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), torch.tensor([1.0]))
    second = (torch.tensor([math.log(2)]), torch.tensor([1.0]), torch.tensor([[0.0, 2.0]]), torch.tensor([4.0]))
    for a, b in ((first, second), (second, first)):
        m, s, G, H = impl.combine(a, b)
        assert m.item() == pytest.approx(math.log(2)) and s.item() == pytest.approx(1.5)
        assert G.tolist() == [pytest.approx([0.5, 2.0])] and H.item() == pytest.approx(4.5)


def test_far_apart_shifts_neither_overflow_nor_underflow_the_larger():
    # shifts 1000 and -1000 (log-densities that far apart happen): e^1000 is inf in float32, so the merge must
    # only ever take e^(negative); the second chunk then weighs e^-2000 = 0 and the result is the first chunk.
    first = (torch.tensor([1000.0, -1000.0]), torch.tensor([2.0, 1.0]), torch.tensor([[1.0], [3.0]]),
             torch.tensor([5.0, 7.0]))
    second = (torch.tensor([-1000.0, 1000.0]), torch.tensor([1.0, 3.0]), torch.tensor([[4.0], [6.0]]),
              torch.tensor([8.0, 9.0]))
    m, s, G, H = impl.combine(first, second)
    assert m.tolist() == [1000.0, 1000.0] and s.tolist() == [2.0, 3.0]
    assert G.tolist() == [[1.0], [6.0]] and H.tolist() == [5.0, 9.0]


def setup(dim=3, centres=7, batch=5):
    torch.manual_seed(0)
    net = ref.FactorNet(dim, depth=1, hidden=8)
    with torch.no_grad():
        net.out.weight.normal_(0, 0.3)
    return net, torch.randn(batch, dim) * 2, torch.randn(centres, dim) * 2


@pytest.mark.parametrize("chunk", [1, 2, 3, 6])  # 7 centres: chunks of 1, and uneven ones (3 + 3 + 1, 6 + 1)
def test_chunked_equals_single_pass_with_gradients(chunk, monkeypatch):
    net, x, centres = setup()
    whole = ref.chunk_stats(net, x, centres, EPS)
    loss = ref.loss_from_stats(*whole[1:])
    want_grads = torch.autograd.grad(loss, list(net.parameters()))
    # your combine, folded over the chunks by the script's own mixture_stats (checkpointed chunks and all)
    monkeypatch.setattr(ref, "combine", impl.combine)
    parts = ref.mixture_stats(net, x, centres, EPS, chunk_size=chunk)
    assert torch.allclose(parts[0], whole[0], atol=1e-5)  # the shift of the union: the largest of all a_k
    for got, want in zip(parts[1:], whole[1:]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    chunked_loss = ref.loss_from_stats(*parts[1:])
    assert chunked_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for got, want in zip(torch.autograd.grad(chunked_loss, list(net.parameters())), want_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
