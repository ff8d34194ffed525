"""The loss alone: the full logits + F.cross_entropy against lib/lm_loss's chunked loss, forward +
backward, time and peak memory, printed as JSON.

    python bench/big_vocab_loss.py                          # CPU, fp32, hidden 768, the four shapes below
    python bench/big_vocab_loss.py --device cuda --dtype bf16
    python bench/big_vocab_loss.py --vocab 151936 --tokens 2x512 --variants full chunked

Shapes: vocabularies 50,257 (GPT-2) and 151,936 (Qwen2) at 8 x 128 and 2 x 512 tokens, hidden 768
(GPT-2 124M's width). Variants: "full" (the logits, .float(), F.cross_entropy, as lib/gpt did before),
"chunked" (lib/lm_loss, gradients made in forward) and, with --variants, "recompute" (lib/lm_loss,
recompute=True). Heads: "trained" (the weight gets a gradient, as in pretraining with a tied
embedding) and "frozen" (no weight gradient, as in LoRA fine-tuning and the judge scripts).

Each (shape, variant) runs in a child process of its own, so each peak is that measurement's alone:
on CPU the peak RSS during the first forward + backward minus the RSS just before it (the inputs
exist already); on CUDA the max allocated bytes over those allocated before. With a trained head the
chunked loss's peak includes the [vocab, hidden] weight gradient (made in forward), which any loss
needs; "own_peak_vs_full" takes it out of the chunked peak and compares with the full loss's whole
peak (whose weight gradient is made after that peak, once its log-softmax and their gradient are
freed). Time: the best of --repeats forward + backward after that first one, wall ("fwd_bwd_s") and
CPU ("cpu_s", user + system of the process, less disturbed by other work on a busy machine). The
target: at vocabulary 151,936 the chunked peak at most 1/4 of the full one. On a busy machine
the times are "loaded"; the peaks still hold.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rss_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(args):
    """In the child: one (vocab, tokens, variant), as JSON on stdout."""
    import torch
    import torch.nn.functional as F

    from lib import lm_loss

    device = torch.device(args.device)
    amp = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    b, t = (int(x) for x in args.tokens.split("x"))
    n, v, c = b * t, args.vocab, args.hidden
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, c, device=device, generator=g).requires_grad_()
    weight = (torch.randn(v, c, device=device, generator=g) * 0.02).requires_grad_(args.head == "trained")
    targets = torch.randint(0, v, (n,), device=device, generator=g)

    def step():
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            if args.variant == "full":
                loss = F.cross_entropy(F.linear(hidden, weight).float(), targets)
            else:
                loss = lm_loss.linear_cross_entropy(hidden, weight, targets, chunk_size=args.chunk_size,
                                                    recompute=args.variant == "recompute")
        loss.backward()
        hidden.grad = weight.grad = None
        return loss

    def cpu_seconds():
        usage = os.times()
        return usage.user + usage.system

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Warm up on small tensors, so one-time costs (thread pools, the autograd engine) are not counted.
    small = (torch.randn(8, c, device=device, requires_grad=True),
             torch.randn(16, c, device=device, requires_grad=True))
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        F.cross_entropy(F.linear(small[0], small[1]).float(), targets[:8] % 16).backward()
        lm_loss.linear_cross_entropy(small[0], small[1], targets[:8] % 16).backward()
    del small

    if device.type == "cuda":
        sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark: the peak from here on
        before = rss_bytes("VmRSS")
        step()
        peak = rss_bytes("VmHWM") - before
    times, cpu = [], []
    for _ in range(args.repeats):
        sync()
        start, start_cpu = time.perf_counter(), cpu_seconds()
        step()
        sync()
        times.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    chunk = args.chunk_size or lm_loss.default_chunk_size(v, c)
    weight_grad = v * c * 4 if args.head == "trained" else 0
    return {"vocab": v, "tokens": args.tokens, "hidden": c, "head": args.head, "variant": args.variant,
            "chunk_rows": None if args.variant == "full" else lm_loss.chunk_rows(n, chunk),  # evened, as the loss does
            "peak_added_mib": round(peak / 2**20, 1),
            "fwd_bwd_s": round(min(times), 3), "cpu_s": round(min(cpu), 3),
            "full_logits_fp32_mib": round(n * v * 4 / 2**20, 1), "weight_grad_mib": round(weight_grad / 2**20, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="*", default=[50257, 151936])
    p.add_argument("--tokens", nargs="*", default=["8x128", "2x512"], help="batch x sequence")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--variants", nargs="*", default=["full", "chunked"], help="full, chunked, recompute")
    p.add_argument("--heads", nargs="*", default=["trained", "frozen"], help="trained, frozen")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast dtype")
    p.add_argument("--chunk-size", type=int, help="rows per chunk (default: lib/lm_loss's choice)")
    p.add_argument("--repeats", type=int, default=2, help="timed forward + backward after the first")
    p.add_argument("--child", nargs=2, metavar=("VOCAB", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--head", default="trained", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.vocab, args.tokens = int(args.child[0]), args.child[1]
        print(json.dumps(measure(args)))
        return None

    rows = []
    for vocab in args.vocab:
        for tokens in args.tokens:
            for head in args.heads:
                for variant in args.variants:
                    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(vocab), tokens, "--variant",
                           variant, "--head", head, "--hidden", str(args.hidden), "--device", args.device, "--dtype",
                           args.dtype, "--repeats", str(args.repeats)] + (["--chunk-size", str(args.chunk_size)]
                                                                          if args.chunk_size else [])
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"{vocab} {tokens} {head} {variant} failed:\n{out.stderr[-3000:]}")
                    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    ratios = {}
    for r in rows:
        if r["variant"] != "full":
            full = next((f for f in rows if f["variant"] == "full"
                         and all(f[k] == r[k] for k in ("vocab", "tokens", "head"))), None)
            if full:
                ratios[f'{r["vocab"]} {r["tokens"]} {r["head"]} {r["variant"]}'] = {
                    "peak_vs_full": round(r["peak_added_mib"] / full["peak_added_mib"], 3),
                    "own_peak_vs_full": round((r["peak_added_mib"] - r["weight_grad_mib"]) / full["peak_added_mib"], 3),
                    "time_vs_full": round(r["fwd_bwd_s"] / full["fwd_bwd_s"], 3) if full["fwd_bwd_s"] else None,
                    "cpu_vs_full": round(r["cpu_s"] / full["cpu_s"], 3) if full["cpu_s"] else None}
    # The target: the loss's own memory (beyond the weight gradient, which the head needs whichever
    # way its loss is computed) at most a quarter of the full loss's, at 151,936.
    big = [v["own_peak_vs_full"] <= 0.25 for k, v in ratios.items() if k.startswith("151936")
           and k.endswith(" chunked")]
    report = {"bench": "big_vocab_loss", "device": args.device, "dtype": args.dtype, "hidden": args.hidden,
              "cpu_count": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0], "rows": rows, "ratios": ratios,
              "target_chunked_peak_at_most_quarter_of_full_at_151936": all(big) if big else None}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
