"""Adapter fine-tuning: the pieces finetune_lora.py and finetune_qlora.py share.

Used by finetune_lora.py and finetune_qlora.py (the steps themselves stay visible in each script).
The one idea: fine-tuning with LoRA is the pretraining loop with the base frozen, so what changes
sits around the loop, not in it. The base is read from its safetensors file one tensor at a time,
and each block linear is converted (kept, cast to 16 bits, or quantised to NF4) the moment it is
read, so the full-precision model never has to fit in memory; only the LoRA matrices reach the
optimizer; and what is saved is the small adapter (PEFT layout) plus, for --resume, the optimizer
state and those same LoRA matrices in one atomically written file. The run directory goes through
lib/rundir.py (each script declares it with SAVED, FIXED and CHANGEABLE below); resolve_run then
checks the rest a user can get wrong (paths, the base, the adapter files) from config.json and
the adapter alone, and save() never writes a NaN.
"""

import argparse
import json
import os

import torch
import torch.nn as nn

from lib import checkpoint, data, gpt, guards, hub, lora, rundir, tokenizer
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
    """The flags both fine-tuning scripts take; train.py's names wherever the meaning is the same.
    Every number has a checked type (lib/guards), so a nonsense value ends at parse time."""
    g = p.add_argument_group("data")
    g.add_argument("--data", default=DEFAULT_DATA, help="a text file, a directory of text files, a prepared shard "
                   "directory, or 'stdlib-tests' (the Python stdlib's own tests, which pretraining left out)")
    g.add_argument("--cache-dir", default=data.default_cache_dir(),
                   help="where prepared shards and hub downloads are kept")
    g = p.add_argument_group("base model")
    g.add_argument("--init-from", help=f"the frozen base: a Hugging Face GPT-2 directory or a hub id (gpt2, "
                   f"gpt2-medium, gpt2-large, gpt2-xl, org/name); when not given, the directory an --adapter's "
                   f"adapter_config.json names, else {DEFAULT_BASE}, what train.py writes")
    g.add_argument("--block-size", type=guards.positive_int, help="sequence length; when not given, the base model's")
    g = p.add_argument_group("LoRA")
    g.add_argument("--lora-r", type=guards.positive_int, default=LORA_DEFAULTS["r"], help="rank of the update B @ A")
    g.add_argument("--lora-alpha", type=guards.positive_float, default=LORA_DEFAULTS["alpha"],
                   help="the update is scaled by alpha / r")
    g.add_argument("--lora-dropout", type=guards.probability, default=LORA_DEFAULTS["dropout"],
                   help="dropout on the LoRA path's input, in [0, 1)")
    g.add_argument("--lora-targets", nargs="+", default=LORA_DEFAULTS["targets"], metavar="NAME",
                   help=f"modules to adapt, from {', '.join(TARGET_CHOICES)} (c_proj = both attn.c_proj and "
                        "mlp.c_proj)")
    g.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(r) (rank-stabilised LoRA)")
    g.add_argument("--adapter", help="start from this saved adapter directory (its r, alpha and targets); "
                   "with --steps 0 it is only evaluated and sampled; when not given, a new adapter (B = 0)")
    g.add_argument("--merge", action=argparse.BooleanOptionalAction, default=False,
                   help="also write base + B @ A * scale as a plain Hugging Face GPT-2 directory, OUT/merged "
                   "(loadable by train.py --init-from)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=guards.nonneg_int, default=200, help="optimizer steps in total")
    g.add_argument("--batch-size", type=guards.positive_int, default=8, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=guards.positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=guards.positive_float, default=5e-3, help="peak learning rate of A and B (tuned on "
                   "the tiny default run; the LoRA paper used 2e-4 for GPT-2 medium and large)")
    g.add_argument("--min-lr-ratio", type=guards.nonneg_float, default=0.1,
                   help="final learning rate as a fraction of --lr, in [0, 1]")
    g.add_argument("--warmup-steps", type=guards.nonneg_int, default=10,
                   help="steps of linear warm-up to --lr before the cosine decay")
    g.add_argument("--weight-decay", type=guards.nonneg_float, default=0.0, help="AdamW weight decay on A and B")
    g.add_argument("--beta1", type=guards.probability, default=0.9, help="AdamW's decay rate of the gradient mean")
    g.add_argument("--beta2", type=guards.probability, default=0.999,
                   help="AdamW's decay rate of the squared-gradient mean")
    g.add_argument("--grad-clip", type=guards.nonneg_float, default=1.0, help="clip the global gradient norm (0: off)")
    g.add_argument("--grad-checkpoint", action=argparse.BooleanOptionalAction, default=False,
                   help="activation checkpointing: keep only each block's input from forward and run the block "
                   "again in backward (one more forward: with the base frozen, about half again the compute; most "
                   "of the activation memory saved)")
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, cuda:N, mps or cpu; when not given, the first available in that order")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help=dtype_help)
    g.add_argument("--seed", type=guards.nonneg_int, default=1337,
                   help="seeds A's initialisation, the batches, dropout and sampling")
    g.add_argument("--out-dir", default=out_dir, help="adapter (PEFT layout), training state and metrics.jsonl")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    guards.add_safety_flags(g)  # --overwrite, --force
    g.add_argument("--eval-interval", type=guards.positive_int, default=50, help="steps between held-out losses")
    g.add_argument("--eval-batches", type=guards.positive_int, default=10, help="batches per held-out loss")
    g.add_argument("--save-interval", type=guards.positive_int, default=100,
                   help="steps between saves (and one at the end)")
    g.add_argument("--log-interval", type=guards.positive_int, default=10, help="steps between progress lines")
    g.add_argument("--peak-flops", type=guards.positive_float,
                   help="peak FLOP/s of the device, for MFU; when not given, looked up for known GPUs")
    g.add_argument("--estimate-memory", action="store_true", help="print the predicted memory breakdown and exit "
                   "(reads config.json only; a hub id is not downloaded)")
    g = p.add_argument_group("sample")
    g.add_argument("--sample-tokens", type=guards.nonneg_int, default=100,
                   help="tokens to sample before and after (0: none)")
    g.add_argument("--prompt", default="", help="sample prompt; empty: start a new file after <|endoftext|>")
    g.add_argument("--temperature", type=guards.positive_float, default=0.8,
                   help="softmax temperature of the samples (lower: more predictable)")
    g.add_argument("--top-k", type=guards.positive_int, default=200, help="sample only from the k most likely tokens")


def check_arguments(args):
    """The mistakes a flag's type cannot see, as one-line UserErrors."""
    if float(args.lora_alpha).is_integer():
        args.lora_alpha = int(args.lora_alpha)  # adapter_config.json then says 16, as PEFT writes it
    args.lora_targets = [t for value in args.lora_targets for t in value.split(",") if t]
    bad = [t for t in args.lora_targets if t not in TARGET_CHOICES]
    if bad or not args.lora_targets:
        raise UserError(f"--lora-targets {' '.join(bad) or '(none)'}: choose from {', '.join(TARGET_CHOICES)}")
    guards.check_schedule_and_seed(args, seed_limit=2**32 - 1)  # the held-out batches use seed + 1


def check_paths(args):
    """--cache-dir always (an estimate may download config.json); --data and OUT/merged for a real run."""
    guards.check_cache_dir(args.cache_dir)
    if not args.estimate_memory:
        merged = os.path.join(args.out_dir, "merged")
        if args.merge and os.path.exists(merged) and not os.path.isdir(merged):
            raise UserError(f"--merge writes the directory {merged}, which is an existing file; move the file away "
                            f"or pass another --out-dir")
        if args.data not in ("stdlib", "stdlib-tests") and not os.path.exists(args.data):
            raise UserError(f"--data {args.data!r} does not exist; pass a text file, a directory of text files, a "
                            f"prepared shard directory or stdlib-tests")


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
    except (json.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path} is not a GPT-2 config ({type(e).__name__}: {e}); point --init-from at a GPT-2 "
                        f"checkpoint") from None


def config_for_estimate(init_from, cache_dir, log=print, known_sizes=True) -> gpt.GPTConfig:
    """The base's shape without its weights: the published GPT-2 sizes by name (known_sizes: no
    network at all), else config.json only (a hub id's weights are not downloaded)."""
    if known_sizes and init_from in gpt.MODEL_SIZES and not os.path.isdir(init_from):
        return gpt.GPTConfig(**gpt.MODEL_SIZES[init_from])
    if init_from and not os.path.isdir(init_from):
        return read_config(hub.resolve_pretrained(init_from, cache_dir, filenames=("config.json",), log=log))
    return read_config(resolve_base(init_from, cache_dir, log))


def check_base_weights(model_dir: str, cfg: gpt.GPTConfig):
    """model.safetensors present, whole, and of the names and shapes config.json implies, from its
    header alone: a wrong or truncated file fails in a moment, before any work."""
    path = os.path.join(model_dir, checkpoint.WEIGHTS)
    header, data_start = checkpoint.read_safetensors_header(
        path, "point --init-from at a directory holding config.json and model.safetensors")
    shapes = {}
    for hf_name, entry in header.items():
        shapes.update(gpt.from_hf_state_dict({hf_name: torch.empty(entry["shape"], device="meta")}))
    checkpoint.check_state_dict(shapes, cfg, path)
    return header, data_start





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
    header, data_start = check_base_weights(model_dir, cfg)  # names and shapes before any weight is read

    with torch.device("meta"):
        model = gpt.GPT(cfg)
    linear_names = {f"transformer.h.{i}.{name}" for i in range(cfg.n_layer) for name in BLOCK_LINEARS}
    pending, rest = {}, {}
    with open(path, "rb") as f:
        for hf_name, entry in header.items():
            for name, t in gpt.from_hf_state_dict({hf_name: checkpoint.read_tensor(f, entry, data_start)}).items():
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
                    replace_submodule(model, module_name, convert_linear(module_name, linear)
                                      if convert_linear else linear)
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


def adapter_shapes(cfg: gpt.GPTConfig, targets, r: int) -> dict:
    """{PEFT key: shape} of the A and B matrices an adapter with these targets and rank holds for
    this base: A is [r, in], B is [out, r] for each block linear a target selects."""
    C = cfg.n_embd
    fans = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, 4 * C), "mlp.c_proj": (4 * C, C)}
    linears = {f"transformer.h.{i}.{name}": fans[name] for i in range(cfg.n_layer) for name in BLOCK_LINEARS}
    for t in targets:
        if not any(lora.target_matches(name, [t]) for name in linears):
            raise UserError(f"target {t!r} in {lora.CONFIG_NAME} selects no block linear of this {cfg.n_layer}-layer "
                            f"GPT-2 (they are named like transformer.h.0.attn.c_attn); use an adapter made for GPT-2")
    shapes = {}
    for name, (fan_in, fan_out) in linears.items():
        if lora.target_matches(name, targets):
            shapes[f"{lora.PEFT_PREFIX}{name}.lora_A.weight"] = (r, fan_in)
            shapes[f"{lora.PEFT_PREFIX}{name}.lora_B.weight"] = (fan_out, r)
    return shapes


def read_adapter(adapter_dir: str, weights: bool = True):
    """--adapter's adapter_config.json (and adapter_model.safetensors), or one line naming what is wrong."""
    if not os.path.isdir(adapter_dir):
        raise UserError(f"--adapter {adapter_dir}: no such directory; pass the directory that holds "
                        f"adapter_config.json and adapter_model.safetensors")
    try:
        return lora.read_adapter_config(adapter_dir), lora.read_adapter_weights(adapter_dir) if weights else None
    except ValueError as e:  # they name the file, the field or the reason
        raise adapter_error(adapter_dir, e) from None


def adapter_error(adapter_dir: str, e: ValueError) -> UserError:
    """lib.lora's ValueError (it names the file, key or field) as --adapter's one line."""
    return UserError(f"--adapter {adapter_dir}: {str(e).removeprefix('load_adapter: ')}")


def check_adapter(adapter_dir: str, cfg: gpt.GPTConfig) -> dict:
    """--adapter, checked against the base before any work starts: adapter_config.json readable and
    sensible, adapter_model.safetensors readable (not truncated), holding exactly the A and B matrices
    the config implies for this base, every one of them finite. Returns its lora_settings()."""
    def fail(message):
        raise UserError(f"--adapter {adapter_dir}: {message}")

    config, tensors = read_adapter(adapter_dir)
    if isinstance(config["target_modules"], str):
        fail(f"target_modules in {lora.CONFIG_NAME} is a regular expression; these scripts read adapters that "
             f"list module names, e.g. [\"c_attn\"]")
    settings = dict(r=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
                    targets=list(config["target_modules"]), rslora=config.get("use_rslora", False))
    path = os.path.join(adapter_dir, lora.WEIGHTS_NAME)
    try:
        want = adapter_shapes(cfg, settings["targets"], settings["r"])
    except UserError as e:
        fail(str(e))
    for key, t in sorted(tensors.items()):
        if key not in want:
            fail(f"{path} key {key!r} is not a LoRA matrix of the layers its config targets "
                 f"({', '.join(settings['targets'])}) in this base; use the adapter made for this base")
        if tuple(t.shape) != want[key]:
            fail(f"{path} key {key!r} has shape {list(t.shape)}, the base model and r={settings['r']} imply "
                 f"{list(want[key])}; the adapter was made for another base")
    missing = sorted(set(want) - set(tensors))
    if missing:
        fail(f"{path} lacks {len(missing)} of the {len(want)} LoRA matrices its config implies, e.g. {missing[0]!r}; "
             f"save or download the adapter again")
    bad = guards.nonfinite(tensors)
    if bad:
        fail(f"{path} holds NaN or inf in {len(bad)} tensors (e.g. {bad[0]!r}); it cannot be used, pick an earlier "
             "adapter")
    return settings


def load_adapter(model: nn.Module, adapter_dir: str, dtype=None) -> dict:
    """lib.lora.load_adapter with its ValueErrors (which name the file and key) as UserErrors."""
    try:
        return lora.load_adapter(model, adapter_dir, dtype)
    except ValueError as e:
        raise adapter_error(adapter_dir, e) from None


def flops_per_token(n_params: int, n_lora: int, n_layer: int, n_embd: int, block_size: int) -> float:
    """Forward 2N plus backward 2N (input gradients) over all N parameters, LoRA's included; plus 2 per LoRA
    parameter for its weight gradient (the frozen weights need none); plus lib.metrics' attention term."""
    return 4 * n_params + 2 * n_lora + 12 * n_layer * n_embd * block_size


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


def trainable_state(model: nn.Module) -> dict:
    """The tensors the optimizer updates (the LoRA A and B matrices), by parameter name, on CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def dtype_name(dtype) -> str:
    """An autocast dtype (None: fp32, no autocast) or a tensor dtype as the scripts print it: fp32, bf16 or fp16."""
    return {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def save(run_dir, model, optimizer, step, base_dir, settings, first_val, amp, args, updates):
    """training_state.pt (LoRA matrices + optimizer + RNG, one atomic file, so --resume never sees an
    adapter from one step and moments from another), then the adapter in the PEFT layout, then the
    commit that makes both one checkpoint (lib/rundir.commit). A and B holding a NaN or an infinity
    are never saved: the run stops with a UserError that names the last step saved with finite
    weights (updates.last_saved; None: none was)."""
    trainable = trainable_state(model)
    guards.check_finite_weights(trainable, step, updates.last_saved, run_dir.out_dir)
    rundir.save_state(run_dir, args, {
        "step": step,
        "trainable": trainable,
        "optimizer": optimizer.state_dict(),
        **devices.rng_states(),
        "base": os.path.abspath(base_dir),
        "lora": settings,
        "first_val_loss": first_val,
        "compute_dtype": dtype_name(amp),
    }, commit_now=False)
    lora.save_adapter(model, run_dir.out_dir, {"base_model_name_or_path": args.init_from or base_dir,
                                               "target_modules": settings["targets"]})
    rundir.commit(run_dir, args, step)
    updates.saved(step)


# --- the run directory (lib/rundir.py), and before any work: the base, the adapter ---------------------
# What a saved fine-tuning run is: the adapter (PEFT layout), the training state --resume needs, and the merged
# model when --merge wrote one (a fresh run replaces none of them without --overwrite).
SAVED = {lora.WEIGHTS_NAME: "safetensors", lora.CONFIG_NAME: "json", checkpoint.STATE: "state",
         os.path.join("merged", checkpoint.WEIGHTS): "safetensors", os.path.join("merged", checkpoint.CONFIG): "json"}
PRODUCTS = ("merged",)  # written at the end (--merge), after the last commit: in no commit, never put back
WRITTEN = (rundir.METRICS, "merged")
# What --resume does with a flag: these make the run what it is (its base and adapter shape, the windows each
# step reads, the optimizer its moments belong to), so another value is refused; these may change (the
# schedule, how often to evaluate, log and save, sampling, --merge, --grad-checkpoint, which changes
# the memory a step needs, not its result) and are reported.
FIXED = ("init_from", "adapter", "data", "block_size", "batch_size", "grad_accum", "seed", "lora_r", "lora_alpha",
         "lora_dropout", "lora_targets", "rslora", "weight_decay", "beta1", "beta2")
CHANGEABLE = ("steps", "lr", "min_lr_ratio", "warmup_steps", "grad_clip", "dtype", "eval_interval", "eval_batches",
              "save_interval", "log_interval", "sample_tokens", "prompt", "temperature", "top_k", "peak_flops", "merge",
              "grad_checkpoint")


def adapter_base(adapter_dir: str, init_from, log=print):
    """The base for an --adapter: --init-from when given (with a warning when the adapter names another),
    else the adapter's own base_model_name_or_path (the field PEFT loads) if that is a directory here,
    else None (the default base). An adapter merged into another base of the same shape would load
    without an error and give other weights."""
    named = read_adapter(adapter_dir, weights=False)[0].get("base_model_name_or_path")  # a bad one: its line now
    if not isinstance(named, str) or not named:
        return init_from
    if init_from is None:
        if os.path.isdir(named):
            log(f"--adapter {adapter_dir} was made on {named} (adapter_config.json); using it as the base "
                f"(--init-from chooses another)")
            return named
        if named != DEFAULT_BASE:
            log(f"warning: --adapter {adapter_dir} was made on {named}, which is not a directory here; using "
                f"{DEFAULT_BASE} (--init-from chooses the base)")
        return None
    if os.path.realpath(named) != os.path.realpath(init_from):  # a hub id too: the same name is the same path
        log(f"warning: --adapter {adapter_dir} was made on {named}, not on --init-from {init_from}")
    return init_from


def resolve_run(args, run_dir, log=print):
    """What both scripts check before any work, once rundir.prepare has dealt with --out-dir (a saved run is
    never replaced without --overwrite; --resume has validated it and taken its flags): the paths; the
    --adapter's directory and adapter_config.json (its base, when --init-from is not given); the base model's
    config.json (a hub id's weights are not downloaded yet: the memory check comes first); that nothing is
    written into the base; the adapter's matrices against the base. The values the run really uses (an
    --adapter's own LoRA settings, or the flags'; the base) are recorded in args, so that a later --resume
    compares against them. Returns (saved training state or None, LoRA settings, the base's GPTConfig)."""
    check_paths(args)
    state = run_dir.state
    if state is not None:
        check_same_script(args, state)
        if not args.estimate_memory and not os.path.isdir(state["base"]):
            raise UserError(f"--resume: the base of the run in {args.out_dir}, {state['base']}, no longer exists; "
                            f"restore it or start a new run")
    if state is None and args.adapter:
        args.init_from = adapter_base(args.adapter, args.init_from, log)
    init_from = state["base"] if state else args.init_from
    cfg = config_for_estimate(init_from, args.cache_dir, log, known_sizes=args.estimate_memory)
    block_size = args.block_size or cfg.block_size
    if block_size > cfg.block_size:
        raise UserError(f"--block-size {block_size} exceeds the base model's {cfg.block_size} positions; use at most "
                        f"{cfg.block_size}")
    if cfg.vocab_size < tokenizer.VOCAB_SIZE:
        raise UserError(f"vocabulary mismatch: the base has vocab_size {cfg.vocab_size}, the GPT-2 tokenizer needs "
                        f"{tokenizer.VOCAB_SIZE}; use a GPT-2 checkpoint")
    if not args.estimate_memory and (init_from is None or os.path.isdir(init_from)):
        check_not_base(args, init_from or DEFAULT_BASE)  # a hub id's directory: in base_weights
    settings = lora_settings(args)
    if state is None and args.adapter:
        if os.path.realpath(args.adapter) == os.path.realpath(args.out_dir):
            raise UserError(f"--adapter and --out-dir are the same directory, {args.out_dir}: this run would replace "
                            f"the adapter it starts from and its metrics.jsonl; pass another --out-dir")
        settings = check_adapter(args.adapter, cfg)
    args.lora_r, args.lora_alpha, args.lora_dropout = settings["r"], settings["alpha"], settings["dropout"]
    args.lora_targets, args.rslora = list(settings["targets"]), settings["rslora"]
    args.init_from, args.block_size = args.init_from or DEFAULT_BASE, block_size
    return state, settings, cfg


def base_weights(args, state, cfg, log=print) -> str:
    """The base directory with its weights: downloaded now for a hub id (after the memory check), the
    saved run's for --resume. model.safetensors is checked from its header: whole, of the shapes
    config.json gives, and not where this run writes."""
    model_dir = state["base"] if state else resolve_base(args.init_from, args.cache_dir, log)
    check_base_weights(model_dir, cfg)
    check_not_base(args, model_dir)
    return model_dir


def check_not_base(args, model_dir: str):
    """The base is read, never written: not by the adapter files, not by --merge (the default base,
    out/train, is train.py's checkpoint, and its training_state.pt would be replaced)."""
    base = os.path.realpath(model_dir)
    if os.path.realpath(args.out_dir) == base:
        raise UserError(f"--out-dir {args.out_dir} is the base model's directory; fine-tuning never writes into its "
                        f"base: pass another --out-dir")
    if args.merge and os.path.realpath(os.path.join(args.out_dir, "merged")) == base:
        raise UserError(f"--merge would write {os.path.join(args.out_dir, 'merged')}, the base model's directory; "
                        f"pass another --out-dir")


def check_same_script(args, state: dict):
    """finetune_lora.py and finetune_qlora.py write the same files, but a run continues with the script that
    made it: its base is quantised or not (finetune_qlora.py's saved flags include --nf4-block-size)."""
    made_by = "finetune_qlora.py" if "nf4_block_size" in rundir.saved_args(state) else "finetune_lora.py"
    if (made_by == "finetune_qlora.py") != hasattr(args, "nf4_block_size"):
        raise UserError(f"--resume: the run in {args.out_dir} was made by {made_by} (its base is "
                        f"{'NF4' if made_by == 'finetune_qlora.py' else 'not quantised'}); continue it with {made_by}")


def restore_optimizer(state: dict, optimizer) -> tuple:
    """--resume: the AdamW moments and the RNG states (LoRA dropout draws from them) as they were saved.
    Returns (the step to continue from, the run's first held-out loss)."""
    optimizer.load_state_dict(state["optimizer"])
    devices.restore_rng_states(state)
    return state["step"], state["first_val_loss"]


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
