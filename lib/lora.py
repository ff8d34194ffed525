"""LoRA: low-rank adapters on frozen linear layers, plus PEFT-compatible save/load.

Used by finetune_lora.py (fp32/bf16 base) and finetune_qlora.py (NF4 base from
lib/nf4.py), later judge_train_cuda.py. Adapters are the same files either way.

The one idea: freeze W and learn a rank-r correction, y = W x + (alpha/r) B A x.
A is [r, in] with nn.Linear's init, B is [out, r] of zeros, so training starts
exactly at the base model and only r*(in+out) numbers per layer are trained.

File layout follows Hugging Face PEFT, so `PeftModel.from_pretrained(gpt2, dir)`
can read what we write: adapter_config.json and adapter_model.safetensors with
keys base_model.model.<module path>.lora_A.weight [r, in] / .lora_B.weight [out, r].
"""
import json
import math
import os
import re

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lib import exercise
from lib.checkpoint import atomic_write  # temporary name, then rename; the umask's mode
from lib.nf4 import LinearNF4, dequantize_linear, replace_submodule

PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _base_weight_info(base: nn.Module):
    """(dtype, device) of a base layer's weight, whether dense or NF4."""
    if isinstance(base, LinearNF4):
        return base.weight_dtype, base.weight_packed.device
    return base.weight.dtype, base.weight.device


class LoRALinear(nn.Module):
    """base(x) + lora_B(lora_A(dropout(x))) * scale, with the base frozen.

    Attribute names (base_layer, lora_A, lora_B, lora_dropout) match PEFT, so the
    state_dict keys of the adapter are PEFT's keys minus the "base_model.model." prefix.

    Dtypes: the LoRA weights have their own dtype (default: the base weight's
    dtype). The input is cast to that dtype for the LoRA path and the LoRA output
    is cast back to the base output's dtype before the add. So fp32 LoRA on a bf16
    base keeps fp32 master weights, and bf16 LoRA on an fp32 base works too.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0,
                 rslora: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}")
        base_dtype, device = _base_weight_info(base)
        dtype = dtype or base_dtype
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.rslora = r, alpha, rslora
        self.dropout_p = dropout
        # rsLoRA: alpha/sqrt(r) keeps the update's size stable as r grows.
        self.scale = alpha / math.sqrt(r) if rslora else alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # nn.Linear's own init is kaiming_uniform(a=sqrt(5)), exactly what LoRA uses for A.
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.lora_B.weight)  # B = 0: step 0 is the base model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        h = self.lora_dropout(x).to(self.lora_A.weight.dtype)
        return y + (self.lora_B(self.lora_A(h)) * self.scale).to(y.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scale={self.scale:.4g}, rslora={self.rslora}"


LoRALinear = exercise.swap("lora", LoRALinear)  # BYHAND_EXERCISE=lora: exercises/lora.py's, in every script


def target_matches(name: str, targets) -> bool:
    # PEFT rules: a list matches on a dotted suffix ("c_proj" matches
    # "transformer.h.0.mlp.c_proj", "proj" does not); a string is a full regex.
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, targets=("c_attn",), r: int = 8, alpha: float = 16,
               dropout: float = 0.0, rslora: bool = False, dtype: torch.dtype | None = None) -> list[str]:
    """Wrap matching nn.Linear / LinearNF4 modules in LoRALinear, in place, and freeze
    everything except the LoRA A/B weights. Returns the wrapped module names."""
    if isinstance(targets, (list, tuple)) and not targets:
        raise ValueError("apply_lora: targets is empty; name at least one module, e.g. ('c_attn',)")
    inside_lora = tuple(name + "." for name in _lora_modules(model))
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, (nn.Linear, LinearNF4)) and not name.startswith(inside_lora)}
    names = [name for name in linears if target_matches(name, targets)]
    for one in ([targets] if isinstance(targets, str) else [[t] for t in targets]):
        if not any(target_matches(name, one) for name in linears):
            examples = ", ".join(list(linears)[:6]) or "(none)"
            raise ValueError(f"apply_lora: target {one if isinstance(one, str) else one[0]!r} matches "
                             f"no linear module; linear modules are named like: {examples}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        replace_submodule(model, name, LoRALinear(linears[name], r, alpha, dropout, rslora, dtype))
    for m in _lora_modules(model).values():
        m.lora_A.weight.requires_grad_(True)
        m.lora_B.weight.requires_grad_(True)
    return names


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total); an NF4 weight counts its logical out*in elements, not its bytes."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, LinearNF4))
    return trainable, total


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """LoRA weights under their PEFT key names, detached, contiguous, on CPU, in their own dtype."""
    out = {}
    for name, m in _lora_modules(model).items():
        out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().cpu().contiguous()
        out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().cpu().contiguous()
    return out


def _infer_targets(all_names: list[str], wrapped: list[str]) -> list[str]:
    # Prefer short leaf names ("c_attn") when they select exactly the wrapped set,
    # else fall back to full dotted paths, which always do.
    leaves = sorted({n.rsplit(".", 1)[-1] for n in wrapped})
    if sorted(n for n in all_names if target_matches(n, leaves)) == sorted(wrapped):
        return leaves
    return sorted(wrapped)


def save_adapter(model: nn.Module, out_dir: str, config_dict: dict | None = None,
                 fan_in_fan_out: bool = True) -> dict:
    """Write adapter_config.json + adapter_model.safetensors (PEFT layout) to out_dir.

    r, lora_alpha, lora_dropout, use_rslora and target_modules are read from the
    model; config_dict adds or overrides fields (e.g. base_model_name_or_path,
    target_modules as the user spelled them). Tensors are saved in their own dtype.
    fan_in_fan_out is true by default because the HF GPT-2 base stores these layers as Conv1D
    ([in, out]); pass False for bases whose layers are nn.Linear in transformers too (Llama,
    Qwen2). It only affects how PEFT merges, not the A/B shapes.
    Returns the config written.
    """
    loras = _lora_modules(model)
    if not loras:
        raise ValueError("save_adapter: the model has no LoRA layers; call apply_lora first")
    settings = {(m.r, m.alpha, m.dropout_p, m.rslora) for m in loras.values()}
    if len(settings) > 1:
        raise ValueError(f"save_adapter: LoRA layers have different settings {sorted(settings)}; "
                         "one adapter file holds one (r, alpha, dropout, rslora)")
    r, alpha, dropout, rslora = settings.pop()
    all_names = [n for n, _ in model.named_modules()]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _infer_targets(all_names, list(loras)),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    config.update(config_dict or {})
    if isinstance(config["target_modules"], tuple):
        config["target_modules"] = list(config["target_modules"])
    matched = sorted(n for n in loras if target_matches(n, config["target_modules"]))
    if matched != sorted(loras):
        raise ValueError(f"save_adapter: target_modules {config['target_modules']!r} do not select "
                         f"exactly the LoRA layers of the model ({sorted(loras)})")

    os.makedirs(out_dir, exist_ok=True)
    tensors = adapter_state_dict(model)
    atomic_write(os.path.join(out_dir, WEIGHTS_NAME),
                  lambda p: save_file(tensors, p, metadata={"format": "pt"}))

    def write_json(p):
        with open(p, "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    atomic_write(os.path.join(out_dir, CONFIG_NAME), write_json)
    return config


def read_adapter_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, CONFIG_NAME)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"load_adapter: {path} not found; is {adapter_dir} a LoRA adapter directory?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"load_adapter: {path} line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"load_adapter: {path} cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"load_adapter: {path} holds a JSON {type(config).__name__}, not an adapter config object")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in config:
            raise ValueError(f"load_adapter: {path} has no field {key!r}")
    number = (int, float)
    checks = {  # field: (is the value usable, what it must be)
        "r": (type(config["r"]) is int and config["r"] >= 1, "a positive integer"),
        "lora_alpha": (type(config["lora_alpha"]) in number and math.isfinite(config["lora_alpha"])
                       and config["lora_alpha"] > 0, "a positive number"),
        "lora_dropout": (type(config.get("lora_dropout", 0.0)) in number and 0 <= config.get("lora_dropout", 0.0) < 1,
                         "a number in [0, 1)"),
        "target_modules": (isinstance(config["target_modules"], str) or (
            isinstance(config["target_modules"], list) and config["target_modules"]
            and all(isinstance(t, str) for t in config["target_modules"])), "a list of module names"),
        "use_rslora": (isinstance(config.get("use_rslora", False), bool), "true or false"),
    }
    for key, (ok, what) in checks.items():
        if not ok:
            raise ValueError(f"load_adapter: {path} has {key} {config[key]!r}; it must be {what}")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"load_adapter: {path} has peft_type {config['peft_type']!r}; only LORA is supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"load_adapter: {path} has bias {config['bias']!r}; only 'none' is supported")
    if config.get("use_dora"):
        raise ValueError(f"load_adapter: {path} is a DoRA adapter; only plain LoRA is supported")
    return config


def read_adapter_weights(adapter_dir: str) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors as {PEFT key: tensor}; a ValueError naming the file when it is
    missing, truncated or not safetensors at all."""
    path = os.path.join(adapter_dir, WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"load_adapter: {path} not found")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"load_adapter: {path} cannot be read as safetensors ({e}); the file is truncated "
                         f"or corrupted: save or download the adapter again") from None


def load_adapter(model: nn.Module, adapter_dir: str, dtype: torch.dtype | None = None) -> dict:
    """Load a PEFT LoRA adapter into model, in place, and return its config.

    A plain model gets LoRA applied with the file's settings first; a model that
    already has LoRA layers must have the same ones (names, r, scale). Every
    tensor in the file must land on a LoRA weight of the same shape, and every
    LoRA weight must be filled.
    """
    config = read_adapter_config(adapter_dir)
    path = os.path.join(adapter_dir, WEIGHTS_NAME)
    r, alpha, rslora = config["r"], config["lora_alpha"], config.get("use_rslora", False)
    loras = _lora_modules(model)
    if not loras:
        apply_lora(model, config["target_modules"], r, alpha, config.get("lora_dropout", 0.0), rslora, dtype)
        loras = _lora_modules(model)
    scale = alpha / math.sqrt(r) if rslora else alpha / r
    for name, m in loras.items():
        if m.r != r or not math.isclose(m.scale, scale):
            raise ValueError(f"load_adapter: layer {name} has r={m.r}, scale={m.scale:.4g} but "
                             f"{adapter_dir} has r={r}, scale={scale:.4g}")

    params = {}
    for name, m in loras.items():
        params[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight
        params[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight
    tensors = read_adapter_weights(adapter_dir)
    for key, t in tensors.items():
        if key not in params:
            raise ValueError(f"load_adapter: {path} key {key!r} matches no LoRA layer of the model "
                             f"(expected keys like {next(iter(params))!r})")
        if t.shape != params[key].shape:
            raise ValueError(f"load_adapter: {path} key {key!r} has shape {list(t.shape)}, "
                             f"the model expects {list(params[key].shape)}")
        with torch.no_grad():
            params[key].copy_(t)  # copy_ casts to the LoRA weight's dtype and device
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"load_adapter: {path} lacks {len(missing)} LoRA weights the model has, "
                         f"e.g. {missing[0]!r}")
    return config


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA layer into a plain nn.Linear, in place: W' = W + scale * B @ A.

    Our weights are [out, in] (nn.Linear), so no transpose is needed. An NF4 base
    is dequantised first (to its original dtype); the sum is formed in fp32 and
    then cast to the base weight's dtype.
    """
    for name, m in list(_lora_modules(model).items()):
        base = m.base_layer
        linear = dequantize_linear(base) if isinstance(base, LinearNF4) else base
        delta = m.lora_B.weight.float() @ m.lora_A.weight.float() * m.scale
        linear.weight.copy_((linear.weight.float() + delta.to(linear.weight.device)).to(linear.weight.dtype))
        replace_submodule(model, name, linear)
    return model


merge_lora = exercise.swap("lora", merge_lora)


def lora_checks(lora_class=LoRALinear, merge=merge_lora) -> str:
    """What a run alone would not show, checked when a learner's LoRA is swapped in: a fresh layer must compute its
    base exactly (B = 0), else training starts from a damaged model and its gain looks larger than it is; and a
    merged layer must compute what the adapted one did. Returns what is wrong, or ""."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base, x = nn.Linear(8, 6), torch.randn(3, 8)
        layer = lora_class(base, r=2, alpha=4)
        with torch.no_grad():
            if not torch.equal(layer(x), base(x)):
                return "a fresh LoRALinear does not compute its base exactly (lora_B must start at zero)"
            layer.lora_B.weight.normal_()
            adapted = layer(x)
            merged = merge(nn.Sequential(layer))[0]
            if not torch.allclose(merged(x), adapted, atol=1e-5):
                return "merge_lora's layer does not compute what the adapted layer did (W + scale * B @ A)"
    return ""


if "lora" in exercise.chosen():
    try:
        _wrong = lora_checks()
    except NotImplementedError as e:
        exercise.fail(f"exercise lora: {e}")
    if _wrong:
        exercise.fail(f"exercise lora: {_wrong}; python -m pytest exercises/test_lora.py shows where")
