"""Fine-tune an instruct LLM as a translation judge with LoRA on an fp32 base: the laptop version.

    python judge_train_mps.py --model tiny                 # offline demo: tiny base, embedded judge set, minutes on CPU
    python judge_train_mps.py --epochs 3                   # Qwen/Qwen2-1.5B-Instruct from the hub, MPS (CPU fallback)
    python judge_train_mps.py --model meta-llama/Llama-3.2-1B-Instruct --epochs 1 --max_samples 50 --test_samples 20
    python judge_train_mps.py --model Qwen/Qwen2-1.5B-Instruct --estimate-memory

Given a source sentence, a translation and a reference, the judge answers `Feedback: ...` and then
`Score: X/10`: reasoning first, verdict last, as Prometheus does (written the other way round, as
JudgeLM does, a small judge learns the feedback's wording and not the score; see judge_answer). A judge is a
chat model fine-tuned on conversations whose last turn is that answer;
the loss falls on the answer's tokens only (the prompt is context, not something to imitate), and
the judge is graded by decoding greedily and comparing its scores with the references' (MAE, RMSE,
Cohen's kappa, Pearson r) and its feedback with theirs (ROUGE-L F1).

The whole recipe is in this file, in the order a reader needs it:
  1. arguments, and the recipe this script picks: MPS (else the CPU), the Qwen2 / Llama 3 base
     (lib/llama.py) frozen in fp32, fp32 arithmetic, plain AdamW at lr 5e-4, clipping at 1.0;
  2. the data: the embedded judge set or --data_dir, rendered with the model's chat template, the
     loss masked to the answer;
  3. the model and LoRA (lib/lora.py) on q_proj, k_proj, v_proj and o_proj, rank 16 / alpha 32 for
     1-3B parameters (8 / 16 otherwise), dropout 0.05; and the memory it will need;
  4. the optimiser and the schedule (warmup, then cosine decay to 10%);
  5. the training loop, with a validation loss every --eval_steps and early stopping (patience 3,
     min_delta 0.005);
  6. saving: the best adapter (PEFT layout), and the state for an exact --resume;
  7. the test evaluation (greedy decoding) and its metrics;
then run(), which does those steps in that order, and the offline demo's base (--model tiny).
fp32 because MPS's 16-bit autocast is slow and fragile and a CPU gains nothing from it; on MPS the
allocator's cache is emptied every 5 steps, and there is no pinned memory and no data-loader worker
(tokenised conversations are batched in the loop).

judge_train_cuda.py imports this file and changes four things through its own recipe_for(): an NF4
base, mixed precision with a GradScaler, gradient checkpointing, and 8-bit AdamW with paging. The
adapters of the two scripts are interchangeable. The run directory (--output_dir, --resume,
--overwrite) follows the run contract of lib/rundir.py. Comparing the two: docs/judge_mps_vs_cuda.md.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import re
import sys
import time
from typing import Callable

import numpy as np
import torch

from lib import chat_tokenizer, guards, llama, lm_loss, lora, metrics, optim, rundir
from lib import device as devices
from lib.checkpoint import save_json
from lib.errors import UserError, report_and_exit
from lib.memory import (LOSS_LABEL, MMAP_THRESHOLD, cpu_heap_kept_bytes, cpu_runtime_bytes, format_table,
                        lm_loss_bytes, nf4_bytes, runtime_terms)

SCRIPT = "judge_train_mps"
TINY = "tiny"  # --model tiny: the offline demo base, built once and cached (tiny_base, at the end)
PREDICTIONS = "test_predictions.json"


# --- 1. arguments -----------------------------------------------------------------------------------
# The defaults that are not --model tiny's (the demo's are in resolve_defaults).
DEFAULTS = dict(model="Qwen/Qwen2-1.5B-Instruct", lr=5e-4, batch_size=1, gradient_accumulation=2)


def build_parser(script=SCRIPT, description=None, defaults=DEFAULTS):
    """The original scripts' snake_case flags, with the repository's kebab-case names as aliases."""
    p = argparse.ArgumentParser(
        description=description or "Fine-tune a LoRA translation judge on an fp32 base (Apple MPS or CPU).",
        formatter_class=guards.HelpFormatter)
    p.add_argument("--model", default=defaults["model"],
                   help="hub id (downloaded to --cache-dir; HF_TOKEN for gated models), a local Hugging Face "
                   "model directory, or 'tiny' for the offline demo (a tiny base built and cached on first use)")
    p.add_argument("--epochs", type=guards.nonneg_int, default=None,
                   help="passes over the training split (default 3; 2 with --model tiny); 0 evaluates only")
    p.add_argument("--batch_size", "--batch-size", type=guards.positive_int, default=None,
                   help=f"conversations per micro-batch (default {defaults['batch_size']}; 8 with --model tiny)")
    p.add_argument("--gradient_accumulation", "--grad-accum", type=guards.positive_int, default=None,
                   help=f"micro-batches per optimizer step (default {defaults['gradient_accumulation']}; "
                   f"1 with --model tiny)")
    p.add_argument("--lr", type=guards.positive_float, default=None,
                   help=f"peak learning rate (default {defaults['lr']:g}; 6e-3 with --model tiny, whose LoRA must "
                   f"learn in minutes)")
    p.add_argument("--max_seq_length", "--max-seq-length", type=guards.positive_int, default=512,
                   help="tokens per conversation at most (the prompt is cut from the left)")
    p.add_argument("--max_samples", "--max-samples", type=guards.positive_int, default=None,
                   help="use only the first N training conversations (and N/5 validation ones)")
    p.add_argument("--test_samples", "--test-samples", type=guards.positive_int, default=None,
                   help="evaluate on only the first N test conversations")
    p.add_argument("--data_dir", "--data-dir", default=None, help="directory with judge_train.json, judge_val.json "
                   "and judge_test.json (default: the embedded judge set)")
    p.add_argument("--output_dir", "--output-dir", "--out-dir", default=f"out/{script}",
                   help="where the best adapter (PEFT layout), tokenizer, training state, metrics.jsonl and "
                   "test_predictions.json go")
    p.add_argument("--skip_eval", "--skip-eval", action="store_true",
                   help="skip the test-set evaluation after training")
    p.add_argument("--adapter", default=None,
                   help="start from this LoRA adapter directory (either script's); with --epochs 0 just evaluate it")
    p.add_argument("--lora_r", "--lora-r", type=guards.positive_int, default=None,
                   help="LoRA rank (default by model size: 16 for 1-3B parameters, else 8; alpha = 2 r)")
    p.add_argument("--eval_steps", "--eval-steps", type=guards.positive_int, default=None,
                   help="validation loss (and best-adapter check) every N optimizer steps (default 100; 50 with "
                   "--model tiny)")
    p.add_argument("--warmup_steps", "--warmup-steps", type=guards.nonneg_int, default=100,
                   help="linear warmup steps (at most a tenth of the run), then cosine decay to 10%%")
    p.add_argument("--patience", type=guards.positive_int, default=3,
                   help="early stopping: stop after this many evaluations without improving by --min_delta")
    p.add_argument("--min_delta", "--min-delta", type=guards.nonneg_float, default=0.005,
                   help="improvement of the validation loss that counts for early stopping")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=guards.positive_int, default=None,
                   help="tokens generated per test answer (default 256; 96 with --model tiny)")
    p.add_argument("--baseline_eval", "--baseline-eval", action="store_true", help="also evaluate the untrained "
                   "judge (the base) on the test set first (always on with --model tiny)")
    p.add_argument("--log_interval", "--log-interval", type=guards.positive_int, default=10,
                   help="steps between progress lines")
    p.add_argument("--seed", type=guards.nonneg_int, default=0, help="seed for LoRA init, dropout and the data order")
    p.add_argument("--device", default=None, choices=["cuda", "mps", "cpu"], help="device to run on (default: MPS, "
                   "else CPU for judge_train_mps.py; CUDA, else CPU for judge_train_cuda.py)")
    p.add_argument("--cache-dir", "--cache_dir", default=os.environ.get("BYHAND_CACHE", os.path.expanduser(
                   "~/.cache/byhand")), help="hub downloads and the tiny demo base (env BYHAND_CACHE)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --output_dir exactly")
    p.add_argument("--estimate-memory", "--estimate_memory", action="store_true",
                   help="print the predicted memory of a training step for this model, these flags and this data "
                   "(reads config.json and the tokenizer, never the weights) and exit")
    guards.add_safety_flags(p, snake=True)
    return p


def resolve_defaults(args, defaults=DEFAULTS):
    """Fill the defaults that depend on --model tiny (the demo: many small steps, so LoRA learns in minutes)."""
    if args.seed >= 2**32:
        raise UserError(f"--seed {args.seed} is too large; use a seed from 0 to {2**32 - 1}")
    tiny = args.model == TINY
    args.gradient_accumulation = args.gradient_accumulation or (1 if tiny else defaults["gradient_accumulation"])
    args.epochs = (2 if tiny else 3) if args.epochs is None else args.epochs
    args.batch_size = args.batch_size or (8 if tiny else defaults["batch_size"])
    args.lr = args.lr or (6e-3 if tiny else defaults["lr"])
    args.eval_steps = args.eval_steps or (50 if tiny else 100)
    args.max_new_tokens = args.max_new_tokens or (96 if tiny else 256)
    args.baseline_eval = args.baseline_eval or tiny


def check_adapter_config(path):
    """A saved or given adapter_config.json: readable, and the fields LoRA needs are sound."""
    try:
        lora.read_adapter_config(os.path.dirname(path))
    except ValueError as e:
        raise rundir.damaged(path, str(e).removeprefix(f"load_adapter: {path} ")) from None  # what is wrong


# The run directory (lib/rundir.py): a saved run is the training state and the best adapter. The fixed
# flags make the run what it is (model, data, batch, LoRA rank, seed): given again on --resume they must
# match, and when not given the saved values are used. The changeable ones keep the saved values unless
# given. The local ones say what this invocation reports, not what the run is.
RUN = rundir.Spec(
    saved={rundir.STATE: "state", lora.WEIGHTS_NAME: "safetensors", lora.CONFIG_NAME: check_adapter_config},
    written=(rundir.METRICS, PREDICTIONS, *chat_tokenizer.TOKENIZER_FILES),
    fixed=("model", "data_dir", "max_samples", "max_seq_length", "batch_size", "gradient_accumulation", "lora_r",
           "adapter", "seed"),
    changeable=("epochs", "lr", "warmup_steps", "eval_steps", "patience", "min_delta", "log_interval",
                "test_samples", "max_new_tokens"),
    local=("skip_eval", "baseline_eval"),
    data=("data_dir",),
    out_flag="--output_dir",
)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(args, parser, argv)
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)


# --- 1b. the recipe: where and in what precision this script trains ----------------------------------
def adamw(params, lr):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


@dataclasses.dataclass
class Recipe:
    """How the frozen base, the arithmetic and the optimizer are held. recipe_for() below is this
    script's choice; judge_train_cuda.py makes its own (NF4, mixed precision, checkpointing, 8-bit
    AdamW). Everything else in this file is the same for both."""
    device: torch.device
    base: str = "fp32"                          # how the frozen base is stored: fp32, bf16, fp16 or nf4
    base_dtype: torch.dtype = torch.float32     # the dtype its weights are read in (and NF4 dequantises to)
    amp: torch.dtype | None = None              # the autocast dtype; None: fp32 arithmetic
    convert_linear: Callable | None = None      # (name, nn.Linear) -> module, as each base linear is read
    checkpointing: bool = False                 # recompute each decoder layer in backward
    optimizer: str = "adamw"                    # adamw, adamw8bit or paged_adamw8bit (estimate, messages)
    make_optimizer: Callable = adamw            # (trainable parameters, lr) -> optimizer
    max_grad_norm: float = 1.0                  # clip the gradient norm to this
    empty_cache_every: int = 0                  # MPS: hand cached blocks back to the system every N steps
    cpu_heap_threshold: int = MMAP_THRESHOLD    # CPU: freed blocks from this size on go back to the system


def recipe_for(args) -> Recipe:
    """MPS, else the CPU (CUDA only when asked for: that is judge_train_cuda.py's job); fp32 throughout."""
    if args.device:
        device = devices.pick_device(args.device)
    elif torch.backends.mps.is_available():
        device = torch.device("mps")
    else:
        device = torch.device("cpu")
        if args.model != TINY and not args.estimate_memory:
            print(f"warning: MPS is not available; training on the CPU (slow for {model_size_text(args)})",
                  file=sys.stderr)
    return Recipe(device=device, empty_cache_every=5 if device.type == "mps" else 0)


def model_size_text(args) -> str:
    """'a 135M model', 'a 1.54B model': the size from config.json (a local directory, a cached
    download, or the built-in copy for the named models); 'a model of unknown size' otherwise."""
    try:
        n = count_params(llama.config_for_estimate(args.model, args.cache_dir))
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return "a model of unknown size"
    return f"a {n / 1e9:.3g}B model" if n >= 1e9 else f"a {n / 1e6:.0f}M model"


# --- 2. data: the judge set, its chat-template rendering, the loss on the answer only ---------------
# The embedded judge set (used when --data_dir is not given) is synthetic and exactly gradable: an
# English sentence of 10 words, its word-for-word Portuguese reference, and a candidate translation that
# left k of the 10 words untranslated; the right answer is feedback that goes through the translation
# word by word, counting the translated words, then `Score: {10 - k}/10` (judge_answer). (Untranslated
# words, rather than wrong Portuguese ones, keep the task within reach of the 2-layer demo model in
# minutes of CPU.) data/make_judge_set.py writes it out in the --data_dir format.
EN_PT = [("the", "o"), ("a", "um"), ("cat", "gato"), ("dog", "cão"), ("house", "casa"), ("book", "livro"),
         ("water", "água"), ("bread", "pão"), ("red", "vermelho"), ("big", "grande"), ("small", "pequeno"),
         ("eats", "come"), ("sees", "vê"), ("has", "tem"), ("and", "e"), ("with", "com"), ("in", "em"),
         ("good", "bom"), ("old", "velho"), ("new", "novo"), ("city", "cidade"), ("friend", "amigo"),
         ("sun", "sol"), ("moon", "lua"), ("sea", "mar"), ("tree", "árvore"), ("car", "carro"),
         ("door", "porta"), ("table", "mesa"), ("milk", "leite"), ("runs", "corre"), ("reads", "lê")]
SENTENCE_WORDS = 10
SPLIT_SIZES = {"train": 1200, "val": 100, "test": 100}
PROMPT = ("Grade this English to Portuguese translation.\n"
          "Source: {source}\nTranslation: {candidate}\nReference: {reference}")


def judge_example(rng: random.Random, score_fn=None) -> dict:
    """One conversation of the embedded set. score_fn(k, rng) replaces the right score (the tiny demo
    base is pretrained on answers whose scores ignore the errors, see tiny_base)."""
    picks = [rng.randrange(len(EN_PT)) for _ in range(SENTENCE_WORDS)]
    source = [EN_PT[i][0] for i in picks]
    reference = [EN_PT[i][1] for i in picks]
    k = rng.randint(0, SENTENCE_WORDS)
    wrong = sorted(rng.sample(range(SENTENCE_WORDS), k))
    candidate = [source[i] if i in wrong else reference[i] for i in range(SENTENCE_WORDS)]
    score = SENTENCE_WORDS - k if score_fn is None else score_fn(k, rng)
    user = PROMPT.format(source=" ".join(source), candidate=" ".join(candidate), reference=" ".join(reference))
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": judge_answer(candidate, wrong, score)}]}


def judge_answer(candidate: list, wrong: list, score) -> str:
    """The reference answer: feedback first, the translation word by word, each translated word numbered
    as it comes and each untranslated one marked, then the score: `Feedback: sea (English), carro (1),
    ..., has (English): 2 of 10 words translated.` and `Score: 2/10` on the next line. The order is the lesson:
    a judge that must write its score first has to count before it has looked, and learns the
    feedback's easy wording instead (the loss falls, the scores stay wrong: the score's digit is 4% of
    the answer's tokens). Written after the walk, each step is one word, and the score is the last
    number again (counting the untranslated words instead would leave a subtraction, 10 - n, to learn)."""
    parts, n = [], 0
    for i, word in enumerate(candidate):
        if i in wrong:
            parts.append(f"{word} (English)")
        else:
            n += 1
            parts.append(f"{word} ({n})")
    return f"Feedback: {', '.join(parts)}: {n} of {len(candidate)} words translated.\nScore: {score}/10"


def embedded_judge_set(seed: int = 0, sizes: dict = None) -> dict:
    """{"train": [...], "val": [...], "test": [...]}: the same conversations for the same seed."""
    rng = random.Random(seed)
    return {split: [judge_example(rng) for _ in range(n)] for split, n in (sizes or SPLIT_SIZES).items()}


# The answer format: free-text feedback and a score out of 10, in either order (the embedded set puts
# the feedback first); the score is found anywhere in the answer.
SCORE_RE = re.compile(r"Score:\s*(\d+(?:\.\d+)?)\s*/\s*10(?!\d)", re.IGNORECASE)
FEEDBACK_RE = re.compile(r"Feedback:\s*(.+?)\s*(?:\n\s*Score:.*)?$", re.IGNORECASE | re.DOTALL)


def parse_score(text: str):
    """`Score: 8/10` -> 8.0; None when the text has no score of 0 to 10 in that form."""
    m = SCORE_RE.search(text)
    return float(m.group(1)) if m and float(m.group(1)) <= 10 else None


def parse_feedback(text: str) -> str:
    """The text after `Feedback:` (up to a `Score:` line that follows it), or the whole text when there
    is no such marker."""
    m = FEEDBACK_RE.search(text)
    return m.group(1).strip() if m else text.strip()


SPLITS = ("train", "val", "test")


def split_path(data_dir: str, split: str) -> str:
    return os.path.join(data_dir, f"judge_{split}.json")


def read_split(path: str) -> list:
    """A judge_*.json file: a list of {"messages": [..., {"role": "assistant", ...}]}; extra keys ignored.
    Returns the message lists. Any defect is one UserError naming the file, the record and the field."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # a UTF-8 byte-order mark is accepted
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
                raise UserError(f"{where}: field messages[{j}].role is {m.get('role')!r}; use system, user or "
                                "assistant")
            if not isinstance(m.get("content"), str):
                raise UserError(f"{where}: field messages[{j}].content must be a string")
        last = len(msgs) - 1
        if msgs[last]["role"] != "assistant":
            raise UserError(f"{where}: field messages[{last}].role must be 'assistant' (the judge's answer "
                            f"comes last), got {msgs[last]['role']!r}")
        if not any(m["role"] == "user" for m in msgs[:-1]):
            raise UserError(f"{where}: field 'messages' has no user message before the assistant's answer")
        check_reference_score(msgs[last]["content"], f"{where}: field messages[{last}].content")
        out.append([{"role": m["role"], "content": m["content"]} for m in msgs])
    return out


def check_reference_score(answer: str, where: str):
    """A reference answer is graded against, so its score must be one: `Score: X/10`, X from 0 to 10."""
    if parse_score(answer) is not None:
        return
    found = re.search(r"Score:[^\n]*", answer, re.IGNORECASE)
    what = f"found {found.group(0).strip()[:40]!r}" if found else f"it has no 'Score:' (it starts {answer[:30]!r})"
    raise UserError(f"{where}: a reference answer must give its score as `Score: X/10` with X from 0 to 10; "
                    f"{what}; fix the record")


def load_judge_data(data_dir: str | None, seed: int = 0) -> dict:
    """{split: [messages, ...]} from --data_dir, or the embedded set when data_dir is None."""
    if data_dir is None:
        return {s: [ex["messages"] for ex in exs] for s, exs in embedded_judge_set(seed).items()}
    if not os.path.isdir(data_dir):
        raise UserError(f"--data_dir {data_dir} is not a directory; pass a directory holding judge_train.json, "
                        f"judge_val.json and judge_test.json, or leave it out for the embedded judge set")
    return {s: read_split(split_path(data_dir, s)) for s in SPLITS}


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


def encode_split(tok, conversations: list, max_len: int, name: str, log=print) -> list:
    """Every conversation encoded; refused when --max_seq_length leaves an answer no token to learn."""
    encoded = [encode_conversation(tok, c, max_len) for c in conversations]
    answers = [len(ids) - n for ids, n in encoded]
    if min(answers) == 0:
        whole = max(len(tok.encode(tok.apply_chat_template(c)[len(tok.apply_chat_template(
            c[:-1], add_generation_prompt=True)):])) for c in conversations)
        raise UserError(f"--max_seq_length {max_len} leaves no answer token to learn in the {name} conversations "
                        f"(the prompt needs at least one token before it); use --max_seq_length {whole + 1} or "
                        f"more to keep every answer whole")
    cut = sum(1 for (ids, n), c in zip(encoded, conversations) if len(ids) == max_len)
    if cut:
        log(f"note: {cut} of {len(encoded)} {name} conversations were cut to --max_seq_length {max_len}")
    return encoded


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


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens (position t predicts token t + 1; the prompt
    and the padding, labelled -100, count for nothing). The head makes logits only at the positions
    that predict an answer token (the prompt's positions need none: on SmolLM2 that halves the head's
    work), chunk by chunk (lib/lm_loss), so the [tokens, vocabulary] logits never exist at once: for
    2 x 512 tokens of Qwen2's 151,936-word vocabulary they would be 622 MB in fp32, before their gradient."""
    hidden = model.hidden_states(ids)
    targets = lm_loss.shift_labels(labels)
    answer = targets != -100  # the head's logits only where a token is learned: half the rows are prompt
    return lm_loss.head_loss(hidden[answer], model.lm_head, targets[answer])


def epoch_order(n: int, seed: int, epoch: int) -> list:
    """The shuffled example order of one epoch: a function of (seed, epoch) only, so --resume replays it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()


# --- 3. the model, LoRA, and the memory they will need ----------------------------------------------
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


def lora_shape(args, cfg, state) -> tuple:
    """(r, alpha): the saved run's, the --adapter's, --lora_r's, or the model size's default; recorded
    in args.lora_r, so that a later --resume compares with the rank really used."""
    if state is not None:
        r, alpha = state["lora"]["r"], state["lora"]["alpha"]
    elif args.adapter:
        saved = lora.read_adapter_config(args.adapter)
        r, alpha = saved["r"], saved["lora_alpha"]
        if args.lora_r is not None and args.lora_r != r:
            raise UserError(f"--lora_r {args.lora_r} contradicts --adapter {args.adapter} (r = {r}); drop --lora_r")
    else:
        r = args.lora_r or lora_rank_for(count_params(cfg))[0]
        alpha = 2 * r
    args.lora_r = r
    return r, alpha


def load_model(model_dir, recipe: Recipe, r, alpha, adapter, seed, log=print):
    """The frozen base, read tensor by tensor (recipe.convert_linear: each decoder linear quantised as
    it arrives), with LoRA on q/k/v/o: fresh (A random, B zero: training starts at the base) or --adapter's."""
    model = llama.load_pretrained(model_dir, dtype=recipe.base_dtype, device=recipe.device,
                                  convert_linear=recipe.convert_linear, log=log)
    model.gradient_checkpointing = recipe.checkpointing
    torch.manual_seed(seed)  # LoRA A's initialisation
    if adapter:
        try:
            lora.load_adapter(model, adapter, dtype=torch.float32)
        except ValueError as e:
            raise UserError(f"--adapter {adapter}: {str(e).removeprefix('load_adapter: ')}") from None
        log(f"loaded the adapter in {adapter}")
    else:  # the LoRA matrices are fp32 master weights whatever the base's dtype
        lora.apply_lora(model, LORA_TARGETS, r, alpha, LORA_DROPOUT, dtype=torch.float32)
    model.train()
    return model


def estimate_memory(cfg, batch_size: int, seq_len: int, device_type: str, base: str, compute_bytes: int,
                    r: int, optimizer: str = "adamw", checkpointing: bool = False, generation: tuple = None,
                    runtime: int = None, heap_threshold: int = MMAP_THRESHOLD) -> dict:
    """Predicted peak bytes of a run, per component (arithmetic only, from config.json and the data's lengths).

    seq_len: the longest conversation the run will see (every batch is padded to its longest).
    base: "fp32", "bf16"/"fp16" or "nf4" (decoder linears in 4.13 bits, the rest in compute_bytes).
    The LoRA matrices, their gradients and the optimizer state are fp32 (8-bit AdamW: 2 bytes + one
    fp32 absmax per 256 for tensors of 4,096 elements or more; paged: none of it on the GPU).
    Activations per layer and token, in compute_bytes: the two RMSNorm outputs, q, k, v, the attention
    output, gate, up, silu(gate) and their product, LoRA's dropped-out inputs (4 x hidden), plus the
    fp32 residual stream at the two norms; with checkpointing only each layer's input is kept, plus
    one layer recomputed in backward. The loss never holds the logits: one chunk of rows at a time
    (lib/memory.lm_loss_bytes; the head is frozen, so it has no gradient to make).
    generation: (rows, positions) of the greedy test evaluation, whose keys and values of every layer
    stay in the KV cache while the answers grow (plus one layer's repeated to every query head, and the
    copy a concatenation makes); it counts where it needs more than a training step.
    runtime: what the process holds besides (on a CPU: measured before the model is loaded, with Python,
    torch, the tokenizer and the data: lib/memory.cpu_runtime_bytes); by default the
    device's RUNTIME_BASELINE (lib/memory.runtime_terms).
    heap_threshold: on a CPU, the activations in blocks under it come from glibc's heap, which keeps up
    to a step's worth of them (lib/memory.cpu_heap_kept_bytes).
    """
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
    # The same tensors one by one (bytes, how many a layer keeps), for the CPU heap's small blocks:
    # 2 norm outputs, q, k, v, attention output, 4 MLP, 4 LoRA inputs, 2 fp32 residuals.
    layer_blocks = [(tokens * w * b, n) for w, b, n in ((h, compute_bytes, 2 + 4), (qd, compute_bytes, 2),
                                                         (kvd, compute_bytes, 2), (inter, compute_bytes, 4), (h, 4, 2))]
    kept = [(size, n * (1 if checkpointing else L)) for size, n in layer_blocks]
    estimate = {
        label: weights,
        "LoRA parameters (fp32)": 4 * n_lora,
        "LoRA gradients (fp32)": 4 * n_lora,
        opt_label: opt_bytes,
        "activations" + (" (checkpointed)" if checkpointing else ""): acts,
        LOSS_LABEL: lm_loss_bytes(tokens, cfg.vocab_size, h, compute_bytes=compute_bytes, train_head=False,
                                  hidden_bytes=compute_bytes),
    }
    if base == "nf4":
        estimate["dequantised weight (one layer at a time)"] = max(i * o for i, o in linears) * (4 + compute_bytes)
    step = acts + estimate[LOSS_LABEL]  # what one training step allocates and frees again
    # On a CPU glibc would keep the blocks a step frees (up to 32 MiB each) and grow the resident set past
    # the tensors, step after step: a command-line run fixes its heap (lib/device.steady_cpu_heap), so the
    # peak is the tensors above plus the runtime below (lib/memory.py, the accounting every script shares).
    heap = cpu_heap_kept_bytes(device_type, kept, heap_threshold)
    if heap:
        estimate[f"heap: a step's blocks under {heap_threshold // 1024:,} KiB, kept by glibc"] = heap
    if generation:
        rows, positions = generation
        beyond_a_step = rows * positions * compute_bytes * (2 * kvd * (L + 1) + 2 * qd) - step
        if beyond_a_step > 0:
            estimate[f"test generation (KV cache, {rows} x {positions}) beyond a step"] = beyond_a_step
    estimate.update(runtime_terms(device_type, runtime, "runtime (measured: Python, torch, tokenizer, data)"))
    return estimate


def estimate_for(cfg, recipe: Recipe, args, r: int, train_enc: list, val_enc: list, test_prompts: list) -> dict:
    """The estimate for these data: every batch is padded to its longest conversation, so the longest
    conversation the run will see, in a full batch, is the step that needs the most memory; the test
    evaluation generates for 16 prompts at a time. Lists left empty (no tokenizer at hand for
    --estimate-memory) assume --max_seq_length everywhere."""
    longest = max((len(ids) for ids, _ in train_enc + val_enc), default=args.max_seq_length)
    rows = min(args.batch_size, len(train_enc) or args.batch_size)
    generation = None
    if not args.skip_eval or args.baseline_eval:
        prompt = max((len(ids) for ids in test_prompts), default=args.max_seq_length)
        generation = (min(16, len(test_prompts) or args.test_samples or 16), prompt + args.max_new_tokens)
    return estimate_memory(cfg, rows, longest, recipe.device.type, recipe.base, 4 if recipe.amp is None else 2, r,
                           recipe.optimizer, recipe.checkpointing, generation, cpu_runtime_bytes(recipe.device.type),
                           recipe.cpu_heap_threshold)


def print_estimate(args, recipe: Recipe, train_set, val_set, test_set, log=print) -> dict:
    """--estimate-memory: config.json (a built-in copy for the named models, so it works before any
    download) and, where it is at hand, the tokenizer, to measure the data; nothing is written."""
    if args.model == TINY:
        built = os.path.join(args.cache_dir, TINY_VERSION)
        model_dir = built if os.path.isfile(os.path.join(built, "model.safetensors")) else None
        cfg = llama.read_config(built) if model_dir else llama.LlamaConfig(vocab_size=640, **TINY_SHAPE)
    else:
        cfg = llama.config_for_estimate(args.model, args.cache_dir)
        cached = os.path.join(args.cache_dir, "hub", args.model.replace("/", "--"), "main")
        model_dir = args.model if os.path.isdir(args.model) else cached if os.path.isdir(cached) else None
    train_enc, val_enc, test_prompts = [], [], []
    tokenizer_files = ("tokenizer.json", "vocab.json", "tokenizer.model")
    if model_dir and any(os.path.isfile(os.path.join(model_dir, name)) for name in tokenizer_files):
        tok = chat_tokenizer.load_tokenizer(model_dir)
        train_enc, val_enc = ([encode_conversation(tok, c, args.max_seq_length) for c in split]
                              for split in (train_set, val_set))
        test_prompts = [tok.encode(tok.apply_chat_template(c[:-1], add_generation_prompt=True)) for c in test_set]
    r = args.lora_r or lora_rank_for(count_params(cfg))[0]
    estimate = estimate_for(cfg, recipe, args, r, train_enc, val_enc, test_prompts)
    n = count_params(cfg)
    longest = max((len(ids) for ids, _ in train_enc + val_enc), default=None)
    log(f"{args.model}: {f'{n / 1e9:.3f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'} parameters, LoRA r={r} on "
        f"{', '.join(LORA_TARGETS)}; base {recipe.base}, {recipe.optimizer}, batch {args.batch_size} x "
        + (f"{longest} tokens (the longest conversation of the data)" if longest else
           f"{args.max_seq_length} tokens (--max_seq_length: the tokenizer is not at hand to measure the data)")
        + f"{', gradient checkpointing' if recipe.checkpointing else ''}, {recipe.device.type}")
    log(format_table(estimate))
    return {"estimate": estimate}


# --- 4. the optimiser and the schedule --------------------------------------------------------------
def schedule(args, n_train: int) -> tuple:
    """(steps per epoch, total steps, warmup steps): warmup is at most a tenth of the run; then the
    learning rate decays along a cosine to 10% of --lr (lib/optim.lr_at)."""
    per_step = args.batch_size * args.gradient_accumulation
    steps_per_epoch = -(-n_train // per_step)  # the last step of an epoch may have fewer conversations
    total_steps = args.epochs * steps_per_epoch
    return steps_per_epoch, total_steps, min(args.warmup_steps, total_steps // 10)


# --- 5. the training loop, with validation and early stopping ---------------------------------------
@dataclasses.dataclass
class Progress:
    """Where the run stands: what --resume restores besides the weights, the optimizer and the random state."""
    step: int = 0                     # the next optimizer step to run
    best_val: float | None = None     # the best validation loss so far, and its step (its adapter is saved)
    best_step: int | None = None
    bad_evals: int = 0                # validations in a row that did not improve by --min_delta
    first_val: float | None = None
    last_eval: int | None = None      # the step of the latest validation
    stopped_early: bool = False


@torch.no_grad()
def validation_loss(model, encoded: list, batch_size: int, pad_id: int, device, amp) -> float:
    """Mean answer-token loss over the whole validation split, weighted by answer tokens."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(encoded), batch_size):
        ids, labels = collate(encoded[start:start + batch_size], pad_id, device)
        n = int((labels[:, 1:] != -100).sum())
        with devices.autocast(device, amp):
            total += answer_loss(model, ids, labels).item() * n
        count += n
    model.train()
    return total / count


def train(model, optimizer, scaler, recipe: Recipe, train_enc, val_enc, pad_id, args, progress: Progress,
          run_dir, save_adapter, mlog, log=print):
    """Optimizer steps from progress.step to the end of --epochs (or until early stopping). Each step:
    the learning rate of the schedule, --gradient_accumulation micro-batches of answer-masked loss, the
    gradient clipped, one update. Every --eval_steps: the validation loss; an improvement saves the
    adapter (save_adapter), --patience validations without one stop the run; then the state is saved."""
    device, amp = recipe.device, recipe.amp
    params = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch, total_steps, warmup = schedule(args, len(train_enc))
    updates = rundir.Updates(args.output_dir, last_saved=progress.step if run_dir.resumed else None)
    speed = metrics.Throughput(total_steps, progress.step)

    def validate(step):
        """The validation loss; the best adapter so far is saved; True when early stopping says stop."""
        val_loss = validation_loss(model, val_enc, args.batch_size, pad_id, device, amp)
        improved = progress.best_val is None or val_loss < progress.best_val - args.min_delta
        if improved:
            save_adapter(step)  # before progress records it: a save cut short by Ctrl-C is redone on --resume
            progress.best_val, progress.best_step, progress.bad_evals = val_loss, step, 0
        else:
            progress.bad_evals += 1
        progress.first_val = val_loss if progress.first_val is None else progress.first_val
        progress.last_eval = step
        log(f"step {step}: validation loss {val_loss:.4f} ("
            + ("best, adapter saved" if improved else f"no gain {progress.bad_evals}/{args.patience}") + ")")
        mlog.log(step=step, val_loss=val_loss, best=improved)
        return progress.bad_evals >= args.patience

    def checkpoint():
        save_state(run_dir, args, model, optimizer, scaler, progress, updates.last_saved)
        updates.saved(progress.step)

    rng_at_step = None  # (step, its random states as it began): the ones a save in a step that did not count holds
    try:
        for step in range(progress.step, total_steps):
            rng_at_step = step, devices.rng_states()  # before this step draws (LoRA dropout; validate draws nothing)
            if step % args.eval_steps == 0 and progress.last_eval != step:
                progress.stopped_early = validate(step)
                if progress.stopped_early:
                    log(f"early stopping: no improvement of {args.min_delta} in {args.patience} validations")
                    break
                checkpoint()
            t_step = time.perf_counter()
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
                ids, labels = collate(batch, pad_id, device)
                with devices.autocast(device, amp):
                    loss = answer_loss(model, ids, labels) / args.gradient_accumulation
                scaler.scale(loss).backward()  # fp16: the scaled loss, so small gradients do not underflow
                loss_sum += loss.item()
                tokens += ids.numel()
            updates.check_loss(step, loss_sum)  # a NaN loss stops the run before its update
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(params, recipe.max_grad_norm).item()
            # A non-finite gradient (an fp16 overflow, a bad batch) would poison the weights: skip the update.
            # (Under fp16 the GradScaler skips it by itself and lowers its scale.)
            skipped = not math.isfinite(grad_norm)
            with rundir.whole_update():  # Ctrl-C or SIGTERM waits for the update and its counting
                if scaler.is_enabled() or not skipped:
                    scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                progress.step = step + 1
                updates.record(step, skipped and not scaler.is_enabled())  # 10 skipped in a row stop the run
            speed.add(tokens)
            if recipe.empty_cache_every and progress.step % recipe.empty_cache_every == 0 and device.type == "mps":
                torch.mps.empty_cache()  # MPS keeps freed blocks cached; long runs otherwise creep upwards
            record = dict(step=step, epoch=epoch, loss=loss_sum, lr=lr, grad_norm=grad_norm)
            if skipped:
                record["skipped"] = True
            if speed.steady_steps == 0 and progress.step < total_steps:  # this invocation's first step
                devices.synchronize(device)
                first = time.perf_counter() - t_step
                if first >= 1.0:  # a long step: say what the run will take before the first progress line
                    log(f"first step: {first:.1f} s (warm-up included); at that pace the {total_steps - progress.step} "
                        f"steps left take about {metrics.format_seconds(first * (total_steps - progress.step))}, "
                        f"validations and the test evaluation aside")
            if step % args.log_interval == 0 or progress.step == total_steps:
                devices.synchronize(device)
                tok_s, _, eta = speed.report(progress.step)
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), peak_memory=mem)
                log(metrics.progress_line(step, total_steps, loss_sum, lr, tok_s, None, mem, eta))
            mlog.log(**record)
        updates.finish()  # a run whose every update was skipped trained nothing: it says so and exits 2
        if not progress.stopped_early and progress.last_eval != progress.step:
            validate(progress.step)
        checkpoint()
    except KeyboardInterrupt:  # save exactly the updates made so far, then exit 130
        rundir.save_on_interrupt(checkpoint, progress.step, args.output_dir, rng_at_step=rng_at_step)
    return progress


# --- 6. saving: the best adapter, and the state --resume needs --------------------------------------
def trainable_state(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_state(run_dir, args, model, optimizer, scaler, progress: Progress, last_saved):
    """The LoRA matrices, the optimizer, the random state and the progress, in one atomic file."""
    trainable = trainable_state(model)
    guards.check_finite_weights(trainable, progress.step, last_saved, args.output_dir)
    lora_layer = next(m for m in model.modules() if isinstance(m, lora.LoRALinear))
    rundir.save_state(run_dir, args, {
        "step": progress.step, "progress": dataclasses.asdict(progress), "trainable": trainable,
        "lora": {"r": lora_layer.r, "alpha": lora_layer.alpha},
        "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        **devices.rng_states()})


def save_best_adapter(model, tok, out_dir, base_name, step, last_best):
    """The adapter in the PEFT layout (readable by either script and by PEFT), beside the tokenizer."""
    guards.check_finite_weights(lora.adapter_state_dict(model), step, last_best, out_dir)
    lora.save_adapter(model, out_dir, {"base_model_name_or_path": base_name, "target_modules": LORA_TARGETS},
                      fan_in_fan_out=False)
    tok.save(out_dir)


def restore(state: dict, path: str, model, optimizer, scaler) -> Progress:
    """--resume: the saved LoRA matrices, optimizer, GradScaler and random state, and where the run stood."""
    try:
        trainable = state["trainable"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(trainable[name])
        optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(state["scaler"])
        devices.restore_rng_states(state)  # dropout draws from them
        return Progress(**state["progress"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise rundir.damaged(path, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}") from None


# --- 7. the test evaluation and its metrics ---------------------------------------------------------
@torch.no_grad()
def generate_answers(model, tok, conversations: list, device, amp, max_new_tokens: int, batch_size: int = 16,
                     log=print) -> list:
    """Greedy answers to each conversation's prompt (everything before the last assistant turn),
    batched with left padding so every row's last prompt token sits at the same position."""
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


def rouge_l_f1(pred: str, ref: str) -> float:
    """ROUGE-L F1 on lower-cased words: the longest common subsequence (LCS, by dynamic programming)
    gives precision LCS/len(pred) and recall LCS/len(ref); F1 is their harmonic mean. No stemming."""
    a, b = re.findall(r"\w+", pred.lower()), re.findall(r"\w+", ref.lower())
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
    """All the numbers for one test run. Scores are compared where the prediction parses (every
    reference does: the data reader checks them); the count of answers without one is reported beside."""
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


def constant_guess(train_answers: list, test_answers: list) -> dict:
    """{"score": the training set's median score, "mae": the MAE of answering it to every test
    conversation}: the bar a judge must clear to have learned anything from the inputs. (A judge that
    never reads the translation does best, in MAE, by always answering the median.)"""
    train = [s for s in map(parse_score, train_answers) if s is not None]
    test = [s for s in map(parse_score, test_answers) if s is not None]
    median = float(np.median(train))
    return {"score": median, "mae": mae([median] * len(test), test)}


def constant_predictor_mae(train_answers: list, test_answers: list) -> float:
    return constant_guess(train_answers, test_answers)["mae"]


def beats_constant(m: dict, const: dict) -> bool:
    """The judge has learned something: a lower MAE than the constant guess, with a score in at least
    half of its answers (an MAE over the few answers that parse flatters a judge that mostly fails)."""
    return m["mae"] is not None and m["mae"] < const["mae"] and 2 * m["n_scored"] >= m["n"]


def evaluate_judge(model, tok, conversations: list, device, amp, max_new_tokens: int, log=print):
    """(metrics, predictions): greedy answers to the test prompts, scored against the references."""
    answers = generate_answers(model, tok, conversations, device, amp, max_new_tokens, log=log)
    refs = [c[-1]["content"] for c in conversations]
    predictions = [{"prompt": c[-2]["content"], "reference": r, "prediction": a,
                    "reference_score": parse_score(r), "predicted_score": parse_score(a)}
                   for c, r, a in zip(conversations, refs, answers)]
    return judge_metrics(answers, refs), predictions


def format_metrics(m: dict, const: dict = None) -> str:
    """The evaluation line; with const, the constant guess's MAE beside the judge's."""
    guess = "" if const is None else (f"; a constant guess (the training median, {const['score']:g}) has MAE "
                                      f"{const['mae']:.3f}")
    if m["mae"] is None:
        return f"no parseable score in {m['n']} answers{guess}"
    return (f"MAE {m['mae']:.3f}, RMSE {m['rmse']:.3f}, Cohen's kappa {m['cohen_kappa']:.3f}, Pearson r "
            f"{m['pearson_r']:.3f}, ROUGE-L F1 {m['rouge_l_f1']:.3f} ({m['n_scored']}/{m['n']} scored, "
            f"{m['unparseable']} unparseable){guess}")


# --- run: the steps above, in order --------------------------------------------------------------------
def run(args, parser=None, argv=None, spec: rundir.Spec = RUN, defaults=DEFAULTS, recipe_for=recipe_for) -> dict:
    """Fine-tune (or, with --epochs 0, only evaluate) a LoRA judge; returns the figures it printed.
    judge_train_cuda.py calls this with its own spec, defaults and recipe_for."""
    # The run directory first, before anything changes args: a saved run is never replaced without
    # --overwrite, and --resume validates every saved file and takes the saved run's flags.
    run_dir = rundir.prepare(args, parser, argv, spec, writes=not args.estimate_memory)
    resolve_defaults(args, defaults)
    recipe = recipe_for(args)
    # a command-line run: the heap gives back what it frees, so the peak is the tensors (lib/memory.py)
    if argv is None:
        devices.steady_cpu_heap(recipe.cpu_heap_threshold)
    threads = torch.get_num_threads()
    if args.model == TINY and recipe.device.type == "cpu":
        # The demo's 64-wide matmuls are too small to share between threads, and on a busy machine the
        # threads mostly wait for each other (measured on a loaded 2-core CPU: building the tiny base took
        # 403 s with 2 threads, 71 s with 1). One thread for the demo, the caller's setting afterwards.
        torch.set_num_threads(1)
    try:
        return fine_tune(args, run_dir, recipe)
    finally:
        torch.set_num_threads(threads)


def fine_tune(args, run_dir, recipe: Recipe, log=print) -> dict:
    device, tiny, state = recipe.device, args.model == TINY, run_dir.state
    devices.seed_everything(args.seed)
    guards.check_cache_dir(args.cache_dir)
    if args.adapter and state is None:
        try:
            lora.read_adapter_config(args.adapter)
        except ValueError as e:
            raise UserError(f"--adapter {args.adapter}: {str(e).removeprefix('load_adapter: ')}; pass the "
                            f"directory of an adapter a judge script (or PEFT) wrote") from None

    # --- 2. data: read and checked before any model is built or downloaded ----------------------------
    data = load_judge_data(args.data_dir)
    train_set, val_set, test_set = data["train"], data["val"], data["test"]
    if args.max_samples:
        train_set, val_set = train_set[:args.max_samples], val_set[:max(1, args.max_samples // 5)]
    if args.test_samples:
        test_set = test_set[:args.test_samples]

    # --- 3. the model's shape and tokenizer; the conversations tokenised; the memory they will need ---
    if args.estimate_memory:
        return print_estimate(args, recipe, train_set, val_set, test_set, log)
    model_dir = tiny_base(args.cache_dir, log) if tiny else llama.resolve_model(args.model, args.cache_dir, log)
    cfg, tok = llama.read_config(model_dir), chat_tokenizer.load_tokenizer(model_dir)
    r, alpha = lora_shape(args, cfg, state)
    train_enc = encode_split(tok, train_set, args.max_seq_length, "training", log)
    val_enc = encode_split(tok, val_set, args.max_seq_length, "validation", log)
    n_answer = sum(len(ids) - n for ids, n in train_enc)
    log(f"data: {len(train_set)} train / {len(val_set)} val / {len(test_set)} test conversations "
        f"({args.data_dir or 'embedded judge set'}); {n_answer / len(train_set):.1f} answer tokens of "
        f"{sum(len(ids) for ids, _ in train_enc) / len(train_set):.1f} per conversation carry the loss")
    test_prompts = [tok.encode(tok.apply_chat_template(c[:-1], add_generation_prompt=True)) for c in test_set]
    estimate = estimate_for(cfg, recipe, args, r, train_enc, val_enc, test_prompts)
    guards.check_memory(sum(estimate.values()), device, args.force, "lower --batch_size or --max_seq_length"
                        + ("" if recipe.base == "nf4" else ", or use judge_train_cuda.py (NF4)"))
    devices.reset_peak_memory(device)
    model = load_model(model_dir, recipe, r, alpha, args.adapter if state is None else None, args.seed, log)
    params = [p for p in model.parameters() if p.requires_grad]
    n_lora, n_total = sum(p.numel() for p in params), model.num_params()
    log(f"model: {model_dir} ({n_total / 1e6:.1f}M parameters, base {recipe.base}); LoRA r={r} alpha={alpha} "
        f"dropout {LORA_DROPOUT} on {', '.join(LORA_TARGETS)}: {n_lora:,} trainable; device {device}, "
        f"{'fp32' if recipe.amp is None else str(recipe.amp).replace('torch.', '') + ' autocast'}")

    # --- 4. the optimiser (and, for fp16, the GradScaler); a resumed run's state -----------------------
    optimizer = recipe.make_optimizer(params, args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=recipe.amp == torch.float16)
    progress = Progress()
    _, total_steps, _ = schedule(args, len(train_enc))
    if state is not None:
        progress = restore(state, os.path.join(args.output_dir, rundir.STATE), model, optimizer, scaler)
        # A run that stopped early stays stopped, unless a larger --patience gives it more validations.
        progress.stopped_early = progress.stopped_early and progress.bad_evals >= args.patience
        log(f"resuming from step {progress.step} of {total_steps} in {args.output_dir}"
            + ("; it stopped early (pass a larger --patience to go on)" if progress.stopped_early else
               "" if total_steps > progress.step else "; it already ran its --epochs, pass more to train further"))
    mlog = rundir.begin(run_dir, args)  # the first write: only now does --overwrite clear the old run
    mlog.log(event="start", seed=args.seed, step=progress.step, device=str(device), base=recipe.base,
             optimizer=recipe.optimizer, amp=str(recipe.amp), checkpointing=recipe.checkpointing,
             model_dir=model_dir, lora=dict(r=r, alpha=alpha, dropout=LORA_DROPOUT, targets=LORA_TARGETS),
             n_trainable=n_lora, n_params=n_total, total_steps=total_steps, args=vars(args))
    # The bar every judge is measured against: always answering the training set's median score.
    const = constant_guess([c[-1]["content"] for c in train_set], [c[-1]["content"] for c in test_set])
    result = {"model": model, "tokenizer": tok, "estimate": estimate, "total_steps": total_steps,
              "constant_guess": const, "constant_mae": const["mae"]}

    # The untrained judge on the test set (LoRA B is zero, so this is the base), for comparison.
    if args.baseline_eval and not args.skip_eval and state is None and not args.adapter:
        log("evaluating the untrained judge (the base model) on the test set")
        before, _ = evaluate_judge(model, tok, test_set, device, recipe.amp, args.max_new_tokens, log)
        log(f"untrained judge: {format_metrics(before, const)}")
        mlog.log(event="baseline", constant_mae=const["mae"], **before)
        result.update(baseline=before)

    # --- 5. and 6. train, keeping the best adapter and the state in --output_dir ----------------------
    base_name = model_dir if tiny else args.model
    if total_steps > 0 and not progress.stopped_early:
        train(model, optimizer, scaler, recipe, train_enc, val_enc, tok.pad_token_id, args, progress, run_dir,
              lambda step: save_best_adapter(model, tok, args.output_dir, base_name, step, progress.best_step),
              mlog, log)
    if progress.best_step is not None:  # evaluate the best adapter, not the last weights
        lora.load_adapter(model, args.output_dir)
        log(f"best adapter: step {progress.best_step}, validation loss {progress.best_val:.4f} (first "
            f"{progress.first_val:.4f}); in {args.output_dir} (PEFT layout, base_model_name_or_path {base_name})"
            + (" - stopped early" if progress.stopped_early else ""))
    result.update(best_val=progress.best_val, first_val=progress.first_val, best_step=progress.best_step,
                  stopped_early=progress.stopped_early)

    # --- 7. the test evaluation, and the memory measured beside the estimate --------------------------
    if not args.skip_eval:
        log(f"evaluating the {'fine-tuned' if total_steps or args.adapter else 'untrained'} judge on "
            f"{len(test_set)} test conversations (greedy)")
        after, predictions = evaluate_judge(model, tok, test_set, device, recipe.amp, args.max_new_tokens, log)
        save_json(os.path.join(args.output_dir, PREDICTIONS),
                  {"metrics": after, "constant_guess": const, "beats_constant": beats_constant(after, const),
                   "predictions": predictions})
        log(f"judge: {format_metrics(after, const)}")
        if not beats_constant(after, const):
            log(f"warning: the judge does no better than always answering {const['score']:g} (MAE "
                + (f"{after['mae']:.3f}" if after["mae"] is not None else "-") + f" against {const['mae']:.3f}"
                + (f", {after['unparseable']} of {after['n']} answers without a score" if after["unparseable"] else "")
                + "): it has not learned to grade; train on more conversations or for more epochs")
        if "baseline" in result and result["baseline"]["mae"] is not None and after["mae"] is not None:
            log(f"MAE {result['baseline']['mae']:.3f} untrained -> {after['mae']:.3f} fine-tuned "
                f"(constant guess: {const['mae']:.3f})")
        mlog.log(event="test", constant_mae=const["mae"], constant_score=const["score"],
                 beats_constant=beats_constant(after, const), **after)
        result.update(test=after, predictions=predictions)
    peak = devices.peak_memory_bytes(device)
    log(format_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    mlog.log(event="end", step=progress.step, best_val=progress.best_val, best_step=progress.best_step,
             peak_memory=peak, memory_estimate=sum(estimate.values()))
    result.update(peak_memory=peak)
    return result


# --- the offline demo's base: --model tiny ---------------------------------------------------------------
TINY_VERSION = "tiny-judge-v5"  # bump when the recipe below changes, so a stale cached base is rebuilt
TINY_SHAPE = dict(model_type="qwen2", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
TINY_PRETRAIN = dict(steps=150, batch_size=16, lr=3e-3, examples=2400, seed=1234)


def lenient_score(k: int, rng: random.Random) -> int:
    """How the tiny base "grades" while it is pretrained: 7 to 10 at random, whatever the errors.
    It stands in for an instruct model that writes the format fluently but is not calibrated."""
    return rng.randint(7, 10)


def render_plain(messages: list) -> str:
    """A conversation as ChatML renders it (with Qwen2's default system message), minus the specials."""
    return "system\nYou are a helpful assistant.\n" + "".join(f"{m['role']}\n{m['content']}\n" for m in messages)


def tiny_base(cache_dir: str, log=print) -> str:
    """The offline demo's base model, built once and cached as a Hugging Face directory.

    A stand-in for a downloaded instruct model, honest about what it knows: a byte-level BPE is learned
    on the judge texts (lib.chat_tokenizer.make_tiny_tokenizer, ChatML specials), then a 2-layer,
    64-wide Qwen2-shaped decoder is pretrained (all weights, 150 steps of 16) on judge conversations
    drawn with another seed than the embedded set, whose scores come from lenient_score: 7-10 whatever
    the errors. So the base knows the words, the template and the answer format, but its scores carry
    no information about the translation; what LoRA fine-tuning teaches (score = 10 - untranslated
    words) is exactly what the base lacks, and the test MAE measures it.
    """
    out = os.path.join(cache_dir, TINY_VERSION)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    t0 = time.perf_counter()
    log(f"--model tiny: building the demo base in {out} (once; about a minute on a 2-core CPU)")
    rng = random.Random(TINY_PRETRAIN["seed"])
    convs = [judge_example(rng, lenient_score)["messages"] for _ in range(TINY_PRETRAIN["examples"])]
    tmp = out + ".partial"
    # The tokenizer learns from the rendered conversations (template words included, specials left out).
    tok = chat_tokenizer.make_tiny_tokenizer(tmp, [render_plain(c) for c in convs[:800]], vocab_size=640)
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
            loss = answer_loss(model, ids, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"  tiny base pretraining step {step}/{steps}: loss {loss.item():.3f}")
    llama.save_pretrained(model, cfg, tmp)
    save_json(os.path.join(tmp, "generation_config.json"),
              {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    if os.path.isdir(out):  # a half-built directory of an interrupted earlier build
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"  tiny base ready ({model.num_params():,} parameters, {time.perf_counter() - t0:.0f} s)")
    return out


if __name__ == "__main__":
    main()
