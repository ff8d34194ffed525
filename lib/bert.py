"""BERT and DistilBERT masked-language models, by hand, loading and saving Hugging Face checkpoints.

Used by train_splade_unified.py and train_splade_optimized.py (SPLADE reads the masked-LM logits as
term weights); check_model_dir() is what they call first, before any data is built. The one idea:
both are the same post-LayerNorm encoder (embeddings, then blocks of
"x = LN(x + attention(x)); x = LN(x + FFN(x))", then an MLM head whose output matrix is the word
embedding matrix again); they differ in names and in two details (DistilBERT has no token-type
embeddings and half the layers). Module names follow transformers' key names, so loading a
checkpoint is a short, readable rename (see hf_to_ours / ours_to_hf), not a conversion.
"""

import json
import os
import re
import zipfile
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lib import hub, wordpiece
from lib.checkpoint import atomic_write, read_safetensors_header, save_json
from lib.errors import UserError

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # BERT's "gelu" is the exact erf form
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # 0 for DistilBERT, which has no token-type embeddings
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    model_type: str = "bert"  # "bert" | "distilbert"
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    sinusoidal_pos_embds: bool = False  # DistilBERT option: fixed sin/cos position table

    def __post_init__(self):
        if self.model_type not in ("bert", "distilbert"):
            raise ValueError(f"model_type {self.model_type!r} is not supported (bert or distilbert)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")


def small_config(vocab_size: int, model_type="bert", **overrides) -> BertConfig:
    """A small BERT for training from scratch on a CPU (the offline demo): 4 layers, 256 wide, 4 heads."""
    base = dict(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=1024, max_position_embeddings=256, model_type=model_type,
                type_vocab_size=0 if model_type == "distilbert" else 2)
    return BertConfig(**{**base, **overrides})


def config_from_hf(d: dict) -> BertConfig:
    """transformers' config.json (BertConfig or DistilBertConfig field names) -> BertConfig."""
    model_type = d.get("model_type")
    if model_type is None:  # very old configs name only the architecture, or nothing
        arch = " ".join(d.get("architectures") or [])
        model_type = "distilbert" if "DistilBert" in arch or "n_layers" in d else "bert"
    if model_type == "distilbert":
        cfg = dict(vocab_size=d.get("vocab_size", 30522), hidden_size=d.get("dim", 768),
                   num_hidden_layers=d.get("n_layers", 6), num_attention_heads=d.get("n_heads", 12),
                   intermediate_size=d.get("hidden_dim", 3072),
                   max_position_embeddings=d.get("max_position_embeddings", 512), type_vocab_size=0,
                   layer_norm_eps=1e-12, hidden_act=d.get("activation", "gelu"), model_type="distilbert",
                   hidden_dropout_prob=d.get("dropout", 0.1),
                   attention_probs_dropout_prob=d.get("attention_dropout", 0.1),
                   sinusoidal_pos_embds=bool(d.get("sinusoidal_pos_embds", False)))
    elif model_type == "bert":
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {d['position_embedding_type']!r} is not supported (absolute "
                             "only)")
        cfg = {f.name: d[f.name] for f in fields(BertConfig) if f.name in d
               and f.name not in ("model_type", "sinusoidal_pos_embds")}
    else:
        raise ValueError(f"model_type {model_type!r} is not BERT or DistilBERT")
    if d.get("pad_token_id") is not None:
        cfg["pad_token_id"] = d["pad_token_id"]
    if d.get("initializer_range") is not None:
        cfg["initializer_range"] = d["initializer_range"]
    if cfg.get("layer_norm_eps") is None:
        cfg.pop("layer_norm_eps", None)
    return BertConfig(**cfg)


def config_to_hf(cfg: BertConfig) -> dict:
    """BertConfig -> config.json as transformers writes it for BertForMaskedLM / DistilBertForMaskedLM."""
    if cfg.model_type == "distilbert":
        return {"architectures": ["DistilBertForMaskedLM"], "model_type": "distilbert", "vocab_size": cfg.vocab_size,
                "dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads,
                "hidden_dim": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
                "sinusoidal_pos_embds": cfg.sinusoidal_pos_embds, "activation": cfg.hidden_act,
                "dropout": cfg.hidden_dropout_prob, "attention_dropout": cfg.attention_probs_dropout_prob,
                "qa_dropout": 0.1, "seq_classif_dropout": 0.2, "initializer_range": cfg.initializer_range,
                "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": True}
    d = {k: v for k, v in asdict(cfg).items() if k != "sinusoidal_pos_embds"}
    return {"architectures": ["BertForMaskedLM"], **d, "position_embedding_type": "absolute",
            "tie_word_embeddings": True}


# ---- the model ----

def attend(x, q_lin, k_lin, v_lin, n_heads, mask, dropout_p):
    """Multi-head self-attention: [B, T, H] -> [B, T, H] before the output projection.
    mask is [B, T] (1 = real token); padding keys are hidden from every query."""
    B, T, H = x.shape
    q, k, v = (lin(x).view(B, T, n_heads, H // n_heads).transpose(1, 2) for lin in (q_lin, k_lin, v_lin))
    keep = None if mask is None else mask[:, None, None, :].bool()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(B, T, H)


class Embeddings(nn.Module):
    """word + position (+ token type) embeddings, then LayerNorm and dropout."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        if cfg.type_vocab_size:
            self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None):
        T = input_ids.shape[1]
        if T > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence of {T} tokens is longer than the model's "
                             f"{self.position_embeddings.num_embeddings} positions")
        x = self.word_embeddings(input_ids) + self.position_embeddings(torch.arange(T, device=input_ids.device))
        if hasattr(self, "token_type_embeddings"):  # one segment: every token has type 0
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_type_embeddings(types)
        return self.dropout(self.LayerNorm(x))


class BertLayer(nn.Module):
    """Post-LN block. Names as transformers' (attention.self.query -> attention.query)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        H = cfg.hidden_size
        self.n_heads, self.attn_p = cfg.num_attention_heads, cfg.attention_probs_dropout_prob
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.attention = nn.ModuleDict(dict(
            query=nn.Linear(H, H), key=nn.Linear(H, H), value=nn.Linear(H, H),
            output=nn.ModuleDict(dict(dense=nn.Linear(H, H), LayerNorm=nn.LayerNorm(H, eps=cfg.layer_norm_eps)))))
        self.intermediate = nn.ModuleDict(dict(dense=nn.Linear(H, cfg.intermediate_size)))
        self.output = nn.ModuleDict(dict(dense=nn.Linear(cfg.intermediate_size, H),
                                         LayerNorm=nn.LayerNorm(H, eps=cfg.layer_norm_eps)))
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x, mask):
        a = self.attention
        h = attend(x, a.query, a.key, a.value, self.n_heads, mask, self.attn_p if self.training else 0.0)
        x = a.output.LayerNorm(x + self.dropout(a.output.dense(h)))
        h = self.act(self.intermediate.dense(x))
        return self.output.LayerNorm(x + self.dropout(self.output.dense(h)))


class DistilBertLayer(nn.Module):
    """The same block under DistilBERT's names."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        H = cfg.hidden_size
        self.n_heads, self.attn_p = cfg.num_attention_heads, cfg.attention_probs_dropout_prob
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.attention = nn.ModuleDict(dict(q_lin=nn.Linear(H, H), k_lin=nn.Linear(H, H), v_lin=nn.Linear(H, H),
                                            out_lin=nn.Linear(H, H)))
        self.sa_layer_norm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.ffn = nn.ModuleDict(dict(lin1=nn.Linear(H, cfg.intermediate_size),
                                      lin2=nn.Linear(cfg.intermediate_size, H)))
        self.output_layer_norm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x, mask):
        a = self.attention
        h = attend(x, a.q_lin, a.k_lin, a.v_lin, self.n_heads, mask, self.attn_p if self.training else 0.0)
        x = self.sa_layer_norm(x + self.dropout(a.out_lin(h)))
        h = self.ffn.lin2(self.act(self.ffn.lin1(x)))
        return self.output_layer_norm(x + self.dropout(h))


class _Encoder(nn.Module):
    """What both models share: run the blocks, optionally re-computing each in the backward pass."""

    gradient_checkpointing = False  # set True to trade a second forward per layer for activation memory

    def run_layers(self, layers, x, mask):
        for layer in layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = layer(x, mask)
        return x

    def forward(self, input_ids, attention_mask=None):
        """Masked-LM logits [B, T, vocab_size]."""
        return self.mlm_head(self.encode(input_ids, attention_mask))


class BertForMaskedLM(_Encoder):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embeddings = Embeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.predictions = nn.Module()
        self.predictions.transform = nn.ModuleDict(dict(dense=nn.Linear(H, H),
                                                        LayerNorm=nn.LayerNorm(H, eps=cfg.layer_norm_eps)))
        self.predictions.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def encode(self, input_ids, attention_mask=None, token_type_ids=None):
        """The last hidden states [B, T, H] (what transformers' BertModel returns as last_hidden_state)."""
        return self.run_layers(self.encoder.layer, self.embeddings(input_ids, token_type_ids), attention_mask)

    def mlm_head(self, x):
        t = self.predictions.transform
        x = t.LayerNorm(self.act(t.dense(x)))
        # The decoder is the word-embedding matrix itself (tied): a token's output row is its input row.
        return F.linear(x, self.embeddings.word_embeddings.weight, self.predictions.bias)


class DistilBertForMaskedLM(_Encoder):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embeddings = Embeddings(cfg)
        self.transformer = nn.Module()
        self.transformer.layer = nn.ModuleList(DistilBertLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.vocab_transform = nn.Linear(H, H)
        self.vocab_layer_norm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.vocab_projector = nn.Linear(H, cfg.vocab_size)
        self.vocab_projector.weight = self.embeddings.word_embeddings.weight  # tied, as in transformers
        if cfg.sinusoidal_pos_embds:
            with torch.no_grad():
                self.embeddings.position_embeddings.weight.copy_(sinusoidal_table(cfg.max_position_embeddings, H))
            self.embeddings.position_embeddings.weight.requires_grad_(False)

    def encode(self, input_ids, attention_mask=None):
        return self.run_layers(self.transformer.layer, self.embeddings(input_ids), attention_mask)

    def mlm_head(self, x):
        return self.vocab_projector(self.vocab_layer_norm(self.act(self.vocab_transform(x))))


def sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """The Transformer paper's fixed positions: sin on even columns, cos on odd, DistilBERT's layout."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]
    j = torch.arange(dim, dtype=torch.float64)[None, :]
    angle = pos / torch.pow(10000.0, 2 * torch.div(j, 2, rounding_mode="floor") / dim)
    table = torch.empty(n_pos, dim, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(angle[:, 0::2]), torch.cos(angle[:, 1::2])
    return table.float()


def build_model(cfg: BertConfig) -> nn.Module:
    return (DistilBertForMaskedLM if cfg.model_type == "distilbert" else BertForMaskedLM)(cfg)


@torch.no_grad()
def init_weights(model: nn.Module, std: float = None):
    """From-scratch initialisation as transformers does it: N(0, 0.02) weights, zero biases,
    LayerNorm 1 and 0, the padding row zero; a DistilBERT sinusoidal table stays as built."""
    std = model.cfg.initializer_range if std is None else std
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if m is not getattr(model, "vocab_projector", None):  # its weight is the embedding matrix
                m.weight.normal_(0.0, std)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            if m is model.embeddings.position_embeddings and model.cfg.sinusoidal_pos_embds:
                continue
            m.weight.normal_(0.0, std)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
    if isinstance(model, BertForMaskedLM):
        model.predictions.bias.zero_()
    return model


# ---- Hugging Face key names ----
# Ours are transformers' names without the "bert." / "distilbert." / "cls." prefixes, and for BERT
# without the ".self" level inside attention. Everything else is the same string.

IGNORED = re.compile(r"(^|\.)(pooler\.|position_ids$|token_type_ids$)|^cls\.seq_relationship\.")


def hf_to_ours(key: str, model_type: str):
    """A transformers key -> our key, or None for tensors we do not use (pooler, NSP head, buffers)."""
    if IGNORED.search(key):
        return None
    # TF-era checkpoints call a LayerNorm's scale and shift gamma and beta.
    key = re.sub(r"(LayerNorm|layer_norm)\.gamma$", r"\1.weight",
                 re.sub(r"(LayerNorm|layer_norm)\.beta$", r"\1.bias", key))
    if model_type == "distilbert":
        return key.removeprefix("distilbert.")
    key = key.removeprefix("bert.")
    if key.startswith("cls.predictions."):
        key = key.removeprefix("cls.")
    return key.replace(".attention.self.", ".attention.")


def ours_to_hf(key: str, model_type: str) -> str:
    if model_type == "distilbert":
        return key if key.startswith("vocab_") else "distilbert." + key
    if key.startswith("predictions."):
        return "cls." + key
    return "bert." + re.sub(r"\.attention\.(query|key|value)\.", r".attention.self.\1.", key)


# Tied tensors that transformers does not write: the decoder weight is the word-embedding matrix,
# BERT's decoder bias is cls.predictions.bias. When a checkpoint has them we read them only to compare.
TIED = {"bert": ("predictions.decoder.weight", "predictions.decoder.bias"), "distilbert": ("vocab_projector.weight",)}


def to_hf_state_dict(model: nn.Module) -> dict:
    t = model.cfg.model_type
    return {ours_to_hf(k, t): v for k, v in model.state_dict().items() if k not in TIED[t]}


def from_hf_state_dict(hf: dict, cfg: BertConfig, where: str, allow_missing_head=False, log=print, model=None) -> dict:
    """transformers' tensors -> a state dict for build_model(cfg) (or for `model`, already built);
    UserError naming the file and the tensor when one is missing or has the wrong shape."""
    t = cfg.model_type
    sd = {}
    for k, v in hf.items():
        ours = hf_to_ours(k, t)
        if ours is not None:
            sd[ours] = v
    if t == "bert" and "predictions.bias" not in sd and "predictions.decoder.bias" in sd:
        sd["predictions.bias"] = sd["predictions.decoder.bias"]  # some checkpoints keep only the decoder's copy
    want = {k: tuple(v.shape) for k, v in (model or build_model(cfg)).state_dict().items()}
    emb = "embeddings.word_embeddings.weight"
    for tied in TIED[t]:
        if tied in sd:
            v = sd.pop(tied)
            if tied.endswith("weight") and emb in sd and v.shape == sd[emb].shape and not v.is_meta \
                    and not torch.equal(v, sd[emb]):
                log(f"note: {where}: {ours_to_hf(tied, t)} differs from the word embeddings; using the word "
                    f"embeddings (the decoder is tied, as transformers does)")
    if t == "distilbert" and emb in sd:
        sd["vocab_projector.weight"] = sd[emb]
    pos = "embeddings.position_embeddings.weight"
    if cfg.sinusoidal_pos_embds and pos not in sd:  # a fixed table: some checkpoints do not store it
        sd[pos] = sinusoidal_table(cfg.max_position_embeddings, cfg.hidden_size)
    head = [k for k in want if k.startswith(("predictions.", "vocab_"))]
    missing = [k for k in want if k not in sd]
    if missing and set(missing) <= set(head) and allow_missing_head:
        log(f"note: {where} has no masked-LM head (a bare encoder checkpoint); the head starts from random weights")
        fresh = init_weights(build_model(cfg)).state_dict()
        for k in missing:
            sd[k] = fresh[k]
        missing = []
    if missing:
        if set(missing) <= set(head):
            raise UserError(f"{where} has no masked-LM head (missing {ours_to_hf(missing[0], t)}); it is an "
                            f"encoder-only checkpoint, not {config_to_hf(cfg)['architectures'][0]}; use a masked-LM or "
                            "SPLADE checkpoint")
        raise UserError(f"{where} lacks tensor {ours_to_hf(missing[0], t)} ({len(missing)} missing) for a "
                        f"{cfg.num_hidden_layers}-layer {t}; is config.json from the same model?")
    unexpected = sorted(set(sd) - set(want))
    if unexpected:
        log(f"note: {where}: ignored {len(unexpected)} tensors not in a masked LM, e.g. {unexpected[0]}")
        for k in unexpected:
            del sd[k]
    for k, shape in want.items():
        if tuple(sd[k].shape) != shape:
            raise UserError(f"{where}: tensor {ours_to_hf(k, t)} has shape {tuple(sd[k].shape)}, config.json implies "
                            f"{shape}; the weights and config.json are from different models")
    return sd


# ---- files ----

CONFIG, SAFETENSORS, TORCH_BIN = "config.json", "model.safetensors", "pytorch_model.bin"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")  # either one; tokenizer.json wins, as in transformers


def read_config(model_dir: str) -> BertConfig:
    path = os.path.join(model_dir, CONFIG)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; pass a Hugging Face BERT or DistilBERT directory (config.json, "
                        f"model.safetensors, tokenizer.json or vocab.txt) or a hub id")
    try:
        with open(path, encoding="utf-8") as f:
            return config_from_hf(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{path} is not a BERT or DistilBERT config ({e}); pass a BERT-family masked-LM "
                        "checkpoint") from None


def weights_path(model_dir: str) -> str:
    """model.safetensors, or else pytorch_model.bin; UserError when neither (or only shards) is there."""
    st, pt = os.path.join(model_dir, SAFETENSORS), os.path.join(model_dir, TORCH_BIN)
    if os.path.isfile(st):
        return st
    if os.path.isfile(pt):
        return pt
    if os.path.isfile(st + ".index.json"):
        raise UserError(f"{model_dir} holds a sharded checkpoint ({SAFETENSORS}.index.json), which this loader does "
                        f"not read; BERT-sized models fit one file: save the model again as a single {SAFETENSORS}")
    raise UserError(f"{model_dir} has neither {SAFETENSORS} nor {TORCH_BIN}; pass a directory with the model's weights")


def _load_torch_bin(path: str, mmap=False) -> dict:
    try:
        # weights_only=True: a pickle could run code; tensors and dicts cannot.
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {e}); download it again or convert it to "
                        "safetensors") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UserError(f"{path} holds a {type(sd).__name__}, not a state dict of tensors; it is not a model "
                        "checkpoint")
    return sd


def read_weights(model_dir: str) -> tuple:
    """(tensors, path) from model.safetensors, or else pytorch_model.bin (loaded with weights_only=True)."""
    path = weights_path(model_dir)
    if path.endswith(".bin"):
        return _load_torch_bin(path), path
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(path), path
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as safetensors ({e}); download or save it again") from None


def read_weight_shapes(model_dir: str) -> tuple:
    """({tensor name: shape}, path) without reading the tensors: the safetensors header, checked to be
    whole (every tensor's bytes inside the file, so a cut-off download shows), or a zip-format
    pytorch_model.bin memory-mapped (older pickles are read whole)."""
    path = weights_path(model_dir)
    if path.endswith(".bin"):
        sd = _load_torch_bin(path, mmap=zipfile.is_zipfile(path))
        return {k: tuple(v.shape) for k, v in sd.items()}, path
    header, _ = read_safetensors_header(path, "pass a model directory with its weights", dtypes=None)
    shapes = {k: tuple(e["shape"]) for k, e in header.items()}
    return shapes, path


def resolve(name_or_dir: str, cache_dir: str = None, log=print) -> str:
    """A local directory as it is; a hub id downloaded (config, tokenizer files, weights)."""
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if not hub.is_hub_id(name_or_dir) or os.path.exists(name_or_dir):
        raise UserError(f"{name_or_dir!r} is neither a directory nor a hub id; pass a local Hugging Face BERT "
                        f"directory or a hub id such as naver/splade-cocondenser-ensembledistil")
    if cache_dir is None:
        from lib.data import default_cache_dir
        cache_dir = default_cache_dir()
    local = hub.download(name_or_dir, [CONFIG], cache_dir, log=log)
    # Many current repositories ship tokenizer.json and no vocab.txt; older ones the other way round.
    hub.download_first(name_or_dir, list(TOKENIZER_FILES), cache_dir, log=log)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        hub.download_optional(name_or_dir, name, cache_dir, log=log)
    hub.download_first(name_or_dir, [SAFETENSORS, TORCH_BIN], cache_dir, log=log)
    return local


def check_model_dir(name_or_dir: str, cache_dir: str = None, log=print, allow_missing_head=False) -> str:
    """Check a BERT / DistilBERT masked-LM directory (a hub id is downloaded first) before any work is
    done, and return the local directory. Checked: config.json readable and a supported model_type;
    the weights present and whole (the safetensors header and file size, or pytorch_model.bin), every
    tensor there with the shape config.json implies; a tokenizer (tokenizer.json or vocab.txt) that
    loads and fits the model's vocabulary. Every problem found is reported, one line each, naming the
    file and what to do, in one UserError."""
    model_dir = resolve(name_or_dir, cache_dir, log)
    problems = []

    def attempt(check):
        try:
            return check()
        except UserError as e:
            problems.append(str(e))

    cfg = attempt(lambda: read_config(model_dir))
    found = attempt(lambda: read_weight_shapes(model_dir))
    if cfg is not None and found is not None:
        shapes, path = found
        with torch.device("meta"):  # shapes only: nothing is allocated
            meta = {k: torch.empty(shape) for k, shape in shapes.items()}
            attempt(lambda: from_hf_state_dict(meta, cfg, path, allow_missing_head=allow_missing_head,
                                               log=lambda *a: None, model=build_model(cfg)))
    # the script's own load prints its notes
    tok = attempt(lambda: wordpiece.load_tokenizer(model_dir, log=lambda *a: None))
    if tok is not None and cfg is not None and tok.vocab_size > cfg.vocab_size:
        problems.append(f"{tok.where}: the tokenizer has {tok.vocab_size:,} ids but {os.path.join(model_dir, CONFIG)} "
                        f"says vocab_size {cfg.vocab_size:,}; the tokenizer does not belong to this model (use the "
                        f"tokenizer files that came with it)")
    if problems:
        raise UserError("\nerror: ".join(problems))  # main() prints "error: " before the first line
    return model_dir


def load_pretrained(name_or_dir: str, cache_dir: str = None, dtype=torch.float32, log=print, allow_missing_head=False):
    """(model, cfg, model_dir) from a Hugging Face BERT / DistilBERT masked-LM directory or hub id.
    The model is in eval mode; model_dir also holds the tokenizer for lib.wordpiece.load_tokenizer."""
    model_dir = resolve(name_or_dir, cache_dir, log)
    cfg = read_config(model_dir)
    hf, path = read_weights(model_dir)
    model = build_model(cfg)
    sd = from_hf_state_dict(hf, cfg, path, allow_missing_head=allow_missing_head, log=log, model=model)
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()})
    return model.to(dtype).eval(), cfg, model_dir


def save_pretrained(model: nn.Module, cfg: BertConfig, out_dir: str, metadata: dict = None):
    """config.json + model.safetensors in transformers' names (tied copies omitted, as
    save_pretrained does), each written atomically. metadata: extra str -> str for the file header."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in to_hf_state_dict(model).items()}
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    atomic_write(os.path.join(out_dir, SAFETENSORS), lambda tmp: save_file(tensors, tmp, metadata=meta))
    save_json(os.path.join(out_dir, CONFIG), config_to_hf(cfg))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


def param_count(cfg: BertConfig) -> int:
    """num_params(build_model(cfg)) by arithmetic, for memory estimates before anything is built."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    embeddings = (V + cfg.max_position_embeddings + cfg.type_vocab_size) * H + 2 * H
    layer = 4 * (H * H + H) + (H * I + I) + (I * H + H) + 2 * 2 * H  # q, k, v, out; FFN in, out; two LayerNorms
    head = (H * H + H) + 2 * H + V  # transform, LayerNorm, output bias (the output matrix is the embeddings)
    return embeddings + cfg.num_hidden_layers * layer + head


def load_config(name_or_dir: str, cache_dir: str = None, log=print) -> BertConfig:
    """Only the config of a directory or hub id (a hub id downloads config.json alone), e.g. for
    --estimate-memory before any weights are fetched."""
    if os.path.isdir(name_or_dir) or not hub.is_hub_id(name_or_dir):
        return read_config(resolve(name_or_dir, cache_dir, log))
    if cache_dir is None:
        from lib.data import default_cache_dir
        cache_dir = default_cache_dir()
    return read_config(hub.download(name_or_dir, [CONFIG], cache_dir, log=log))
