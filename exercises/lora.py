"""Exercise 3, lora: a LoRA linear layer, and merging it back into the weight.

Read first: docs/qlora_explained.md (the LoRA sections: y = W x + (alpha / r) B A x, why B starts at zero, the
PEFT names). The reference solution is lib/lora.py, LoRALinear and merge_lora.

Hint: the base layer stays as it is (apply_lora in lib/lora.py freezes it and makes A and B trainable; you only
write the layer). A is [r, in] with nn.Linear's own initialisation, B is [out, r] of zeros, so a fresh layer
computes exactly what its base does. Merging folds the update into the weight: W' = W + scale * B @ A, and the
layer becomes a plain nn.Linear again.

Check:  python -m pytest exercises/test_lora.py
Run:    BYHAND_EXERCISE=lora python finetune_lora.py   (LoRA fine-tuning of train.py's GPT with your layer; add
        --init-from gpt2 for GPT-2 from the hub, --merge to fold it with your merge_lora)
"""

import math  # noqa: F401

import torch
import torch.nn as nn

from lib.nf4 import LinearNF4, dequantize_linear, replace_submodule  # noqa: F401  (helpers, not solutions)

REFERENCE = {"LoRALinear": "lib.lora.LoRALinear", "merge_lora": "lib.lora.merge_lora"}


class LoRALinear(nn.Module):
    """base(x) + lora_B(lora_A(dropout(x))) * scale, with the base frozen.

    lib/lora.py saves, loads and counts adapters through these attributes, so keep their names (PEFT's):
    base_layer (the wrapped layer), lora_A = nn.Linear(in, r, bias=False), lora_B = nn.Linear(r, out, bias=False),
    lora_dropout (nn.Dropout(dropout), or nn.Identity() when dropout is 0), scale (alpha / r, or alpha / sqrt(r)
    with rslora), and r, alpha, rslora, dropout_p, in_features, out_features.

    The base may be an nn.Linear or, in finetune_qlora.py, a lib.nf4.LinearNF4 (no .weight: its dtype is
    base.weight_dtype, its device base.weight_packed.device). dtype: A's and B's dtype (None: the base
    weight's); the LoRA path runs in it and its output is cast to the base output's dtype before the add.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0,
                 rslora: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}")
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.rslora, self.dropout_p = r, alpha, rslora, dropout
        raise NotImplementedError("exercises/lora.py: make scale, lora_dropout, lora_A and lora_B")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("exercises/lora.py: write LoRALinear.forward")


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA layer into a plain nn.Linear, in place: W' = W + scale * B @ A, and return the model.

    Our weights are [out, in] (nn.Linear), so no transpose is needed. An NF4 base is dequantised first
    (lib.nf4.dequantize_linear(layer) returns a whole plain nn.Linear, bias included, in the original dtype);
    form the sum in fp32, then cast it to the base
    weight's dtype. lib.nf4.replace_submodule(model, dotted_name, new) puts the plain layer in the LoRA one's place.
    """
    raise NotImplementedError("exercises/lora.py: write merge_lora")
