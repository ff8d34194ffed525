"""NF4: 4-bit NormalFloat weight quantisation (QLoRA), written out by hand.

Used by finetune_qlora.py (and later judge_train_cuda.py) to hold the frozen base
model in about 4.13 bits per weight; lib/lora.py puts the trainable adapters on top
(finetune_lora.py uses the same adapters on an unquantised base).

The one idea: trained weights are roughly normal, so put the 16 codes at normal
quantiles (each code then covers about the same share of weights), scale each
small block by its own absmax (one outlier only spoils its 64 neighbours), and
dequantise on the fly inside forward *and again* in backward, so a full-precision
copy of the weight never lives longer than one matmul.

Storage of a quantised tensor with N elements (blocks of 64, double quantisation on):
  packed codes   N/2 bytes            two 4-bit codes per uint8, first element in the high nibble
  absmax codes   N/64 bytes           int8, symmetric: absmax = code * scale + mean
  absmax scales  N/(64*256) * 4 bytes one fp32 per 256 absmaxes
  absmax mean    4 bytes              one fp32
  => 4 + 8/64 + 32/(64*256) = 4.127 bits per parameter (plus 32/N for the mean).
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib import exercise

# The 16 NF4 codes from the QLoRA paper / bitsandbytes. They are quantiles of
# N(0, 1), rescaled to [-1, 1]: with normal weights every code is used about
# equally often, so no code is wasted on values that hardly occur (uniform int4
# spends half of its 16 levels on the sparse tails). 8 positive and 7 negative
# codes plus an exact 0.0 (zero weights and padding stay exactly zero).
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def nf4_codebook(device=None) -> torch.Tensor:
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def nf4_midpoints(device=None) -> torch.Tensor:
    """The 15 decision boundaries: value v gets code i when mid[i-1] < v <= mid[i]."""
    cb = nf4_codebook(device)
    return (cb[:-1] + cb[1:]) / 2


_BYTE_TABLES: dict[str, torch.Tensor] = {}  # one small table per device, built once


def _byte_table(device) -> torch.Tensor:
    """[256, 2] table: byte b -> (code[b >> 4], code[b & 15]).

    One gather per byte decodes both nibbles at once, with no shifting or masking
    passes over the big tensor: dequantisation is a table lookup and a multiply.
    """
    key = str(device)
    if key not in _BYTE_TABLES:
        cb = nf4_codebook(device)
        _BYTE_TABLES[key] = torch.stack([cb.repeat_interleave(16), cb.repeat(16)], dim=1)
    return _BYTE_TABLES[key]


@dataclass
class NF4Tensor:
    """Everything needed to rebuild a weight; nothing full-precision is kept."""
    packed: torch.Tensor                # uint8 [n_blocks * block_size / 2]
    absmax: torch.Tensor                # int8 [n_blocks] if double-quantised, else fp32 [n_blocks]
    absmax_scale: torch.Tensor | None   # fp32 [ceil(n_blocks / absmax_block_size)], double quant only
    absmax_mean: torch.Tensor | None    # fp32 [] (a scalar), double quant only
    shape: torch.Size
    dtype: torch.dtype                  # dtype of the original weight (default for dequantise)
    block_size: int = 64
    absmax_block_size: int = 256

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.absmax_scale is not None


# ---------------------------------------------------------------------------
# Double quantisation of the per-block absmaxes.
# Scheme (symmetric absmax int8, simpler than bitsandbytes' dynamic 8-bit map):
#   mean    = mean(absmax)                       one fp32
#   c       = absmax - mean                      centring: absmaxes are all positive and
#                                                similar, so centring uses both signs of int8
#   scale_j = max|c| over block j of 256 / 127   one fp32 per 256 absmaxes
#   code    = round(c / scale_j), in [-127, 127] int8
#   absmax' = code * scale_j + mean              error <= scale_j / 2
# ---------------------------------------------------------------------------
def quantize_absmax(absmax: torch.Tensor, block_size: int = 256):
    """fp32 [n] -> (int8 codes [n], fp32 scales [ceil(n / block_size)], fp32 mean [])."""
    n = absmax.numel()
    mean = absmax.mean()
    centred = absmax - mean
    n_pad = -n % block_size
    blocks = F.pad(centred, (0, n_pad)).view(-1, block_size)
    scale = blocks.abs().amax(dim=1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant block has all c == 0
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[:n].contiguous(), scale, mean


quantize_absmax = exercise.swap("nf4", quantize_absmax)  # BYHAND_EXERCISE=nf4: exercises/nf4.py's, here and below


def dequantize_absmax(codes: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                      block_size: int = 256) -> torch.Tensor:
    n = codes.numel()
    if n % block_size:
        codes = F.pad(codes, (0, -n % block_size))
    blocks = codes.view(-1, block_size).float()
    return torch.addcmul(mean.float(), blocks, scale.float()[:, None]).view(-1)[:n]


dequantize_absmax = exercise.swap("nf4", dequantize_absmax)


def absmax_fp32(q: NF4Tensor) -> torch.Tensor:
    """The per-block absmaxes as used by dequantisation, fp32 [n_blocks]."""
    if q.double_quant:
        return dequantize_absmax(q.absmax, q.absmax_scale, q.absmax_mean, q.absmax_block_size)
    return q.absmax.float()


# ---------------------------------------------------------------------------
# Quantise / dequantise
# ---------------------------------------------------------------------------
@torch.no_grad()
def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True,
                 chunk_rows: int = 16384, absmax_block_size: int = 256) -> NF4Tensor:
    """Quantise any tensor to NF4, blockwise over its flattened elements.

    chunk_rows: how many blocks (rows of the [n_blocks, block_size] view) are
    processed at once. The temporaries (fp32 copy, int32 codes) exist only for
    one chunk, so peak memory is the weight plus ~N/2 bytes of output plus one
    chunk. The result does not depend on chunk_rows.
    """
    if block_size % 2 or block_size <= 0:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    if w.numel() == 0:
        raise ValueError("cannot quantise an empty tensor")
    flat = w.detach().reshape(-1)  # a view when w is contiguous
    n = flat.numel()
    n_blocks = -(-n // block_size)
    packed = torch.empty(n_blocks * block_size // 2, dtype=torch.uint8, device=w.device)
    absmax = torch.empty(n_blocks, dtype=torch.float32, device=w.device)
    mids = nf4_midpoints(w.device)

    for b0 in range(0, n_blocks, chunk_rows):
        b1 = min(b0 + chunk_rows, n_blocks)
        chunk = flat[b0 * block_size: b1 * block_size].float()
        if chunk.numel() < (b1 - b0) * block_size:
            # Only the last chunk can be short: pad it with zeros (they get the 0.0 code).
            chunk = F.pad(chunk, (0, (b1 - b0) * block_size - chunk.numel()))
        blocks = chunk.view(-1, block_size)
        amax = blocks.abs().amax(dim=1)
        absmax[b0:b1] = amax
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))  # all-zero block: 0/1, not 0/0
        normed = blocks / safe[:, None]  # in [-1, 1]
        # Nearest code by comparing with the 15 midpoints. right=False means a value
        # exactly on mid[i] gets index i, i.e. the LOWER of the two codes.
        codes = torch.bucketize(normed, mids, out_int32=True).view(-1, 2)
        packed[b0 * block_size // 2: b1 * block_size // 2] = (codes[:, 0] * 16 + codes[:, 1]).to(torch.uint8)

    if not torch.isfinite(absmax).all():
        raise ValueError("cannot quantise a tensor that contains inf or nan")
    if double_quant:
        codes8, scale, mean = quantize_absmax(absmax, absmax_block_size)
        return NF4Tensor(packed, codes8, scale, mean, w.shape, w.dtype, block_size, absmax_block_size)
    return NF4Tensor(packed, absmax, None, None, w.shape, w.dtype, block_size, absmax_block_size)


quantize_nf4 = exercise.swap("nf4", quantize_nf4)


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuild the weight: code value * block absmax, in `dtype` (default: the original dtype)."""
    dtype = dtype or q.dtype
    table = _byte_table(q.packed.device)
    # uint8 indices would be read as a boolean mask, so widen to int32 (not int64: half the bytes).
    values = table.index_select(0, q.packed.int())  # [n_pad / 2, 2] fp32
    values = values.view(-1, q.block_size).mul_(absmax_fp32(q)[:, None])
    return values.view(-1)[:q.numel].view(q.shape).to(dtype)


dequantize_nf4 = exercise.swap("nf4", dequantize_nf4)
if "nf4" in exercise.chosen():  # a poor quantiser would still train LoRA on top: check what it rebuilds
    _w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    try:
        _error = ((dequantize_nf4(quantize_nf4(_w)) - _w).norm() / _w.norm()).item()
    except NotImplementedError as e:
        exercise.fail(f"exercise nf4: {e}")
    if not _error < 0.1:
        exercise.fail(f"exercise nf4: your quantize_nf4 and dequantize_nf4 rebuild N(0, 1) weights with {_error:.1%} "
                      f"relative RMS error (NF4 gives 9.2%); python -m pytest exercises/test_nf4.py shows where")


def bits_per_parameter(q: NF4Tensor) -> float:
    """All stored bits (codes incl. padding, absmax state, scales, mean) per logical element."""
    stored = [q.packed, q.absmax, q.absmax_scale, q.absmax_mean]
    n_bytes = sum(t.numel() * t.element_size() for t in stored if t is not None)
    return 8 * n_bytes / q.numel


# ---------------------------------------------------------------------------
# A frozen linear layer stored in NF4
# ---------------------------------------------------------------------------
class _NF4Matmul(torch.autograd.Function):
    """y = x @ W^T with W dequantised on the fly; backward dequantises again.

    Saving only the NF4 state (which the module keeps anyway) instead of W means
    between forward and backward the layer costs ~0.5 bytes per weight, not 2-4.
    The weight is frozen: there is no weight gradient, only input (and bias) ones.
    The bias goes into F.linear so the add is fused, as in nn.Linear.
    """

    @staticmethod
    def forward(ctx, x, q, bias):
        ctx.q = q  # references to the module's buffers, no copy
        return F.linear(x, dequantize_nf4(q, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ dequantize_nf4(ctx.q, grad_out.dtype)
        if ctx.needs_input_grad[2]:  # only if someone unfroze the bias
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias


class LinearNF4(nn.Module):
    """A frozen nn.Linear whose weight exists only as NF4 buffers.

    The quantised state is registered as buffers, so .to(device) moves it and
    state_dict() / load_state_dict() round-trip it. Do not .to(dtype) the module:
    that would also cast the fp32 absmax scales (results stay valid, just coarser).
    The bias (if any) is a frozen parameter in its original precision.

    Compute dtype: compute_dtype if given, else the autocast dtype when autocast
    is on, else x.dtype. The weight is dequantised straight to that dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 block_size: int = 64, double_quant: bool = True,
                 compute_dtype: torch.dtype | None = None,
                 weight_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.double_quant = block_size, double_quant
        self.compute_dtype, self.weight_dtype = compute_dtype, weight_dtype
        self.absmax_block_size = 256
        # Empty buffers of the right shapes, so a skeleton can load a state_dict.
        n_blocks = -(-in_features * out_features // block_size)
        n_scales = -(-n_blocks // self.absmax_block_size)
        self.register_buffer("weight_packed", torch.zeros(n_blocks * block_size // 2, dtype=torch.uint8, device=device))
        if double_quant:
            self.register_buffer("weight_absmax", torch.zeros(n_blocks, dtype=torch.int8, device=device))
            self.register_buffer("weight_absmax_scale", torch.zeros(n_scales, dtype=torch.float32, device=device))
            self.register_buffer("weight_absmax_mean", torch.zeros((), dtype=torch.float32, device=device))
        else:
            self.register_buffer("weight_absmax", torch.zeros(n_blocks, dtype=torch.float32, device=device))
            self.weight_absmax_scale = None
            self.weight_absmax_mean = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=weight_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: int = 64, double_quant: bool = True,
                    compute_dtype: torch.dtype | None = None) -> "LinearNF4":
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, block_size,
                    double_quant, compute_dtype, weight_dtype=w.dtype, device=w.device)
        q = quantize_nf4(w, block_size, double_quant, absmax_block_size=layer.absmax_block_size)
        layer.weight_packed.copy_(q.packed)
        layer.weight_absmax.copy_(q.absmax)
        if double_quant:
            layer.weight_absmax_scale.copy_(q.absmax_scale)
            layer.weight_absmax_mean.copy_(q.absmax_mean)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def quant_state(self) -> NF4Tensor:
        # Rebuilt on each call because .to(device) replaces the buffer tensors.
        return NF4Tensor(self.weight_packed, self.weight_absmax, self.weight_absmax_scale,
                         self.weight_absmax_mean, torch.Size((self.out_features, self.in_features)),
                         self.weight_dtype, self.block_size, self.absmax_block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nf4(self.quant_state(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        if dtype is None:
            on = torch.is_autocast_enabled(x.device.type)
            dtype = torch.get_autocast_dtype(x.device.type) if on else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return _NF4Matmul.apply(x.to(dtype), self.quant_state(), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block_size={self.block_size}, double_quant={self.double_quant}")


def dequantize_linear(layer: LinearNF4, dtype: torch.dtype | None = None) -> nn.Linear:
    """A plain nn.Linear holding the dequantised weight (for merging LoRA or export)."""
    w = layer.dequantize(dtype or layer.weight_dtype)
    linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                       device=w.device, dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    linear.requires_grad_(False)
    return linear


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def quantize_model_linears(model: nn.Module, predicate: Callable[[str, nn.Linear], bool],
                           block_size: int = 64, double_quant: bool = True,
                           compute_dtype: torch.dtype | None = None) -> list[str]:
    """Replace, in place, every nn.Linear for which predicate(name, module) is true.

    Returns the dotted names replaced. Keep tied weights (a GPT-2 lm_head shares
    wte) out of the predicate: quantising one side would silently untie them.
    """
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear and predicate(name, m)]
    for name in names:
        replace_submodule(model, name, LinearNF4.from_linear(model.get_submodule(name), block_size,
                                                             double_quant, compute_dtype))
    return names
