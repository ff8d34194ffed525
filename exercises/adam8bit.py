"""Exercise adam8bit: one block-wise 8-bit AdamW step, the way bitsandbytes stores Adam's moments.

Read first: docs/adam8bit_explained.md (why 8 bits are enough for the moments; the dynamic map).
Reference solution: lib/adam8bit.py (quantize_blockwise, dequantize_blockwise, adamw8bit_update).
Test:    python -m pytest exercises/test_adam8bit.py
Run:     BYHAND_EXERCISE=adam8bit python judge_train_cuda.py --model tiny   (your three functions inside the
         real 8-bit AdamW of the QLoRA judge; on a CPU too)

Hint: the 256-entry table is given (create_dynamic_map below). Quantising is "divide each block of 256 values by
its absmax, then take the index of the nearest table entry" (torch.bucketize on the midpoints between entries, or
an argmin of distances over a small chunk); dequantising is a table lookup times the absmax. For the step, turn
the codes back into fp32 moments, do ordinary AdamW, and store the new moments' codes and absmaxes in place.
"""

import torch

from lib.adam8bit import BLOCK_SIZE, create_dynamic_map  # noqa: F401  (given: the signed and unsigned tables)

REFERENCE = {
    "quantize_blockwise": "lib.adam8bit.quantize_blockwise",
    "dequantize_blockwise": "lib.adam8bit.dequantize_blockwise",
    "adamw8bit_update": "lib.adam8bit.adamw8bit_update",
}


def quantize_blockwise(x: torch.Tensor, signed: bool, block_size: int = BLOCK_SIZE):
    """fp32 [n] -> (uint8 codes [n], fp32 absmax [ceil(n / block_size)]): nearest table entry of x / absmax.

    The table is create_dynamic_map(signed). Blocks are consecutive runs of block_size values (the last one may be
    short); a block of zeros has absmax 0 and all codes at the table's 0 entry. Ties go to the lower entry. Signed:
    a negative value never takes the 0 entry or a positive one (a tiny momentum keeps its sign: it goes to the
    smallest negative entry); an exact 0 takes the 0 entry.
    """
    raise NotImplementedError("exercise adam8bit: quantize_blockwise")


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """uint8 [n] + fp32 absmax -> fp32 [n_blocks, block_size] (zero-padded past n): table[code] * its block's absmax."""
    raise NotImplementedError("exercise adam8bit: dequantize_blockwise")


def adamw8bit_update(w, g, state1, absmax1, state2, absmax2, step, lr, betas, eps, weight_decay,
                     block_size=BLOCK_SIZE):
    """One AdamW step on flat fp32 weights w (in place) whose moments are stored in 8 bits.

    state1/absmax1 hold the first moment (signed map), state2/absmax2 the second (unsigned map), as
    quantize_blockwise returns them, one absmax per block of w. Dequantise both, run the fp32 AdamW
    step, and write the new moments' codes and absmaxes back into the four tensors.

    The fp32 AdamW step (step counts from 1; weight decay decoupled, applied before the update, as torch does):
        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2;   w = w (1 - lr weight_decay)
        w = w - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
    """
    raise NotImplementedError("exercise adam8bit: adamw8bit_update")
