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
    four = torch.cat([data.Batches(split, 2, 8, grad_accum=1, rank=r,
                                   world_size=4, seed=1).get(5, 0)[0] for r in range(4)])
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


# --- streaming preparation: chunks cut at line boundaries, the same tokens as the whole text --------------
def whole_file_tokens(texts):
    """What preparing used to do, all in memory: each file encoded whole, after <|endoftext|>."""
    enc = tokenizer.get_encoding()
    return np.array([t for text in texts for t in [tokenizer.EOT, *enc.encode_ordinary(text)]], dtype=np.uint16)


def test_a_big_file_in_small_chunks_gives_the_tokens_of_the_whole_file(tmp_path, monkeypatch):
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    # Real text with indentation, blank lines, trailing spaces, CRLF and non-ASCII: every place a cut could
    # change GPT-2's pre-tokenisation ("\n    " and "\n\n" are single pieces).
    text = open(os.path.join(stdlib, "json", "decoder.py"), encoding="utf-8").read()
    text += "trailing   \n\n\n   indented after blanks\r\nwindows line\r\n  café ünïcödé\u00a0\n\u3000x\n" * 20
    f = tmp_path / "big.txt"
    f.write_bytes(text.encode("utf-8"))
    monkeypatch.setattr(data, "CHUNK_BYTES", 97)  # hundreds of chunks
    monkeypatch.setattr(data, "BATCH_CHUNKS", 3)
    monkeypatch.setattr(data, "SHARD_TOKENS", 1000)  # several shards, the val tail spanning two of them
    chunks = [t for _, t in data._chunks(str(f), False)]
    assert len(chunks) > 50 and "".join(chunks) == text
    for a in chunks[:-1]:  # each cut is just before a line break that follows a non-space character
        assert not a[-1].isspace()
    out = data.prepare(str(f), log=lambda *a: None)
    splits = data.read_splits(out)
    got = np.concatenate([*splits["train"], *splits["val"]])
    expected = whole_file_tokens([text])
    assert np.array_equal(got, expected)
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["val_tokens"] == max(1, len(expected) * data.VAL_PERCENT // 100)
    assert len(meta["train_shards"]) == -(-meta["train_tokens"] // 1000)
    assert sorted(os.listdir(out)) == sorted(["meta.json", *meta["train_shards"], *meta["val_shards"]])


def test_a_directory_streams_to_the_same_tokens_as_tokenising_each_file(tmp_path, text_dir, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(data, "PROGRESS_SECONDS", 0)  # a progress line after every batch
    said = []
    out = data.prepare(text_dir, str(tmp_path / "cache"), log=said.append)  # a fresh cache: prepared here
    files = sorted(os.listdir(text_dir))
    for split in ("train", "val"):
        texts = [open(os.path.join(text_dir, n), encoding="utf-8").read() for n in files
                 if data.is_val_file(n) == (split == "val")]
        assert np.array_equal(np.concatenate(data.read_splits(out)[split]), whole_file_tokens(texts)), split
    assert any(line.startswith("preparing: ") and "MB/s, ETA" in line for line in said)
    assert said[-1].startswith("prepared ") and "MB/s" in said[-1]


def test_bad_utf8_deep_inside_a_big_file_names_the_file_and_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_BYTES", 64)
    f = tmp_path / "mostly.txt"
    f.write_bytes(b"fine line\n" * 100 + b"caf\xe9\n" + b"more\n")
    with pytest.raises(UserError, match=r"mostly.txt is not UTF-8 text \(bad byte at offset 1003\)"):
        data.prepare(str(f), log=lambda *a: None)
    assert not [p for p in os.listdir(os.path.join(data.default_cache_dir(), "data"))
                if "mostly" in p and "tmp" not in p]


# --- nanoGPT's and llm.c's token files, read in place ---------------------------------------------------
def write_llmc(path, tokens, magic=20240520, version=1, count=None):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def test_nanogpt_and_llmc_token_files_are_read_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 50257, 5000, dtype=np.uint16), rng.integers(0, 50257, 700, dtype=np.uint16)
    nano = tmp_path / "nano"
    nano.mkdir()
    train.tofile(nano / "train.bin")
    val.tofile(nano / "val.bin")
    assert data.token_format(str(nano)) == "nanogpt" and data.is_prepared(str(nano))
    assert data.prepare(str(nano)) == str(nano)  # no copy, no cache
    split = data.TokenSplit(str(nano), "train")
    assert isinstance(split.shards[0], np.memmap) and np.array_equal(split.shards[0], train)
    assert "5,000 train tokens" in data.describe(str(nano)) and "nanogpt" in data.describe(str(nano))

    llmc = tmp_path / "fineweb10B"
    llmc.mkdir()
    write_llmc(llmc / "fineweb_val_000000.bin", val)
    write_llmc(llmc / "fineweb_train_000001.bin", train[:3000])
    write_llmc(llmc / "fineweb_train_000002.bin", train[3000:])
    assert data.token_format(str(llmc)) == "llm.c"
    split = data.TokenSplit(str(llmc), "train")
    assert [len(s) for s in split.shards] == [3000, 2000] and isinstance(split.shards[0], np.memmap)
    assert np.array_equal(np.concatenate(split.shards), train)
    assert np.array_equal(data.TokenSplit(str(llmc), "val").shards[0], val)
    # A batch window is a window of one shard, read through the memory map.
    x, y = data.Batches(split, 4, 16, seed=3).get(0)
    for row in x.numpy():
        assert any(np.array_equal(s[p:p + 16], row) for s in split.shards for p in np.flatnonzero(s[:-16] == row[0]))


def test_foreign_token_files_are_one_line_naming_what_was_expected(tmp_path):
    def refused(d, pattern):
        with pytest.raises(UserError, match=pattern):
            data.prepare(str(d))  # a token directory is checked whole, both splits

    ok = np.arange(100, dtype=np.uint16)
    for name, kwargs, pattern in [
        ("magic", dict(magic=20240801), "no llm.c header .*magic 20240520, found 20240801"),
        ("version", dict(version=2), "llm.c version 2, expected 1"),
        ("count", dict(count=150), "the header says 150 tokens, so 1,324 bytes, the file has 1,224"),
    ]:
        d = tmp_path / name
        d.mkdir()
        write_llmc(d / "x_train_000001.bin", ok, **kwargs)
        write_llmc(d / "x_val_000000.bin", ok)
        refused(d, pattern)
    d = tmp_path / "trainonly"
    d.mkdir()
    write_llmc(d / "x_train_000001.bin", ok)
    refused(d, r"no \*_val_\*.bin")
    d = tmp_path / "nanoodd"
    d.mkdir()
    (d / "train.bin").write_bytes(b"\x00" * 101)
    (d / "val.bin").write_bytes(b"\x00" * 100)
    refused(d, "not a whole number of uint16 tokens")
    d = tmp_path / "nanonoval"
    d.mkdir()
    ok.tofile(d / "train.bin")
    refused(d, r"no val.bin; expected both train.bin and val.bin")
    d = tmp_path / "uint32"
    d.mkdir()
    np.full(100, 60000, dtype=np.uint16).tofile(d / "train.bin")
    ok.tofile(d / "val.bin")
    refused(d, "token id 60000, past GPT-2's 50257")
    d = tmp_path / "other"
    d.mkdir()
    ok.tofile(d / "tokens.bin")
    refused(d, r"tokens.bin: a .bin file in a directory that is not a token directory; expected text files, or "
               r"nanoGPT's train.bin and val.bin, or llm.c's")


def test_train_py_trains_on_nanogpt_and_llmc_files_as_on_its_own_shards(tmp_path, text_dir, capsys):
    import train
    from tests.conftest import TINY, step_losses

    ours = data.prepare(text_dir, log=lambda *a: None)
    train_ids, val_ids = (np.fromfile(os.path.join(ours, f"{s}_0000.bin"), dtype=np.uint16) for s in ("train", "val"))
    nano, llmc = tmp_path / "nano", tmp_path / "llmc"
    nano.mkdir(), llmc.mkdir()
    train_ids.tofile(nano / "train.bin"), val_ids.tofile(nano / "val.bin")
    write_llmc(llmc / "corpus_train_000001.bin", train_ids), write_llmc(llmc / "corpus_val_000000.bin", val_ids)
    losses = {}
    for name, d in [("ours", text_dir), ("nanogpt", nano), ("llm.c", llmc)]:
        train.main([*TINY, "--steps", "2", "--eval-interval", "100", "--eval-batches", "1", "--data", str(d),
                    "--out-dir", str(tmp_path / name)])
        printed = capsys.readouterr().out
        assert f"data: {len(train_ids):,} train tokens (1 file(s)), {len(val_ids):,} val tokens" in printed
        losses[name] = step_losses(tmp_path / name)
    assert losses["nanogpt"] == losses["ours"] == losses["llm.c"]  # the same windows of the same tokens


def test_the_data_page_shows_the_committed_preparation_bench():
    """docs/pretraining_data.md's table is rendered from bench/results/prepare.json, which shows flat memory."""
    from docs import render

    page = os.path.join(render.ROOT, "docs", "pretraining_data.md")
    text = open(page, encoding="utf-8").read()
    assert [source for _, _, source in render.blocks(text)] == ["bench.prepare.render bench/results/prepare.json"]
    assert render.render_page(text)[1] == [], "run python docs/render.py"
    report = json.load(open(os.path.join(render.ROOT, "bench", "results", "prepare.json")))
    assert report["checks"]["flat_memory"] and report["checks"]["same_tokens_as_in_memory"]
    assert {p["text_mb"] for p in report["points"]} == {50, 400, 1600}
    peak = {(p["impl"], p["text_mb"]): p.get("peak_rss") for p in report["points"]}
    assert peak["streaming", 400] < peak["in_memory", 400] / 10  # the in-memory way held the corpus many times over
