"""lib/lm_loss: the chunked cross-entropy over the LM head against a golden value by hand and against
F.cross_entropy on the full logits (loss and both gradients), with ignored targets, tied weights,
autocast, frozen parts, odd chunk sizes, and a check that no [tokens, vocab] tensor is ever made."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lib import gpt, lm_loss, memory

MODES = [False, True]  # recompute: gradients made in forward, or made in backward from logits made again


def full_reference(hidden, weight, targets, reduction="mean"):
    """The plain way: all the logits, F.cross_entropy in fp32 (as lib/gpt did before lib/lm_loss)."""
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 for fp64 tests
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction=reduction)


def grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in tensors]


def leaves(n, c, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, c, generator=g, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("recompute", MODES)
def test_golden_two_tokens_three_classes_by_hand(recompute):
    # W = I, so the logits are the hidden states: z1 = (1, 2, 3) with target 2, z2 = (0, 0, 0) with target 0.
    hidden = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    weight = torch.eye(3, requires_grad=True)
    targets = torch.tensor([2, 0])
    loss = lm_loss.linear_cross_entropy(hidden, weight, targets, chunk_size=1, recompute=recompute)
    s = math.exp(1) + math.exp(2) + math.exp(3)
    loss1 = math.log(s) - 3  # = log(1 + e^-1 + e^-2) = 0.407606
    loss2 = math.log(3)  # uniform over 3 classes = 1.098612
    assert loss.item() == pytest.approx((loss1 + loss2) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.7531090, abs=1e-6)
    loss.backward()
    # dL/dz = (softmax - onehot) / 2 rows; with W = I, d_hidden = dL/dz and d_W = dL/dz^T @ hidden.
    p1 = [math.exp(1) / s, math.exp(2) / s, math.exp(3) / s]
    dz = torch.tensor([[p1[0], p1[1], p1[2] - 1], [1 / 3 - 1, 1 / 3, 1 / 3]]) / 2
    torch.testing.assert_close(hidden.grad, dz, rtol=0, atol=1e-6)
    torch.testing.assert_close(weight.grad, dz.t() @ hidden.detach(), rtol=0, atol=1e-6)
    # The second token ignored: the mean is over the first alone, and row 2 gets no gradient.
    hidden.grad = weight.grad = None
    loss = lm_loss.linear_cross_entropy(hidden, weight, torch.tensor([2, -100]), recompute=recompute)
    assert loss.item() == pytest.approx(loss1, abs=1e-6)
    loss.backward()
    assert torch.equal(hidden.grad[1], torch.zeros(3))
    torch.testing.assert_close(hidden.grad[0], dz[0] * 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("recompute", MODES)
@pytest.mark.parametrize("chunk", [7, 50, 1000, None])  # does not divide 50; exactly 50; more than N; default
def test_loss_and_gradients_equal_full_cross_entropy(recompute, chunk):
    hidden, weight, targets = leaves(50, 16, 97)
    targets[::5] = -100
    ref, (rh, rw) = grads(lambda: full_reference(hidden, weight, targets), hidden, weight)
    got, (gh, gw) = grads(lambda: lm_loss.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk,
                                                               recompute=recompute), hidden, weight)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recompute", MODES)
def test_sum_reduction_3d_hidden_and_a_scaled_loss(recompute):
    hidden, weight, targets = leaves(24, 8, 31, dtype=torch.float64)
    h3, t3 = hidden.view(2, 12, 8), targets.view(2, 12)
    ref, (rh, rw) = grads(lambda: 3.0 * full_reference(hidden, weight, targets, "sum"), hidden, weight)
    got, (gh, gw) = grads(lambda: 3.0 * lm_loss.linear_cross_entropy(h3, weight, t3, chunk_size=5, reduction="sum",
                                                                     recompute=recompute), hidden, weight)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("recompute", MODES)
def test_all_targets_ignored_gives_zero_and_zero_gradients(recompute):
    hidden, weight, _ = leaves(6, 4, 9)
    targets = torch.full((6,), -100)
    assert math.isnan(full_reference(hidden, weight, targets).item())  # what F.cross_entropy does: 0 / 0
    loss, (gh, gw) = grads(lambda: lm_loss.linear_cross_entropy(hidden, weight, targets, recompute=recompute),
                           hidden, weight)
    assert loss.item() == 0.0
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


@pytest.mark.parametrize("recompute", MODES)
def test_frozen_weight_or_hidden_gets_no_gradient_and_no_work(recompute, monkeypatch):
    hidden, weight, targets = leaves(20, 8, 33)
    _, (rh, rw) = grads(lambda: full_reference(hidden, weight, targets), hidden, weight)
    calls = []
    real = lm_loss._add_weight_grad
    monkeypatch.setattr(lm_loss, "_add_weight_grad", lambda *a: calls.append(1) or real(*a))
    frozen_w = weight.detach()  # a frozen head (LoRA, the judge): no d_W is ever computed
    hidden.grad = None
    lm_loss.linear_cross_entropy(hidden, frozen_w, targets, chunk_size=6, recompute=recompute).backward()
    torch.testing.assert_close(hidden.grad, rh, rtol=1e-5, atol=1e-7)
    assert calls == []
    weight.grad = None
    lm_loss.linear_cross_entropy(hidden.detach(), weight, targets, chunk_size=6, recompute=recompute).backward()
    torch.testing.assert_close(weight.grad, rw, rtol=1e-5, atol=1e-7)
    assert len(calls) == 4  # ceil(20 / 6) chunks
    with torch.no_grad():  # evaluation: the loss only
        calls.clear()
        loss = lm_loss.linear_cross_entropy(hidden, weight, targets, recompute=recompute)
    assert not loss.requires_grad and calls == []


def test_the_gradients_made_in_forward_refuse_a_second_backward():
    hidden, weight, targets = leaves(4, 4, 5)
    loss = lm_loss.linear_cross_entropy(hidden, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("recompute", MODES)
def test_cpu_bf16_autocast_matches_the_full_loss_under_the_same_autocast_and_fp32(recompute):
    hidden, weight, targets = leaves(40, 32, 200, seed=1)
    targets[3] = -100
    lin = lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, (rh, rw) = grads(lin, hidden, weight)
        got, (gh, gw) = grads(lambda: lm_loss.linear_cross_entropy(hidden, weight, targets, chunk_size=16,
                                                                   recompute=recompute), hidden, weight)
    fp32, (fh, fw) = grads(lambda: full_reference(hidden, weight, targets), hidden, weight)
    assert got.dtype == torch.float32 and gh.dtype == hidden.dtype and gw.dtype == weight.dtype
    # Same bf16 logits, same fp32 log-sum-exp: the losses agree to fp32 rounding.
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    assert got.item() == pytest.approx(fp32.item(), rel=2e-3)  # bf16 logits against fp32 ones
    # Gradients through bf16 matmuls (bf16 rounds to within 2^-8 = 0.4%): within a few epsilons of the
    # largest entry, against the full loss under the same autocast and against fp32.
    assert (gh - rh).abs().max() <= 1e-2 * rh.abs().max() and (gw - rw).abs().max() <= 1e-2 * rw.abs().max()
    assert (gh - fh).abs().max() <= 2e-2 * fh.abs().max() and (gw - fw).abs().max() <= 2e-2 * fw.abs().max()


@pytest.mark.parametrize("recompute", MODES)
def test_tied_weights_inside_a_tiny_gpt_add_both_gradients(recompute, monkeypatch):
    cfg = gpt.GPTConfig(block_size=16, vocab_size=300, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    idx, targets = torch.randint(0, 300, (3, 16)), torch.randint(0, 300, (3, 16))
    logits, _ = model(idx)
    model.zero_grad()
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    real = lm_loss.linear_cross_entropy
    monkeypatch.setattr(lm_loss, "linear_cross_entropy",
                        lambda *a, **k: real(*a, chunk_size=10, recompute=recompute, **k))
    out, loss = model(idx, targets)
    assert out is None  # no logits when there are targets
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, p in model.named_parameters():  # wte's gradient: the embedding's and the head's, added
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_causal_lm_loss_shifts_the_labels_as_transformers_does():
    hidden, weight, _ = leaves(2 * 7, 8, 40, dtype=torch.float64)
    h = hidden.view(2, 7, 8)
    labels = torch.randint(0, 40, (2, 7))
    labels[0, :3] = -100  # a prompt
    logits = h @ weight.t()
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 40), labels[:, 1:].reshape(-1), ignore_index=-100)
    got = lm_loss.causal_lm_loss(h, weight, labels, chunk_size=4)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)
    assert lm_loss.logits_cross_entropy(logits[:, :-1], labels[:, 1:]).item() == pytest.approx(ref.item(), rel=1e-12)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("recompute", MODES)
def test_no_tensor_of_tokens_x_vocab_is_ever_made(recompute):
    n, c, v, chunk = 256, 16, 3000, 32
    hidden, weight, targets = leaves(n, c, v)
    with LargestTensor() as mode:
        lm_loss.linear_cross_entropy(hidden, weight, targets, chunk_size=chunk, recompute=recompute).backward()
    assert mode.largest == chunk * v  # one chunk's logits; the full logits would be n * v = 8 x more
    with LargestTensor() as mode:
        full_reference(hidden, weight, targets).backward()
    assert mode.largest == n * v


def test_default_chunk_size_from_vocabulary_and_width():
    # At least 256 rows (fast matmuls), more while the fp32 logits (plus the rows' hidden states and
    # gradients) fit 128 MiB: a small vocabulary gets many rows, GPT-2's 664, Qwen2's 256.
    assert lm_loss.default_chunk_size(1000, 64) == 128 * 2**20 // (4 * (1000 + 128)) == 29746
    assert lm_loss.default_chunk_size(50257, 128) == 128 * 2**20 // (4 * (50257 + 256)) == 664
    assert lm_loss.default_chunk_size(151936, 1536) == 256
    # Chunks of equal size: 1,024 rows with at most 664 are two of 512; 1,000 with 256 are four of 250.
    assert lm_loss.chunk_rows(1024, 664) == 512 and lm_loss.chunk_rows(1000, 256) == 250
    assert lm_loss.chunk_rows(7, 256) == 7 and lm_loss.chunk_rows(20, 7) == 7  # 7, 7, 6
    # The estimate: one chunk's fp32 logits and d_hidden; under autocast also 16-bit copies.
    assert memory.lm_loss_bytes(1024, 50257, 128) == 512 * 50257 * 4 + 1024 * 128 * 4
    assert memory.lm_loss_bytes(10, 50257, 128, train_head=False) == 10 * 50257 * 4 + 10 * 128 * 4
    assert memory.lm_loss_bytes(1024, 50257, 128, compute_bytes=2) == (512 * 50257 * 6 + 1024 * 128 * 4
                                                                       + 2 * 50257 * 128 * 2)


def test_bad_arguments_are_refused():
    hidden, weight, targets = leaves(4, 4, 5)
    with pytest.raises(ValueError, match="hidden size"):
        lm_loss.linear_cross_entropy(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        lm_loss.linear_cross_entropy(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="reduction"):
        lm_loss.linear_cross_entropy(hidden, weight, targets, reduction="none")
