"""Exercise 4, nf4: NF4 quantisation and dequantisation, with double quantisation of the absmaxes.

Read first: docs/qlora_explained.md, "NF4: the frozen weights in 4 bits" (why normal quantiles, why blocks, the
double-quantisation arithmetic, 4.127 bits per weight). The reference solution is lib/nf4.py: quantize_nf4,
dequantize_nf4, quantize_absmax, dequantize_absmax (the storage layout is in its module docstring).

Hint: flatten the weight, pad it with zeros to whole blocks of block_size, and per block: absmax = max |w|,
normed = w / absmax in [-1, 1], code = the nearest of the 16 NF4_CODEBOOK values (compare with the 15 midpoints
nf4_midpoints(); a value exactly on a midpoint takes the lower code), two codes per byte with the first element
in the high nibble: byte = 16 * code[2i] + code[2i + 1]. An all-zero block has absmax 0: divide by 1 instead.
Double quantisation: mean = absmax.mean(); c = absmax - mean; per block of 256: scale = max |c| / 127,
code = round(c / scale) as int8 in [-127, 127]; back: code * scale + mean. Dequantisation: code value * absmax.

Check:  python -m pytest exercises/test_nf4.py
Run:    BYHAND_EXERCISE=nf4 python finetune_qlora.py    (QLoRA on train.py's GPT; its NF4 base made by your code)
"""

import torch
import torch.nn.functional as F  # noqa: F401

# Only these from lib.nf4: this file is read while lib/nf4.py itself is being imported.
from lib.nf4 import NF4_CODEBOOK, NF4Tensor, nf4_codebook, nf4_midpoints  # noqa: F401

REFERENCE = {"quantize_absmax": "lib.nf4.quantize_absmax", "dequantize_absmax": "lib.nf4.dequantize_absmax",
             "quantize_nf4": "lib.nf4.quantize_nf4", "dequantize_nf4": "lib.nf4.dequantize_nf4"}


def quantize_absmax(absmax: torch.Tensor, block_size: int = 256):
    """fp32 [n] -> (int8 codes [n], fp32 scales [ceil(n / block_size)], fp32 mean [])."""
    raise NotImplementedError("exercises/nf4.py: write quantize_absmax")


def dequantize_absmax(codes: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor,
                      block_size: int = 256) -> torch.Tensor:
    """(int8 codes [n], fp32 scales, fp32 mean) -> the absmaxes, fp32 [n]."""
    raise NotImplementedError("exercises/nf4.py: write dequantize_absmax")


@torch.no_grad()
def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True,
                 chunk_rows: int = 16384, absmax_block_size: int = 256) -> NF4Tensor:
    """Quantise any tensor to NF4, blockwise over its flattened elements.

    Returns NF4Tensor(packed uint8 [n_blocks * block_size / 2], absmax, absmax_scale, absmax_mean, w.shape,
    w.dtype, block_size, absmax_block_size): with double_quant absmax is int8 [n_blocks] and absmax_scale,
    absmax_mean come from quantize_absmax; without, absmax is fp32 [n_blocks] and the other two are None.
    chunk_rows: blocks processed at once, to bound the temporaries (you may ignore it; the result must not
    depend on it). A ValueError for an odd block_size, an empty tensor, or one holding inf or nan.
    """
    raise NotImplementedError("exercises/nf4.py: write quantize_nf4")


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rebuild the weight: code value * block absmax, shape q.shape, in `dtype` (default: q.dtype, the original's).
    With double quantisation the absmaxes come from dequantize_absmax first."""
    raise NotImplementedError("exercises/nf4.py: write dequantize_nf4")
