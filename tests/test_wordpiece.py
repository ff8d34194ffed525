"""WordPiece by hand: hand-checked cases, transformers' goldens, files, and the vocabulary learner."""

import json
import os
import random
import shutil
import sysconfig

import pytest
import torch

from lib import wordpiece
from lib.errors import UserError
from lib.wordpiece import WordPiece, learn_vocab, load_wordpiece

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
SMALL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "hello", "world", ",", "!", ".",
         "naive", "cafe", "中", "文", "a", "##a", "x", "##y", "##z", "xy", "'", "s", "it"]


@pytest.fixture
def small():
    return WordPiece(SMALL)


@pytest.mark.parametrize("text, want", [
    ("unaffable", ["un", "##aff", "##able"]),                 # greedy longest match, ## continuation
    ("UnAffable", ["un", "##aff", "##able"]),                 # lowercased first
    ("Naïve CAFÉ", ["naive", "cafe"]),                        # accents stripped (NFD, drop Mn)
    ("nai\u0308ve cafe\u0301", ["naive", "cafe"]),            # already decomposed
    ("hello,world!", ["hello", ",", "world", "!"]),           # punctuation split off
    ("hello\u4e2d\u6587world", ["hello", "中", "文", "world"]),  # CJK ideographs spaced out
    ("hel\x00lo \x07world\ufffd", ["hello", "world"]),        # control characters and U+FFFD dropped
    ("hello\u00a0\tworld\n", ["hello", "world"]),              # every kind of space splits
    ("xyz", ["xy", "##z"]),                                    # the longest first piece wins, not the finest split
    ("unknown", ["[UNK]"]),                                    # no full cover -> the whole word is [UNK]
    ("hello[MASK]world [CLS]", ["hello", "[MASK]", "world", "[CLS]"]),  # special tokens kept whole
    ("hello [mask]", ["hello", "[UNK]", "[UNK]", "[UNK]"]),   # lowercase is not the special token
    ("a" * 100, ["a"] + ["##a"] * 99),
    ("a" * 101, ["[UNK]"]),                                    # over 100 characters -> [UNK]
    ("", []),
])
def test_hand_checked_tokens(small, text, want):
    assert small.tokenize(text) == want


def test_settings_change_the_basic_pass():
    cased = WordPiece(SMALL + ["Hello", "Café"], do_lower_case=False)
    assert cased.tokenize("Hello Café hello") == ["Hello", "Café", "hello"]
    assert WordPiece(SMALL + ["Cafe"], do_lower_case=False, strip_accents=True).tokenize("Café") == ["Cafe"]
    assert WordPiece(SMALL + ["café"], strip_accents=False).tokenize("CAFÉ") == ["café"]
    no_cjk = WordPiece(SMALL + ["中文"], tokenize_chinese_chars=False)
    assert no_cjk.tokenize("中文") == ["中文"]


def test_encode_truncate_pad_decode(small):
    ids = small.encode("hello, world!")
    assert ids == [2, 8, 10, 9, 11, 3]
    assert small.encode("hello, world!", max_length=4) == [2, 8, 10, 3]  # [SEP] survives truncation
    assert small.encode("hello, world!", add_special_tokens=False) == [8, 10, 9, 11]
    ids, mask = small.batch(["hello world", "unaffable hello, world!", ""], max_length=6)
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == [[2, 8, 9, 3, 0, 0], [2, 5, 6, 7, 8, 3], [2, 3, 0, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    ids, mask = small.batch(["hello", "hello world"], max_length=16, pad_to=8)
    assert ids.shape == mask.shape == (2, 8) and mask.sum().item() == 7
    assert small.decode([2, 5, 6, 7, 10, 9, 11, 3]) == "[CLS] unaffable, world! [SEP]"
    assert small.decode([2, 5, 6, 7, 3], skip_special_tokens=True) == "unaffable"
    assert (small.cls_id, small.sep_id, small.pad_id, small.unk_id, small.mask_id, small.vocab_size) == (2, 3, 0, 1, 4, len(SMALL))


def test_truncation_is_a_prefix_at_every_length(small):
    """Cutting early (encode stops reading words once max_length is spent) gives the same ids as
    encoding everything and cutting after: [CLS], a prefix of the pieces, [SEP]."""
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(["[MASK]", "un", "affable", " ", "é", "##", "xyz", ",", "中", "hello "]) for _ in range(rng.randint(0, 25)))
        full = small.encode(text)
        for n in range(2, len(full) + 2):
            assert small.encode(text, max_length=n) == (full[: n - 1] + [small.sep_id] if n < len(full) else full)
            assert small.encode(text, max_length=n, add_special_tokens=False) == full[1:-1][:n]


# ---- against transformers (tests/fixtures/make_bert_golden.py wrote these) ----

@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(FIXTURES, "wordpiece_golden.json"), encoding="utf-8") as f:
        return json.load(f)


def real_tokenizer(tmp_path, settings):
    shutil.copy(os.path.join(FIXTURES, "bert_uncased_vocab.txt"), tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    return load_wordpiece(str(tmp_path))


@pytest.mark.parametrize("setting", ["uncased", "cased", "cased_strip_accents", "uncased_keep_accents_no_cjk", "no_basic_tokenize"])
def test_matches_transformers_bert_tokenizer(golden, tmp_path, setting):
    """381 strings (hard cases and seeded random mixes of scripts, accents, controls, emoji) under
    five settings, over the real bert-base-uncased vocabulary: ids equal BertTokenizerLegacy's."""
    want = golden["settings"][setting]
    tok = real_tokenizer(tmp_path, want["kwargs"])
    texts = golden["texts"]
    wrong = [t for t, ids in zip(texts, want["ids"]) if tok.encode(t) != ids]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, e.g. {wrong[:3]}"
    if setting == "uncased":
        assert [tok.tokenize(t) for t in texts] == want["tokens"]
        assert sum("[UNK]" in t for t in want["tokens"]) > 20 and sum(any(p.startswith("##") for p in t) for t in want["tokens"]) > 100
        # The Rust tokenizer lowercases Σ without looking at its neighbours; Python (and we) write ς at a word's end.
        assert want["rust_differs"] and all("Σ" in texts[i] for i in want["rust_differs"])


def test_batch_and_decode_match_transformers(golden, tmp_path):
    tok = real_tokenizer(tmp_path, {})
    b = golden["batch"]
    ids, mask = tok.batch(b["texts"], max_length=b["max_length"])
    assert ids.tolist() == b["input_ids"] and mask.tolist() == b["attention_mask"]
    for d in golden["decode"]:
        assert tok.decode(d["ids"]) == d["text"]
        assert tok.decode(d["ids"], skip_special_tokens=True) == d["skip"]


# ---- files ----

def test_save_and_load_round_trip(tmp_path):
    tok = WordPiece(SMALL + ["Hello"], do_lower_case=False, model_max_length=128)
    tok.save(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "BertTokenizer" and cfg["do_lower_case"] is False and cfg["model_max_length"] == 128
    assert cfg["cls_token"] == "[CLS]" and cfg["mask_token"] == "[MASK]"
    assert (tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines() == SMALL + ["Hello"]
    again = load_wordpiece(str(tmp_path))
    assert again.vocab == tok.vocab and again.do_lower_case is False and again.model_max_length == 128
    assert again.encode("Hello hello, world") == tok.encode("Hello hello, world")
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_special_tokens_from_either_file(tmp_path):
    vocab = ["<pad>", "<unk>", "<s>", "</s>", "<mask>", "hi"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    names = {"pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "<s>", "sep_token": "</s>"}
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(names))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"mask_token": {"content": "<mask>", "lstrip": True}}))
    tok = load_wordpiece(str(tmp_path))
    assert tok.encode("hi <mask> yo") == [2, 5, 4, 1, 3]
    assert (tok.pad_id, tok.mask_id) == (0, 4)


def test_added_tokens_cut_out_everywhere_never_split_only_alone(tmp_path):
    """As transformers' BertTokenizerLegacy does (checked by hand against it): an added special token
    is found even inside a word; a never_split word escapes lowercasing only standing alone."""
    (tmp_path / "vocab.txt").write_text("\n".join(SMALL + ["<ent>", "keepme", "KEEPME"]) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"additional_special_tokens": ["<ent>"], "never_split": ["KEEPME"], "do_lower_case": True}))
    tok = load_wordpiece(str(tmp_path))
    want = ["hello", "<ent>", "world", "KEEPME", "keepme", ".", "hello", "[MASK]"]
    assert tok.tokenize("hello<ent>world KEEPME KEEPME. hello [MASK]") == want
    tok.save(str(tmp_path / "again"))
    again = load_wordpiece(str(tmp_path / "again"))
    assert again.tokenize("hello<ent>world KEEPME KEEPME. hello [MASK]") == want
    assert again.decode(again.encode("hello<ent>"), skip_special_tokens=True) == "hello"


def test_file_errors(tmp_path):
    with pytest.raises(UserError, match=r"vocab\.txt is missing"):
        load_wordpiece(str(tmp_path))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(UserError, match=r"vocab\.txt has no '\[UNK\]'"):
        load_wordpiece(str(tmp_path))
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match=r"tokenizer_config\.json is not valid JSON"):
        load_wordpiece(str(tmp_path))


# ---- learning a vocabulary ----

def test_learn_vocab_merges_by_hand():
    """The Hugging Face course's example, merges worked out by hand: pair counts over
    hug x10, pug x5, pun x12, bun x4, hugs x5; ties go to the older pair (smaller ids)."""
    texts = ["hug " * 10 + "pug " * 5 + "pun " * 12 + "bun " * 4 + "hugs " * 5]
    tok = learn_vocab(texts, vocab_size=100, min_frequency=1)
    alphabet = ["b", "g", "h", "n", "p", "s", "u", "##g", "##n", "##s", "##u"]
    merges = ["##ug", "##un", "hug", "pun", "pug", "hugs", "bun"]
    assert tok.ids_to_tokens == list(wordpiece.SPECIALS.values()) + alphabet + merges
    assert learn_vocab(texts, vocab_size=100, min_frequency=5).ids_to_tokens[-1] == "hugs"  # bun occurs 4 times
    assert learn_vocab(texts, vocab_size=19, min_frequency=1).vocab_size == 19
    assert tok.tokenize("hugs bug") == ["hugs", "b", "##ug"]
    pieces = texts[0].split()
    random.Random(0).shuffle(pieces)  # the order of the texts does not change the vocabulary
    assert learn_vocab([" ".join(pieces[i:i + 3]) for i in range(0, len(pieces), 3)], 100, min_frequency=1).vocab == tok.vocab


@pytest.fixture(scope="module")
def stdlib_texts():
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in ("argparse.py", "textwrap.py", "difflib.py"):  # about 220 KB of code and docstrings
        with open(os.path.join(root, name), encoding="utf-8") as f:
            texts.append(f.read())
    return texts


def test_learn_vocab_covers_its_training_text(stdlib_texts):
    tok = learn_vocab(stdlib_texts, vocab_size=1500)
    assert tok.vocab_size == 1500 and tok.ids_to_tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    tokens = [t for text in stdlib_texts for t in tok.tokenize(text)]
    words = sum(len(tok.basic_tokenize(text)) for text in stdlib_texts)
    assert tokens.count("[UNK]") <= len(tokens) * 0.001
    assert len(tokens) < 1.35 * words  # most words are one or two pieces
    assert {"def", "return", "self"} <= set(tok.vocab)
