"""Checks for exercises/nf4.py: a block quantised by hand, every NF4 code rebuilt exactly, the bytes and the
double-quantised absmaxes against lib/nf4, and the figures of docs/qlora_explained.md (9.2% relative RMS error on
N(0, 1) weights in blocks of 64, 4.127 bits per weight with double quantisation)."""

import pytest
import torch

from lib import exercise, nf4

impl = exercise.load("nf4")
CODES = torch.tensor(nf4.NF4_CODEBOOK)


def test_a_block_by_hand():
    # Block 1, absmax 1: 0.5 lies below the midpoint 0.5017 of 0.4407 and 0.5626, so code 12 (0.4407); -1.0 is
    # code 0; 0.25 is code 10 (0.2461, midpoint 0.2920); 0 is code 7. Block 2, absmax 2: 2.0 / 2 = 1.0 is code 15,
    # -0.3 / 2 = -0.15 lies below the midpoint -0.1379 of -0.1848 and -0.0911: code 5, rebuilt as -0.3696.
    w = torch.zeros(2, 64)
    w[0, :4] = torch.tensor([0.5, -1.0, 0.25, 0.0])
    w[1, :2] = torch.tensor([2.0, -0.3])
    q = impl.quantize_nf4(w, double_quant=False)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (64,)
    assert q.packed[:2].tolist() == [12 * 16 + 0, 10 * 16 + 7] and q.packed[32].item() == 15 * 16 + 5
    assert set(q.packed[2:32].tolist()) == {7 * 16 + 7}, "zeros are code 7 (0.0) in both nibbles"
    assert q.absmax.tolist() == [1.0, 2.0] and q.absmax_scale is None
    back = impl.dequantize_nf4(q)
    torch.testing.assert_close(back[0, :4], torch.tensor([0.44070982933044434, -1.0, 0.24611230194568634, 0.0]))
    torch.testing.assert_close(back[1, :2], torch.tensor([2.0, -0.18477343022823334 * 2]))


def test_every_code_is_rebuilt_exactly():
    w = torch.stack([CODES * 3, CODES.flip(0) * 0.5])  # each block holds all 16 codes, scaled by its absmax
    for double_quant in (False, True):
        back = impl.dequantize_nf4(impl.quantize_nf4(w, block_size=16, double_quant=double_quant))
        assert back.shape == w.shape and back.dtype == w.dtype
        torch.testing.assert_close(back, w, atol=1e-6, rtol=1e-6)


def test_bytes_and_absmaxes_match_the_reference():
    w = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 0.02  # 350 weights: a short last block
    w[3] = 0  # and an all-zero stretch
    for double_quant in (True, False):
        yours, ref = impl.quantize_nf4(w, double_quant=double_quant), nf4.quantize_nf4(w, double_quant=double_quant)
        assert torch.equal(yours.packed, ref.packed), "the 4-bit codes differ"
        assert yours.absmax.dtype == ref.absmax.dtype and torch.equal(yours.absmax, ref.absmax)
        if double_quant:
            torch.testing.assert_close(yours.absmax_scale, ref.absmax_scale)
            torch.testing.assert_close(yours.absmax_mean, ref.absmax_mean)
        # Each half read back by the other: the same format, not just a self-consistent one.
        torch.testing.assert_close(impl.dequantize_nf4(ref), nf4.dequantize_nf4(ref), atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(nf4.dequantize_nf4(yours), nf4.dequantize_nf4(ref), atol=1e-7, rtol=1e-6)
    assert impl.dequantize_nf4(ref, torch.float64).dtype == torch.float64


def test_double_quantisation_of_the_absmaxes():
    absmax = torch.rand(600, generator=torch.Generator().manual_seed(1)) * 0.1 + 0.05  # positive, similar
    codes, scale, mean = impl.quantize_absmax(absmax)
    assert codes.dtype == torch.int8 and codes.shape == (600,) and scale.shape == (3,) and mean.shape == ()
    ref_codes, ref_scale, ref_mean = nf4.quantize_absmax(absmax)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close((scale, mean), (ref_scale, ref_mean))
    back = impl.dequantize_absmax(codes, scale, mean)
    # By hand: an error of at most half a step of its block's scale.
    steps = scale.repeat_interleave(256)[:600]
    assert ((back - absmax).abs() <= steps / 2 + 1e-7).all()
    torch.testing.assert_close(back, nf4.dequantize_absmax(ref_codes, ref_scale, ref_mean))


def test_the_figures_of_the_doc_page():
    w = torch.randn(256, 768, generator=torch.Generator().manual_seed(0))
    q = impl.quantize_nf4(w)
    error = ((impl.dequantize_nf4(q) - w).norm() / w.norm()).item()
    assert 0.088 < error < 0.096, f"relative RMS error {error:.4f}; NF4 in blocks of 64 gives 9.2%"
    assert round(nf4.bits_per_parameter(q), 3) == 4.127  # 4 + 8/64 + 32/(64 * 256), plus the mean's 32 bits
    assert round(nf4.bits_per_parameter(impl.quantize_nf4(w, double_quant=False)), 3) == 4.5


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        impl.quantize_nf4(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError):
        impl.quantize_nf4(torch.ones(10), block_size=3)
