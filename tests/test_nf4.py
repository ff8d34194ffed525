"""NF4 quantisation (lib/nf4.py), checked against hand values and a numpy reference."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lib import nf4

# Written out again here (not imported) so a typo in the library is caught.
CODEBOOK = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=np.float32)
# Midpoints between neighbouring codes, computed by hand to 7 decimals.
MIDPOINTS = [-0.8480964, -0.6106329, -0.4599953, -0.3396794, -0.2346074, -0.1379117, -0.0455250,
             0.0397901, 0.1202553, 0.2035212, 0.2920138, 0.3893125, 0.5016634, 0.6427869, 0.8614784]
MAX_GAP = 1.0 - 0.6961928009986877  # the widest gap is the first one, -1 .. -0.696


def unpack_codes(packed: torch.Tensor) -> np.ndarray:
    """High nibble first, by hand."""
    b = packed.cpu().numpy().astype(np.int64)
    return np.stack([b >> 4, b & 15], axis=1).reshape(-1)


def reference_absmax(q) -> np.ndarray:
    if q.absmax_scale is None:
        return q.absmax.cpu().numpy().astype(np.float64)
    codes = q.absmax.cpu().numpy().astype(np.float64)
    scales = q.absmax_scale.cpu().numpy().astype(np.float64)
    idx = np.arange(codes.size) // q.absmax_block_size
    return codes * scales[idx] + float(q.absmax_mean)


def reference_dequant(q) -> np.ndarray:
    codes = unpack_codes(q.packed).reshape(-1, q.block_size)
    vals = CODEBOOK[codes].astype(np.float64) * reference_absmax(q)[:, None]
    return vals.reshape(-1)[: math.prod(q.shape)].reshape(tuple(q.shape))


def test_codes_of_hand_values():
    mids = np.array(MIDPOINTS)
    values = np.concatenate([CODEBOOK, mids - 1e-4, mids + 1e-4])
    block = np.zeros(64, dtype=np.float32)
    block[: values.size] = values
    expected = list(range(16)) + list(range(15)) + list(range(1, 16)) + [7] * (64 - values.size)
    q = nf4.quantize_nf4(torch.from_numpy(block), double_quant=False)
    assert unpack_codes(q.packed).tolist() == expected
    assert q.absmax.tolist() == [1.0]
    # Scaling a block by a power of two changes the absmax, not the codes.
    q4 = nf4.quantize_nf4(torch.from_numpy(block * 4), double_quant=False)
    assert unpack_codes(q4.packed).tolist() == expected
    assert q4.absmax.tolist() == [4.0]


def test_exact_halfway_goes_to_lower_code():
    # Halving a float32 code is exact, so these two are exactly half-way in real terms.
    exact = np.array([CODEBOOK[6] / 2, CODEBOOK[8] / 2], dtype=np.float32)  # between 6|7 and 7|8
    # For the others "half-way" means the float32 midpoint (c_i + c_{i+1}) / 2.
    fp32_mids = ((CODEBOOK[:-1] + CODEBOOK[1:]) / np.float32(2)).astype(np.float32)
    block = np.zeros(64, dtype=np.float32)
    block[0], block[1] = 1.0, -1.0
    block[2:4] = exact
    block[4:19] = fp32_mids
    codes = unpack_codes(nf4.quantize_nf4(torch.from_numpy(block), double_quant=False).packed)
    assert codes[2:4].tolist() == [6, 7]
    assert codes[4:19].tolist() == list(range(15))


def test_packing_first_element_in_high_nibble():
    w = torch.tensor([-1.0, 1.0, 1.0, -1.0, 0.0, 1.0])  # codes 0, 15, 15, 0, 7, 15, then padding 7s
    q = nf4.quantize_nf4(w, double_quant=False)
    raw = q.packed.tolist()
    assert raw[:3] == [0x0F, 0xF0, 0x7F]
    assert raw[3:] == [0x77] * 29
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == 32


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (64,), (65,), (2, 3, 70), (129, 3)])
@pytest.mark.parametrize("double_quant", [False, True])
def test_odd_sizes_round_trip(shape, double_quant):
    torch.manual_seed(0)
    w = torch.randn(shape)
    q = nf4.quantize_nf4(w, double_quant=double_quant)
    assert q.packed.numel() == math.ceil(w.numel() / 64) * 32
    d = nf4.dequantize_nf4(q)
    assert d.shape == w.shape and d.dtype == w.dtype
    np.testing.assert_allclose(d.numpy(), reference_dequant(q), rtol=1e-6, atol=1e-7)


def test_round_trip_error_bound():
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    w[3, 5] = 25.0  # an outlier only coarsens its own block
    q = nf4.quantize_nf4(w, double_quant=False)
    err = (nf4.dequantize_nf4(q) - w).abs().reshape(-1, 64).numpy()
    block_absmax = w.abs().reshape(-1, 64).amax(1).numpy()
    assert np.all(err <= MAX_GAP / 2 * block_absmax[:, None] * (1 + 1e-6))
    # Nearest-code check on the same data with brute force over all 16 codes
    # (argmin keeps the first of equal distances, i.e. the lower code).
    normed = w.reshape(-1, 64).numpy() / block_absmax[:, None]
    nearest = np.abs(normed[..., None] - CODEBOOK).argmin(-1).reshape(-1)
    assert np.array_equal(unpack_codes(q.packed), nearest)
    # With double quantisation the absmax itself moves by at most its own error.
    qd = nf4.quantize_nf4(w, double_quant=True)
    absmax_err = np.abs(reference_absmax(qd) - block_absmax)
    errd = (nf4.dequantize_nf4(qd) - w).abs().reshape(-1, 64).numpy()
    assert np.all(errd <= (MAX_GAP / 2 * block_absmax + absmax_err)[:, None] + 1e-6)


def test_all_zero_block():
    w = torch.zeros(3, 64)
    w[1] = torch.linspace(-2, 2, 64)
    for dq in (False, True):
        d = nf4.dequantize_nf4(nf4.quantize_nf4(w, double_quant=dq))
        assert torch.isfinite(d).all()
        assert torch.equal(d[0], torch.zeros(64)) and torch.equal(d[2], torch.zeros(64))


def test_double_quant_of_absmax():
    torch.manual_seed(0)
    absmax = torch.rand(700) * 0.2 + 0.01  # 700 absmaxes -> 3 blocks of 256, the last partial
    codes, scales, mean = nf4.quantize_absmax(absmax, 256)
    assert codes.dtype == torch.int8 and codes.shape == (700,)
    assert scales.dtype == torch.float32 and scales.shape == (3,)
    a = absmax.numpy().astype(np.float64)
    assert float(mean) == pytest.approx(a.mean(), rel=1e-6)
    centred = a - a.mean()
    step = np.array([np.abs(centred[i:i + 256]).max() / 127 for i in range(0, 700, 256)])
    np.testing.assert_allclose(scales.numpy(), step, rtol=1e-5)
    back = nf4.dequantize_absmax(codes, scales, mean, 256).numpy()
    bound = step[np.arange(700) // 256] / 2
    assert np.all(np.abs(back - a) <= bound * (1 + 1e-4) + 1e-9)
    assert np.abs(codes.numpy()).max() == 127  # the block max uses the full int8 range


def test_bits_per_parameter():
    w = torch.randn(1024, 1024)
    q = nf4.quantize_nf4(w)
    hand = 4 + 8 / 64 + 32 / (64 * 256) + 32 / w.numel()  # codes, int8 absmax, fp32 scales, mean
    assert nf4.bits_per_parameter(q) == pytest.approx(hand, rel=1e-12)
    assert nf4.bits_per_parameter(q) <= 4.13
    assert nf4.bits_per_parameter(nf4.quantize_nf4(w, double_quant=False)) == pytest.approx(4.5)


def test_chunked_quantisation_is_identical():
    torch.manual_seed(0)
    w = torch.randn(37, 100)  # 3700 elements: 58 blocks, the last one padded
    a = nf4.quantize_nf4(w, chunk_rows=3)
    b = nf4.quantize_nf4(w, chunk_rows=10_000)
    for x, y in [(a.packed, b.packed), (a.absmax, b.absmax), (a.absmax_scale, b.absmax_scale),
                 (a.absmax_mean, b.absmax_mean)]:
        assert torch.equal(x, y)


def test_bf16_weight_keeps_dtype():
    w = torch.randn(8, 64, dtype=torch.bfloat16)
    q = nf4.quantize_nf4(w)
    assert nf4.dequantize_nf4(q).dtype == torch.bfloat16
    assert nf4.dequantize_nf4(q, torch.float32).dtype == torch.float32


def _linear(in_f=96, out_f=40, bias=True):
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f, bias=bias)
    return lin, nf4.LinearNF4.from_linear(lin)


def test_linear_nf4_forward_and_input_grad():
    lin, qlin = _linear()
    w_ref = torch.from_numpy(reference_dequant(qlin.quant_state())).float()
    x = torch.randn(2, 5, 96, requires_grad=True)
    y = qlin(x)
    torch.testing.assert_close(y, F.linear(x, w_ref, lin.bias), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    x2 = x.detach().clone().requires_grad_(True)
    (gx_ref,) = torch.autograd.grad(F.linear(x2, w_ref, lin.bias), x2, g)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in qlin.parameters())


def test_linear_nf4_bias_grad_when_unfrozen():
    _, qlin = _linear(in_f=64, out_f=8)
    qlin.bias.requires_grad_(True)
    g = torch.randn(2, 3, 8)
    qlin(torch.randn(2, 3, 64)).backward(g)
    torch.testing.assert_close(qlin.bias.grad, g.sum((0, 1)))


def test_linear_nf4_saves_no_dense_weight():
    _, qlin = _linear(in_f=128, out_f=64, bias=False)
    saved = []
    x = torch.randn(3, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = qlin(x)
    assert all(t.numel() < 128 * 64 for t in saved if t.is_floating_point())
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_linear_nf4_state_dict_round_trip():
    lin, qlin = _linear(in_f=70, out_f=9)  # 630 weights: not a multiple of 64
    skeleton = nf4.LinearNF4(70, 9, bias=True)
    skeleton.load_state_dict(qlin.state_dict())
    assert set(qlin.state_dict()) == {"weight_packed", "weight_absmax", "weight_absmax_scale",
                                      "weight_absmax_mean", "bias"}
    x = torch.randn(4, 70)
    assert torch.equal(skeleton(x), qlin(x))
    moved = qlin.to("cpu")  # buffers follow .to(device)
    assert torch.equal(moved(x), qlin(x))


def test_linear_nf4_compute_dtype():
    lin, _ = _linear()
    qlin = nf4.LinearNF4.from_linear(lin, compute_dtype=torch.bfloat16)
    y = qlin(torch.randn(3, 96))
    assert y.dtype == torch.bfloat16


def test_quantize_model_linears_and_dequantize_linear():
    torch.manual_seed(0)
    model = nn.ModuleDict({"h": nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 128)]),
                           "lm_head": nn.Linear(64, 10, bias=False)})
    dense = [m.weight.detach().clone() for m in model["h"]]
    names = nf4.quantize_model_linears(model, lambda name, m: name.startswith("h."))
    assert names == ["h.0", "h.1"]
    assert all(isinstance(m, nf4.LinearNF4) for m in model["h"])
    assert type(model["lm_head"]) is nn.Linear
    back = nf4.dequantize_linear(model["h"][1])
    assert type(back) is nn.Linear and back.weight.shape == (128, 64)
    ref = torch.from_numpy(reference_dequant(model["h"][1].quant_state())).float()
    torch.testing.assert_close(back.weight, ref, rtol=1e-6, atol=1e-7)
    assert (back.weight - dense[1]).abs().max() <= MAX_GAP / 2 * dense[1].abs().max() + 1e-3
