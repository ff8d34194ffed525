"""NF4 benchmark: quantise/dequantise throughput and LinearNF4 vs nn.Linear step time.

Prints one JSON object. Throughput is GB/s of fp32 weight processed (numel * 4 bytes).
The linear comparison runs forward + backward w.r.t. the input at gpt2-medium MLP
shapes; "plain_frozen" is an nn.Linear with requires_grad=False on its weight (the
same work as the frozen NF4 base in QLoRA), "plain_trainable" also computes dW.

    python bench/nf4.py [--device cpu] [--dtype float32] [--repeats 3] [--out bench/results/nf4.json] [--quiet]

render(path) turns the JSON into the speed table of docs/qlora_explained.md.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import machine  # noqa: E402
from lib import nf4  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def best_time(fn, device, repeats):
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def default_device():
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def main(argv=None):
    # arguments
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8 * 256, help="batch * sequence length")
    ap.add_argument("--out", default=None, help="also write the JSON here (e.g. bench/results/nf4.json)")
    ap.add_argument("--quiet", action="store_true", help="nothing else ran on the machine (recorded)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or default_device())
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    report = {"machine": machine.describe(quiet=args.quiet), "device": str(device), "dtype": args.dtype,
              "threads": torch.get_num_threads(), "repeats": args.repeats, "tokens": args.tokens,
              # Other processes competing for the cores slow the many small dequantise ops most.
              "load_avg_1min_before": round(os.getloadavg()[0], 2), "quantize": {}, "linear": {}}

    # quantise / dequantise throughput
    for out_f, in_f in [(4096, 1024), (1024, 4096)]:
        w = (torch.randn(out_f, in_f, device=device) * 0.02).to(dtype)
        gb = w.numel() * 4 / 1e9
        t_q = best_time(lambda: nf4.quantize_nf4(w), device, args.repeats)
        q = nf4.quantize_nf4(w)
        t_dq = best_time(lambda: nf4.dequantize_nf4(q, dtype), device, args.repeats)
        report["quantize"][f"{out_f}x{in_f}"] = {
            "quantize_gb_s": round(gb / t_q, 3), "dequantize_gb_s": round(gb / t_dq, 3),
            "quantize_ms": round(t_q * 1e3, 2), "dequantize_ms": round(t_dq * 1e3, 2),
            "bits_per_parameter": round(nf4.bits_per_parameter(q), 4)}

    # forward + backward: LinearNF4 vs nn.Linear (c_fc 1024->4096 and c_proj 4096->1024)
    for in_f, out_f in [(1024, 4096), (4096, 1024)]:
        plain = nn.Linear(in_f, out_f, device=device, dtype=dtype)
        qlin = nf4.LinearNF4.from_linear(plain)
        x = torch.randn(args.tokens, in_f, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(args.tokens, out_f, device=device, dtype=dtype)

        def step(layer):
            x.grad = None
            layer(x).backward(g)

        t_nf4 = best_time(lambda: step(qlin), device, args.repeats)
        t_trainable = best_time(lambda: step(plain), device, args.repeats)
        plain.requires_grad_(False)
        t_frozen = best_time(lambda: step(plain), device, args.repeats)
        report["linear"][f"{in_f}->{out_f}"] = {
            "nf4_ms": round(t_nf4 * 1e3, 2), "plain_frozen_ms": round(t_frozen * 1e3, 2),
            "plain_trainable_ms": round(t_trainable * 1e3, 2),
            "ratio_vs_frozen": round(t_nf4 / t_frozen, 3),
            "ratio_vs_trainable": round(t_nf4 / t_trainable, 3)}

    worst = max(r["ratio_vs_frozen"] for r in report["linear"].values())
    report["worst_ratio_vs_frozen"] = worst
    report["target_ratio"] = 1.5
    report["meets_target"] = worst <= 1.5
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")


def render(path="bench/results/nf4.json"):
    """The quantise/dequantise and LinearNF4 tables for the docs, with the machine's caption."""
    with open(path) as f:
        r = json.load(f)
    lines = [f"Device {r['device']}, {r['dtype']} weights, {r['threads']} threads, best of {r['repeats']} "
             "after a warm-up; GB/s counts the fp32 size of the weight (numel x 4 bytes).", "",
             "| weight | quantise | dequantise | bits per parameter |", "|---|---:|---:|---:|"]
    for shape, q in r["quantize"].items():
        lines.append(f"| {shape} | {q['quantize_gb_s']:.2f} GB/s ({q['quantize_ms']:.1f} ms) | "
                     f"{q['dequantize_gb_s']:.2f} GB/s ({q['dequantize_ms']:.1f} ms) | {q['bits_per_parameter']:.3f} |")
    lines += ["", f"Forward + backward (w.r.t. the input) of one layer on {r['tokens']:,} tokens:", "",
              "| layer | LinearNF4 | nn.Linear, frozen | nn.Linear, trainable | NF4 / frozen |",
              "|---|---:|---:|---:|---:|"]
    for shape, t in r["linear"].items():
        lines.append(f"| {shape} | {t['nf4_ms']:.1f} ms | {t['plain_frozen_ms']:.1f} ms | "
                     f"{t['plain_trainable_ms']:.1f} ms | {t['ratio_vs_frozen']:.2f}x |")
    return "\n".join(lines + ["", machine.caption(r["machine"])])


if __name__ == "__main__":
    main()
