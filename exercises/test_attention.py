"""Checks for exercises/attention.py: outputs and gradients against lib/gpt.CausalSelfAttention given the same
weights, causality (a later token cannot change an earlier output), and a value worked out by hand."""

import torch
import torch.nn.functional as F

from lib import exercise, gpt

impl = exercise.load("attention")
CFG = gpt.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=4, n_embd=16, dropout=0.0)
TOL = dict(atol=1e-5, rtol=1e-4)  # fp32; softmax and matmuls in another order differ by ~1e-7


def pair(seed=0):
    """(yours, the reference) holding the same seeded weights, biases included, in eval mode."""
    torch.manual_seed(seed)
    ref = gpt.CausalSelfAttention(CFG)
    for p in ref.parameters():  # biases too: zero biases would hide a forgotten one
        torch.nn.init.normal_(p, std=0.3)
    yours = impl.CausalSelfAttention(CFG)
    yours.load_state_dict(ref.state_dict())
    return yours.eval(), ref.eval()


def inputs(seed=1, B=2, T=8):
    return torch.randn(B, T, CFG.n_embd, generator=torch.Generator().manual_seed(seed))


def test_output_matches_the_reference():
    yours, ref = pair()
    x = inputs()
    torch.testing.assert_close(yours(x), ref(x), **TOL)
    torch.testing.assert_close(yours(x[:, :3]), ref(x[:, :3]), **TOL)  # any length up to block_size


def test_gradients_match_the_reference():
    yours, ref = pair()
    x1, x2 = inputs().requires_grad_(), inputs().requires_grad_()
    probe = torch.randn(2, 8, CFG.n_embd, generator=torch.Generator().manual_seed(2))
    (yours(x1) * probe).sum().backward()
    (ref(x2) * probe).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, **TOL)
    for (name, p), q in zip(yours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"gradient of {name}")


def test_later_tokens_cannot_change_earlier_outputs():
    yours, _ = pair()
    x = inputs()
    changed = x.clone()
    changed[:, 5:] += 3.0  # a different future from position 5 on
    y, y_changed = yours(x), yours(changed)
    torch.testing.assert_close(y[:, :5], y_changed[:, :5], atol=1e-6, rtol=0, msg="a position saw a later token")
    assert (y[:, 5:] - y_changed[:, 5:]).abs().max() > 1e-2, "positions 5.. ignored their own, changed, tokens"


def test_first_position_attends_only_to_itself():
    # By hand: position 0 sees only itself, so its softmax is [1.0] and its output is c_proj(v_0), whatever q and k.
    yours, ref = pair()
    x = inputs()
    v0 = F.linear(x[:, 0], ref.c_attn.weight, ref.c_attn.bias)[:, 2 * CFG.n_embd:]
    expected = F.linear(v0, ref.c_proj.weight, ref.c_proj.bias)
    torch.testing.assert_close(yours(x)[:, 0], expected, **TOL)


def test_heads_attend_separately():
    # Two heads with scores all equal (q = 0) average the values over positions 0..t: position t's output
    # before c_proj is the mean of v_0..v_t, in every head.
    yours, ref = pair()
    with torch.no_grad():
        yours.c_attn.weight[:CFG.n_embd] = 0
        yours.c_attn.bias[:CFG.n_embd] = 0
        yours.c_proj.weight.copy_(torch.eye(CFG.n_embd))
        yours.c_proj.bias.zero_()
    x = inputs()
    v = F.linear(x, yours.c_attn.weight, yours.c_attn.bias)[..., 2 * CFG.n_embd:]
    expected = v.cumsum(dim=1) / torch.arange(1, 9)[None, :, None]
    torch.testing.assert_close(yours(x), expected, **TOL)
