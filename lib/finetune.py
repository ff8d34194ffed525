"""Adapter fine-tuning: the pieces finetune_lora.py and finetune_qlora.py share.

Used by finetune_lora.py and finetune_qlora.py (the steps themselves stay visible in each script).
The one idea: fine-tuning with LoRA is the pretraining loop with the base frozen, so what changes
sits around the loop, not in it. The base is read from its safetensors file one tensor at a time,
and each block linear is converted (kept, cast to 16 bits, or quantised to NF4) the moment it is
read, so the full-precision model never has to fit in memory; only the LoRA matrices reach the
optimizer; and what is saved is the small adapter (PEFT layout) plus, for --resume, the optimizer
state and those same LoRA matrices in one atomically written file.
"""

import argparse
import json
import os

import torch
import torch.nn as nn

from lib import checkpoint, data, gpt, hub, lora, tokenizer
from lib import device as devices
from lib.errors import UserError
from lib.nf4 import LinearNF4, dequantize_linear, replace_submodule

DEFAULT_BASE = os.path.join("out", "train")  # what `python train.py` writes
DEFAULT_DATA = "stdlib-tests"  # the stdlib's own test files: the domain pretraining left out
# Module names inside a GPT-2 block. PEFT's rule: a target matches a module whose dotted name ends
# in ".<target>", so "c_proj" selects both attn.c_proj and mlp.c_proj.
TARGET_CHOICES = ("c_attn", "c_proj", "attn.c_proj", "c_fc", "mlp.c_proj")
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
LORA_DEFAULTS = dict(r=8, alpha=16, dropout=0.0, targets=["c_attn"], rslora=False)


# --- arguments ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, out_dir: str, dtype_help: str):
    """The flags both fine-tuning scripts take; train.py's names wherever the meaning is the same."""
    g = p.add_argument_group("data")
    g.add_argument("--data", default=DEFAULT_DATA, help="a text file, a directory of text files, a prepared shard "
                   "directory, or 'stdlib-tests' (the Python stdlib's own tests, which pretraining left out)")
    g.add_argument("--cache-dir", default=data.default_cache_dir(), help="where prepared shards and hub downloads are kept")
    g = p.add_argument_group("base model")
    g.add_argument("--init-from", help=f"the frozen base: a Hugging Face GPT-2 directory or a hub id (gpt2, "
                   f"gpt2-medium, gpt2-large, gpt2-xl, org/name); when not given, {DEFAULT_BASE}, what train.py writes")
    g.add_argument("--block-size", type=int, help="sequence length; when not given, the base model's")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-r", type=int, default=LORA_DEFAULTS["r"], help="rank of the update B @ A")
    g.add_argument("--lora-alpha", type=float, default=LORA_DEFAULTS["alpha"], help="the update is scaled by alpha / r")
    g.add_argument("--lora-dropout", type=float, default=LORA_DEFAULTS["dropout"], help="dropout on the LoRA path's input")
    g.add_argument("--lora-targets", nargs="+", default=LORA_DEFAULTS["targets"], metavar="NAME",
                   help=f"modules to adapt, from {', '.join(TARGET_CHOICES)} (c_proj = both attn.c_proj and mlp.c_proj)")
    g.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(r) (rank-stabilised LoRA)")
    g.add_argument("--adapter", help="start from this saved adapter directory (its r, alpha and targets); "
                   "with --steps 0 it is only evaluated and sampled")
    g.add_argument("--merge", action="store_true", help="also write base + B @ A * scale as a plain Hugging Face "
                   "GPT-2 directory, OUT/merged (loadable by train.py --init-from)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=200, help="optimizer steps in total")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=5e-3, help="peak learning rate of A and B (tuned on the tiny default "
                   "run; the LoRA paper used 2e-4 for GPT-2 medium and large)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate as a fraction of --lr")
    g.add_argument("--warmup-steps", type=int, default=10)
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay on A and B")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.999)
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, mps or cpu; when not given, the first available in that order")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help=dtype_help)
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--out-dir", default=out_dir, help="adapter (PEFT layout), training state and metrics.jsonl")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    g.add_argument("--eval-interval", type=int, default=50, help="steps between held-out losses")
    g.add_argument("--eval-batches", type=int, default=10, help="batches per held-out loss")
    g.add_argument("--save-interval", type=int, default=100, help="steps between saves (and one at the end)")
    g.add_argument("--log-interval", type=int, default=10, help="steps between progress lines")
    g.add_argument("--peak-flops", type=float, help="peak FLOP/s of the device, for MFU where it is not in the table")
    g.add_argument("--estimate-memory", action="store_true", help="print the predicted memory breakdown and exit "
                   "(reads config.json only; a hub id is not downloaded)")
    g = p.add_argument_group("sample")
    g.add_argument("--sample-tokens", type=int, default=100, help="tokens to sample before and after (0: none)")
    g.add_argument("--prompt", default="", help="sample prompt; empty: start a new file after <|endoftext|>")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=200)


def check_arguments(args):
    """The mistakes argparse cannot see, as one-line UserErrors."""
    if args.batch_size < 1 or args.grad_accum < 1 or args.steps < 0:
        raise UserError("--batch-size and --grad-accum must be at least 1 and --steps at least 0")
    if args.lora_r < 1:
        raise UserError(f"--lora-r must be at least 1, got {args.lora_r}")
    if float(args.lora_alpha).is_integer():
        args.lora_alpha = int(args.lora_alpha)  # adapter_config.json then says 16, as PEFT writes it
    if not 0 <= args.lora_dropout < 1:
        raise UserError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    args.lora_targets = [t for value in args.lora_targets for t in value.split(",") if t]
    bad = [t for t in args.lora_targets if t not in TARGET_CHOICES]
    if bad or not args.lora_targets:
        raise UserError(f"--lora-targets {' '.join(bad) or '(none)'}: choose from {', '.join(TARGET_CHOICES)}")
    if args.resume and args.adapter:
        raise UserError("--resume continues the adapter saved in --out-dir, --adapter starts from another one; pass one of them")


# --- the base model -------------------------------------------------------------------------------
def resolve_base(init_from, cache_dir, log=print) -> str:
    """--init-from as a local directory (a hub id is downloaded); without it, train.py's output."""
    if init_from:
        return hub.resolve_pretrained(init_from, cache_dir, log=log)
    if not os.path.isfile(os.path.join(DEFAULT_BASE, checkpoint.WEIGHTS)):
        raise UserError(f"no base model: {DEFAULT_BASE}/{checkpoint.WEIGHTS} does not exist; run `python train.py` "
                        f"first, or pass --init-from (a GPT-2 directory or a hub id such as gpt2)")
    return DEFAULT_BASE


def read_config(model_dir: str) -> gpt.GPTConfig:
    """config.json alone, as the GPTConfig it describes."""
    path = os.path.join(model_dir, checkpoint.CONFIG)
    try:
        with open(path) as f:
            return gpt.config_from_hf(json.load(f))
    except FileNotFoundError:
        raise UserError(f"{path} is missing, so {model_dir!r} is not a GPT-2 checkpoint; point --init-from at a "
                        f"directory holding config.json and model.safetensors") from None
    except (json.JSONDecodeError, ValueError) as e:
        raise UserError(f"{path} is not a GPT-2 config ({e})") from None


def config_for_estimate(init_from, cache_dir, log=print) -> gpt.GPTConfig:
    """The base's shape without its weights: the known GPT-2 sizes by name, else config.json only."""
    if init_from in gpt.MODEL_SIZES and not os.path.isdir(init_from):
        return gpt.GPTConfig(**gpt.MODEL_SIZES[init_from])
    if init_from and not os.path.isdir(init_from):
        return read_config(hub.resolve_pretrained(init_from, cache_dir, filenames=("config.json",), log=log))
    return read_config(resolve_base(init_from, cache_dir, log))


# A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
# dtype, shape and byte range, and then the raw bytes. Reading it by hand lets us take one tensor at
# a time with plain file reads: nothing is memory-mapped, so the resident set never holds the file.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _read_header(path: str):
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise UserError(f"{path} is missing; point --init-from at a directory holding config.json and "
                        f"model.safetensors") from None
    except (ValueError, OSError, MemoryError, OverflowError) as e:
        raise UserError(f"{path} cannot be read as safetensors ({type(e).__name__}); download or save it again") from None
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if entry.get("dtype") not in _SAFETENSORS_DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {entry.get('dtype')}; a GPT-2 checkpoint holds float tensors")
    return header, 8 + n


def _read_tensor(f, entry: dict, data_start: int) -> torch.Tensor:
    begin, end = entry["data_offsets"]
    buf = bytearray(end - begin)
    f.seek(data_start + begin)
    if f.readinto(buf) != len(buf):
        raise UserError(f"{f.name} is truncated (a tensor's bytes end past the end of the file); download or save it again")
    dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
    t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    return t.reshape(entry["shape"])


def load_base(model_dir: str, device, convert_linear=None) -> gpt.GPT:
    """The frozen base GPT, its block linears passed through convert_linear(name, nn.Linear) as read.

    The model is built on the meta device (no memory), then filled from model.safetensors one tensor
    at a time: a block's nn.Linear is assembled on `device` as soon as its weight and bias are read
    and handed to convert_linear (None keeps it in fp32; finetune_lora.py may cast it to 16 bits,
    finetune_qlora.py quantises it to NF4), so at most one full-precision linear exists at a time.
    Embeddings and LayerNorms are loaded in fp32; lm_head is tied to the token embedding again.
    Dropout is off: the base is frozen, LoRA has its own --lora-dropout.
    """
    cfg = read_config(model_dir)
    cfg.dropout = 0.0
    path = os.path.join(model_dir, checkpoint.WEIGHTS)
    header, data_start = _read_header(path)
    # Names and shapes are checked before any weight is read: a wrong file fails in a moment.
    shapes = {}
    for hf_name, entry in header.items():
        shapes.update(gpt.from_hf_state_dict({hf_name: torch.empty(entry["shape"], device="meta")}))
    checkpoint.check_state_dict(shapes, cfg, path)

    with torch.device("meta"):
        model = gpt.GPT(cfg)
    linear_names = {f"transformer.h.{i}.{name}" for i in range(cfg.n_layer) for name in BLOCK_LINEARS}
    pending, rest = {}, {}
    with open(path, "rb") as f:
        for hf_name, entry in header.items():
            for name, t in gpt.from_hf_state_dict({hf_name: _read_tensor(f, entry, data_start)}).items():
                if name == "lm_head.weight":
                    continue  # tied to the token embedding below
                module_name, _, kind = name.rpartition(".")
                if module_name not in linear_names:
                    rest[name] = nn.Parameter(t.to(device, torch.float32), requires_grad=False)
                    continue
                parts = pending.setdefault(module_name, {})
                parts[kind] = t
                if len(parts) == (2 if cfg.bias else 1):
                    meta_linear = model.get_submodule(module_name)
                    linear = nn.Linear(meta_linear.in_features, meta_linear.out_features, bias=cfg.bias, device="meta")
                    linear.weight = nn.Parameter(parts["weight"].to(device, torch.float32), requires_grad=False)
                    if cfg.bias:
                        linear.bias = nn.Parameter(parts["bias"].to(device, torch.float32), requires_grad=False)
                    replace_submodule(model, module_name, convert_linear(module_name, linear) if convert_linear else linear)
                    del pending[module_name], linear, parts
    model.load_state_dict(rest, strict=False, assign=True)
    model.lm_head.weight = model.transformer.wte.weight
    model.requires_grad_(False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"load_base left {left[:3]} unloaded"  # check_state_dict makes this a bug, not a user error
    return model


# --- LoRA -----------------------------------------------------------------------------------------
def lora_settings(args) -> dict:
    return dict(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, targets=list(args.lora_targets),
                rslora=args.rslora)


def read_adapter_settings(adapter_dir: str) -> dict:
    """The lora_settings() an adapter directory's adapter_config.json describes."""
    try:
        config = lora.read_adapter_config(adapter_dir)
    except ValueError as e:
        raise UserError(f"--adapter {adapter_dir}: {str(e).removeprefix('load_adapter: ')}") from None
    if isinstance(config["target_modules"], str):
        raise UserError(f"--adapter {adapter_dir}: target_modules in {lora.CONFIG_NAME} is a regular expression; "
                        f"these scripts read adapters that list module names, e.g. [\"c_attn\"]")
    return dict(r=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
                targets=list(config["target_modules"]), rslora=config.get("use_rslora", False))


def load_adapter(model: nn.Module, adapter_dir: str, dtype=None) -> dict:
    """lib.lora.load_adapter with its ValueErrors (which name the file and key) as UserErrors."""
    try:
        return lora.load_adapter(model, adapter_dir, dtype)
    except ValueError as e:
        raise UserError(f"--adapter {adapter_dir}: {str(e).removeprefix('load_adapter: ')}") from None
    except OSError as e:  # safetensors' own errors for a truncated or foreign file
        raise UserError(f"--adapter {adapter_dir}: {lora.WEIGHTS_NAME} cannot be read ({e})") from None


def flops_per_token(n_params: int, n_lora: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """Forward 2N plus backward 2N (input gradients only: the frozen weights need no dW), plus 6 per
    LoRA parameter and the attention term of lib.metrics.flops_per_token."""
    return 4 * n_params + 6 * n_lora + 12 * n_layer * n_embd * block_size


# --- the loop's pieces ----------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, batches, n_batches, device, amp) -> float:
    """Mean loss over the same n_batches held-out windows every time."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(n_batches):
        x, y = batches.get(i, 0, device)
        with devices.autocast(device, amp):
            loss = model(x, y)[1]
        total += loss.float()
    model.train()
    return (total / n_batches).item()


@torch.no_grad()
def sample(model, args, device, amp) -> str:
    """args.sample_tokens tokens after args.prompt, from a generator seeded with args.seed, so the
    sample before and after fine-tuning starts from the same random numbers."""
    model.eval()
    prompt = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.EOT]
    idx = torch.tensor([prompt], device=device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    with devices.autocast(device, amp):
        out = model.generate(idx, args.sample_tokens, args.temperature, args.top_k, generator=g)
    model.train()
    return tokenizer.decode(t for t in out[0].tolist() if t != tokenizer.EOT)


def trainable_state(model: nn.Module) -> dict:
    """The tensors the optimizer updates (the LoRA A and B matrices), by parameter name, on CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def dtype_name(amp) -> str:
    """The compute dtype as the scripts print it: fp32 (no autocast), bf16 or fp16."""
    return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp]


def save(out_dir, model, optimizer, step, base_dir, settings, first_val, amp, args):
    """training_state.pt first (LoRA matrices + optimizer + RNG, one atomic file, so --resume never
    sees an adapter from one step and moments from another), then the adapter in the PEFT layout."""
    state = {
        "step": step,
        "trainable": trainable_state(model),
        "optimizer": optimizer.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "base": os.path.abspath(base_dir),
        "lora": settings,
        "first_val_loss": first_val,
        "compute_dtype": dtype_name(amp),
        "args": json.dumps(vars(args)),
    }
    checkpoint.save_training_state(out_dir, state)
    return lora.save_adapter(model, out_dir, {"base_model_name_or_path": args.init_from or base_dir,
                                              "target_modules": settings["targets"]})


def load_state_for_resume(out_dir: str, settings: dict, init_from, cache_dir) -> dict:
    """The saved training state. Its base and LoRA settings are the run's; a flag given on the command
    line that says otherwise is a mistake (defaults are not, so `--resume` alone is enough)."""
    state = checkpoint.load_training_state(out_dir)
    where = os.path.join(out_dir, checkpoint.STATE)
    for key, flag in (("r", "--lora-r"), ("alpha", "--lora-alpha"), ("dropout", "--lora-dropout"),
                      ("targets", "--lora-targets"), ("rslora", "--rslora")):
        if settings[key] != LORA_DEFAULTS[key] and settings[key] != state["lora"][key]:
            raise UserError(f"--resume: {flag} is {settings[key]} but the run in {where} used {state['lora'][key]}; "
                            f"leave the flag out, or use a new --out-dir")
    if init_from and os.path.abspath(resolve_base(init_from, cache_dir)) != state["base"]:
        raise UserError(f"--resume: --init-from {init_from} is not the base of the run in {where} "
                        f"({state['base']}); leave --init-from out to use that one")
    if not os.path.isdir(state["base"]):
        raise UserError(f"--resume: the base of the run in {where}, {state['base']}, no longer exists; "
                        f"restore it or start a new run")
    return state


def restore_trainable(model: nn.Module, tensors: dict, where: str):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if sorted(params) != sorted(tensors):
        raise UserError(f"{where} holds LoRA matrices for other layers than this model has; use a new --out-dir")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


def save_merged(model: nn.Module, cfg: gpt.GPTConfig, out_dir: str) -> str:
    """Fold every LoRA layer into its base (W + scale * B @ A, NF4 dequantised first), in place, and
    write a plain Hugging Face GPT-2 directory out_dir/merged in fp32. Returns the path."""
    lora.merge_lora(model)
    for name, m in list(model.named_modules()):
        if isinstance(m, LinearNF4):  # a quantised layer without LoRA: dequantised as it is
            replace_submodule(model, name, dequantize_linear(m))
    path = os.path.join(out_dir, "merged")
    state = {k: v.float() for k, v in gpt.to_hf_state_dict(model).items()}
    checkpoint.save_hf(path, cfg, state)
    return path
