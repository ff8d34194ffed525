"""Training throughput of the GPT in lib/: tokens/s, MFU and peak memory, printed as JSON.

    python bench/train_throughput.py                                   # tiny model, CPU
    python bench/train_throughput.py --model-size gpt2 --compile --batch-size 16 --device cuda

It times the same step train.py runs (batch from lib.data, autocast forward, backward, clip,
fused AdamW) after warm-up steps, so compilation and allocator warm-up are not counted.
Targets live here, not in the tests: on a GPU, gpt2 + --compile + bf16 at block 1024
should reach at least 40% MFU (not measured yet); on CPU the data path must cost a negligible share of a step
(no per-token Python loops), which the "data_ms_per_step" field shows.

--out FILE adds the run to FILE's "runs" (with the machine, bench/machine.describe) and
render(FILE) makes the table of docs/training_architecture.md from them.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import machine  # noqa: E402
from lib import data, gpt, metrics, optim  # noqa: E402
from lib import device as devices  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="tiny", choices=list(gpt.MODEL_SIZES))
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--data", default="stdlib")
    p.add_argument("--device")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--peak-flops", type=float)
    p.add_argument("--out", help="add this run to the JSON file's runs (e.g. bench/results/train_throughput.json)")
    p.add_argument("--quiet", action="store_true", help="nothing else ran on the machine (recorded)")
    args = p.parse_args(argv)

    device = devices.pick_device(args.device)
    amp = devices.amp_dtype(device, args.dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = dict(gpt.MODEL_SIZES[args.model_size])
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    cfg = gpt.GPTConfig(**shape)
    T = cfg.block_size
    split = data.TokenSplit(data.prepare(args.data, log=lambda *a: None), "train")
    batches = data.Batches(split, args.batch_size, T, seed=0)

    devices.seed_everything(0)
    raw = gpt.GPT(cfg).to(device)
    model = torch.compile(raw) if args.compile else raw
    opt = optim.make_adamw(raw.parameters(), 1e-4, device_type=device.type)
    devices.reset_peak_memory(device)

    data_time = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            devices.synchronize(device)
            t0, data_time, cpu0 = time.perf_counter(), 0.0, time.process_time()
        td = time.perf_counter()
        x, y = batches.get(step, 0, device)
        data_time += time.perf_counter() - td
        with devices.autocast(device, amp):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    devices.synchronize(device)
    dt = (time.perf_counter() - t0) / args.steps
    cpu_dt = (time.process_time() - cpu0) / args.steps  # user + system of this process, all threads
    tokens = args.batch_size * T
    peak = metrics.peak_flops_for(device, args.peak_flops)
    flops = metrics.flops_per_token(raw.num_params(), cfg.n_layer, cfg.n_embd, T) * tokens
    result = {
        "machine": machine.describe(quiet=args.quiet),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model_size": args.model_size, "n_params": raw.num_params(), "batch_size": args.batch_size, "block_size": T,
        "dtype": "fp32" if amp is None else str(amp).replace("torch.", ""), "compile": args.compile,
        "timed_steps": args.steps, "warmup_steps": args.warmup,
        "ms_per_step": round(dt * 1e3, 2),
        "cpu_ms_per_step": round(cpu_dt * 1e3, 2),
        "data_ms_per_step": round(data_time / args.steps * 1e3, 3),
        "tokens_per_s": round(tokens / dt),
        "achieved_tflops": round(flops / dt / 1e12, 3),
        "mfu": round(flops / dt / peak, 4) if peak else None,
        "peak_memory_bytes": devices.peak_memory_bytes(device),
        "memory_kind": devices.memory_label(device),
    }
    print(json.dumps(result))
    if args.out:
        runs = []
        if os.path.exists(args.out):
            with open(args.out) as f:
                runs = json.load(f)["runs"]
        with open(args.out, "w") as f:
            f.write(json.dumps({"runs": runs + [result]}, indent=1) + "\n")


def render(path="bench/results/train_throughput.json"):
    """One row per recorded run: the step time, tokens/s and the data path's share, with each machine named."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    lines = ["| model | batch | dtype | timed steps (after warm-up) | ms per step, wall (CPU) | tokens/s | data path "
             "per step | peak memory | load average (1 min) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['model_size']} ({r['n_params'] / 1e6:.1f}M) | {r['batch_size']} x {r['block_size']} | "
                     f"{r['dtype']}{' + compile' if r['compile'] else ''} | {r.get('timed_steps', '?')} "
                     f"({r.get('warmup_steps', '?')}) | {r['ms_per_step']:,.0f} "
                     f"({r.get('cpu_ms_per_step', float('nan')):,.0f}) | {r['tokens_per_s']:,} | "
                     f"{r['data_ms_per_step']:.1f} ms ({r['data_ms_per_step'] / r['ms_per_step']:.1%}) | "
                     f"{r['peak_memory_bytes'] / 2**20:,.0f} MiB ({r['memory_kind']}) | "
                     f"{r['machine']['load_avg_1m']} |")
    captions = sorted({machine.caption(r["machine"]) for r in runs})
    return "\n".join(lines + [""] + captions)


if __name__ == "__main__":
    main()
