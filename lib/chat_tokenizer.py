"""Hugging Face byte-level BPE tokenizers and chat templates, read from a model directory's own files.

Used by judge_train_mps.py (and so judge_train_cuda.py, which imports it). Reads what transformers
reads: tokenizer.json (normaliser, pre-tokenizer, BPE vocabulary and merges, post-processor), or
vocab.json + merges.txt, or Llama 3's tiktoken-format tokenizer.model; the special and added tokens;
and the chat template (tokenizer_config.json or chat_template.jinja), rendered in code, without Jinja.

The one idea: a tokenizer is a short pipeline, and each stage is a few lines. Added tokens such as
<|im_end|> are cut out of the text first; the rest is normalised (NFC), split into pieces by the
pre-tokenizer (a regex, digits one by one), each piece's UTF-8 bytes are spelled with 256 printable
characters, and BPE merges adjacent symbols, always the pair earliest in the merge list, until no pair
of the list is left. The ids are the `tokenizers` library's ids (what transformers gives and what the
models were trained with), checked on real files in tests/test_chat_tokenizer.py.

A chat template is Jinja code; this module recognises the real templates of the Qwen2, Qwen2.5,
SmolLM2 and Llama 3.0-3.3 families and reads what varies from them (the default system message, the
date lines), and refuses, in one line, a template it cannot render exactly as transformers would.
"""
import base64
import datetime
import hashlib
import heapq
import json
import os
import re
import shutil
import unicodedata
from collections import Counter, defaultdict

import regex  # tiktoken's own dependency: the \p{L} classes the tokenizers' split patterns use
import tiktoken

from lib.errors import UserError
from lib.wordpiece import BEHAVIORS, char_spans, split_piece  # the tokenizers library's Split, shared

# GPT-2's pre-tokeniser split (ByteLevel with use_regex=true).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2's and Llama 3's: case-insensitive contractions, letters with one leading non-letter,
# digits one at a time (Qwen2) or up to three (Llama 3), punctuation runs that keep their newlines.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3.1's special tokens as Meta's tokenizer.py numbers them after the 128,000 ranks.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja")
UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the other 68 move to
    U+0100 and up, so every byte string is a printable string in vocab.json / tokenizer.json."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table, extra = {b: chr(b) for b in bs}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_B2U = bytes_to_unicode()
_U2B = {c: b for b, c in _B2U.items()}


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno} column {e.colno}: {e.msg}; re-download or fix the file") from None


def _content(tok):
    return tok.get("content") if isinstance(tok, dict) else tok


def _steps(spec: dict | None, key: str) -> list[dict]:
    """A tokenizer.json component as a flat list of steps (a Sequence's members, one step, or none)."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [s for member in spec.get(key, []) for s in _steps(member, key)]
    return [spec]


# --- stage 1: normalisers ---------------------------------------------------------------------------
def read_normalizer(spec: dict | None, where: str) -> list[str]:
    """The Unicode normal forms to apply, in order (tokenizer.json's NFC / NFKC / ... or a Sequence)."""
    forms = []
    for step in _steps(spec, "normalizers"):
        if step.get("type") not in UNICODE_FORMS:
            raise UserError(f"{where}: normalizer {step.get('type')!r} is not supported; only none, NFC, NFD, NFKC, "
                            f"NFKD or a Sequence of them (byte-level BPE tokenizers: GPT-2, Llama 3, Qwen2, SmolLM)")
        forms.append(step["type"])
    return forms


# --- stage 2: pre-tokenizers --------------------------------------------------------------------------
def _is_numeric(ch: str) -> bool:  # Unicode category N*, Rust's char::is_numeric: what Digits splits at
    return unicodedata.category(ch)[0] == "N"


def _regex_spans(pattern, piece: str, invert: bool) -> list[tuple[int, int, bool]]:
    spans, last = [], 0
    for m in pattern.finditer(piece):
        if m.start() > last:
            spans.append((last, m.start(), invert))
        spans.append((m.start(), m.end(), not invert))
        last = m.end()
    if last < len(piece):
        spans.append((last, len(piece), invert))
    return spans


_GPT2_SPLIT = regex.compile(GPT2_PATTERN)


def read_pre_tokenizer(spec: dict | None, where: str) -> list:
    """The pre-tokenizer as a list of functions, each turning one piece of text into several.

    Supported: Split (Regex or String pattern, any behaviour, invert), Digits (individual_digits) and
    ByteLevel (add_prefix_space, use_regex: GPT-2's split), alone or in a Sequence ending in ByteLevel,
    which is what makes the BPE byte-level. Anything else is refused by name.
    """
    steps, funcs = _steps(spec, "pretokenizers"), []
    kinds = [s.get("type") for s in steps]
    if "ByteLevel" not in kinds:
        raise UserError(f"{where}: pre_tokenizer {kinds or None} has no ByteLevel step; only byte-level BPE "
                        f"tokenizers (GPT-2, Llama 3, Qwen2, SmolLM) are supported")
    if kinds[-1] != "ByteLevel":
        raise UserError(f"{where}: pre_tokenizer step {kinds[-1]!r} after ByteLevel is not supported")
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            behavior, invert, pat = step.get("behavior"), bool(step.get("invert")), step.get("pattern") or {}
            if behavior not in BEHAVIORS:
                raise UserError(f"{where}: pre_tokenizer Split behavior {behavior!r} is not supported ({BEHAVIORS})")
            if "Regex" in pat:
                try:
                    compiled = regex.compile(pat["Regex"])
                except regex.error as e:
                    raise UserError(f"{where}: pre_tokenizer Split pattern {pat['Regex']!r} does not compile: "
                                    f"{e}") from None
            elif "String" in pat:
                compiled = regex.compile(regex.escape(pat["String"]))
            else:
                raise UserError(f"{where}: pre_tokenizer Split pattern {pat!r} is neither Regex nor String")
            funcs.append(lambda p, c=compiled, b=behavior, i=invert: split_piece(p, _regex_spans(c, p, i), b))
        elif kind == "Digits":
            behavior = "Isolated" if step.get("individual_digits") else "Contiguous"
            funcs.append(lambda p, b=behavior: split_piece(p, char_spans(p, _is_numeric), b))
        elif kind == "ByteLevel":
            prefix, use_regex = bool(step.get("add_prefix_space")), step.get("use_regex", True)

            def byte_level(p, prefix=prefix, use_regex=use_regex):
                if prefix and not p.startswith(" "):
                    p = " " + p
                return split_piece(p, _regex_spans(_GPT2_SPLIT, p, False), "Isolated") if use_regex else [p]
            funcs.append(byte_level)
        else:
            raise UserError(f"{where}: pre_tokenizer {kind!r} is not supported; only Split, Digits and ByteLevel "
                            f"(byte-level BPE tokenizers: GPT-2, Llama 3, Qwen2, SmolLM)")
    return funcs


# --- stage 3: byte-level BPE --------------------------------------------------------------------------
def bpe(symbols: list[str], merge_rank: dict) -> list[str]:
    """Merge adjacent symbols, always the pair with the best (lowest) merge rank, leftmost on ties,
    until no adjacent pair is in the merge list: the tokenizers library's Word::merge_all.

    A heap of candidate pairs by (rank, position) and a linked list of live symbols keep it
    O(n log n); an entry whose pair has changed since it was pushed is skipped.
    """
    symbols = list(symbols)
    nxt, prev = list(range(1, len(symbols))) + [-1], list(range(-1, len(symbols) - 1))
    heap = [(merge_rank[(a, b)], i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if (a, b) in merge_rank]
    heapq.heapify(heap)
    while heap:
        rank, i = heapq.heappop(heap)
        j = nxt[i]
        if symbols[i] is None or j == -1 or merge_rank.get((symbols[i], symbols[j])) != rank:
            continue  # stale: one side was merged into something else since
        symbols[i], symbols[j] = symbols[i] + symbols[j], None
        nxt[i] = nxt[j]
        if nxt[i] != -1:
            prev[nxt[i]] = i
        for a, b in ((prev[i], i), (i, nxt[i])):
            if a != -1 and b != -1 and (symbols[a], symbols[b]) in merge_rank:
                heapq.heappush(heap, (merge_rank[(symbols[a], symbols[b])], a))
    return [s for s in symbols if s is not None]


def read_merges(merges: list, vocab: dict, where: str) -> dict:
    """{(left, right): rank} from tokenizer.json's merges ("a b" strings or [a, b] pairs)."""
    rank = {}
    for n, merge in enumerate(merges):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if a + b not in vocab:
            raise UserError(f"{where}: merge {n} ({a!r} {b!r}) makes {a + b!r}, which is not in the vocabulary")
        rank.setdefault((a, b), n)  # a pair listed twice keeps its first (best) rank
    return rank


# --- the tokenizer ----------------------------------------------------------------------------------
class Tokenizer:
    """encode / decode / apply_chat_template for one model directory (see load_tokenizer)."""

    def __init__(self, model_dir, config, files, added, special_ids, prefix_ids, suffix_ids, template, *,
                 model=None, normalizer=(), pre_tokenizer=(), tiktoken_ranks=None, pattern=None):
        self.model_dir, self.config, self.files = model_dir, config, files
        self.added = dict(added)                      # content -> id, every added token
        self.special_ids = set(special_ids)           # ids that skip_special_tokens drops
        self.prefix_ids, self.suffix_ids = list(prefix_ids), list(suffix_ids)
        self.normalizer, self.pre_tokenizer, self.pattern = list(normalizer), list(pre_tokenizer), pattern
        # Added tokens are found in the text before anything else, longest first at each position.
        self._added_split = (re.compile("(" + "|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True))
                                        + ")") if self.added else None)
        self._id_to_bytes, self.tiktoken_ranks = None, tiktoken_ranks
        if tiktoken_ranks is not None:  # Llama 3's tokenizer.model: tiktoken's own algorithm is the reference
            self.enc = tiktoken.Encoding(name=f"hf:{model_dir}", pat_str=pattern, mergeable_ranks=tiktoken_ranks,
                                         special_tokens={})
            self.vocab_size = max(len(tiktoken_ranks), max(self.added.values(), default=0) + 1)
        else:
            self.enc = None
            self.vocab, self.merge_rank = model["vocab"], model["merge_rank"]
            self.ignore_merges, self.unk_token = model["ignore_merges"], model["unk_token"]
            self.fuse_unk, self.byte_fallback = model["fuse_unk"], model["byte_fallback"]
            self._cache = {}
            self.vocab_size = max(max(self.vocab.values(), default=-1), max(self.added.values(), default=-1)) + 1
        self.template = template or ""
        self.chat_format, self.chat_settings, self.template_error = identify_template(template)

        def token_id(key):
            tok = _content(config.get(key))
            if tok is None:
                return None
            if tok not in self.added:
                raise UserError(f"{model_dir}/tokenizer_config.json: {key} {tok!r} is not a special or added token")
            return self.added[tok]
        self.bos_token_id, self.eos_token_id = token_id("bos_token"), token_id("eos_token")
        self.bos_token = _content(config.get("bos_token")) or ""
        pad = token_id("pad_token")
        self.pad_token_id = pad if pad is not None else self.eos_token_id  # padding is masked anyway
        stops = [self.eos_token_id] + [self.added[t] for t in STOP_TOKENS if t in self.added]
        gen = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen):
            eos = _read_json(gen).get("eos_token_id")
            stops += eos if isinstance(eos, list) else [eos]
        self.stop_token_ids = list(dict.fromkeys(i for i in stops if i is not None))

    # -- encoding: added tokens, normaliser, pre-tokenizer, BPE --
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids, as the tokenizers library gives them; added/special tokens written in the text
        become their ids. add_special_tokens adds what the post-processor adds (Llama 3: <|begin_of_text|>)."""
        ids = []
        for n, part in enumerate(self._added_split.split(text) if self._added_split else [text]):
            if n % 2:  # the odd parts of re.split with one group are the added tokens themselves
                ids.append(self.added[part])
            elif part:
                ids += self._encode_ordinary(part)
        return (self.prefix_ids + ids + self.suffix_ids) if add_special_tokens else ids

    def _encode_ordinary(self, text: str) -> list[int]:
        if self.enc is not None:
            return self.enc.encode_ordinary(text)
        for form in self.normalizer:
            text = unicodedata.normalize(form, text)
        pieces = [text]
        for step in self.pre_tokenizer:
            pieces = [q for p in pieces for q in step(p)]
        ids = []
        for piece in pieces:  # cached by the piece itself: a repeated word costs one dict lookup
            hit = self._cache.get(piece)
            if hit is None:
                if len(self._cache) > 200_000:
                    self._cache.clear()
                hit = self._cache[piece] = self._bpe_ids("".join(_B2U[b] for b in piece.encode("utf-8")))
            ids += hit
        return ids

    def _bpe_ids(self, chars: str) -> list[int]:
        if self.ignore_merges and chars in self.vocab:  # Llama 3: a whole word in the vocabulary is one token
            return [self.vocab[chars]]
        # Start from single byte characters. A vocabulary may lack some (SmolLM2 has 235 of the 256);
        # the tokenizers library then uses byte_fallback tokens <0xNN> if the file asks for them, else
        # the unk token if there is one, else drops the byte -- and so do we.
        symbols, unknown = [], False
        for c in chars:
            if c in self.vocab:
                symbols.append(c)
                unknown = False
                continue
            fallback = [f"<0x{b:02X}>" for b in c.encode("utf-8")] if self.byte_fallback else []
            if fallback and all(f in self.vocab for f in fallback):
                symbols += fallback
            elif self.unk_token is not None and not (unknown and self.fuse_unk):
                symbols.append(self.unk_token)
            unknown = self.unk_token is not None
        return [self.vocab[s] for s in bpe(symbols, self.merge_rank)]

    @property
    def id_to_bytes(self) -> dict[int, bytes]:
        """{id: the bytes it stands for}, built on first use (decode only)."""
        if self._id_to_bytes is None:
            table = {}
            if self.enc is not None:
                table.update({i: b for b, i in self.tiktoken_ranks.items()})
            else:
                for t, i in self.vocab.items():
                    try:
                        table[i] = bytes(_U2B[c] for c in t)
                    except KeyError:  # not a byte-level spelling (a special kept in the vocabulary)
                        table[i] = t.encode("utf-8")
            table.update({i: s.encode("utf-8") for s, i in self.added.items()})
            self._id_to_bytes = table
        return self._id_to_bytes

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of the ids (bytes that are not valid UTF-8 become U+FFFD, as in transformers)."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        try:
            data = b"".join(self.id_to_bytes[i] for i in ids)
        except KeyError as e:
            raise ValueError(f"decode: id {e.args[0]} is not in the vocabulary (size {self.vocab_size})") from None
        # transformers 5 no longer applies clean_up_tokenization_spaces to BPE tokenizers (Llama 3 sets it)
        return data.decode("utf-8", errors="replace")

    # -- chat --
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, date_string: str | None = None):
        """The conversation rendered as the model's chat template renders it in transformers.
        date_string: Llama 3.1+'s "Today Date" (default: what the template itself does)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"apply_chat_template: message {i} needs string 'role' and 'content', got {m!r}")
        if self.chat_format is None:
            raise UserError(f"{self.model_dir}: {self.template_error}")
        text = RENDERERS[self.chat_format](messages, add_generation_prompt, self.bos_token, date_string,
                                           **self.chat_settings)
        return self.encode(text) if tokenize else text

    def save(self, out_dir: str) -> None:
        """Copy the tokenizer files, so out_dir loads as the same tokenizer (here and in transformers)."""
        os.makedirs(out_dir, exist_ok=True)
        for name in self.files:
            src = os.path.join(self.model_dir, name)
            if os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
                shutil.copyfile(src, os.path.join(out_dir, name))

    def __len__(self) -> int:
        return self.vocab_size


# --- chat templates: recognised, not interpreted ----------------------------------------------------
# A template is compared with the real ones after rewriting every Jinja string literal one way: real
# tokenizer_config.json files hold 'system\nYou are...' with a REAL newline inside the quotes (the JSON
# "\n" decoded), others a backslash and an n, or double quotes; all mean the same string. Spaces inside
# {{ }} / {% %} are dropped too. What varies between models of a family (the default system message, the
# dates) is a slot, read back from the model's own template.
_TAG = re.compile(r"({{.*?}}|{%.*?%}|{#.*?#})", re.S)
_STRING = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*\"""", re.S)
_JINJA_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _unescape(literal: str) -> str:
    return re.sub(r"\\(.)", lambda m: _JINJA_ESCAPES.get(m.group(1), "\\" + m.group(1)), literal[1:-1], flags=re.S)


def canonical_template(template: str) -> str:
    """The template with its string literals rewritten one way (as JSON), spaces inside tags dropped,
    comments dropped, and the whitespace that a '-' in {%- / -%} trims away removed (as Jinja would)."""
    parts = _TAG.split(template)
    out = []
    for n, part in enumerate(parts):
        if n % 2 == 0:  # literal text between tags
            if n + 1 < len(parts) and parts[n + 1][2:3] == "-":
                part = part.rstrip()
            if n > 0 and parts[n - 1][-3:-2] == "-":
                part = part.lstrip()
            out.append(part)
        elif not part.startswith("{#"):
            code = [re.sub(r"\s+", "", piece) for piece in _STRING.split(part)]
            strings = [json.dumps(_unescape(s), ensure_ascii=False) for s in _STRING.findall(part)] + [""]
            out.append("".join(c + strings[k] for k, c in enumerate(code)))
    return "".join(out)


SLOT = "\ue000{}\ue000"  # a private-use character marks a slot
_QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + SLOT.format("system") + "<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_LLAMA3_BODY = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}")
_LLAMA3_GEN = "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
_JSON_STRING = r'((?:[^"\\]|\\.)*)'  # the inside of a JSON string literal (canonical form)
# The long templates (Qwen2.5's 2.5 kB, Llama 3.1's and 3.2's 4-5 kB, with tool-calling branches this module
# does not render) are recognised by a fingerprint: their canonical form, the slots cut out by these
# regexes, hashed. The real files are tests/fixtures/real/chat/{qwen2.5,llama3.1,llama3.2}.
_FINGERPRINTS = {
    "qwen2_5": ({"system": [r'\{%-else%\}\{\{-"' + _JSON_STRING + r'"\}\}(?=\{%-endif%\}\{\{-"\\n\\n# Tools)',
                            r'\{\{-"<\|im_start\|>system\\n' + _JSON_STRING + r'<\|im_end\|>\\n"\}\}']},
                "cd680286ed10501a"),
    "llama3_1": ({"knowledge": [r'"Cutting Knowledge Date: ' + _JSON_STRING + r'\\n"'],
                  "date": [r'\{%-setdate_string="' + _JSON_STRING + r'"%\}']}, "495256b025eb78ff"),
    "llama3_2": ({"knowledge": [r'"Cutting Knowledge Date: ' + _JSON_STRING + r'\\n"'],
                  "date": [r'\{%-setdate_string="' + _JSON_STRING + r'"%\}']}, "19bdb1e3ae86eba9"),
}


def _skeleton(template):
    """A regex over the canonical form of a template written out above, its slots as named groups."""
    canon = re.escape(canonical_template(template))
    for name in ("system",):
        slot = re.escape(SLOT.format(name))
        canon = canon.replace(slot, f"(?P<{name}>(?:[^\"\\\\]|\\\\.)*)")
    return re.compile(canon + r"\Z", re.S)


_SKELETONS = {"chatml": _skeleton(_QWEN2_TEMPLATE),
              "llama3": _skeleton(_LLAMA3_BODY + "{% if add_generation_prompt %}" + _LLAMA3_GEN + "{% endif %}"),
              "llama3_always_gen": _skeleton(_LLAMA3_BODY + _LLAMA3_GEN)}  # Llama 3's first release


def fingerprint(canon: str, slots: dict):
    """(hash of `canon` with the slots cut out, {slot: value}), or None when a slot is missing or
    its occurrences disagree."""
    values = {}
    for name, patterns in slots.items():
        for pattern in patterns:
            found = list(re.finditer(pattern, canon))
            if not found:
                return None
            for m in found:
                values.setdefault(name, m.group(1))
                if m.group(1) != values[name]:
                    return None
            canon = re.sub(pattern, lambda m: m.group(0).replace(m.group(1), SLOT.format(name)), canon)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16], values


def identify_template(template: str | None):
    """(family, its settings, None) for a template this module renders exactly, else (None, {}, why)."""
    if not template:
        return None, {}, ("has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                          "use an instruct model")
    canon = canonical_template(template)
    for name, skeleton in _SKELETONS.items():
        m = skeleton.match(canon)
        if m:
            return name, {k: json.loads(f'"{v}"') for k, v in m.groupdict().items()}, None
    for name, (slots, digest) in _FINGERPRINTS.items():
        found = fingerprint(canon, slots)
        if found and found[0] == digest:
            return name, {k: json.loads(f'"{v}"') for k, v in found[1].items()}, None
    return None, {}, ("its chat template is not one this module renders exactly as transformers does (known: "
                      "the ChatML templates of Qwen2 and SmolLM2, Qwen2.5's, Llama 3.0, 3.1, 3.2 and 3.3's); "
                      "use one of those models or a copy of their template")


def chatml_default_system(template: str) -> str | None:
    """The system message a ChatML template (Qwen2, Qwen2.5, SmolLM2) writes when the conversation has
    none, however the template spells its newlines; None for other templates."""
    family, settings, _ = identify_template(template)
    return settings.get("system") if family in ("chatml", "qwen2_5") else None


def llama3_system_preamble(template: str, date_string: str | None) -> str | None:
    """Llama 3.1+'s knowledge-cutoff and date lines, as the template writes them; None for 3.0."""
    family, settings, _ = identify_template(template)
    if family not in ("llama3_1", "llama3_2"):
        return None
    return (f"Cutting Knowledge Date: {settings['knowledge']}\n"
            f"Today Date: {_llama3_date(family, settings, date_string)}\n\n")


def _llama3_date(family, settings, date_string):
    if date_string is not None:
        return date_string
    if family == "llama3_2":  # strftime_now, which transformers defines: today's date
        return datetime.datetime.now().strftime("%d %b %Y")
    return settings["date"]


def _render_chatml(messages, generation, bos, date_string, system):
    # Qwen2 / SmolLM2: the default system message only when the conversation has none
    out = [f"<|im_start|>system\n{system}<|im_end|>\n"] if messages and messages[0]["role"] != "system" else []
    out += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(out) + ("<|im_start|>assistant\n" if generation else "")


def _no_tools(m, i):
    if "tool_calls" in m or m["role"] in ("tool", "ipython"):
        raise UserError(f"apply_chat_template: message {i} is a tool call or tool result; tool use is not supported "
                        f"by this renderer")


def _render_qwen2_5(messages, generation, bos, date_string, system):
    if not messages:
        raise ValueError("apply_chat_template: the Qwen2.5 template needs at least one message")
    first = messages[0]["role"] == "system"
    out = [f"<|im_start|>system\n{messages[0]['content'] if first else system}<|im_end|>\n"]
    for i, m in enumerate(messages):
        _no_tools(m, i)
        # the template writes user, assistant and later system turns; a first system turn is above, other
        # roles it leaves out
        if m["role"] in ("user", "assistant") or (m["role"] == "system" and i > 0):
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(out) + ("<|im_start|>assistant\n" if generation else "")


def _llama3_turn(m):
    return f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"  # | trim


def _render_llama3(messages, generation, bos, date_string, always_generation=False):
    out = [bos * (i == 0) + _llama3_turn(m) for i, m in enumerate(messages)]
    return "".join(out) + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if generation
                           or always_generation else "")


def _render_llama3_1(messages, generation, bos, date_string, knowledge, date=None, family="llama3_1"):
    # 3.1+ always opens with a system block: knowledge cut-off, today's date, then the user's system message
    system = ""
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    today = _llama3_date(family, {"date": date}, date_string)
    out = [f"{bos}<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: {knowledge}\n"
           f"Today Date: {today}\n\n{system}<|eot_id|>"]
    for i, m in enumerate(messages):
        _no_tools(m, i)
        out.append(_llama3_turn(m))
    return "".join(out) + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if generation else "")


RENDERERS = {
    "chatml": _render_chatml,
    "qwen2_5": _render_qwen2_5,
    "llama3": _render_llama3,
    "llama3_always_gen": lambda *a: _render_llama3(*a, always_generation=True),
    "llama3_1": _render_llama3_1,
    "llama3_2": lambda *a, **k: _render_llama3_1(*a, **k, family="llama3_2"),
}


# --- reading the files ------------------------------------------------------------------------------
def read_model(model: dict, added: dict, where: str) -> dict:
    """tokenizer.json's "model": a byte-level BPE, checked; the merges as {(a, b): rank}."""
    if model.get("type") != "BPE":
        raise UserError(f"{where}: model type {model.get('type')!r} is not supported; only byte-level BPE "
                        f"tokenizers (GPT-2, Llama 3, Qwen2, SmolLM) are")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise UserError(f"{where}: BPE {key} {model[key]!r} is not supported (not a byte-level BPE)")
    if model.get("dropout"):
        raise UserError(f"{where}: BPE dropout {model['dropout']} is not supported (random tokenisation)")
    vocab = model.get("vocab") or {}
    unk = model.get("unk_token")
    if unk is not None and unk not in vocab:
        raise UserError(f"{where}: unk_token {unk!r} is not in the vocabulary")
    singles = sum(1 for t in vocab if len(t) == 1 and t in _U2B)
    if singles < 128:  # not a byte-level vocabulary at all (a missing few are fine: see Tokenizer._bpe_ids)
        raise UserError(f"{where}: only {singles} of the 256 byte-level characters are in the vocabulary; "
                        f"only byte-level BPE tokenizers are supported")
    return {"vocab": vocab, "merge_rank": read_merges(model.get("merges") or [], vocab, where),
            "ignore_merges": bool(model.get("ignore_merges")), "unk_token": unk,
            "fuse_unk": bool(model.get("fuse_unk")), "byte_fallback": bool(model.get("byte_fallback"))}


def read_post_processor(post: dict | None, added: dict, where: str) -> tuple[list[int], list[int]]:
    """Ids a TemplateProcessing post-processor puts before and after the text (Llama 3: <|begin_of_text|>)."""
    prefix, suffix = [], []
    for step in _steps(post, "processors"):
        kind = step.get("type")
        if kind == "TemplateProcessing":
            seen_text = False
            for piece in step.get("single", []):
                if "Sequence" in piece:
                    seen_text = True
                    continue
                tok = piece["SpecialToken"]["id"]
                ids = step.get("special_tokens", {}).get(tok, {}).get("ids") or [added.get(tok)]
                (suffix if seen_text else prefix).extend(ids)
        elif kind != "ByteLevel":
            raise UserError(f"{where}: post_processor {kind!r} is not supported; only ByteLevel and TemplateProcessing")
    return prefix, suffix


def read_chat_template(model_dir: str, config: dict):
    """The default chat template, where transformers looks: chat_template.jinja beside the config wins;
    else tokenizer_config.json's "chat_template" (a string, or a list of named ones: "default")."""
    jinja = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    if os.path.isdir(os.path.join(model_dir, "additional_chat_templates")):
        return None  # only named templates and no default: transformers has no default either
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (tokenizer.json, vocab.json + merges.txt, or
    Llama 3's tiktoken tokenizer.model; with tokenizer_config.json and the chat template)."""
    def path(name):
        return os.path.join(model_dir, name)

    config = _read_json(path("tokenizer_config.json")) if os.path.isfile(path("tokenizer_config.json")) else {}
    files = [n for n in TOKENIZER_FILES if os.path.isfile(path(n))]
    added, special_ids = {}, []
    for i, tok in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        added[tok["content"]] = int(i)
        if tok.get("special"):
            special_ids.append(int(i))
    engine, prefix, suffix = {}, [], []
    if os.path.isfile(path("tokenizer.json")) or (os.path.isfile(path("vocab.json"))
                                                  and os.path.isfile(path("merges.txt"))):
        if os.path.isfile(path("tokenizer.json")):
            where = path("tokenizer.json")
            tj = _read_json(where)
        else:  # the "slow" files: the pipeline their tokenizer class implies
            where = path("merges.txt")
            with open(where, encoding="utf-8") as f:
                merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
            qwen = config.get("tokenizer_class", "").startswith("Qwen2")
            byte_level = {"type": "ByteLevel", "add_prefix_space": bool(config.get("add_prefix_space")),
                          "use_regex": not qwen}
            split = {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False}
            tj = {"model": {"type": "BPE", "vocab": _read_json(path("vocab.json")), "merges": merges},
                  "normalizer": {"type": "NFC"} if qwen else None,
                  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]} if qwen else byte_level}
            bos = _content(config.get("bos_token"))
            if config.get("add_bos_token") and bos in added:
                prefix = [added[bos]]
        for tok in tj.get("added_tokens") or []:
            for flag in ("lstrip", "rstrip", "single_word"):
                if tok.get(flag):
                    raise UserError(f"{where}: added token {tok['content']!r} with {flag}=true is not supported")
            added.setdefault(tok["content"], tok["id"])
            if tok.get("special"):
                special_ids.append(tok["id"])
        if (tj.get("decoder") or {}).get("type", "ByteLevel") != "ByteLevel":
            raise UserError(f"{where}: decoder {tj['decoder'].get('type')!r} is not supported; only ByteLevel")
        model = read_model(tj.get("model") or {}, added, where)
        engine = dict(model=model, normalizer=read_normalizer(tj.get("normalizer"), where),
                      pre_tokenizer=read_pre_tokenizer(tj.get("pre_tokenizer"), where))
        if "post_processor" in tj:
            prefix, suffix = read_post_processor(tj.get("post_processor"), added, where)
        vocab_ids = set(model["vocab"].values())
        # bos/eos/pad named in tokenizer_config.json but kept in the vocabulary (GPT-2's <|endoftext|>):
        # transformers treats them as special tokens, so do we.
        for key in ("bos_token", "eos_token", "pad_token"):
            tok = _content(config.get(key))
            if tok is not None and tok not in added and tok in model["vocab"]:
                added[tok] = model["vocab"][tok]
                special_ids.append(added[tok])
        for s, i in added.items():
            if i in vocab_ids and model["vocab"].get(s) != i:
                raise UserError(f"{model_dir}: added token {s!r} has id {i}, which the vocabulary gives another token")
    elif os.path.isfile(path("tokenizer.model")):
        where = path("tokenizer.model")
        ranks = load_tiktoken_ranks(where)
        if not added:  # Meta's own layout: no tokenizer_config, the specials follow the ranks
            added = {s: len(ranks) + k for k, s in enumerate(LLAMA3_SPECIALS)}
            added.update({f"<|reserved_special_token_{k}|>": len(ranks) + k + 9 for k in range(2, 256 - 9)})
            special_ids = list(added.values())
            config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", **config}
        engine = dict(tiktoken_ranks=ranks, pattern=LLAMA3_PATTERN)
        if _content(config.get("bos_token")) in added:
            prefix = [added[_content(config["bos_token"])]]
    else:
        raise UserError(f"{model_dir} has no tokenizer.json, vocab.json + merges.txt or tokenizer.model; "
                        f"pass a complete Hugging Face model directory")
    return Tokenizer(model_dir, config, files, added, special_ids, prefix, suffix,
                     read_chat_template(model_dir, config), **engine)


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """'base64-token rank' lines (Llama 3's tokenizer.model, tiktoken's own format)."""
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise UserError(f"{path} line {n} is not 'base64-token rank': a sentencepiece tokenizer.model "
                                f"(Llama 2, Mistral) is not supported, only Llama 3's tiktoken format") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


# --- a tiny tokenizer for the offline demo ----------------------------------------------------------
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)  # Qwen2-Instruct's template, verbatim
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TRAIN_SPLIT = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+(?!\S)|\s+""")


def train_bpe(texts, vocab_size: int) -> list[tuple[bytes, bytes]]:
    """Byte-level BPE merges learned by hand: repeatedly merge the most frequent adjacent pair
    (ties: the smaller pair) inside pre-split words, until vocab_size or no pair occurs twice.

    Pair counts are updated only for the words that contain the merged pair, and a heap finds the
    most frequent pair, so a few hundred KB of text trains in seconds.
    """
    counts = Counter()
    for text in texts:
        counts.update(_TRAIN_SPLIT.findall(text))
    words = [[bytes([b]) for b in w.encode("utf-8")] for w in counts]
    freq = list(counts.values())
    pairs, where = Counter(), defaultdict(set)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pairs[pair] += freq[i]
            where[pair].add(i)
    heap = [(-n, pair) for pair, n in pairs.items()]
    heapq.heapify(heap)
    merges = []
    while heap and 256 + len(merges) < vocab_size:
        n, best = heapq.heappop(heap)
        if -n != pairs.get(best, 0):
            continue  # a stale entry: this pair's count changed since it was pushed
        if -n < 2:
            break
        merges.append(best)
        changed = set()
        for i in where.pop(best):
            w = words[i]
            for pair in zip(w, w[1:]):
                pairs[pair] -= freq[i]
                changed.add(pair)
            out, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    out.append(w[j] + w[j + 1])
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for pair in zip(out, out[1:]):
                pairs[pair] += freq[i]
                where[pair].add(i)
                changed.add(pair)
        for pair in changed:
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], pair))
            else:
                pairs.pop(pair, None)
    return merges


def make_tiny_tokenizer(out_dir: str, texts, vocab_size: int = 512) -> Tokenizer:
    """Learn a small byte-level BPE on `texts` and write a Qwen2-style tokenizer directory
    (tokenizer.json with the Qwen2 regex and NFC, tokenizer_config.json with ChatML specials and
    chat template). Ids: 256 bytes, then the merges, then <|endoftext|> <|im_start|> <|im_end|>."""
    b2u = bytes_to_unicode()
    uni = lambda b: "".join(b2u[x] for x in b)
    merges = train_bpe(texts, vocab_size - len(CHATML_SPECIALS))
    vocab = {b2u[b]: i for i, b in enumerate(sorted(range(256), key=lambda b: ord(b2u[b])))}
    for a, b in merges:
        vocab.setdefault(uni(a + b), len(vocab))
    specials = {s: len(vocab) + k for k, s in enumerate(CHATML_SPECIALS)}
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for s, i in specials.items()]
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[uni(a), uni(b)] for a, b in merges]},
    }
    config = {
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": 32768, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
    }
    os.makedirs(out_dir, exist_ok=True)
    for name, obj in (("tokenizer.json", tokenizer_json), ("tokenizer_config.json", config)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=1)
    return load_tokenizer(out_dir)
