"""The GPT-2 byte-pair encoding, built offline from the ranks file shipped in data/.

Used by every GPT-2 script (train.py, train_fsdp.py, finetune_lora.py, finetune_qlora.py; onefile_train.py
has its own copy). The one idea: a BPE tokenizer is just a table of byte sequences and their merge
ranks plus a regex that splits text into words first; tiktoken does the merging fast, we only hand
it the table. The file is checked against the hash tiktoken itself checks, so a corrupted copy is
caught before it silently produces different token ids.
"""

import base64
import hashlib
import os

import tiktoken

RANKS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "gpt2.tiktoken")
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
EOT = 50256  # <|endoftext|>, the one special token; documents are joined with it
VOCAB_SIZE = 50257

# GPT-2's pre-tokenisation: contractions, runs of letters, of digits, of other symbols, and spaces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_cache = {}


def load_ranks(path: str = RANKS_PATH) -> dict:
    """Read 'base64-token rank' lines into {bytes: rank}, after checking the file's sha256."""
    with open(path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != RANKS_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {RANKS_SHA256}: the GPT-2 ranks file is corrupt")
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def get_encoding(path: str = RANKS_PATH) -> tiktoken.Encoding:
    """The GPT-2 encoding (same ids as tiktoken.get_encoding('gpt2')), built without the network."""
    if path not in _cache:
        _cache[path] = tiktoken.Encoding(
            name="gpt2-byhand",
            pat_str=GPT2_PATTERN,
            mergeable_ranks=load_ranks(path),
            special_tokens={"<|endoftext|>": EOT},
        )
    return _cache[path]


def encode(text: str) -> list:
    # Text that happens to contain "<|endoftext|>" is encoded as ordinary characters, not as EOT.
    return get_encoding().encode_ordinary(text)


def decode(ids) -> str:
    return get_encoding().decode(list(ids))
