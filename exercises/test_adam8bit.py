"""exercises/adam8bit.py against lib/adam8bit.py and torch.optim.AdamW (python -m pytest exercises/test_adam8bit.py)."""

import pytest
import torch

from lib import adam8bit as ref
from lib import exercise

impl = exercise.load("adam8bit")


def moments(n=1000, seed=0):
    """A signed first moment and a non-negative second moment spanning several decades, n values (not whole blocks)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 0, (n,), generator=g)
    return m, m.square() + 1e-3 * torch.rand(n, generator=g)


def test_quantize_gives_the_nearest_table_entry():
    for x, signed in zip(moments(), (True, False)):
        codes, absmax = impl.quantize_blockwise(x, signed)
        want_codes, want_absmax = ref.quantize_blockwise(x, signed)
        assert codes.dtype == torch.uint8 and codes.shape == (1000,)
        assert torch.equal(absmax, want_absmax)  # 4 blocks: 256, 256, 256, 232 values
        # the same codes, but for a value that lies within float rounding of a boundary between two entries
        assert (codes != want_codes).sum() <= 2
        table = ref.create_dynamic_map(signed)
        err = (table[codes.long()] - x / absmax.repeat_interleave(256)[:1000]).abs()
        want_err = (table[want_codes.long()] - x / want_absmax.repeat_interleave(256)[:1000]).abs()
        assert torch.allclose(err, want_err, atol=1e-6)


def test_quantize_by_hand():
    # block [0.5, -1, 0, -1e-9] (absmax 1): 1 -> the last signed entry is 1.0, the first -0.99296875 (no -1.0),
    # 0 -> the 0 entry, and -1e-9 keeps its sign: the smallest negative entry, -0.55e-6, not 0.
    table = ref.create_dynamic_map(True)
    codes, absmax = impl.quantize_blockwise(torch.tensor([0.5, -1.0, 0.0, -1e-9, 2.0, 2.0]), True, block_size=4)
    assert absmax.tolist() == [1.0, 2.0]
    got = table[codes.long()].tolist()
    assert got[1] == pytest.approx(-0.99296875) and got[2] == 0.0 and got[3] == pytest.approx(-0.55e-6)
    assert got[4] == got[5] == 1.0 and abs(got[0] - 0.5) < 0.01
    # a block of zeros: absmax 0, every code the 0 entry (unsigned: code 0)
    codes, absmax = impl.quantize_blockwise(torch.zeros(5), False, block_size=4)
    assert absmax.tolist() == [0.0, 0.0] and codes.tolist() == [0] * 5


def test_dequantize_matches_the_reference_exactly():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (600,), generator=g, dtype=torch.uint8)
    absmax = torch.rand(3, generator=g) + 0.5
    for signed in (True, False):
        got = impl.dequantize_blockwise(codes, absmax, signed)
        want = ref.dequantize_blockwise(codes, absmax, signed)
        assert got.shape == (3, 256) and torch.equal(got, want)  # 600 values, zero-padded to 3 x 256


def _run(update, steps, n=1000, block_size=256, lr=1e-2, wd=1e-2):
    """`steps` AdamW steps of weights [n] with 8-bit moments through `update`; fp32 AdamW on the same gradients."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, generator=g)
    w32 = torch.nn.Parameter(w.clone())
    blocks = -(-n // block_size)
    zero = int((ref.create_dynamic_map(True) == 0).nonzero()[0])
    state = [torch.full((n,), zero, dtype=torch.uint8), torch.zeros(blocks), torch.zeros(n, dtype=torch.uint8),
             torch.zeros(blocks)]
    opt = torch.optim.AdamW([w32], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g) * 0.1
        update(w, grad, *state, step, lr, (0.9, 0.999), 1e-8, wd, block_size)
        w32.grad = grad
        opt.step()
    return w, state, w32.detach()


def test_update_matches_the_reference_and_stays_near_fp32_adamw():
    w, state, w32 = _run(impl.adamw8bit_update, steps=5)
    want_w, want_state, _ = _run(ref.adamw8bit_update, steps=5)
    assert (w - want_w).abs().max() < 1e-5
    for got, want in zip(state, want_state):  # codes may differ by one entry where rounding ties differ
        assert (got.long() - want.long()).abs().max() <= 1 if got.dtype == torch.uint8 else torch.allclose(got, want)
    # 5 steps of lr 1e-2 move each weight about 0.05; 8-bit moments keep it within 5% of that of fp32 AdamW
    assert (w - w32).abs().max() < 2.5e-3 and (w32 - _run(lambda *a: None, 0)[0]).abs().max() > 0.04


def test_update_first_step_by_hand():
    # step 1 from zero moments: m = 0.1 g, v = 0.001 g^2, bias-corrected m / sqrt(v) = sign(g): w -= lr sign(g)
    # (exactly, but for eps and the 8-bit rounding of m and v, which cancels in m / sqrt(v) to ~1%)
    w = torch.tensor([1.0, -2.0, 3.0, 0.5])
    zero = int((ref.create_dynamic_map(True) == 0).nonzero()[0])
    s1, a1, s2, a2 = torch.full((4,), zero, dtype=torch.uint8), torch.zeros(1), torch.zeros(4, dtype=torch.uint8), \
        torch.zeros(1)
    impl.adamw8bit_update(w, torch.tensor([0.3, -0.1, 0.2, -0.4]), s1, a1, s2, a2, 1, 0.1, (0.9, 0.999), 1e-8, 0.0, 4)
    assert torch.allclose(w, torch.tensor([0.9, -1.9, 2.9, 0.6]), atol=2e-3)
    # the stored moments: absmax 0.1 * 0.4 = 0.04 and 0.001 * 0.16 = 1.6e-4; g = -0.4 is its block's absmax
    assert a1.item() == pytest.approx(0.04) and a2.item() == pytest.approx(1.6e-4)
    m = ref.dequantize_blockwise(s1, a1, True, 4).view(-1)
    assert torch.allclose(m, 0.1 * torch.tensor([0.3, -0.1, 0.2, -0.4]), rtol=0.02)
