"""Hugging Face tokenizers and chat templates, rebuilt on tiktoken from the model directory's files.

Used by judge_train_mps.py and judge_train_cuda.py. Reads what transformers reads: tokenizer.json
(a byte-level BPE: vocab + merges, its pre-tokenizer regex, its normaliser), or vocab.json +
merges.txt, or Llama 3's tiktoken-format tokenizer.model; special and added tokens from
tokenizer_config.json / tokenizer.json; and the chat template, written out in code (no Jinja).

The one idea: a byte-level BPE is a table {byte string: rank} plus a split regex. transformers
merges the pair with the best merge priority; tiktoken merges to the byte string with the lowest
rank. The two agree when a token's rank is the priority of the merge that makes it, so the ranks
are built from the merge list (not from the ids), and tiktoken's ranks are mapped back to the ids.
"""
import base64
import datetime
import heapq
import json
import os
import re
import shutil
import unicodedata
from collections import Counter, defaultdict

import tiktoken

from lib.errors import UserError

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


_U2B = {c: b for b, c in bytes_to_unicode().items()}


def _token_bytes(token: str, where: str) -> bytes:
    try:
        return bytes(_U2B[c] for c in token)
    except KeyError:
        raise UserError(f"{where}: token {token!r} has a character outside the byte-level alphabet; "
                        f"only byte-level BPE tokenizers (GPT-2, Qwen2, Llama 3) are supported") from None


def ranks_from_merges(vocab: dict[str, int], merges: list, where: str, ignore_merges: bool = False):
    """({bytes: rank}, [id for each rank], {id: bytes} of the rest) from a byte-level vocab and merges.

    Single bytes get ranks 0..255; the token a merge makes gets 256 + the merge's position (its
    priority). A token made by two merges keeps the first (transformers would never reach it
    through the later one before the earlier). Vocabulary entries no merge makes are never produced
    by transformers' BPE, so they get no rank (only decode knows them), unless the file says
    ignore_merges (Llama 3): then a whole word found in the vocabulary is one token, which is what
    tiktoken does for any word that has a rank.
    """
    singles = sorted((i, _token_bytes(t, where)) for t, i in vocab.items() if len(t) == 1 and t in _U2B)
    if len(singles) != 256:
        raise UserError(f"{where}: the vocabulary has {len(singles)} of the 256 single-byte tokens; "
                        f"a byte-level BPE needs all of them")
    ranks, rank_to_id = {}, []
    for i, b in singles:
        ranks[b] = len(rank_to_id)
        rank_to_id.append(i)
    for n, merge in enumerate(merges):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if a + b not in vocab:
            raise UserError(f"{where}: merge {n} ({a!r} {b!r}) makes {a + b!r}, which is not in the vocabulary")
        token = _token_bytes(a + b, where)
        if token not in ranks:
            ranks[token] = len(rank_to_id)
            rank_to_id.append(vocab[a + b])
    reached, rest = set(rank_to_id), {}
    for t, i in vocab.items():
        if i not in reached:
            b = bytes(_U2B[c] for c in t) if all(c in _U2B for c in t) else t.encode("utf-8")
            if ignore_merges and b not in ranks:
                ranks[b] = len(rank_to_id)
                rank_to_id.append(i)
            else:
                rest[i] = b
    return ranks, rank_to_id, rest


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno} column {e.colno}: {e.msg}; re-download or fix the file") from None


def _content(tok):
    return tok.get("content") if isinstance(tok, dict) else tok


# --- chat templates ---------------------------------------------------------------------------------
def _jinja_unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), s)


def chatml_default_system(template: str) -> str | None:
    """The system message a ChatML template writes when the conversation has none, read from the
    template text ('<|im_start|>system\\nYou are ...<|im_end|>' as a literal), else None."""
    m = re.search(r"""(['"])<\|im_start\|>system\\n((?:(?!\1)[^\\]|\\.)*?)<\|im_end\|>""", template)
    if m:
        return _jinja_unescape(m.group(2))
    return None


def llama3_system_preamble(template: str, date_string: str | None) -> str | None:
    """Llama 3.1+ always opens with a system block: 'Cutting Knowledge Date: ...\\nToday Date: ...\\n\\n'.
    None for Llama 3.0's template, which has no such block."""
    knowledge = re.search(r"Cutting Knowledge Date: ([^\\\"']*)\\n", template)
    if not knowledge:
        return None
    if date_string is None:
        if "strftime_now" in template:  # Llama 3.2: today's date, as transformers fills it in
            date_string = datetime.datetime.now().strftime("%d %b %Y")
        else:
            default = re.search(r"""set date_string = ["']([^"']*)["']""", template)
            date_string = default.group(1) if default else "26 Jul 2024"
    return f"Cutting Knowledge Date: {knowledge.group(1)}\nToday Date: {date_string}\n\n"


# --- the tokenizer ----------------------------------------------------------------------------------
class Tokenizer:
    """encode / decode / apply_chat_template for one model directory (see load_tokenizer)."""

    def __init__(self, model_dir, ranks, rank_to_id, rest, pattern, added, special_ids, nfc, config, prefix_ids,
                 template, files):
        self.model_dir, self.config, self.files = model_dir, config, files
        self.nfc, self.prefix_ids, self.template, self.pattern = nfc, prefix_ids, template or "", pattern
        self.added = dict(added)                      # content -> id, every added token
        self.special_ids = set(special_ids)           # ids that skip_special_tokens drops
        # tiktoken returns ranks; specials get ranks after the mergeable ones. to_id maps back.
        base = len(rank_to_id)
        specials_tt = {s: base + k for k, s in enumerate(self.added)}
        self.to_id = list(rank_to_id) + list(self.added.values())
        self.identity = self.to_id == list(range(len(self.to_id)))
        self.enc = tiktoken.Encoding(name=f"hf:{model_dir}", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=specials_tt)
        self.id_to_bytes = dict(rest)  # vocabulary entries no merge produces: decode only
        for b, r in ranks.items():
            self.id_to_bytes[rank_to_id[r]] = b
        for s, i in self.added.items():
            self.id_to_bytes[i] = s.encode("utf-8")
        self.vocab_size = max(self.id_to_bytes) + 1

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
        # The template kind follows the tokens the tokenizer has, not the architecture.
        self.chat_format = ("chatml" if "<|im_start|>" in self.added else
                            "llama3" if "<|start_header_id|>" in self.added else None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids; added/special tokens written in the text become their ids (as transformers does).
        add_special_tokens prepends what the tokenizer's post-processor adds (Llama 3: <|begin_of_text|>)."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        ids = self.enc.encode(text, allowed_special="all")
        if not self.identity:
            ids = [self.to_id[i] for i in ids]
        return (self.prefix_ids + ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        try:
            data = b"".join(self.id_to_bytes[i] for i in ids)
        except KeyError as e:
            raise ValueError(f"decode: id {e.args[0]} is not in the vocabulary (size {self.vocab_size})") from None
        text = data.decode("utf-8", errors="replace")
        if self.config.get("clean_up_tokenization_spaces") is True:
            # transformers' clean_up_tokenization (Llama 3's tokenizer_config turns it on)
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = False, date_string: str | None = None):
        """The conversation rendered as the model's chat template renders it (ChatML or Llama 3)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"apply_chat_template: message {i} needs string 'role' and 'content', got {m!r}")
        if self.chat_format == "chatml":
            text = self._chatml(messages, add_generation_prompt)
        elif self.chat_format == "llama3":
            text = self._llama3(messages, add_generation_prompt, date_string)
        else:
            raise UserError(f"{self.model_dir}: the tokenizer has neither <|im_start|> (ChatML) nor "
                            f"<|start_header_id|> (Llama 3) tokens, so no chat template applies; use an "
                            f"instruct model")
        return self.encode(text) if tokenize else text

    def _chatml(self, messages, add_generation_prompt):
        # <|im_start|>role\ncontent<|im_end|>\n per message; the template's default system message
        # (Qwen2: "You are a helpful assistant.") only when the conversation has none.
        out = []
        default = chatml_default_system(self.template)
        if default is not None and messages and messages[0]["role"] != "system":
            out.append(f"<|im_start|>system\n{default}<|im_end|>\n")
        for m in messages:
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def _llama3(self, messages, add_generation_prompt, date_string):
        # <|start_header_id|>role<|end_header_id|>\n\n content.strip() <|eot_id|>; 3.1+ always has a
        # system block with the knowledge-cutoff and date lines, the user's system message after them.
        preamble = llama3_system_preamble(self.template, date_string)
        out = [self.bos_token] if messages or preamble is not None else []  # 3.0 puts BOS on message 0
        if preamble is not None:
            system = ""
            if messages and messages[0]["role"] == "system":
                system, messages = messages[0]["content"].strip(), messages[1:]
            out.append(f"<|start_header_id|>system<|end_header_id|>\n\n{preamble}{system}<|eot_id|>")
        for m in messages:
            out.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
        if add_generation_prompt:
            out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
        return "".join(out)

    def save(self, out_dir: str) -> None:
        """Copy the tokenizer files, so out_dir loads as the same tokenizer (here and in transformers)."""
        os.makedirs(out_dir, exist_ok=True)
        for name in self.files:
            src = os.path.join(self.model_dir, name)
            if os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
                shutil.copyfile(src, os.path.join(out_dir, name))

    def __len__(self) -> int:
        return self.vocab_size


# --- reading the files ------------------------------------------------------------------------------
def _pattern_from_pre_tokenizer(pre: dict | None, where: str) -> str:
    """The split regex of a tokenizer.json pre_tokenizer: Split(Regex) + ByteLevel(use_regex=false),
    or ByteLevel(use_regex=true) alone, which means GPT-2's regex."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    pattern = None
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            if step.get("behavior") != "Isolated" or step.get("invert"):
                raise UserError(f"{where}: pre_tokenizer Split with behavior {step.get('behavior')} / invert "
                                f"{step.get('invert')} is not supported (only Isolated, not inverted)")
            pat = step.get("pattern", {})
            pattern = pat["Regex"] if "Regex" in pat else re.escape(pat.get("String", ""))
        elif kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise UserError(f"{where}: ByteLevel add_prefix_space=true is not supported")
            if step.get("use_regex", True):
                if pattern is not None:
                    raise UserError(f"{where}: a Split followed by ByteLevel(use_regex=true) is not supported")
                pattern = GPT2_PATTERN
        else:
            raise UserError(f"{where}: pre_tokenizer {kind!r} is not supported; only byte-level BPE "
                            f"tokenizers (GPT-2, Qwen2, Llama 3 style) are")
    if pattern is None:
        raise UserError(f"{where}: no ByteLevel pre_tokenizer; only byte-level BPE tokenizers are supported")
    return pattern


def _normalizer_is_nfc(norm: dict | None, where: str) -> bool:
    steps = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    kinds = [s.get("type") for s in steps]
    if any(k != "NFC" for k in kinds):
        raise UserError(f"{where}: normalizer {kinds} is not supported (only none or NFC)")
    return "NFC" in kinds


def _prefix_from_post_processor(post: dict | None, added: dict) -> list[int]:
    """Ids a TemplateProcessing post-processor puts before the text (Llama 3: <|begin_of_text|>)."""
    steps = post.get("processors", []) if post and post.get("type") == "Sequence" else [post] if post else []
    prefix = []
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            for piece in step.get("single", []):
                if "Sequence" in piece:
                    break
                tok = piece["SpecialToken"]["id"]
                prefix += step.get("special_tokens", {}).get(tok, {}).get("ids", [added.get(tok)])
    return prefix


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (tokenizer.json, vocab.json + merges.txt, or
    Llama 3's tiktoken tokenizer.model; with tokenizer_config.json)."""
    def path(name):
        return os.path.join(model_dir, name)

    config = _read_json(path("tokenizer_config.json")) if os.path.isfile(path("tokenizer_config.json")) else {}
    files = [n for n in TOKENIZER_FILES if os.path.isfile(path(n))]
    added, special_ids = {}, []
    for i, tok in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        added[tok["content"]] = int(i)
        if tok.get("special"):
            special_ids.append(int(i))
    nfc, prefix = False, []
    if os.path.isfile(path("tokenizer.json")):
        where = path("tokenizer.json")
        tj = _read_json(where)
        model = tj.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            raise UserError(f"{where}: model type {model.get('type')!r}{' with byte_fallback' if model.get('byte_fallback') else ''} "
                            f"is not supported; only byte-level BPE tokenizers (GPT-2, Qwen2, Llama 3) are")
        for tok in tj.get("added_tokens") or []:
            added.setdefault(tok["content"], tok["id"])
            if tok.get("special"):
                special_ids.append(tok["id"])
        vocab = {t: i for t, i in (model.get("vocab") or {}).items() if t not in added}
        ranks, rank_to_id, rest = ranks_from_merges(vocab, model.get("merges") or [], where,
                                                    bool(model.get("ignore_merges")))
        pattern = _pattern_from_pre_tokenizer(tj.get("pre_tokenizer"), where)
        nfc = _normalizer_is_nfc(tj.get("normalizer"), where)
        prefix = _prefix_from_post_processor(tj.get("post_processor"), added)
    elif os.path.isfile(path("vocab.json")) and os.path.isfile(path("merges.txt")):
        where = path("merges.txt")
        vocab = {t: i for t, i in _read_json(path("vocab.json")).items() if t not in added}
        with open(where, encoding="utf-8") as f:
            merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
        ranks, rank_to_id, rest = ranks_from_merges(vocab, merges, where)
        qwen = config.get("tokenizer_class", "").startswith("Qwen2")
        pattern, nfc = (QWEN2_PATTERN, True) if qwen else (GPT2_PATTERN, False)
        if config.get("add_bos_token") and _content(config.get("bos_token")) in added:
            prefix = [added[_content(config["bos_token"])]]
    elif os.path.isfile(path("tokenizer.model")):
        where = path("tokenizer.model")
        ranks = load_tiktoken_ranks(where)
        rank_to_id, rest = list(range(len(ranks))), {}
        if not added:  # Meta's own layout: no tokenizer_config, the specials follow the ranks
            added = {s: len(ranks) + k for k, s in enumerate(LLAMA3_SPECIALS)}
            added.update({f"<|reserved_special_token_{k}|>": len(ranks) + k + 9 for k in range(2, 256 - 9)})
            special_ids = list(added.values())
            config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", **config}
        pattern = LLAMA3_PATTERN
        if _content(config.get("bos_token")) in added:
            prefix = [added[_content(config["bos_token"])]]
    else:
        raise UserError(f"{model_dir} has no tokenizer.json, vocab.json + merges.txt or tokenizer.model; "
                        f"pass a complete Hugging Face model directory")
    # bos/eos/pad named in tokenizer_config.json but kept in the vocabulary (GPT-2's <|endoftext|>):
    # transformers treats them as special tokens, so do we.
    for key in ("bos_token", "eos_token", "pad_token"):
        tok = _content(config.get(key))
        if tok is not None and tok not in added:
            b = tok.encode("utf-8")
            i = next((i for i, v in rest.items() if v == b), None)
            if i is None and b in ranks and len(b) > 1:
                i = rank_to_id[ranks.pop(b)]
            if i is not None:
                added[tok] = i
                special_ids.append(i)
    merged_ids = {rank_to_id[r] for r in ranks.values()}
    for s, i in added.items():
        if i in merged_ids:
            raise UserError(f"{model_dir}: added token {s!r} has id {i}, which a merged token also has")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if os.path.isfile(path("chat_template.jinja")):  # transformers >= 4.50 saves it beside the config
        with open(path("chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    return Tokenizer(model_dir, ranks, rank_to_id, rest, pattern, added, special_ids, nfc, config, prefix,
                     template, files)


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
