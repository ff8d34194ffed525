"""The GPT-2 model, its Hugging Face weight layout, and sampling.

Used by train.py, train_fsdp.py, finetune_lora.py and finetune_qlora.py (onefile_train.py
carries its own copy on purpose). The one idea: GPT-2 is a stack of identical pre-norm blocks
(attention, then MLP, each added back to a residual stream); everything else here is bookkeeping
so that the weights we train load in Hugging Face transformers and the other way round.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lib import device as devices
from lib import exercise, lm_loss, tokenizer


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the position table covers
    vocab_size: int = 50257  # GPT-2 BPE: 50,000 merges + 256 bytes + <|endoftext|>
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in every Linear and LayerNorm


# The published GPT-2 shapes; "tiny" is this repository's CPU default.
MODEL_SIZES = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        # One matmul makes queries, keys and values together (HF calls it c_attn).
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_dim]: each head attends independently.
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # SDPA picks a fused kernel (flash / memory-efficient) that never stores the T x T matrix; on a CPU only
        # at dropout 0 (with dropout it falls back to the plain kernel, which stores it).
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


CausalSelfAttention = exercise.swap("attention", CausalSelfAttention)  # BYHAND_EXERCISE=attention: exercises/


def is_causal(attention_class) -> bool:
    """Whether changing the last token leaves every earlier output alone. An attention that sees the future
    would make training look better, not worse, so a learner's is checked when it is swapped in."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer, x = attention_class(GPTConfig(n_layer=1, n_head=2, n_embd=8)).eval(), torch.randn(1, 4, 8)
        with torch.no_grad():
            return torch.allclose(layer(x)[:, :3], layer(torch.cat([x[:, :3], x[:, 3:] + 1], 1))[:, :3], atol=1e-5)


try:
    _causal = "attention" not in exercise.chosen() or is_causal(CausalSelfAttention)
except NotImplementedError as e:
    exercise.fail(f"exercise attention: {e}")
if not _causal:
    exercise.fail("exercise attention: your CausalSelfAttention lets a position see later tokens; "
                  "python -m pytest exercises/test_attention.py shows where")


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        # GPT-2 used the tanh approximation of GELU ("gelu_new" in transformers).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        # Pre-norm: the residual stream itself is never normalised, which keeps deep stacks stable.
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    gradient_checkpointing = False  # True: keep each block's input only, recompute the block in backward

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying: the output projection reuses the token embedding (saves vocab x n_embd).
        self.lm_head.weight = self.transformer.wte.weight
        self.init_weights()

    def init_weights(self):
        """GPT-2 initialisation: N(0, 0.02), with residual projections scaled by 1/sqrt(2 n_layer)."""
        # Each block adds two projections to the residual stream; shrinking them keeps the
        # stream's variance from growing with depth.
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = std_proj if name.endswith("c_proj") else 0.02
                torch.nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                torch.nn.init.ones_(module.weight)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=False):
        # Parameters are counted once even though wte and lm_head share storage.
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def hidden_states(self, idx):
        """The final hidden states [B, T, n_embd] (after ln_f): what the LM head turns into logits."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # Activation checkpointing: forward keeps only the block's input; backward runs the
                # block again to get what it needs (one more forward, a block's activations at a time).
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, logits_to_keep=0):
        """(logits [B, T, vocab], None) without targets; (None, mean loss) with targets [B, T].

        With targets no logits are made at all: lib/lm_loss computes the cross-entropy chunk by chunk
        from the hidden states and the head weight (the [B, T, vocab] logits are a small GPT's largest
        tensor: 206 MB for the tiny default). The pair keeps `model(x, y)[1]` working everywhere.
        logits_to_keep > 0 returns the logits of the last that many positions only (generation).
        """
        x = self.hidden_states(idx)
        if targets is None:
            return self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x), None
        return None, lm_loss.head_loss(x, self.lm_head, targets)  # a LoRA-wrapped head: the plain loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample max_new_tokens tokens after idx ([B, T] token ids); returns [B, T + max_new_tokens]."""
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]
            # Only the last position's logits are needed: [B, 1, vocab], not [B, T, vocab]. (Through
            # forward, not hidden_states: FSDP2 gathers the root's parameters in forward's hook.)
            logits, _ = self(idx_cond, logits_to_keep=1)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    # Keep the k most likely tokens; the long tail is where nonsense comes from.
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


# --- Hugging Face GPT-2 layout --------------------------------------------------------------
# transformers stores GPT-2's projections as Conv1D modules whose weight is [in, out], the
# transpose of nn.Linear's [out, in]. These four names are the only ones that need a transpose.
CONV1D_NAMES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def config_to_hf(cfg: GPTConfig) -> dict:
    """The config.json that transformers' GPT2LMHeadModel reads."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def config_from_hf(hf: dict) -> GPTConfig:
    """Read a transformers GPT-2 config.json; raises ValueError when it is not one we can build."""
    if hf.get("model_type") not in (None, "gpt2"):
        raise ValueError(f"model_type is {hf.get('model_type')!r}, expected 'gpt2'")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"missing GPT-2 fields {missing}")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError(f"n_inner={hf['n_inner']} is not 4*n_embd, which this model assumes")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function {hf['activation_function']!r} is not GPT-2's tanh GELU")
    return GPTConfig(
        block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
        vocab_size=hf["vocab_size"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        dropout=hf.get("resid_pdrop", 0.0),
    )


def to_hf_state_dict(model: GPT) -> dict:
    """Our state dict -> transformers GPT2LMHeadModel names and layouts (Conv1D transposed)."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to transformer.wte.weight; transformers re-ties it on load
        t = t.detach()
        if name.endswith(CONV1D_NAMES):
            t = t.t()
        out[name] = t.contiguous()
    return out


def from_hf_state_dict(sd: dict) -> dict:
    """transformers GPT-2 tensors -> our state dict. Accepts GPT2LMHeadModel ("transformer.h.0...")
    and GPT2Model ("h.0...", as on the hub) names; drops the causal-mask buffers old files carry."""
    out = {}
    for name, t in sd.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # not weights: the lower-triangular mask buffer of old transformers versions
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        if name.endswith(CONV1D_NAMES):
            t = t.t()
        out[name] = t.contiguous()
    if "lm_head.weight" not in out and "transformer.wte.weight" in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


@torch.no_grad()
def sample(model, args, device, amp=None) -> str:
    """args.sample_tokens tokens after args.prompt (or <|endoftext|>: the start of a new file), from a
    generator seeded with args.seed: train.py's and train_fsdp.py's sample at the end, and
    finetune_lora.py's before and after fine-tuning, which start from the same random numbers. Under
    FSDP every rank runs the same forwards (each all-gathers the weights), so the ranks stay in step."""
    was_training = model.training
    model.eval()
    prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.EOT]
    g = torch.Generator(device=device).manual_seed(args.seed)
    with devices.autocast(device, amp):
        out = model.generate(torch.tensor([prompt], device=device), args.sample_tokens, args.temperature,
                             args.top_k, generator=g)
    model.train(was_training)
    return tokenizer.decode(t for t in out[0].tolist() if t != tokenizer.EOT)
