"""Text in, token shards out, batches drawn from them.

Used by train.py, train_fsdp.py, finetune_lora.py and finetune_qlora.py (onefile_train.py has its
own copy). The one idea: tokenise once, store the ids as a flat uint16 array on disk (GPT-2's 50,257
ids fit in 16 bits), and from then on a batch is just random windows of that array read through a
memory map. The window positions for step k are a pure function of (seed, k), so a resumed run or a
run on N ranks reads exactly the windows an uninterrupted single-process run would have read.

Preparation streams (chunks cut at line boundaries, tokenised in batches, appended to the shards on disk), so
memory does not grow with the corpus. nanoGPT's train.bin/val.bin and llm.c's *_train_*.bin shards are read
in place. keep_global_batch lets --resume continue on another number of processes with the same windows.

The embedded default corpus is the running Python's own standard library (found via sysconfig),
split into train/val by file. The stdlib's test files are left out of it and form a second domain
("stdlib-tests") for the fine-tuning scripts.
"""

import hashlib
import itertools
import json
import os
import shutil
import socket
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from lib import metrics, tokenizer
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
        raise UserError(f"data path {source!r} does not exist; pass a text file, a directory of text files or a "
                        "prepared shard directory")
    if os.path.isfile(source):
        return os.path.basename(source), os.path.dirname(os.path.abspath(source)), [os.path.basename(source)]
    files = []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.relpath(os.path.join(dirpath, f), source) for f in filenames if not f.startswith(".")]
    return os.path.basename(os.path.normpath(source)), source, sorted(files)


CHUNK_BYTES = 1 << 20  # a big file is read (and tokenised) about 1 MiB at a time, cut at a line boundary
BATCH_CHUNKS = 8  # chunks tokenised together, on a thread per core (tiktoken releases the GIL): memory ~ 8 chunks
PROGRESS_SECONDS = 10  # at most one progress line this often


def _cut(buf: bytes) -> int:
    """Where to end a chunk of buf: at the last line break whose preceding character is not whitespace, so
    that GPT-2's pre-tokeniser (lib/tokenizer.GPT2_PATTERN) breaks there too: a piece holding the break
    starts at the break, and BPE never merges across pieces, so the two chunks tokenise to exactly the
    tokens of the whole text. 0 when buf holds no such place (one long line, or only whitespace)."""
    p = len(buf)
    while True:
        p = max(buf.rfind(b"\n", 0, p), buf.rfind(b"\r", 0, p))
        if p <= 0:
            return 0
        before = buf[max(0, p - 4):p].decode("utf-8", errors="ignore")[-1:]  # the whole character before p
        if before and not before.isspace():
            return p


def _chunks(path: str, skip_undecodable: bool):
    """(byte count, text) pieces of a file, each about CHUNK_BYTES, cut by _cut. A file that is not UTF-8
    is one line naming it and the offset of its first bad byte (or, for the stdlib's deliberately
    mis-encoded codec tests, skipped whole: those files are small, so they are checked whole first)."""
    if skip_undecodable:
        with open(path, "rb") as f:
            try:
                f.read().decode("utf-8")
            except UnicodeDecodeError:
                return
    with open(path, "rb") as f:
        offset, buf = 0, b""
        while True:
            block = f.read(CHUNK_BYTES)
            buf += block
            cut = _cut(buf) if block else len(buf)
            if cut == 0 and block:
                continue  # no line break to cut at yet: read on
            piece, buf = buf[:cut], buf[cut:]
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it to "
                                f"UTF-8 or remove it from the data directory") from None
            if text:
                yield cut, text
            offset += cut
            if not block:
                return


class _ShardWriter:
    """Appends uint16 tokens to <split>_0000.bin, <split>_0001.bin, ... of SHARD_TOKENS each, on disk."""

    def __init__(self, folder: str, split: str):
        self.folder, self.split, self.tokens, self.shards, self.file = folder, split, 0, [], None

    def write(self, ids: np.ndarray):
        while len(ids):
            if self.file is None or self.tokens % SHARD_TOKENS == 0 and self.tokens // SHARD_TOKENS == len(self.shards):
                self._open_next()
            room = SHARD_TOKENS - (self.tokens % SHARD_TOKENS)
            self.file.write(ids[:room].astype(np.uint16).tobytes())
            self.tokens += min(room, len(ids))
            ids = ids[room:]

    def _open_next(self):
        if self.file:
            self.file.close()
        self.shards.append(f"{self.split}_{len(self.shards):04d}.bin")
        self.file = open(os.path.join(self.folder, self.shards[-1]), "wb")

    def close(self):
        if self.file is None:  # a split with no tokens still has its (empty) first shard
            self._open_next()
        self.file.close()


def _move_tail_to_val(train: _ShardWriter, val: _ShardWriter):
    """One file (or too few files to hold some out): the last VAL_PERCENT of the train tokens become val.
    The tail is copied from the train shards on disk, a block at a time, and the train shards truncated."""
    n = train.tokens
    cut = n - max(1, n * VAL_PERCENT // 100)
    for i, name in enumerate(train.shards):
        lo, hi = i * SHARD_TOKENS, min(n, (i + 1) * SHARD_TOKENS)
        if hi <= cut:
            continue
        path = os.path.join(train.folder, name)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        for start in range(max(cut, lo) - lo, hi - lo, 16 << 20):
            val.write(np.array(tokens[start:min(hi - lo, start + (16 << 20))]))
        del tokens
        os.truncate(path, 2 * max(0, cut - lo))
    train.shards = train.shards[:max(1, -(-cut // SHARD_TOKENS))]
    for name in os.listdir(train.folder):
        if name.startswith("train_") and name not in train.shards:
            os.remove(os.path.join(train.folder, name))
    train.tokens = cut


def _malloc_trim():
    """A function that hands the heap's free pages back to the OS (glibc's malloc_trim), or one that does nothing.

    Each batch allocates and frees buffers of about a MiB (the chunks' text, their tokens) on 8 threads. After
    the first are freed, glibc raises its mmap threshold and serves the later ones from its per-thread heaps,
    whose free pages it keeps: measured, the peak then creeps up with the corpus (1.35x at 1,600 MB against
    50 MB). Trimming after every batch keeps it flat."""
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
        return lambda: trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return lambda: None


def _progress(log, done, total, started, unit="MB"):
    seconds = max(1e-9, time.perf_counter() - started)
    rate = done / seconds
    eta = (total - done) / rate if rate > 0 else 0
    log(f"preparing: {done / 1e6:,.1f} of {total / 1e6:,.1f} {unit} ({100 * done / max(1, total):.0f}%), "
        f"{rate / 1e6:.2f} {unit}/s, ETA {metrics.format_seconds(eta)}")


def is_prepared(path: str) -> bool:
    """A directory of tokens ready to read: this project's shards, or nanoGPT's or llm.c's .bin files."""
    return token_format(path) is not None


def prepare(source: str, cache_dir: str = None, log=print) -> str:
    """Tokenise `source` into a cached shard directory and return its path.

    source: "stdlib", "stdlib-tests", a text file, a directory of text files, or a directory that
    already holds tokens (this project's shards, nanoGPT's train.bin/val.bin or llm.c's *_train_*.bin:
    returned as it is, after a check). The cache key covers every file's path, size and modification
    time, so editing the data re-tokenises it and nothing else does.

    Text streams through in bounded memory: files (a big one in chunks cut at line boundaries) are read
    BATCH_CHUNKS at a time, tokenised by tiktoken on that many threads, and appended to the shards on
    disk; the tokens are exactly those of tokenising each whole file.
    """
    if os.path.isdir(source) and is_prepared(source):
        read_splits(source)  # checked now: a bad header is one line before any work
        return source
    name, root, files = _list_source(source)
    if not files:
        raise UserError(f"data directory {source!r} holds no files; put .txt (or any UTF-8 text) files in it")
    if os.path.isdir(source):
        binary = [f for f in files if f.endswith(".bin")]
        if binary:
            raise UserError(f"{os.path.join(source, binary[0])}: a .bin file in a directory that is not a token "
                            f"directory; expected text files, or nanoGPT's train.bin and val.bin, or llm.c's "
                            f"*_train_*.bin and *_val_*.bin shards (header magic {LLMC_MAGIC}), or this "
                            f"project's meta.json shards")
    key = hashlib.sha1(FORMAT.encode())
    sizes = {}
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        sizes[rel] = st.st_size
        key.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    out = os.path.join(cache_dir or default_cache_dir(), "data", f"{name}-{key.hexdigest()[:12]}")
    if is_prepared(out):
        return out

    total = sum(sizes.values())
    log(f"preparing {name}: tokenising {len(files)} file(s), {total / 1e6:,.1f} MB, with the GPT-2 BPE -> {out}")
    # A private temporary name: machines sharing the cache may prepare the same data at once.
    tmp = f"{out}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    writers = {split: _ShardWriter(tmp, split) for split in ("train", "val")}
    single_file = len(files) == 1
    enc = tokenizer.get_encoding()
    skip = source in ("stdlib", "stdlib-tests")  # the stdlib ships a few mis-encoded codec tests; skip those
    started, last_report, done = time.perf_counter(), time.perf_counter(), 0
    pool = ThreadPoolExecutor(max(1, min(BATCH_CHUNKS, os.cpu_count() or 1)))
    release = _malloc_trim()

    def pieces():
        """(split, first chunk of its file?, byte count, text) for every non-blank file, in order."""
        for rel in files:
            split = "val" if (not single_file and is_val_file(rel)) else "train"
            first = True
            for nbytes, text in _chunks(os.path.join(root, rel), skip):
                # Blank text is never a cut (a cut follows a non-space): a blank first chunk is a blank file.
                if first and not text.strip():
                    break
                yield split, first, nbytes, text
                first = False

    try:
        batch = []
        for item in itertools.chain(pieces(), [None]):
            if item is not None:
                batch.append(item)
            if batch and (item is None or len(batch) == BATCH_CHUNKS):
                encoded = pool.map(lambda t: enc.encode_to_numpy(t[3], disallowed_special=()), batch)
                for (split, first, nbytes, text), ids in zip(batch, encoded):
                    if first:  # every document starts with <|endoftext|>, as in GPT-2's training data
                        writers[split].write(np.array([tokenizer.EOT], dtype=np.uint16))
                    writers[split].write(ids)
                    done += nbytes
                batch = []
                release()
                if time.perf_counter() - last_report > PROGRESS_SECONDS:
                    _progress(log, done, total, started)
                    last_report = time.perf_counter()
    finally:
        pool.shutdown()
        for w in writers.values():
            if w.file:
                w.file.close()
    if writers["train"].tokens + writers["val"].tokens == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"data {source!r} is empty: no text found in {len(files)} file(s); add some text")
    if single_file or writers["val"].tokens == 0:
        _move_tail_to_val(writers["train"], writers["val"])
    for w in writers.values():
        w.close()
    meta = {"format": FORMAT, "tokenizer": "gpt2", "vocab_size": tokenizer.VOCAB_SIZE, "dtype": "uint16",
            "source": source if skip else os.path.abspath(source), "files": len(files)}
    for split, w in writers.items():
        meta[f"{split}_tokens"] = int(w.tokens)
        meta[f"{split}_shards"] = w.shards
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
    seconds = time.perf_counter() - started
    log(f"prepared {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens from {total / 1e6:,.1f} MB "
        f"in {seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.2f} MB/s)")
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
        raise UserError(f"{meta_path} was made with vocab {meta.get('vocab_size')} / {meta.get('dtype')}, expected "
                        "GPT-2's 50257 / uint16")
    return meta


# --- the community's token files: nanoGPT's and llm.c's, read in place ------------------------------
# nanoGPT (data/openwebtext/prepare.py): train.bin and val.bin, raw uint16 GPT-2 ids, nothing else.
# llm.c and modded-nanogpt (dev/data/fineweb.py): *_train_*.bin / *_val_*.bin shards, each a header of 256
# int32 (magic 20240520, version 1, token count) and then the uint16 ids. Both are memory-mapped as they are:
# no copy, no cache.
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4


def _llmc_shards(path: str, split: str) -> list:
    return sorted(f for f in os.listdir(path) if f.endswith(".bin") and f"_{split}_" in f)


def token_format(path: str):
    """'byhand', 'nanogpt' or 'llm.c' for a directory of tokens, else None."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "meta.json")):
        return "byhand"
    if os.path.isfile(os.path.join(path, "train.bin")) or os.path.isfile(os.path.join(path, "val.bin")):
        return "nanogpt"
    if _llmc_shards(path, "train") or _llmc_shards(path, "val"):
        return "llm.c"
    return None


def _check_ids(tokens: np.ndarray, fpath: str):
    """A cheap look at the first million ids: a file of another tokenizer or dtype shows itself there."""
    head = np.asarray(tokens[: 1 << 20])
    if len(head) and int(head.max()) >= tokenizer.VOCAB_SIZE:
        raise UserError(f"{fpath} holds token id {int(head.max())}, past GPT-2's {tokenizer.VOCAB_SIZE}; expected "
                        f"uint16 GPT-2 ids")


def _read_nanogpt(path: str, split: str) -> list:
    fpath = os.path.join(path, f"{split}.bin")
    if not os.path.isfile(fpath):
        raise UserError(f"{path} has nanoGPT's {'val' if split == 'train' else 'train'}.bin but no {split}.bin; "
                        f"expected both train.bin and val.bin (raw uint16 GPT-2 tokens)")
    size = os.path.getsize(fpath)
    if size % 2:
        raise UserError(f"{fpath} is {size:,} bytes, not a whole number of uint16 tokens; expected nanoGPT's raw "
                        f"uint16 GPT-2 tokens")
    tokens = np.memmap(fpath, dtype=np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    _check_ids(tokens, fpath)
    return [tokens]


def _read_llmc(path: str, split: str) -> list:
    names = _llmc_shards(path, split)
    if not names:
        raise UserError(f"{path} has llm.c shards but no *_{split}_*.bin; expected both *_train_*.bin and "
                        f"*_val_*.bin")
    shards = []
    for name in names:
        fpath = os.path.join(path, name)
        size = os.path.getsize(fpath)
        header = np.fromfile(fpath, dtype="<i4", count=256) if size >= LLMC_HEADER_BYTES else np.zeros(0, "<i4")
        if len(header) < 256 or header[0] != LLMC_MAGIC:
            raise UserError(f"{fpath}: no llm.c header (expected 256 int32 starting with magic {LLMC_MAGIC}, found "
                            f"{int(header[0]) if len(header) else 'a file of ' + str(size) + ' bytes'}); expected "
                            f"llm.c's GPT-2 token shards")
        if header[1] != LLMC_VERSION:
            raise UserError(f"{fpath}: llm.c version {int(header[1])}, expected {LLMC_VERSION} (uint16 GPT-2 "
                            f"tokens; no other version holds ids the GPT-2 scripts can read)")
        count = int(header[2])
        if size != LLMC_HEADER_BYTES + 2 * count:
            raise UserError(f"{fpath}: the header says {count:,} tokens, so {LLMC_HEADER_BYTES + 2 * count:,} bytes, "
                            f"the file has {size:,}; it is truncated or not an llm.c shard")
        tokens = np.memmap(fpath, dtype=np.uint16, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,)) if count \
            else np.zeros(0, np.uint16)
        _check_ids(tokens, fpath)
        shards.append(tokens)
    return shards


def _read_byhand(path: str, split: str) -> list:
    meta = load_meta(path)
    shards = []
    for fname in meta[f"{split}_shards"]:
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            raise UserError(f"shard {fpath} listed in meta.json is missing; prepare the data again")
        shards.append(np.memmap(fpath, dtype=np.uint16, mode="r") if os.path.getsize(fpath) else np.zeros(0, np.uint16))
    if sum(len(s) for s in shards) != meta[f"{split}_tokens"]:
        raise UserError(f"{path}: {split} shards hold {sum(len(s) for s in shards)} tokens, meta.json says "
                        f"{meta[f'{split}_tokens']}; prepare again")
    return shards


READERS = {"byhand": _read_byhand, "nanogpt": _read_nanogpt, "llm.c": _read_llmc}


def read_splits(path: str, splits=("train", "val")) -> dict:
    """{"train": [uint16 arrays], "val": [...]} of a token directory, checked; one line when it is none."""
    fmt = token_format(path)
    if fmt is None:
        raise UserError(f"{path} is not a token directory; expected this project's meta.json shards, nanoGPT's "
                        f"train.bin and val.bin, or llm.c's *_train_*.bin and *_val_*.bin")
    return {split: READERS[fmt](path, split) for split in splits}


def describe(path: str) -> str:
    """One line: how many tokens each split of a token directory holds, and in which format."""
    splits = read_splits(path)
    counts = {k: sum(len(s) for s in v) for k, v in splits.items()}
    return (f"data: {counts['train']:,} train tokens ({len(splits['train'])} file(s)), {counts['val']:,} val tokens "
            f"({len(splits['val'])}), {token_format(path)} format, {path}")


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
    """One split ("train" or "val") of a token directory (any of the three formats), as memory-mapped uint16
    arrays."""

    def __init__(self, path: str, split: str):
        self.name = f"{path}:{split}"
        self.shards = read_splits(path, (split,))[split]
        self.num_tokens = sum(len(s) for s in self.shards)


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


# --- preparing without training -----------------------------------------------------------------------
def main(argv=None):
    """python -m lib.data SOURCE [--cache-dir DIR]: tokenise once, print the shard directory (progress on stderr),
    e.g. on a login node before a multi-machine launch; pass the printed path as --data."""
    import argparse
    import sys

    from lib.errors import report_and_exit

    p = argparse.ArgumentParser(prog="python -m lib.data", description=main.__doc__.split(":")[1].strip())
    p.add_argument("source", help="a text file, a directory of text files, 'stdlib', or a token directory to check")
    p.add_argument("--cache-dir", default=default_cache_dir(), help="where prepared shards are kept")
    args = p.parse_args(argv)
    try:
        path = prepare(args.source, args.cache_dir, log=lambda *a: print(*a, file=sys.stderr, flush=True))
        print(describe(path), file=sys.stderr)
    except UserError as e:
        report_and_exit(e)
    print(path)
    return path


if __name__ == "__main__":
    main()
