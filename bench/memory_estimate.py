"""Every script's --estimate-memory against the peak it measures, at tiny and at real sizes, as JSON.

    python bench/memory_estimate.py                                # every script, tiny and real sizes, CPU
    python bench/memory_estimate.py --sizes tiny                   # the small shapes only (minutes)
    python bench/memory_estimate.py --sizes bf16 --out bench/results/memory_cpu_bf16.json  # tiny, --dtype bf16
    python bench/memory_estimate.py --scripts finetune_lora.py finetune_qlora.py --sizes real
    python bench/memory_estimate.py --device cuda --out bench/results/memory_cuda.json
    python bench/memory_estimate.py --write-models /work/scratch/models   # only write the real-size models

Each case is one short run of the script in a child process, with its defaults except the few flags
the case names: a few steps, one held-out batch, no sampling. The ratio is the peak the run measured
over the total it predicted, both read in bytes from the end record of its metrics.jsonl (train_fsdp.py:
rank 0's). The project's targets: measured / estimate within 0.75-1.25 on CPU (peak RSS) and within
20% on CUDA (max allocated).

The real-size models are written here, with random weights in the Hugging Face layout each script
reads (random weights need the same memory as trained ones; no network): GPT-2 124M (config.json +
model.safetensors in transformers' names), a SmolLM2-135M-shaped Llama with SmolLM2's real tokenizer
(tests/fixtures/real/chat/smollm2), a bert-base-shaped masked LM with the real bert-base-uncased
tokenizer (tests/fixtures/real/splade), and CIFAR-10's binary layout filled with random images.
They take about 1.1 GB of disk in --models (default: a scratch directory, kept between runs).

render(path) turns a result file into the markdown table docs/ show (python docs/render.py).
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (script, size, flags): {gpt2}, {smollm2}, {bert}, {cifar} are the models and data written below.
CASES = [
    ("train.py", "tiny", "--steps 3 --eval-batches 1 --sample-tokens 0"),
    ("train_fsdp.py", "tiny", "--steps 3 --eval-batches 1 --sample-tokens 0"),
    ("finetune_lora.py", "tiny", "--init-from {tiny_gpt} --steps 3 --eval-batches 1 --sample-tokens 0"),
    ("finetune_qlora.py", "tiny", "--init-from {tiny_gpt} --steps 3 --eval-batches 1 --sample-tokens 0 --dtype fp32"),
    ("judge_train_mps.py", "tiny", "--model tiny --max_samples 12 --batch_size 4 --epochs 1 --skip_eval"),
    ("judge_train_cuda.py", "tiny", "--model tiny --max_samples 12 --batch_size 4 --epochs 1 --skip_eval"),
    ("train_splade_unified.py", "tiny", "--steps 3 --index none"),
    ("train_splade_optimized.py", "tiny", "--steps 3 --index none"),
    ("train_wpo_sgm_memory_efficient.py", "tiny", "--niters 3 --num-samples 0"),
    # The tiny shapes under bf16 autocast, for every script that takes --dtype bf16 on a CPU (onefile_train.py
    # computes in bf16 by itself where the CPU has it natively). Slow where it has not: about 50x per matmul.
    ("train.py", "bf16", "--steps 3 --eval-batches 1 --sample-tokens 0 --dtype bf16"),
    ("train_fsdp.py", "bf16", "--steps 3 --eval-batches 1 --sample-tokens 0 --dtype bf16"),
    ("finetune_lora.py", "bf16", "--init-from {tiny_gpt} --steps 3 --eval-batches 1 --sample-tokens 0 --dtype bf16"),
    ("finetune_qlora.py", "bf16", "--init-from {tiny_gpt} --steps 3 --eval-batches 1 --sample-tokens 0 --dtype bf16"),
    ("train_splade_unified.py", "bf16", "--steps 3 --index none --dtype bf16"),
    ("train_splade_optimized.py", "bf16", "--steps 3 --index none --dtype bf16"),
    ("judge_train_mps.py", "real", "--model {smollm2} --max_samples 12 --batch_size 4 --epochs 1 --skip_eval"),
    # the default batch, 1 x 2: one short conversation a step, whose activations are blocks under 1 MiB
    ("judge_train_mps.py", "real", "--model {smollm2} --max_samples 24 --epochs 1 --skip_eval"),
    ("train_splade_unified.py", "real", "--init-from {bert} --train-file {splade_train} "
                                 "--val-file {splade_val} --steps 2 --index none"),
    ("train_splade_optimized.py", "real", "--init-from {bert} --train-file {splade_train} "
                                 "--val-file {splade_val} --steps 2 --index none"),
    # CIFAR-10's D = 3,072 with K = 10 centres, 4 at a time (all at once would need twice the memory).
    ("train_wpo_sgm_memory_efficient.py", "real", "--data cifar10 --data-dir {cifar} --train_kernel_size 10 "
                                                  "--train_samples_size 10 --test_samples_size 0 --niters 2 "
                                                  "--num-samples 0 --strategy chunked --chunk_size 4"),
    # The real sizes: 8 x 1024 GPT-2 tokens a step, computing in fp32, as --dtype auto did on the CPU they were
    # measured on. (LoRA's case has no --dtype, as recorded: on a CPU with native bf16, auto picks bf16, and
    # render_finetune's caption, "fp32 compute", would need the case's flags and the caption changed together.)
    # One step: LoRA's AdamW moments, made after the first backward, are a few MiB.
    ("finetune_lora.py", "real", "--init-from {gpt2} --steps 1 --eval-batches 1 --sample-tokens 0"),
    ("finetune_qlora.py", "real", "--init-from {gpt2} --steps 1 --eval-batches 1 --sample-tokens 0 --dtype fp32"),
    ("finetune_qlora.py", "real", "--init-from {gpt2} --steps 1 --eval-batches 1 --sample-tokens 0 --dtype fp32 "
                                  "--grad-checkpoint"),
    ("judge_train_cuda.py", "real", "--model {smollm2} --max_samples 12 --batch_size 4 --epochs 1 --skip_eval"),
    # Two steps: full training's AdamW moments (twice the weights) are made in the first update, so the second
    # step's backward is the peak. train.py at its default batch, 8 x 1,024; FSDP's 2 ranks at 2 each.
    # (onefile_train.py leaves the memory estimate to train.py.)
    ("train.py", "real", "--model-size gpt2 --steps 2 --eval-batches 1 --sample-tokens 0"),
    ("train_fsdp.py", "real", "--model-size gpt2 --batch-size 2 --steps 2 --eval-batches 1 --sample-tokens 0"),
]
# The published SmolLM2-135M shape (HuggingFaceTB/SmolLM2-135M config.json).
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


# --- the models and data, written with random weights ------------------------------------------------
def write_gpt2(out_dir, size="gpt2"):
    """A GPT-2 directory as transformers writes it (Conv1D weights [in, out], the tied head left out)."""
    import torch

    from lib import checkpoint, gpt
    if not os.path.isfile(os.path.join(out_dir, checkpoint.WEIGHTS)):
        cfg = gpt.GPTConfig(**(gpt.MODEL_SIZES[size] if isinstance(size, str) else size))
        torch.manual_seed(0)
        checkpoint.save_hf(out_dir, cfg, gpt.to_hf_state_dict(gpt.GPT(cfg)))
    return out_dir


def write_smollm2(out_dir):
    """A SmolLM2-135M-shaped Llama directory with SmolLM2's own tokenizer files."""
    from lib import llama
    if not os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        cfg = llama.LlamaConfig(**SMOLLM2_135M)
        llama.save_pretrained(llama.build_model(cfg, seed=0), cfg, out_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(ROOT, "tests", "fixtures", "real", "chat", "smollm2", name), out_dir)
    return out_dir


def write_bert(out_dir, shape=None):
    """A bert-base-shaped BertForMaskedLM directory (12 layers, 768 wide, 30,522 tokens; shape: other
    BertConfig fields) with the real bert-base-uncased tokenizer files."""
    import torch

    from lib import bert
    if not os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        torch.manual_seed(0)
        cfg = bert.BertConfig(**(shape or {}))  # bert-base-uncased's shape
        os.makedirs(out_dir, exist_ok=True)
        bert.save_pretrained(bert.init_weights(bert.build_model(cfg)), cfg, out_dir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(ROOT, "tests", "fixtures", "real", "splade", name), out_dir)
        shutil.copy(os.path.join(ROOT, "tests", "fixtures", "bert_uncased_vocab.txt"),
                    os.path.join(out_dir, "vocab.txt"))
    return out_dir


def write_cifar(out_dir, records=1000):
    """cifar-10-batches-bin's layout (one label byte, then 3,072 pixel bytes a record) with random images."""
    import numpy as np
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("data_batch_1.bin", "test_batch.bin"):
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            data = rng.integers(0, 256, size=(records, 1 + 3072), dtype=np.uint8)
            data[:, 0] %= 10
            data.tofile(path)
    return out_dir


def write_splade_data(out_dir, n_val=16):
    """The stdlib set the SPLADE scripts embed, as --train-file and --val-file: all its training pairs and
    the first n_val of its validation queries. Validating the whole pool of 400 on bert-base takes two
    minutes each time, and a validation batch needs no more memory than a training step (the estimate
    counts it): the run keeps the real shapes at a fraction of the time."""
    import train_splade_unified as splade
    paths = {f"splade_{name}": os.path.join(out_dir, f"{name}.jsonl") for name in ("train", "val")}
    if not all(os.path.isfile(path) for path in paths.values()):
        os.makedirs(out_dir, exist_ok=True)
        train, val, _ = splade.stdlib_examples()
        for path, examples in zip(paths.values(), (train, val[:n_val])):
            with open(path, "w", encoding="utf-8") as f:
                for ex in examples:
                    f.write(json.dumps({"query": ex.query, "positive_document": ex.positive,
                                        "negative_documents": ex.negatives}) + "\n")
    return paths


def write_models(models_dir, sizes):
    paths = {"tiny_gpt": write_gpt2(os.path.join(models_dir, "gpt2-tiny"),
                                    dict(n_layer=4, n_head=4, n_embd=128, block_size=128))}
    if "real" in sizes:
        paths.update(gpt2=write_gpt2(os.path.join(models_dir, "gpt2")),
                     smollm2=write_smollm2(os.path.join(models_dir, "smollm2-135m")),
                     bert=write_bert(os.path.join(models_dir, "bert-base")),
                     cifar=write_cifar(os.path.join(models_dir, "cifar10")),
                     **write_splade_data(os.path.join(models_dir, "splade-stdlib")))
    return paths


def torch_cuda_count():
    import torch
    return torch.cuda.device_count()


# --- one case ------------------------------------------------------------------------------------
def run_case(script, flags, device, work, env, timeout=None):
    out_dir = os.path.join(work, "out")
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, script, *flags.split(), "--out-dir", out_dir, "--device", device]
    if script == "train_fsdp.py":  # two ranks: gloo on a CPU, nccl on two GPUs (one rank where there is one)
        ranks = min(2, torch_cuda_count()) if device.startswith("cuda") else 2
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *cmd[1:]]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        raise RuntimeError(f"{script} {flags} failed:\n{out.stdout[-1500:]}\n{out.stderr[-2500:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:  # the run's exact bytes, in its end record
        end = [json.loads(line) for line in f if '"end"' in line][-1]
    table = out.stdout[out.stdout.rfind("memory estimate"):].split("\n\n")[0].splitlines()
    return {"estimate": end["memory_estimate"], "measured": end["peak_memory"],
            "measured_over_estimate": round(end["peak_memory"] / end["memory_estimate"], 3),
            "cpu_seconds": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "wall_seconds": round(wall, 1), "printed": table[:24]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scripts", nargs="*", help="only these scripts (default: all ten)")
    p.add_argument("--sizes", nargs="+", default=["tiny", "real"], choices=["tiny", "real", "bf16"],
                   help="bf16: the tiny shapes with --dtype bf16")
    p.add_argument("--flags-with", help="only the cases whose flags contain this text (e.g. --grad-checkpoint)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "byhand-memory-models"),
                   help="where the real-size models and data are written (and found again)")
    p.add_argument("--cache-dir", help="token and model cache for the runs (default: the scripts')")
    p.add_argument("--out", help="write the JSON here too (default: print only); bench/results/memory_<device>.json")
    p.add_argument("--quiet", action=argparse.BooleanOptionalAction, default=None,
                   help="say whether nothing else ran on the machine (recorded with the result)")
    p.add_argument("--write-models", action="store_true", help="only write the models and data, then stop")
    args = p.parse_args(argv)
    t_start = time.perf_counter()  # the whole bench, writing the models included
    paths = write_models(args.models, args.sizes)
    if args.write_models:
        print(json.dumps(paths, indent=2))
        return paths
    env = dict(os.environ, **({"BYHAND_CACHE": args.cache_dir} if args.cache_dir else {}))
    work = tempfile.mkdtemp(prefix="byhand-memory-estimate-")
    rows = []
    for script, size, flags in CASES:
        if size not in args.sizes or (args.scripts and script not in args.scripts) or \
                (args.flags_with and args.flags_with not in flags):
            continue
        row = {"script": script, "size": size, "flags": flags.format(**paths).replace(args.models, "MODELS")}
        try:
            row.update(run_case(script, flags.format(**paths), args.device, work, env))
        except RuntimeError as e:  # one failing case is reported, the others still run
            print(e, file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "printed"}), file=sys.stderr, flush=True)
        report = make_report(args, rows)
        if args.out:  # after every case: a long run's measurements are never lost
            merge_into(args.out, report)
    shutil.rmtree(work, ignore_errors=True)
    report = make_report(args, rows)
    report["bench_wall_seconds"] = {"+".join(args.sizes): round(time.perf_counter() - t_start, 1)}
    if args.out:
        merge_into(args.out, report)
    print(json.dumps(report, indent=2))
    return report


def make_report(args, rows):
    from bench.machine import describe
    low, high = (0.75, 1.25) if args.device == "cpu" else (0.8, 1.2)
    return {"bench": "memory_estimate", "device": args.device, "machine": describe(quiet=args.quiet),
            "target": [low, high], "rows": rows,
            "all_within_target": all(low <= r["measured_over_estimate"] <= high for r in rows)}


def merge_into(path, report):
    """Rows measured now replace those of the same script, size and flags in an earlier result file."""
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        keep = {(r["script"], r["size"], r["flags"]) for r in report["rows"]}
        report["rows"] = [r for r in old["rows"] if (r["script"], r["size"], r["flags"]) not in keep] + report["rows"]
        report["all_within_target"] = all(report["target"][0] <= r["measured_over_estimate"] <= report["target"][1]
                                          for r in report["rows"])
        for key in ("before", "before_note"):
            if key in old:
                report[key] = old[key]
        report["bench_wall_seconds"] = {**old.get("bench_wall_seconds", {}), **report.get("bench_wall_seconds", {})}
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


# --- the tables in docs/ ------------------------------------------------------------------------------
def _gib(b):
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def render(path, size="real", gpu_path=None):
    """Markdown: every script's estimate, measured peak and ratio at this size, and the machine; with
    gpu_path (bench/gpu.py's result, where a GPU wrote one) the CUDA columns beside them."""
    from bench.gpu import memory_cases
    from bench.machine import caption
    with open(os.path.join(ROOT, path)) as f:
        report = json.load(f)
    cuda, gpu_machine = memory_cases(gpu_path) if gpu_path else ({}, None)
    measure = {"cpu": "peak RSS", "cuda": "max allocated"}.get(report["device"], "peak")
    head = f"| script | flags | estimate | measured ({measure}) | measured / estimate |"
    lines = [head + (" CUDA estimate | CUDA max allocated | CUDA ratio |" if cuda else ""),
             "|---|---|---:|---:|---:|" + ("---:|---:|---:|" if cuda else "")]
    estimating = {script for script, _, _ in CASES}  # a row of a script that no longer estimates is not shown
    report["rows"] = [r for r in report["rows"] if r["script"] in estimating]
    for r in report["rows"]:
        if r["size"] == size:
            c = cuda.get((r["script"], r["flags"]))
            cells = (f" {_gib(c['estimate'])} | {_gib(c['measured'])} | {c['measured_over_estimate']:.2f} |" if c
                     else " - | - | - |") if cuda else ""
            lines.append(f"| {r['script']} | `{r['flags']}` | {_gib(r['estimate'])} | {_gib(r['measured'])} | "
                         f"{r['measured_over_estimate']:.2f} |" + cells)
    runs = [r for r in report["rows"] if r["size"] == size]
    whole = report.get("bench_wall_seconds", {}).get(size)
    lines += ["", f"{len(runs)} runs, {sum(r['wall_seconds'] for r in runs) / 60:.1f} min of wall time in all "
              f"({sum(r['cpu_seconds'] for r in runs) / 60:.1f} min of CPU time)"
              + (f"; `python bench/memory_estimate.py --sizes {size}` took {whole / 60:.1f} min, writing the "
                 f"models included." if whole else "."),
              "", caption(report["machine"]) + f" Target: measured / estimate within {report['target'][0]}-"
              f"{report['target'][1]}." + ("" if cuda or not gpu_path else " CUDA has not been measured yet (no "
                                                                         "GPU was available).")
              if report["device"] == "cpu" else caption(report["machine"])]
    if cuda:
        lines += ["", "CUDA columns: `python bench/gpu.py`, row memory (target within 0.8-1.2). "
                  + caption(gpu_machine)]
    return "\n".join(lines)


def render_before_after(path):
    """Markdown: the real-size runs measured before the CPU accounting and the steady heap ("before" in
    the result file, each with its estimate of the time) beside the same script measured now."""
    from bench.machine import caption
    with open(os.path.join(ROOT, path)) as f:
        report = json.load(f)
    lines = ["| run | estimate before | measured before | ratio before | estimate now | measured now | ratio now |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for b in report.get("before", []):
        now = [r for r in report["rows"] if r["size"] == "real" and r["script"] == b["script"]
               and "--grad-checkpoint" not in r["flags"]]
        cells = (f"{_gib(now[0]['estimate'])} | {_gib(now[0]['measured'])} | {now[0]['measured_over_estimate']:.2f}"
                 if now else "- | - | -")
        before = (f"{_gib(b['estimate'])} | {_gib(b['measured'])} | {b['measured'] / b['estimate']:.2f}"
                  if b.get("measured") else "- | - | -")  # a "before" kept only where its machine is named
        lines.append(f"| {b['script']}: {b['case']} | {before} | {cells} |")
    lines += ["", "Before: " + report.get("before_note", "") + " Now: " + caption(report["machine"])]
    return "\n".join(lines)


def render_finetune(path):
    """Markdown: LoRA, QLoRA and QLoRA with --grad-checkpoint on GPT-2 124M, side by side, with the
    estimate's rows for each (what the peak is made of)."""
    from bench.machine import caption
    with open(os.path.join(ROOT, path)) as f:
        report = json.load(f)
    runs = [r for r in report["rows"] if r["size"] == "real" and r["script"].startswith("finetune_")]
    names = [("QLoRA + checkpointing" if "--grad-checkpoint" in r["flags"] else
              "QLoRA" if "qlora" in r["script"] else "LoRA") for r in runs]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(runs)]
    lines.append("| measured peak (RSS) | " + " | ".join(f"**{_gib(r['measured'])}**" for r in runs) + " |")
    lines.append("| estimate | " + " | ".join(_gib(r["estimate"]) for r in runs) + " |")
    lines.append("| measured / estimate | " + " | ".join(f"{r['measured_over_estimate']:.2f}" for r in runs) + " |")
    lines.append("| CPU time of the run (user + sys) | " + " | ".join(f"{r['cpu_seconds']:.0f} s" for r in runs) + " |")
    lines += ["", "The estimate's rows (as the script prints them):", ""]
    for name, r in zip(names, runs):
        table = [line for line in r["printed"] if line.startswith(("memory estimate", "  "))]
        lines += [f"{name}:", "", "```", *table, "```", ""]
    lines.append(caption(report["machine"]) + " GPT-2 124M (random weights, same shapes), 8 x 1,024 tokens a step, "
                 "LoRA r=8 on c_attn, fp32 compute.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
