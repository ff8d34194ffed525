"""The GPT-2 BPE built offline from data/gpt2.tiktoken."""

import hashlib
import shutil

import pytest

from lib import tokenizer


def test_known_ids():
    assert tokenizer.encode("Hello world") == [15496, 995]
    # " the" is one of the most frequent tokens; "<|endoftext|>" is the only special token.
    assert tokenizer.encode(" the") == [262]
    assert tokenizer.get_encoding().encode("<|endoftext|>", allowed_special="all") == [50256]
    assert tokenizer.get_encoding().n_vocab == tokenizer.VOCAB_SIZE == 50257


def test_round_trip_on_unicode_and_code():
    text = "def f(x):\n    return x ** 2  # ça marche, 日本語, emoji 🎉\n\n\t\r\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_endoftext_in_text_is_ordinary_characters():
    ids = tokenizer.encode("a <|endoftext|> b")
    assert 50256 not in ids
    assert tokenizer.decode(ids) == "a <|endoftext|> b"


def test_shipped_file_hash():
    with open(tokenizer.RANKS_PATH, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == tokenizer.RANKS_SHA256


def test_corrupt_ranks_file_is_refused(tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    shutil.copy(tokenizer.RANKS_PATH, bad)
    with open(bad, "ab") as f:
        f.write(b"QQ== 50257\n")
    with pytest.raises(ValueError, match="sha256"):
        tokenizer.load_ranks(str(bad))
