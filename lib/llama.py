"""A Llama / Qwen2 decoder by hand: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Used by judge_train_mps.py and judge_train_cuda.py (and bench/judge.py). Any Hugging Face
LlamaForCausalLM or Qwen2ForCausalLM checkpoint loads by key name, single-file or sharded.

The one idea: a modern decoder is GPT-2 with four substitutions. LayerNorm becomes RMSNorm (no
mean, no bias); learned positions become RoPE (rotate each query/key pair by an angle that grows
with position, so attention sees only relative distance); the MLP becomes SwiGLU (a gated
down(silu(gate x) * up x)); and several query heads share one key/value head (grouped-query
attention), which shrinks the KV cache. Qwen2 is Llama plus biases on q/k/v.

Module names mirror transformers' (model.layers.N.self_attn.q_proj, model.norm, lm_head), so a
checkpoint's keys are this module's state_dict keys and PEFT adapter names line up.
"""
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lib import hub, lm_loss
from lib.checkpoint import SAFETENSORS_DTYPES, read_safetensors_header, read_tensor
from lib.errors import UserError
from lib.nf4 import LinearNF4, replace_submodule

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# --- config ---------------------------------------------------------------------------------------
@dataclass
class LlamaConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None          # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False         # Llama: bias on q/k/v/o; Qwen2 always has q/k/v bias, never o
    mlp_bias: bool = False
    model_type: str = "llama"            # "llama" | "qwen2"
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    initializer_range: float = 0.02
    extra: dict = field(default_factory=dict, repr=False)  # other config.json keys, written back as read

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type == "llama" and self.attention_bias


def tiny_config(**overrides) -> LlamaConfig:
    """2 layers, 64 wide, 4 query heads sharing 2 key/value heads: the shape tests use."""
    return LlamaConfig(**overrides)


def config_from_hf(d: dict, where: str = "config.json") -> LlamaConfig:
    """A LlamaConfig from a config.json dict (transformers 4.x rope_scaling or 5.x rope_parameters)."""
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type not in ARCHITECTURES or any(a not in ARCHITECTURES.values() for a in archs):
        raise UserError(f"{where} describes model_type {model_type!r} {archs}; only LlamaForCausalLM and "
                        f"Qwen2ForCausalLM checkpoints are supported; pick a Llama or Qwen2 model")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if not isinstance(d.get(k), int)]
    if missing:
        raise UserError(f"{where} has no integer {missing[0]}; re-download or fix config.json")
    known = {f.name for f in fields(LlamaConfig)} - {"extra", "rope_scaling", "rope_theta"}
    kw = {k: d[k] for k in known if d.get(k) is not None}
    # transformers' defaults where the file is silent (ours suit the tiny demo model instead)
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    kw.setdefault("tie_word_embeddings", False)
    # transformers 5 writes {"rope_parameters": {"rope_type", "rope_theta", ...}}; 4.x rope_theta + rope_scaling.
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kw["rope_theta"] = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise UserError(f"{where} asks for rope_type {rope_type!r}; supported are default, linear and llama3")
    need = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[rope_type]
    if any(not isinstance(rope.get(k), (int, float)) for k in need):
        raise UserError(f"{where}: rope scaling {rope_type} needs numbers for {', '.join(need)}; fix config.json")
    kw["rope_scaling"] = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    if model_type == "qwen2" and d.get("use_sliding_window"):
        raise UserError(f"{where} turns on use_sliding_window; sliding-window attention is not supported")
    try:
        cfg = LlamaConfig(**kw)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}; fix or re-download config.json") from None
    cfg.extra = {k: v for k, v in d.items() if k not in known and k not in ("rope_scaling", "rope_theta",
                                                                               "rope_parameters", "architectures")}
    return cfg


def config_to_hf(cfg: LlamaConfig) -> dict:
    """config.json as transformers writes it (legacy rope_theta + rope_scaling, read by 4.x and 5.x)."""
    d = dict(cfg.extra)
    d.update({k: v for k, v in asdict(cfg).items() if k not in ("extra", "initializer_range")})
    d["initializer_range"] = cfg.initializer_range
    d["architectures"] = [ARCHITECTURES[cfg.model_type]]
    if cfg.model_type == "qwen2":
        d.pop("attention_bias"), d.pop("mlp_bias")  # Qwen2's biases are fixed by the architecture
        d.setdefault("use_sliding_window", False)
    d.setdefault("hidden_act", "silu")
    return d


def read_config(model_dir: str) -> LlamaConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} is missing; pass a Hugging Face model directory (config.json + "
                        f"model.safetensors) or a hub id") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno} column {e.colno}: {e.msg}; re-download or fix it") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; re-download or fix it") from None
    if d.get("hidden_act", "silu") != "silu":
        raise UserError(f"{path} has hidden_act {d['hidden_act']!r}; this decoder implements silu (SwiGLU)")
    return config_from_hf(d, path)


# --- the parts --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back as transformers does."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """The head_dim/2 rotation frequencies theta^(-2i/d), with llama3's long-context rescaling.

    Llama 3.1+ divides the low frequencies (wavelengths longer than the original context) by
    `factor`, keeps the high ones, and blends linearly in between, so nearby tokens are seen as
    sharply as before while far positions stay within the range the model was trained on.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype):
    """cos, sin of shape [B, T, head_dim]: angle position * freq, the half-size table written twice."""
    angles = position_ids[:, :, None].float() * inv_freq[None, None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # transformers pairs dimension i with i + d/2 (not 2i with 2i+1 as the RoPE paper writes it).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, head_dim] rotated by its positions' angles."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, T, D] -> [B, kv_heads * n_rep, T, D]: each key/value head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


class KVCache:
    """Per layer, the keys and values of every position seen so far (grown by concatenation)."""

    def __init__(self, n_layers: int):
        self.keys = [None] * n_layers
        self.values = [None] * n_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=2)
            v = torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, mask, kv_cache):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        k, v = repeat_kv(k, self.n_head // self.n_kv), repeat_kv(v, self.n_head // self.n_kv)
        # mask None means plain causal attention over positions 0..t-1 (no cache, no padding).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        # SwiGLU: the gate decides, per hidden unit, how much of the "up" signal passes.
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask=None, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """transformers' `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # _weight skips nn.Embedding's own init: Llama._init_weights does it, and on the meta device
        # (load_pretrained) a normal_ costs seconds of one-time setup for nothing.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def attention_mask_4d(attention_mask: torch.Tensor | None, t: int, past: int, device) -> torch.Tensor | None:
    """Boolean [B or 1, 1, t, past + t] mask (True = may attend): causal, and no padding keys.

    None when plain causal SDPA does the job (no padding; no cache, or one new token).
    """
    if attention_mask is None and (past == 0 or t == 1):
        return None
    total = past + t
    q_pos = torch.arange(past, total, device=device)[:, None]
    mask = (torch.arange(total, device=device)[None, :] <= q_pos)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -total:].bool()
        # A padding query may see no key at all; SDPA would give NaN. Let it see everything: its
        # output is never used, and no real token ever attends to it.
        mask = mask | ~mask.any(-1, keepdim=True)
    return mask


class Llama(nn.Module):
    """LlamaForCausalLM / Qwen2ForCausalLM: forward(input_ids) -> logits [B, T, vocab];
    forward(input_ids, labels=labels) -> the next-token loss, without the logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self._inv_freq = {}  # per device; a plain attribute, so .to(bf16) can never round it
        self.apply(self._init_weights)

    def _init_weights(self, m):
        # transformers' init: N(0, 0.02) for every linear and embedding, zero biases, RMSNorm weight 1.
        if isinstance(m, (nn.Linear, nn.Embedding)) and not m.weight.is_meta:
            nn.init.normal_(m.weight, std=self.config.initializer_range)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def inv_freq(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_inv_freq(self.config, device)
        return self._inv_freq[key]

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      kv_cache: KVCache | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [B, T, hidden] (after model.norm): what lm_head turns into logits.

        attention_mask [B, past + T] (1 = token, 0 = padding) is only needed when a padded row
        has real tokens after padding (left padding); right-padded training batches are causal
        already. kv_cache (a KVCache) is extended in place by the new keys and values.
        """
        b, t = input_ids.shape
        past = len(kv_cache) if kv_cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq(input_ids.device), position_ids, x.dtype)
        if torch.is_autocast_enabled(x.device.type):
            dt = torch.get_autocast_dtype(x.device.type)
            cos, sin = cos.to(dt), sin.to(dt)
        mask = attention_mask_4d(attention_mask, t, past, input_ids.device)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # Keep only each layer's input; recompute its insides during backward.
                x = checkpoint(layer, x, cos, sin, mask, kv_cache, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                kv_cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                logits_to_keep: int = 0, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] (the last `logits_to_keep` positions if > 0), in the compute dtype.

        With labels [B, T] it returns the loss instead, as transformers' `.loss`: the mean next-token
        cross-entropy (position t predicts labels[:, t + 1]; -100 is ignored; 0 when nothing counts),
        computed chunk by chunk by lib/lm_loss without making the [B, T, vocab] logits (622 MB in
        fp32 for 2 x 512 tokens of Qwen2's 151,936-word vocabulary). See hidden_states for the rest.
        """
        x = self.hidden_states(input_ids, attention_mask, kv_cache, position_ids)
        if labels is not None:
            return lm_loss.head_loss(x, self.lm_head, lm_loss.shift_labels(labels))  # adapted head: the plain loss
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.lm_head(x)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy decoding with a KV cache; returns [B, T + new] (prompt included, as transformers).

        Batches must be left-padded (attention_mask marks real tokens). A row that produced an
        end-of-sequence id is filled with that id afterwards; decoding stops when every row ended.
        """
        stops = torch.tensor([] if eos_token_id is None else
                             [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                             dtype=torch.long, device=input_ids.device)
        b = input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        padded = not bool(attention_mask.all())
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = KVCache(self.config.num_hidden_layers)
        out, done = input_ids, torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        step_ids, step_pos = input_ids, position_ids
        for _ in range(max_new_tokens):
            logits = self(step_ids, attention_mask if padded else None, cache, step_pos, logits_to_keep=1)
            nxt = logits[:, -1].argmax(-1)
            if len(stops):
                nxt = torch.where(done, stops[0], nxt)
                done = done | (nxt[:, None] == stops[None]).any(-1)
            out = torch.cat((out, nxt[:, None]), dim=1)
            attention_mask = torch.cat((attention_mask, attention_mask.new_ones(b, 1)), dim=1)
            step_ids, step_pos = nxt[:, None], step_pos[:, -1:] + 1
            if bool(done.all()):
                break
        return out

    def num_params(self) -> int:
        """Distinct parameters (a tied head counts once); an NF4 weight counts its logical size."""
        n = sum(p.numel() for p in self.parameters())
        return n + sum(m.in_features * m.out_features for m in self.modules() if isinstance(m, LinearNF4))


def build_model(cfg: LlamaConfig, seed: int | None = None, dtype=torch.float32, device="cpu") -> Llama:
    """A randomly initialised model (transformers' N(0, 0.02) init), e.g. the offline demo model."""
    if seed is not None:
        torch.manual_seed(seed)
    # Built directly on the device in the dtype: a 3B bench model never exists twice.
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Llama(cfg)
    finally:
        torch.set_default_dtype(default)


# --- loading and saving in the Hugging Face layout --------------------------------------------------
_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _read_header_of(path: str):
    return read_safetensors_header(path, "download the model again or pass a complete model directory")


def weight_files(model_dir: str) -> dict[str, str]:
    """{tensor name: file path} from model.safetensors.index.json, else from model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); download it "
                            "again") from None
        return {name: os.path.join(model_dir, shard) for name, shard in weight_map.items()}
    single = os.path.join(model_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise UserError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json; "
                        f"pass a Hugging Face model directory with safetensors weights")
    header, _ = _read_header_of(single)
    return {name: single for name in header}


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        model = Llama(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def load_pretrained(model_dir: str, dtype=torch.float32, device="cpu", convert_linear=None, log=print) -> Llama:
    """The model in model_dir, frozen (requires_grad False), in `dtype` on `device`.

    Tensors are read one at a time. Each decoder-layer linear (q/k/v/o, gate/up/down) is built as
    soon as its weight (and bias) arrived and handed to convert_linear(name, nn.Linear) -> module
    (e.g. NF4 quantisation), so a full-precision copy of the whole model never exists.
    """
    cfg = read_config(model_dir)
    files = weight_files(model_dir)
    want = expected_shapes(cfg)
    # Check every name and shape from the headers before reading a single weight.
    headers = {}
    for path in sorted(set(files.values())):
        headers[path] = _read_header_of(path)
    found = {}
    for name, path in files.items():
        if name not in headers[path][0]:
            raise UserError(f"{path} lacks tensor {name} that model.safetensors.index.json places there; "
                            f"download the model again")
        found[name] = path
    for path, (header, _) in headers.items():
        for name in header:
            found.setdefault(name, path)
    for name, path in found.items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name not in want:
            raise UserError(f"{path}: unexpected tensor {name}; is this a {ARCHITECTURES[cfg.model_type]} "
                            f"checkpoint matching its config.json?")
        shape = tuple(headers[path][0][name]["shape"])
        if shape != want[name]:
            raise UserError(f"{path}: tensor {name} has shape {list(shape)} but config.json implies "
                            f"{list(want[name])}; the weights and config.json do not belong together")
    missing = sorted(set(want) - set(found))
    if missing:
        raise UserError(f"{model_dir}: tensor {missing[0]} is missing ({len(missing)} missing in all) from "
                        f"{', '.join(sorted({os.path.basename(p) for p in headers}))}; download the model again")

    with torch.device("meta"):
        model = Llama(cfg)
    linear_names = {f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in LAYER_LINEARS}
    pending, rest = {}, {}
    for path, (header, start) in headers.items():
        log(f"loading {os.path.basename(path)} ({len(header)} tensors)")
        with open(path, "rb") as f:
            for name, entry in header.items():
                if name not in want:
                    continue
                t = read_tensor(f, entry, start).to(device=device, dtype=dtype)
                module_name, _, kind = name.rpartition(".")
                if module_name not in linear_names:
                    rest[name] = nn.Parameter(t, requires_grad=False)
                    continue
                parts = pending.setdefault(module_name, {})
                parts[kind] = t
                meta = model.get_submodule(module_name)
                if len(parts) == (2 if meta.bias is not None else 1):
                    linear = nn.Linear(meta.in_features, meta.out_features, bias=meta.bias is not None, device="meta")
                    linear.weight = nn.Parameter(parts["weight"], requires_grad=False)
                    if meta.bias is not None:
                        linear.bias = nn.Parameter(parts["bias"], requires_grad=False)
                    replace_submodule(model, module_name, convert_linear(module_name, linear)
                                      if convert_linear else linear)
                    del pending[module_name], linear, parts
    model.load_state_dict(rest, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    model.eval()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"load_pretrained left {left[:3]} unloaded"
    return model


def save_pretrained(model: Llama, cfg: LlamaConfig, out_dir: str, dtype=None) -> None:
    """config.json + model.safetensors in the Hugging Face layout (a plain model: merge LoRA first)."""
    from lib.checkpoint import atomic_write, save_json
    from safetensors.torch import save_file

    odd = [n for n, m in model.named_modules() if isinstance(m, LinearNF4) or hasattr(m, "lora_A")]
    if odd:
        raise ValueError(f"save_pretrained: {odd[0]} is a LoRA or NF4 layer; merge or dequantise first")
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tensors = {k: (v.to(dtype) if dtype else v).detach().cpu().contiguous() for k, v in sd.items()}
    os.makedirs(out_dir, exist_ok=True)
    d = config_to_hf(cfg)
    d["torch_dtype"] = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    if "dtype" in d:  # transformers 5 spells it "dtype"; keep both true
        d["dtype"] = d["torch_dtype"]
    save_json(os.path.join(out_dir, "config.json"), d)
    atomic_write(os.path.join(out_dir, "model.safetensors"),
                 lambda p: save_file(tensors, p, metadata={"format": "pt"}))


# --- where the files come from ----------------------------------------------------------------------
# The shapes of the models the judge scripts name, from each hub repository's config.json, so that
# --estimate-memory works before (and without) a download.
KNOWN_CONFIGS = {
    "Qwen/Qwen2-1.5B-Instruct": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "Qwen/Qwen2.5-3B-Instruct": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "meta-llama/Llama-3.2-1B-Instruct": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009]),
}


def config_for_estimate(name_or_dir: str, cache_dir: str) -> LlamaConfig:
    """The model's shape without downloading weights: a directory's config.json, a cached hub copy's,
    or KNOWN_CONFIGS for the named models."""
    if os.path.isdir(name_or_dir):
        return read_config(name_or_dir)
    cached = os.path.join(cache_dir, "hub", name_or_dir.replace("/", "--"), "main")
    if os.path.isfile(os.path.join(cached, "config.json")):
        return read_config(cached)
    if name_or_dir in KNOWN_CONFIGS:
        return LlamaConfig(**KNOWN_CONFIGS[name_or_dir])
    raise UserError(f"--model {name_or_dir!r} is not downloaded yet, so its size is unknown; run once without "
                    f"--estimate-memory to download it, or pass a local model directory")


# What transformers reads besides the weights (the same list as lib/chat_tokenizer.TOKENIZER_FILES,
# kept here so the decoder does not depend on the tokenizer module).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
OFFLINE_HINT = "--model tiny runs the offline demo without any download"


def resolve_model(name_or_dir: str, cache_dir: str, log=print) -> str:
    """A local directory as it is; a hub id downloaded into cache_dir (config, tokenizer, weights)."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if hub.is_hub_id(name_or_dir) and not os.path.exists(name_or_dir):
        return hub.download_model(name_or_dir, cache_dir, optional=TOKENIZER_FILES, hint=OFFLINE_HINT, log=log)
    raise UserError(f"--model {name_or_dir!r} is neither a directory nor a hub id; pass a local Hugging Face "
                    f"model directory, a hub id such as Qwen/Qwen2-1.5B-Instruct, or --model tiny")
