"""Pretrain a GPT-2 in one file: the same training as train.py + lib/, importing nothing from lib/.

    python onefile_train.py                                   # tiny GPT on the Python stdlib, CPU, minutes
    python onefile_train.py --model-size gpt2 --steps 5000    # GPT-2 124M, bf16 on a GPU that has it

Read it top to bottom: arguments, the run directory, data, model, optimiser and memory, checkpoint, run().
With the same seed and flags it gives train.py's loss at every step (tests/test_onefile.py). It keeps saved
work safe, compactly: no fresh run replaces a saved one without --overwrite (which removes nothing before
every check has passed); --resume continues exactly; Ctrl-C saves; non-finite weights are never saved.
Left to train.py (docs/training_architecture.md): DDP, torch.compile, fp16, --dtype, --init-from, a sample,
MFU, the memory table, the token cache, moved data files.
"""

import argparse
import base64
import contextlib
import hashlib
import json
import math
import os
import pathlib
import resource
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import tiktoken
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# The published GPT-2 shapes; "tiny" is this repository's CPU default.
MODEL_SIZES = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M (larger ones: train.py)
}


class UserError(Exception):
    """A mistake the user can fix: main() prints it as one `error: ...` line and exits 2, no traceback."""


# --- arguments ----------------------------------------------------------------------------------
def number(kind, test, what):
    """An argparse type: a value that is not a finite number passing test is argparse's one-line error, exit 2."""
    def parse(text):
        value = kind(text)  # "x": a ValueError, which argparse reports as an invalid value
        if not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


count, positive_int = number(int, lambda v: v >= 0, "an integer >= 0"), number(int, lambda v: v >= 1, "an integer >= 1")
positive, nonneg = number(float, lambda v: v > 0, "a number > 0"), number(float, lambda v: v >= 0, "a number >= 0")
below_one, fraction = (number(float, lambda v: 0 <= v < 1, "a number from 0 to below 1"),
                       number(float, lambda v: 0 <= v <= 1, "a number from 0 to 1"))


def make_parser():
    p = argparse.ArgumentParser(description="Pretrain GPT-2 from scratch in one file (train.py: the same with lib/).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default="stdlib", help="a text file, a directory of text files, or 'stdlib'")
    p.add_argument("--model-size", default="tiny", choices=list(MODEL_SIZES), help="a GPT-2 shape")
    p.add_argument("--n-layer", type=positive_int, help="override the shape's layer count")
    p.add_argument("--n-head", type=positive_int, help="override the shape's head count")
    p.add_argument("--n-embd", type=positive_int, help="override the shape's width")
    p.add_argument("--block-size", type=positive_int, help="override the shape's sequence length")
    p.add_argument("--dropout", type=below_one, default=0.0, help="dropout (GPT-2 used 0.1)")
    p.add_argument("--steps", type=count, default=300, help="optimizer steps in total")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=positive, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=fraction, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--warmup-steps", type=count, default=30, help="steps of linear learning-rate warmup")
    p.add_argument("--weight-decay", type=nonneg, default=0.1, help="AdamW decay (matrices, embeddings)")
    p.add_argument("--beta1", type=below_one, default=0.9, help="AdamW beta1")
    p.add_argument("--beta2", type=below_one, default=0.95, help="AdamW beta2")
    p.add_argument("--grad-clip", type=nonneg, default=1.0, help="clip the gradient norm (0: off)")
    p.add_argument("--device", help="cuda, cuda:N, mps or cpu; if unset, the first available of cuda, mps, cpu")
    p.add_argument("--seed", type=count, default=1337, help="seeds the weights, data and dropout")
    p.add_argument("--out-dir", default="out/onefile_train", help="checkpoint, training state and metrics")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    p.add_argument("--overwrite", action="store_true", help="replace a run saved in --out-dir with a fresh one")
    p.add_argument("--force", action="store_true", help="run even when the memory estimate exceeds the device's")
    p.add_argument("--eval-interval", type=positive_int, default=100, help="steps between validation losses")
    p.add_argument("--eval-batches", type=positive_int, default=10, help="batches per validation loss")
    p.add_argument("--save-interval", type=positive_int, default=100, help="steps between checkpoints")
    p.add_argument("--log-interval", type=positive_int, default=10, help="steps between progress lines")
    p.add_argument("--estimate-memory", action="store_true", help="print the predicted peak memory and exit")
    return p


# --- the run directory: check everything, then write (train.py: lib/rundir.py) -------------------
SAVED = ("config.json", "model.safetensors", "training_state.pt")  # a run is saved here if any of them is
# --resume continues the saved run: flags not given take its values. These make it what it is (the model, the
# data, the windows a step reads), so another value is refused; the CHANGEABLE ones are reported when changed.
FIXED = ("model_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "data", "seed", "batch_size",
         "grad_accum")
CHANGEABLE = ("steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
              "eval_interval", "eval_batches", "save_interval", "log_interval")


def check_run_dir(args, parser, argv):
    """A saved run is continued (--resume) or replaced (--overwrite), never silently; the saved state or None."""
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --out-dir and --overwrite replaces it; pass one of them")
    found = [name for name in SAVED if os.path.exists(os.path.join(args.out_dir, name))]
    if not args.resume:
        if found and not (args.overwrite or args.estimate_memory):
            raise UserError(f"{args.out_dir} already holds a saved run ({', '.join(found)}); pass --resume to "
                            f"continue it, --overwrite to replace it, or another --out-dir")
        return None
    try:  # the files --resume reads (config.json is for other programs: this one only writes it)
        path = os.path.join(args.out_dir, "training_state.pt")  # weights_only: a pickle that cannot run code
        state = torch.load(path, map_location="cpu", weights_only=True)
        saved, path = json.loads(state["args"]), os.path.join(args.out_dir, "model.safetensors")
        with safe_open(path, framework="pt") as f:  # its header, checked against the file's length
            weights_step = int(f.metadata()["step"])
    except Exception as e:  # missing, truncated, garbled, foreign: which file, not where its reader failed
        raise UserError(f"--resume: {path} does not exist; run without --resume first" if isinstance(
            e, FileNotFoundError) else f"{path} is damaged ({type(e).__name__}); restore it, or --overwrite") from None
    if weights_step != state["step"]:
        raise UserError(f"--resume: the weights in {args.out_dir} are from step {weights_step}, the training state "
                        f"from step {state['step']}: the save was interrupted; start again with --overwrite")
    options = parser._option_string_actions  # the flags named on the command line, or not at their default
    given = {options[a.split("=")[0]].dest for a in argv if a.split("=")[0] in options}
    given |= {key for key, value in vars(args).items() if value != parser.get_default(key)}
    for key in (key for key in FIXED + CHANGEABLE if key in saved):
        flag = "--" + key.replace("_", "-")
        if key not in given:
            setattr(args, key, saved[key])
        elif getattr(args, key) != saved[key] and key in FIXED:
            raise UserError(f"--resume: {flag} {getattr(args, key)} contradicts the saved run ({flag} {saved[key]}); "
                            f"drop {flag} to continue it, or start a new run with --overwrite or another --out-dir")
        elif getattr(args, key) != saved[key]:
            print(f"--resume: {flag} changed from {saved[key]} to {getattr(args, key)}")
    return state


# --- data ---------------------------------------------------------------------------------------
# GPT-2's BPE is a table of byte sequences with merge ranks plus a regex that splits text into words
# first; tiktoken does the merging, we hand it the table shipped in data/.
RANKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT, VAL_PERCENT = 50256, 5  # <|endoftext|> (the last of 50,257 ids) joins documents; 5% is held out


def tokenize(source):
    """The train and val token ids of source ('stdlib': its code, its tests left out; a text file; a directory),
    split as train.py splits it. Tokenised afresh each run: seconds for the stdlib (train.py keeps a cache)."""
    root = sysconfig.get_paths()["stdlib"] if source == "stdlib" else source
    if not os.path.exists(root):
        raise UserError(f"data path {source!r} does not exist; pass a text file, a directory of text files or 'stdlib'")
    files, skip = [], ("site-packages", "dist-packages", "__pycache__")
    if os.path.isfile(root):  # one file: its directory is the root
        root, files = os.path.dirname(os.path.abspath(root)), [os.path.basename(root)]
    for folder, subfolders, names in os.walk(root) if not files else ():
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and (source != "stdlib" or d not in skip))
        for parts in (os.path.relpath(os.path.join(folder, name), root).split(os.sep) for name in names):
            stdlib_code = parts[-1].endswith(".py") and not parts[-1].startswith("test_") and \
                not set(parts[:-1]) & {"test", "tests", "idle_test"}  # the tests are train.py's second domain
            if stdlib_code if source == "stdlib" else not parts[-1].startswith("."):
                files.append(os.path.join(*parts))
    with open(RANKS_PATH, "rb") as f:
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line.strip())}
    encoding = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    texts = {"train": [], "val": []}
    for rel in sorted(files):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:  # the stdlib ships a few deliberately mis-encoded files: skipped
            if source != "stdlib":
                raise UserError(f"{os.path.join(root, rel)} is not UTF-8 text (bad byte at offset {e.start}); "
                                f"convert it to UTF-8 or remove it") from None
            text = ""
        # 5% of the files are val, chosen by a hash of the path: adding a file never moves the others.
        is_val = int(hashlib.sha1(rel.replace(os.sep, "/").encode()).hexdigest()[:8], 16) % 100 < VAL_PERCENT
        if text.strip():
            texts["val" if len(files) > 1 and is_val else "train"].append(text)
    if not texts["train"] + texts["val"]:
        raise UserError(f"data {source!r} is empty: no text found in {len(files)} file(s); add some text")
    # Each document starts with <|endoftext|>, as in GPT-2's data: the model learns where files end.
    ids = {split: np.fromiter((token for doc in encoding.encode_ordinary_batch(docs) for token in [EOT, *doc]),
                              dtype=np.uint16) for split, docs in texts.items()}  # 50,257 ids fit in 16 bits
    if len(files) == 1 or len(ids["val"]) == 0:  # nothing held out by file: the last 5% of the tokens is val
        all_ids = np.concatenate([ids["train"], ids["val"]])
        cut = len(all_ids) - max(1, len(all_ids) * VAL_PERCENT // 100)
        ids = {"train": all_ids[:cut], "val": all_ids[cut:]}
    print(f"data: {len(files)} file(s) of {source}, {len(ids['train']):,} train and {len(ids['val']):,} val tokens")
    return ids


class Batches:
    """Random [batch, block+1] windows of one split, a function of (seed, step) only, so a resumed run reads what
    an unbroken one would; micro-batch m takes row m of the step's windows (train.py: row m of rank r's share)."""

    def __init__(self, tokens, name, batch_size, block_size, grad_accum, seed):
        self.tokens, self.shape, self.block_size, self.seed = tokens, (grad_accum, batch_size), block_size, seed
        if len(tokens) <= block_size:
            raise UserError(f"the {name} split holds {len(tokens)} tokens, fewer than block_size+1 = "
                            f"{block_size + 1}; use a smaller --block-size or more data")

    def get(self, step, micro_step, device):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(len(self.tokens) - self.block_size, self.shape, generator=generator)[micro_step].tolist()
        xy = torch.from_numpy(np.stack([self.tokens[s : s + self.block_size + 1] for s in starts]).astype(np.int64))
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if device.type == "cuda":  # pinned memory lets the copy overlap with compute
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)


# --- model --------------------------------------------------------------------------------------
# A stack of identical pre-norm blocks (attention, then MLP, each added back to a residual stream).
# Module names follow Hugging Face's GPT-2 so the checkpoint loads in transformers.
@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k and v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape  # batch, time (tokens), channels (width): the names every GPT implementation uses
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        # SDPA picks a fused (flash / memory-efficient) kernel that never stores the T x T matrix.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        # GPT-2 used the tanh approximation of GELU ("gelu_new" in transformers).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        # Pre-norm: the residual stream itself is never normalised, which keeps deep stacks stable.
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying saves vocab x n_embd parameters
        # GPT-2's init: N(0, 0.02), residual projections / sqrt(2 n_layer) so that the residual stream's variance
        # does not grow with depth; LayerNorms 1 and 0. lm_head re-draws the tied wte last: train.py's RNG order.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):  # the mean next-token loss of idx [B, T] against targets [B, T]
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        # Cross-entropy in fp32 even under autocast: log-softmax over 50k classes needs the range.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# --- optimiser, learning-rate schedule, memory ----------------------------------------------------
def make_adamw(model, lr, weight_decay, betas, device_type):
    # Decay pulls weights towards zero: it regularises matrices (and, as in nanoGPT, embeddings) but
    # only hurts biases and LayerNorm gains, so 1-D parameters do not decay.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # The fused kernel updates every parameter in one launch instead of one per tensor.
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=device_type in ("cuda", "cpu", "mps") or None)


def lr_at(step, max_lr, warmup_steps, total_steps, min_lr_ratio):
    """Linear warmup to max_lr, then cosine decay to min_lr_ratio * max_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return max_lr * min_lr_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def estimate_memory(cfg, n_params, batch_size, device_type, amp):
    """Predicted peak bytes of AdamW training (lib/memory.py's formula; train.py prints it as a table)."""
    tokens, act_bytes = batch_size * cfg.block_size, 2 if amp else 4
    # Autograd keeps, per block and token, 2 LayerNorm inputs in fp32 and 15 x n_embd matmul ins and outs.
    per_block = tokens * cfg.n_embd * (2 * 4 + 15 * act_bytes + (6 if cfg.dropout > 0 else 0))
    return {"weights, gradients, AdamW moments": n_params * 16,
            "activations": cfg.n_layer * per_block + tokens * cfg.n_embd * 4 * 3,  # + embeddings out, ln_f in/out
            # the logits, their fp32 log-softmax and both gradients (+ an fp32 copy of 16-bit logits)
            "logits + loss": tokens * cfg.vocab_size * ((2 + 4 + 4 + 4 + 2) if amp else 16),
            # Python with torch and the BPE table loaded; CUDA's max_memory_allocated counts tensors only.
            "runtime": {"cpu": 250 * 2**20, "mps": 100 * 2**20}.get(device_type, 0)}


def peak_memory(device):
    """CUDA: max allocated by tensors. MPS: what the driver holds. CPU: the process's peak RSS."""
    if device.type != "cpu":
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else torch.mps.driver_allocated_memory()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


# --- checkpoint ---------------------------------------------------------------------------------
# config.json + model.safetensors in transformers' GPT-2 names and layouts, for anyone; training_state.pt for
# --resume. transformers stores these four as Conv1D, whose weight is [in, out]: nn.Linear's transpose.
CONV1D_NAMES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def atomic_write(path, write):
    write(f"{path}.tmp-{os.getpid()}")
    os.replace(f"{path}.tmp-{os.getpid()}", path)  # a rename: the old file or the new one, never half of one


def save_checkpoint(out_dir, model, optimizer, step, args, first_val):
    """Weights in the HF layout, then the state --resume needs. step = the next step to run."""
    # lm_head is tied to wte, so it is left out; transformers re-ties it on load. The step in the metadata
    # lets --resume check that weights and training state belong together.
    tensors = {name: (t.t() if name.endswith(CONV1D_NAMES) else t).detach().to("cpu").contiguous()
               for name, t in model.state_dict().items() if name != "lm_head.weight"}
    atomic_write(os.path.join(out_dir, "model.safetensors"),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt", "step": str(step)}))
    c = model.config
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
              "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
              "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": c.dropout,
              "embd_pdrop": c.dropout, "attn_pdrop": c.dropout, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
              "bos_token_id": EOT, "eos_token_id": EOT, "tie_word_embeddings": True, "torch_dtype": "float32"}
    atomic_write(os.path.join(out_dir, "config.json"), lambda tmp: pathlib.Path(tmp).write_text(json.dumps(config)))
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng_cpu": torch.get_rng_state(),
             "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
             "args": json.dumps(vars(args)), "first_val_loss": first_val}  # "started at" after a resume
    atomic_write(os.path.join(out_dir, "training_state.pt"), lambda tmp: torch.save(state, tmp))


# --- training ------------------------------------------------------------------------------------
def run(args, parser, argv):
    # --- before any work: the device, --out-dir, the run directory -------------------------------
    available = ["cuda"] * torch.cuda.is_available() + ["mps"] * torch.backends.mps.is_available() + ["cpu"]
    try:  # --device if given and here, else the first of cuda, mps, cpu
        device = torch.device(args.device or available[0])
        torch.empty(0, device=device)  # a device that is not here (cuda:9, mps on Linux) fails now
    except (RuntimeError, AssertionError):
        raise UserError(f"--device {args.device!r} is not available here; use one of {', '.join(available)}") from None
    try:  # made now, with a probe file written: a path mistake stops here, not after an hour of training
        if not args.estimate_memory:
            os.makedirs(args.out_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=args.out_dir).close()
    except OSError as e:
        raise UserError(f"--out-dir {args.out_dir} cannot be written ({e.strerror}); pick another --out-dir") from None
    train_state = check_run_dir(args, parser, argv)
    torch.manual_seed(args.seed)
    # bf16 autocast on a GPU that has it (weights, gradients and AdamW stay fp32), else fp32 throughout.
    amp = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None

    # --- model configuration and memory: --model-size and the shape flags, recorded for a later --resume ---
    shape = {key: getattr(args, key) for key in ("n_layer", "n_head", "n_embd", "block_size") if getattr(args, key)}
    cfg = GPTConfig(**{**MODEL_SIZES[args.model_size], **shape}, dropout=args.dropout)
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}; pick a multiple of it")
    args.n_layer, args.n_head, args.n_embd, args.block_size = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size
    with torch.device("meta"):  # shapes only: counts the parameters without allocating them
        n_params = sum(p.numel() for p in GPT(cfg).parameters())  # the tied wte / lm_head counts once
    tokens_per_step = args.batch_size * cfg.block_size * args.grad_accum
    estimate = estimate_memory(cfg, n_params, args.batch_size, device.type, amp is not None)
    print(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, {n_params:,} parameters; device "
          f"{device}, {'bf16' if amp else 'fp32'}; {tokens_per_step:,} tokens per step\nmemory estimate: "
          + ", ".join(f"{part} {size / 2**20:,.0f} MiB" for part, size in estimate.items()))
    if args.estimate_memory:
        return estimate
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # stop before allocating if clearly (25%) more
    if sum(estimate.values()) > 1.25 * free and not args.force:
        raise UserError(f"the memory estimate ({sum(estimate.values()) / 2**30:.1f} GiB) exceeds the "
                        f"{free / 2**30:.1f} GiB of this {device.type} device; lower --batch-size or --block-size, "
                        f"pick a smaller model, or pass --force to try anyway")

    # --- data, model and optimiser (with --resume: the saved weights, moments and RNG) --------------
    tokens = tokenize(args.data)
    train_batches = Batches(tokens["train"], "train", args.batch_size, cfg.block_size, args.grad_accum, args.seed)
    val_batches = Batches(tokens["val"], "val", args.batch_size, cfg.block_size, 1, args.seed + 1)  # a fixed list
    model = GPT(cfg).to(device)
    optimizer = make_adamw(model, args.lr, args.weight_decay, (args.beta1, args.beta2), device.type)
    start_step, first_val = 0, None
    if train_state is not None:  # the weights (back in our names and layouts, lm_head tied again), moments, RNG
        weights = {name: (t.t() if name.endswith(CONV1D_NAMES) else t).contiguous()
                   for name, t in load_file(os.path.join(args.out_dir, "model.safetensors")).items()}
        model.load_state_dict({**weights, "lm_head.weight": weights["transformer.wte.weight"]})
        optimizer.load_state_dict(train_state["optimizer"])
        torch.set_rng_state(train_state["rng_cpu"])  # dropout draws from it
        if train_state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(train_state["rng_cuda"])
        start_step, first_val = train_state["step"], train_state["first_val_loss"]
        print(f"resuming from step {start_step} in {args.out_dir}")

    @torch.no_grad()
    def evaluate():  # the mean loss over the same validation batches every time
        model.eval()
        total = torch.zeros((), device=device)
        for index in range(args.eval_batches):
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                total += model(*val_batches.get(index, 0, device)).float()
        model.train()
        return total.item() / args.eval_batches

    def log_metrics(**record):  # one JSON object per line, appended (a resumed run continues the file)
        with open(os.path.join(args.out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    def diverged(what):  # the one line a diverged run stops with; it names the last finite checkpoint
        last = "no finite checkpoint was saved in this run" if last_saved is None else \
            f"the last finite checkpoint is step {last_saved} in {args.out_dir}"
        return UserError(f"{what}, {last}; lower --lr or check the data")

    def save(step):  # weights and training state after `step` updates (the next step to run); never non-finite
        nonlocal last_saved
        bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            raise diverged(f"weights are not finite at step {step} ({len(bad)}, e.g. {bad[0]}); nothing was saved")
        save_checkpoint(args.out_dir, model, optimizer, step, args, first_val)
        last_saved = step

    # --- training loop ----------------------------------------------------------------------------
    for name in (*SAVED, "metrics.jsonl") if train_state is None else ():
        with contextlib.suppress(FileNotFoundError):  # the first write: only now does --overwrite clear the old run
            os.remove(os.path.join(args.out_dir, name))
    log_metrics(event="start", seed=args.seed, step=start_step, world_size=1, device=str(device), n_params=n_params,
                config=vars(cfg), args=vars(args))
    # The ETA counts from the end of the first step: that one pays for warm-up (and compilation).
    last_time, last_step, steady_since = time.perf_counter(), start_step, None
    next_step = start_step  # the first step whose update is not in the weights yet: what a checkpoint records
    last_saved = start_step if train_state else None  # only finite weights are ever saved
    applied = skipped_in_a_row = 0  # updates applied, and skipped for a non-finite gradient (10 in a row stop)
    val_loss = None
    try:
        for step in range(start_step, args.steps):
            if step % args.eval_interval == 0:
                val_loss = evaluate()
                first_val = val_loss if first_val is None else first_val
                print(f"step {step}: val loss {val_loss:.4f}")
                log_metrics(step=step, val_loss=val_loss)

            lr = lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    loss = model(*train_batches.get(step, micro, device))
                loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                loss.backward()
                loss_sum += loss.detach()
            loss_value = loss_sum.item()
            if not math.isfinite(loss_value):  # its gradient would be NaN everywhere: stop before the update
                raise diverged(f"the loss became {loss_value} at step {step}; stopped before the update")
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf")).item()
            skipped = not math.isfinite(grad_norm)  # such a gradient would turn every weight it touches into NaN
            if not skipped:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            next_step, steady_since = step + 1, steady_since or time.perf_counter()
            applied, skipped_in_a_row = applied + (not skipped), skipped_in_a_row + 1 if skipped else 0
            if skipped:
                print(f"step {step}: gradient norm {grad_norm}, update skipped")
            if skipped_in_a_row == 10:
                raise diverged(f"the gradient norm was not finite for 10 steps in a row ({step - 9} to {step})")

            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm)
            record.update({"skipped": True} if skipped else {})
            if step % args.log_interval == 0 or step == args.steps - 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # timings are only honest once queued GPU work is done
                now = time.perf_counter()
                tokens_per_s = tokens_per_step * (next_step - last_step) / max(now - last_time, 1e-9)
                eta = (now - steady_since) / (step - start_step) * (args.steps - next_step) if step > start_step else -1
                last_time, last_step = now, next_step
                record.update(tokens_per_s=round(tokens_per_s), peak_memory=peak_memory(device))
                eta_text = f"{eta / 60:.1f} min" if eta >= 0 else "?"
                print(f"step {step:5d}/{args.steps} | loss {loss_value:.4f} | lr {lr:.2e} | {tokens_per_s:8,.0f} "
                      f"tok/s | mem {record['peak_memory'] / 2**20:,.0f} MiB | ETA {eta_text}")
            log_metrics(**record)
            if next_step % args.save_interval == 0 and next_step < args.steps:
                save(next_step)
    except KeyboardInterrupt:  # save exactly the updates made so far: --resume neither skips nor repeats one
        save(next_step)
        print(f"\ninterrupted: saved step {next_step} to {args.out_dir}; continue with --resume", file=sys.stderr)
        sys.exit(130)  # the shell's code for Ctrl-C
    if skipped_in_a_row and not applied:  # it tried to update, and never could: nothing was trained
        raise diverged("no update was applied: each was skipped for a non-finite gradient; nothing was trained")

    # --- save, and the measured peak beside the estimate --------------------------------------------
    if args.steps > start_step or train_state is None:
        val_loss = evaluate()
        print(f"step {next_step}: val loss {val_loss:.4f}" + (f" (started at {first_val:.4f})" if first_val else ""))
        log_metrics(step=next_step, val_loss=val_loss)
    save(next_step)
    peak, predicted = peak_memory(device), sum(estimate.values())
    print(f"saved {args.out_dir}/config.json, model.safetensors (Hugging Face GPT-2 layout), training_state.pt\n"
          f"memory: estimate {predicted / 2**20:,.0f} MiB, measured peak {peak / 2**20:,.0f} MiB "
          f"({peak / predicted:.1f}x the estimate)")
    log_metrics(event="end", step=next_step, val_loss=val_loss, peak_memory=peak, memory_estimate=predicted)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak}


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return run(args, parser, sys.argv[1:] if argv is None else list(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
