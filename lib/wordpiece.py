"""BERT's WordPiece tokenizer, by hand: read from tokenizer.json or vocab.txt, saved as both; and a vocabulary learner.

Used by train_splade_unified.py and train_splade_optimized.py (and lib/bert.check_model_dir). The one
idea: a tokenizer is a short pipeline, and tokenizer.json writes it down stage by stage:
  1. added tokens ([CLS], [MASK], ...) written in the text are cut out first and kept whole;
  2. the normalizer cleans the rest (BERT's: drop control characters, put spaces around CJK
     ideographs, strip accents, lowercase);
  3. the pre-tokenizer cuts it into words (BERT's: at spaces, and around every punctuation mark);
  4. the model cuts each word greedily into the longest pieces of the vocabulary, left to right,
     pieces after the first spelled with "##"; a word that cannot be covered, or is longer than
     max_input_chars_per_word (100), becomes [UNK];
  5. the post-processor wraps the ids: [CLS] ... [SEP].
A vocab.txt directory is the same pipeline, with BERT's settings from tokenizer_config.json.

Whose ids these are: the Hugging Face `tokenizers` library's, which transformers' BertTokenizer (and so
AutoTokenizer and sentence-transformers) runs. Two rules from there that surprise people:
- transformers' BertTokenizer takes only the vocabulary and the added tokens from tokenizer.json and
  rebuilds stages 2-5 from tokenizer_config.json (do_lower_case, strip_accents, ...; defaults when
  absent). load_tokenizer() does the same for BERT and DistilBERT directories, and says so in one line
  when tokenizer.json disagrees. A directory whose tokenizer_class is PreTrainedTokenizerFast is read
  as tokenizer.json says, stage by stage.
- transformers' old Python tokenizer (BertTokenizerLegacy) differs in a few corners: it lowercases a
  word-final "Σ" to "ς" (here and in tokenizers: "σ"), composes accents (NFC) first, deletes
  unassigned code points, honours never_split and do_basic_tokenize, and uses 0x2B820 where
  tokenizers starts a CJK block at 0x2B920.
tests/test_wordpiece.py checks all of this against goldens written by both libraries on real files.

learn_vocab() builds a vocabulary from training text the way Hugging Face's WordPieceTrainer does: start
from single characters ("##x" inside a word) and repeatedly merge the most frequent adjacent pair.
"""

import heapq
import itertools
import json
import os
import re
import unicodedata
from collections import Counter

import torch

from lib.checkpoint import atomic_write, save_json
from lib.errors import UserError

SPECIALS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
            "mask_token": "[MASK]"}
MAX_CHARS_PER_WORD = 100  # longer "words" (URLs, base64, minified code) become one [UNK]
BERT_CLASSES = {"BertTokenizer", "BertTokenizerFast", "DistilBertTokenizer", "DistilBertTokenizerFast"}
AS_FILE_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}  # transformers runs tokenizer.json as written


# ---- character classes, as the tokenizers library (Rust) defines them ----

# Unicode's White_Space, what Rust's char::is_whitespace tests. (Python's str.split() also cuts at \x1c-\x1f.)
WHITESPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
              "\u2028\u2029\u202f\u205f\u3000")


def _is_cjk(cp: int) -> bool:
    """The CJK Unified Ideographs blocks (not Hangul, Hiragana or Katakana, which are written with
    spaces). 0x2B920, not 0x2B820: the tokenizers library's table, which transformers follows."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2B73F
            or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
            or 0x2F800 <= cp <= 0x2FA1F)


def _is_punctuation(ch: str) -> bool:
    # All non-alphanumeric ASCII counts ("$", "+", "^", "`" are symbols to Unicode, punctuation to BERT).
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_control(ch: str) -> bool:
    """Control, format, private-use (Cc, Cf, Co): deleted by BERT's cleaning. Unassigned code points
    (Cn) are kept, as tokenizers keeps them; tab, newline and CR are whitespace instead."""
    return ch not in "\t\n\r" and unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs")


def _is_word_char(ch: str) -> bool:
    r"""The regex class \w of Rust's regex crate: letters, marks, decimal digits, connector punctuation,
    letter numbers, the two joiners, and the circled/squared Latin letters Unicode calls alphabetic."""
    cat = unicodedata.category(ch)
    if cat[0] in "LM" or cat in ("Nd", "Nl", "Pc"):
        return True
    cp = ord(ch)
    return cp in (0x200C, 0x200D) or 0x24B6 <= cp <= 0x24E9 or 0x1F130 <= cp <= 0x1F149 or 0x1F150 <= cp <= 0x1F189


class _CharTable(dict):
    """A str.translate table filled on first sight of each character, so the per-character Python
    work is done once per distinct character rather than once per character of text."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def __missing__(self, cp):
        self[cp] = out = self.rule(chr(cp))
        return out


def _clean_char(ch: str, space_cjk: bool, clean: bool):
    """BertNormalizer, one character: deleted (None), a space, spaced out (CJK), or itself."""
    cp = ord(ch)
    if clean:
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            return None
        if ch in WHITESPACE:
            return " "
    if space_cjk and _is_cjk(cp):
        return f" {ch} "
    return ch


_BERT_TABLES = {(cjk, clean): _CharTable(lambda ch, a=cjk, b=clean: _clean_char(ch, a, b))
                for cjk in (True, False) for clean in (True, False)}
_DROP_MN = _CharTable(lambda ch: None if unicodedata.category(ch) == "Mn" else ch)  # BertNormalizer's accents
_DROP_MARKS = _CharTable(lambda ch: None if unicodedata.category(ch)[0] == "M" else ch)  # the StripAccents normalizer
# BertPreTokenizer in one pass: every space becomes " ", every punctuation mark " p ", then split at " ".
_BERT_WORDS = _CharTable(lambda ch: " " if ch in WHITESPACE else f" {ch} " if _is_punctuation(ch) else ch)


def _lowercase(text: str) -> str:
    # Rust lowercases one character at a time; Python's lower() alone would give "ς" for a word-final "Σ".
    return text.replace("Σ", "σ").lower()


# ---- stage 2: normalizers, as tokenizer.json describes them ----

def _bert_settings(spec: dict) -> tuple:
    """A BertNormalizer's (clean_text, handle_chinese_chars, strip_accents, lowercase), defaults filled in."""
    lower = spec.get("lowercase", True)
    strip = lower if spec.get("strip_accents") is None else spec["strip_accents"]  # null: do what lowercasing does
    return spec.get("clean_text", True), spec.get("handle_chinese_chars", True), bool(strip), bool(lower)


def _bert_normalizer(spec: dict):
    clean, cjk, strip, lower = _bert_settings(spec)
    table = _BERT_TABLES[(cjk, clean)] if (cjk or clean) else None

    def normalize(text):
        if table is not None:
            text = text.translate(table)
        if strip and not text.isascii():
            # NFD splits "é" into "e" + a combining accent (category Mn), which is then dropped.
            text = unicodedata.normalize("NFD", text).translate(_DROP_MN)
        return _lowercase(text) if lower else text
    return normalize


def compile_normalizer(spec, where: str):
    """A tokenizer.json "normalizer" (a dict, or None) -> a function str -> str.
    UserError naming the component for a type this loader does not read."""
    if spec is None:
        return lambda text: text
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "BertNormalizer":
        return _bert_normalizer(spec)
    if kind == "Sequence":
        steps = [compile_normalizer(s, where) for s in spec.get("normalizers") or []]
        return lambda text: _chain(steps, text)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Lowercase":
        return _lowercase
    if kind == "StripAccents":  # drops every combining mark (Mn, Mc, Me); an NFD before it does the splitting
        return lambda text: text.translate(_DROP_MARKS)
    if kind == "Strip":
        left, right = spec.get("strip_left", True), spec.get("strip_right", True)

        def strip(text):
            text = text.lstrip(WHITESPACE) if left else text
            return text.rstrip(WHITESPACE) if right else text
        return strip
    if kind == "Replace":
        pattern, content = spec.get("pattern") or {}, spec.get("content", "")
        if "String" in pattern:
            return lambda text: text.replace(pattern["String"], content)
        if "Regex" in pattern:
            regex = re.compile(pattern["Regex"])
            return lambda text: regex.sub(content.replace("\\", "\\\\"), text)
    if kind == "Prepend":
        return lambda text: spec["prepend"] + text if text else text
    raise UserError(f"{where}: normalizer {kind or repr(spec)} is not supported (BertNormalizer, Sequence, NFC, NFD, "
                    "NFKC, NFKD, Lowercase, StripAccents, Strip, Replace, Prepend are); this is not a BERT-family "
                    "tokenizer")


def _chain(steps, text):
    for step in steps:
        text = step(text)
    return text


# ---- stage 3: pre-tokenizers ----

# The tokenizers library's Split behaviours, shared with lib/chat_tokenizer.py's byte-level BPE.
BEHAVIORS = ("Removed", "Isolated", "Contiguous", "MergedWithPrevious", "MergedWithNext")


def split_piece(piece: str, spans: list, behavior: str) -> list:
    """Cut `piece` by (start, end, is_match) spans that cover it, as the tokenizers library's Split does:
    Isolated keeps every span; Removed drops the matches; MergedWithPrevious / MergedWithNext glue each
    match to the span before / after it; Contiguous joins runs of neighbouring matches."""
    if behavior in ("Removed", "Isolated"):
        return [piece[s:e] for s, e, match in spans if e > s and not (match and behavior == "Removed")]
    backwards = behavior == "MergedWithNext"
    out, previous = [], False  # [start, end] of each new piece
    for s, e, match in reversed(spans) if backwards else spans:
        glue = match == previous if behavior == "Contiguous" else match and not previous
        if out and glue:
            out[-1][0 if backwards else 1] = s if backwards else e
        else:
            out.append([s, e])
        previous = match
    return [piece[s:e] for s, e in (reversed(out) if backwards else out) if e > s]


def char_spans(text: str, is_delimiter) -> list:
    """(start, end, is_match) spans of text: every character is_delimiter accepts is a match of its own."""
    spans, last = [], 0
    for i, ch in enumerate(text):
        if is_delimiter(ch):
            if i > last:
                spans.append((last, i, False))
            spans.append((i, i + 1, True))
            last = i + 1
    if last < len(text):
        spans.append((last, len(text), False))
    return spans


def _split(text: str, is_delimiter, behavior: str) -> list:
    """Cut text at every character is_delimiter accepts, as tokenizers' NormalizedString.split does."""
    return split_piece(text, char_spans(text, is_delimiter), behavior)


def _whitespace_words(text: str) -> list:
    r"""The Whitespace pre-tokenizer, the regex \w+|[^\w\s]+: runs of word characters, runs of other
    non-space characters; spaces dropped."""
    kind = lambda ch: 0 if ch in WHITESPACE else 1 if _is_word_char(ch) else 2  # noqa: E731
    return ["".join(run) for k, run in itertools.groupby(text, kind) if k]


def compile_pre_tokenizer(spec, where: str):
    """A tokenizer.json "pre_tokenizer" (a dict, or None) -> a function str -> list of words."""
    if spec is None:
        return lambda text: [text] if text else []
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "BertPreTokenizer":
        return lambda text: [w for w in text.translate(_BERT_WORDS).split(" ") if w]
    if kind == "WhitespaceSplit":
        return lambda text: [w for w in re.split(f"[{WHITESPACE}]+", text) if w]
    if kind == "Whitespace":
        return _whitespace_words
    if kind == "Punctuation" and spec.get("behavior", "Isolated") in BEHAVIORS:
        behavior = spec.get("behavior", "Isolated")
        return lambda text: _split(text, _is_punctuation, behavior)
    if kind == "Digits":
        behavior = "Isolated" if spec.get("individual_digits") else "Contiguous"
        return lambda text: _split(text, lambda ch: unicodedata.category(ch) in ("Nd", "Nl", "No"), behavior)
    if kind == "CharDelimiterSplit" and len(spec.get("delimiter") or "") == 1:
        return lambda text: _split(text, lambda ch: ch == spec["delimiter"], "Removed")
    if kind == "Sequence":
        steps = [compile_pre_tokenizer(s, where) for s in spec.get("pretokenizers") or []]

        def run(text):
            words = [text] if text else []
            for step in steps:
                words = [w for word in words for w in step(word)]
            return words
        return run
    raise UserError(f"{where}: pre_tokenizer {kind or repr(spec)} is not supported (BertPreTokenizer, Whitespace, "
                    f"WhitespaceSplit, Punctuation, Digits, CharDelimiterSplit, Sequence are); this is not a "
                    f"BERT-family WordPiece tokenizer")


# ---- stage 5: post-processors ----

def template_ids(spec, where: str) -> tuple:
    """A tokenizer.json "post_processor" -> (ids before the text, ids after it) for one sequence."""
    if spec is None:
        return [], []
    kind = spec.get("type") if isinstance(spec, dict) else None
    try:
        if kind in ("BertProcessing", "RobertaProcessing"):
            return [int(spec["cls"][1])], [int(spec["sep"][1])]
        if kind == "ByteLevel":
            return [], []
        if kind == "Sequence":
            before, after = [], []
            for step in spec.get("processors") or []:
                b, a = template_ids(step, where)
                before, after = b + before, after + a  # each processor wraps what the one before made
            return before, after
        if kind == "TemplateProcessing":
            items = spec["single"]
            seq = [i for i, item in enumerate(items) if "Sequence" in item]
            if len(seq) == 1:
                ids = [[int(x) for x in spec["special_tokens"][item["SpecialToken"]["id"]]["ids"]]
                       if "SpecialToken" in item else None for item in items]
                return sum(ids[:seq[0]], []), sum(ids[seq[0] + 1:], [])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise UserError(f"{where}: post_processor {kind} is malformed ({type(e).__name__}: {e}); restore "
                        f"tokenizer.json from the model's repository") from None
    raise UserError(f"{where}: post_processor {kind or repr(spec)} is not supported (TemplateProcessing with one "
                    f"sequence, BertProcessing, RobertaProcessing, Sequence are)")


def bert_template(cls_token: str, cls_id: int, sep_token: str, sep_id: int) -> dict:
    """[CLS] $A [SEP] as transformers writes it into tokenizer.json."""
    special = lambda tok, type_id=0: {"SpecialToken": {"id": tok, "type_id": type_id}}  # noqa: E731
    return {"type": "TemplateProcessing",
            "single": [special(cls_token), {"Sequence": {"id": "A", "type_id": 0}}, special(sep_token)],
            "pair": [special(cls_token), {"Sequence": {"id": "A", "type_id": 0}}, special(sep_token),
                     {"Sequence": {"id": "B", "type_id": 1}}, special(sep_token, 1)],
            "special_tokens": {cls_token: {"id": cls_token, "ids": [cls_id], "tokens": [cls_token]},
                               sep_token: {"id": sep_token, "ids": [sep_id], "tokens": [sep_token]}}}


def bert_normalizer(do_lower_case=True, strip_accents=None, tokenize_chinese_chars=True) -> dict:
    return {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": bool(tokenize_chinese_chars),
            "strip_accents": strip_accents, "lowercase": bool(do_lower_case)}


# ---- the tokenizer ----

class WordPiece:
    """Build with load_tokenizer() or learn_vocab().

    tokens: the vocabulary in id order (vocab.txt's lines; None for an id no token has). The
    pipeline defaults to BERT's, from do_lower_case / strip_accents / tokenize_chinese_chars; pass
    normalizer / pre_tokenizer / post_processor (tokenizer.json's dicts) to read any other.
    added_tokens: strings (special, matched as written) or tokenizer.json's added-token dicts."""

    BERT = "bert"  # the default of normalizer / pre_tokenizer / post_processor: BERT's own

    def __init__(self, tokens: list, do_lower_case=True, strip_accents=None, tokenize_chinese_chars=True,
                 specials: dict = None, added_tokens=(), model_max_length=512, clean_up_tokenization_spaces=True,
                 normalizer=BERT, pre_tokenizer=BERT, post_processor=BERT, prefix="##",
                 max_input_chars_per_word=MAX_CHARS_PER_WORD, where="vocab.txt"):
        self.where = where
        self.ids_to_tokens = list(tokens)
        # a repeated line keeps its last id
        self.vocab = {tok: i for i, tok in enumerate(self.ids_to_tokens) if tok is not None}
        self.specials = {**SPECIALS, **(specials or {})}
        self.prefix, self.max_chars = prefix, int(max_input_chars_per_word)
        self.model_max_length = int(model_max_length)
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
        self.unk_id = self._require("unk_token")
        self.model_size = len(self.ids_to_tokens)  # the WordPiece model's own ids; added tokens may come after
        # The special tokens are added tokens too (kept whole wherever they appear), unless listed with other flags.
        self._add_tokens([*added_tokens, *(t for t in self.specials.values() if t in self.vocab)])
        self.pad_id = self._require("pad_token")
        self.cls_id, self.sep_id, self.mask_id = (self.vocab.get(self.specials[n])
                                                  for n in ("cls_token", "sep_token", "mask_token"))

        # The pipeline, kept as tokenizer.json's dicts (save() writes them back) and compiled to functions.
        if normalizer == self.BERT:
            normalizer = bert_normalizer(do_lower_case, strip_accents, tokenize_chinese_chars)
        self.normalizer = normalizer
        self.pre_tokenizer = {"type": "BertPreTokenizer"} if pre_tokenizer == self.BERT else pre_tokenizer
        if post_processor == self.BERT:
            self._require("cls_token"), self._require("sep_token")
            post_processor = bert_template(self.specials["cls_token"], self.cls_id,
                                           self.specials["sep_token"], self.sep_id)
        self.post_processor = post_processor
        self.normalize = compile_normalizer(self.normalizer, where)
        self.pre_tokenize = compile_pre_tokenizer(self.pre_tokenizer, where)
        self.before_ids, self.after_ids = template_ids(self.post_processor, where)
        bad = [i for i in self.before_ids + self.after_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UserError(f"{where}: the post_processor adds id {bad[0]}, outside the vocabulary of "
                            f"{self.vocab_size}")
        self._raw_matcher, self._normalized_matcher = self._added_matcher(False), self._added_matcher(True)
        self._cache = {}

    def _require(self, name: str) -> int:
        if self.specials[name] not in self.vocab:
            raise UserError(f"{self.where} has no {self.specials[name]!r} ({name}); use the tokenizer files that came "
                            f"with the model")
        return self.vocab[self.specials[name]]

    def _add_tokens(self, added_tokens):
        """Added tokens are found in the text before anything else and kept whole. normalized=False
        ones (the specials) are matched in the raw text, the others in the normalized text;
        lstrip/rstrip swallow the spaces beside them; single_word ones only match a whole word."""
        self.added = {}  # content -> its tokenizer.json dict, with the id it has here
        for t in added_tokens:
            t = {"content": t, "special": True, "normalized": False} if isinstance(t, str) else dict(t)
            content = t.get("content")
            if not isinstance(content, str) or not content or content in self.added:
                continue
            t.setdefault("normalized", not t.get("special", False))
            if content in self.vocab:
                t["id"] = self.vocab[content]
            elif (not isinstance(t.get("id"), int)
                  or t["id"] < len(self.ids_to_tokens) and self.ids_to_tokens[t["id"]] is not None):
                t["id"] = len(self.ids_to_tokens)  # a new token: the next free id, as the tokenizers library gives it
            while len(self.ids_to_tokens) <= t["id"]:
                self.ids_to_tokens.append(None)
            self.ids_to_tokens[t["id"]] = content
            self.vocab[content] = t["id"]
            self.added[content] = {k: t.get(k, False)
                                   for k in ("id", "content", "single_word", "lstrip", "rstrip",
                                             "normalized", "special")}
        self.special_ids = {t["id"] for t in self.added.values() if t["special"]}

    def _added_matcher(self, normalized: bool):
        """(regex, text -> token) for the added tokens matched in the raw (or the normalized) text.
        Alternatives longest first, so at each position the longest token wins (leftmost-longest)."""
        by_text = {(self.normalize(c) if normalized else c): t for c, t in self.added.items()
                   if t["normalized"] == normalized}
        by_text.pop("", None)
        if not by_text:
            return None, {}
        return re.compile("|".join(map(re.escape, sorted(by_text, key=lambda c: (-len(c), c))))), by_text

    @property
    def vocab_size(self) -> int:
        return len(self.ids_to_tokens)

    # -- text -> tokens --
    def _split_added(self, text: str, normalized: bool) -> list:
        """text -> a list of str (text between added tokens) and int (an added token's id)."""
        regex, by_text = self._normalized_matcher if normalized else self._raw_matcher
        if regex is None:
            return [text]
        out, done = [], 0
        for m in regex.finditer(text):
            start, stop, t = m.start(), m.end(), by_text[m.group()]
            if t["single_word"] and ((start > 0 and _is_word_char(text[start - 1])) or
                                     (stop < len(text) and _is_word_char(text[stop]))):
                continue
            if t["lstrip"]:
                start = max(len(text[:start].rstrip(WHITESPACE)), done)
            if t["rstrip"]:
                stop = len(text) - len(text[stop:].lstrip(WHITESPACE))
            if done < start:
                out.append(text[done:start])
            out.append(t["id"])
            done = stop
        if done < len(text):
            out.append(text[done:])
        return out

    def basic_tokenize(self, text: str) -> list:
        """Stages 2 and 3 (no added tokens): the words the model will cut into pieces."""
        return self.pre_tokenize(self.normalize(text))

    def wordpiece(self, word: str) -> list:
        """Stage 4: greedy longest-match-first; [UNK] for the whole word if any part fails."""
        if len(word) > self.max_chars:
            return [self.specials["unk_token"]]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
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
            pieces = self.wordpiece(word)
            hit = (pieces, [self.vocab.get(p, self.unk_id) for p in pieces])
            if len(self._cache) < 200_000:  # frequent words are met early; cap the memory
                self._cache[word] = hit
        return hit

    def _pieces(self, text: str, which: int, limit: int = None) -> list:
        """Pieces (which=0) or ids (which=1) of a text, stages 1-4. With a limit, words past it are
        not looked at (a long document cut to 256 tokens)."""
        out, cache = [], self._cache
        for part in self._split_added(text, normalized=False):
            if limit is not None and len(out) >= limit:
                break
            if isinstance(part, int):
                out.append(self.ids_to_tokens[part] if which == 0 else part)
                continue
            for piece in self._split_added(self.normalize(part), normalized=True):
                if isinstance(piece, int):
                    out.append(self.ids_to_tokens[piece] if which == 0 else piece)
                    continue
                words = self.pre_tokenize(piece)
                if limit is not None:
                    words = words[: limit - len(out)]  # every word gives at least one piece
                for word in words:
                    out += (cache.get(word) or self._word(word))[which]  # the lookup inlined: the hot path
        return out if limit is None else out[:limit]

    def tokenize(self, text: str) -> list:
        return self._pieces(text, 0)

    def convert_tokens_to_ids(self, tokens) -> list:
        return [self.vocab.get(t, self.unk_id) for t in tokens]

    def encode(self, text: str, add_special_tokens=True, max_length=None) -> list:
        """Token ids, wrapped by the post-processor ([CLS] ... [SEP]) and cut so the whole fits
        max_length (the closing [SEP] stays)."""
        extra = len(self.before_ids) + len(self.after_ids) if add_special_tokens else 0
        if max_length is not None and max_length < extra:
            raise ValueError(f"max_length {max_length} leaves no room for the {extra} special tokens")
        ids = self._pieces(text, 1, None if max_length is None else max_length - extra)
        return [*self.before_ids, *ids, *self.after_ids] if add_special_tokens else ids

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
        """tokenizers' WordPiece decoder, then transformers' clean-up: a "##" piece joins the piece
        before it, every other piece gets a space; " ," -> "," and the like."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        tokens = [self.ids_to_tokens[i] if 0 <= i < self.vocab_size and self.ids_to_tokens[i] is not None
                  else self.specials["unk_token"] for i in ids if not (skip_special_tokens and i in self.special_ids)]
        out = []
        for i, tok in enumerate(tokens):
            if i:
                tok = tok[len(self.prefix):] if tok.startswith(self.prefix) else " " + tok
            for a, b in _DECODER_CLEANUP:
                tok = tok.replace(a, b)
            out.append(tok)
        text = "".join(out)
        if self.clean_up_tokenization_spaces:
            for a, b in _DECODER_CLEANUP:
                if a != " do not":
                    text = text.replace(a, b)
        return text

    # -- files --
    def is_bert_standard(self) -> bool:
        """True when transformers' BertTokenizer, built from tokenizer_config.json alone, gives these
        ids: BERT's normalizer (cleaning on), BERT's pre-tokenizer, [CLS] $A [SEP], "##", 100."""
        n = self.normalizer or {}
        return (n.get("type") == "BertNormalizer" and n.get("clean_text", True) is True
                and (self.pre_tokenizer or {}).get("type") == "BertPreTokenizer"
                and (self.before_ids, self.after_ids) == ([self.cls_id], [self.sep_id])
                and None not in (self.cls_id, self.sep_id) and self.prefix == "##"
                and self.max_chars == MAX_CHARS_PER_WORD)

    def to_tokenizer_json(self) -> dict:
        """The pipeline as tokenizer.json, loadable by the tokenizers library and transformers."""
        model_vocab = {tok: i for i, tok in enumerate(self.ids_to_tokens[: self.model_size]) if tok is not None}
        return {"version": "1.0", "truncation": None, "padding": None,
                "added_tokens": sorted(({k: t[k] for k in ("id", "content", "single_word", "lstrip", "rstrip",
                                                           "normalized", "special")}
                                        for t in self.added.values()), key=lambda t: t["id"]),
                "normalizer": self.normalizer, "pre_tokenizer": self.pre_tokenizer,
                "post_processor": self.post_processor,
                "decoder": {"type": "WordPiece", "prefix": self.prefix, "cleanup": True},
                "model": {"type": "WordPiece", "unk_token": self.specials["unk_token"],
                          "continuing_subword_prefix": self.prefix, "max_input_chars_per_word": self.max_chars,
                          "vocab": dict(sorted(model_vocab.items(), key=lambda kv: kv[1]))}}

    def save(self, out_dir: str):
        """tokenizer.json (the whole pipeline), vocab.txt (for tools that read only that),
        tokenizer_config.json and special_tokens_map.json: transformers' AutoTokenizer,
        sentence-transformers and load_tokenizer() all read them back to the same ids."""
        atomic_write(os.path.join(out_dir, "tokenizer.json"), lambda tmp: _write_text(tmp, json.dumps(
            self.to_tokenizer_json(), ensure_ascii=False, indent=2)))
        model_tokens = self.ids_to_tokens[: self.model_size]
        if None not in model_tokens and not any("\n" in t or "\r" in t for t in model_tokens):
            atomic_write(os.path.join(out_dir, "vocab.txt"),
                         lambda tmp: _write_text(tmp, "".join(t + "\n" for t in model_tokens)))
        specials = {k: v for k, v in self.specials.items() if v in self.vocab}
        extra = sorted((c for c, t in self.added.items() if t["special"]
                        and c not in specials.values()), key=self.vocab.get)
        if extra:
            specials["additional_special_tokens"] = extra
        config = {"tokenizer_class": "BertTokenizer" if self.is_bert_standard() else "PreTrainedTokenizerFast"}
        if self.is_bert_standard():
            n = self.normalizer
            config.update(do_lower_case=n.get("lowercase", True), strip_accents=n.get("strip_accents"),
                          tokenize_chinese_chars=n.get("handle_chinese_chars", True))
        config.update(model_max_length=self.model_max_length,
                      clean_up_tokenization_spaces=self.clean_up_tokenization_spaces, **specials,
                      added_tokens_decoder={str(t["id"]): {k: t[k]
                                                           for k in ("content", "lstrip", "normalized", "rstrip",
                                                                     "single_word", "special")}
                                                        for t in sorted(self.added.values(), key=lambda t: t["id"])})
        save_json(os.path.join(out_dir, "tokenizer_config.json"), config)
        save_json(os.path.join(out_dir, "special_tokens_map.json"), specials)


_DECODER_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                    (" do not", " don't"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _write_text(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


# ---- reading a model directory ----

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
        raise UserError(f"{path} is not valid JSON ({e}); restore it from the model's repository or delete "
                        "it") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a JSON object; restore it from the model's "
                        "repository")
    return obj


def _read_vocab_txt(path: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            tokens = [line[:-1] if line.endswith("\n") else line for line in f]
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e}); it is not a WordPiece vocabulary") from None
    tokens = [t[:-1] if t.endswith("\r") else t for t in tokens]  # written on Windows
    if not tokens:
        raise UserError(f"{path} is empty; use the vocab.txt that came with the model")
    return tokens


def _read_tokenizer_json(path: str) -> tuple:
    """(the parsed file, its WordPiece vocabulary as a list in id order)."""
    tj = _read_json(path)
    model = tj.get("model")
    if not isinstance(model, dict):
        raise UserError(f"{path} has no \"model\" section; it is not a tokenizers tokenizer.json (restore it from the "
                        f"model's repository)")
    # Files written by old tokenizers versions leave out the model's "type"; WordPiece is the one with a prefix and no
    # merges.
    kind = model.get("type") or ("WordPiece" if "continuing_subword_prefix" in model
                                 and "merges" not in model else None)
    if kind != "WordPiece":
        raise UserError(f"{path}: model type {kind or 'unknown'} is not WordPiece; this loader reads BERT-family "
                        f"(WordPiece) tokenizers, as SPLADE's BERT and DistilBERT models use")
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not vocab or not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
        raise UserError(f"{path}: model.vocab is not a map of tokens to ids; restore tokenizer.json from the model's "
                        "repository")
    tokens = [None] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    return tj, tokens


def _file_tokens(tj: dict) -> list:
    """tokenizer.json's added_tokens, as dicts."""
    return [t for t in tj.get("added_tokens") or [] if isinstance(t, dict)]


def _config_tokens(config: dict, smap: dict) -> tuple:
    """(special token names -> text, added tokens) from tokenizer_config.json / special_tokens_map.json."""
    specials, added = {}, []
    for name in SPECIALS:
        for source in (config, smap):
            value = source.get(name)
            if _token_text(value):
                specials[name] = _token_text(value)
                added.append({**value, "special": True} if isinstance(value, dict) else value)
                break
    decoder = config.get("added_tokens_decoder") or {}
    added = [{**t, "id": int(i)} for i, t in decoder.items() if isinstance(t, dict) and str(i).isdigit()] + added
    for source in (config, smap):
        for t in source.get("additional_special_tokens") or source.get("extra_special_tokens") or []:
            if _token_text(t):
                added.append({**t, "special": True} if isinstance(t, dict) else t)
    return specials, added


def _model_max_length(config: dict) -> int:
    n = config.get("model_max_length", 512)
    return int(n) if isinstance(n, (int, float)) and 0 < n <= 1e9 else 512  # transformers writes 1e30 for "no limit"


def _reads_file_as_is(config: dict, model_dir: str, log) -> bool:
    """Does transformers' AutoTokenizer run this tokenizer.json as written (PreTrainedTokenizerFast), or
    rebuild it as a BertTokenizer from tokenizer_config.json? The class named there decides; without
    one, config.json's model_type does (bert and distilbert mean BertTokenizer)."""
    name = config.get("tokenizer_class")
    if name in BERT_CLASSES:
        return False
    if name in AS_FILE_CLASSES:
        return True
    if name is None:
        model_type = _read_json(os.path.join(model_dir, "config.json")).get("model_type")
        return model_type not in ("bert", "distilbert")
    log(f"note: {model_dir}/tokenizer_config.json names tokenizer_class {name!r}; reading tokenizer.json as written, "
        f"as the tokenizers library does")
    return True


def load_tokenizer(model_dir: str, log=print) -> WordPiece:
    """The tokenizer of a Hugging Face BERT / DistilBERT directory, as transformers' AutoTokenizer builds it:
    from tokenizer.json when there is one (its vocabulary, added tokens and, for PreTrainedTokenizerFast
    files, its whole pipeline), else from vocab.txt; BERT's settings from tokenizer_config.json.
    log: where the one-line notes go (a setting transformers ignores, a tokenizer.json it overrides)."""
    tj_path, vocab_path = os.path.join(model_dir, "tokenizer.json"), os.path.join(model_dir, "vocab.txt")
    if not os.path.isfile(tj_path) and not os.path.isfile(vocab_path):
        raise UserError(f"{model_dir} has neither tokenizer.json nor vocab.txt; a BERT tokenizer needs one of them "
                        f"(pass the model's directory as downloaded, or a hub id)")
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    smap = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
    specials, config_added = _config_tokens(config, smap)
    common = dict(model_max_length=_model_max_length(config),
                  clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", True))

    if os.path.isfile(tj_path):
        tj, tokens = _read_tokenizer_json(tj_path)
        model = tj["model"]
        if _reads_file_as_is(config, model_dir, log):
            specials.setdefault("unk_token", model.get("unk_token", "[UNK]"))
            pad = (tj.get("padding") or {}).get("pad_token")
            if pad and "pad_token" not in specials:
                specials["pad_token"] = pad
            return WordPiece(tokens, specials=specials, added_tokens=config_added + _file_tokens(tj), **common,
                             normalizer=tj.get("normalizer"), pre_tokenizer=tj.get("pre_tokenizer"),
                             post_processor=tj.get("post_processor"),
                             prefix=model.get("continuing_subword_prefix", "##"),
                             max_input_chars_per_word=model.get("max_input_chars_per_word", MAX_CHARS_PER_WORD),
                             where=tj_path)
        added, where = config_added + _file_tokens(tj), tj_path
    else:
        tj, tokens, added, where = None, _read_vocab_txt(vocab_path), config_added, vocab_path

    # transformers' BertTokenizer: the vocabulary from the file, everything else from tokenizer_config.json.
    tok = WordPiece(tokens, do_lower_case=config.get("do_lower_case", True), strip_accents=config.get("strip_accents"),
                    tokenize_chinese_chars=config.get("tokenize_chinese_chars", True), specials=specials,
                    added_tokens=added, **common, where=where)
    ignored = [f"{k}={config[k]!r}" for k in ("do_basic_tokenize", "never_split")
               if config.get(k) not in (None, True, [])]
    if ignored:
        log(f"note: {model_dir}/tokenizer_config.json sets {', '.join(ignored)}, which transformers' BertTokenizer "
            f"(and so AutoTokenizer and this loader) ignores; only its Python BertTokenizerLegacy honours it")
    if tj is not None:
        differs = _differences(tj, tok)
        if differs:
            log(f"note: {tj_path} asks for {'; '.join(differs)}; transformers' BertTokenizer (AutoTokenizer, "
                f"sentence-transformers) rebuilds these from tokenizer_config.json ({_describe(tok)}) and so does this "
                f"loader; the tokenizers library alone would follow tokenizer.json")
    return tok


load_wordpiece = load_tokenizer  # the name train_splade_*.py knew first


def _effective_bert_normalizer(spec):
    if not isinstance(spec, dict) or spec.get("type") != "BertNormalizer":
        return spec
    return _bert_settings(spec)


def _differences(tj: dict, tok: WordPiece) -> list:
    """Where tokenizer.json's own pipeline would give other ids than the BertTokenizer built from the config."""
    out = []
    if _effective_bert_normalizer(tj.get("normalizer")) != _effective_bert_normalizer(tok.normalizer):
        out.append(f"normalizer {_short(tj.get('normalizer'))}")
    if (tj.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer":
        out.append(f"pre_tokenizer {_short(tj.get('pre_tokenizer'))}")
    try:
        same = template_ids(tj.get("post_processor"), "") == (tok.before_ids, tok.after_ids)
    except UserError:
        same = False
    if not same:
        out.append(f"post_processor {_short(tj.get('post_processor'))}")
    model = tj["model"]
    for key, ours in (("unk_token", tok.specials["unk_token"]), ("continuing_subword_prefix", "##"),
                      ("max_input_chars_per_word", MAX_CHARS_PER_WORD)):
        if model.get(key, ours) != ours:
            out.append(f"model.{key} {model[key]!r}")
    return out


def _short(spec) -> str:
    if not isinstance(spec, dict):
        return "null"
    return spec.get("type", "?") + ("(" + ", ".join(f"{k}={v}" for k, v in spec.items() if k != "type"
                                                    and not isinstance(v, (dict, list))) + ")"
                                    if spec.get("type") == "BertNormalizer" else "")


def _describe(tok: WordPiece) -> str:
    n = tok.normalizer
    return (f"lowercase={n['lowercase']}, strip_accents={n['strip_accents']}, "
            f"handle_chinese_chars={n['handle_chinese_chars']}, BertPreTokenizer, {tok.specials['cls_token']} ... "
            f"{tok.specials['sep_token']}")


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
