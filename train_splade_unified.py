"""Train a SPLADE sparse retriever: a BERT masked-LM whose vocabulary logits become weighted terms.

    python train_splade_unified.py              # offline demo: stdlib docstring -> code, CPU, minutes
    python train_splade_unified.py --train-file data/training.json --val-file data/val.json \\
        --model-name naver/splade-cocondenser-ensembledistil --output-dir out/splade
    python train_splade_unified.py --search out/splade --query "how do I parse a date"

SPLADE turns a text into one weight per vocabulary entry: w_j = max over the text's tokens i of
log(1 + ReLU(logit_ij)), where logit_ij is the masked-LM head's score for vocabulary entry j at
position i. Most weights are zero, so a document is a short bag of weighted terms (including terms
it does not contain: "expansion") and search is an inverted index, as in a classic search engine.
Training is contrastive: each query must score its positive document above its hard negative(s)
and every other document in the batch, while a FLOPS penalty keeps the vectors sparse.

Read top to bottom: arguments and the run directory, data, the SPLADE loss, encoding and search,
validation, memory estimate, save, then run(), the recipe in its stages: device, model, data,
optimiser, training loop, save, index, report. train_splade_optimized.py imports this file and adds
exact gradient accumulation (GradCache), device forcing, memory tracking, memory-efficient mode and
mixed precision.

Nothing saved is lost (lib/rundir.py, the run contract every script shares): a fresh run refuses an
--output-dir holding a saved run (--resume or --overwrite), and --overwrite removes nothing until
every check has passed; --resume validates every saved file, keeps the saved run's flags and refuses
contradicting ones; an update with a non-finite gradient is skipped, ten in a row stop the run, and
non-finite weights are never saved; Ctrl-C saves and exits 130.

From Python, once a run has saved OUT (or with any Hugging Face SPLADE checkpoint):

    from train_splade_unified import load_splade, encode
    model, tokenizer = load_splade("out/train_splade_unified")   # a directory or a hub id
    tokenizer.encode("parse a date")                             # ids with [CLS] ... [SEP]
    reps = encode(model, tokenizer, ["parse a date", "def parse(s): ..."], max_length=256)
    reps.shape                                                   # [2, vocab_size], mostly zeros
    (reps[0] @ reps[1]).item()                                   # the relevance score

With no checkpoint (the offline default) the vocabulary (WordPiece, up to 8,192 entries) is learned from
the training texts and a small BERT starts from random weights: a demonstration of the mechanics,
not a competitive retriever. Explained with this repo's numbers in docs/splade_explained.md.
"""

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import textwrap
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from lib import bert, checkpoint, exercise, guards, memory, metrics, optim, rundir, wordpiece
from lib import data as stdlib_data
from lib import device as devices
from lib.errors import UserError, report_and_exit

OUT_DIR = "out/train_splade_unified"
METRICS = ("mrr@10", "recall@10", "recall@100", "ndcg@10")
INDEX_FILE, DOCUMENTS_FILE, INDEX_FORMAT = "index.safetensors", "documents.json", "byhand-splade-index-v1"
# The embedded default: how many docstring -> code pairs, and how much of each function is kept.
STDLIB_TRAIN, STDLIB_VAL, STDLIB_MAX_LINES, STDLIB_VAL_PERCENT = 1600, 400, 24, 20


# --- arguments ----------------------------------------------------------------------------------
def build_parser(description=None, out_dir=OUT_DIR):
    p = argparse.ArgumentParser(
        description=description or "Train a SPLADE sparse retriever (BERT masked-LM + FLOPS), or search with one.",
        formatter_class=guards.HelpFormatter,
        conflict_handler="resolve",  # train_splade_optimized.py redefines --grad-accum
    )
    g = p.add_argument_group("data")
    g.add_argument("--train-file", help="JSON list or JSONL of {query, positive_document, negative_documents}"
                   "; none given: docstring -> code pairs from the running Python's standard library")
    g.add_argument("--val-file", help="same format; its documents form the retrieval pool for MRR@10 and recall"
                   "; none given: the stdlib set's held-out modules (none with --train-file)")
    g.add_argument("--max-length", type=guards.positive_int, default=64,
                   help="documents are cut to this many tokens (64 keeps the CPU demo in minutes; 256 or more for real "
                        "text)")
    g.add_argument("--max-query-length", type=guards.positive_int, default=32,
                   help="queries are cut to this many tokens")
    g.add_argument("--negatives-per-query", type=guards.nonneg_int, default=1,
                   help="hard negatives drawn per query and step from its negative_documents (0: in-batch only)")
    g = p.add_argument_group("model")
    g.add_argument("--model-name", "--init-from", dest="model_name",
                   help="a Hugging Face BERT/DistilBERT masked-LM (local directory or hub id, e.g. "
                   "naver/splade_v2_distil); none given: learn a WordPiece vocabulary and train a small BERT "
                   "from scratch")
    g.add_argument("--cache-dir", default=stdlib_data.default_cache_dir(), help="where hub downloads are kept")
    g.add_argument("--vocab-size", type=guards.positive_int, default=8192,
                   help="from scratch: WordPiece entries to learn")
    g.add_argument("--hidden-size", type=guards.positive_int, default=128, help="from scratch: model width")
    g.add_argument("--num-layers", type=guards.positive_int, default=2, help="from scratch: transformer layers")
    g.add_argument("--num-heads", type=guards.positive_int, default=2, help="from scratch: attention heads")
    g.add_argument("--dropout", type=guards.probability,
                   help="dropout inside the encoder; none given: the checkpoint's, 0.1 from scratch")
    g = p.add_argument_group("optimisation")
    g.add_argument("--learning-rate", "--lr", dest="lr", type=guards.positive_float,
                   help="peak learning rate; none given: 5e-5 for a checkpoint, 1e-3 from scratch")
    g.add_argument("--batch-size", type=guards.positive_int, default=16, help="queries per micro-batch")
    g.add_argument("--grad-accum", type=guards.positive_int, default=1,
                   help="micro-batches per update, accumulated naively (each micro-batch sees only its own in-batch "
                   "negatives; train_splade_optimized.py accumulates exactly)")
    g.add_argument("--epochs", type=guards.positive_int, default=2, help="passes over the training set")
    g.add_argument("--steps", type=guards.nonneg_int, help="a step budget instead of --epochs")
    g.add_argument("--warmup-steps", type=guards.nonneg_int, default=30, help="linear learning-rate warmup")
    g.add_argument("--weight-decay", type=guards.nonneg_float, default=0.01, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=guards.nonneg_float, default=1.0, help="clip the gradient norm (0: off)")
    g.add_argument("--lambda-q", type=guards.nonneg_float, default=3e-4, help="FLOPS weight on the queries")
    g.add_argument("--lambda-d", type=guards.nonneg_float, default=1e-4, help="FLOPS weight on the documents")
    g.add_argument("--reg-warmup-steps", type=guards.nonneg_int, default=100,
                   help="the lambdas grow quadratically from 0 to their value over this many steps")
    g = p.add_argument_group("validation and early stopping")
    g.add_argument("--early-stopping", action="store_true", help="stop when the monitored metric stops improving")
    g.add_argument("--early-stopping-patience", type=guards.positive_int, default=3,
                   help="validations without improvement before stopping")
    g.add_argument("--early-stopping-min-delta", type=guards.nonneg_float, default=1e-4,
                   help="smallest improvement that counts")
    g.add_argument("--early-stopping-monitor", default="mrr@10", choices=METRICS,
                   help="validation metric for early stopping and the best model")
    g.add_argument("--save-best-only", action="store_true",
                   help="OUT keeps only the best validated model (a later, worse epoch is not saved)")
    g.add_argument("--eval-batch-size", type=guards.positive_int, default=64, help="texts per batch when encoding")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=["cuda", "mps", "cpu"],
                   help="where to train; none given: cuda, then mps, then cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="autocast dtype; auto = bf16 on CUDA (fp16 + GradScaler without bf16) and on a CPU with native "
                   "bf16 (AVX512-BF16 or AMX), else fp32")
    g.add_argument("--seed", type=int, default=42, help="seeds weights, data order, negatives and dropout")
    g.add_argument("--output-dir", "--out-dir", dest="output_dir", default=out_dir,
                   help="the model (Hugging Face masked-LM layout), training state, metrics.jsonl and search index")
    g.add_argument("--resume", action="store_true", help="continue the run saved in --output-dir")
    g.add_argument("--save-interval", type=guards.nonneg_int, default=0,
                   help="also save every N steps (0: at the end of each epoch only)")
    g.add_argument("--log-interval", type=guards.positive_int, default=10, help="steps between progress lines")
    g.add_argument("--index", default="pool", choices=["pool", "all", "none"],
                   help="documents in the search index saved at the end: the val pool (the training documents "
                   "without val data), all train + val documents, or no index")
    g.add_argument("--estimate-memory", action="store_true", help="print the predicted memory breakdown and exit")
    guards.add_safety_flags(p)
    g = p.add_argument_group("search (no training)")
    g.add_argument("--search", metavar="DIR", help="a saved run: encode --query and search its index")
    g.add_argument("--query", help="the text to search for, with --search")
    g.add_argument("--top-k", type=guards.positive_int, default=10, help="documents to print")
    return p


# --- the run directory (lib/rundir.py) ---------------------------------------------------------
# What a saved run holds, and which flags --resume may change. The fixed flags make the run what it
# is (the data, the model's shape and vocabulary, the batches a step reads): given again they must
# match, and not given they take the saved values, so that resuming is exact. A data file that moved
# may be given again when its contents are the same. Every saved file is checked before anything is
# written; the checks below catch what a truncated file would otherwise only show as a traceback.
def check_vocab(path):
    """vocab.txt has as many entries as the vocabulary of the tokenizer.json beside it."""
    beside = os.path.join(os.path.dirname(path), "tokenizer.json")
    want = len(rundir.read_json(beside)["model"]["vocab"]) if os.path.exists(beside) else None
    with open(path, encoding="utf-8", errors="replace") as f:
        have = sum(1 for _ in f)
    if want is not None and have != want:
        raise rundir.damaged(path, f"{have:,} entries, but the tokenizer.json beside it has {want:,}")


def check_index(path):
    if rundir.safetensors_metadata(path).get("format") != INDEX_FORMAT:
        raise rundir.damaged(path, f"not a SPLADE index ({INDEX_FORMAT})")


def check_documents(path):
    """documents.json: the indexed texts, as many as index.safetensors beside it indexes."""
    documents = rundir.read_json(path)
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise rundir.damaged(path, "not a JSON list of document texts")
    index = os.path.join(os.path.dirname(path), INDEX_FILE)
    n_docs = rundir.safetensors_metadata(index).get("n_docs") if os.path.exists(index) else None
    if n_docs is not None and int(n_docs) != len(documents):
        raise rundir.damaged(path, f"{len(documents):,} documents, but {INDEX_FILE} indexes {int(n_docs):,}")


MODEL_FILES = {bert.CONFIG: "json", bert.SAFETENSORS: "safetensors", "tokenizer.json": "json", "vocab.txt": check_vocab,
               "tokenizer_config.json": "json", "special_tokens_map.json": "json"}
RUN = rundir.Spec(
    saved={**MODEL_FILES, rundir.STATE: "state", **{f"best/{name}": check for name, check in MODEL_FILES.items()},
           INDEX_FILE: check_index, DOCUMENTS_FILE: check_documents},
    # A tokenizer is tokenizer.json or vocab.txt (runs saved before tokenizer.json was written have only
    # vocab.txt; a vocabulary with gaps has no vocab.txt): check_model_dir insists on one of them.
    optional=("tokenizer.json", "vocab.txt", *(f"best/{name}" for name in MODEL_FILES)),
    products=(INDEX_FILE, DOCUMENTS_FILE),  # written at the end, from the final model: in no commit
    written=(rundir.METRICS, "best"),
    same_step=(bert.SAFETENSORS,),
    fixed=("train_file", "val_file", "model_name", "vocab_size", "hidden_size", "num_layers", "num_heads", "dropout",
           "max_length", "max_query_length", "negatives_per_query", "batch_size", "grad_accum", "seed",
           "early_stopping_monitor"),
    changeable=("lr", "epochs", "steps", "warmup_steps", "weight_decay", "grad_clip", "lambda_q", "lambda_d",
                "reg_warmup_steps", "early_stopping", "early_stopping_patience", "early_stopping_min_delta",
                "save_best_only", "eval_batch_size", "dtype", "save_interval", "log_interval", "index"),
    data=("train_file", "val_file"),
    local=("search", "query", "top_k"),
    out_flag="--output-dir",
)


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # a command-line run: the heap gives back what it frees (lib/device.py)
        devices.steady_cpu_heap()
    try:
        if args.search or args.query:
            return search_cli(args)
        # The run directory first, before anything reads the flags: --resume takes the saved run's.
        run_dir = rundir.prepare(args, parser, sys.argv[1:] if argv is None else list(argv), RUN,
                                 writes=not args.estimate_memory)
        return run(args, run_dir)
    except (UserError, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM outside the loop: one line, 130 or 143
        report_and_exit(e)


# --- data ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Example:
    query: str
    positive: str
    negatives: list  # of str


def _line_col(text, pos):
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _json_records(path, text):
    """[(record, line)] from a JSON list or JSONL, with the line each record starts on."""
    dec = json.JSONDecoder()
    where = f"; fix the JSON in {path}"

    def decode(pos):
        try:
            return dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg}){where}") from None

    def skip_ws(pos):
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip_ws(0)
    if pos == len(text):
        raise UserError(f"{path} is empty; expected a JSON list (or JSONL) of "
                        f"{{\"query\", \"positive_document\", \"negative_documents\"}} records")
    records = []
    if text[pos] == "[":  # a JSON list: walk it element by element to know where each record starts
        pos = skip_ws(pos + 1)
        if pos < len(text) and text[pos] == "]":
            return records, skip_ws(pos + 1)
        while True:
            line = _line_col(text, pos)[0]
            value, pos = decode(pos)
            records.append((value, line))
            pos = skip_ws(pos)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(pos + 1)
            elif pos < len(text) and text[pos] == "]":
                return records, skip_ws(pos + 1)
            else:
                line, col = _line_col(text, pos)
                raise UserError(f"{path}: invalid JSON at line {line}, column {col} (expected ',' or ']' after "
                                f"record {len(records) - 1}){where}")
    if text[pos] != "{":
        line, col = _line_col(text, pos)
        raise UserError(f"{path}: the top level at line {line}, column {col} is not a list; expected a JSON list "
                        f"of records or one JSON object per line (JSONL)")
    for lineno, raw in enumerate(text.splitlines(), 1):  # JSONL: one object per line
        if not raw.strip():
            continue
        try:
            records.append((json.loads(raw), lineno))
        except json.JSONDecodeError as e:
            hint = " (a single JSON object? the top level must be a list, or one object per line)" \
                if lineno == 1 and raw.strip() == "{" else ""
            raise UserError(f"{path}: invalid JSON at line {lineno}, column {e.colno} ({e.msg}){hint}{where}") from None
    return records, len(text)


def read_examples(path, flag, need_negatives, log=print):
    """The original trainer's format -> [Example]; any problem is one UserError naming file, record, field."""
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path} does not exist or is not a file; pass a JSON or JSONL file of training records")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    if text.startswith("\ufeff"):  # Windows editors write a byte-order mark; JSON has no place for one
        text = text[1:]
        log(f"note: {flag} {path} starts with a UTF-8 byte-order mark (BOM); it was skipped")
    records, end = _json_records(path, text)
    if end < len(text):
        line, col = _line_col(text, end)
        raise UserError(f"{path}: unexpected text after the list at line {line}, column {col}; fix the JSON")
    if not records:
        raise UserError(f"{path} holds no records; expected at least one {{\"query\", \"positive_document\", "
                        f"\"negative_documents\"}} record")
    examples = []
    for i, (rec, line) in enumerate(records):
        at = f"{path}: record {i} (line {line})"
        if not isinstance(rec, dict):
            raise UserError(f"{at} is a JSON {type(rec).__name__}, expected an object with query, positive_document "
                            f"and negative_documents")
        for key in ("query", "positive_document"):
            if key not in rec:
                raise UserError(f"{at} has no field {key!r}; every record needs query, positive_document and "
                                f"negative_documents")
            if not isinstance(rec[key], str) or not rec[key].strip():
                got = "an empty string" if isinstance(rec[key], str) else f"a JSON {type(rec[key]).__name__}"
                raise UserError(f"{at}, field {key!r}: {got}, expected a non-empty string")
        negs = rec.get("negative_documents", [])
        if not isinstance(negs, list):
            raise UserError(f"{at}, field 'negative_documents': a JSON {type(negs).__name__}, expected a list of "
                            f"strings or of {{\"document\": string}} objects")
        texts = []
        for j, neg in enumerate(negs):
            field = f"field 'negative_documents[{j}]'"
            if isinstance(neg, dict):
                if "document" not in neg:
                    raise UserError(f"{at}, {field}: an object without 'document', expected a string or "
                                    f"{{\"document\": string}}")
                neg = neg["document"]
                field = f"field 'negative_documents[{j}].document'"
            if not isinstance(neg, str) or not neg.strip():
                got = "an empty string" if isinstance(neg, str) else f"a JSON {type(neg).__name__}"
                raise UserError(f"{at}, {field}: {got}, expected a non-empty string")
            texts.append(neg)
        if need_negatives and not texts:
            raise UserError(f"{at}, field 'negative_documents': no negatives, but --negatives-per-query "
                            f"{need_negatives} needs at least one per record; add some, or pass --negatives-per-query "
                            f"0 (in-batch negatives only)")
        examples.append(Example(rec["query"], rec["positive_document"], texts))
    return examples


def _functions(rel_path, root):
    """(first docstring line, source without the docstring) for each documented function in a stdlib file."""
    try:
        with open(os.path.join(root, rel_path), encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("test"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2 or node.decorator_list:
            continue
        query = doc.strip().splitlines()[0].strip()
        if len(query.split()) < 4:
            continue
        first, doc_node = node.lineno - 1, node.body[0]
        body = lines[first:doc_node.lineno - 1] + lines[doc_node.end_lineno:node.end_lineno]
        code = textwrap.dedent("\n".join(body[:STDLIB_MAX_LINES])).strip()
        found.append((query, code))
    return found


def stdlib_examples(files=None, n_train=STDLIB_TRAIN, n_val=STDLIB_VAL, n_hard=3):
    """The embedded default set: docstring first line -> the function's code, from the running Python.

    Split by module (a hash of its path), so no val query's module was seen in training. Negatives:
    up to n_hard other functions of the same module (hard: same names, same style) and one from
    elsewhere. Returns (train examples, val examples, val document pool).
    """
    root = stdlib_data.sysconfig.get_paths()["stdlib"]
    files = stdlib_data.stdlib_files() if files is None else files
    by_split = {"train": [], "val": []}
    seen_queries = set()
    # Visit modules in the order of a hash of their path (a fixed shuffle) and stop once both splits
    # have enough: parsing the whole stdlib would take half a minute.
    for rel in sorted(files, key=lambda rel: hashlib.sha1(rel.encode()).hexdigest()):
        split = "val" if int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100 < STDLIB_VAL_PERCENT else "train"
        funcs = [(q, c) for q, c in _functions(rel, root) if q not in seen_queries]
        seen_queries.update(q for q, _ in funcs)
        by_split[split].append(funcs)
        if all(sum(map(len, by_split[s])) >= n for s, n in (("train", n_train), ("val", 2 * n_val))):
            break
    rng = random.Random(0)
    out = {}
    for split, modules in by_split.items():
        all_code = [c for funcs in modules for _, c in funcs]
        examples = []
        for funcs in modules:
            for i, (query, code) in enumerate(funcs):
                others = [c for j, (_, c) in enumerate(funcs) if j != i and c != code]
                negatives = rng.sample(others, min(n_hard, len(others)))
                negatives.append(rng.choice(all_code))
                examples.append(Example(query, code, [n for n in negatives if n != code]))
        rng.shuffle(examples)
        out[split] = examples
    val = out["val"][:n_val]
    pool = sorted({c for funcs in by_split["val"] for _, c in funcs})  # every val-module function
    return out["train"][:n_train], val, pool


def val_pool(examples):
    """The retrieval pool of a val file: every distinct document in it, positives and negatives."""
    docs = {}
    for ex in examples:
        for text in [ex.positive, *ex.negatives]:
            docs.setdefault(text, len(docs))
    return list(docs)


def pad(id_lists, pad_id):
    """Right-pad token-id lists to the longest -> (input_ids [B, T], attention_mask [B, T])."""
    width = max(len(ids) for ids in id_lists)
    ids = torch.full((len(id_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(id_lists), width), dtype=torch.long)
    for i, row in enumerate(id_lists):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


@dataclasses.dataclass
class Batch:
    """One micro-batch: B queries; documents = B positives, then each query's k negatives in query order."""
    q_ids: torch.Tensor
    q_mask: torch.Tensor
    d_ids: torch.Tensor
    d_mask: torch.Tensor


def batch_for_step(examples, ids, step, steps_per_epoch, batch_size, grad_accum, k, seed, pad_id):
    """The micro-batches of optimizer step `step`: a pure function of (seed, step), so --resume is exact.

    Epoch e visits the examples in a shuffled order seeded by (seed, e); the negatives of example i
    in epoch e are drawn by a generator seeded by (seed, e, i).
    """
    epoch, pos = divmod(step, steps_per_epoch)
    order = list(range(len(examples)))
    random.Random(f"{seed}-order-{epoch}").shuffle(order)
    per_step = batch_size * grad_accum
    chosen = order[pos * per_step:(pos + 1) * per_step]
    micro = []
    for m in range(grad_accum):
        part = chosen[m * batch_size:(m + 1) * batch_size]
        queries = [ids["q"][examples[i].query] for i in part]
        positives = [ids["d"][examples[i].positive] for i in part]
        negatives = []
        for i in part:
            rng, negs = random.Random(f"{seed}-neg-{epoch}-{i}"), examples[i].negatives
            picked = (rng.sample(negs, k) if len(negs) >= k else rng.choices(negs, k=k)) if k and negs else []
            negatives += [ids["d"][t] for t in picked]
        micro.append(Batch(*pad(queries, pad_id), *pad(positives + negatives, pad_id)))
    return micro


# --- the SPLADE loss ----------------------------------------------------------------------------
def splade_max(logits, attention_mask):
    """SPLADE-max: w_j = max over unmasked positions i of log(1 + ReLU(logit_ij)); [B, T, V] -> [B, V].

    log(1 + ReLU(x)) never decreases as x grows, so the max can be taken over the raw logits first
    and the activation applied to the [B, V] result: the same weights and gradients, with one [B, T, V]
    tensor kept for backward instead of two (the logits are by far the largest activation). Under
    torch.no_grad (encoding for search) no backward needs the raw logits: they are masked in place,
    one [B, T, V] tensor less.
    """
    logits, padding = logits.float(), attention_mask.unsqueeze(-1) == 0
    if torch.is_grad_enabled():
        logits = logits.masked_fill(padding, float("-inf"))
    else:
        logits.masked_fill_(padding, float("-inf"))
    return torch.log1p(torch.relu(logits.amax(dim=1)))


splade_max = exercise.swap("splade", splade_max)  # BYHAND_EXERCISE=splade: yours (exercises/splade.py)


def flops(reps):
    """naver/splade's FLOPS regulariser: sum over terms of (mean weight over the batch)^2.

    The expected number of multiply-adds when a random query meets a random document is about
    sum_j P(q_j != 0) P(d_j != 0); squaring the mean weight is its smooth stand-in, and it
    punishes a term most when the whole batch uses it (a term in every posting list is expensive).
    """
    return (reps.mean(dim=0) ** 2).sum()


flops = exercise.swap("splade", flops)


def ranking_loss(q_reps, d_reps, positives=None):
    """Cross-entropy over q . d for each query against every document in the batch.

    Query i's positive is document positives[i] (default: document i); every other row (the other
    queries' positives, every hard negative) is one of its negatives, so a batch of B queries with
    k hard negatives each gives every query B(1 + k) - 1 negatives for the price of encoding
    B(1 + k) documents once.
    """
    scores = q_reps @ d_reps.T  # [B, B(1 + k)]
    if positives is None:
        positives = torch.arange(len(q_reps), device=scores.device)
    return F.cross_entropy(scores, positives)


def lambda_at(step, lam, warmup_steps):
    """Quadratic warm-up of a FLOPS weight: lam * (step / warmup)^2, then lam. Sparsity pressure from
    step 0 would zero the weights before the ranking signal has shaped them."""
    if warmup_steps == 0 or step >= warmup_steps:
        return lam
    return lam * (step / warmup_steps) ** 2


def splade_loss(q_reps, d_reps, lam_q, lam_d, positives=None):
    """Total loss and what is logged: rank loss + lam_q FLOPS(q) + lam_d FLOPS(d)."""
    rank = ranking_loss(q_reps, d_reps, positives)
    q_flops, d_flops = flops(q_reps), flops(d_reps)
    loss = rank + lam_q * q_flops + lam_d * d_flops
    stats = {"rank_loss": rank.detach(), "q_flops": q_flops.detach(), "d_flops": d_flops.detach(),
             "q_terms": (q_reps > 0).sum(1).float().mean().detach(),
             "d_terms": (d_reps > 0).sum(1).float().mean().detach()}
    return loss, stats


def encode_batch(model, ids, mask, amp=None):
    with devices.autocast(ids.device, amp):
        logits = model(ids, attention_mask=mask)
    return splade_max(logits, mask)


def naive_step(model, micro_batches, lam_q, lam_d, amp, scaler):
    """Forward, loss and backward for each micro-batch in turn (accumulation as the original trainer did it).

    Each micro-batch's in-batch ranking loss only sees that micro-batch's documents, so with --grad-accum N
    a query meets N times fewer negatives than in one batch of the same size (see
    train_splade_optimized.py for the exact version). Returns the summed stats, as floats.
    """
    totals = {}
    for mb in micro_batches:
        q = encode_batch(model, mb.q_ids, mb.q_mask, amp)
        d = encode_batch(model, mb.d_ids, mb.d_mask, amp)
        loss, stats = splade_loss(q, d, lam_q, lam_d)
        scaler.scale(loss / len(micro_batches)).backward()
        for key, value in {"loss": loss.detach(), **stats}.items():
            totals[key] = totals.get(key, 0.0) + value.item() / len(micro_batches)
    return totals


# --- encoding and search ------------------------------------------------------------------------
@torch.no_grad()
def encode_batches(model, tokenizer, texts, max_length=256, batch_size=64, amp=None):
    """SPLADE weights of the texts, batch_size at a time: float tensors [rows, vocab_size] on the CPU.
    A collection is indexed batch by batch (build_index), so its dense [texts, vocab] never exists."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for start in range(0, len(texts), batch_size):
            rows = [tokenizer.encode(t, max_length=max_length) for t in texts[start:start + batch_size]]
            ids, mask = pad(rows, tokenizer.pad_id)
            yield encode_batch(model, ids.to(device), mask.to(device), amp).float().cpu()
    finally:
        model.train(was_training)


def encode(model, tokenizer, texts, max_length=256, batch_size=64, amp=None):
    """SPLADE weights of each text: a float tensor [len(texts), vocab_size] on the CPU."""
    reps = list(encode_batches(model, tokenizer, texts, max_length, batch_size, amp))
    return torch.cat(reps) if reps else torch.zeros(0, tokenizer.vocab_size)


def load_model_and_tokenizer(name_or_dir, cache_dir=None, log=print):
    """(model, cfg, tokenizer) from a BERT/DistilBERT masked-LM directory or hub id (lib/bert.py, lib/wordpiece.py)."""
    model, cfg, model_dir = bert.load_pretrained(name_or_dir, cache_dir=cache_dir, log=log)
    tokenizer = wordpiece.load_tokenizer(model_dir, log=log)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"{tokenizer.where} has {tokenizer.vocab_size} entries but the model only "
                        f"{cfg.vocab_size}; the tokenizer does not belong to this model")
    return model, cfg, tokenizer


def load_splade(name_or_dir, cache_dir=None):
    """A SPLADE checkpoint (a directory, or a hub id downloaded with lib/hub.py) -> (model, tokenizer)."""
    model, _, tokenizer = load_model_and_tokenizer(name_or_dir, cache_dir, log=lambda *a, **k: None)
    return model.eval(), tokenizer


@torch.no_grad()
def init_lexical(model):
    """From scratch: start the MLM head as "each token predicts itself", so step 0 is a bag of words.

    The decoder is tied to the word embeddings, so with the head's dense layer set to the identity a
    position's strongest logit is its own token (e_t . e_t ~ H sigma^2 against noise of about
    sigma^2 sqrt(H) for other entries, sigma = 0.02). A negative output bias of 3.5 noise standard
    deviations then zeroes the other terms. Training starts from this lexical matcher and learns
    term weights and expansion; from plain random weights a small model first has to discover that
    words should match themselves, which takes far longer than the demo's few minutes.
    """
    dense = model.predictions.transform.dense
    hidden = dense.weight.shape[0]
    dense.weight.copy_(torch.eye(hidden))
    noise = model.cfg.initializer_range * hidden ** 0.5  # std of e_j . x for |x| = sqrt(H) (LayerNorm output)
    model.predictions.bias.fill_(-3.5 * noise)
    return model


def set_dropout(model, cfg, p):
    """Change a loaded model's dropout (the checkpoint's config sets it at build time)."""
    cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = p
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
        if hasattr(m, "attn_p"):
            m.attn_p = p


def build_index(doc_reps):
    """The inverted index: for each term, the documents that use it and their weights.

    Stored as a CSR matrix [vocab, n_docs] (term-major): term_ptr[t]:term_ptr[t + 1] is term t's
    posting list in doc_ids / weights. A query touches only the posting lists of its own terms.
    doc_reps: a [n_docs, vocab] tensor, or its rows in blocks (encode_batches), of which only the
    nonzero entries are kept.
    """
    docs, terms, weights, n_docs = [], [], [], 0
    for block in [doc_reps] if torch.is_tensor(doc_reps) else doc_reps:
        nz = block.nonzero()  # (doc, term) pairs, in doc order
        docs.append(nz[:, 0] + n_docs)
        terms.append(nz[:, 1])
        weights.append(block[nz[:, 0], nz[:, 1]].float())
        n_docs, vocab = n_docs + len(block), block.shape[1]
    docs, terms, weights = torch.cat(docs), torch.cat(terms), torch.cat(weights)
    order = torch.argsort(terms * n_docs + docs)
    counts = torch.bincount(terms, minlength=vocab)
    term_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return {"term_ptr": term_ptr, "doc_ids": docs[order], "weights": weights[order]}


def score(index, q_reps, n_docs):
    """q . d for every query and every indexed document, through the posting lists: [n_q, n_docs]."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        inverted = torch.sparse_csr_tensor(index["term_ptr"], index["doc_ids"], index["weights"],
                                           size=(len(index["term_ptr"]) - 1, n_docs))
        return q_reps.float() @ inverted  # each query weight times its term's posting list, summed per document


def save_index(out_dir, index, documents, step):
    tensors = {k: v.contiguous() for k, v in index.items()}
    meta = {"format": INDEX_FORMAT, "n_docs": str(len(documents)), "step": str(step)}
    checkpoint.atomic_write(os.path.join(out_dir, INDEX_FILE), lambda tmp: save_file(tensors, tmp, metadata=meta))
    checkpoint.save_json(os.path.join(out_dir, DOCUMENTS_FILE), documents)


def load_index(out_dir):
    """(index, documents, the step of the model that built it); a missing or damaged file is one line."""
    for name, check in ((INDEX_FILE, check_index), (DOCUMENTS_FILE, check_documents)):
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            raise UserError(f"--search {out_dir}: {name} is missing; it is written at the end of a training run "
                            f"(not with --index none): finish the run (--resume) or train again")
        rundir.check_file(path, check)
    with safe_open(os.path.join(out_dir, INDEX_FILE), framework="pt") as f:
        index = {k: f.get_tensor(k) for k in f.keys()}
        step = (f.metadata() or {}).get("step")
    return index, rundir.read_json(os.path.join(out_dir, DOCUMENTS_FILE)), step


def search_cli(args):
    """--search OUT --query TEXT: the query's top terms, then the top-k documents of OUT's index."""
    if not (args.search and args.query):
        raise UserError("--search and --query go together: --search OUT --query 'some text'")
    if not os.path.isdir(args.search):
        raise UserError(f"--search {args.search} is not a directory; pass the --output-dir of a training run")
    index, documents, index_step = load_index(args.search)
    model, tokenizer = load_splade(args.search)
    q = encode(model, tokenizer, [args.query], args.max_query_length)[0]
    if len(index["term_ptr"]) - 1 != len(q):
        raise UserError(f"{args.search}: the index has {len(index['term_ptr']) - 1} terms, the model {len(q)}; "
                        f"the index belongs to another model, train again to rebuild it")
    model_step = checkpoint.weights_step(os.path.join(args.search, bert.SAFETENSORS))
    if index_step is not None and model_step is not None and int(index_step) != model_step:
        print(f"warning: the index was built by the model of step {index_step}, the saved model is from step "
              f"{model_step} (a resumed run that has not finished); finish it with --resume to rebuild the index",
              file=sys.stderr)
    weights, terms = q.topk(min(20, int((q > 0).sum())))
    vocab = tokenizer.ids_to_tokens
    print(f"query: {args.query!r} -> {int((q > 0).sum())} non-zero terms; top terms:")
    print("  " + "  ".join(f"{vocab[t]}:{w:.2f}" for w, t in zip(weights.tolist(), terms.tolist())))
    scores = score(index, q[None], len(documents))[0]
    top = scores.topk(min(args.top_k, len(documents)))
    print(f"top {len(top.indices)} of {len(documents)} documents:")
    results = []
    for rank, (s, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
        first = documents[i].strip().splitlines()[0] if documents[i].strip() else ""
        print(f"  {rank:2d}. {s:8.3f}  {first[:100]}")
        results.append((i, s))
    return {"terms": [vocab[t] for t in terms.tolist()], "results": results}


# --- validation -----------------------------------------------------------------------------------
def retrieval_metrics(scores, relevant):
    """MRR@10, Recall@10, Recall@100 and nDCG@10 with one relevant document per query.

    relevant[i] is the pool index of query i's positive. With a single relevant document the ideal
    DCG is 1, so nDCG@10 = 1 / log2(rank + 1) when it ranks in the top 10.
    """
    target = scores[torch.arange(len(relevant)), relevant]
    rank = (scores > target[:, None]).sum(1) + 1  # ties count in the query's favour
    rank = rank.float()
    return {
        "mrr@10": torch.where(rank <= 10, 1 / rank, 0).mean().item(),
        "recall@10": (rank <= 10).float().mean().item(),
        "recall@100": (rank <= 100).float().mean().item(),
        "ndcg@10": torch.where(rank <= 10, 1 / torch.log2(rank + 1), 0).mean().item(),
    }


def evaluate(model, tokenizer, val, args, amp):
    """Index the val pool, search it with every val query -> (metrics and sparsity, the pool's index)."""
    queries, pool, relevant = val
    index = build_index(encode_batches(model, tokenizer, pool, args.max_length, args.eval_batch_size, amp))
    scores, q_terms = [], []
    for q in encode_batches(model, tokenizer, queries, args.max_query_length, args.eval_batch_size, amp):
        scores.append(score(index, q, len(pool)))
        q_terms.append((q > 0).sum(1))
    result = retrieval_metrics(torch.cat(scores), torch.tensor(relevant))
    result.update(val_q_terms=torch.cat(q_terms).float().mean().item(), val_d_terms=len(index["weights"]) / len(pool))
    return result, index


def metrics_text(m):
    return (f"MRR@10 {m['mrr@10']:.4f} | R@10 {m['recall@10']:.4f} | R@100 {m['recall@100']:.4f} | "
            f"nDCG@10 {m['ndcg@10']:.4f} | terms q {m['val_q_terms']:.0f} d {m['val_d_terms']:.0f}")


# --- memory estimate ------------------------------------------------------------------------------
def estimate_memory(cfg, n_params, batch_size, k, q_len, d_len, device_type, amp=False, checkpointing=False,
                    optimizer_on_cpu=False, cached_batch=0, eval_batch=64, runtime=None):
    """Predicted bytes per component for one SPLADE training step.

    A micro-batch encodes batch_size queries and batch_size (1 + k) documents. Per token and layer,
    BERT keeps about 18 x hidden values for backward (q, k, v, attention output, two LayerNorm inputs
    and outputs, the 4x-wide MLP before and after GELU) plus heads x T attention probabilities; the
    MLM head's [tokens, vocab] logits cost 12 bytes a value in fp32 at the peak in backward (the
    masked logits kept for the max, the gradient the max scatters back, and the gradient of the
    logits themselves; splade_max takes the max before the activation, so nothing larger is kept;
    calibrated on CPU with bench/splade.py: 2.45 GiB measured for 2.38 GiB predicted). Gradient
    checkpointing keeps only each layer's input. cached_batch > 0 (GradCache) adds the cached
    representations of the whole effective batch and their gradients, [queries + documents, vocab].
    Validation encodes eval_batch documents at a time without a graph: their logits (masked in place)
    and one layer's temporaries; it adds to the peak only where that is more than a training step.
    On CPU the measured peak is the process's resident set: what the process holds before the model
    (Python, torch; runtime, measured by lib/memory.cpu_runtime_bytes) and the first step's kernels and
    threads come first (lib/memory.runtime_terms, the accounting every script shares), and
    devices.steady_cpu_heap() keeps the allocator from adding to it.
    """
    s = 2 if amp else 4
    tokens = batch_size * q_len + batch_size * (1 + k) * d_len
    per_layer = tokens * cfg.hidden_size * 18 * s + cfg.num_attention_heads * (
        batch_size * q_len ** 2 + batch_size * (1 + k) * d_len ** 2) * (s + 1)
    layers = cfg.num_hidden_layers
    act = (layers * tokens * cfg.hidden_size * s + per_layer) if checkpointing else layers * per_layer
    estimate = {
        "parameters (fp32)": n_params * 4,
        "gradients (fp32)": n_params * 4,
        "AdamW moments (2 x fp32)" + (" on the CPU" if optimizer_on_cpu else ""):
            0 if optimizer_on_cpu else n_params * 8,
        "encoder activations": act + tokens * cfg.hidden_size * 4 * 3,
        "MLM logits + gradient": tokens * cfg.vocab_size * (12 if not amp else 2 + 4 + 4 + 4),
    }
    if cached_batch:
        estimate["cached representations + grads"] = cached_batch * (2 + k) * cfg.vocab_size * 4 * 2
    eval_tokens = eval_batch * d_len
    validation = eval_tokens * cfg.vocab_size * (4 if not amp else 2 + 4) + eval_tokens * cfg.hidden_size * 4 * 8
    step = estimate["encoder activations"] + estimate["MLM logits + gradient"]
    if validation > step:
        estimate["validation batch, beyond a step"] = validation - step
    estimate.update(memory.runtime_terms(device_type, runtime, "runtime (measured: Python, torch, the tokenizer)"))
    return estimate


# --- save -----------------------------------------------------------------------------------------
def save_model(out_dir, model, cfg, tokenizer, step, last_saved):
    """A plain Hugging Face masked-LM directory: config.json, model.safetensors, the tokenizer
    (tokenizer.json, vocab.txt, tokenizer_config.json, special_tokens_map.json), which transformers and
    sentence-transformers' SparseEncoder load as they are. Non-finite weights are never written: the run
    stops instead, naming the last finite checkpoint."""
    guards.check_finite_weights(model.state_dict(), step, last_saved, out_dir)
    bert.save_pretrained(model, cfg, out_dir, metadata={"step": step})
    tokenizer.save(out_dir)


# --- what train_splade_optimized.py changes -------------------------------------------------------
@dataclasses.dataclass
class Variant:
    """The decisions a variant script makes differently; the defaults are this script's behaviour."""
    device: torch.device = None  # None: --device, else cuda, mps, cpu
    amp: object = "from --dtype"  # an autocast dtype, None for fp32, or "from --dtype"
    step_fn: Callable = naive_step  # (model, micro_batches, lam_q, lam_d, amp, scaler) -> stats
    prepare_model: Callable = None  # (model) -> None, before the optimiser is built
    make_optimizer: Callable = None  # (params, lr, weight_decay, device) -> optimizer
    after_step: Callable = None  # (step, record) -> text for the progress line
    estimate_kwargs: dict = dataclasses.field(default_factory=dict)
    memory_hint: str = "lower --batch-size or --max-length, or use train_splade_optimized.py (GradCache: the same " \
                       "batch in pieces that fit)"


# --- checks before any work --------------------------------------------------------------------------
def check_args(args):
    """The flags and paths rundir.prepare does not know about, checked before any work starts."""
    guards.check_cache_dir(args.cache_dir)
    for flag, path in (("--train-file", args.train_file), ("--val-file", args.val_file)):
        if path and not os.path.isfile(path):
            raise UserError(f"{flag} {path} does not exist or is not a file; pass a JSON or JSONL file of records")
    if args.val_file and not args.train_file:
        raise UserError("--val-file goes with --train-file (the embedded stdlib set brings its own validation "
                        "queries); pass both, or neither")
    if args.early_stopping and args.train_file and not args.val_file:
        raise UserError("--early-stopping needs validation data; pass --val-file")


def model_config(args, run_dir, log):
    """(cfg, model_dir): a checkpoint's (or the resumed run's) config, the flags' shape from scratch
    (model_dir None). A real run checks the whole model directory first (config, weights against it,
    the tokenizer: lib/bert.py check_model_dir), before any data is built; --estimate-memory reads
    config.json alone (a hub id downloads nothing else)."""
    model_dir = run_dir.out_dir if run_dir.resumed else args.model_name
    if model_dir and not args.estimate_memory:
        model_dir = bert.check_model_dir(model_dir, args.cache_dir, log=log)
    if model_dir:
        cfg = bert.load_config(model_dir, args.cache_dir, log=log)
    else:
        if args.hidden_size % args.num_heads:
            raise UserError(f"--hidden-size {args.hidden_size} is not divisible by --num-heads {args.num_heads}")
        cfg = bert.BertConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                              num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
                              intermediate_size=4 * args.hidden_size, max_position_embeddings=512)
    if args.dropout is not None:
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = args.dropout
    longest = max(args.max_length, args.max_query_length)
    if longest > cfg.max_position_embeddings:
        raise UserError(f"--max-length {longest} exceeds the model's {cfg.max_position_embeddings} positions; "
                        f"use at most {cfg.max_position_embeddings}")
    return cfg, model_dir


def load_data(args, k, log):
    """(train, val, val pool, source): the user's files, or the embedded stdlib set."""
    if args.train_file:
        val = read_examples(args.val_file, "--val-file", 0, log) if args.val_file else []
        return read_examples(args.train_file, "--train-file", k, log), val, val_pool(val), args.train_file
    t0 = time.perf_counter()
    train, val, pool = stdlib_examples()
    log(f"data: {len(train)} train pairs, {len(val)} val queries over a pool of {len(pool)} functions, built "
        f"from the running Python's standard library in {time.perf_counter() - t0:.1f}s")
    return train, val, pool, "the stdlib (docstring -> code)"


def tokenize(train, tokenizer, args, log):
    """Every query and document of the training set, tokenised once; a batch is then just padding."""
    t0 = time.perf_counter()
    ids = {"q": {}, "d": {}}
    for ex in train:
        ids["q"].setdefault(ex.query, tokenizer.encode(ex.query, max_length=args.max_query_length))
        for text in (ex.positive, *ex.negatives):
            if text not in ids["d"]:
                ids["d"][text] = tokenizer.encode(text, max_length=args.max_length)
    log(f"tokenised {len(ids['q']):,} queries and {len(ids['d']):,} documents in {time.perf_counter() - t0:.1f}s")
    return ids


def update_best(progress, m, step, args):
    """After a validation: is this the best model so far, and should training stop early?"""
    if progress["first_metrics"] is None:  # the model before training: the baseline, not a candidate
        progress["first_metrics"] = m
        return False, False
    value = m[args.early_stopping_monitor]
    if progress["best"] is None or value > progress["best"] + args.early_stopping_min_delta:
        progress.update(best=value, best_step=step, bad_evals=0)
        return True, False
    progress["bad_evals"] += 1
    return False, args.early_stopping and progress["bad_evals"] >= args.early_stopping_patience


# --- run: the recipe, stage by stage -----------------------------------------------------------------
def run(args, run_dir, variant=None):
    """Train from the flags; run_dir comes from rundir.prepare (main), which has settled --resume."""
    variant, log, out = variant or Variant(), print, run_dir.out_dir
    check_args(args)

    # --- device ------------------------------------------------------------------------------------
    device = variant.device or devices.pick_device(args.device)
    amp = devices.amp_dtype(device, args.dtype) if variant.amp == "from --dtype" else variant.amp
    devices.seed_everything(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    # --- model configuration and memory (config.json alone: --estimate-memory is instant) ----------
    cfg, model_dir = model_config(args, run_dir, log)
    args.lr = args.lr or (5e-5 if args.model_name else 1e-3)  # fine-tuning moves little; from scratch needs more
    k = args.negatives_per_query
    n_params = bert.param_count(cfg)
    estimate = estimate_memory(cfg, n_params, args.batch_size, k, args.max_query_length, args.max_length,
                               device.type, amp is not None, eval_batch=args.eval_batch_size,
                               runtime=memory.cpu_runtime_bytes(device.type), **variant.estimate_kwargs)
    log(f"model: {cfg.model_type} {'from ' + model_dir if model_dir else 'from scratch'}, {cfg.num_hidden_layers} "
        f"layers, {cfg.hidden_size} wide, vocabulary {cfg.vocab_size:,}, {n_params:,} parameters; device {device}, "
        f"{'fp32' if amp is None else str(amp).replace('torch.', '') + ' autocast'}; {args.batch_size} queries x "
        f"(1 + {k}) documents per micro-batch, {args.grad_accum} micro-batch(es) per step")
    log(devices.dtype_line(device, args.dtype, amp))
    if args.estimate_memory:
        log(memory_table(estimate))
        return {"estimate": estimate}
    guards.check_memory(sum(estimate.values()), device, args.force, variant.memory_hint)

    # --- a checkpoint's weights and tokenizer, before the data: a bad directory stops the run here ---
    if model_dir:
        model, cfg, tokenizer = load_model_and_tokenizer(model_dir, args.cache_dir, log)
        if args.dropout is not None:
            set_dropout(model, cfg, args.dropout)

    # --- data --------------------------------------------------------------------------------------
    train, val, pool, source = load_data(args, k, log)
    steps_per_epoch = len(train) // (args.batch_size * args.grad_accum)
    if steps_per_epoch == 0:
        raise UserError(f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} queries per step exceeds "
                        f"the {len(train)} training records; lower --batch-size")
    total_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
    position = {d: i for i, d in enumerate(pool)}
    val_data = ([ex.query for ex in val], pool, [position[ex.positive] for ex in val]) if val else None

    # --- from scratch: a vocabulary learned from the training texts, and a BERT that starts lexical --
    if not model_dir:
        t0 = time.perf_counter()
        texts = dict.fromkeys(t for ex in train for t in (ex.query, ex.positive, *ex.negatives))
        tokenizer = wordpiece.learn_vocab(list(texts), vocab_size=args.vocab_size)
        cfg.vocab_size = tokenizer.vocab_size  # a small corpus can end below --vocab-size
        log(f"learned a WordPiece vocabulary of {tokenizer.vocab_size:,} entries from the training texts "
            f"in {time.perf_counter() - t0:.1f}s")
        model = init_lexical(bert.init_weights(bert.build_model(cfg)))
    model.train()
    ids = tokenize(train, tokenizer, args, log)
    devices.reset_peak_memory(device)
    # On CPU the peak below includes what the process already holds: the data, and the heap the
    # vocabulary learning grew (Python rarely gives memory back). Say how much, beside the estimate.
    resident_before = devices.peak_memory_bytes(device) if device.type == "cpu" else 0
    model.to(device)
    if variant.prepare_model:
        variant.prepare_model(model)

    # --- optimiser ---------------------------------------------------------------------------------
    make = variant.make_optimizer or (
        lambda params, lr, wd, dev: optim.make_adamw(params, lr, wd, (0.9, 0.999), dev.type))
    optimizer = make(list(model.parameters()), args.lr, args.weight_decay, device)
    # fp16 gradients underflow; the scaler multiplies the loss up and divides the gradients back.
    scaler = torch.amp.GradScaler(device.type, enabled=amp == torch.float16)
    start_step, progress = 0, {"first_metrics": None, "best": None, "best_step": None, "bad_evals": 0}
    if run_dir.resumed:
        state = run_dir.state
        optimizer.load_state_dict(state["optimizer"])
        devices.restore_rng_states(state)
        start_step, progress = state["step"], {**progress, **json.loads(state["run"])}
        if total_steps < start_step:
            raise UserError(f"--resume: {out} is already at step {start_step}; pass --steps {start_step} or more")
        log(f"resuming from step {start_step} of {total_steps} in {out}")

    # --- training loop -----------------------------------------------------------------------------
    mlog = rundir.begin(run_dir, args)  # the first write: only now does --overwrite clear the old run
    mlog.log(event="start", seed=args.seed, step=start_step, device=str(device), data=source, n_train=len(train),
             n_val=len(val), pool=len(pool), total_steps=total_steps, steps_per_epoch=steps_per_epoch,
             n_params=n_params, config=dataclasses.asdict(cfg), args=vars(args))
    # Only finite weights are ever saved, so every checkpoint this run wrote (or resumed from) is finite.
    updates = rundir.Updates(out, last_saved=start_step if run_dir.resumed else None)
    last = {"step": None, "metrics": None, "index": None}  # the latest validation

    def save(step):
        """The model (Hugging Face layout), then what --resume needs; step = the next step to run."""
        save_model(out, model, cfg, tokenizer, step, updates.last_saved)
        rundir.save_state(run_dir, args, {"step": step, "optimizer": optimizer.state_dict(),
                                          "run": json.dumps(progress), **devices.rng_states()})
        updates.saved(step)

    def validate(step):
        """Retrieval on the val pool; keep the best model (OUT/best, or OUT itself with --save-best-only)."""
        m, last["index"] = evaluate(model, tokenizer, val_data, args, amp)
        last.update(step=step, metrics=m)
        log(f"step {step} (epoch {step / steps_per_epoch:.2f}): val {metrics_text(m)}")
        mlog.log(step=step, epoch=step / steps_per_epoch, val=m)
        improved, stop = update_best(progress, m, step, args)
        if improved and updates.in_a_row == 0 and args.save_best_only:
            save(step)
        elif improved and updates.in_a_row == 0:
            save_model(os.path.join(out, "best"), model, cfg, tokenizer, step, updates.last_saved)
        return stop

    speed = metrics.Throughput(total_steps, start_step)
    # next_step is what a checkpoint records: it moves only once the update is applied, so an
    # interrupt anywhere in a step saves a state that --resume continues without repeating work.
    next_step, stopped_early = start_step, False
    rng_at_step = None  # (step, its random states as it began): the ones a save in a step that did not count holds
    if val_data and start_step == 0:
        validate(0)
    try:
        for step in range(start_step, total_steps):
            # Before this step draws: its dropout (GradCache sets the states back and forth within the step); the
            # batch and its negatives come from generators of their own (batch_for_step).
            rng_at_step = step, devices.rng_states()
            lr_now = optim.lr_at(step, args.lr, args.warmup_steps, total_steps, 0.0)
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            lam_q, lam_d = (lambda_at(step, lam, args.reg_warmup_steps) for lam in (args.lambda_q, args.lambda_d))
            micro = batch_for_step(train, ids, step, steps_per_epoch, args.batch_size, args.grad_accum, k,
                                   args.seed, tokenizer.pad_id)
            micro = [Batch(*(t.to(device) for t in dataclasses.astuple(mb))) for mb in micro]
            stats = variant.step_fn(model, micro, lam_q, lam_d, amp, scaler)
            updates.check_loss(step, stats["loss"])  # a non-finite loss stops the run before its update
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf")).item()
            # A NaN or infinite gradient would turn every weight it touches into NaN: skip that update.
            # (Under fp16 the GradScaler skips it by itself and lowers its scale: its way of finding one.)
            skipped = not math.isfinite(grad_norm)
            with rundir.whole_update():  # Ctrl-C or SIGTERM waits for the update and its counting
                if scaler.is_enabled() or not skipped:
                    scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                next_step = step + 1
                updates.record(step, skipped and not scaler.is_enabled())  # 10 skipped in a row stop the run
            speed.add(sum(mb.q_mask.sum().item() + mb.d_mask.sum().item() for mb in micro))

            record = dict(step=step, lr=lr_now, lambda_q=lam_q, lambda_d=lam_d, grad_norm=grad_norm, **stats)
            if skipped:
                record["skipped"] = True
            note = variant.after_step(step, record) if variant.after_step else ""
            if step % args.log_interval == 0 or step == total_steps - 1 or note:
                devices.synchronize(device)
                tok_s, _, eta = speed.report(step + 1)
                mem = devices.peak_memory_bytes(device)
                record.update(tokens_per_s=round(tok_s), peak_memory=mem)
                log(f"step {step:5d}/{total_steps} | loss {stats['loss']:.4f} | rank {stats['rank_loss']:.4f} | "
                    f"flops q {stats['q_flops']:.2f} d {stats['d_flops']:.2f} | terms q {stats['q_terms']:.0f} "
                    f"d {stats['d_terms']:.0f} | lr {lr_now:.2e} | {tok_s:7,.0f} tok/s | mem "
                    f"{metrics.format_bytes(mem)}{note} | ETA {metrics.format_seconds(eta)}"
                    + (" | skipped (gradient not finite)" if skipped else ""))
            mlog.log(**record)

            end_of_epoch = next_step % steps_per_epoch == 0 or next_step == total_steps
            if end_of_epoch and val_data:
                stopped_early = validate(next_step)
            # No checkpoint in the middle of a run of skipped updates: it may be a divergence starting,
            # and the last good checkpoint must stay the one --resume finds.
            due = ((end_of_epoch and next_step < total_steps)
                   or (args.save_interval and next_step % args.save_interval == 0))
            if due and not args.save_best_only and updates.in_a_row == 0:
                save(next_step)
            if stopped_early:
                log(f"early stopping: {args.early_stopping_monitor} has not improved by "
                    f"{args.early_stopping_min_delta} for {args.early_stopping_patience} validations "
                    f"(best {progress['best']:.4f} at step {progress['best_step']})")
                break
    except KeyboardInterrupt:  # save exactly the updates made so far (--save-best-only: OUT keeps the best), exit 130
        keep_best = args.save_best_only and updates.last_saved is not None
        rundir.save_on_interrupt(lambda: False if keep_best else save(next_step), next_step, out,
                                 rng_at_step=rng_at_step)
    step = next_step
    updates.finish()  # a run whose every update was skipped trained nothing: it says so and exits 2

    # --- save --------------------------------------------------------------------------------------
    if not (args.save_best_only and updates.last_saved is not None):
        save(step)
    else:  # OUT holds the best model; the index and the report must describe that one
        model.load_state_dict(bert.load_pretrained(out, log=lambda *a: None)[0].state_dict())
        last["step"] = None  # the model in memory changed
        log(f"--save-best-only: {out} holds the best model, step {updates.last_saved}")
    log(f"saved {out}: config.json, model.safetensors ({cfg.model_type} masked-LM, Hugging Face layout), "
        f"tokenizer.json, vocab.txt, tokenizer_config.json, training_state.pt")

    # --- index -------------------------------------------------------------------------------------
    train_docs = list(dict.fromkeys(t for ex in train for t in (ex.positive, *ex.negatives)))
    index_docs = {"all": list(dict.fromkeys([*pool, *train_docs])), "pool": pool or train_docs, "none": []}[args.index]
    if index_docs:
        t0 = time.perf_counter()
        if index_docs is pool and last["step"] == step and last["index"] is not None:
            index = last["index"]  # the final validation has just indexed exactly these, with these weights
        else:
            reps = encode_batches(model, tokenizer, index_docs, args.max_length, args.eval_batch_size, amp)
            index = build_index(reps)  # block by block: the dense [documents, vocabulary] never exists
        save_index(out, index, index_docs, updates.last_saved)
        log(f"indexed {len(index_docs):,} documents ({len(index['weights']) / len(index_docs):.0f} terms per document, "
            f"{len(index['weights']):,} postings) in {time.perf_counter() - t0:.1f}s: {out}/{INDEX_FILE}; "
            f"search with --search {out} --query TEXT")

    # --- report ------------------------------------------------------------------------------------
    peak = devices.peak_memory_bytes(device)
    log(memory_table(estimate, peak, f"measured ({devices.memory_label(device)})"))
    if resident_before:
        log(f"  (of the measured peak, {metrics.format_bytes(resident_before)} was resident before training started: "
            f"Python, torch, the model, the data and what tokenising it left)")
    first = progress["first_metrics"]
    final = last["metrics"] if last["step"] == step else None
    if last["step"] != step and val_data:
        final = evaluate(model, tokenizer, val_data, args, amp)[0]
    if final:
        log(f"val {args.early_stopping_monitor}: {first[args.early_stopping_monitor]:.4f} before training, "
            f"{final[args.early_stopping_monitor]:.4f} now"
            + ("" if progress["best"] is None else f" (best {progress['best']:.4f} at step {progress['best_step']})"))
    mlog.log(event="end", step=step, val=final, first_val=first, best=progress["best"], best_step=progress["best_step"],
             stopped_early=stopped_early, peak_memory=peak, memory_estimate=sum(estimate.values()),
             resident_before_training=resident_before)
    return {"first": first, "final": final, "best": progress["best"], "step": step, "peak_memory": peak,
            "estimate": estimate, "model": model, "tokenizer": tokenizer}


def memory_table(estimate, measured=None, label="measured peak"):
    from lib.memory import format_table

    return format_table(estimate, measured, label)


if __name__ == "__main__":
    main()
