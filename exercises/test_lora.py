"""Checks for exercises/lora.py: a fresh layer computes its base exactly, outputs and gradients against
lib/lora.LoRALinear with the same A and B, the rsLoRA scale, and merge_lora's W + (alpha / r) B @ A by hand."""

import math

import torch
import torch.nn as nn

from lib import exercise, lora, nf4

impl = exercise.load("lora")
IN, OUT, R = 64, 24, 4
TOL = dict(atol=1e-5, rtol=1e-4)


def base(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(IN, OUT)


def trained_pair(rslora=False):
    """(yours, the reference) wrapping the same base, with the same non-zero A and B, as after some training."""
    ref = lora.LoRALinear(base(), r=R, alpha=8, rslora=rslora)
    torch.nn.init.normal_(ref.lora_B.weight, std=0.1)
    yours = impl.LoRALinear(base(), r=R, alpha=8, rslora=rslora)
    yours.load_state_dict(ref.state_dict())  # keys base_layer.*, lora_A.weight [r, in], lora_B.weight [out, r]
    return yours, ref


def x(seed=1):
    return torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(seed))


def test_a_fresh_layer_is_its_base():
    layer = impl.LoRALinear(base(), r=R, alpha=8)
    assert layer.lora_A.weight.shape == (R, IN) and layer.lora_B.weight.shape == (OUT, R)
    assert not layer.lora_B.weight.any(), "B starts at zero"
    bound = 1 / math.sqrt(IN)  # nn.Linear's init of A: uniform(-1/sqrt(in), 1/sqrt(in)), std bound/sqrt(3)
    a = layer.lora_A.weight
    assert a.abs().max() <= bound and abs(a.std().item() / (bound / math.sqrt(3)) - 1) < 0.15
    torch.testing.assert_close(layer(x()), base()(x()), atol=0, rtol=0)


def test_output_and_gradients_match_the_reference():
    for rslora in (False, True):
        yours, ref = trained_pair(rslora)
        assert math.isclose(yours.scale, 8 / math.sqrt(R) if rslora else 8 / R)
        out, ref_out = yours(x()), ref(x())
        torch.testing.assert_close(out, ref_out, **TOL)
        probe = torch.randn(3, 5, OUT, generator=torch.Generator().manual_seed(2))
        (out * probe).sum().backward()
        (ref_out * probe).sum().backward()
        for name in ("lora_A", "lora_B"):
            torch.testing.assert_close(getattr(yours, name).weight.grad, getattr(ref, name).weight.grad, **TOL)


def test_update_is_scale_b_a_by_hand():
    # y - base(x) = (alpha / r) * x A^T B^T: with A = ones and B = ones every output moves by 2 * sum(x).
    layer = impl.LoRALinear(base(), r=R, alpha=8)
    with torch.no_grad():
        layer.lora_A.weight.fill_(1.0)
        layer.lora_B.weight.fill_(1.0)
    inp = x()
    expected = base()(inp) + (8 / R) * R * inp.sum(-1, keepdim=True)
    torch.testing.assert_close(layer(inp), expected, **TOL)


def test_merge_folds_the_update_into_the_weight():
    torch.manual_seed(3)
    model = nn.Sequential(impl.LoRALinear(base(4), r=R, alpha=8), nn.GELU(), impl.LoRALinear(nn.Linear(OUT, IN), r=2))
    for m in (model[0], model[2]):
        torch.nn.init.normal_(m.lora_B.weight, std=0.1)
    inp = x()
    before = model(inp)
    a, b, w = (model[0].lora_A.weight.clone(), model[0].lora_B.weight.clone(), model[0].base_layer.weight.clone())
    merged = impl.merge_lora(model)
    assert type(merged[0]) is nn.Linear and type(merged[2]) is nn.Linear, "merged layers are plain nn.Linear"
    torch.testing.assert_close(merged[0].weight, w + (8 / R) * b @ a, **TOL)  # W' = W + (alpha / r) B A
    torch.testing.assert_close(merged(inp), before, **TOL)


def test_merge_dequantises_an_nf4_base():
    quantised = nf4.LinearNF4.from_linear(base(5))  # finetune_qlora.py's base: the layer has no .weight
    layer = impl.LoRALinear(quantised, r=R, alpha=8)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.1)
    model = nn.Sequential(layer)
    before = model(x())
    merged = impl.merge_lora(model)
    assert type(merged[0]) is nn.Linear
    torch.testing.assert_close(merged(x()), before, **TOL)
