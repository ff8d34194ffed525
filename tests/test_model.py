"""The GPT model: shapes, causality, parameter counts, the HF layout, and sampling."""

import math

import pytest
import torch
import torch.nn.functional as F

from lib import gpt


def tiny(**kw):
    return gpt.GPTConfig(**{**dict(block_size=16, vocab_size=50257, n_layer=2, n_head=2, n_embd=32), **kw})


def test_logits_shape_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    model = gpt.GPT(tiny())
    idx = torch.randint(0, 50257, (3, 16))
    targets = torch.randint(0, 50257, (3, 16))  # not idx: tied weights favour repeating the input
    logits, none = model(idx)
    assert logits.shape == (3, 16, 50257) and none is None
    no_logits, loss = model(idx, targets)
    assert no_logits is None  # with targets, the chunked loss (lib/lm_loss) makes no logits at all
    # With N(0, 0.02) weights the prediction is close to uniform: loss ~ ln(50257) = 10.82.
    assert abs(loss.item() - math.log(50257)) < 0.1
    # ... and it is the cross-entropy of the logits, to fp32 rounding.
    full = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert loss.item() == pytest.approx(full.item(), rel=1e-6)


def test_chunked_loss_trains_like_the_full_one():
    """Three AdamW steps with model(x, y)[1] and with F.cross_entropy on the logits: the same losses, and
    the same gradients at every step to float rounding (more in tests/test_lm_loss.py). Weights are not
    compared: AdamW divides by the gradient's size, so a gradient that is 0 but for rounding (the key
    bias, to which softmax is blind) moves by the learning rate either way."""
    cfg = tiny(vocab_size=500)
    idx, targets = torch.randint(0, 500, (2, 16)), torch.randint(0, 500, (2, 16))
    runs = []
    for chunked in (True, False):
        torch.manual_seed(0)
        model = gpt.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        for _ in range(3):
            if chunked:
                loss = model(idx, targets)[1]
            else:
                loss = F.cross_entropy(model(idx)[0].flatten(0, 1), targets.flatten())
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, grads))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-5) and runs[0][0][2] < runs[0][0][0]
    for step, (ours, theirs) in enumerate(zip(runs[0][1], runs[1][1])):
        for name, g in ours.items():
            torch.testing.assert_close(g, theirs[name], rtol=1e-4, atol=1e-7, msg=f"step {step} {name}")


def test_a_lora_adapted_head_takes_the_plain_way():
    from lib import lora
    torch.manual_seed(0)
    model = gpt.GPT(tiny(vocab_size=300))
    lora.apply_lora(model, targets=("lm_head",), r=4)
    torch.nn.init.normal_(model.lm_head.lora_B.weight)
    idx, targets = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    ref = F.cross_entropy(model(idx)[0].flatten(0, 1), targets.flatten())
    assert model(idx, targets)[1].item() == pytest.approx(ref.item(), rel=1e-6)


def test_logits_to_keep_gives_the_last_positions_logits():
    torch.manual_seed(0)
    model = gpt.GPT(tiny()).eval()
    idx = torch.randint(0, 50257, (2, 10))
    last, _ = model(idx, logits_to_keep=1)
    assert last.shape == (2, 1, 50257)
    torch.testing.assert_close(last, model(idx)[0][:, -1:], rtol=0, atol=1e-5)


def test_causal_mask_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = gpt.GPT(tiny()).eval()
    a = torch.randint(0, 50257, (1, 16))
    b = a.clone()
    b[0, 10:] = torch.randint(0, 50257, (6,))
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[:, :10], lb[:, :10], rtol=0, atol=1e-5)
    assert not torch.allclose(la[:, 10:], lb[:, 10:])


def test_sequence_longer_than_block_size_is_refused():
    model = gpt.GPT(tiny())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("size,expected", [
    ("gpt2", 124_439_808),  # the published GPT-2 small count (tied head counted once)
    # 12 * n_layer * n_embd^2 + 13 * n_layer * n_embd (blocks) + (V + 1024) * n_embd + 2 * n_embd (embeddings, ln_f)
    ("gpt2-xl", 12 * 48 * 1600**2 + 13 * 48 * 1600 + (50257 + 1024) * 1600 + 2 * 1600),
])
def test_parameter_counts(size, expected):
    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(**gpt.MODEL_SIZES[size]))
    assert model.num_params() == expected


def test_weight_tying_shares_storage():
    model = gpt.GPT(tiny())
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_hf_layout_names_and_conv1d_transpose():
    torch.manual_seed(0)
    model = gpt.GPT(tiny())
    hf = gpt.to_hf_state_dict(model)
    assert "lm_head.weight" not in hf  # tied, as transformers saves GPT2LMHeadModel
    # HF Conv1D stores [in, out]: c_attn is 32 -> 96, so [32, 96]; nn.Linear holds [96, 32].
    assert tuple(hf["transformer.h.0.attn.c_attn.weight"].shape) == (32, 96)
    assert tuple(hf["transformer.h.1.mlp.c_fc.weight"].shape) == (32, 128)
    assert tuple(hf["transformer.h.1.mlp.c_proj.weight"].shape) == (128, 32)
    torch.testing.assert_close(hf["transformer.h.0.attn.c_attn.weight"], model.transformer.h[0].attn.c_attn.weight.t())
    # Non-Conv1D tensors are untouched.
    torch.testing.assert_close(hf["transformer.wpe.weight"], model.transformer.wpe.weight)
    assert set(hf) == {k for k in model.state_dict() if k != "lm_head.weight"}


def test_hf_round_trip_accepts_hub_style_names_and_mask_buffers():
    torch.manual_seed(0)
    model = gpt.GPT(tiny())
    hf = gpt.to_hf_state_dict(model)
    # The hub's gpt2 file is a GPT2Model: no "transformer." prefix, and old mask buffers.
    hub_style = {k.removeprefix("transformer."): v for k, v in hf.items()}
    hub_style["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    back = gpt.from_hf_state_dict(hub_style)
    model2 = gpt.GPT(tiny())
    model2.load_state_dict(back)
    idx = torch.randint(0, 50257, (2, 16))
    torch.testing.assert_close(model(idx)[0], model2(idx)[0])


def test_hf_config_round_trip():
    cfg = tiny(dropout=0.1)
    hf = gpt.config_to_hf(cfg)
    assert hf["model_type"] == "gpt2" and hf["n_positions"] == 16 and hf["activation_function"] == "gelu_new"
    assert gpt.config_from_hf(hf) == cfg
    with pytest.raises(ValueError, match="model_type"):
        gpt.config_from_hf({**hf, "model_type": "llama"})


def test_generate_greedy_and_top_k():
    torch.manual_seed(0)
    model = gpt.GPT(tiny()).eval()
    idx = torch.tensor([[1, 2, 3]])
    out = model.generate(idx, 20, temperature=0)  # longer than block_size: the window slides
    assert out.shape == (1, 23) and torch.equal(out[:, :3], idx)
    # Greedy = argmax of the last position's logits.
    logits, _ = model(idx)
    assert out[0, 3].item() == logits[0, -1].argmax().item()
    # top_k=1 sampling must equal greedy decoding whatever the temperature.
    g = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(idx, 5, temperature=2.0, top_k=1, generator=g), out[:, :8])
