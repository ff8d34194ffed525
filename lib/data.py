"""Text in, token shards out, batches drawn from them.

Used by train.py, train_fsdp.py, finetune_lora.py and finetune_qlora.py (onefile_train.py has its
own copy). The one idea: tokenise once, store the ids as a flat uint16 array on disk (GPT-2's 50,257
ids fit in 16 bits), and from then on a batch is just random windows of that array read through a
memory map. The window positions for step k are a pure function of (seed, k), so a resumed run or a
run on N ranks reads exactly the windows an uninterrupted single-process run would have read.

The embedded default corpus is the running Python's own standard library (found via sysconfig),
split into train/val by file. The stdlib's test files are left out of it and form a second domain
("stdlib-tests") for the fine-tuning scripts.
"""

import hashlib
import json
import os
import shutil
import socket
import sysconfig

import numpy as np
import torch

from lib import tokenizer
from lib.errors import UserError

FORMAT = "byhand-tokens-v1"
SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard: big enough to be few, small enough to copy
VAL_PERCENT = 5  # share of files (or of a single file's tokens) held out for validation
TEST_DIRS = ("test", "tests", "idle_test")


# --- the embedded corpus ----------------------------------------------------------------------


def is_stdlib_test_file(rel_path: str) -> bool:
    parts = rel_path.replace(os.sep, "/").split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_")


def stdlib_files(tests: bool = False) -> list:
    """The stdlib's .py files (relative paths, sorted): its code, or with tests=True its test files."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed third-party packages and bytecode are not "the standard library".
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                if is_stdlib_test_file(rel) == tests:
                    found.append(rel)
    return sorted(found)


def is_val_file(rel_path: str) -> bool:
    # Hash the path, not the position in a listing: adding one file never moves the others.
    h = int(hashlib.sha1(rel_path.replace(os.sep, "/").encode()).hexdigest()[:8], 16)
    return h % 100 < VAL_PERCENT


# --- preparation: text -> shards ---------------------------------------------------------------


def default_cache_dir() -> str:
    return os.environ.get("BYHAND_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "byhand"))


def _list_source(source: str):
    """(name, root, [relative file paths]) for the stdlib corpora, a text file or a directory."""
    if source in ("stdlib", "stdlib-tests"):
        return source, sysconfig.get_paths()["stdlib"], stdlib_files(tests=source == "stdlib-tests")
    if not os.path.exists(source):
        raise UserError(f"data path {source!r} does not exist; pass a text file, a directory of text files or a prepared shard directory")
    if os.path.isfile(source):
        return os.path.basename(source), os.path.dirname(os.path.abspath(source)), [os.path.basename(source)]
    files = []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.relpath(os.path.join(dirpath, f), source) for f in filenames if not f.startswith(".")]
    return os.path.basename(os.path.normpath(source)), source, sorted(files)


def _read_text(path: str, skip_undecodable: bool) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if skip_undecodable:
            return ""
        raise UserError(
            f"{path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8 or remove it from the data directory"
        ) from None


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def prepare(source: str, cache_dir: str = None, log=print) -> str:
    """Tokenise `source` into a cached shard directory and return its path.

    source: "stdlib", "stdlib-tests", a text file, a directory of text files, or a directory that
    already holds shards (returned as it is, after a check). The cache key covers every file's path,
    size and modification time, so editing the data re-tokenises it and nothing else does.
    """
    if os.path.isdir(source) and is_prepared(source):
        load_meta(source)
        return source
    name, root, files = _list_source(source)
    if not files:
        raise UserError(f"data directory {source!r} holds no files; put .txt (or any UTF-8 text) files in it")
    key = hashlib.sha1(FORMAT.encode())
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        key.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    out = os.path.join(cache_dir or default_cache_dir(), "data", f"{name}-{key.hexdigest()[:12]}")
    if is_prepared(out):
        return out

    log(f"preparing {name}: tokenising {len(files)} file(s) with the GPT-2 BPE -> {out}")
    single_file = len(files) == 1
    texts = {"train": [], "val": []}
    for rel in files:
        # The stdlib ships a few deliberately mis-encoded files (codec tests); skip those, but a
        # user's file that is not UTF-8 is an error they should hear about.
        text = _read_text(os.path.join(root, rel), skip_undecodable=source in ("stdlib", "stdlib-tests"))
        if text.strip():
            texts["val" if (not single_file and is_val_file(rel)) else "train"].append(text)
    enc = tokenizer.get_encoding()
    ids = {}
    for split, docs in texts.items():
        # Every document starts with <|endoftext|>, as in GPT-2's training data, so the model
        # learns where one file ends and the next begins.
        batches = enc.encode_ordinary_batch(docs, num_threads=max(1, min(8, os.cpu_count() or 1)))
        ids[split] = np.fromiter(
            (t for doc in batches for t in [tokenizer.EOT, *doc]), dtype=np.uint16
        ) if batches else np.zeros(0, dtype=np.uint16)
    if single_file or len(ids["val"]) == 0:
        # One file (or too few files to hold some out): the last VAL_PERCENT of its tokens is val.
        all_ids = np.concatenate([ids["train"], ids["val"]])
        cut = len(all_ids) - max(1, len(all_ids) * VAL_PERCENT // 100)
        ids = {"train": all_ids[:cut], "val": all_ids[cut:]}
    if len(ids["train"]) == 0 or not any(t.strip() for docs in texts.values() for t in docs):
        raise UserError(f"data {source!r} is empty: no text found in {len(files)} file(s); add some text")

    # A private temporary name: machines sharing the cache may prepare the same data at once.
    tmp = f"{out}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    meta = {"format": FORMAT, "tokenizer": "gpt2", "vocab_size": tokenizer.VOCAB_SIZE, "dtype": "uint16",
            "source": source if source in ("stdlib", "stdlib-tests") else os.path.abspath(source), "files": len(files)}
    for split, arr in ids.items():
        meta[f"{split}_tokens"] = int(len(arr))
        meta[f"{split}_shards"] = []
        for i in range(0, max(1, len(arr)), SHARD_TOKENS):
            fname = f"{split}_{i // SHARD_TOKENS:04d}.bin"
            arr[i : i + SHARD_TOKENS].tofile(os.path.join(tmp, fname))
            meta[f"{split}_shards"].append(fname)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    # A directory rename is atomic: a half-written cache can never look prepared. If another
    # process finished first, its copy is identical; keep it and drop ours.
    if os.path.isdir(out) and not is_prepared(out):
        shutil.rmtree(out)  # the remains of a copy that never finished
    try:
        os.rename(tmp, out)
    except OSError:
        if not is_prepared(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    log(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    return out


def load_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{meta_path} cannot be read ({e}); delete the directory and prepare the data again") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}; prepare the data again")
    if meta.get("vocab_size") != tokenizer.VOCAB_SIZE or meta.get("dtype") != "uint16":
        raise UserError(f"{meta_path} was made with vocab {meta.get('vocab_size')} / {meta.get('dtype')}, expected GPT-2's 50257 / uint16")
    return meta


# --- batches ------------------------------------------------------------------------------------


def keep_global_batch(batch_size: int, saved_accum: int, saved_world: int, world: int, given_accum: int = None,
                      log=print) -> int:
    """The --grad-accum that continues a run saved by saved_world processes on `world` processes.

    A step's windows depend only on (seed, step) and on how many there are (see Batches), so a run saved
    by N processes continues exactly on M as long as the global batch, batch_size x grad_accum x world,
    stays the same. given_accum: a --grad-accum the user gave, checked; else it is recomputed, and the
    change is said. What cannot keep the global batch is refused in one line, never run silently.
    """
    saved_global = batch_size * saved_accum * saved_world
    per_accum = batch_size * world
    if given_accum is not None:
        if given_accum * per_accum != saved_global:
            raise UserError(
                f"--resume: --grad-accum {given_accum} on {world} process(es) makes {given_accum * per_accum} "
                f"sequences per step, the saved run took {saved_global} ({batch_size} x {saved_accum} x "
                f"{saved_world} processes); drop --grad-accum to keep the run's global batch"
            )
        return given_accum
    if saved_global % per_accum:
        raise UserError(
            f"--resume: the saved run took {saved_global} sequences per step ({batch_size} x {saved_accum} "
            f"accumulation x {saved_world} processes), which {world} process(es) of --batch-size {batch_size} "
            f"cannot share evenly; resume on a number of processes that divides {saved_global // batch_size}"
        )
    accum = saved_global // per_accum
    if world != saved_world:
        log(f"--resume: saved by {saved_world} process(es) with --grad-accum {saved_accum}, continued by {world} "
            f"with --grad-accum {accum}: the same {saved_global} sequences per step")
    return accum


class TokenSplit:
    """One split ("train" or "val") of a shard directory, as memory-mapped uint16 arrays."""

    def __init__(self, path: str, split: str):
        meta = load_meta(path)
        self.name = f"{path}:{split}"
        self.shards = []
        for fname in meta[f"{split}_shards"]:
            fpath = os.path.join(path, fname)
            if not os.path.isfile(fpath):
                raise UserError(f"shard {fpath} listed in meta.json is missing; prepare the data again")
            arr = np.memmap(fpath, dtype=np.uint16, mode="r") if os.path.getsize(fpath) else np.zeros(0, np.uint16)
            self.shards.append(arr)
        self.num_tokens = sum(len(s) for s in self.shards)
        if self.num_tokens != meta[f"{split}_tokens"]:
            raise UserError(f"{path}: {split} shards hold {self.num_tokens} tokens, meta.json says {meta[f'{split}_tokens']}; prepare again")


class Batches:
    """Random [batch, block+1] windows of a split; the windows of a step depend only on (seed, step).

    One optimizer step consumes grad_accum * world_size * batch_size windows. They are drawn together
    and rank r takes micro-batch m's slice [m, r], so N ranks see the same windows, in total, as one
    process with N times the accumulation.
    """

    def __init__(self, split: TokenSplit, batch_size, block_size, grad_accum=1, rank=0, world_size=1, seed=0):
        self.split, self.B, self.T = split, batch_size, block_size
        self.accum, self.rank, self.world, self.seed = grad_accum, rank, world_size, seed
        # Windows may start at any position that leaves T+1 tokens inside the same shard.
        self.starts_per_shard = [max(0, len(s) - block_size) for s in split.shards]
        if sum(self.starts_per_shard) == 0:
            raise UserError(
                f"{split.name} holds {split.num_tokens} tokens, fewer than block_size+1 = {block_size + 1}; "
                f"use a smaller --block-size or more data"
            )
        self.cum = np.cumsum([0] + self.starts_per_shard)

    def get(self, step: int, micro_step: int = 0, device="cpu"):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        n = self.accum * self.world * self.B
        picks = torch.randint(int(self.cum[-1]), (n,), generator=g).view(self.accum, self.world, self.B)
        picks = picks[micro_step, self.rank].numpy()
        shard_idx = np.searchsorted(self.cum, picks, side="right") - 1
        rows = [self.split.shards[s][p - self.cum[s] : p - self.cum[s] + self.T + 1] for s, p in zip(shard_idx, picks)]
        xy = torch.from_numpy(np.stack(rows).astype(np.int64))
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if torch.device(device).type == "cuda":
            # Pinned memory lets the copy overlap with compute.
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)
