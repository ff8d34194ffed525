"""BERT's WordPiece tokenizer, by hand, from vocab.txt and tokenizer_config.json; and a vocabulary learner.

Used by train_splade_unified.py and train_splade_optimized.py. The one idea: BERT tokenizes in two
passes. A "basic" pass cleans the text and cuts it into words (drop control characters, put spaces
around CJK ideographs, lowercase and strip accents, split off every punctuation mark); then each
word is cut greedily into the longest pieces the vocabulary holds, left to right, pieces after the
first spelled with a leading "##". A word that cannot be covered, or is longer than 100
characters, becomes [UNK]. That is all of it: the output matches transformers' Python BertTokenizer
(BertTokenizerLegacy in transformers 5) id for id, and its Rust tokenizer except where that one
lowercases a word-final Σ to σ instead of ς (tests/test_wordpiece.py checks 381 strings x 5 settings
against goldens written by transformers).

learn_vocab() builds such a vocabulary from training text the way Hugging Face's WordPieceTrainer
does: start from single characters ("##x" for characters inside a word) and repeatedly merge the
most frequent adjacent pair, BPE-style, until the vocabulary has the requested size.
"""

import heapq
import json
import os
import re
import unicodedata
from collections import Counter

import torch

from lib.checkpoint import atomic_write, save_json
from lib.errors import UserError

SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
MAX_CHARS_PER_WORD = 100  # longer "words" (URLs, base64, minified code) become one [UNK]


# ---- the basic pass: character classes exactly as transformers' BasicTokenizer defines them ----

def _is_cjk(cp: int) -> bool:
    # The CJK Unified Ideographs blocks (not Hangul, Hiragana or Katakana, which are written with spaces).
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _is_punctuation(ch: str) -> bool:
    # All non-alphanumeric ASCII counts ("$", "+", "^", "`" are symbols to Unicode, punctuation to BERT).
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _clean_char(ch: str, space_cjk=True):
    """What the cleaning pass turns one character into: deleted (None), a space, spaced out, or itself."""
    cp = ord(ch)
    if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
        return " "
    if cp == 0 or cp == 0xFFFD or unicodedata.category(ch).startswith("C"):
        return None  # control and format characters (tab, newline and CR were whitespace above)
    if space_cjk and _is_cjk(cp):
        return f" {ch} "
    return ch


class _CharTable(dict):
    """A str.translate table filled on first sight of each character, so the per-character Python
    work is done once per distinct character rather than once per character of text."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def __missing__(self, cp):
        self[cp] = out = self.rule(chr(cp))
        return out


_CLEAN = _CharTable(_clean_char)
_CLEAN_NO_CJK = _CharTable(lambda ch: _clean_char(ch, space_cjk=False))
_SPLIT_PUNCT = _CharTable(lambda ch: f" {ch} " if _is_punctuation(ch) else ch)


def remove_accents(word: str) -> str:
    """NFD splits "é" into "e" + a combining accent (category Mn), which is then dropped."""
    return "".join(ch for ch in unicodedata.normalize("NFD", word) if unicodedata.category(ch) != "Mn")


# ---- the tokenizer ----

class WordPiece:
    """vocab: token -> id (vocab.txt line number). Build with load_wordpiece() or learn_vocab()."""

    def __init__(self, tokens: list, do_lower_case=True, strip_accents=None, tokenize_chinese_chars=True,
                 specials: dict = None, added_tokens=(), never_split=(), model_max_length=512,
                 clean_up_tokenization_spaces=True, do_basic_tokenize=True, where="vocab.txt"):
        self.ids_to_tokens = list(tokens)
        self.vocab = {tok: i for i, tok in enumerate(self.ids_to_tokens)}  # a repeated line keeps its last id, as in transformers
        self.vocab_size = len(self.ids_to_tokens)
        self.do_lower_case = bool(do_lower_case)
        # transformers: strip_accents=None means "do whatever lowercasing does".
        self.strip_accents = self.do_lower_case if strip_accents is None else bool(strip_accents)
        self._strip_accents_setting = strip_accents
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        self.do_basic_tokenize = bool(do_basic_tokenize)  # False: words are split on whitespace only, as they are
        self.model_max_length = int(model_max_length)
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.specials = {**SPECIALS, **(specials or {})}
        for name in ("unk_token", "cls_token", "sep_token", "pad_token"):
            if self.specials[name] not in self.vocab:
                raise UserError(f"{where} has no {self.specials[name]!r} ({name}); use the vocab.txt that came with the model")
        self.unk_id = self.vocab[self.specials["unk_token"]]
        self.cls_id = self.vocab[self.specials["cls_token"]]
        self.sep_id = self.vocab[self.specials["sep_token"]]
        self.pad_id = self.vocab[self.specials["pad_token"]]
        self.mask_id = self.vocab.get(self.specials["mask_token"])
        # Special (and added) tokens written in the text, even inside a word ("a[MASK]b"), are cut out
        # and kept whole before anything else, as transformers does; never_split words from the
        # config are only protected when they stand alone between spaces.
        self.added_tokens = {t for t in (*self.specials.values(), *added_tokens) if t in self.vocab}
        self._never_split_setting = sorted(set(never_split))
        self.never_split = set(never_split) | self.added_tokens
        whole = sorted(self.added_tokens, key=lambda t: (-len(t), t))
        self._special_re = re.compile("(" + "|".join(map(re.escape, whole)) + ")") if whole else None
        self._cache = {}

    # -- text -> tokens --
    def _clean(self, text: str) -> str:
        """Drop control characters, turn every space into " ", space out CJK ideographs."""
        text = text.translate(_CLEAN if self.tokenize_chinese_chars else _CLEAN_NO_CJK)
        # transformers' BasicTokenizer composes the text (NFC) before splitting it into words.
        return text if text.isascii() else unicodedata.normalize("NFC", text)

    def _split_word(self, word: str) -> list:
        """One space-separated chunk -> words: lowercase, strip accents, split off punctuation."""
        if word in self.never_split:
            return [word]
        if self.do_lower_case:
            word = word.lower()
        if self.strip_accents and not word.isascii():
            word = remove_accents(word)
        return word.translate(_SPLIT_PUNCT).split()

    def basic_tokenize(self, text: str) -> list:
        """The first pass: clean, space out CJK, lowercase / strip accents, split punctuation."""
        text = self._clean(text)
        if self._never_split_setting:  # words the config protects: look at each chunk alone
            return [w for chunk in text.split() for w in self._split_word(chunk)]
        # transformers does these chunk by chunk; on the whole text at once they give the same words
        # (spaces end a final-sigma context and a combining sequence), only faster.
        if self.do_lower_case:
            text = text.lower()
        if self.strip_accents and not text.isascii():
            text = remove_accents(text)
        return text.translate(_SPLIT_PUNCT).split()

    def wordpiece(self, word: str) -> list:
        """The second pass: greedy longest-match-first; [UNK] for the whole word if any part fails."""
        if len(word) > MAX_CHARS_PER_WORD:
            return [self.specials["unk_token"]]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:  # not even one character matched here
                return [self.specials["unk_token"]]
            pieces.append(piece)
            start = end
        return pieces

    def _word(self, word: str) -> tuple:
        """(pieces, ids) of one word, remembered: text repeats its words, so most cost one lookup."""
        hit = self._cache.get(word)
        if hit is None:
            pieces = [word] if word in self.never_split else self.wordpiece(word)
            hit = (pieces, [self.vocab.get(p, self.unk_id) for p in pieces])
            if len(self._cache) < 200_000:  # frequent words are met early; cap the memory
                self._cache[word] = hit
        return hit

    def _pieces(self, text: str, which: int, limit: int = None) -> list:
        """Pieces (which=0) or ids (which=1) of a text: special tokens cut out first, then both passes.
        With a limit, words past it are not looked at (a long document cut to 256 tokens)."""
        parts = self._special_re.split(text) if self._special_re else [text]
        out, cache = [], self._cache
        for i, part in enumerate(parts):
            if limit is not None and len(out) >= limit:
                break
            if i % 2:  # a special token found in the text
                out.append(part if which == 0 else self.vocab[part])
                continue
            words = self.basic_tokenize(part) if self.do_basic_tokenize else part.split()
            if limit is not None:
                words = words[: limit - len(out)]  # every word gives at least one piece
            for word in words:
                out += (cache.get(word) or self._word(word))[which]  # the lookup inlined: this loop is the hot path
        return out if limit is None else out[:limit]

    def tokenize(self, text: str) -> list:
        return self._pieces(text, 0)

    def convert_tokens_to_ids(self, tokens) -> list:
        return [self.vocab.get(t, self.unk_id) for t in tokens]

    def encode(self, text: str, add_special_tokens=True, max_length=None) -> list:
        """Token ids; [CLS] ... [SEP] around them, cut so the whole fits max_length (the [SEP] stays)."""
        if max_length is not None and add_special_tokens and max_length < 2:
            raise ValueError(f"max_length {max_length} leaves no room for [CLS] and [SEP]")
        limit = None if max_length is None else max_length - 2 * add_special_tokens
        ids = self._pieces(text, 1, limit)
        return [self.cls_id, *ids, self.sep_id] if add_special_tokens else ids

    def batch(self, texts, max_length: int, pad_to: int = None):
        """(input_ids, attention_mask), both LongTensor [B, T]: each text encoded and cut to max_length,
        padded with [PAD] to the longest in the batch (or to exactly pad_to, for fixed shapes)."""
        if pad_to is not None:
            max_length = min(max_length, pad_to)
        rows = [self.encode(t, max_length=max_length) for t in texts]
        width = pad_to if pad_to is not None else max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids, mask

    # -- ids -> text --
    def decode(self, ids, skip_special_tokens=False) -> str:
        """The pieces joined, "##" pieces glued to the piece before, as BertTokenizer.decode does."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        special = {self.vocab[t] for t in self.added_tokens}
        words, run = [], []
        for i in ids:
            tok = self.ids_to_tokens[i] if 0 <= i < self.vocab_size else self.specials["unk_token"]
            if i in special:
                if skip_special_tokens:
                    continue
                if run:
                    words.append(" ".join(run).replace(" ##", "").strip())
                    run = []
                words.append(tok)
            else:
                run.append(tok)
        if run:
            words.append(" ".join(run).replace(" ##", "").strip())
        text = " ".join(words)
        if self.clean_up_tokenization_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    # -- files --
    def save(self, out_dir: str):
        """vocab.txt (one token per line, line number = id), tokenizer_config.json and
        special_tokens_map.json, in the layout transformers' BertTokenizer reads."""
        text = "".join(tok + "\n" for tok in self.ids_to_tokens)

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)

        atomic_write(os.path.join(out_dir, "vocab.txt"), write)
        specials = dict(self.specials)
        extra = sorted(self.added_tokens - set(self.specials.values()))
        if extra:
            specials["additional_special_tokens"] = extra
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": self.do_lower_case, "do_basic_tokenize": self.do_basic_tokenize,
                  "strip_accents": self._strip_accents_setting, "tokenize_chinese_chars": self.tokenize_chinese_chars,
                  "model_max_length": self.model_max_length,
                  "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces, **specials}
        if self._never_split_setting:
            config["never_split"] = self._never_split_setting
        save_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        save_json(os.path.join(out_dir, "special_tokens_map.json"), specials)


def _token_text(value):
    """A special token in tokenizer_config.json is a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); restore it from the model's repository or delete it") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a JSON object; restore it from the model's repository")
    return obj


def load_wordpiece(model_dir: str) -> WordPiece:
    """A WordPiece from model_dir/vocab.txt, with the settings of tokenizer_config.json (and
    special_tokens_map.json) when present; transformers' defaults (lowercase, [UNK], ...) otherwise."""
    vocab_path = os.path.join(model_dir, "vocab.txt")
    if not os.path.isfile(vocab_path):
        raise UserError(f"{vocab_path} is missing; a BERT tokenizer needs the vocab.txt that came with the model "
                        f"(pass a directory or hub id that has one)")
    try:
        with open(vocab_path, encoding="utf-8") as f:
            tokens = [line[:-1] if line.endswith("\n") else line for line in f]
    except UnicodeDecodeError as e:
        raise UserError(f"{vocab_path} is not UTF-8 text ({e}); it is not a WordPiece vocabulary") from None
    tokens = [t[:-1] if t.endswith("\r") else t for t in tokens]  # written on Windows
    if not tokens:
        raise UserError(f"{vocab_path} is empty; use the vocab.txt that came with the model")
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    smap = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    specials = {}
    for name in SPECIALS:
        value = _token_text(config.get(name)) or _token_text(smap.get(name))
        if value:
            specials[name] = value
    added = []
    for source in (config, smap):
        added += [_token_text(t) for t in source.get("additional_special_tokens") or [] if _token_text(t)]
    added += [t["content"] for t in (config.get("added_tokens_decoder") or {}).values()
              if isinstance(t, dict) and isinstance(t.get("content"), str)]
    max_len = config.get("model_max_length", 512)
    if not isinstance(max_len, (int, float)) or max_len > 1e9:  # transformers writes 1e30 for "no limit"
        max_len = 512
    return WordPiece(
        tokens,
        do_lower_case=config.get("do_lower_case", True),
        strip_accents=config.get("strip_accents"),
        tokenize_chinese_chars=config.get("tokenize_chinese_chars", True),
        specials=specials,
        added_tokens=added,
        never_split=list(config.get("never_split") or []),
        model_max_length=int(max_len),
        clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", True),
        do_basic_tokenize=config.get("do_basic_tokenize", True),
        where=vocab_path,
    )


# ---- learning a vocabulary ----

def learn_vocab(texts, vocab_size=8192, lowercase=True, min_frequency=2) -> WordPiece:
    """Learn a WordPiece vocabulary from texts (an iterable of str).

    The vocabulary starts as the five special tokens, every character seen, and "##c" for every
    character seen inside a word. Then, over the unique words weighted by their counts, the most
    frequent adjacent pair of pieces is merged into a new piece ("t" + "##h" -> "th"; "##i" + "##n"
    -> "##in"), until vocab_size entries exist or no pair occurs min_frequency times. Ties go to
    the pair of older pieces (smaller ids), so the result is deterministic. Pair counts are updated
    only for the words that contain the merged pair, which keeps this fast enough for megabytes.
    The specials and the characters are always kept, so a tiny vocab_size can be exceeded.
    """
    if vocab_size < len(SPECIALS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the {len(SPECIALS)} special tokens")
    base = WordPiece(list(SPECIALS.values()), do_lower_case=lowercase)
    counts = Counter()
    for text in texts:
        counts.update(base.basic_tokenize(text))
    words = sorted(counts)  # fixed order: ids below do not depend on the order of the texts
    freq = [counts[w] for w in words]

    tokens = list(SPECIALS.values())
    tokens += sorted({ch for w in words for ch in w})
    tokens += sorted({"##" + ch for w in words for ch in w[1:]})
    ids = {t: i for i, t in enumerate(tokens)}
    splits = [[ids[w[0]]] + [ids["##" + ch] for ch in w[1:]] for w in words]

    pair_count = Counter()
    where = {}  # pair -> indices of the words that contain it
    for wi, sym in enumerate(splits):
        for pair in zip(sym, sym[1:]):
            pair_count[pair] += freq[wi]
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)

    while len(tokens) < vocab_size and heap:
        neg, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg:
            continue  # a stale entry; the pair's current count was pushed again when it changed
        if -neg < min_frequency:
            break
        new_tok = tokens[a] + tokens[b][2:]  # b is always a "##" piece: it never starts a word
        new_id = ids.get(new_tok)
        if new_id is None:
            new_id = ids[new_tok] = len(tokens)
            tokens.append(new_tok)
        changed = set()
        for wi in sorted(where.pop((a, b), ())):
            sym, f = splits[wi], freq[wi]
            for pair in zip(sym, sym[1:]):
                pair_count[pair] -= f
                changed.add(pair)
            merged, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    merged.append(new_id)
                    i += 2
                else:
                    merged.append(sym[i])
                    i += 1
            splits[wi] = merged
            old_pairs = set(zip(sym, sym[1:]))
            new_pairs = set(zip(merged, merged[1:]))
            for pair in zip(merged, merged[1:]):
                pair_count[pair] += f
                changed.add(pair)
            for pair in old_pairs - new_pairs:
                if pair in where:
                    where[pair].discard(wi)
            for pair in new_pairs:
                where.setdefault(pair, set()).add(wi)
        pair_count.pop((a, b), None)
        for pair in changed:
            c = pair_count.get(pair, 0)
            if c > 0 and pair != (a, b):
                heapq.heappush(heap, (-c, *pair))
            elif c <= 0:
                pair_count.pop(pair, None)
    return WordPiece(tokens, do_lower_case=lowercase)
