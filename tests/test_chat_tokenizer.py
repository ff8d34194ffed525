"""lib/chat_tokenizer.py: byte-level BPE from tokenizer.json / vocab.json+merges.txt / tiktoken
tokenizer.model, specials, and the chat templates, against the real files of SmolLM2, Qwen2, Qwen2.5 and
Llama 3.0-3.3 (tests/fixtures/real/chat, goldens from the tokenizers library and transformers written by
tests/fixtures/make_chat_golden.py), against transformers' goldens on small trained tokenizers, and by hand."""
import base64
import copy
import datetime
import importlib.util
import json
import os
import random
import shutil

import pytest
import regex  # tiktoken's own dependency; an independent implementation of the split regexes
import tiktoken

from lib import chat_tokenizer as ct
from lib import tokenizer as gpt2_tokenizer
from lib.errors import UserError

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
GOLDEN = os.path.join(FIXTURES, "llama_golden")
TOKENIZERS = ["qwen2", "qwen2_5", "llama3_0", "llama3_1", "llama3_2"]
REAL = os.path.join(FIXTURES, "real", "chat")
REAL_MODELS = ["smollm2", "qwen2", "qwen2.5", "llama3.0", "llama3.1", "llama3.2", "llama3.3"]


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(GOLDEN, "tokenizer_golden.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def templates():
    with open(os.path.join(FIXTURES, "chat_templates.json")) as f:
        return json.load(f)


def _merge_bpe(word: bytes, priority: dict) -> list:
    """transformers' BPE: repeatedly apply the adjacent pair with the best merge priority."""
    parts = [bytes([b]) for b in word]
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: priority.get((parts[i], parts[i + 1]), float("inf")))
        if (parts[best], parts[best + 1]) not in priority:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def _reference_encode(text: str, tokenizer_json: dict, pattern: str) -> list:
    """A by-hand merge-priority encoder for a byte-level tokenizer.json (no specials)."""
    u2b = {c: b for b, c in ct.bytes_to_unicode().items()}
    to_bytes = lambda s: bytes(u2b[c] for c in s)
    model = tokenizer_json["model"]
    priority = {}
    for k, m in enumerate(model["merges"]):
        a, b = m.split(" ") if isinstance(m, str) else m
        priority.setdefault((to_bytes(a), to_bytes(b)), k)
    vocab = {to_bytes(t): i for t, i in model["vocab"].items()}
    return [vocab[p] for word in regex.findall(pattern, text) for p in _merge_bpe(word.encode(), priority)]


# --- against transformers ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", TOKENIZERS)
def test_encode_decode_and_chat_templates_match_transformers(golden, name):
    tok = ct.load_tokenizer(os.path.join(GOLDEN, "tokenizers", name))
    rec = golden["tokenizers"][name]
    for text, ids in zip(golden["texts"], rec["encode"]):
        assert tok.encode(text) == ids, text
        want = text if name.startswith("llama") else __import__("unicodedata").normalize("NFC", text)
        assert tok.decode(ids) == want
    for text, ids in zip(golden["texts"], rec["encode_special"]):
        assert tok.encode(text, add_special_tokens=True) == ids
    for text, want in zip(golden["texts"][-2:], rec["decode_skip"]):
        assert tok.decode(tok.encode(text, add_special_tokens=True), skip_special_tokens=True) == want
    for key, want in rec["chat"].items():
        conv, gen = key.split("|")
        msgs = golden["conversations"][conv]
        kw = dict(add_generation_prompt=gen == "True", date_string="26 Jul 2024")
        assert tok.apply_chat_template(msgs, **kw) == want["text"], key
        assert tok.apply_chat_template(msgs, tokenize=True, **kw) == want["ids"], key


def test_default_system_messages_are_read_from_the_template(golden, templates):
    assert ct.chatml_default_system(ct.CHATML_TEMPLATE) == "You are a helpful assistant."
    assert ct.chatml_default_system(templates["qwen2_5"]) == \
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert ct.chatml_default_system("{% for m in messages %}{{'<|im_start|>' + m['role'] }}{% endfor %}") is None
    assert ct.llama3_system_preamble(templates["llama3_0"], None) is None
    assert ct.llama3_system_preamble(templates["llama3_1"], None) == \
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    # Llama 3.2 asks for today's date (strftime_now), as transformers renders it
    import datetime
    today = datetime.datetime.now().strftime("%d %b %Y")
    assert ct.llama3_system_preamble(templates["llama3_2"], None).endswith(f"Today Date: {today}\n\n")
    tok = ct.load_tokenizer(os.path.join(GOLDEN, "tokenizers", "llama3_2"))
    assert f"Today Date: {today}" in tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_gpt2_at_full_scale_against_transformers(tmp_path):
    """50,000 merges: tokenizer.json rebuilt from data/gpt2.tiktoken, encoded by merge priority."""
    spec = importlib.util.spec_from_file_location("make_llama_golden", os.path.join(FIXTURES, "make_llama_golden.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    with open(os.path.join(GOLDEN, "gpt2_golden.json")) as f:
        golden = json.load(f)
    tj = maker.gpt2_tokenizer_json(gpt2_tokenizer.RANKS_PATH, list(base64.b64decode(golden["splits"])))
    assert len(tj["model"]["merges"]) == golden["n_merges"] == 50000
    with open(tmp_path / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    tok = ct.load_tokenizer(str(tmp_path))
    reference = gpt2_tokenizer.get_encoding()
    for text, ids in zip(golden["texts"], golden["ids"]):
        assert tok.encode(text) == ids
        assert reference.encode(text, allowed_special="all") == ids  # and tiktoken's own GPT-2 agrees


# --- built in the test: tokenizer.json, vocab.json + merges.txt, tokenizer.model --------------------
TRAIN = ["The quick brown fox jumps over the lazy dog. " * 3, "Score: 7/10\nFeedback: two words differ.",
         "It's we'll they've 12345 caf\u00e9 na\u00efve \u4eca\u5929 \U0001F600", "def f(x):\n    return x"] * 4
CHECK = ["The lazy fox's score: 10/10!", "  spaced  out\n\n\tend ", "caf\u00e9 vs cafe\u0301 \u4eca\u5929\u597d",
         "12345678 apples", "<|im_start|>user\nhi<|im_end|>\n", "no special <|im_start here"]


@pytest.fixture
def tiny(tmp_path):
    return ct.make_tiny_tokenizer(str(tmp_path / "tiny"), TRAIN, vocab_size=300), tmp_path / "tiny"


def test_tiny_tokenizer_round_trips_and_agrees_with_merge_priority_bpe(tiny):
    tok, d = tiny
    assert tok.vocab_size == 300 and tok.chat_format == "chatml"
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (299, 297, None)
    assert tok.stop_token_ids == [299, 297]
    tj = json.load(open(d / "tokenizer.json", encoding="utf-8"))
    rng = random.Random(0)
    alphabet = "abcdefghij ABC.,'\n0123456789\u00e9"
    texts = CHECK[:4] + ["".join(rng.choice(alphabet) for _ in range(60)) for _ in range(20)]
    for text in texts:
        import unicodedata
        text = unicodedata.normalize("NFC", text)
        assert tok.encode(text) == _reference_encode(text, tj, ct.QWEN2_PATTERN), text
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(CHECK[4])
    assert ids[0] == 298 and ids[-2] == 299 and tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert 298 not in tok.encode(CHECK[5])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) == \
        ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_ids_that_differ_from_merge_order_are_mapped_back(tiny, tmp_path):
    """Ranks follow merge priority; when the file's ids follow another order the ids still come out right."""
    tok, d = tiny
    tj = json.load(open(d / "tokenizer.json", encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    perm = list(range(256, 297))
    random.Random(1).shuffle(perm)
    new_id = {i: (perm[i - 256] if 256 <= i < 297 else i) for i in range(300)}
    tj["model"]["vocab"] = {t: new_id[i] for t, i in vocab.items()}
    tj["model"]["merges"] = [" ".join(m) for m in tj["model"]["merges"]]  # the older "a b" format
    out = tmp_path / "permuted"
    shutil.copytree(d, out)
    json.dump(tj, open(out / "tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
    permuted = ct.load_tokenizer(str(out))
    for text in CHECK:
        assert permuted.encode(text) == [new_id[i] for i in tok.encode(text)]
        assert permuted.decode(permuted.encode(text)) == tok.decode(tok.encode(text))


def test_vocab_json_and_merges_txt(tiny, tmp_path):
    tok, d = tiny
    tj = json.load(open(d / "tokenizer.json", encoding="utf-8"))
    out = tmp_path / "slow"
    out.mkdir()
    json.dump(tj["model"]["vocab"], open(out / "vocab.json", "w", encoding="utf-8"), ensure_ascii=False)
    with open(out / "merges.txt", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in tj["model"]["merges"]))
    shutil.copy(d / "tokenizer_config.json", out)  # tokenizer_class Qwen2Tokenizer: Qwen2's regex and NFC
    slow = ct.load_tokenizer(str(out))
    for text in CHECK:
        assert slow.encode(text) == tok.encode(text)
    cfg = json.load(open(out / "tokenizer_config.json"))
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # GPT-2's regex: digits stay together
    json.dump(cfg, open(out / "tokenizer_config.json", "w"))
    gpt2_style = ct.load_tokenizer(str(out))
    assert (slow.normalizer, gpt2_style.normalizer) == (["NFC"], [])
    for text in CHECK[:4]:
        assert gpt2_style.encode(text) == _reference_encode(text, tj, ct.GPT2_PATTERN)


def test_llama3_tiktoken_tokenizer_model(tmp_path, templates):
    """Llama 3's tokenizer.model ('base64 rank' lines), with and without a tokenizer_config.json."""
    merges = ct.train_bpe(TRAIN, 400)
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in merges:
        ranks.setdefault(a + b, len(ranks))
    d = tmp_path / "meta"
    d.mkdir()
    with open(d / "tokenizer.model", "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items())
    meta = ct.load_tokenizer(str(d))  # Meta's layout: specials numbered after the ranks
    n = len(ranks)
    assert meta.added["<|begin_of_text|>"] == n and meta.added["<|eot_id|>"] == n + 9
    assert meta.added["<|reserved_special_token_2|>"] == n + 11 and meta.vocab_size == n + 256
    direct = tiktoken.Encoding("llama3", pat_str=ct.LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})
    for text in CHECK + TRAIN[:4]:
        assert meta.encode(text) == direct.encode(text, disallowed_special=())
        assert meta.decode(meta.encode(text)) == text
    assert meta.encode("x", add_special_tokens=True)[0] == n
    assert meta.eos_token_id == n + 9
    # Meta's layout carries none; neither would transformers
    with pytest.raises(UserError, match="has no chat template"):
        meta.apply_chat_template([{"role": "user", "content": "x"}])
    # the HF layout: tokenizer_config.json's added_tokens_decoder and the real Llama 3.1 template
    specials = {str(n + k): {"content": s, "special": True} for k, s in enumerate(ct.LLAMA3_SPECIALS)}
    json.dump({"added_tokens_decoder": specials, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
               "chat_template": templates["llama3_1"]}, open(d / "tokenizer_config.json", "w"))
    hf = ct.load_tokenizer(str(d))
    msgs = [{"role": "system", "content": "Judge."}, {"role": "user", "content": " hi "}]
    text = hf.apply_chat_template(msgs, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                    "December 2023\nToday Date: 26 Jul 2024\n\nJudge.<|eot_id|><|start_header_id|>user"
                    "<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert ids[:2] == [n, n + 6] and hf.decode(ids) == text and hf.stop_token_ids == [n + 9, n + 8, n + 1]


def test_template_follows_the_special_tokens_not_the_architecture(tmp_path):
    d = tmp_path / "llama_with_chatml"
    shutil.copytree(os.path.join(GOLDEN, "tokenizers", "qwen2"), d)
    shutil.copy(os.path.join(GOLDEN, "models", "llama_tied", "config.json"), d)  # LlamaForCausalLM
    tok = ct.load_tokenizer(str(d))
    assert tok.chat_format == "chatml"
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]).startswith("<|im_start|>system\n")


def test_save_copies_the_files_and_loads_again(tiny, tmp_path):
    tok, _ = tiny
    tok.save(str(tmp_path / "copy"))
    again = ct.load_tokenizer(str(tmp_path / "copy"))
    assert sorted(os.listdir(tmp_path / "copy")) == ["tokenizer.json", "tokenizer_config.json"]
    assert again.encode(CHECK[0]) == tok.encode(CHECK[0]) and again.template == tok.template


def test_clear_errors(tmp_path, tiny):
    with pytest.raises(UserError, match="has no tokenizer.json, vocab.json"):
        ct.load_tokenizer(str(tmp_path))
    d = tmp_path / "sp"
    d.mkdir()
    (d / "tokenizer.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(UserError, match="sentencepiece tokenizer.model .* not supported"):
        ct.load_tokenizer(str(d))
    _, tiny_dir = tiny
    tj = json.load(open(tiny_dir / "tokenizer.json", encoding="utf-8"))
    tj["model"]["type"] = "Unigram"
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UserError, match="model type 'Unigram' is not supported"):
        ct.load_tokenizer(str(d))
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match=r"tokenizer.json line 1 column 2"):
        ct.load_tokenizer(str(d))
    tok = ct.load_tokenizer(str(tiny_dir))
    with pytest.raises(ValueError, match="message 0 needs string 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user"}])


def test_unmerged_vocabulary_entries_ignore_merges_and_eos_kept_in_the_vocab(tiny, tmp_path):
    tok, d = tiny
    tj = json.load(open(d / "tokenizer.json", encoding="utf-8"))
    tj["model"]["vocab"]["\u0120zqzq"] = 300  # " zqzq": no merge makes it
    tj["model"]["vocab"]["<|eos|>"] = 301  # a vocabulary entry tokenizer_config names as eos
    cfg = json.load(open(d / "tokenizer_config.json"))
    cfg["eos_token"] = "<|eos|>"
    out = tmp_path / "extra"
    out.mkdir()
    json.dump(cfg, open(out / "tokenizer_config.json", "w"))
    for ignore in (False, True):
        tj["model"]["ignore_merges"] = ignore
        json.dump(tj, open(out / "tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
        t = ct.load_tokenizer(str(out))
        ids = t.encode("a zqzq<|eos|>")
        assert (300 in ids) == ignore  # transformers' BPE never reaches it unless the word is looked up whole
        assert ids[-1] == 301 and t.eos_token_id == 301 and t.decode(ids) == "a zqzq<|eos|>"
        assert t.decode([300]) == " zqzq" and t.decode(ids, skip_special_tokens=True) == "a zqzq"


@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1"])
def test_prompt_tokens_are_a_prefix_of_the_conversation_tokens(name):
    """What prompt masking relies on: the tokens of (messages[:-1] + generation prompt) are exactly the
    first tokens of the whole conversation, so the rest are the assistant's."""
    tok = ct.load_tokenizer(os.path.join(GOLDEN, "tokenizers", name))
    for answer in ("Score: 7/10\nFeedback: good.", " leading space", "9"):
        msgs = [{"role": "user", "content": "Source: chat\nTranslation: cat"}, {"role": "assistant", "content": answer}]
        prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True)
        full = tok.apply_chat_template(msgs, tokenize=True)
        assert full[:len(prompt)] == prompt
        assert tok.decode(full[len(prompt):]) == (answer.strip() if name.startswith("llama") else answer) + \
            ("<|eot_id|>" if name.startswith("llama") else "<|im_end|>\n")
    # The one exception: an answer that starts with a newline joins the template's own "\n" in one
    # pre-token under ChatML (as in transformers), so the split point must come from the prompt's length
    # and the text, not from the tokens alone. Llama 3 trims the content, so it never happens there.
    msgs[1]["content"] = "\n\nstarts with newlines"
    prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True)
    full = tok.apply_chat_template(msgs, tokenize=True)
    assert (full[:len(prompt)] == prompt) == name.startswith("llama")


def test_train_bpe_equals_the_textbook_loop():
    """The incremental trainer learns the same merges as recounting every pair after every merge."""
    from collections import Counter
    texts = TRAIN + ["aaaa abab aaaa ababab la la la land", "\u00e9t\u00e9 \u00e9t\u00e9 caf\u00e9s"]
    words = Counter()
    for text in texts:
        for w in ct._TRAIN_SPLIT.findall(text):
            words[tuple(bytes([b]) for b in w.encode())] += 1
    want = []
    while 256 + len(want) < 330:
        pairs = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        best = min(pairs, key=lambda p: (-pairs[p], p)) if pairs else None
        if best is None or pairs[best] < 2:
            break
        want.append(best)
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if w[i:i + 2] == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    assert ct.train_bpe(texts, 330) == want and len(want) > 40


# --- real files: SmolLM2, Qwen2, Qwen2.5, Llama 3.0-3.3 (tests/fixtures/real/chat) ------------------------
@pytest.fixture(scope="module")
def real_golden():
    with open(os.path.join(REAL, "golden.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smol_json():
    with open(os.path.join(REAL, "smollm2", "tokenizer.json"), encoding="utf-8") as f:
        return json.load(f)


def _write_variant(tmp_path, tj, name="variant", config_from="smollm2"):
    d = tmp_path / name
    d.mkdir()
    with open(d / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    shutil.copy(os.path.join(REAL, config_from, "tokenizer_config.json"), d)
    return d


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_tokenizers_give_the_tokenizers_library_ids(real_golden, name):
    """Ids equal the tokenizers library's on the real file (whole for SmolLM2, a faithful excerpt of the
    9 MB Llama 3 / 7 MB Qwen files, checked equal on the whole file by make_chat_golden.py), decoding equal
    transformers' decode, with and without the post-processor's specials."""
    tok = ct.load_tokenizer(os.path.join(REAL, name))
    rec = real_golden["models"][name]
    for text, ids, with_special, dec, dec_skip in zip(real_golden["texts"], rec["encode"], rec["encode_special"],
                                                       rec["decode"], rec["decode_skip"]):
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=True) == with_special, text
        assert tok.decode(with_special) == dec
        assert tok.decode(with_special, skip_special_tokens=True) == dec_skip
    # Llama 3.1+'s TemplateProcessing puts <|begin_of_text|> first; this Llama 3.0 file's post-processor has none
    bos = [128000] if name.startswith("llama") and name != "llama3.0" else []
    assert rec["encode_special"][0] == bos + rec["encode"][0]


@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_chat_templates_render_as_transformers(real_golden, name):
    """apply_chat_template text and ids equal transformers' on the real template, for a lone user turn,
    a system turn, several turns, whitespace to trim, unicode and empty contents, with and without the
    generation prompt (Llama 3.1+: date_string given, as transformers passes it to the template)."""
    tok = ct.load_tokenizer(os.path.join(REAL, name))
    for key, want in real_golden["models"][name]["chat"].items():
        conv, gen = key.split("|")
        kw = dict(add_generation_prompt=gen == "True", date_string=real_golden["date_string"])
        assert tok.apply_chat_template(real_golden["conversations"][conv], **kw) == want["text"], key
        assert tok.apply_chat_template(real_golden["conversations"][conv], tokenize=True, **kw) == want["ids"], key


def test_real_template_families_and_their_defaults():
    """The default system messages and date lines are read from each real template, however its strings
    spell the newline: Qwen2's and SmolLM2's files hold a real newline inside the Jinja quotes, Qwen2.5's a
    backslash-n (the bug: only the second was found, so Qwen2's default system message was dropped)."""
    want = {"smollm2": ("chatml", {"system": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}),
            "qwen2": ("chatml", {"system": "You are a helpful assistant."}),
            "qwen2.5": ("qwen2_5", {"system": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}),
            "llama3.0": ("llama3_always_gen", {}),  # Llama 3's first template: the assistant header always
            "llama3.1": ("llama3_1", {"knowledge": "December 2023", "date": "26 Jul 2024"}),
            "llama3.2": ("llama3_2", {"knowledge": "December 2023", "date": "26 Jul 2024"}),
            "llama3.3": ("llama3_1", {"knowledge": "December 2023", "date": "26 Jul 2024"})}  # 3.3 ships 3.1's
    for name, (family, settings) in want.items():
        tok = ct.load_tokenizer(os.path.join(REAL, name))
        assert (tok.chat_format, tok.chat_settings) == (family, settings), name
    qwen2 = ct.load_tokenizer(os.path.join(REAL, "qwen2")).template
    assert "system\nYou are a helpful assistant.<|im_end|>\n' }}" in qwen2  # a real newline in the literal
    spellings = [qwen2, qwen2.replace("system\nYou", "system\\nYou"), ct.CHATML_TEMPLATE,
                 ct.CHATML_TEMPLATE.replace("'<|im_start|>system\\n", '"<|im_start|>system\\n').replace(
                     "assistant.<|im_end|>\\n'", 'assistant.<|im_end|>\\n"')]
    for template in spellings:
        assert ct.chatml_default_system(template) == "You are a helpful assistant.", template
    # Qwen2 base's template differs only in the message (no full stop): read, not assumed
    assert ct.chatml_default_system(qwen2.replace("assistant.<|im_end|>", "assistant<|im_end|>")) == \
        "You are a helpful assistant"
    llama31 = ct.load_tokenizer(os.path.join(REAL, "llama3.1")).template
    preamble = ct.llama3_system_preamble(llama31, None)
    assert preamble == "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    assert ct.llama3_system_preamble(llama31.replace("26 Jul 2024", "01 Jan 2025"), None).endswith("01 Jan 2025\n\n")


def test_llama3_2_writes_todays_date_unless_given():
    tok = ct.load_tokenizer(os.path.join(REAL, "llama3.2"))
    today = datetime.datetime.now().strftime("%d %b %Y")  # transformers' strftime_now("%d %b %Y")
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert f"Cutting Knowledge Date: December 2023\nToday Date: {today}\n\n<|eot_id|>" in text
    assert "Today Date: 26 Jul 2024\n" in ct.load_tokenizer(os.path.join(REAL, "llama3.1")).apply_chat_template(
        [{"role": "user", "content": "x"}])  # 3.1 / 3.3: the template's fixed default


def test_chat_template_jinja_wins_over_the_config_as_in_transformers(tmp_path):
    """llama3.1's tokenizer_config.json holds an older template; chat_template.jinja beside it wins."""
    d = tmp_path / "llama3.1"
    shutil.copytree(os.path.join(REAL, "llama3.1"), d)
    assert ct.load_tokenizer(str(d)).chat_format == "llama3_1"
    os.remove(d / "chat_template.jinja")
    assert ct.load_tokenizer(str(d)).chat_format == "llama3"  # the config's (Llama 3.0-style) template
    cfg = json.load(open(d / "tokenizer_config.json"))
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": ct.CHATML_TEMPLATE}]
    json.dump(cfg, open(d / "tokenizer_config.json", "w"))
    assert ct.load_tokenizer(str(d)).chat_format == "chatml"  # the list form: the "default" one


def test_templates_that_cannot_be_rendered_exactly_are_refused(tmp_path):
    qwen25 = ct.load_tokenizer(os.path.join(REAL, "qwen2.5"))
    with pytest.raises(UserError, match="tool use is not supported"):
        qwen25.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}])
    with pytest.raises(UserError, match="tool use is not supported"):
        ct.load_tokenizer(os.path.join(REAL, "llama3.1")).apply_chat_template(
            [{"role": "assistant", "content": "", "tool_calls": []}])
    d = tmp_path / "changed"
    shutil.copytree(os.path.join(REAL, "qwen2.5"), d)
    cfg = json.load(open(d / "tokenizer_config.json"))
    for changed in (cfg["chat_template"].replace("'<|im_end|>\\n' }}", "'<|im_end|>\\n\\n' }}", 1),  # one newline more
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}"):  # an unknown family
        cfg["chat_template"] = changed
        json.dump(cfg, open(d / "tokenizer_config.json", "w"))
        tok = ct.load_tokenizer(str(d))
        assert tok.chat_format is None
        with pytest.raises(UserError, match="not one this module renders exactly"):
            tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_smollm2_lacks_21_single_bytes_and_drops_them_as_the_tokenizers_library_does(real_golden, smol_json,
                                                                                         tmp_path):
    """SmolLM2's vocabulary has 235 of the 256 byte-level characters. The tokenizers library drops a byte
    it has no token for (no unk_token, no byte_fallback), before merging; with an unk_token each becomes
    <|endoftext|> (id 0), one per run with fuse_unk. Golden ids from the tokenizers library on the real file."""
    b2u = ct.bytes_to_unicode()
    missing = [b for b in range(256) if b2u[b] not in smol_json["model"]["vocab"]]
    assert len(missing) == 21 and missing[:6] == [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D]
    tok = ct.load_tokenizer(os.path.join(REAL, "smollm2"))
    text = "x\x04\x06\x13y"
    assert tok.encode(text) == tok.encode("x") + tok.encode("y")
    assert tok.decode(tok.encode(real_golden["texts"][17])) == real_golden["texts"][17].translate(
        {b: None for b in missing if b < 0x80})
    i = real_golden["texts"].index("Control bytes \x04 \x06 \x13 \x14 \x16 \x1d and\x04glued\x1d text, NUL \x00 and "
                                   "BEL \x07.")
    assert tok.encode(real_golden["texts"][i]) == real_golden["models"]["smollm2"]["encode"][i]
    for variant, zeros in (("unk_token", 3), ("unk_token_fused", 1)):
        tj = dict(smol_json, model=dict(smol_json["model"], **real_golden["variants"][variant]["change"]["model"]))
        unk = ct.load_tokenizer(str(_write_variant(tmp_path, tj, variant)))
        assert unk.encode(text).count(0) == zeros
        assert unk.encode(real_golden["texts"][i]) == real_golden["variants"][variant]["encode"][i]


def test_pre_tokenizer_and_normalizer_settings_on_the_real_vocabulary(real_golden):
    """Each Split behaviour (Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous, inverted),
    a String pattern, Digits with and without individual_digits, ByteLevel add_prefix_space, NFKC, a
    Sequence of normalisers, ignore_merges and unk: SmolLM2's real vocabulary under each setting, against
    the tokenizers library's ids on the same edit of the file. (The real file is loaded once and the
    edited component read with the loader's own reader, to keep the test fast.)"""
    base = ct.load_tokenizer(os.path.join(REAL, "smollm2"))
    for name, variant in real_golden["variants"].items():
        tok = copy.copy(base)
        tok._cache = {}
        change = variant["change"]
        if "pre_tokenizer" in change:
            tok.pre_tokenizer = ct.read_pre_tokenizer(change["pre_tokenizer"], name)
        if "normalizer" in change:
            tok.normalizer = ct.read_normalizer(change["normalizer"], name)
        for key, value in change.get("model", {}).items():
            setattr(tok, key, value)
        for text, ids in zip(real_golden["texts"], variant["encode"]):
            assert tok.encode(text) == ids, (name, text)


def test_split_behaviours_by_hand():
    spans = [(0, 1, False), (1, 2, True), (2, 3, True), (3, 5, False), (5, 6, True)]  # "a,,bc."
    piece = "a,,bc."
    assert ct.split_piece(piece, spans, "Isolated") == ["a", ",", ",", "bc", "."]
    assert ct.split_piece(piece, spans, "Removed") == ["a", "bc"]
    assert ct.split_piece(piece, spans, "MergedWithPrevious") == ["a,", ",", "bc."]
    assert ct.split_piece(piece, spans, "MergedWithNext") == ["a", ",", ",bc", "."]
    assert ct.split_piece(piece, spans, "Contiguous") == ["a", ",,", "bc", "."]


def test_unsupported_components_are_named_in_one_line(tiny, tmp_path):
    _, d = tiny
    base = json.load(open(d / "tokenizer.json", encoding="utf-8"))
    cases = [
        ({"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}},
         r"pre_tokenizer \['Metaspace'\] has no ByteLevel step"),
        ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, {"type": "ByteLevel"}]}},
         "pre_tokenizer 'Whitespace' is not supported"),
        ({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]}},
         "pre_tokenizer step 'Digits' after ByteLevel is not supported"),
        ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Sideways", "invert": False}},
         "no ByteLevel step"),
        ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}},
         "normalizer 'Lowercase' is not supported"),
        ({"post_processor": {"type": "RobertaProcessing"}}, "post_processor 'RobertaProcessing' is not supported"),
        ({"decoder": {"type": "Sequence", "decoders": []}}, "decoder 'Sequence' is not supported"),
        ({"model": dict(base["model"], type="WordPiece")}, "model type 'WordPiece' is not supported"),
        ({"model": dict(base["model"], dropout=0.1)}, "BPE dropout 0.1 is not supported"),
        ({"added_tokens": [dict(base["added_tokens"][0], rstrip=True)]}, "with rstrip=true is not supported"),
    ]
    for n, (change, message) in enumerate(cases):
        out = tmp_path / f"bad{n}"
        shutil.copytree(d, out)
        json.dump(dict(base, **change), open(out / "tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
        with pytest.raises(UserError, match=message) as err:
            ct.load_tokenizer(str(out))
        assert "\n" not in str(err.value) and "tokenizer.json" in str(err.value)
