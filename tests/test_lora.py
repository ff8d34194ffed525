"""LoRA (lib/lora.py): wrapping, freezing, merging and PEFT-layout adapter files."""
import copy
import json
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from lib import lora, nf4

C, V = 64, 50  # width and vocabulary of the tiny test model


class Block(nn.Module):
    """Same module names as Hugging Face GPT-2; the maths is just enough to use every layer."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.c_attn = nn.Linear(C, 3 * C)
        self.attn.c_proj = nn.Linear(C, C)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(C, 4 * C)
        self.mlp.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        q, k, v = self.attn.c_attn(x).split(C, dim=-1)
        x = x + self.attn.c_proj(torch.tanh(q * k) * v)
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(x)))


class TinyGPT(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, C),
                                          "h": nn.ModuleList([Block() for _ in range(n_layer)])})
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def forward(self, idx):
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(x)


def tiny(seed=0):
    torch.manual_seed(seed)
    return TinyGPT()


def randomise_B(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


IDX = torch.arange(12).reshape(2, 6) % V


def test_step_zero_equals_base():
    base = tiny()
    model = copy.deepcopy(base)
    lora.apply_lora(model, targets=("c_attn", "c_proj", "c_fc"), r=4, alpha=8)
    assert torch.equal(model(IDX), base(IDX))


def test_lora_layer_matches_formula_and_init():
    torch.manual_seed(0)
    base = nn.Linear(32, 48)
    layer = lora.LoRALinear(base, r=4, alpha=8)
    assert layer.lora_A.weight.shape == (4, 32) and layer.lora_B.weight.shape == (48, 4)
    assert torch.equal(layer.lora_B.weight, torch.zeros(48, 4))
    bound = 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) on fan_in=32 gives U(-1/sqrt(32), 1/sqrt(32))
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.abs().max() > 0.8 * bound
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(5, 32)
    A, B = layer.lora_A.weight, layer.lora_B.weight
    expected = x @ base.weight.T + base.bias + (x @ A.T @ B.T) * (8 / 4)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_rslora_scale():
    torch.manual_seed(0)
    base = nn.Linear(16, 16, bias=False)
    layer = lora.LoRALinear(base, r=16, alpha=8, rslora=True)
    assert layer.scale == pytest.approx(8 / 4)  # alpha / sqrt(16)
    assert lora.LoRALinear(base, r=16, alpha=8).scale == pytest.approx(0.5)  # alpha / r
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 16)
    A, B = layer.lora_A.weight, layer.lora_B.weight
    torch.testing.assert_close(layer(x), x @ base.weight.T + 2.0 * (x @ A.T @ B.T), rtol=1e-5, atol=1e-5)


def test_merge_equals_adapter_output():
    model = tiny()
    lora.apply_lora(model, targets=("c_attn", "mlp.c_proj"), r=4, alpha=16)
    randomise_B(model)
    before = model(IDX)
    lora.merge_lora(model)
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())
    assert type(model.transformer.h[0].attn.c_attn) is nn.Linear
    torch.testing.assert_close(model(IDX), before, rtol=1e-5, atol=1e-5)


def test_only_lora_params_train():
    model = tiny()
    lora.apply_lora(model, targets=("c_attn", "c_proj"), r=4, alpha=8)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A.weight", "lora_B.weight")) for n in trainable)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        loss = F.cross_entropy(model(IDX).flatten(0, 1), IDX.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == trainable


def test_count_parameters():
    model = tiny()
    total_plain = sum(p.numel() for p in model.parameters())
    lora.apply_lora(model, targets=("c_attn",), r=4)
    per_layer = 4 * C + 3 * C * 4  # A [r, in] + B [out, r]
    assert lora.count_parameters(model) == (2 * per_layer, total_plain + 2 * per_layer)
    # An NF4 model counts logical weights: same total as the dense one.
    q = tiny()
    nf4.quantize_model_linears(q, lambda n, m: ".h." in f".{n}")
    lora.apply_lora(q, targets=("c_attn",), r=4)
    assert lora.count_parameters(q) == (2 * per_layer, total_plain + 2 * per_layer)


@pytest.mark.parametrize("targets, expected", [
    (("c_attn",), ["attn.c_attn"]),
    (("c_proj",), ["attn.c_proj", "mlp.c_proj"]),
    (("mlp.c_proj",), ["mlp.c_proj"]),
    (("attn.c_proj",), ["attn.c_proj"]),
    (("c_fc",), ["mlp.c_fc"]),
    (("c_attn", "c_fc"), ["attn.c_attn", "mlp.c_fc"]),
])
def test_target_matching(targets, expected):
    model = tiny()
    names = lora.apply_lora(model, targets=targets)
    assert sorted(names) == sorted(f"transformer.h.{i}.{e}" for i in range(2) for e in expected)
    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear))
    assert wrapped == sorted(names)


@pytest.mark.parametrize("bad", ["proj", "attn", "q_proj", "h.0.attn.c_att"])
def test_target_matching_nothing_is_an_error(bad):
    with pytest.raises(ValueError, match=bad):
        lora.apply_lora(tiny(), targets=("c_attn", bad))


def expected_keys(targets_by_shape):
    keys = {}
    for i in range(2):
        for suffix, (out_f, in_f) in targets_by_shape.items():
            p = f"base_model.model.transformer.h.{i}.{suffix}"
            keys[p + ".lora_A.weight"] = (4, in_f)
            keys[p + ".lora_B.weight"] = (out_f, 4)
    return keys


def test_adapter_file_layout(tmp_path):
    model = tiny()
    lora.apply_lora(model, targets=("c_attn", "c_proj"), r=4, alpha=8, dropout=0.05)
    lora.save_adapter(model, str(tmp_path), {"base_model_name_or_path": "gpt2"})
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert shapes == expected_keys({"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_proj": (C, 4 * C)})
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["lora_dropout"] == 0.05
    assert cfg["target_modules"] == ["c_attn", "c_proj"]
    assert cfg["bias"] == "none" and cfg["fan_in_fan_out"] is True and cfg["use_rslora"] is False
    assert cfg["base_model_name_or_path"] == "gpt2" and cfg["modules_to_save"] is None
    assert cfg["inference_mode"] is True


def test_inferred_targets_are_exact(tmp_path):
    model = tiny()
    lora.apply_lora(model, targets=("mlp.c_proj",), r=4)
    cfg = lora.save_adapter(model, str(tmp_path))
    # "c_proj" would also select attn.c_proj, so the full paths are written instead.
    assert cfg["target_modules"] == ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]
    fresh = tiny()
    lora.load_adapter(fresh, str(tmp_path))
    assert sorted(n for n, m in fresh.named_modules() if isinstance(m, lora.LoRALinear)) == \
        ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]


def test_save_load_round_trip(tmp_path):
    model = tiny()
    lora.apply_lora(model, targets=("c_attn", "c_fc"), r=4, alpha=8, rslora=True)
    randomise_B(model)
    lora.save_adapter(model, str(tmp_path))
    fresh = tiny()  # same seed, same base weights, no LoRA yet
    lora.load_adapter(fresh, str(tmp_path))
    assert torch.equal(fresh(IDX), model(IDX))
    # Loading into an already-wrapped model just fills the weights.
    wrapped = tiny()
    lora.apply_lora(wrapped, targets=("c_attn", "c_fc"), r=4, alpha=8, rslora=True)
    lora.load_adapter(wrapped, str(tmp_path))
    assert torch.equal(wrapped(IDX), model(IDX))
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temp files


def test_load_errors_name_file_and_key(tmp_path):
    model = tiny()
    lora.apply_lora(model, targets=("c_attn",), r=4)
    lora.save_adapter(model, str(tmp_path))
    other_r = tiny()
    lora.apply_lora(other_r, targets=("c_attn",), r=8)
    with pytest.raises(ValueError, match="r=8"):
        lora.load_adapter(other_r, str(tmp_path))
    more = tiny()
    lora.apply_lora(more, targets=("c_attn", "c_fc"), r=4)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors lacks .*c_fc"):
        lora.load_adapter(more, str(tmp_path))
    fewer = tiny()
    lora.apply_lora(fewer, targets=("h.0.attn.c_attn",), r=4)
    with pytest.raises(ValueError, match=r"key 'base_model\.model\.transformer\.h\.1\.attn\.c_attn"):
        lora.load_adapter(fewer, str(tmp_path))
    wider = TinyGPT()
    wider.transformer.h[0].attn.c_attn = nn.Linear(C, 2 * C)
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.lora_B\.weight' has shape \[192, 4\]"):
        lora.load_adapter(wider, str(tmp_path))
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        lora.load_adapter(tiny(), str(tmp_path / "nowhere"))


def test_nf4_and_dense_adapters_are_interchangeable(tmp_path):
    # Train-side QLoRA: NF4 base + LoRA.
    qmodel = tiny()
    nf4.quantize_model_linears(qmodel, lambda n, m: ".h." in f".{n}")
    lora.apply_lora(qmodel, targets=("c_attn", "c_proj"), r=4, alpha=8)
    assert isinstance(qmodel.transformer.h[0].attn.c_attn.base_layer, nf4.LinearNF4)
    loss = qmodel(IDX).square().mean()
    loss.backward()  # gradients reach A through the NF4 base
    assert qmodel.transformer.h[0].attn.c_attn.lora_A.weight.grad is not None
    randomise_B(qmodel)
    lora.save_adapter(qmodel, str(tmp_path / "q"))

    # The same adapter on a dense fp32 base of the same shapes.
    dense = tiny()
    lora.load_adapter(dense, str(tmp_path / "q"))
    for name, m in dense.named_modules():
        if isinstance(m, lora.LoRALinear):
            qm = qmodel.get_submodule(name)
            assert torch.equal(m.lora_A.weight, qm.lora_A.weight) and torch.equal(m.lora_B.weight, qm.lora_B.weight)
    # Replace the dense base weights by the NF4 ones: the two models must then agree.
    for name, m in qmodel.named_modules():
        if isinstance(m, nf4.LinearNF4):
            dense_base = dense.get_submodule(name)
            with torch.no_grad():
                dense_base.weight.copy_(m.dequantize(torch.float32))
    torch.testing.assert_close(dense(IDX), qmodel(IDX), rtol=1e-5, atol=1e-5)

    # And the other way: a dense-trained adapter loads onto an NF4 base.
    lora.save_adapter(dense, str(tmp_path / "d"))
    q2 = tiny()
    nf4.quantize_model_linears(q2, lambda n, m: ".h." in f".{n}")
    lora.load_adapter(q2, str(tmp_path / "d"))
    torch.testing.assert_close(q2(IDX), qmodel(IDX), rtol=1e-5, atol=1e-5)

    # Merging an NF4 + LoRA model gives plain linears with the same output.
    before = q2(IDX)
    lora.merge_lora(q2)
    assert type(q2.transformer.h[1].mlp.c_proj) is nn.Linear
    torch.testing.assert_close(q2(IDX), before, rtol=1e-5, atol=1e-5)


def test_mixed_dtypes():
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    bf16_lora = lora.LoRALinear(nn.Linear(16, 8), r=2, dtype=torch.bfloat16)  # bf16 LoRA, fp32 base
    assert bf16_lora.lora_A.weight.dtype == torch.bfloat16
    assert bf16_lora(x).dtype == torch.float32
    fp32_lora = lora.LoRALinear(nn.Linear(16, 8).to(torch.bfloat16), r=2, dtype=torch.float32)
    with torch.no_grad():
        fp32_lora.lora_B.weight.normal_()
    y = fp32_lora(x.to(torch.bfloat16))  # bf16 compute, fp32 LoRA weights
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert fp32_lora.lora_B.weight.grad.dtype == torch.float32
