"""Pretrain a GPT-2 in one file: the same training as train.py + lib/, importing nothing from lib/.

    python onefile_train.py                                    # tiny GPT on the Python stdlib, CPU, minutes
    python onefile_train.py --model-size gpt2 --steps 5000     # GPT-2 124M, bf16 on a GPU that has it
    torchrun --standalone --nproc_per_node=2 onefile_train.py  # DDP: one process per device

Read it top to bottom. With the same flags it gives train.py's loss at every step (tests/test_onefile.py), alone or
under torchrun. Saved work is safe: no silent overwrite, an exact --resume, Ctrl-C saves, only finite weights are
saved, and a save is one folder written in full, then renamed into place (OUT/checkpoint). Left to train.py and
lib/ (docs/training_architecture.md): commit folders (OUT/checkpoints/step-N) and --keep-last, --auto-resume, SIGTERM
handling and its agreement across ranks, torchrun --max-restarts, a resume on another number of processes (elastic),
skipping non-finite updates (lib/rundir.py, lib/distributed.py); the token cache, the nanoGPT and llm.c token formats
(lib/data.py); --init-from (Hugging Face checkpoints), torch.compile, --dtype (fp16 with a GradScaler), gpt2-large
and -xl, MFU, a sample at the end, the memory table, --estimate-memory and --force (lib/memory.py).
"""

import argparse
import atexit
import base64
import contextlib
import gc
import hashlib
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

MODEL_SIZES = {  # the published GPT-2 shapes (larger ones: train.py); "tiny" is this repository's CPU default
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
}


class UserError(Exception):
    """A mistake the user can fix: main() prints it as one `error: ...` line and exits 2, no traceback."""


# --- arguments ----------------------------------------------------------------------------------
def make_parser():
    def number(kind, what, test):  # an argparse type: a value that is not finite, or fails test, is its usage error
        def parse(text):  # "x": kind's ValueError, which argparse reports as an invalid value
            if not math.isfinite(value := kind(text)) or not test(value):
                raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
            return value
        return parse

    count = number(int, "an integer >= 0", lambda value: value >= 0)
    positive_int = number(int, "an integer >= 1", lambda value: value >= 1)
    nonneg = number(float, "a number >= 0", lambda value: value >= 0)
    below_one = number(float, "a number from 0 to below 1", lambda value: 0 <= value < 1)
    class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):  # each default once; none for None or a switch
        def _get_help_string(self, action):
            return action.help if action.default is None or action.nargs == 0 else super()._get_help_string(action)
    # allow_abbrev=False: a flag is only taken whole, so --resume knows exactly which flags were given
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
                                     allow_abbrev=False)
    add = parser.add_argument
    add("--data", default="stdlib", help="a text file, a directory of text files, or 'stdlib'")
    add("--model-size", default="tiny", choices=list(MODEL_SIZES), help="a GPT-2 shape")
    for flag, what in (("n-layer", "layer count"), ("n-head", "head count"), ("n-embd", "width"),
                       ("block-size", "sequence length")):
        add(f"--{flag}", type=positive_int, help=f"override the shape's {what}")
    add("--dropout", type=below_one, default=0.0, help="dropout probability (GPT-2 used 0.1)")
    add("--steps", type=count, default=300, help="optimizer steps in total")
    add("--batch-size", type=positive_int, default=8, help="sequences per micro-batch per process")
    add("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    add("--lr", type=number(float, "a number > 0", lambda value: value > 0), default=2e-3, help="peak learning rate")
    add("--min-lr-ratio", type=number(float, "a number from 0 to 1", lambda value: 0 <= value <= 1), default=0.1,
        help="final lr as a fraction of --lr")
    add("--warmup-steps", type=count, default=30, help="steps of linear learning-rate warmup")
    add("--weight-decay", type=nonneg, default=0.1, help="AdamW decay (matrices, embeddings)")
    for beta, default in (("beta1", 0.9), ("beta2", 0.95)):
        add(f"--{beta}", type=below_one, default=default, help=f"AdamW {beta}")
    add("--grad-clip", type=nonneg, default=1.0, help="clip the gradient norm (0: off)")
    add("--device", help="cuda, cuda:N, mps or cpu; if unset, the first available of cuda, mps, cpu")
    add("--seed", type=count, default=1337, help="seeds the weights, data and dropout")
    add("--out-dir", default="out/onefile_train", help="the model, training state and metrics (OUT/checkpoint)")
    add("--resume", action="store_true", help="continue the run saved in --out-dir")
    add("--overwrite", action="store_true", help="replace a run saved in --out-dir with a fresh one")
    add("--eval-interval", type=positive_int, default=100, help="steps between validation losses")
    add("--eval-batches", type=positive_int, default=10, help="batches per validation loss")
    add("--save-interval", type=positive_int, default=100, help="steps between checkpoints")
    add("--log-interval", type=positive_int, default=10, help="steps between progress lines")
    return parser


# --- the run directory: check everything, then write (train.py: lib/rundir.py) -------------------
# --resume: flags not given keep the saved values; FIXED ones make the run what it is, CHANGEABLE ones are reported.
FIXED = ("model_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "data", "seed", "batch_size",
         "grad_accum")
CHANGEABLE = ("steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
              "eval_interval", "eval_batches", "save_interval", "log_interval")


def check_run_dir(args, argv, options, world, log):
    """A saved run is continued (--resume) or replaced (--overwrite), never silently; returns the saved state or None.
    The weights and the training state are read whole here: a damaged one stops the run before any write."""
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --out-dir and --overwrite replaces it; pass one of them")
    # OUT/checkpoint; or OUT/checkpoint.old, if a save stopped between its two renames (save_checkpoint)
    folder = next(filter(os.path.isdir, (f"{args.out_dir}/checkpoint", f"{args.out_dir}/checkpoint.old")), None)
    if not args.resume:
        if folder and not args.overwrite:
            raise UserError(f"{args.out_dir} already holds a saved run ({folder}); pass --resume to continue it, "
                            f"--overwrite to replace it, or another --out-dir")
        return None
    path = os.path.join(folder or f"{args.out_dir}/checkpoint", "training_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # a pickle that cannot run code
        saved, path = json.loads(state["args"]), os.path.join(folder, "model.safetensors")
        state["weights"] = load_file(path)  # safetensors checks that the file holds every tensor it lists
    except Exception as error:  # missing, truncated, garbled, foreign: which file, not where its reader failed
        raise UserError(f"{path} is damaged or missing ({type(error).__name__}); restore it, or start anew: "
                        f"--overwrite") from None
    if state["world_size"] != world:  # a step's windows are split between the ranks: another count reads others
        raise UserError(f"--resume: the run was saved by {state['world_size']} process(es), not {world}; start as many")
    given = {options[arg.split("=")[0]].dest for arg in argv if arg.split("=")[0] in options}
    for key in (key for key in FIXED + CHANGEABLE if key in saved):
        flag = "--" + key.replace("_", "-")
        if key not in given:
            setattr(args, key, saved[key])
        elif getattr(args, key) != saved[key] and key in FIXED:
            raise UserError(f"--resume: {flag} {getattr(args, key)} contradicts the saved run ({flag} {saved[key]}); "
                            f"drop {flag} to continue it, or start a new run with --overwrite or another --out-dir")
        elif getattr(args, key) != saved[key]:
            log(f"--resume: {flag} changed from {saved[key]} to {getattr(args, key)}")
    return state


# --- data ---------------------------------------------------------------------------------------
# GPT-2's BPE: a table of byte sequences with merge ranks (shipped in data/) and a regex that first splits words.
RANKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT, VAL_PERCENT = 50256, 5  # <|endoftext|> (the last of 50,257 ids) joins documents; 5% is held out


def tokenize(source, log):
    """The train and val token ids of source ('stdlib': its code, its tests left out; a text file; a directory),
    split as train.py splits it. Tokenised afresh each run: seconds for the stdlib (train.py keeps a cache)."""
    root = sysconfig.get_paths()["stdlib"] if source == "stdlib" else source
    if not os.path.exists(root):
        raise UserError(f"data path {source!r} does not exist; pass a text file, a directory of text files or 'stdlib'")
    files, skip = [], ("site-packages", "dist-packages", "__pycache__") if source == "stdlib" else ()
    if os.path.isfile(root):  # one file: its directory is the root
        root, files = os.path.dirname(os.path.abspath(root)), [os.path.basename(root)]
    for folder, subfolders, names in os.walk(root) if not files else ():
        subfolders[:] = sorted(sub for sub in subfolders if not sub.startswith(".") and sub not in skip)
        for parts in (os.path.relpath(os.path.join(folder, name), root).split(os.sep) for name in names):
            stdlib_code = parts[-1].endswith(".py") and not parts[-1].startswith("test_") and \
                not set(parts[:-1]) & {"test", "tests", "idle_test"}  # the tests are train.py's second domain
            if stdlib_code if source == "stdlib" else not parts[-1].startswith("."):
                files.append(os.path.join(*parts))
    with open(RANKS_PATH, "rb") as table:
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in table if line.strip())}
    encoding = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={})
    texts = {"train": [], "val": []}
    for rel in sorted(files):
        try:
            text = pathlib.Path(root, rel).read_bytes().decode("utf-8")  # as is: read_text would turn \r\n to \n
        except UnicodeDecodeError as error:  # the stdlib ships a few deliberately mis-encoded files: skipped
            if source != "stdlib":
                raise UserError(f"{os.path.join(root, rel)} is not UTF-8 text (bad byte at offset {error.start}); "
                                f"convert it to UTF-8 or remove it") from None
            continue
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
    log(f"data: {len(files)} file(s) of {source}, {len(ids['train']):,} train and {len(ids['val']):,} val tokens")
    return ids


class Batches:
    """Random [batch, block+1] windows of one split, a function of (seed, step) only, so a resumed run reads what
    an unbroken one would. A step's grad_accum x world x batch windows are drawn together and rank r takes
    micro-batch m's slice [m, r]: N ranks read what one process with N times the accumulation reads."""

    def __init__(self, tokens, split, batch_size, block_size, seed, grad_accum=1, rank=0, world=1):
        self.tokens, self.window, self.seed = tokens[split], block_size + 1, seed
        self.shape, self.rank = (grad_accum, world, batch_size), rank
        if len(self.tokens) <= block_size:
            raise UserError(f"the {split} split holds {len(self.tokens)} tokens, fewer than block_size+1 = "
                            f"{block_size + 1}; use a smaller --block-size or more data")

    def get(self, step, micro, device):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(len(self.tokens) - self.window + 1, self.shape, generator=generator)
        windows = np.stack([self.tokens[start : start + self.window] for start in starts[micro, self.rank].tolist()])
        return tuple(torch.from_numpy(part.astype(np.int64)).to(device) for part in (windows[:, :-1], windows[:, 1:]))


# --- model --------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class Block(nn.Module):
    """Causal self-attention, then an MLP, each added back to the residual stream. Pre-norm: each reads a LayerNorm
    of the stream, and the stream itself is never normalised, which keeps deep stacks stable."""

    def __init__(self, cfg):
        super().__init__()
        width = cfg.n_embd  # c_attn makes the queries, keys and values in one matmul
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(width, 3 * width), c_proj=nn.Linear(width, width)))
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(width, 4 * width), c_proj=nn.Linear(4 * width, width)))
        self.n_head, self.dropout = cfg.n_head, nn.Dropout(cfg.dropout)

    def forward(self, stream):
        B, T, C = stream.shape  # batch, time (tokens), channels (width): the names every GPT implementation uses
        # Attention. q, k, v: the queries, keys and values of one matmul, each split into heads [B, n_head, T, C/n_head]
        q, k, v = (part.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for part in self.attn.c_attn(self.ln_1(stream)).split(C, dim=2))
        # SDPA picks a fused (flash / memory-efficient) kernel that never stores the T x T matrix (CPU: at dropout 0).
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout.p if self.training else 0.0)
        stream = stream + self.dropout(self.attn.c_proj(heads.transpose(1, 2).contiguous().view(B, T, C)))
        # The MLP: 4 x wider, GELU (the tanh approximation GPT-2 used, "gelu_new" in transformers), and back.
        return stream + self.dropout(self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(stream)), approximate="tanh")))


class GPT(nn.Module):  # embeddings of tokens and positions, the blocks, a LayerNorm, a head tied to wte (HF names)
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout), h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying saves vocab x n_embd parameters
        # GPT-2's init: N(0, 0.02), residual projections / sqrt(2 n_layer) so that the residual stream's variance
        # does not grow with depth; LayerNorms 1 and 0. lm_head re-draws the tied wte last: train.py's RNG order.
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * cfg.n_layer) if "c_proj" in name else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):  # the mean next-token loss of idx [B, T] against targets [B, T]
        positions = torch.arange(idx.size(1), device=idx.device)
        stream = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            stream = block(stream)
        hidden = self.transformer.ln_f(stream).flatten(0, 1)  # [tokens, n_embd]: what lm_head turns into logits
        return LinearCrossEntropy.apply(hidden, self.lm_head.weight, targets.flatten())


class LinearCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of hidden @ weight.T against targets, a few hundred rows at a time, so that the
    [tokens, vocab] logits never exist whole (lib/lm_loss.py compacted, docs/big_vocab_loss.md explained). The
    gradients are made in forward, while each chunk's logits are there: in place, the logits become d loss / d logits
    = softmax - onehot(target), then d hidden = that @ W and d W += that^T hidden (in fp32); backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        kind = hidden.device.type  # the matmuls in autocast's dtype, as nn.Linear's would be; the softmax in fp32
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        rows = max(256, 2**27 // (4 * (weight.shape[0] + 2 * weight.shape[1])))  # 128 MiB of logits, >= 256 rows
        rows = -(-len(hidden) // -(-len(hidden) // rows))  # even chunks: 1,024 rows are 2 x 512, not 664 + 360
        total, d_hidden, d_weight = torch.zeros((), device=hidden.device), torch.empty_like(hidden), \
            torch.zeros_like(weight)  # the head's gradient in fp32, as the weight is
        with torch.autocast(kind, enabled=False):
            head = weight.to(dtype)
            for start in range(0, len(hidden), rows):
                chunk, label = hidden[start : start + rows].to(dtype), targets[start : start + rows, None]
                logits = (chunk @ head.t()).float()  # this chunk's logits, in fp32 for the softmax
                target_logit = logits.gather(1, label).squeeze(1)
                top = logits.amax(dim=1, keepdim=True)  # subtracted before exp, so nothing overflows
                sumexp = logits.sub_(top).exp_().sum(dim=1)
                total += (sumexp.log() + top.squeeze(1) - target_logit).sum()  # log-sum-exp - the target's logit
                grad = logits.mul_(sumexp.reciprocal()[:, None]).scatter_add_(1, label, -torch.ones_like(top)).to(dtype)
                d_hidden[start : start + rows] = grad @ head
                d_weight.addmm_(grad.t(), chunk) if grad.dtype == d_weight.dtype else d_weight.add_(grad.t() @ chunk)
        ctx.save_for_backward(d_hidden, d_weight)
        return total / len(hidden)

    @staticmethod
    def backward(ctx, grad_loss):  # the mean's 1 / tokens, times what comes from above (1 / --grad-accum)
        d_hidden, d_weight = ctx.saved_tensors
        scale = grad_loss.float() / len(d_hidden)
        return d_hidden.mul_(scale), d_weight.mul_(scale), None


# --- learning-rate schedule ----------------------------------------------------
def lr_at(step, max_lr, warmup_steps, total_steps, min_lr_ratio):  # linear warmup, then cosine to min_lr_ratio
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return max_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# --- checkpoint ---------------------------------------------------------------------------------
# OUT/checkpoint: config.json + model.safetensors in transformers' GPT-2 names and layouts, for anyone, and
# training_state.pt for --resume. transformers stores these four as Conv1D: [in, out], nn.Linear's transpose.
CONV1D_NAMES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_layout(tensors):  # (name, tensor) pairs from our layout to transformers' or back: a transpose undoes itself
    return {name: (tensor.t() if name.endswith(CONV1D_NAMES) else tensor).contiguous() for name, tensor in tensors}


def save_checkpoint(out_dir, model, optimizer, step, args, world):
    """Weights in the HF layout and the state --resume needs after `step` updates, atomically: all three files go
    into OUT/checkpoint.tmp, which one rename makes OUT/checkpoint. A crash before it leaves the previous checkpoint;
    a crash just after it moved aside leaves that as OUT/checkpoint.old, which --resume reads."""
    final, tmp, old = (os.path.join(out_dir, name) for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)  # what a crash in an earlier save left
    os.makedirs(tmp)
    tensors = hf_layout((name, tensor.detach().cpu()) for name, tensor in model.state_dict().items()
                        if name != "lm_head.weight")  # lm_head is tied to wte: transformers re-ties it on load
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt", "step": str(step)})
    cfg = model.config
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
              "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
              "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), cfg.dropout), "initializer_range": 0.02,
              "bos_token_id": EOT, "eos_token_id": EOT, "tie_word_embeddings": True, "torch_dtype": "float32"}
    pathlib.Path(tmp, "config.json").write_text(json.dumps(config))
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng_cpu": torch.get_rng_state(), "world_size": world,
             "rng_cuda": torch.cuda.get_rng_state_all(), "args": json.dumps(vars(args))}  # [] without CUDA
    torch.save(state, os.path.join(tmp, "training_state.pt"))
    if os.path.isdir(final):  # the previous checkpoint steps aside (a directory cannot be renamed onto another)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)  # THE COMMIT POINT: from here on this save is the checkpoint
    shutil.rmtree(old, ignore_errors=True)


def cpu_has_bf16():  # lib/device.cpu_has_native_bf16's rule: AVX-512 kernels and bf16 units (AVX512-BF16, AMX)
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and bool({"avx512_bf16", "amx_bf16"} & {*flags})


# --- training ------------------------------------------------------------------------------------
def run(args, parser, argv):
    # --- before any work: the ranks, the device, --out-dir, the run directory --------------------
    # torchrun starts a process per device with its RANK, LOCAL_RANK and WORLD_SIZE (plain python: rank 0 of 1).
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world, log = int(os.environ.get("WORLD_SIZE", 1)), print if rank == 0 else lambda *_, **__: None
    available = ["cuda"] * torch.cuda.is_available() + ["mps"] * torch.backends.mps.is_available() + ["cpu"]
    try:  # --device if given and here, else the first of cuda, mps, cpu
        device = torch.device(args.device or available[0])
        device = torch.device("cuda", local_rank) if device.type == "cuda" and world > 1 else device  # its own GPU
        torch.empty(0, device=device)  # a device that is not here (cuda:9, mps on Linux) fails now
        if device.type == "cuda":  # made current, for nccl
            torch.cuda.set_device(device)
        os.makedirs(args.out_dir, exist_ok=True)  # made now, with a file written: a path mistake stops here
        tempfile.TemporaryFile(dir=args.out_dir).close()
    except (RuntimeError, AssertionError):
        raise UserError(f"--device {args.device!r} is not available here; use one of {', '.join(available)}") from None
    except OSError as error:
        raise UserError(f"--out-dir {args.out_dir} cannot be written ({error.strerror}); pick another one") from None
    train_state = check_run_dir(args, argv, parser._option_string_actions, world, log)
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights. Rank 0 alone writes.
    # bf16 autocast where the GPU (False: in hardware, not emulated) or CPU has it; weights, grads, AdamW stay fp32
    amp = torch.bfloat16 if (torch.cuda.is_bf16_supported(False) if device.type == "cuda" else cpu_has_bf16()) else None

    # --- model configuration (recorded for a later --resume), its size and the memory it needs at least ---
    shape = {key: getattr(args, key) for key in ("n_layer", "n_head", "n_embd", "block_size") if getattr(args, key)}
    cfg = GPTConfig(**{**MODEL_SIZES[args.model_size], **shape}, dropout=args.dropout)
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}; pick a multiple of it")
    args.n_layer, args.n_head, args.n_embd, args.block_size = cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size
    with torch.device("meta"):  # shapes only: counts the parameters without allocating them (tied wte once)
        n_params = sum(param.numel() for param in GPT(cfg).parameters())
    tokens_per_step = args.batch_size * cfg.block_size * args.grad_accum * world
    log(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, {n_params:,} parameters; device {device}"
        f"{f' x {world} ranks' if world > 1 else ''}, {'bf16' if amp else 'fp32'}; {tokens_per_step:,} tokens per step")
    # At least: 16 bytes a parameter (weight, gradient, 2 AdamW moments), 17 values a token, layer, width for backward
    needed = 16 * n_params + args.batch_size * cfg.block_size * cfg.n_embd * cfg.n_layer * (8 + 15 * (2 if amp else 4))
    have = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else \
        os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > have:  # stop before allocating it, and before --overwrite removes anything
        raise UserError(f"the memory estimate ({needed / 2**30:.1f} GiB at least) exceeds the {have / 2**30:.1f} GiB "
                        f"of this {device.type} device; lower --batch-size or --block-size, or pick a smaller model")

    # --- the process group, data, model and optimiser (with --resume: the saved weights, moments, RNG) ------
    if world > 1:  # the ranks meet: nccl between GPUs, gloo between CPU processes
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        # Freed at exit while Python is whole: one freed in its shutdown can abort ("terminate called without ...")
        atexit.register(lambda: (dist.is_initialized() and dist.destroy_process_group(), gc.collect()))

    def across_ranks(tensor, op=dist.ReduceOp.SUM):  # every rank's value combined (their sum); alone, its own
        if world > 1:
            dist.all_reduce(tensor, op=op)
        return tensor

    tokens = tokenize(args.data, log)
    train_batches = Batches(tokens, "train", args.batch_size, cfg.block_size, args.seed, args.grad_accum, rank, world)
    val_batches = Batches(tokens, "val", args.batch_size, cfg.block_size, args.seed + 1)  # a fixed list, split below
    model = raw_model = GPT(cfg).to(device)
    if world > 1:  # DDP averages the ranks' gradients during backward, overlapping communication with compute
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # AdamW, fused (one kernel). Decay pulls weights to 0: good for matrices and embeddings, bad for biases and gains
    groups = [{"params": [p for p in raw_model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in raw_model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=1e-8, fused=True)
    start_step = 0 if train_state is None else train_state["step"]
    if train_state is not None:  # the weights (back in our layout, lm_head tied again), moments and RNG
        weights = hf_layout(train_state["weights"].items())
        raw_model.load_state_dict({**weights, "lm_head.weight": weights["transformer.wte.weight"]})
        optimizer.load_state_dict(train_state["optimizer"])
        torch.set_rng_state(train_state["rng_cpu"])  # dropout draws from it, and from each GPU's where CUDA is
        torch.cuda.set_rng_state_all(train_state["rng_cuda"] if torch.cuda.is_available() else [])
        log(f"resuming from step {start_step} in {args.out_dir}")

    @torch.no_grad()
    def validate(step):  # the mean loss over the same validation batches every time, however many ranks share them
        model.eval()
        total = torch.zeros((), device=device)
        for index in range(rank, args.eval_batches, world):  # rank r takes batches r, r+N, ...
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                total += model(*val_batches.get(index, 0, device)).float()
        model.train()
        loss = across_ranks(total).item() / args.eval_batches
        log(f"step {step}: val loss {loss:.4f}")
        log_metrics(step=step, val_loss=loss)
        return loss

    def log_metrics(**record):  # one JSON object per line, appended (a resumed run continues the file)
        if rank == 0:
            with open(os.path.join(args.out_dir, "metrics.jsonl"), "a") as metrics:
                metrics.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    def diverged(what):  # the one line a diverged run stops with; it names the last finite checkpoint
        last = "none was saved in this run" if last_saved is None else f"step {last_saved} in {args.out_dir}"
        return UserError(f"{what}, the last finite checkpoint is {last}; lower --lr or check the data")

    def save(step):  # weights and training state after `step` updates (the next step to run); never non-finite
        nonlocal last_saved
        bad = [name for name, param in raw_model.named_parameters() if not bool(torch.isfinite(param).all())]
        if bad:  # found by every rank alike: the ranks hold the same weights
            raise diverged(f"weights are not finite at step {step} ({len(bad)}, e.g. {bad[0]}); nothing was saved")
        if rank == 0:
            save_checkpoint(args.out_dir, raw_model, optimizer, step, args, world)
        last_saved = step

    # --- training loop ----------------------------------------------------------------------------
    if train_state is None and rank == 0:  # the first write: only now does --overwrite clear the old run
        for name in ("checkpoint", "checkpoint.old"):
            shutil.rmtree(os.path.join(args.out_dir, name), ignore_errors=True)
        pathlib.Path(args.out_dir, "metrics.jsonl").unlink(missing_ok=True)
    log_metrics(event="start", seed=args.seed, step=start_step, world_size=world, device=str(device),
                dtype="bf16" if amp else "fp32", n_params=n_params, config=vars(cfg), args=vars(args))
    next_step = start_step  # the first step whose update is not in the weights yet: what a checkpoint records
    rng_at_step = (None,)  # (step, the CPU and GPU random states as it began): see Ctrl-C below
    last_saved = start_step if train_state else None  # only finite weights are ever saved
    ctrl_c = []  # Ctrl-C as a flag: under torchrun always (it reaches each rank at another point), alone in an update
    if world > 1:
        signal.signal(signal.SIGINT, lambda *_: ctrl_c.append(1))
    try:
        for step in range(start_step, args.steps):
            rng_at_step = step, torch.get_rng_state(), torch.cuda.get_rng_state_all()  # before this step draws
            if step % args.eval_interval == 0:
                validate(step)
            started = time.perf_counter()
            lr = lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                # Under DDP, the gradients are all-reduced once per step, in the last micro-step's backward.
                with model.no_sync() if world > 1 and micro < args.grad_accum - 1 else contextlib.nullcontext():
                    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                        loss = model(*train_batches.get(step, micro, device))
                    loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                    loss.backward()
                loss_sum += loss.detach()
            loss_value = (across_ranks(loss_sum) / world).item()  # each rank's loss is of its own windows
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf")).item()
            if not math.isfinite(loss_value + grad_norm):  # the update would turn weights into NaN: stop before it
                raise diverged(f"the loss is {loss_value} and the gradient norm {grad_norm} at step {step}; "
                               f"stopped before the update")  # (train.py skips a few such updates: lib/rundir.Updates)
            handler = signal.signal(signal.SIGINT, lambda *_: ctrl_c.append(1))  # from here to next_step Ctrl-C
            optimizer.step()  # only sets the flag: no save holds half an update, or one that next_step misses
            optimizer.zero_grad(set_to_none=True)
            next_step, record = step + 1, dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm)
            signal.signal(signal.SIGINT, handler)
            if step % args.log_interval == 0 or step == args.steps - 1:
                record["tokens_per_s"] = round(tokens_per_s := tokens_per_step / (time.perf_counter() - started))
                log(f"step {step:5d}/{args.steps} | loss {loss_value:.4f} | lr {lr:.2e} | {tokens_per_s:8,.0f} tok/s")
            log_metrics(**record)
            if across_ranks(torch.tensor(float(bool(ctrl_c)), device=device), dist.ReduceOp.MAX):
                raise KeyboardInterrupt  # after a whole step (under torchrun on every rank, once any rank saw Ctrl-C)
            if next_step % args.save_interval == 0 and next_step < args.steps:
                save(next_step)
    except KeyboardInterrupt:  # save exactly the updates made so far: --resume neither skips nor repeats one
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut the save short
        if rng_at_step[0] == next_step:  # inside a step that did not count, masks drawn: save the RNG it began with,
            torch.set_rng_state(rng_at_step[1]), torch.cuda.set_rng_state_all(rng_at_step[2])  # --resume redraws them
        save(next_step)
        log(f"\ninterrupted: saved step {next_step} to {args.out_dir}; continue with --resume", file=sys.stderr)
        if world > 1:  # every rank arrives before any leaves (at exit, the group goes: atexit above)
            dist.barrier()
        sys.exit(130)  # the shell's code for Ctrl-C

    # --- save and report ---------------------------------------------------------------------------
    val_loss = validate(next_step)
    save(next_step)
    log(f"saved {args.out_dir}/checkpoint: config.json, model.safetensors (Hugging Face's layout), training_state.pt")
    log_metrics(event="end", step=next_step, val_loss=val_loss)
    if world > 1:  # as on Ctrl-C: a gloo rank that leaves while a peer still works can abort it
        dist.barrier()
    return {"val_loss": val_loss}


def main(argv=None):
    args = (parser := make_parser()).parse_args(argv)
    try:
        return run(args, parser, sys.argv[1:] if argv is None else list(argv))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
