"""Renderers for the figure blocks of README.md and docs/*.md (see docs/render.py); nothing here trains.

Each function returns markdown for one block:
- the scripts' flags, read from their own argparse parsers: flag_table, kept_names (script_parser,
  options and parse also serve tests/test_docs.py);
- estimator tables, on the meta device or from arithmetic: nf4_table, nf4_errors, lora_estimates,
  chunk_policy, logits_table, pretrain_table, fsdp_table, fsdp_estimate, fsdp_rows, finetune_totals,
  judge_table, judge_estimates, wpo_plans, wpo_summary, splade_table, splade_breakdown, dynamic_map;
- hand-worked examples checked against the function they explain: splade_example, gradcache_check;
- measurements kept in bench/results JSON from before their bench wrote JSON: recorded.
Measured tables whose bench writes JSON are rendered by that bench script (bench/adam8bit.py,
bench/nf4.py, bench/train_throughput.py).
"""

import argparse
import functools
import importlib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The top-level scripts, in the README's order, with the short name a table column uses.
SCRIPTS = [("onefile_train", "onefile"), ("train", "train"), ("train_fsdp", "fsdp"),
           ("finetune_lora", "lora"), ("finetune_qlora", "qlora"),
           ("train_splade_unified", "splade"), ("train_splade_optimized", "splade-opt"),
           ("judge_train_mps", "judge-mps"), ("judge_train_cuda", "judge-cuda"),
           ("train_wpo_sgm_memory_efficient", "wpo-sgm")]


class _Parser(BaseException):
    """Carries the parser out of a script's main() at its first parse (BaseException: no `except Exception` eats it)."""


def script_parser(module):
    """The argparse parser a script's main() builds, taken at its first parse_args; nothing else runs.

    `module` is an importable name ("train", "bench.nf4") or a path ("bench/nf4.py"). Works for any
    script whose main(argv) parses its arguments with argparse, however its parser is built.
    """
    if module.endswith(".py"):
        module = module[:-3].replace("/", ".")
    mod = importlib.import_module(module)
    original = argparse.ArgumentParser.parse_known_args

    def grab(self, args=None, namespace=None):
        raise _Parser(self)

    argparse.ArgumentParser.parse_known_args = grab
    try:
        mod.main([])
    except _Parser as got:
        return got.args[0]
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise RuntimeError(f"{module}.main([]) returned without parsing arguments")


def parse(parser, argv):
    """parser.parse_args(argv) for a test: returns None, or argparse's error message instead of exiting."""
    messages = []
    error = parser.error
    parser.error = lambda message: (messages.append(message), (_ for _ in ()).throw(SystemExit(2)))
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        return messages[0] if messages else f"exit {e.code}"
    finally:
        parser.error = error
    return None


def options(parser):
    """{option string: action} for every option the parser's --help shows."""
    return {o: a for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings}


def _first_sentence(text):
    """A help text's first clause, its parenthesised asides left out (not cut off at the first one: what
    follows an aside, such as "or 'stdlib'" or "and exit", is part of the meaning)."""
    text = " ".join((text or "").split()).replace("%%", "%")
    while True:  # innermost asides first: "(default %(default)s)" holds one
        shorter = re.sub(r" ?\([^()]*\)", "", text)
        if shorter == text:
            break
        text = shorter
    text = text.split("; ")[0].split(": ")[0]
    return text.rstrip(" .,:(")


def flag_table(min_scripts="4"):
    """The flags at least `min_scripts` of the ten scripts share, which scripts have each, and what it means."""
    parsers = {name: options(script_parser(name)) for name, _ in SCRIPTS}
    counts = {}
    for opts in parsers.values():
        for o in opts:
            if o.startswith("--") and o != "--help":
                counts[o] = counts.get(o, 0) + 1
    order = [o for name, _ in SCRIPTS for o in parsers[name]]  # first seen, in script order
    common = sorted({o for o, c in counts.items() if c >= int(min_scripts)}, key=order.index)
    lines = ["| flag | " + " | ".join(short for _, short in SCRIPTS) + " | meaning (the scripts' help) |",
             "|---|" + "---|" * len(SCRIPTS) + "---|"]
    for flag in common:
        cells = ["✓" if flag in parsers[name] else "" for name, _ in SCRIPTS]
        meanings = {}  # each distinct help text, with the scripts that give it
        for name, short in SCRIPTS:
            if flag in parsers[name]:
                meanings.setdefault(_first_sentence(parsers[name][flag].help), []).append(short)
        if len(meanings) == 1:
            meaning = next(iter(meanings))
        else:
            meaning = "; ".join(f"{text} ({', '.join(shorts)})" for text, shorts in meanings.items())
        lines.append(f"| `{flag}` | " + " | ".join(cells) + f" | {meaning} |")
    return "\n".join(lines)


def kept_names():
    """One line per script family: the original projects' flag names it keeps, and the repository's names it
    also accepts; a pair that only one script of the family has names that script."""
    families = [("SPLADE", ("train_splade_unified", "train_splade_optimized")),
                ("judge", ("judge_train_mps", "judge_train_cuda")),
                ("WPO-SGM", ("train_wpo_sgm_memory_efficient",))]
    lines = []
    for title, names in families:
        pairs = {}  # each pair of spellings, in the order the scripts' parsers give them, with the scripts that take it
        for name in names:
            for action in script_parser(name)._actions:
                longs = [o for o in action.option_strings if o.startswith("--")]
                if len(longs) > 1 and action.help != argparse.SUPPRESS:
                    pairs.setdefault(" = ".join(f"`{o}`" for o in longs), []).append(name)
        shown = [pair if len(has) == len(names) else f"{pair} ({', '.join(n + '.py' for n in has)} only)"
                 for pair, has in pairs.items()]
        lines.append(f"- {title} ({', '.join(n + '.py' for n in names)}): " + "; ".join(shown) + ".")
    return "\n".join(lines)


# --- estimators (arithmetic and the meta device; nothing is allocated) ---------------------------

def _mib(b):
    return f"{b / 2**20:,.0f} MiB" if b < 2**30 else f"{b / 2**30:,.2f} GiB"


@functools.lru_cache(maxsize=None)
def _gpt(size):
    """(config, model on the meta device) for a named GPT-2 size: shapes only, no memory."""
    import torch
    from lib import gpt
    cfg = gpt.GPTConfig(**gpt.MODEL_SIZES[size])
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    return cfg, model


def nf4_table(r="8"):
    """Bytes of GPT-2's block linears in fp32, bf16 and NF4 (lib/memory.nf4_bytes), and LoRA's trained share."""
    from lib import memory
    lines = ["| model | parameters | block-linear weights | fp32 | bf16 | NF4 (double quant) | NF4 (no double quant) "
             f"| LoRA r={r} on c_attn |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        cfg, model = _gpt(size)
        n = sum(p.numel() for p in model.parameters())
        shapes = [(a * cfg.n_embd, b * cfg.n_embd) for a, b in memory.BLOCK_LINEAR_SHAPES.values()]
        linear = cfg.n_layer * sum(i * o for i, o in shapes)
        nf4 = lambda dq: cfg.n_layer * sum(memory.nf4_bytes(i * o, 64, dq) for i, o in shapes)  # noqa: E731
        lora = cfg.n_layer * int(r) * (cfg.n_embd + 3 * cfg.n_embd)
        lines.append(f"| {size} | {n / 1e6:,.0f}M | {linear / 1e6:,.0f}M ({linear / n:.0%}) | {_mib(linear * 4)} | "
                     f"{_mib(linear * 2)} | {_mib(nf4(True))} | {_mib(nf4(False))} | {lora:,} ({lora / n:.2%}) |")
    return "\n".join(lines)


def lora_estimates(batch="4", block="512"):
    """Full fine-tuning, LoRA and QLoRA of GPT-2 sizes on a GPU under bf16 autocast (lib/memory's estimators)."""
    from lib import memory
    batch, block = int(batch), int(block)
    lines = ["| model | method | weights (the base, or all of them for full fine-tuning) | trained: LoRA params + "
             "grads + AdamW | activations | loss (one chunk of logits) | other | total |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        cfg, model = _gpt(size)
        n = sum(p.numel() for p in model.parameters())
        rows = [("full fine-tuning", memory.estimate_gpt_training(cfg, n, batch, block, "cuda", amp=True)),
                ("LoRA", memory.estimate_lora_finetuning(cfg, batch, block, "cuda", amp=True,
                                                         base="bf16", lora_bytes=4)),
                ("QLoRA", memory.estimate_lora_finetuning(cfg, batch, block, "cuda", amp=True,
                                                          base="nf4", lora_bytes=2))]
        for method, e in rows:
            base = sum(v for k, v in e.items() if k.startswith(("base weights", "parameters")))
            trained = sum(v for k, v in e.items() if k.startswith(("gradients", "AdamW", "LoRA")))
            act, loss = e["activations"], e[memory.LOSS_LABEL]
            other = sum(e.values()) - base - trained - act - loss - e.get("runtime baseline", 0)
            lines.append(f"| {size} | {method} | {_mib(base)} | {_mib(trained)} | {_mib(act)} | "
                         f"{_mib(loss)} | {_mib(other) if other else '0'} | **{_mib(sum(e.values()))}** |")
    return "\n".join(lines)


def chunk_policy():
    """lib/lm_loss's chunk policy: the budget, and the rows and bytes per chunk it gives for real vocabularies."""
    from lib import lm_loss
    lines = [f"`CHUNK_BYTES` = {lm_loss.CHUNK_BYTES // 2**20} MiB is a chunk's budget: as many rows as fit it with",
             "their fp32 logits (and their hidden states and gradients), but at least",
             f"`MIN_CHUNK_ROWS` = {lm_loss.MIN_CHUNK_ROWS} rows; the tokens of a call are then split into as few",
             "chunks as that allows, all of one size but a last one that may be shorter (`lm_loss.chunk_rows`), so a",
             "chunk's logits can take less than the budget, or more where the floor applies.", "",
             "| model | vocab | hidden | rows per chunk (budget) | 1,024 tokens go in | one chunk's fp32 logits |",
             "|---|---:|---:|---:|---|---:|"]
    for name, vocab, hidden in (("GPT-2 tiny (the default)", 50257, 128), ("GPT-2 124M", 50257, 768),
                                ("SmolLM2-135M", 49152, 576), ("Qwen2-1.5B", 151936, 1536)):
        size = lm_loss.default_chunk_size(vocab, hidden)
        rows = lm_loss.chunk_rows(1024, size)
        lines.append(f"| {name} | {vocab:,} | {hidden:,} | {size:,} | {-(-1024 // rows)} chunk(s) of {rows:,} rows | "
                     f"{rows * vocab * 4 / 2**20:,.0f} MiB |")
    return "\n".join(lines)


# --- measurements recorded before their bench wrote JSON ----------------------------------------

def value(path, key, form="{}"):
    """One number of a bench JSON, for an inline block in a sentence: KEY is a dotted path into the file
    (a list index as a number), FORM a format string with no spaces ({:.2f}x, {:,.0f}_MiB: _ is a space)."""
    import json
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        found = json.load(f)
    for part in key.split("."):
        found = found[int(part)] if isinstance(found, list) else found[part]
    return form.replace("_", " ").format(found)


def constant(name, unit=""):
    """A constant of the code, for an inline block: "lib.memory.CPU_FIRST_STEP MiB" renders "20 MiB"; a
    dict entry is named after a dot (lib.memory.RUNTIME_BASELINE.cpu)."""
    parts = name.split(".")
    found = importlib.import_module(".".join(parts[:2]))
    for part in parts[2:]:
        found = found[part] if isinstance(found, dict) else getattr(found, part)
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}.get(unit, 1)
    return f"{found / scale:g} {unit}".strip()


def recorded(path, key):
    """A table or figure kept in a bench/results JSON whose bench printed it before JSON was committed.

    The file holds "machine" (what is known of the machine: bench.machine's fields), "how" (what was
    run) and "tables" {key: {"header": [...], "align": "l r ...", "rows": [[...]], "note": "..."}} or
    "figures" {key: "text" or {"text": ..., "machine": {...}}}; a table's or figure's own "machine" fields
    override the file's. The rendering ends with the machine's caption, or, where "machine" holds
    "independent" (why no machine changes these figures), with the run's torch version and date.
    """
    import json
    from bench import machine
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        report = json.load(f)
    figure = report.get("figures", {}).get(key)
    if isinstance(figure, str):
        figure = {"text": figure}
    entry = figure or report["tables"][key]
    where = {**report["machine"], **entry.get("machine", {})}  # a table or figure may say more of its run
    caption = machine.caption(where)
    if where.get("independent"):  # counts, metrics or bytes no CPU changes: the run is named, not the machine
        caption = f"Run with torch {where['torch']}, {where['date']}; {where['independent']}."
    if where.get("note"):
        caption = caption[:-1] + f"; {where['note']}."
    if figure:
        return figure["text"] + "\n\n" + caption
    t = report["tables"][key]
    align = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(t["header"]) + " |", "|" + "|".join(align[a] for a in t["align"].split()) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in t["rows"]]
    if t.get("note"):
        lines += ["", t["note"]]
    return "\n".join(lines + ["", caption])


SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def logits_table():
    """Why the logits dominate: the head's share, one fp32 copy of the logits, the plain loss and the chunked one."""
    import torch
    from lib import llama, memory
    rows = []
    for name, size, batch, block in (("GPT-2 tiny (this repo's default: 4 layers, block 128, batch 8)", "tiny", 8, 128),
                                     ("GPT-2 124M (`--model-size gpt2`, batch 8)", "gpt2", 8, 1024)):
        cfg, model = _gpt(size)
        n = sum(p.numel() for p in model.parameters())
        rows.append((name, cfg.vocab_size, cfg.n_embd, batch, block, n, True))
    for name, kw in (("SmolLM2-135M (fine-tuned, head frozen, batch 2)", SMOLLM2_135M),
                     ("Qwen2-1.5B (fine-tuned, head frozen, batch 2)",
                      llama.KNOWN_CONFIGS["Qwen/Qwen2-1.5B-Instruct"])):
        with torch.device("meta"):
            model = llama.Llama(llama.LlamaConfig(**kw))
        n = sum(p.numel() for p in model.parameters())
        rows.append((name, kw["vocab_size"], kw["hidden_size"], 2, 512, n, False))
    lines = ["| model | vocab | hidden | tokens per forward | head weight, share of parameters | weights (fp32) "
             "| fp32 logits | plain loss (16 B a value) | chunked loss |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, vocab, hidden, batch, block, n, train_head in rows:
        tokens = batch * block
        head = vocab * hidden
        chunked = memory.lm_loss_bytes(tokens, vocab, hidden, train_head=train_head)
        lines.append(f"| {name} | {vocab:,} | {hidden:,} | {batch} x {block:,} = {tokens:,} | {head / 1e6:.1f}M, "
                     f"{head / n:.0%} of {n / 1e6:,.1f}M | {n * 4 / 2**20:,.0f} MiB | "
                     f"{tokens * vocab * 4 / 2**20:,.0f} MiB | {tokens * vocab * 16 / 2**20:,.0f} MiB | "
                     f"{chunked / 2**20:,.0f} MiB |")
    return "\n".join(lines)


def dynamic_map():
    """lib/adam8bit's two 256-entry tables, decade by decade: how many entries, and the worst rounding error."""
    import torch
    from lib import adam8bit
    tables = {s: adam8bit.create_dynamic_map(s).double() for s in (True, False)}
    lines = ["| values in | entries, signed table (per sign) | entries, unsigned table | worst rounding error, signed "
             "| worst rounding error, unsigned |", "|---|---:|---:|---:|---:|"]

    def worst(table, lo, hi, signed):
        """Largest relative error of rounding a value of magnitude in [lo, hi) to its nearest entry (0 included)."""
        b = table[table > 0]
        a = torch.cat([b.new_zeros(1), b[:-1]])
        x = ((a + b) / 2).clamp(lo, hi)  # the worst point of each gap [a, b] that lies in [lo, hi)
        err = torch.minimum(x - a, b - x) / x
        if signed:  # a negative value never rounds to 0: all below the smallest entry take it, worst at lo
            err[0] = max(err[0], (b[0] - lo) / lo)
        return float(err[(b > lo) & (a < hi)].max())

    for i in range(7):
        lo, hi = 10.0 ** (i - 7), 10.0 ** (i - 6)
        counts = [int(((t >= lo) & (t < hi)).sum()) for t in (tables[True], tables[False])]
        errs = [worst(tables[s], lo, hi, s) for s in (True, False)]
        lines.append(f"| [1e{i - 7}, 1e{i - 6}) | {counts[0]} | {counts[1]} | {errs[0]:.1%} | {errs[1]:.1%} |")
    n_neg = int((tables[True] < 0).sum())
    lines += ["", f"Each table also holds 0 and 1; the signed one's {n_neg} negative entries mirror its positive "
              "ones below 1 (there is no -1). The error is the largest, relative to the value, of any value in the "
              "row's range rounded to the nearest entry (a negative one never to 0); computed from "
              "`lib/adam8bit.create_dynamic_map`."]
    return "\n".join(lines)


# --- hand-worked examples, checked against the functions they explain -----------------------------

def splade_example():
    """The in-batch ranking loss worked by hand, and the same numbers from train_splade_unified.ranking_loss."""
    import math
    import torch
    import train_splade_unified as unified
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    d = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    scores = (q @ d.T).tolist()
    by_hand = []
    for i, row in enumerate(scores):
        by_hand.append(math.log(sum(math.exp(s) for s in row)) - row[i])
    code = unified.ranking_loss(q, d).item()
    mean = sum(by_hand) / len(by_hand)
    if abs(code - mean) > 1e-6 * mean:
        raise AssertionError(f"ranking_loss gives {code}, the hand computation {mean}")
    fmt = lambda row: "[" + ", ".join(f"{s:g}" for s in row) + "]"  # noqa: E731
    return (f"`q0 = (1, 0)`, `q1 = (0, 1)`, documents `(2, 0)`, `(0, 1)`, `(1, 1)` (the positives of q0 and q1, "
            f"then one hard negative) give scores `{fmt(scores[0])}` and `{fmt(scores[1])}`; q0's positive scores "
            f"{scores[0][0]:g}, q1's {scores[1][1]:g}. The losses are `-log(e^2 / (e^2 + 1 + e)) = {by_hand[0]:.3f}` "
            f"and `-log(e / (1 + 2e)) = {by_hand[1]:.3f}`, mean **{mean:.3f}**; `ranking_loss` returns "
            f"{code:.4f} (rendered by `docs/figures.splade_example`, which fails if the two differ).")


def gradcache_check(n_queries="8", micro="2"):
    """GradCache against one full batch and against naive accumulation, on a tiny random BERT (one step, no update)."""
    import torch
    import train_splade_optimized as optimized
    import train_splade_unified as unified
    from lib import bert
    n_queries, micro = int(n_queries), int(micro)
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    model = bert.init_weights(bert.build_model(cfg)).train()
    gen = torch.Generator().manual_seed(1)

    def texts(n, lo, hi):
        return [[2] + torch.randint(5, 50, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist()
                + [3] for _ in range(n)]

    q, pos, neg = texts(n_queries, 2, 6), texts(n_queries, 5, 12), texts(n_queries, 5, 12)

    def batches(size):
        return [unified.Batch(*unified.pad(q[s:s + size], 0), *unified.pad(pos[s:s + size] + neg[s:s + size], 0))
                for s in range(0, n_queries, size)]

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    results = {}
    for name, step, size in (("one batch", unified.naive_step, n_queries),
                             ("GradCache", optimized.gradcache_step, micro),
                             ("naive accumulation", unified.naive_step, micro)):
        model.zero_grad(set_to_none=True)
        stats = step(model, batches(size), 1e-3, 2e-3, None, scaler)
        results[name] = (stats, torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    full = results["one batch"][1]
    lines = [f"A 2-layer, 64-wide BERT with random weights, {n_queries} queries with one positive and one hard "
             f"negative each; GradCache and naive accumulation in micro-batches of {micro} queries "
             f"({n_queries // micro} micro-batches), one step each from the same weights, no dropout:", "",
             "| step | negatives per query | ranking loss | largest gradient difference from one batch | cosine with "
             "one batch's gradient |",
             "|---|---:|---:|---:|---:|"]
    for name, (stats, g) in results.items():
        negatives = 2 * (n_queries if name != "naive accumulation" else micro) - 1
        diff = float((g - full).abs().max() / full.abs().max())
        cos = float(torch.nn.functional.cosine_similarity(g, full, dim=0))
        difference = ("0" if name == "one batch" else "below 1e-5 of the largest entry" if diff < 1e-5
                      else f"{diff:.1%} of the largest entry")
        lines.append(f"| {name} | {negatives} | {stats['rank_loss']:.4f} | "
                     f"{difference} | "
                     f"{cos:.4f} |")
    lines += ["",
              "(Computed by `docs/figures.gradcache_check` with the scripts' own `naive_step` and `gradcache_step`; "
              "`tests/test_splade.py` compares GradCache with one batch on this same batch, within a tolerance.)"]
    return "\n".join(lines)


def nf4_errors():
    """Relative RMS error of NF4 quantise + dequantise (lib/nf4) on a seeded 768 x 3072 N(0, 1) matrix."""
    import torch
    from lib import nf4
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(768, 3072, generator=gen)
    outliers = w.clone().view(-1)
    picks = torch.randperm(outliers.numel(), generator=gen)[:outliers.numel() // 5000]
    outliers[picks] *= 20
    outliers = outliers.view_as(w)

    def err(x, block, dq=True):
        y = nf4.dequantize_nf4(nf4.quantize_nf4(x, block, dq), torch.float32)
        return float((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())

    def uniform(x, block):
        levels = torch.linspace(-1, 1, 16)
        b = x.reshape(-1, block)
        a = b.abs().amax(1, keepdim=True)
        y = levels[((b / a)[..., None] - levels).abs().argmin(-1)] * a
        return float((y - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    n = w.numel()
    q = nf4.quantize_nf4(w, 64, True)
    return "\n".join([
        "| 768 x 3072 N(0, 1) matrix, NF4 | one absmax per tensor | per 4,096 | per 64 |", "|---|---:|---:|---:|",
        f"| relative RMS error | {err(w, n):.1%} | {err(w, 4096):.1%} | {err(w, 64):.2%} |",
        f"| the same with one weight in 5,000 multiplied by 20 | {err(outliers, n):.1%} | {err(outliers, 4096):.1%} | "
        f"{err(outliers, 64):.1%} |", "",
        f"Blocks of 64: NF4 {err(w, 64):.2%} with double quantisation, {err(w, 64, False):.2%} without; 16 evenly "
        f"spaced 4-bit levels instead of NF4's, {uniform(w, 64):.2%}. `lib/nf4.bits_per_parameter` gives "
        f"{nf4.bits_per_parameter(q):.3f} bits per weight with double quantisation. (Computed by "
        "`docs/figures.nf4_errors` with `lib/nf4.quantize_nf4` and `dequantize_nf4`, seed 0.)"])


# --- docs/choosing_a_script.md and friends: one table per script family --------------------------

def _gib(b):
    return f"{b / 2**30:,.2f} GiB"


def pretrain_table():
    """Full pretraining (train.py / onefile_train.py), lib/memory.estimate_gpt_training per model size."""
    from lib import memory
    lines = ["| model | parameters | batch x block | weights + grads + AdamW | activations (bf16) | loss (bf16) "
             "| total, CUDA bf16 | total, CPU fp32 |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for size in ("tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        cfg, model = _gpt(size)
        n = sum(p.numel() for p in model.parameters())
        gpu = memory.estimate_gpt_training(cfg, n, 8, cfg.block_size, "cuda", amp=True)
        cpu = memory.estimate_gpt_training(cfg, n, 8, cfg.block_size, "cpu", amp=False)
        state = gpu["parameters (fp32)"] + gpu["gradients (fp32)"] + gpu["AdamW moments (2 x fp32)"]
        name = "tiny (default)" if size == "tiny" else size
        lines.append(f"| {name} | {n:,} | 8 x {cfg.block_size} | {_gib(state)} | {_gib(gpu['activations'])} | "
                     f"{_gib(gpu[memory.LOSS_LABEL])} | {_gib(sum(gpu.values()))} | {_gib(sum(cpu.values()))} |")
    return "\n".join(lines)


def fsdp_table(batch="4"):
    """Per rank: DDP (train.py, with its gradient buckets) against FSDP2 on N ranks, CUDA bf16 (lib/memory)."""
    from lib import memory
    batch = int(batch)
    lines = ["| model | DDP (`train.py`) | FSDP2 N=2 | FSDP2 N=4 | FSDP2 N=8 |", "|---|---:|---:|---:|---:|"]
    for size, ckpt in (("gpt2", False), ("gpt2-xl", False), ("gpt2-xl", True)):
        cfg, model = _gpt(size)
        n = sum(p.numel() for p in model.parameters())
        ddp = "(no such flag in train.py)" if ckpt else _gib(sum(memory.estimate_gpt_training(
            cfg, n, batch, cfg.block_size, "cuda", amp=True, ddp=True).values()))
        cells = [_gib(sum(memory.estimate_fsdp_training(cfg, n, batch, cfg.block_size, w, "cuda", mixed_precision=True,
                                                         checkpointing=ckpt).values())) for w in (2, 4, 8)]
        name = f"{size}, `--activation-checkpointing`" if ckpt else f"{size} ({n:,})"
        lines.append(f"| {name} | {ddp} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def finetune_totals(batch="4", block="512"):
    """Totals of lora_estimates: full fine-tuning, LoRA and QLoRA per GPT-2 size."""
    rows = [r for r in lora_estimates(batch, block).split("\n")[2:]]
    totals = {}
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        totals.setdefault(cells[0], {})[cells[1]] = cells[-1].strip("*")
    lines = ["| model | full fine-tuning (`train.py --init-from`) | LoRA (`finetune_lora.py`) | QLoRA "
             "(`finetune_qlora.py`) |",
             "|---|---:|---:|---:|"]
    for size, t in totals.items():
        lines.append(f"| {size} | {t['full fine-tuning']} | {t['LoRA']} | {t['QLoRA']} |")
    return "\n".join(lines)


def judge_table(seq="512"):
    """judge_train_mps.estimate_memory for the known models: the MPS recipe against the CUDA one."""
    from lib import llama
    import judge_train_mps as judge
    lines = ["| model | `judge_train_mps.py` (fp32, AdamW, batch 1) | `judge_train_cuda.py` (NF4, bf16, checkpointing, "
             "8-bit AdamW, batch 2) |", "|---|---:|---:|"]
    for name, kw in llama.KNOWN_CONFIGS.items():
        cfg = llama.LlamaConfig(**kw)
        r, _ = judge.lora_rank_for(judge.count_params(cfg))
        mps = judge.estimate_memory(cfg, 1, int(seq), "mps", "fp32", 4, r, "adamw", False)
        cuda = judge.estimate_memory(cfg, 2, int(seq), "cuda", "nf4", 2, r, "adamw8bit", True)
        lines.append(f"| {name.split('/')[1]} (LoRA r={r}) | {_gib(sum(mps.values()))} | {_gib(sum(cuda.values()))} |")
    return "\n".join(lines)


def _cifar_shape():
    import train_wpo_sgm_memory_efficient as wpo
    return wpo.Shape(dim=3072, centres=1000, batch=8, train_samples=50000, depth=5, hidden=64)


def wpo_plans():
    """WPO-SGM on CIFAR-10 (K = 1000): what each plan holds and adds, from the script's own estimator."""
    import train_wpo_sgm_memory_efficient as wpo
    shape = _cifar_shape()
    lines = [f"K = {shape.centres:,} centres, D = {shape.dim:,}, N = {shape.train_samples:,} training samples "
             f"(CIFAR-10's training set) and no test set, batch B = {shape.batch}, factornet {shape.depth} x "
             f"{shape.hidden} ({shape.n_params:,} parameters), no sampling; peak = held + the larger of the step and "
             "AdamW's update:", "",
             "| plan | predicted peak | held (data, weights, AdamW state) | a step's forward and backward | AdamW's "
             "update |",
             "|---|---:|---:|---:|---:|"]
    for label, plan in (("single_gpu", wpo.Plan("single_gpu")),
                        ("gradient_accumulation, 4 micro-batches", wpo.Plan("gradient_accumulation", None, 4)),
                        ("model_parallel, 8 ranks", wpo.Plan("model_parallel", None, 1, 8)),
                        ("model_parallel, 8 ranks, chunk 4", wpo.Plan("model_parallel", 4, 1, 8)),
                        ("chunked, chunk 16", wpo.Plan("chunked", 16)), ("chunked, chunk 4", wpo.Plan("chunked", 4))):
        held = sum(wpo.held_memory(shape).values())
        m = {k: sum(v.values()) for k, v in wpo.moments(shape, plan).items()}
        per_rank = " per rank" if plan.world_size > 1 else ""
        lines.append(f"| {label} | {sum(wpo.estimate_memory(shape, plan).values()) / 2**30:.1f} GiB{per_rank} | "
                     f"{held / 2**30:.1f} GiB | "
                     f"{m[chr(97) + ' step' + chr(39) + 's forward and backward'] / 2**30:.1f} GiB | "
                     f"{m['AdamW' + chr(39) + 's update'] / 2**30:.1f} GiB |")
    picks = [(gib, wpo.largest_chunk(shape, wpo.Plan("chunked"), wpo.FREE_FRACTION * gib * 2**30, 0))
             for gib in (80, 40, 16)]
    lines += ["", "With this much memory free on a GPU, auto picks chunked with the largest chunk that fits "
              f"{wpo.FREE_FRACTION:.0%} of it: "
              + ", ".join(f"{c} centres per chunk on {g} GiB" for g, c in picks) + "."]
    return "\n".join(lines)


def wpo_summary():
    """One line: CIFAR-10 with K = 1000, all centres at once against chunks of 4 (the figures of wpo_plans)."""
    import train_wpo_sgm_memory_efficient as wpo
    shape = _cifar_shape()
    full = sum(wpo.estimate_memory(shape, wpo.Plan("single_gpu")).values()) / 2**30
    chunked = sum(wpo.estimate_memory(shape, wpo.Plan("chunked", 4)).values()) / 2**30
    return (f"CIFAR-10 (D = {shape.dim:,}, N = {shape.train_samples:,}, batch {shape.batch}, factornet "
            f"{shape.depth} x {shape.hidden}), K = {shape.centres:,}: {full:.1f} GiB predicted for all centres at "
            f"once, {chunked:.1f} GiB chunked with c = 4 (the script's estimator; "
            "[wpo_sgm_memory.md](wpo_sgm_memory.md) breaks both down).")


def splade_table():
    """train_splade_unified.estimate_memory for BERT-base, CUDA: the unified and optimized scripts' settings."""
    import train_splade_unified as unified
    from lib import bert
    cfg = bert.BertConfig()
    n = bert.param_count(cfg)
    # On CUDA --dtype auto autocasts (lib/device.amp_dtype): the fp32 rows say --dtype fp32.
    rows = [("`train_splade_unified.py --batch-size 32 --dtype fp32`", "32", dict(batch_size=32)),
            ("`train_splade_unified.py --batch-size 32` (the default `--dtype auto`: 16-bit autocast)", "32",
             dict(batch_size=32, amp=True)),
            ("`train_splade_optimized.py --batch-size 8 --gradient-accumulation-steps 4 --dtype fp32`", "32 (exact)",
             dict(batch_size=8, cached_batch=32)),
            ("the same `--memory-efficient`", "32 (exact)",
             dict(batch_size=8, cached_batch=32, checkpointing=True, optimizer_on_cpu=True)),
            ("`train_splade_unified.py --batch-size 128 --dtype fp32`", "128", dict(batch_size=128)),
            ("`train_splade_optimized.py --batch-size 8 --gradient-accumulation-steps 16 --memory-efficient "
             "--mixed-precision`", "128 (exact)",
             dict(batch_size=8, cached_batch=128, checkpointing=True, optimizer_on_cpu=True, amp=True))]
    lines = [f"BERT-base ({n / 1e6:.1f}M parameters, vocabulary {cfg.vocab_size:,}), one hard negative, queries 32 "
             "and documents 256 tokens, CUDA:", "", "| run | effective batch | estimate |", "|---|---:|---:|"]
    for label, eff, kw in rows:
        kw = dict(kw)
        b = kw.pop("batch_size")
        e = unified.estimate_memory(cfg, n, b, 1, 32, 256, "cuda", **kw)
        lines.append(f"| {label} | {eff} | {_gib(sum(e.values()))} |")
    return "\n".join(lines)


# --- docs/fsdp2_explained.md ------------------------------------------------------------------------

def _fsdp_counts(model, world):
    """Each rank's local parameter count under FSDP2's Shard(0): dim 0 cut into chunks of ceil(rows / world)."""
    counts = [0] * world
    for p in model.parameters():
        rows, rest = p.shape[0], p[0].numel() if p.dim() > 1 else 1
        chunk = -(-rows // world)
        for r in range(world):
            counts[r] += max(0, min(chunk, rows - r * chunk)) * rest
    return counts


def fsdp_estimate(size="gpt2-xl", world="2", batch="8", bf16="no", checkpointing="no"):
    """What `torchrun --nproc_per_node=WORLD train_fsdp.py --model-size SIZE --estimate-memory` prints per rank
    on a CPU: the same lib/memory functions train_fsdp.print_estimate calls, and each rank's share of the rows."""
    from lib import memory
    cfg, model = _gpt(size)
    world, batch, bf16, ckpt = int(world), int(batch), bf16 == "bf16", checkpointing == "checkpointing"
    n = sum(p.numel() for p in model.parameters())
    fsdp = memory.estimate_fsdp_training(cfg, n, batch, cfg.block_size, world, "cpu", bf16, checkpointing=ckpt)
    ddp = memory.estimate_gpt_training(cfg, n, batch, cfg.block_size, "cpu", bf16, ddp=world > 1, checkpointing=ckpt)
    counts = _fsdp_counts(model, world)
    flags = f" --mixed-precision bf16 --batch-size {batch}" if bf16 else ""
    flags += " --activation-checkpointing" if ckpt else ""
    return "\n".join([
        "```",
        f"$ torchrun --standalone --nproc_per_node={world} train_fsdp.py --model-size {size} --estimate-memory{flags}",
        "parameters per rank: " + ", ".join(f"rank {r} {c:,}" for r, c in enumerate(counts))
        + f" (of {n:,}; {n / world:,.0f} = 1/{world} each)",
        memory.format_columns({f"FSDP2, 1 of {world}": fsdp, "DDP / unsharded": ddp},
                              f"memory estimate per rank (lib/memory.py, batch {batch} x {cfg.block_size}, "
                              f"{'bf16' if bf16 else 'fp32'}):"), "```"])


def fsdp_rows(batch="4"):
    """DDP against FSDP2 on 2, 4 and 8 ranks, per rank, CUDA bf16: the estimator's parts summed."""
    from lib import memory
    batch = int(batch)
    lines = ["| model | per rank | DDP (any N) | FSDP2 N=2 | FSDP2 N=4 | FSDP2 N=8 |", "|---|---|---:|---:|---:|---:|"]

    def parts(e):
        state = sum(v for k, v in e.items() if k.startswith(("parameters", "gradients", "AdamW")))
        comm = sum(v for k, v in e.items() if k.startswith(("DDP gradient", "all-gathered", "unsharded", "tied")))
        act = e["activations"] + e[memory.LOSS_LABEL]
        return state, comm, act, sum(e.values())

    for size, label, ckpt in (("gpt2", "GPT-2 124M", False), ("gpt2-xl", "GPT-2 XL 1.5B", False),
                              ("gpt2-xl", "GPT-2 XL, `--activation-checkpointing`", True)):
        cfg, model = _gpt(size)
        n = sum(p.numel() for p in model.parameters())
        cols = [parts(memory.estimate_gpt_training(cfg, n, batch, cfg.block_size, "cuda", True,
                                                   ddp=True, checkpointing=ckpt))]
        cols += [parts(memory.estimate_fsdp_training(cfg, n, batch, cfg.block_size, w, "cuda",
                                                     True, checkpointing=ckpt))
                 for w in (2, 4, 8)]
        name = label if ckpt else f"{label} ({n:,})"
        if not ckpt:
            lines.append(f"| {name} | weights + grads + AdamW | " + " | ".join(_gib(c[0]) for c in cols) + " |")
            lines.append("| | DDP gradient buckets and tied embedding's second gradient / all-gathered + unsharded "
                         "grads | " + " | ".join(_gib(c[1]) for c in cols) + " |")
        lines.append(f"| {'' if not ckpt else name} | activations + loss (one chunk of logits) | "
                     + " | ".join(_gib(c[2]) for c in cols) + " |")
        total = [f"**{_gib(c[3])}**" for c in cols]
        if ckpt:
            total[0] += " (if train.py had the flag)"
        lines.append("| | **total** | " + " | ".join(total) + " |")
    return "\n".join(lines)


def judge_estimates(seq="512"):
    """docs/judge_mps_vs_cuda.md: judge_train_mps.estimate_memory per known model and recipe, and one NF4 figure
    taken apart."""
    from lib import llama
    import judge_train_mps as judge
    seq = int(seq)
    lines = ["| model | parameters | LoRA r (trainable) | MPS script, fp32, batch 1 | CUDA script, NF4 + bf16 + "
             "checkpointing + 8-bit AdamW, batch 2 | CUDA `--no_4bit` (bf16 base), batch 1 |",
             "|---|---:|---:|---:|---:|---:|"]
    full_logits = []
    for name, kw in llama.KNOWN_CONFIGS.items():
        cfg = llama.LlamaConfig(**kw)
        n = judge.count_params(cfg)
        r, _ = judge.lora_rank_for(n)
        h, qd, kvd = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        trainable = cfg.num_hidden_layers * r * ((h + qd) + 2 * (h + kvd) + (qd + h))
        mps = judge.estimate_memory(cfg, 1, seq, "mps", "fp32", 4, r, "adamw", False)
        nf4 = judge.estimate_memory(cfg, 2, seq, "cuda", "nf4", 2, r, "adamw8bit", True)
        bf16 = judge.estimate_memory(cfg, 1, seq, "cuda", "bf16", 2, r, "adamw8bit", True)
        lines.append(f"| {name.split('/')[1]} | {n:,} | {r} ({trainable:,}) | {_gib(sum(mps.values()))} | "
                     f"{_gib(sum(nf4.values()))} | {_gib(sum(bf16.values()))} |")
        # lib/memory.logits_bytes under 16-bit autocast: 2 + 4 + 4 + 4 + 2 bytes a value
        logits = 2 * seq * cfg.vocab_size * 16
        full_logits.append((name, cfg, n, nf4, logits, sum(nf4.values()) - nf4["loss (one chunk of logits)"] + logits))
    name, cfg, n, e, logits, _ = full_logits[1]
    lora = e["LoRA parameters (fp32)"]
    lines += ["", f"Of the NF4 figure for {name.split('/')[1]}: the base {_gib(e['base weights (NF4 linears)'])} "
              f"({_gib(n * 4)} in fp32), activations {_gib(e['activations (checkpointed)'])} with checkpointing, "
              f"{e['8-bit AdamW state'] / 2**20:.1f} MiB of 8-bit AdamW state ({2 * lora / 2**20:.0f} MiB in fp32), "
              f"and the loss, {e['loss (one chunk of logits)'] / 2**20:.0f} MiB. The full logits of its "
              f"{cfg.vocab_size:,}-word vocabulary, 2 x {seq} x {cfg.vocab_size:,} values at 16 bytes under bf16 "
              "autocast (bf16 logits, the fp32 log-softmax and its gradient, the logits' fp32 gradient and the bf16 "
              f"gradient the head receives: `lib/memory.logits_bytes`), would be {_gib(logits)}, the largest single "
              "term: the NF4 column would read " + ", ".join(_gib(t) for *_, t in full_logits) + " with them."]
    return "\n".join(lines)


def splade_cache(batch="32"):
    """docs/memory_optimization.md: GradCache's cached vectors and their gradients, BERT-base (estimate_memory)."""
    import train_splade_unified as unified
    from lib import bert
    cfg = bert.BertConfig()
    e = unified.estimate_memory(cfg, bert.param_count(cfg), 8, 1, 32, 256, "cuda", cached_batch=int(batch))
    return _mib(e["cached representations + grads"])


def splade_breakdown(batch="32"):
    """docs/memory_optimization.md: where SPLADE's memory goes for BERT-base (train_splade_unified.estimate_memory)."""
    import train_splade_unified as unified
    from lib import bert
    cfg = bert.BertConfig()
    n = bert.param_count(cfg)
    e = unified.estimate_memory(cfg, n, int(batch), 1, 32, 256, "cuda")
    bf16 = unified.estimate_memory(cfg, n, int(batch), 1, 32, 256, "cuda", amp=True)
    state = e["parameters (fp32)"] + e["gradients (fp32)"] + e["AdamW moments (2 x fp32)"]
    return "\n".join([
        f"| component | bytes | BERT-base, B={batch}, k=1, Lq=32, Ld=256 |", "|---|---|---:|",
        f"| weights, gradients, AdamW moments (fp32) | 16 per parameter | {_gib(state)} |",
        "| encoder activations | about 18 x hidden values per token and layer, plus attention | "
        f"{_gib(e['encoder activations'])} |",
        f"| MLM logits and their gradients | tokens x vocabulary x 12 | {_gib(e['MLM logits + gradient'])} |", "",
        f"(`estimate_memory` in `train_splade_unified.py`, which `--estimate-memory` prints, here in fp32; BERT-base: "
        f"{cfg.num_hidden_layers} layers, {cfg.hidden_size} wide, vocabulary {cfg.vocab_size:,}, {n / 1e6:.1f}M "
        f"parameters; the whole estimate on CUDA: {_gib(sum(e.values()))} in fp32 (`--dtype fp32`), "
        f"{_gib(sum(bf16.values()))} under the bf16 autocast that `--dtype auto` picks on an Ampere or newer GPU.)"])
