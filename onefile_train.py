"""Pretrain a GPT-2 in one file: the same training as train.py + lib/, importing nothing from lib/.

    python onefile_train.py                                   # tiny GPT on the Python stdlib, CPU, minutes
    python onefile_train.py --model-size gpt2 --compile       # GPT-2 124M on a GPU
    torchrun --standalone --nproc_per_node=2 onefile_train.py # DDP: one process per device

Read it top to bottom: arguments, device, tokenizer, data, model, optimiser, memory and speed, training loop,
checkpoint, sample. With the same seed and flags it prints train.py's loss at every step, writes the same files
and shares its data cache; only its --init-from takes a local directory, never a hub id to download.
It checks what train.py checks (lib/guards.py there, inline here): flags and paths before any work, no
silent overwrite of a saved run, --resume flags against the saved run, finite checkpoints only, memory
before allocating. Under torchrun, Ctrl-C saves and the workers exit 130, but torchrun itself ends with
its own `...SignalException: Process <pid> got signal: 2` traceback and status 1 (see the README).
"""

import argparse
import base64
import contextlib
import functools
import hashlib
import json
import math
import os
import pathlib
import random
import resource
import shutil
import signal
import socket
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

# The published GPT-2 shapes; "tiny" is this repository's CPU default.
MODEL_SIZES = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
}


class UserError(Exception):
    """A mistake the user can fix: main() prints it as one `error: ...` line and exits 2, no traceback."""


# --- arguments ----------------------------------------------------------------------------------
def number(kind, test, what):
    """An argparse type: a bad value (nan and inf included) ends in argparse's one-line error, exit 2."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
        return value
    return parse


positive_int, nonneg_int = number(int, lambda v: v >= 1, "at least 1"), number(int, lambda v: v >= 0, "0 or more")
positive_float, nonneg_float = number(float, lambda v: v > 0, "greater than 0"), number(float, lambda v: v >= 0, "0 or more")
probability = number(float, lambda v: 0 <= v < 1, "at least 0 and below 1")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default shown once: none for a flag without one (its help says what happens) or a switch."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.nargs == 0 else super()._get_help_string(action)


def make_parser():
    p = argparse.ArgumentParser(description="Pretrain GPT-2 from scratch in one file (train.py: the same with lib/).",
                                formatter_class=HelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", default="stdlib", help="a text file, a directory of them, prepared shards, or 'stdlib'")
    g.add_argument("--cache-dir", default=os.environ.get("BYHAND_CACHE", os.path.expanduser("~/.cache/byhand")),
                   help="where prepared shards are kept, shared with train.py ($BYHAND_CACHE, else ~/.cache/byhand)")
    g = p.add_argument_group("model")
    g.add_argument("--model-size", default="tiny", choices=list(MODEL_SIZES), help="a GPT-2 shape")
    g.add_argument("--n-layer", type=positive_int, help="override the shape's layer count")
    g.add_argument("--n-head", type=positive_int, help="override the shape's head count")
    g.add_argument("--n-embd", type=positive_int, help="override the shape's width")
    g.add_argument("--block-size", type=positive_int,
                   help="sequence length; if unset, the shape's, or the checkpoint's with --init-from")
    g.add_argument("--dropout", type=probability, default=0.0, help="dropout probability (GPT-2 used 0.1)")
    g.add_argument("--init-from", help="start from a Hugging Face GPT-2 directory (config.json + model.safetensors)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=nonneg_int, default=300, help="optimizer steps in total")
    g.add_argument("--batch-size", type=positive_int, default=8, help="sequences per micro-batch per process")
    g.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=positive_float, default=2e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=nonneg_float, default=0.1, help="final learning rate as a fraction of --lr (0 to 1)")
    g.add_argument("--warmup-steps", type=nonneg_int, default=30, help="steps of linear learning-rate warmup")
    g.add_argument("--weight-decay", type=nonneg_float, default=0.1, help="AdamW weight decay (matrices and embeddings only)")
    g.add_argument("--beta1", type=probability, default=0.9, help="AdamW beta1 (0 to below 1)")
    g.add_argument("--beta2", type=probability, default=0.95, help="AdamW beta2 (0 to below 1)")
    g.add_argument("--grad-clip", type=nonneg_float, default=1.0, help="clip the global gradient norm (0: off)")
    g = p.add_argument_group("run")
    g.add_argument("--device", help="cuda, cuda:N, mps or cpu; if unset, the first available of cuda, mps, cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="autocast dtype; auto = bf16 on CUDA (fp16 + GradScaler without bf16), fp32 on CPU/MPS")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--seed", type=nonneg_int, default=1337, help="seeds the weights, the data order and dropout")
    g.add_argument("--out-dir", default="out/onefile_train", help="checkpoint, training state and metrics")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --out-dir")
    g.add_argument("--overwrite", action="store_true",
                   help="start a fresh run even if --out-dir already holds a saved one (it is replaced)")
    g.add_argument("--force", action="store_true", help="run even when the memory estimate exceeds what the device has free")
    g.add_argument("--eval-interval", type=positive_int, default=100, help="steps between validation losses")
    g.add_argument("--eval-batches", type=positive_int, default=10, help="batches per validation loss")
    g.add_argument("--save-interval", type=positive_int, default=100, help="steps between checkpoints (and one at the end)")
    g.add_argument("--log-interval", type=positive_int, default=10, help="steps between progress lines")
    g.add_argument("--peak-flops", type=positive_float, help="peak FLOP/s of the device, for MFU where it is not in the table")
    g.add_argument("--estimate-memory", action="store_true", help="print the predicted memory breakdown and exit")
    g = p.add_argument_group("sample")
    g.add_argument("--sample-tokens", type=nonneg_int, default=200, help="tokens to generate at the end (0: none)")
    g.add_argument("--prompt", default="", help="sample prompt; if empty, start a new file after <|endoftext|>")
    g.add_argument("--temperature", type=nonneg_float, default=0.8, help="sampling temperature (0: always the most likely token)")
    g.add_argument("--top-k", type=positive_int, default=200, help="sample from the k most likely tokens only")
    return p


# --- guards: check before spending (train.py has the same rules in lib/guards.py) ----------------
def check_args(args):
    """Flags and paths that can be checked before any work: one line and exit 2, never a traceback."""
    if args.min_lr_ratio > 1:
        raise UserError(f"--min-lr-ratio {args.min_lr_ratio} is above 1 (the final learning rate would exceed --lr); "
                        f"use a value from 0 to 1")
    if args.seed >= 2**32:
        raise UserError(f"--seed {args.seed} is too large; use a seed from 0 to {2**32 - 1}")
    if args.resume and args.overwrite:
        raise UserError("--resume continues the run in --out-dir and --overwrite replaces it; pass one of them")
    pick_device(args.device)  # a --device that is not here fails now, not after other checks
    for flag, path, create in (("--out-dir", args.out_dir, not args.estimate_memory),
                               ("--cache-dir", args.cache_dir, not args.estimate_memory
                                and not os.path.isfile(os.path.join(args.data, "meta.json")))):
        path = parent = os.path.abspath(path)
        while not os.path.exists(parent):  # the nearest part of the path that exists decides
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            where = "is an existing file, not a directory" if parent == path else f"lies under {parent}, which is a file"
            raise UserError(f"{flag} {path} {where}; pick another {flag}")
        try:
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(13, "not writable")
            if create:  # make it and write a probe: a read-only mount stops even root here
                os.makedirs(path, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):
                    pass
        except OSError as e:
            raise UserError(f"{flag} {path} cannot be written ({e.strerror}); pick a directory you can write to") from None
    # A fresh run never replaces a saved one unless asked to.
    found = [n for n in ("model.safetensors", "training_state.pt") if os.path.isfile(os.path.join(args.out_dir, n))]
    if found and not (args.resume or args.overwrite or args.estimate_memory):
        raise UserError(f"{args.out_dir} already holds a saved run ({', '.join(found)}); pass --resume to continue it, "
                        f"--overwrite to replace it, or another --out-dir")


# --resume continues the saved run: these flags would change what it is (model, data, the windows a step
# reads), so given explicitly they must match, and unset they take the saved values. The others may change:
# given, they are reported; unset, they keep the saved values (except --device: it may be another machine).
RESUME_FIXED = ("model_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "init_from", "data", "seed",
                "batch_size", "grad_accum")
RESUME_CHANGEABLE = ("steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
                     "eval_interval", "eval_batches", "save_interval", "log_interval", "device", "dtype", "compile",
                     "sample_tokens", "prompt", "temperature", "top_k")


def check_resume_flags(saved, args, parser, argv, log):
    options = parser._option_string_actions
    given = {options[a.split("=", 1)[0]].dest for a in argv if a.split("=", 1)[0] in options}
    for key in RESUME_FIXED:
        flag = "--" + key.replace("_", "-")
        if key in given and key in saved and getattr(args, key) != saved[key]:
            raise UserError(f"--resume: {flag} {getattr(args, key)} contradicts the saved run ({flag} {saved[key]}); "
                            f"drop {flag} to continue it, or start a new run with --overwrite or another --out-dir")
        if key in saved:
            setattr(args, key, saved[key])
    for key in RESUME_CHANGEABLE:
        if key not in given and key in saved and key != "device":  # not given: as the saved run had it
            setattr(args, key, saved[key])
        if key in saved and getattr(args, key) != saved[key]:
            log(f"--resume: {'--' + key.replace('_', '-')} changed from {saved[key]} to {getattr(args, key)}")


def check_finite_weights(model, step, last_finite, out_dir):
    """A checkpoint is only good if it is finite: weights holding NaN or inf are never saved."""
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise UserError(f"weights are not finite at step {step} ({len(bad)} tensors, e.g. {bad[0]}); nothing was "
                        f"saved, {last_finite_text(last_finite, out_dir)}; lower --lr or check the data")


def last_finite_text(last_finite, out_dir):
    if last_finite is None:
        return "no finite checkpoint was saved in this run"
    return f"the last finite checkpoint is step {last_finite} in {out_dir}"


def check_memory(estimate_bytes, device, force):
    """Stop before allocating when the predicted peak is clearly (25%) more than the device has free."""
    if device.type == "cuda":
        available, what = torch.cuda.mem_get_info(device)[0], "free CUDA memory"
    elif device.type == "mps":
        available, what = torch.mps.recommended_max_memory(), "MPS recommended maximum"
    else:
        try:  # Linux; elsewhere the physical RAM is the best figure the stdlib has
            available = next(int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemAvailable:"))
            what = "available RAM"
        except (OSError, StopIteration):
            available, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM"
    if not force and estimate_bytes > 1.25 * available:
        raise UserError(f"the memory estimate ({format_bytes(estimate_bytes)}) exceeds the {format_bytes(available)} "
                        f"of {what} on {device}; lower --batch-size or --block-size, or pick a smaller model, or pass "
                        f"--force to try anyway (--estimate-memory shows the breakdown)")


# --- device, precision and processes ------------------------------------------------------------
def pick_device(name=None):
    """--device if given (cuda, cuda:N, mps or cpu, and present here), else cuda, then mps, then cpu."""
    available = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(), "cpu": True}
    if not name:
        return torch.device(next(kind for kind, ok in available.items() if ok))
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in available:
        raise UserError(f"--device {name!r} is not a device this script runs on; use cuda, cuda:N, mps or cpu")
    if not available[device.type]:
        raise UserError(f"--device {name} was asked for but is not available here; use --device cpu")
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if (device.index or 0) >= count:
        raise UserError(f"--device {name}: this machine has {count} {device.type} device(s); use an index below {count}")
    return device


def amp_dtype(device, requested):
    """The autocast dtype, or None for fp32. fp16 needs a GradScaler, because its gradients underflow."""
    if requested == "auto":
        requested = "fp32" if device.type != "cuda" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]


def autocast(device, dtype):
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu" and os.path.exists("/proc/self/clear_refs"):
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: resets the peak-RSS mark, so tokenising the data does not count as training


def peak_memory_bytes(device):
    """CUDA: max allocated by tensors. MPS: driver-allocated now. CPU: the process's peak RSS."""
    if device.type != "cpu":
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else torch.mps.driver_allocated_memory()
    if os.path.exists("/proc/self/status"):  # Linux: VmHWM, the mark reset_peak_memory resets
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, kilobytes elsewhere


def setup_distributed(device):
    """torchrun starts one process per device and tells each its RANK, LOCAL_RANK and WORLD_SIZE;
    plain python sees none of them and runs as rank 0 of 1."""
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(local_rank)  # each process owns the GPU of its local rank
            device = torch.device("cuda", local_rank)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank, local_rank, world, device


def all_reduce_mean(t, world):
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= world
    return t


def cleanup_distributed(world, wait=True):
    # Let every rank arrive first: a gloo rank tearing down while a peer still works can abort the job.
    if world > 1 and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


# --- tokenizer ----------------------------------------------------------------------------------
# GPT-2's BPE is a table of byte sequences with merge ranks plus a regex that splits text into words
# first; tiktoken does the merging, we hand it the table shipped in data/ (checked by its hash).
RANKS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken")
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT, VOCAB_SIZE = 50256, 50257  # <|endoftext|> joins documents; 50,000 merges + 256 bytes + EOT


@functools.lru_cache(maxsize=None)
def get_encoding():
    raw = pathlib.Path(RANKS_PATH).read_bytes()
    if hashlib.sha256(raw).hexdigest() != RANKS_SHA256:
        raise UserError(f"{RANKS_PATH} does not have the GPT-2 ranks' sha256 {RANKS_SHA256}; restore it from git")
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in raw.splitlines() if line)}
    return tiktoken.Encoding(name="gpt2-byhand", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT})


# --- data ---------------------------------------------------------------------------------------
# Tokenise once into flat uint16 shards on disk (GPT-2's 50,257 ids fit in 16 bits), in the format and cache
# layout of lib/data.py, so train.py shares them; a batch is then random windows read through a memory map.
FORMAT, SHARD_TOKENS, VAL_PERCENT = "byhand-tokens-v1", 100_000_000, 5  # 200 MB shards, 5% held out
STDLIB = ("stdlib", "stdlib-tests")  # the stdlib's code, or its test files (a second domain)


def stdlib_files(tests=False):
    root, found = sysconfig.get_paths()["stdlib"], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for rel in (os.path.relpath(os.path.join(dirpath, n), root) for n in filenames if n.endswith(".py")):
            parts = rel.replace(os.sep, "/").split("/")
            if (any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")) == tests:
                found.append(rel)
    return sorted(found)


def list_source(source):
    """(name, root, sorted relative paths) of the stdlib corpora, a text file or a directory."""
    if source in STDLIB:
        return source, sysconfig.get_paths()["stdlib"], stdlib_files(tests=source == "stdlib-tests")
    if not os.path.exists(source):
        raise UserError(f"data path {source!r} does not exist; pass a text file, a directory of text files or 'stdlib'")
    if os.path.isfile(source):
        return os.path.basename(source), os.path.dirname(os.path.abspath(source)), [os.path.basename(source)]
    files = []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.relpath(os.path.join(dirpath, f), source) for f in filenames if not f.startswith(".")]
    return os.path.basename(os.path.normpath(source)), source, sorted(files)


def prepare_data(source, cache_dir, log=print):
    """Tokenise source into cache_dir/data/<name>-<key>/ unless it is there already; return that directory."""
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "meta.json")):
        load_meta(source)  # already prepared shards: only check them
        return source
    name, root, files = list_source(source)
    if not files:
        raise UserError(f"data directory {source!r} holds no files; put .txt (or any UTF-8 text) files in it")
    # Every file's path, size and mtime go into the key: editing the data re-tokenises it, nothing else does.
    key = hashlib.sha1(FORMAT.encode())
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        key.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    out = os.path.join(cache_dir, "data", f"{name}-{key.hexdigest()[:12]}")
    if os.path.isfile(os.path.join(out, "meta.json")):
        return out

    log(f"preparing {name}: tokenising {len(files)} file(s) with the GPT-2 BPE -> {out}")
    texts = {"train": [], "val": []}
    for rel in files:
        raw = pathlib.Path(root, rel).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if source not in STDLIB:
                raise UserError(f"{os.path.join(root, rel)} is not UTF-8 text (bad byte at offset {e.start}); "
                                f"convert it to UTF-8 or remove it") from None
            text = ""  # the stdlib ships a few deliberately mis-encoded files (codec tests): skip those
        # 5% of the files are val, chosen by a hash of the path: adding a file never moves the others.
        is_val = int(hashlib.sha1(rel.replace(os.sep, "/").encode()).hexdigest()[:8], 16) % 100 < VAL_PERCENT
        if text.strip():
            texts["val" if len(files) > 1 and is_val else "train"].append(text)
    ids = {}
    for split, docs in texts.items():
        # Each document starts with <|endoftext|>, as in GPT-2's data: the model learns where files end.
        encoded = get_encoding().encode_ordinary_batch(docs, num_threads=max(1, min(8, os.cpu_count() or 1)))
        ids[split] = np.fromiter((t for doc in encoded for t in [EOT, *doc]), dtype=np.uint16)
    if len(files) == 1 or len(ids["val"]) == 0:  # nothing held out by file: the last 5% of the tokens is val
        all_ids = np.concatenate([ids["train"], ids["val"]])
        cut = len(all_ids) - max(1, len(all_ids) * VAL_PERCENT // 100)
        ids = {"train": all_ids[:cut], "val": all_ids[cut:]}
    if len(ids["train"]) == 0 or not any(texts.values()):
        raise UserError(f"data {source!r} is empty: no text found in {len(files)} file(s); add some text")

    tmp = f"{out}.tmp-{socket.gethostname()}-{os.getpid()}"  # private: machines may share the cache
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {"format": FORMAT, "tokenizer": "gpt2", "vocab_size": VOCAB_SIZE, "dtype": "uint16",
            "source": source if source in STDLIB else os.path.abspath(source), "files": len(files)}
    for split, arr in ids.items():
        meta[f"{split}_tokens"], meta[f"{split}_shards"] = int(len(arr)), []
        for i in range(0, max(1, len(arr)), SHARD_TOKENS):
            meta[f"{split}_shards"].append(f"{split}_{i // SHARD_TOKENS:04d}.bin")
            arr[i : i + SHARD_TOKENS].tofile(os.path.join(tmp, meta[f"{split}_shards"][-1]))
    pathlib.Path(tmp, "meta.json").write_text(json.dumps(meta, indent=2))
    if os.path.isdir(out) and not os.path.isfile(os.path.join(out, "meta.json")):
        shutil.rmtree(out)  # the remains of a copy that never finished
    try:
        os.rename(tmp, out)  # a directory rename is atomic: a half-written cache never looks prepared
    except OSError:  # another process finished the same data first: keep its identical copy
        if not os.path.isfile(os.path.join(out, "meta.json")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    return out


def load_meta(path):
    meta_path = os.path.join(path, "meta.json")
    try:
        meta = json.loads(pathlib.Path(meta_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{meta_path} cannot be read ({e}); delete the directory and prepare the data again") from None
    if meta.get("format") != FORMAT or meta.get("vocab_size") != VOCAB_SIZE or meta.get("dtype") != "uint16":
        raise UserError(f"{meta_path} is not {FORMAT} with GPT-2's 50257 ids in uint16; prepare the data again")
    return meta


class Batches:
    """Random [batch, block+1] windows of one split; the windows of a step depend only on (seed, step).
    A step's grad_accum x world x batch_size windows are drawn together and rank r takes micro-batch m's
    slice [m, r]: N ranks read what one process with N times the accumulation reads, and a resumed run
    reads what an uninterrupted one would have."""

    def __init__(self, data_dir, split, batch_size, block_size, grad_accum, rank, world, seed):
        meta, self.shards = load_meta(data_dir), []
        for fname in meta[f"{split}_shards"]:
            path = os.path.join(data_dir, fname)
            if not os.path.isfile(path):
                raise UserError(f"shard {path} listed in meta.json is missing; prepare the data again")
            # np.memmap refuses empty files; an empty split is an empty array.
            self.shards.append(np.memmap(path, np.uint16, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint16))
        self.B, self.T, self.accum, self.rank, self.world, self.seed = batch_size, block_size, grad_accum, rank, world, seed
        # A window may start wherever T+1 tokens remain inside the same shard.
        self.cum = np.cumsum([0] + [max(0, len(s) - block_size) for s in self.shards])
        if self.cum[-1] == 0:
            raise UserError(f"{data_dir}:{split} holds {sum(map(len, self.shards))} tokens, fewer than block_size+1 = "
                            f"{block_size + 1}; use a smaller --block-size or more data")

    def get(self, step, micro_step, device):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        picks = torch.randint(int(self.cum[-1]), (self.accum * self.world * self.B,), generator=g)
        picks = picks.view(self.accum, self.world, self.B)[micro_step, self.rank].numpy()
        shard_idx = np.searchsorted(self.cum, picks, side="right") - 1
        rows = [self.shards[s][p - self.cum[s] : p - self.cum[s] + self.T + 1] for s, p in zip(shard_idx, picks)]
        xy = torch.from_numpy(np.stack(rows).astype(np.int64))
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
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k and v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        # SDPA picks a fused (flash / memory-efficient) kernel that never stores the T x T matrix.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        # GPT-2 used the tanh approximation of GELU ("gelu_new" in transformers).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
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
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying saves vocab x n_embd parameters
        # GPT-2's init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer) so the residual stream's
        # variance does not grow with depth; LayerNorms keep gain 1, bias 0. lm_head comes last and re-draws the
        # tied wte: the RNG order train.py uses.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} exceeds block_size {self.config.block_size}")
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device)))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        # Cross-entropy in fp32 even under autocast: log-softmax over 50k classes needs the range.
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# --- optimiser and learning-rate schedule -------------------------------------------------------
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


# --- memory and speed ---------------------------------------------------------------------------
def estimate_memory(cfg, n_params, batch_size, block_size, device_type, amp, ddp):
    """Predicted bytes per component of AdamW training (lib/memory.py's formula, explained there)."""
    tokens = batch_size * block_size
    # Autograd keeps, per block and token, the two LayerNorm inputs (fp32 residual stream) and 15 x n_embd
    # matmul inputs and outputs in the compute dtype: LN outs 2, q/k/v 3, attention out 2, MLP 4x in/out 8.
    per_block = tokens * cfg.n_embd * (2 * 4 + 15 * (2 if amp else 4) + (6 if cfg.dropout > 0 else 0))
    return {
        "parameters (fp32)": int(n_params * 4),
        "gradients (fp32)": int(n_params * 4),
        "AdamW moments (2 x fp32)": int(n_params * 8),
        "activations": cfg.n_layer * per_block + tokens * cfg.n_embd * 4 * 3,  # + embeddings out, ln_f in/out
        # logits, their fp32 log-softmax and both gradients (+ an fp32 copy of 16-bit logits): a small GPT's largest
        "logits + loss": tokens * cfg.vocab_size * ((2 + 4 + 4 + 4 + 2) if amp else (4 + 4 + 4 + 4)),
        # Python with torch and the BPE table loaded; CUDA's max_memory_allocated counts tensors only.
        "runtime baseline": {"cpu": 250 * 2**20, "mps": 100 * 2**20}.get(device_type, 0),
    } | ({"DDP gradient buckets (fp32)": int(n_params * 4)} if ddp else {})  # DDP all-reduces a flat copy


def format_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_seconds(s):
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_memory_table(estimate, measured=None, label="measured peak"):
    width, total = max(len(k) for k in estimate) + 2, sum(estimate.values())
    rows = [*estimate.items(), ("total (predicted peak)", total), *([(label, measured)] if measured is not None else [])]
    table = "memory estimate:" + "".join(f"\n  {name:<{width}}{format_bytes(b):>12}" for name, b in rows)
    return table + (f"   ({measured / max(total, 1):.2f}x the estimate)" if measured is not None else "")


# Dense bf16 tensor-core peak FLOP/s from the data sheets; the first key found in the GPU's name wins.
PEAK_FLOPS = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12,
              "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12, "T4": 65e12}


# --- training loop ------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, batches, n_batches, device, amp, rank, world):
    """Mean loss over the same n_batches validation batches every time, however many ranks share them."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(rank, n_batches, world):  # rank r takes batches r, r+N, ...
        x, y = batches.get(i, 0, device)
        with autocast(device, amp):
            loss = model(x, y)[1]
        total += loss.float()
    model.train()
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / n_batches


def run(args, parser, argv):
    check_args(args)
    train_state = None
    if args.resume:
        train_state = load_training_state(args.out_dir)
        check_resume_flags(json.loads(train_state.get("args", "{}")), args, parser, argv,
                           print if int(os.environ.get("RANK", 0)) == 0 else (lambda *a: None))
    rank, local_rank, world, device = setup_distributed(pick_device(args.device))
    log = print if rank == 0 else (lambda *a, **k: None)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # the same seed on every rank: identical initial weights
    amp = amp_dtype(device, args.dtype)
    if amp is not None and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast use TF32

    # The model's shape: from the run being resumed, a pretrained GPT-2, or --model-size + overrides. Only
    # config.json is read here: the memory check below comes before any weight is read.
    if args.resume:
        if args.steps < train_state["step"]:
            raise UserError(f"--resume: {args.out_dir} is at step {train_state['step']}, past --steps {args.steps}; "
                            f"pass --steps {train_state['step']} or more")
        cfg = load_config(args.out_dir)
    elif args.init_from:
        cfg = load_config(args.init_from)
        cfg.dropout = args.dropout
        options = parser._option_string_actions
        given = {options[a.split("=", 1)[0]].dest for a in argv if a.split("=", 1)[0] in options}
        want = (MODEL_SIZES[args.model_size] if "model_size" in given else {}) | \
            {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if k in given}
        for key, value in want.items():  # shape flags may repeat the checkpoint's shape, not contradict it
            if key != "block_size" and value != getattr(cfg, key):
                flag = f"--model-size {args.model_size}" if key not in given else f"--{key.replace('_', '-')} {value}"
                raise UserError(f"{flag} contradicts --init-from {args.init_from}, whose {key} is {getattr(cfg, key)}; "
                                f"drop the shape flags (only --block-size may shorten the sequence)")
    else:
        flags = {key: getattr(args, key) for key in ("n_layer", "n_head", "n_embd", "block_size")}
        shape = MODEL_SIZES[args.model_size] | {key: v for key, v in flags.items() if v is not None}
        if shape["n_embd"] % shape["n_head"]:
            raise UserError(f"--n-embd {shape['n_embd']} is not divisible by --n-head {shape['n_head']}; "
                            f"pick a width that is a multiple of the head count")
        cfg = GPTConfig(**shape, dropout=args.dropout)
    block_size = args.block_size or cfg.block_size
    if block_size > cfg.block_size:
        raise UserError(f"--block-size {block_size} is more than the model's {cfg.block_size} positions; lower it")
    if cfg.vocab_size < VOCAB_SIZE:
        raise UserError(f"vocabulary mismatch: the checkpoint has vocab_size {cfg.vocab_size}, the GPT-2 tokenizer "
                        f"needs {VOCAB_SIZE}; use a GPT-2 checkpoint")
    # Record the shape the run really has, so a later --resume compares against it.
    args.n_layer, args.n_head, args.n_embd, args.block_size = cfg.n_layer, cfg.n_head, cfg.n_embd, block_size
    with torch.device("meta"):  # shapes only: counts the parameters without allocating them
        n_params = sum(p.numel() for p in GPT(cfg).parameters())  # the tied wte / lm_head counts once
    tokens_per_step = args.batch_size * block_size * args.grad_accum * world
    log(f"model: {cfg.n_layer} layers, {cfg.n_head} heads, {cfg.n_embd} wide, {n_params:,} parameters; "
        f"device {device}{f' x {world} ranks' if world > 1 else ''}, "
        f"{'fp32' if amp is None else str(amp).replace('torch.', '') + ' autocast'}; {tokens_per_step:,} tokens per step")
    estimate = estimate_memory(cfg, n_params, args.batch_size, block_size, device.type, amp is not None, world > 1)
    if args.estimate_memory:
        log(format_memory_table(estimate))
        cleanup_distributed(world)
        return estimate
    # On a CPU the ranks of one machine share its RAM.
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if device.type == "cpu" else 1
    check_memory(sum(estimate.values()) * per_machine, device, args.force)

    # Data: one process per machine tokenises (once, cached); the others wait, then find the cache.
    if local_rank == 0:
        data_dir = prepare_data(args.data, args.cache_dir, log=log)
    if world > 1:
        dist.barrier()
    if local_rank != 0:
        data_dir = prepare_data(args.data, args.cache_dir, log=log)
    train_batches = Batches(data_dir, "train", args.batch_size, block_size, args.grad_accum, rank, world, args.seed)
    # Validation batches are one fixed list (as if on one rank), split between the ranks inside evaluate().
    val_batches = Batches(data_dir, "val", args.batch_size, block_size, 1, 0, 1, args.seed + 1)

    # Model, then optimiser.
    reset_peak_memory(device)  # count training, not tokenisation
    state_dict = None
    if args.resume:
        _, state_dict = load_hf(args.out_dir)
        with safe_open(os.path.join(args.out_dir, "model.safetensors"), framework="pt") as f:
            saved_step = int((f.metadata() or {}).get("step", -1))  # written by save_checkpoint, beside the weights
        if saved_step != train_state["step"]:
            raise UserError(f"{args.out_dir}: weights are from step {saved_step} but the training state from "
                            f"step {train_state['step']}; the save was interrupted, start again with --overwrite")
        bad = [name for name, t in state_dict.items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise UserError(f"{args.out_dir}/model.safetensors holds non-finite weights ({len(bad)} tensors, e.g. "
                            f"{bad[0]}), so it cannot be continued; start again with --overwrite and a lower --lr")
    elif args.init_from:
        _, state_dict = load_hf(args.init_from)
    raw_model = GPT(cfg)
    if state_dict is not None:
        raw_model.load_state_dict(state_dict)
        del state_dict  # the model holds its own copy now
    raw_model.to(device)
    model = torch.compile(raw_model) if args.compile else raw_model
    if world > 1:
        # DDP averages gradients across ranks during backward, overlapping communication with compute.
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = make_adamw(raw_model, args.lr, args.weight_decay, (args.beta1, args.beta2), device.type)
    # fp16 gradients underflow; the scaler multiplies the loss up and divides the gradients back.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    start_step, first_val = 0, None
    if train_state is not None:
        optimizer.load_state_dict(train_state["optimizer"])
        torch.set_rng_state(train_state["rng_cpu"])
        if train_state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(train_state["rng_cuda"])
        start_step, first_val = train_state["step"], train_state.get("first_val_loss")
        log(f"resuming from step {start_step} in {args.out_dir}" + ("" if args.steps > start_step else
            f"; it already ran its --steps {args.steps}, pass a larger --steps to train further"))

    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if rank == 0 and not args.resume and os.path.isfile(metrics_path):
        os.remove(metrics_path)  # a fresh run starts a fresh log

    def log_metrics(**record):  # one JSON object per line, appended (a resumed run continues the file)
        if rank == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    log_metrics(event="start", seed=args.seed, step=start_step, world_size=world, device=str(device),
                n_params=n_params, config=vars(cfg), args=vars(args))
    peak_flops = args.peak_flops  # CPU and MPS have no entry: their MFU is n/a unless --peak-flops is given
    if not peak_flops and device.type == "cuda":
        peak_flops = next((f for k, f in PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), None)
    # MFU: about 6 FLOPs per parameter per token (2 forward, 4 backward) plus attention's 12 L C T.
    flops_per_step = (6 * n_params + 12 * cfg.n_layer * cfg.n_embd * block_size) * tokens_per_step
    if args.compile:
        log("torch.compile: the first step compiles the model, which takes a minute or more (longer on a CPU)")
    # The ETA counts from the end of the first step: that one pays for warm-up (and compilation).
    t_last, step_last, t_steady = time.perf_counter(), start_step, None
    next_step = start_step  # the first step whose update is not in the weights yet: what a checkpoint records
    last_finite = start_step if args.resume else None  # only finite weights are ever saved
    val_loss, skipped_in_a_row = None, 0
    # Under torchrun Ctrl-C only sets a flag that the ranks agree on after each step, so that none of them
    # leaves while the others wait in an all-reduce; one process stops at once (KeyboardInterrupt).
    previous_handler, ctrl_c = signal.getsignal(signal.SIGINT), {"requested": False}
    if world > 1:
        signal.signal(signal.SIGINT, lambda *_: ctrl_c.update(requested=True))
    try:
        for step in range(start_step, args.steps):
            if step % args.eval_interval == 0:
                val_loss = evaluate(model, val_batches, args.eval_batches, device, amp, rank, world)
                first_val = val_loss if first_val is None else first_val
                log(f"step {step}: val loss {val_loss:.4f}")
                log_metrics(step=step, val_loss=val_loss)

            lr = lr_at(step, args.lr, args.warmup_steps, args.steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(args.grad_accum):
                x, y = train_batches.get(step, micro, device)
                # Under DDP, skip the gradient all-reduce on every micro-step but the last.
                sync = model.no_sync() if world > 1 and micro < args.grad_accum - 1 else contextlib.nullcontext()
                with sync:
                    with autocast(device, amp):
                        loss = model(x, y)[1]  # drop the logits now: holding them costs B x T x vocab floats
                    loss = loss / args.grad_accum  # so the accumulated gradient is the batch mean
                    scaler.scale(loss).backward()
                loss_sum += loss.detach()
            loss_value = all_reduce_mean(loss_sum, world).item()
            if not math.isfinite(loss_value):
                raise UserError(f"loss became {loss_value} at step {step}; stopped before the update, "
                                f"{last_finite_text(last_finite, args.out_dir)}; lower --lr or check the data")
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf")).item()
            # A NaN or infinite gradient would turn every weight it touches into NaN: skip that update.
            # (Under fp16 the GradScaler skips it by itself and lowers its scale: its way of finding one.)
            skipped = not math.isfinite(grad_norm)
            if scaler.is_enabled() or not skipped:
                scaler.step(optimizer)
            next_step = step + 1
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            t_steady = t_steady or time.perf_counter()
            skipped_in_a_row = skipped_in_a_row + 1 if skipped and not scaler.is_enabled() else 0
            if skipped:
                log(f"step {step}: gradient norm {grad_norm}, update skipped")
            if skipped_in_a_row >= 10:
                raise UserError(f"the gradient norm was not finite for 10 steps in a row (steps {step - 9} to {step}); "
                                f"stopped, {last_finite_text(last_finite, args.out_dir)}; lower --lr or check the data")
            record = dict(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm) | ({"skipped": True} if skipped else {})
            if step % args.log_interval == 0 or step == args.steps - 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # timings are only honest once queued GPU work is done
                now = time.perf_counter()
                sec_per_step = max(now - t_last, 1e-9) / (step + 1 - step_last)  # since the last progress line
                tok_s = tokens_per_step / sec_per_step
                # ETA from the steady-state steps after the first; after the first alone there is none yet ("?").
                steady = step - start_step
                eta = (now - t_steady) / steady * (args.steps - step - 1) if steady else float("inf")
                eta = 0.0 if step + 1 >= args.steps else eta
                t_last, step_last = now, step + 1
                mfu = flops_per_step / sec_per_step / peak_flops if peak_flops else None
                mem = peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), mfu=mfu, peak_memory=mem)
                log(f"step {step:5d}/{args.steps} | loss {loss_value:.4f} | lr {lr:.2e} | {tok_s:8,.0f} tok/s | "
                    f"MFU {f'{mfu:.1%}' if mfu is not None else 'n/a'} | mem {format_bytes(mem)} | "
                    f"ETA {format_seconds(eta)}")
            log_metrics(**record)

            if world > 1:  # every rank learns whether any rank saw Ctrl-C, after the same finished step
                flag = torch.tensor(float(ctrl_c["requested"]), device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    raise KeyboardInterrupt
            if next_step % args.save_interval == 0 and next_step < args.steps:
                check_finite_weights(raw_model, next_step, last_finite, args.out_dir)
                if rank == 0:
                    save_checkpoint(args.out_dir, raw_model, optimizer, next_step, args, first_val)
                last_finite = next_step
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards a second Ctrl-C: let the save finish
        # Save exactly the updates made so far: --resume then runs next_step, neither skipped nor repeated.
        check_finite_weights(raw_model, next_step, last_finite, args.out_dir)
        if rank == 0:
            save_checkpoint(args.out_dir, raw_model, optimizer, next_step, args, first_val)
            print(f"\ninterrupted: saved step {next_step} to {args.out_dir}; continue with --resume", file=sys.stderr)
        cleanup_distributed(world)
        # Exit 130, the shell's code for Ctrl-C. torchrun got the SIGINT too and always ends with its own
        # traceback, `...SignalException: Process <pid> got signal: 2`, and status 1 (see the README).
        sys.exit(130)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    step = next_step

    # Final validation loss and checkpoint, then the measured memory beside the estimate, then a sample.
    if args.steps > start_step or not args.resume:
        val_loss = evaluate(model, val_batches, args.eval_batches, device, amp, rank, world)
        log(f"step {step}: val loss {val_loss:.4f}" + (f" (started at {first_val:.4f})" if first_val else ""))
        log_metrics(step=step, val_loss=val_loss)
    check_finite_weights(raw_model, step, last_finite, args.out_dir)
    if rank == 0:
        save_checkpoint(args.out_dir, raw_model, optimizer, step, args, first_val)
        log(f"saved {args.out_dir}/config.json, model.safetensors (Hugging Face GPT-2 layout) and training_state.pt")
    peak = peak_memory_bytes(device)
    label = {"cuda": "max allocated", "mps": "driver allocated", "cpu": "peak RSS"}[device.type]
    log(format_memory_table(estimate, peak, f"measured ({label})"))
    sample = sample_text(raw_model, args, device, amp) if args.sample_tokens > 0 and rank == 0 else None
    log_metrics(event="end", step=step, val_loss=val_loss, peak_memory=peak, memory_estimate=sum(estimate.values()),
                sample=sample)
    cleanup_distributed(world)
    return {"val_loss": val_loss, "first_val_loss": first_val, "peak_memory": peak}


# --- checkpoint ---------------------------------------------------------------------------------
# Two files for two audiences: config.json + model.safetensors in transformers' GPT-2 names and
# layouts (anyone can load the model), and training_state.pt (optimizer moments, step, RNG) only for
# --resume. Each is written to a temporary name and renamed into place, so a crash never tears one.
# transformers stores these four projections as Conv1D, whose weight is [in, out]: nn.Linear's transpose.
CONV1D_NAMES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def atomic_write(path, write):
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        umask = os.umask(0)  # safetensors creates its file 0600: give it the mode open() would, 0666 - umask
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_checkpoint(out_dir, model, optimizer, step, args, first_val=None):
    """Weights in the HF layout, then the state --resume needs. step = the next step to run."""
    os.makedirs(out_dir, exist_ok=True)
    # lm_head is tied to wte, so it is left out; transformers re-ties it on load. The step in the metadata
    # lets --resume check that weights and training state belong together.
    tensors = {name: (t.t() if name.endswith(CONV1D_NAMES) else t).detach().to("cpu").contiguous()
               for name, t in model.state_dict().items() if name != "lm_head.weight"}
    atomic_write(os.path.join(out_dir, "model.safetensors"),
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt", "step": str(step)}))
    c = model.config
    hf_config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
                 "n_positions": c.block_size, "n_ctx": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
                 "n_head": c.n_head, "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": c.dropout,
                 "embd_pdrop": c.dropout, "attn_pdrop": c.dropout, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
                 "bos_token_id": EOT, "eos_token_id": EOT, "tie_word_embeddings": True, "torch_dtype": "float32"}
    atomic_write(os.path.join(out_dir, "config.json"),
                 lambda tmp: pathlib.Path(tmp).write_text(json.dumps(hf_config, indent=2) + "\n"))
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng_cpu": torch.get_rng_state(),
             "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
             "data_position": step,  # batches are a function of (seed, step): the step is the position
             "args": json.dumps(vars(args)), "first_val_loss": first_val}  # "started at" after a resume
    atomic_write(os.path.join(out_dir, "training_state.pt"), lambda tmp: torch.save(state, tmp))


def load_config(model_dir):
    """config.json alone -> GPTConfig (--estimate-memory and the memory check read no weights)."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise UserError(f"--init-from {model_dir!r}: the local path {os.path.abspath(model_dir)} does not exist or is "
                        f"not a directory; pass a GPT-2 directory (`python train.py --init-from gpt2` downloads one)")
    try:
        hf = json.loads(pathlib.Path(config_path).read_text())
        cfg = GPTConfig(block_size=hf.get("n_positions", hf.get("n_ctx", 1024)), vocab_size=hf["vocab_size"],
                        n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=hf.get("resid_pdrop", 0.0))
        is_gpt2 = hf.get("model_type", "gpt2") == "gpt2" and hf.get("n_inner") in (None, 4 * cfg.n_embd) and \
            hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh")
    except (OSError, json.JSONDecodeError, KeyError, AttributeError):
        is_gpt2 = False
    if not is_gpt2:
        raise UserError(f"{config_path} is missing or not a GPT-2 config (model_type gpt2 with n_layer, n_head, "
                        f"n_embd, vocab_size, 4x MLP and tanh GELU); point --init-from at a local GPT-2 directory")
    return cfg


def load_hf(model_dir):
    """A Hugging Face GPT-2 directory -> (GPTConfig, state dict in our names and layouts)."""
    cfg, weights_path = load_config(model_dir), os.path.join(model_dir, "model.safetensors")
    hint = "point --init-from at a local GPT-2 directory (`python train.py --init-from gpt2` downloads one)"
    try:
        hf_state = load_file(weights_path)
    except (SafetensorError, OSError) as e:  # .bin weights must be converted to safetensors first
        raise UserError(f"{weights_path} is missing or not safetensors ({e}); {hint}") from None
    sd = {}
    for name, t in hf_state.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the causal-mask buffers old transformers versions saved: not weights
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name  # GPT2Model names
        sd[name] = (t.t() if name.endswith(CONV1D_NAMES) else t).contiguous()
    if "lm_head.weight" not in sd and "transformer.wte.weight" in sd:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied: HF files leave it out
    with torch.device("meta"):  # compare names and shapes with the model config.json describes
        want = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    bad = [k for k, shape in want.items() if k in sd and tuple(sd[k].shape) != shape]
    if missing or unexpected or bad:
        raise UserError(f"{weights_path} does not match the {cfg.n_layer}-layer GPT-2 of its config.json: missing "
                        f"{missing[:4]}, unexpected {unexpected[:4]}, wrong shape {bad[:4]}")
    return cfg, sd


def load_training_state(out_dir):
    path = os.path.join(out_dir, "training_state.pt")
    if not os.path.isfile(path):
        raise UserError(f"--resume: {path} does not exist; run without --resume first, or pass an earlier --out-dir")
    try:
        # weights_only=True: unpickling arbitrary objects can run code; tensors and dicts cannot.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which one
        raise UserError(f"{path} cannot be read ({type(e).__name__}: {e}); it is not a byhand training state") from None


# --- sample -------------------------------------------------------------------------------------
@torch.no_grad()
def sample_text(model, args, device, amp):
    model.eval()
    # The default prompt is <|endoftext|>, "start a new file"; a prompt's text never becomes a special token.
    idx = torch.tensor([get_encoding().encode_ordinary(args.prompt) if args.prompt else [EOT]], device=device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    for _ in range(args.sample_tokens):
        with autocast(device, amp):
            logits = model(idx[:, -model.config.block_size :])[0][:, -1, :].float()
        if args.temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / args.temperature
            if args.top_k is not None:
                # Keep the k most likely tokens; the long tail is where nonsense comes from.
                kth = torch.topk(logits, min(args.top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=g)
        idx = torch.cat((idx, next_id), dim=1)
    text = get_encoding().decode([t for t in idx[0].tolist() if t != EOT])
    print("sample:\n" + "-" * 40 + "\n" + text + "\n" + "-" * 40)
    return text


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
