"""Data preparation (text -> uint16 shards) and the batch windows drawn from them."""

import json
import os

import numpy as np
import pytest
import torch

from lib import data, tokenizer
from lib.errors import UserError


def test_stdlib_split_rules():
    assert data.is_stdlib_test_file("test/test_os.py")
    assert data.is_stdlib_test_file("unittest/test/test_case.py")
    assert data.is_stdlib_test_file("idlelib/idle_test/htest.py")
    assert data.is_stdlib_test_file("ctypes/test_x.py")
    assert not data.is_stdlib_test_file("os.py")
    assert not data.is_stdlib_test_file("unittest/case.py")
    code, tests = data.stdlib_files(), data.stdlib_files(tests=True)
    assert "os.py" in code and not set(code) & set(tests)
    assert all(data.is_stdlib_test_file(f) for f in tests)
    # The split is by hash of the path: deterministic, and about VAL_PERCENT of the files.
    val = [f for f in code if data.is_val_file(f)]
    assert 0.01 < len(val) / len(code) < 0.10
    assert val == [f for f in data.stdlib_files() if data.is_val_file(f)]


def test_prepare_directory_tokens_match_the_tokenizer(tmp_path, isolated_cache):
    src = tmp_path / "docs"
    src.mkdir()
    texts = {f"f{i}.txt": f"document number {i}\n" * (i + 1) for i in range(60)}
    for name, text in texts.items():
        (src / name).write_text(text)
    out = data.prepare(str(src), log=lambda *a: None)
    meta = json.load(open(os.path.join(out, "meta.json")))
    train = np.fromfile(os.path.join(out, "train_0000.bin"), dtype=np.uint16)
    val = np.fromfile(os.path.join(out, "val_0000.bin"), dtype=np.uint16)
    # Every file lands in exactly one split, each preceded by <|endoftext|>.
    expected = {
        split: sum(len(tokenizer.encode(t)) + 1 for n, t in texts.items() if data.is_val_file(n) == (split == "val"))
        for split in ("train", "val")
    }
    assert (len(train), len(val)) == (expected["train"], expected["val"]) == (meta["train_tokens"], meta["val_tokens"])
    assert train[0] == tokenizer.EOT
    assert (train == tokenizer.EOT).sum() + (val == tokenizer.EOT).sum() == 60
    # Prepared once: the second call is a cache hit, the shard dir itself is accepted as --data.
    assert data.prepare(str(src), log=lambda *a: pytest.fail("re-tokenised")) == out
    assert data.prepare(out) == out
    # Changing a file changes the cache key.
    (src / "f0.txt").write_text("changed text, longer than before\n")
    assert data.prepare(str(src), log=lambda *a: None) != out


def test_single_file_holds_out_its_tail(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("word " * 2000)
    out = data.prepare(str(f), log=lambda *a: None)
    meta = json.load(open(os.path.join(out, "meta.json")))
    total = len(tokenizer.encode("word " * 2000)) + 1
    assert meta["train_tokens"] + meta["val_tokens"] == total
    assert meta["val_tokens"] == total * data.VAL_PERCENT // 100


def test_batches_are_windows_of_the_token_stream_and_deterministic(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text(" ".join(str(i) for i in range(3000)))
    out = data.prepare(str(f), log=lambda *a: None)
    split = data.TokenSplit(out, "train")
    stream = np.asarray(split.shards[0]).astype(np.int64)
    b = data.Batches(split, batch_size=4, block_size=16, seed=7)
    x, y = b.get(step=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # y is x shifted by one
    for row in x.numpy():  # every row is a contiguous window of the stream
        starts = np.flatnonzero(stream[: len(stream) - 16] == row[0])
        assert any((stream[s : s + 16] == row).all() for s in starts)
    assert torch.equal(b.get(3)[0], x) and not torch.equal(b.get(4)[0], x)


def test_ranks_and_accumulation_partition_the_same_global_batch(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text(" ".join(str(i) for i in range(3000)))
    split = data.TokenSplit(data.prepare(str(f), log=lambda *a: None), "train")
    # One process accumulating 4 micro-batches == 2 ranks accumulating 2 == 4 ranks with 1.
    one = torch.cat([data.Batches(split, 2, 8, grad_accum=4, seed=1).get(5, m)[0] for m in range(4)])
    two = torch.cat([data.Batches(split, 2, 8, grad_accum=2, rank=r, world_size=2, seed=1).get(5, m)[0]
                     for m in range(2) for r in range(2)])
    four = torch.cat([data.Batches(split, 2, 8, grad_accum=1, rank=r, world_size=4, seed=1).get(5, 0)[0] for r in range(4)])
    assert torch.equal(one, two) and torch.equal(one, four)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        data.prepare(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="holds no files"):
        data.prepare(str(empty))
    (empty / "blank.txt").write_text("   \n\n")
    with pytest.raises(UserError, match="empty"):
        data.prepare(str(empty), log=lambda *a: None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text \(bad byte at offset 3\)"):
        data.prepare(str(bad), log=lambda *a: None)
    small = tmp_path / "small.txt"
    small.write_text("just a few words here " * 3)
    split = data.TokenSplit(data.prepare(str(small), log=lambda *a: None), "train")
    with pytest.raises(UserError, match="fewer than block_size"):
        data.Batches(split, 2, 1024)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"format": data.FORMAT, "vocab_size": 32000, "dtype": "uint16"}))
    with pytest.raises(UserError, match="vocab 32000"):
        data.prepare(str(foreign))
