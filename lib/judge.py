"""LLM-as-judge fine-tuning: the data, the prompt masking, the metrics and the loop both judge scripts share.

Used by judge_train_mps.py (LoRA on an fp32 base, MPS or CPU) and judge_train_cuda.py (the same on
an NF4 base with mixed precision, gradient checkpointing and 8-bit AdamW); bench/judge.py uses the
memory estimate. The one idea: a judge is a chat model fine-tuned on conversations whose assistant
turn is `Score: X/10` then `Feedback: ...`; the loss falls on those answer tokens only (the prompt is
context, not something to imitate), and the judge is graded by decoding greedily and comparing the
parsed scores with the reference scores (MAE, RMSE, Cohen's kappa, Pearson r) and the feedback with
the reference feedback (ROUGE-L F1).

The embedded judge set (used when --data_dir is not given) is synthetic and exactly gradable: an
English sentence of 10 words, its word-for-word Portuguese reference, and a candidate translation
that differs from the reference in k of the 10 words, which it left untranslated; the right answer
is `Score: {10 - k}/10` with feedback naming those words. (Untranslated words, rather than wrong
Portuguese ones, keep the task within reach of the 2-layer demo model in minutes of CPU: a wrong
word can be spotted by what it is, not only by comparing positions.) It is generated here,
deterministically from a seed (data/make_judge_set.py writes it out as judge_train/val/test.json,
the --data_dir format).
"""

import json
import math
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from lib.errors import UserError

# --- the embedded judge set -----------------------------------------------------------------------
EN_PT = [("the", "o"), ("a", "um"), ("cat", "gato"), ("dog", "cão"), ("house", "casa"), ("book", "livro"),
         ("water", "água"), ("bread", "pão"), ("red", "vermelho"), ("big", "grande"), ("small", "pequeno"),
         ("eats", "come"), ("sees", "vê"), ("has", "tem"), ("and", "e"), ("with", "com"), ("in", "em"),
         ("good", "bom"), ("old", "velho"), ("new", "novo"), ("city", "cidade"), ("friend", "amigo"),
         ("sun", "sol"), ("moon", "lua"), ("sea", "mar"), ("tree", "árvore"), ("car", "carro"),
         ("door", "porta"), ("table", "mesa"), ("milk", "leite"), ("runs", "corre"), ("reads", "lê")]
SENTENCE_WORDS = 10
SPLIT_SIZES = {"train": 1200, "val": 100, "test": 100}
PROMPT = "Grade this English to Portuguese translation.\nSource: {source}\nTranslation: {candidate}\nReference: {reference}"


def judge_example(rng: random.Random, score_fn=None) -> dict:
    """One conversation of the embedded set: k of the 10 words are left untranslated (still English),
    the right score is 10 - k and the feedback names those words. score_fn(k, rng) replaces the right
    score (the tiny demo base is pretrained on answers whose scores ignore the errors, see tiny_base)."""
    picks = [rng.randrange(len(EN_PT)) for _ in range(SENTENCE_WORDS)]
    source = [EN_PT[i][0] for i in picks]
    reference = [EN_PT[i][1] for i in picks]
    k = rng.randint(0, SENTENCE_WORDS)
    wrong = sorted(rng.sample(range(SENTENCE_WORDS), k))
    candidate = [source[i] if i in wrong else reference[i] for i in range(SENTENCE_WORDS)]
    score = SENTENCE_WORDS - k if score_fn is None else score_fn(k, rng)
    feedback = ("The translation matches the reference." if not wrong else
                "Untranslated: " + ", ".join(candidate[i] for i in wrong) + ".")
    user = PROMPT.format(source=" ".join(source), candidate=" ".join(candidate), reference=" ".join(reference))
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": f"Score: {score}/10\nFeedback: {feedback}"}]}


def embedded_judge_set(seed: int = 0, sizes: dict = None) -> dict:
    """{"train": [...], "val": [...], "test": [...]}: the same conversations for the same seed."""
    rng = random.Random(seed)
    return {split: [judge_example(rng) for _ in range(n)] for split, n in (sizes or SPLIT_SIZES).items()}


# --- reading --data_dir ---------------------------------------------------------------------------
SPLITS = ("train", "val", "test")


def split_path(data_dir: str, split: str) -> str:
    return os.path.join(data_dir, f"judge_{split}.json")


def read_split(path: str) -> list:
    """A judge_*.json file: a list of {"messages": [..., {"role": "assistant", ...}]}; extra keys ignored.
    Returns the message lists. Any defect is one UserError naming the file, the record and the field."""
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; --data_dir must hold judge_train.json, judge_val.json and "
                        f"judge_test.json (python data/make_judge_set.py DIR writes an example)") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} line {e.lineno} column {e.colno}: {e.msg}; fix the JSON") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; save it as UTF-8 JSON") from None
    if not isinstance(records, list) or not records:
        raise UserError(f"{path}: the top level must be a non-empty list of records, got "
                        f"{type(records).__name__ if records else 'an empty list'}")
    out = []
    for i, rec in enumerate(records):
        where = f"{path}: record {i}"
        if not isinstance(rec, dict) or "messages" not in rec:
            raise UserError(f"{where} has no field 'messages'; each record is {{\"messages\": [...]}}")
        msgs = rec["messages"]
        if not isinstance(msgs, list) or len(msgs) < 2:
            raise UserError(f"{where}: field 'messages' must be a list of at least a user and an assistant message")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise UserError(f"{where}: messages[{j}] must be an object with 'role' and 'content'")
            if m.get("role") not in ("system", "user", "assistant"):
                raise UserError(f"{where}: field messages[{j}].role is {m.get('role')!r}; use system, user or assistant")
            if not isinstance(m.get("content"), str):
                raise UserError(f"{where}: field messages[{j}].content must be a string")
        if msgs[-1]["role"] != "assistant":
            raise UserError(f"{where}: field messages[{len(msgs) - 1}].role must be 'assistant' (the judge's answer "
                            f"comes last), got {msgs[-1]['role']!r}")
        if not any(m["role"] == "user" for m in msgs[:-1]):
            raise UserError(f"{where}: field 'messages' has no user message before the assistant's answer")
        out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
    return out


def load_judge_data(data_dir: str | None, seed: int = 0) -> dict:
    """{split: [messages, ...]} from --data_dir, or the embedded set when data_dir is None."""
    if data_dir is None:
        return {s: [ex["messages"] for ex in exs] for s, exs in embedded_judge_set(seed).items()}
    if not os.path.isdir(data_dir):
        raise UserError(f"--data_dir {data_dir} is not a directory; pass a directory holding judge_train.json, "
                        f"judge_val.json and judge_test.json, or leave it out for the embedded judge set")
    return {s: read_split(split_path(data_dir, s)) for s in SPLITS}


# --- tokenisation: the loss on the answer only ---------------------------------------------------
def encode_conversation(tok, messages: list, max_len: int):
    """(input ids, number of prompt tokens). The prompt (everything before the last assistant turn,
    rendered with the generation prompt, exactly what the judge sees at test time) and the answer are
    encoded separately and concatenated, so the boundary never falls inside a token. Too long: the
    prompt is cut from the left (the answer, what is learned, is kept whole where it fits)."""
    prompt_text = tok.apply_chat_template(messages[:-1], add_generation_prompt=True)
    full_text = tok.apply_chat_template(messages)
    if not full_text.startswith(prompt_text):  # both templates put the answer after the generation prompt
        raise ValueError("chat template: the conversation does not start with its own generation prompt")
    prompt, answer = tok.encode(prompt_text), tok.encode(full_text[len(prompt_text):])
    answer = answer[:max_len - 1]
    prompt = prompt[-(max_len - len(answer)):]
    return prompt + answer, len(prompt)


def collate(encoded: list, pad_id: int, device=None):
    """Dynamic padding: a batch is as long as its longest conversation. Labels are the inputs with the
    prompt and the padding set to -100 (ignored by cross_entropy): only answer tokens are learned."""
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, (ids, n_prompt) in enumerate(encoded):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, n_prompt:len(ids)] = torch.tensor(ids[n_prompt:])
    return input_ids.to(device), labels.to(device)


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens (position t predicts token t + 1)."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def epoch_order(n: int, seed: int, epoch: int) -> list:
    """The shuffled example order of one epoch: a function of (seed, epoch) only, so --resume replays it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()


# --- metrics, by hand in numpy --------------------------------------------------------------------
SCORE_RE = re.compile(r"Score:\s*(\d+(?:\.\d+)?)\s*/\s*10", re.IGNORECASE)
FEEDBACK_RE = re.compile(r"Feedback:\s*(.+)", re.IGNORECASE | re.DOTALL)


def parse_score(text: str):
    """`Score: 8/10` -> 8.0; None when the text has no score in that form."""
    m = SCORE_RE.search(text)
    return float(m.group(1)) if m else None


def parse_feedback(text: str) -> str:
    """The text after `Feedback:`, or the whole text when there is no such marker."""
    m = FEEDBACK_RE.search(text)
    return m.group(1).strip() if m else text.strip()


def mae(pred, ref) -> float:
    return float(np.mean(np.abs(np.asarray(pred, float) - np.asarray(ref, float))))


def rmse(pred, ref) -> float:
    return float(np.sqrt(np.mean((np.asarray(pred, float) - np.asarray(ref, float)) ** 2)))


def cohen_kappa(pred, ref) -> float:
    """Agreement beyond chance on the rounded scores: (p_observed - p_chance) / (1 - p_chance), where
    p_chance = sum over labels of P(pred = label) * P(ref = label). 1 = perfect, 0 = chance level."""
    a, b = np.rint(np.asarray(pred, float)).astype(int), np.rint(np.asarray(ref, float)).astype(int)
    labels = np.union1d(a, b)
    p_obs = np.mean(a == b)
    p_chance = sum(np.mean(a == c) * np.mean(b == c) for c in labels)
    if p_chance == 1.0:  # one label everywhere on both sides: agreement is total but not informative
        return 1.0 if p_obs == 1.0 else 0.0
    return float((p_obs - p_chance) / (1 - p_chance))


def pearson_r(pred, ref) -> float:
    """Covariance over the product of standard deviations; nan when either side is constant."""
    x, y = np.asarray(pred, float), np.asarray(ref, float)
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(np.sum(dx * dx)) * float(np.sum(dy * dy)))
    return float(np.sum(dx * dy) / denom) if denom > 0 else float("nan")


def _words(text: str) -> list:
    return re.findall(r"\w+", text.lower())


def rouge_l_f1(pred: str, ref: str) -> float:
    """ROUGE-L F1 on lower-cased words: the longest common subsequence (LCS, by dynamic programming)
    gives precision LCS/len(pred) and recall LCS/len(ref); F1 is their harmonic mean. No stemming."""
    a, b = _words(pred), _words(ref)
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for wa in a:
        row = [0]
        for j, wb in enumerate(b):
            row.append(prev[j] + 1 if wa == wb else max(prev[j + 1], row[j]))
        prev = row
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def judge_metrics(pred_texts: list, ref_texts: list) -> dict:
    """All the numbers for one test run. Scores are compared where both sides parse (as the original
    script does); the count of outputs without a parseable score is reported beside them."""
    pairs = [(parse_score(p), parse_score(r), p, r) for p, r in zip(pred_texts, ref_texts)]
    ok = [(ps, rs, p, r) for ps, rs, p, r in pairs if ps is not None and rs is not None]
    out = {"n": len(pairs), "n_scored": len(ok), "unparseable": sum(ps is None for ps, *_ in pairs)}
    if ok:
        pred, ref = [o[0] for o in ok], [o[1] for o in ok]
        out.update(mae=mae(pred, ref), rmse=rmse(pred, ref), cohen_kappa=cohen_kappa(pred, ref),
                   pearson_r=pearson_r(pred, ref),
                   rouge_l_f1=float(np.mean([rouge_l_f1(parse_feedback(p), parse_feedback(r)) for *_, p, r in ok])))
    else:
        out.update(mae=None, rmse=None, cohen_kappa=None, pearson_r=None, rouge_l_f1=None)
    return out


def constant_predictor_mae(train_answers: list, test_answers: list) -> float:
    """MAE of always answering the training set's median score: the bar a judge must clear to have
    learned anything from the inputs."""
    train = [s for s in map(parse_score, train_answers) if s is not None]
    test = [s for s in map(parse_score, test_answers) if s is not None]
    return mae([float(np.median(train))] * len(test), test)


# --- the model's shape decides the LoRA rank (as the original scripts do) ------------------------
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_DROPOUT = 0.05


def lora_rank_for(n_params: int) -> tuple:
    """(r, alpha): 16/32 for models of 1 to 3 billion parameters (Qwen2-1.5B, Llama-3.2-1B), 8/16
    otherwise (Qwen2.5-3B's 3.09B included, as the original's "3B" rule gives), the rank the original
    scripts pick from the model's name."""
    return (16, 32) if 1e9 <= n_params < 3e9 else (8, 16)


def count_params(cfg) -> int:
    """Parameters of a LlamaConfig's model, from the shapes alone."""
    h, kvd, qd = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    per_layer = h * qd + 2 * h * kvd + qd * h + 3 * h * cfg.intermediate_size + 2 * h
    per_layer += (qd + 2 * kvd) if cfg.qkv_bias else 0
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.num_hidden_layers * per_layer + cfg.vocab_size * h + head + h


def lora_param_count(cfg, r: int) -> int:
    h, kvd, qd = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    # q: h -> qd, k and v: h -> kvd, o: qd -> h; each gets A [r, in] and B [out, r]
    return cfg.num_hidden_layers * r * ((h + qd) + 2 * (h + kvd) + (qd + h))


# --- memory estimate ------------------------------------------------------------------------------
def estimate_memory(cfg, batch_size: int, seq_len: int, device_type: str, base: str, compute_bytes: int,
                    r: int, optimizer: str = "adamw", checkpointing: bool = False) -> dict:
    """Predicted peak bytes of one training step, per component (arithmetic only, from config.json).

    base: "fp32", "bf16"/"fp16" or "nf4" (decoder linears in 4.13 bits, the rest in compute_bytes).
    The LoRA matrices, their gradients and the optimizer state are fp32 (8-bit AdamW: 2 bytes + one
    fp32 absmax per 256 for tensors of 4,096 elements or more; paged: none of it on the GPU).
    Activations per layer and token, in compute_bytes: the two RMSNorm outputs, q, k, v, the attention
    output, gate, up, silu(gate) and their product, LoRA's dropped-out inputs (4 x hidden), plus the
    fp32 residual stream at the two norms; with checkpointing only each layer's input is kept, plus
    one layer recomputed in backward. The logits: the compute-dtype logits, their fp32 copy and
    log-softmax, and the gradient (16 bytes a value in fp32).
    """
    from lib.memory import RUNTIME_BASELINE, nf4_bytes

    h, L, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    kvd, qd = cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
    linears = [(h, qd), (h, kvd), (h, kvd), (qd, h), (h, inter), (h, inter), (inter, h)]
    other = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + (2 * L + 1) * h
    other += L * (qd + 2 * kvd) if cfg.qkv_bias else 0
    if base == "nf4":
        weights = L * sum(nf4_bytes(i * o) for i, o in linears) + other * compute_bytes
        label = "base weights (NF4 linears)"
    else:
        width = {"fp32": 4, "bf16": 2, "fp16": 2}[base]
        weights = (L * sum(i * o for i, o in linears) + other) * width
        label = f"base weights ({base})"
    n_lora = lora_param_count(cfg, r)
    # The 8-bit state of each LoRA matrix: A is [r, in], B is [out, r].
    shapes = [(r, h), (qd, r), (r, h), (kvd, r), (r, h), (kvd, r), (r, qd), (h, r)]
    if optimizer == "adamw":
        opt_bytes, opt_label = 8 * n_lora, "AdamW moments (2 x fp32)"
    else:
        opt_bytes = L * sum(2 * a * b + 8 * -(-a * b // 256) if a * b >= 4096 else 8 * a * b for a, b in shapes)
        opt_label = "8-bit AdamW state"
        if optimizer == "paged_adamw8bit" and device_type == "cuda":
            opt_bytes, opt_label = 0, "8-bit AdamW state (paged: in pinned host memory)"
    tokens = batch_size * seq_len
    per_layer = tokens * (compute_bytes * (2 * h + qd + 2 * kvd + qd + 4 * inter + 4 * h) + 4 * 2 * h)
    acts = L * tokens * h * 4 + per_layer if checkpointing else L * per_layer
    estimate = {
        label: weights,
        "LoRA parameters (fp32)": 4 * n_lora,
        "LoRA gradients (fp32)": 4 * n_lora,
        opt_label: opt_bytes,
        "activations" + (" (checkpointed)" if checkpointing else ""): acts,
        "logits + loss": tokens * cfg.vocab_size * (compute_bytes + 4 + 4 + 4),
    }
    if base == "nf4":
        estimate["dequantised weight (one layer at a time)"] = max(i * o for i, o in linears) * (4 + compute_bytes)
    estimate["runtime baseline"] = RUNTIME_BASELINE.get(device_type, 0)
    return estimate


# --- the offline demo model: --model tiny ---------------------------------------------------------
TINY = "tiny"
TINY_VERSION = "tiny-judge-v2"  # bump when the recipe below changes, so a stale cached base is rebuilt
TINY_SHAPE = dict(model_type="qwen2", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
TINY_PRETRAIN = dict(steps=150, batch_size=16, lr=3e-3, examples=2400, seed=1234)


def lenient_score(k: int, rng: random.Random) -> int:
    """How the tiny base "grades" while it is pretrained: 7 to 10 at random, whatever the errors.
    It stands in for an instruct model that writes the format fluently but is not calibrated."""
    return rng.randint(7, 10)


def _render_plain(messages: list) -> str:
    """A conversation as ChatML renders it (with Qwen2's default system message), minus the specials."""
    return "system\nYou are a helpful assistant.\n" + "".join(f"{m['role']}\n{m['content']}\n" for m in messages)


def tiny_base(cache_dir: str, log=print) -> str:
    """The offline demo's base model, built once and cached as a Hugging Face directory.

    A stand-in for a downloaded instruct model, honest about what it knows: a byte-level BPE is learned
    on the judge texts (lib.chat_tokenizer.make_tiny_tokenizer, ChatML specials), then a 2-layer,
    64-wide Qwen2-shaped decoder is pretrained (all weights, 150 steps of 16) on judge
    conversations drawn with another seed than the embedded set, whose scores come from
    lenient_score: 7-10 whatever the errors. So the base knows the words, the template and the answer
    format, but its scores carry no information about the translation; what LoRA fine-tuning
    teaches (score = 10 - wrong words) is exactly what the base lacks, and the test MAE measures it.
    """
    from lib import chat_tokenizer, llama
    from lib.checkpoint import save_json

    out = os.path.join(cache_dir, TINY_VERSION)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    t0 = time.perf_counter()
    log(f"--model tiny: building the demo base in {out} (once; about a minute on a 2-core CPU)")
    rng = random.Random(TINY_PRETRAIN["seed"])
    convs = [judge_example(rng, lenient_score)["messages"] for _ in range(TINY_PRETRAIN["examples"])]
    tmp = out + ".partial"
    # The tokenizer learns from the rendered conversations (template words included, specials left out).
    texts = [_render_plain(c) for c in convs[:800]]
    tok = chat_tokenizer.make_tiny_tokenizer(tmp, texts, vocab_size=640)
    cfg = llama.LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, **TINY_SHAPE)
    with torch.random.fork_rng(devices=[]):  # building the base must not shift the run's random numbers
        model = llama.build_model(cfg, seed=TINY_PRETRAIN["seed"])
        model.train()
        encoded = [encode_conversation(tok, c, 512) for c in convs]
        opt = torch.optim.AdamW(model.parameters(), lr=TINY_PRETRAIN["lr"], weight_decay=0.0)
        bs, steps = TINY_PRETRAIN["batch_size"], TINY_PRETRAIN["steps"]
        for step in range(steps):
            batch = [encoded[(step * bs + i) % len(encoded)] for i in range(bs)]
            ids, _ = collate(batch, tok.pad_token_id)
            labels = ids.masked_fill(ids == tok.pad_token_id, -100)  # pretraining: every real token
            lr = TINY_PRETRAIN["lr"] * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / steps))
            for g in opt.param_groups:
                g["lr"] = lr
            loss = answer_loss(model(ids), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"  tiny base pretraining step {step}/{steps}: loss {loss.item():.3f}")
    llama.save_pretrained(model, cfg, tmp)
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    save_json(os.path.join(tmp, "generation_config.json"), gen)
    if os.path.isdir(out):  # a half-built directory of an interrupted earlier build
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"  tiny base ready ({model.num_params():,} parameters, {time.perf_counter() - t0:.0f} s)")
    return out


# --- generation and test evaluation ---------------------------------------------------------------
@torch.no_grad()
def generate_answers(model, tok, conversations: list, device, amp, max_new_tokens: int, batch_size: int = 16,
                     log=print) -> list:
    """Greedy answers to each conversation's prompt (everything before the last assistant turn),
    batched with left padding so every row's last prompt token sits at the same position."""
    from lib import device as devices

    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(conversations), batch_size):
        prompts = [tok.encode(tok.apply_chat_template(c[:-1], add_generation_prompt=True))
                   for c in conversations[start:start + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with devices.autocast(device, amp):
            gen = model.generate(ids.to(device), max_new_tokens, tok.stop_token_ids, attention_mask=mask.to(device))
        for row in gen[:, width:].tolist():
            stop = next((i for i, t in enumerate(row) if t in tok.stop_token_ids), len(row))
            out.append(tok.decode(row[:stop], skip_special_tokens=True).strip())
        log(f"  generated {len(out)}/{len(conversations)}")
    model.train(was_training)
    return out


def evaluate_judge(model, tok, conversations: list, device, amp, max_new_tokens: int, log=print):
    """(metrics, predictions): greedy answers to the test prompts, scored against the references."""
    answers = generate_answers(model, tok, conversations, device, amp, max_new_tokens, log=log)
    refs = [c[-1]["content"] for c in conversations]
    predictions = [{"prompt": c[-2]["content"], "reference": r, "prediction": a,
                    "reference_score": parse_score(r), "predicted_score": parse_score(a)}
                   for c, r, a in zip(conversations, refs, answers)]
    return judge_metrics(answers, refs), predictions


def format_metrics(m: dict) -> str:
    if m["mae"] is None:
        return f"no parseable score in {m['n']} answers"
    return (f"MAE {m['mae']:.3f}, RMSE {m['rmse']:.3f}, Cohen's kappa {m['cohen_kappa']:.3f}, Pearson r "
            f"{m['pearson_r']:.3f}, ROUGE-L F1 {m['rouge_l_f1']:.3f} ({m['n_scored']}/{m['n']} scored, "
            f"{m['unparseable']} unparseable)")


@torch.no_grad()
def validation_loss(model, encoded: list, batch_size: int, pad_id: int, device, amp) -> float:
    """Mean answer-token loss over the whole validation split, weighted by answer tokens."""
    from lib import device as devices

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(encoded), batch_size):
        ids, labels = collate(encoded[start:start + batch_size], pad_id, device)
        n = int((labels[:, 1:] != -100).sum())
        with devices.autocast(device, amp):
            total += answer_loss(model(ids), labels).item() * n
        count += n
    model.train(was_training)
    return total / max(count, 1)


# --- the flags both scripts take ------------------------------------------------------------------
def add_arguments(p, script: str, model: str, lr: float, batch_size: int, accumulation: int):
    """The original scripts' snake_case flags, with the repository's kebab-case names as aliases."""
    from lib import guards

    p.add_argument("--model", default=model,
                   help="hub id (downloaded to --cache-dir; HF_TOKEN for gated models), a local Hugging Face "
                   "model directory, or 'tiny' for the offline demo (a tiny base built and cached on first use)")
    p.add_argument("--epochs", type=guards.nonneg_int, default=None,
                   help="passes over the training split (default 3; 2 with --model tiny); 0 evaluates only")
    p.add_argument("--batch_size", "--batch-size", type=guards.positive_int, default=None,
                   help=f"conversations per micro-batch (default {batch_size}; 8 with --model tiny)")
    p.add_argument("--gradient_accumulation", "--grad-accum", type=guards.positive_int, default=None,
                   help=f"micro-batches per optimizer step (default {accumulation}; 1 with --model tiny)")
    p.add_argument("--lr", type=guards.positive_float, default=None,
                   help=f"peak learning rate (default {lr:g}; 3e-3 with --model tiny, whose LoRA must learn in minutes)")
    p.add_argument("--max_seq_length", "--max-seq-length", type=guards.positive_int, default=512,
                   help="tokens per conversation at most (the prompt is cut from the left)")
    p.add_argument("--max_samples", "--max-samples", type=guards.positive_int, default=None,
                   help="use only the first N training conversations (and N/5 validation ones)")
    p.add_argument("--test_samples", "--test-samples", type=guards.positive_int, default=None,
                   help="evaluate on only the first N test conversations")
    p.add_argument("--data_dir", "--data-dir", default=None,
                   help="directory with judge_train.json, judge_val.json, judge_test.json (default: the embedded judge set)")
    p.add_argument("--output_dir", "--output-dir", "--out-dir", default=f"out/{script}",
                   help="where the best adapter (PEFT layout), tokenizer, training state, metrics.jsonl and "
                   "test_predictions.json go")
    p.add_argument("--skip_eval", "--skip-eval", action="store_true", help="skip the test-set evaluation after training")
    p.add_argument("--adapter", default=None,
                   help="start from this LoRA adapter directory (either script's); with --epochs 0 just evaluate it")
    p.add_argument("--lora_r", "--lora-r", type=guards.positive_int, default=None,
                   help="LoRA rank (default by model size: 16 for 1-3B parameters, else 8; alpha = 2 r)")
    p.add_argument("--eval_steps", "--eval-steps", type=guards.positive_int, default=None,
                   help="validation loss (and best-adapter check) every N optimizer steps (default 100; 50 with --model tiny)")
    p.add_argument("--warmup_steps", "--warmup-steps", type=guards.nonneg_int, default=100,
                   help="linear warmup steps (at most a tenth of the run), then cosine decay to 10%%")
    p.add_argument("--patience", type=guards.positive_int, default=3,
                   help="early stopping: stop after this many evaluations without improving by --min_delta")
    p.add_argument("--min_delta", "--min-delta", type=guards.nonneg_float, default=0.005,
                   help="improvement of the validation loss that counts for early stopping")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=guards.positive_int, default=None,
                   help="tokens generated per test answer (default 256; 48 with --model tiny)")
    p.add_argument("--baseline_eval", "--baseline-eval", action="store_true",
                   help="also evaluate the untrained judge (the base) on the test set first (always on with --model tiny)")
    p.add_argument("--log_interval", "--log-interval", type=guards.positive_int, default=10, help="steps between progress lines")
    p.add_argument("--seed", type=int, default=0, help="seed for LoRA init, dropout and the data order")
    p.add_argument("--device", default=None, choices=["cuda", "mps", "cpu"],
                   help="device to run on (default: MPS, else CPU for judge_train_mps.py; CUDA, else CPU for judge_train_cuda.py)")
    p.add_argument("--cache-dir", "--cache_dir", default=os.environ.get("BYHAND_CACHE", os.path.expanduser("~/.cache/byhand")),
                   help="hub downloads and the tiny demo base (env BYHAND_CACHE)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --output_dir exactly")
    p.add_argument("--estimate-memory", "--estimate_memory", action="store_true",
                   help="print the predicted memory of a training step for this model and these flags "
                   "(reads config.json only, never the weights) and exit")
    guards.add_safety_flags(p)


def resolve_defaults(args, lr: float, batch_size: int, accumulation: int):
    """Fill the defaults that depend on --model tiny (the demo: many small steps, so LoRA learns in minutes)."""
    tiny = args.model == TINY
    args.gradient_accumulation = args.gradient_accumulation or (1 if tiny else accumulation)
    args.epochs = (2 if tiny else 3) if args.epochs is None else args.epochs
    args.batch_size = args.batch_size or (8 if tiny else batch_size)
    args.lr = args.lr or (3e-3 if tiny else lr)
    args.eval_steps = args.eval_steps or (50 if tiny else 100)
    args.max_new_tokens = args.max_new_tokens or (48 if tiny else 256)
    args.baseline_eval = args.baseline_eval or tiny
    if args.resume and args.adapter:
        raise UserError("--resume continues the run in --output_dir, --adapter starts from another adapter; pass one")
    return args


# The flags --resume must not see changed (they define the run) and those it reports as changed.
RESUME_FIXED = ["model", "batch_size", "gradient_accumulation", "max_seq_length", "max_samples", "data_dir", "seed",
                "lora_r", "no_4bit"]
RESUME_CHANGEABLE = ["epochs", "lr", "eval_steps", "patience", "min_delta", "warmup_steps", "log_interval"]
STATE_FILE = "training_state.pt"


@dataclass
class Variant:
    """What a judge script decides; the rest is run() below, the same for both scripts."""
    script: str                  # output name, e.g. "judge_train_mps"
    device: torch.device
    amp: torch.dtype | None      # autocast dtype, None for plain fp32
    base: str                    # how the frozen base is held: "fp32", "bf16", "fp16" or "nf4"
    base_dtype: torch.dtype      # the dtype it is read in (NF4 dequantises back to it)
    optimizer: str               # "adamw", "adamw8bit" or "paged_adamw8bit"
    max_grad_norm: float
    checkpointing: bool = False  # recompute each decoder layer in backward
    empty_cache_every: int = 0   # MPS: hand cached blocks back to the system every N steps


def make_optimizer(params, v: Variant, lr: float):
    if v.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    from lib.adam8bit import AdamW8bit
    return AdamW8bit(params, lr=lr, weight_decay=0.01, paged=v.optimizer == "paged_adamw8bit")


def run(args, v: Variant, parser=None, argv=None, log=print) -> dict:
    """Fine-tune (or, with --epochs 0, only evaluate) a LoRA judge; returns the figures it printed."""
    if args.model != TINY or v.device.type != "cpu" or torch.get_num_threads() == 1:
        return _run(args, v, parser, argv, log)
    # The demo's 64-wide matmuls are too small to share between threads, and on a busy machine the
    # threads mostly wait for each other (measured on a loaded 2-core CPU: building the tiny base took
    # 403 s with 2 threads, 71 s with 1). One thread for the demo, the caller's setting afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, v, parser, argv, log)
    finally:
        torch.set_num_threads(threads)


def _run(args, v: Variant, parser, argv, log) -> dict:
    from lib import chat_tokenizer, guards, llama, lora, optim
    from lib import device as devices
    from lib.checkpoint import atomic_write, save_json
    from lib.memory import format_table
    from lib.metrics import MetricsLog, Throughput, progress_line
    from lib.nf4 import LinearNF4

    device, tiny = v.device, args.model == TINY
    guards.check_output_dir(args.output_dir, "--output_dir")
    guards.check_cache_dir(args.cache_dir)
    if args.adapter and not os.path.isfile(os.path.join(args.adapter, lora.CONFIG_NAME)):
        raise UserError(f"--adapter {args.adapter} has no {lora.CONFIG_NAME}; pass a directory a judge script wrote")
    compute_bytes = 4 if v.amp is None else 2

    def estimate_for(cfg, r):
        return estimate_memory(cfg, args.batch_size, args.max_seq_length, device.type, v.base, compute_bytes, r,
                               v.optimizer, v.checkpointing)

    # --- the model's shape, and the memory estimate from config.json alone ---------------------------
    if args.estimate_memory:
        if tiny:
            cfg = llama.LlamaConfig(vocab_size=640, **TINY_SHAPE)
        else:
            cfg = llama.config_for_estimate(args.model, args.cache_dir)
        r = args.lora_r or lora_rank_for(count_params(cfg))[0]
        estimate = estimate_for(cfg, r)
        n = count_params(cfg)
        log(f"{args.model}: {f'{n / 1e9:.3f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'} parameters, LoRA r={r} on {', '.join(LORA_TARGETS)}; "
            f"base {v.base}, {v.optimizer}, batch {args.batch_size} x {args.max_seq_length} tokens"
            f"{', gradient checkpointing' if v.checkpointing else ''}, {device.type}")
        log(format_table(estimate))
        return {"estimate": estimate}
    guards.refuse_overwrite(args.output_dir, args.resume, args.overwrite)
    state = None
    if args.resume:
        path = os.path.join(args.output_dir, STATE_FILE)
        if not os.path.isfile(path):
            raise UserError(f"--resume: {path} does not exist; run without --resume first, or pass the "
                            f"--output_dir of an earlier run")
        state = torch.load(path, map_location="cpu", weights_only=True)
        guards.check_resume_flags(json.loads(state["args"]), args, parser, RESUME_FIXED, RESUME_CHANGEABLE, log, argv)
        args.model = json.loads(state["args"])["model"]

    data = load_judge_data(args.data_dir)  # read and checked before any model is built or downloaded

    # --- base model directory and tokenizer ----------------------------------------------------------
    model_dir = tiny_base(args.cache_dir, log) if tiny else llama.resolve_model(args.model, args.cache_dir, log)
    cfg = llama.read_config(model_dir)
    tok = chat_tokenizer.load_tokenizer(model_dir)
    r = args.lora_r or lora_rank_for(count_params(cfg))[0]
    alpha = 2 * r
    if args.adapter:
        saved = lora.read_adapter_config(args.adapter)
        r, alpha = saved["r"], saved["lora_alpha"]

    # --- data: conversations, tokenised with the prompt masked ----------------------------------------
    train, val, test = data["train"], data["val"], data["test"]
    if args.max_samples:
        train, val = train[:args.max_samples], val[:max(1, args.max_samples // 5)]
    if args.test_samples:
        test = test[:args.test_samples]
    train_enc = [encode_conversation(tok, c, args.max_seq_length) for c in train]
    val_enc = [encode_conversation(tok, c, args.max_seq_length) for c in val]
    n_answer = sum(len(ids) - n for ids, n in train_enc)
    log(f"data: {len(train)} train / {len(val)} val / {len(test)} test conversations "
        f"({args.data_dir or 'embedded judge set'}); {n_answer / len(train):.1f} answer tokens of "
        f"{sum(len(ids) for ids, _ in train_enc) / len(train):.1f} per conversation carry the loss")

    # --- memory check, then the model: frozen base (+ NF4) and LoRA on q/k/v/o ------------------------
    estimate = estimate_for(cfg, r)
    guards.check_memory(sum(estimate.values()), device, args.force,
                        "lower --batch_size or --max_seq_length" + ("" if v.base == "nf4" else ", or use judge_train_cuda.py (NF4)"))
    devices.reset_peak_memory(device)
    convert = (lambda name, linear: LinearNF4.from_linear(linear, 64, True)) if v.base == "nf4" else None
    model = llama.load_pretrained(model_dir, dtype=v.base_dtype, device=device, convert_linear=convert, log=log)
    model.gradient_checkpointing = v.checkpointing
    torch.manual_seed(args.seed)  # LoRA A's initialisation
    if args.adapter:
        try:
            lora.load_adapter(model, args.adapter, dtype=torch.float32)
        except ValueError as e:
            raise UserError(f"--adapter {args.adapter}: {str(e).removeprefix('load_adapter: ')}") from None
        log(f"loaded the adapter in {args.adapter}")
    else:
        lora.apply_lora(model, LORA_TARGETS, r, alpha, LORA_DROPOUT, dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_lora, n_total = sum(p.numel() for p in params), model.num_params()
    log(f"model: {model_dir} ({n_total / 1e6:.1f}M parameters, base {v.base}); LoRA r={r} alpha={alpha} "
        f"dropout {LORA_DROPOUT} on {', '.join(LORA_TARGETS)}: {n_lora:,} trainable; device {device}, "
        f"{'fp32' if v.amp is None else str(v.amp).replace('torch.', '') + ' autocast'}")

    # --- optimiser and schedule ----------------------------------------------------------------------
    optimizer = make_optimizer(params, v, args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=v.amp == torch.float16)
    per_step = args.batch_size * args.gradient_accumulation
    steps_per_epoch = -(-len(train) // per_step)
    total_steps = args.epochs * steps_per_epoch
    warmup = min(args.warmup_steps, total_steps // 10)
    start_step, best_val, best_step, bad_evals, first_val, last_saved = 0, None, None, 0, None, None
    if state is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(state["trainable"][name])
        optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        start_step, best_val, best_step = state["step"], state["best_val"], state["best_step"]
        bad_evals, first_val, last_saved = state["bad_evals"], state["first_val"], state["step"]
        log(f"resuming from step {start_step} of {total_steps} in {args.output_dir}")

    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    guards.start_metrics(metrics_path, args.resume)
    mlog = MetricsLog(metrics_path)
    mlog.log(event="start", seed=args.seed, step=start_step, device=str(device), script=v.script, base=v.base,
             optimizer=v.optimizer, amp=str(v.amp), checkpointing=v.checkpointing, model_dir=model_dir,
             lora=dict(r=r, alpha=alpha, dropout=LORA_DROPOUT, targets=LORA_TARGETS), n_trainable=n_lora,
             n_params=n_total, total_steps=total_steps, args=vars(args))
    result = {"model": model, "tokenizer": tok, "estimate": estimate, "total_steps": total_steps}

    # --- the untrained judge on the test set (LoRA B is zero, so this is the base) -----------------
    if args.baseline_eval and not args.skip_eval and state is None and not args.adapter:
        log("evaluating the untrained judge (the base model) on the test set")
        before, _ = evaluate_judge(model, tok, test, device, v.amp, args.max_new_tokens, log)
        const = constant_predictor_mae([c[-1]["content"] for c in train], [c[-1]["content"] for c in test])
        log(f"untrained judge: {format_metrics(before)}; a constant answer (the training median) has MAE {const:.3f}")
        mlog.log(event="baseline", constant_mae=const, **before)
        result.update(baseline=before, constant_mae=const)

    def save_state(step):
        """LoRA matrices + optimizer + RNG + early-stopping counters, one atomic file, for --resume."""
        trainable = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
        guards.check_finite_weights(trainable, step, last_saved, args.output_dir)
        atomic_write(os.path.join(args.output_dir, STATE_FILE), lambda tmp: torch.save({
            "step": step, "trainable": trainable, "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "best_val": best_val, "best_step": best_step, "bad_evals": bad_evals, "first_val": first_val,
            "args": json.dumps(vars(args)), "model_dir": model_dir}, tmp))

    def save_best(step):
        guards.check_finite_weights(lora.adapter_state_dict(model), step, best_step, args.output_dir)
        lora.save_adapter(model, args.output_dir, {"base_model_name_or_path": args.model if not tiny else model_dir,
                                                   "target_modules": LORA_TARGETS}, fan_in_fan_out=False)
        tok.save(args.output_dir)

    def evaluate_and_keep_best(step):
        """Validation loss; the best adapter so far is saved; returns True when early stopping says stop."""
        nonlocal best_val, best_step, bad_evals, first_val
        val_loss = validation_loss(model, val_enc, args.batch_size, tok.pad_token_id, device, v.amp)
        first_val = val_loss if first_val is None else first_val
        improved = best_val is None or val_loss < best_val - args.min_delta
        if improved:
            best_val, best_step, bad_evals = val_loss, step, 0
            save_best(step)
        else:
            bad_evals += 1
        log(f"step {step}: validation loss {val_loss:.4f} ({'best, adapter saved' if improved else f'no gain {bad_evals}/{args.patience}'})")
        mlog.log(step=step, val_loss=val_loss, best=improved)
        return bad_evals >= args.patience

    # --- training loop -------------------------------------------------------------------------------
    speed = Throughput(total_steps, start_step)
    step = next_step = start_step
    stopped_early = False
    try:
        for step in range(start_step, total_steps):
            if step % args.eval_steps == 0 and step > start_step or (step == 0 and first_val is None):
                if evaluate_and_keep_best(step):
                    stopped_early = True
                    break
                save_state(step)
                last_saved = step
            epoch, i = divmod(step, steps_per_epoch)
            order = epoch_order(len(train_enc), args.seed, epoch)
            lr = optim.lr_at(step, args.lr, warmup, total_steps, 0.1)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum, tokens = 0.0, 0
            for micro in range(args.gradient_accumulation):
                first = (i * args.gradient_accumulation + micro) * args.batch_size
                batch = [train_enc[j] for j in order[first:first + args.batch_size]]
                if not batch:
                    continue  # the last step of an epoch may have fewer micro-batches
                ids, labels = collate(batch, tok.pad_token_id, device)
                with devices.autocast(device, v.amp):
                    loss = answer_loss(model(ids), labels) / args.gradient_accumulation
                scaler.scale(loss).backward()
                loss_sum += loss.item()
                tokens += ids.numel()
            if not math.isfinite(loss_sum):
                raise UserError(f"the loss became {loss_sum} at step {step}; stopped before the update, "
                                f"{guards.last_finite_text(last_saved, args.output_dir)}; lower --lr or check the data")
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, v.max_grad_norm).item()
            record = dict(step=step, epoch=epoch, loss=loss_sum, lr=lr, grad_norm=grad_norm)
            if math.isfinite(grad_norm):
                scaler.step(optimizer)
            else:  # an fp16 overflow or a bad batch: skip the update, keep the weights
                record["skipped"] = True
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            next_step = step + 1
            speed.add(tokens)
            if v.empty_cache_every and next_step % v.empty_cache_every == 0 and device.type == "mps":
                torch.mps.empty_cache()  # MPS keeps freed blocks cached; long runs otherwise creep upwards
            if step % args.log_interval == 0 or next_step == total_steps:
                devices.synchronize(device)
                tok_s, _, eta = speed.report(next_step)
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), peak_memory=mem)
                log(progress_line(step, total_steps, loss_sum, lr, tok_s, None, mem, eta))
            mlog.log(**record)
        else:
            step = max(total_steps, start_step)
        if total_steps > start_step and not stopped_early:
            evaluate_and_keep_best(step)
        if total_steps > 0:
            save_state(step)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the save short
        save_state(next_step)
        print(f"\ninterrupted: saved step {next_step} to {args.output_dir}; continue with --resume", file=sys.stderr)
        sys.exit(130)

    # --- save: the best adapter is already in --output_dir; evaluate that one ------------------------
    if best_step is not None:
        lora.load_adapter(model, args.output_dir)
        log(f"best adapter: step {best_step}, validation loss {best_val:.4f} (first {first_val:.4f}); in "
            f"{args.output_dir} (PEFT layout, base_model_name_or_path {args.model if not tiny else model_dir})"
            + (" - stopped early" if stopped_early else ""))
    result.update(best_val=best_val, first_val=first_val, best_step=best_step, stopped_early=stopped_early)

    # --- report: test metrics and memory -------------------------------------------------------------
    if not args.skip_eval:
        log(f"evaluating the {'fine-tuned' if total_steps or args.adapter else 'untrained'} judge on {len(test)} "
            f"test conversations (greedy)")
        after, predictions = evaluate_judge(model, tok, test, device, v.amp, args.max_new_tokens, log)
        save_json(os.path.join(args.output_dir, "test_predictions.json"), predictions)
        log(f"judge: {format_metrics(after)}")
        if "baseline" in result and result["baseline"]["mae"] is not None and after["mae"] is not None:
            log(f"MAE {result['baseline']['mae']:.3f} untrained -> {after['mae']:.3f} fine-tuned "
                f"(constant answer: {result['constant_mae']:.3f})")
        mlog.log(event="test", **after)
        result.update(test=after, predictions=predictions)
    peak = devices.peak_memory_bytes(device)
    log(format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    mlog.log(event="end", step=step, best_val=best_val, best_step=best_step, peak_memory=peak,
             memory_estimate=sum(estimate.values()))
    result.update(peak_memory=peak)
    return result
