"""8-bit AdamW benchmark: how far it drifts from fp32 AdamW, and how fast its step is.

    nice -n 10 python bench/adam8bit.py --out bench/results/adam8bit.json [--quiet]

Writes one JSON object (also printed) with
- "drift": the same small MLP regression (its width x width weights get 8-bit state; the biases and
  the last Linear(width, 1) weight, under 4,096 elements, keep fp32 moments) trained
  from the same start on the same batches by torch.optim.AdamW (fp32 moments) and by
  lib/adam8bit.AdamW8bit; at chosen steps: both losses, the weights' distance apart relative to how
  far fp32 AdamW moved them, and the relative error of the 8-bit first and second moments against
  fp32 moments computed from the 8-bit run's own gradients (the rounding alone, one step).
- "speed": seconds per optimizer step on N random parameters (one tensor) for torch.optim.AdamW
  fused=True, foreach=True and AdamW8bit, median of --repeats timed steps after a warm-up, wall and
  CPU (user + sys) time, and state bytes per parameter.
render(path) turns the JSON into the two tables of docs/adam8bit_explained.md.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import machine  # noqa: E402
from lib.adam8bit import AdamW8bit, dequantize_blockwise, state_bytes  # noqa: E402


def make_mlp(seed, width, depth):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def drift(args):
    """Train the same MLP with fp32 AdamW and AdamW8bit; compare at the checkpoints."""
    teacher = make_mlp(1, args.width, args.depth)
    fp32, q8 = make_mlp(0, args.width, args.depth), make_mlp(0, args.width, args.depth)
    # The baseline for "drift": a second fp32 run whose start differs by 1e-6 relative noise.
    nudged = make_mlp(0, args.width, args.depth)
    noise = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in nudged.parameters():
            p.mul_(1 + 1e-6 * torch.randn(p.shape, generator=noise))
    start = [p.detach().clone() for p in fp32.parameters()]
    opt32 = torch.optim.AdamW(fp32.parameters(), lr=args.lr, weight_decay=0.01)
    opt8 = AdamW8bit(q8.parameters(), lr=args.lr, weight_decay=0.01)
    opt_nudged = torch.optim.AdamW(nudged.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(2)
    checkpoints, rows = set(args.checkpoints), []
    for step in range(1, max(checkpoints) + 1):
        x = torch.randn(args.batch, args.width, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        losses = []
        for model, opt in ((fp32, opt32), (q8, opt8), (nudged, opt_nudged)):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            if opt is opt8 and step in checkpoints:
                # The rounding alone: fp32 moments one step on from the 8-bit state, vs the 8-bit result.
                p = q8[0].weight
                s = opt8.state[p]
                if s:
                    m0 = dequantize_blockwise(s["state1"], s["absmax1"], True).view(-1)[:p.numel()]
                    v0 = dequantize_blockwise(s["state2"], s["absmax2"], False).view(-1)[:p.numel()]
                else:  # the first step: both moments start at zero
                    m0 = v0 = torch.zeros(p.numel())
                g = p.grad.reshape(-1)
                m_exact, v_exact = 0.9 * m0 + 0.1 * g, 0.999 * v0 + 0.001 * g * g
            opt.step()
        if step in checkpoints:
            s = opt8.state[q8[0].weight]
            m8 = dequantize_blockwise(s["state1"], s["absmax1"], True).view(-1)[:m_exact.numel()]
            v8 = dequantize_blockwise(s["state2"], s["absmax2"], False).view(-1)[:v_exact.numel()]
            apart = sum((a - b).pow(2).sum() for a, b in zip(q8.parameters(), fp32.parameters())).sqrt()
            moved = sum((a - b).pow(2).sum() for a, b in zip(fp32.parameters(), start)).sqrt()
            apart_fp32 = sum((a - b).pow(2).sum() for a, b in zip(nudged.parameters(), fp32.parameters())).sqrt()
            rows.append({"step": step, "loss_fp32": losses[0], "loss_8bit": losses[1],
                         "weights_apart_over_moved": (apart / moved).item(),
                         "fp32_nudged_apart_over_moved": (apart_fp32 / moved).item(),
                         "m_rel_error": ((m8 - m_exact).norm() / m_exact.norm()).item(),
                         "v_rel_error": ((v8 - v_exact).norm() / v_exact.norm()).item()})
            print(json.dumps(rows[-1]), file=sys.stderr)
    n_params = sum(p.numel() for p in fp32.parameters())
    return {"model": f"MLP {args.depth} x Linear({args.width}, {args.width}) + GELU, Linear({args.width}, 1)",
            "parameters": n_params, "batch": args.batch, "lr": args.lr, "weight_decay": 0.01,
            "task": "regression onto a random teacher MLP of the same shape, fresh Gaussian inputs each step",
            "rows": rows}


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def speed(args):
    results = []
    for n in args.sizes:
        row = {"parameters": n}
        for name, make in (("adamw_fused", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                           ("adamw_foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True)),
                           ("adamw8bit", lambda ps: AdamW8bit(ps, lr=1e-4))):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(n) * 0.02)
            p.grad = torch.randn(n) * 1e-3
            opt = make([p])
            opt.step()  # warm-up: state allocated
            walls, cpus = [], []
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), cpu_seconds()
                opt.step()
                walls.append(time.perf_counter() - t0)
                cpus.append(cpu_seconds() - c0)
            row[name] = {"step_ms": round(statistics.median(walls) * 1e3, 2),
                         "cpu_ms": round(statistics.median(cpus) * 1e3, 2),
                         "state_bytes_per_param": round(state_bytes(opt) / n, 3)}
        row["ratio_8bit_vs_fused"] = round(row["adamw8bit"]["step_ms"] / row["adamw_fused"]["step_ms"], 2)
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    return {"repeats": args.repeats, "threads": torch.get_num_threads(), "rows": results}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the JSON here (e.g. bench/results/adam8bit.json)")
    p.add_argument("--quiet", action="store_true", help="nothing else ran on the machine (recorded)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoints", type=int, nargs="+", default=[1, 10, 100, 500, 2000])
    p.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**22, 2**24])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", choices=["drift", "speed"], help="measure one part; the other is kept from --out")
    args = p.parse_args(argv)
    report = {}
    if args.only and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            report = json.load(f)
    if args.only:
        report.setdefault("machines", {})[args.only] = machine.describe(quiet=args.quiet)
    else:
        report["machine"] = machine.describe(quiet=args.quiet)
    for part, measure in (("drift", drift), ("speed", speed)):
        if args.only in (None, part):
            report[part] = measure(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def render_drift(path="bench/results/adam8bit.json"):
    with open(path) as f:
        report = json.load(f)
    d = report["drift"]
    where = report.get("machines", {}).get("drift", report["machine"])
    lines = [f"{d['model']}, {d['parameters']:,} parameters, batch {d['batch']}, lr {d['lr']:g}, "
             f"weight decay {d['weight_decay']:g}; {d['task']}.", "",
             "| step | loss, fp32 AdamW | loss, 8-bit AdamW | weights apart / distance fp32 moved "
             "| the same for fp32 from a start 1e-6 apart | rounding error of m (one step) | rounding error of v (one "
             "step) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        lines.append(f"| {r['step']:,} | {r['loss_fp32']:.4g} | {r['loss_8bit']:.4g} | "
                     f"{r['weights_apart_over_moved']:.2%} | {r['fp32_nudged_apart_over_moved']:.4%} | "
                     f"{r['m_rel_error']:.2%} | {r['v_rel_error']:.2%} |")
    return "\n".join(lines + ["", machine.caption(where)])


def render_speed(path="bench/results/adam8bit.json"):
    with open(path) as f:
        report = json.load(f)
    s = report["speed"]
    lines = [f"One step over N parameters in one tensor, median of {s['repeats']} steps after a warm-up, "
             f"{s['threads']} threads; wall time (CPU time: user + sys, summed over threads).", "",
             "| N | fused AdamW | foreach AdamW | 8-bit AdamW | 8-bit / fused | state bytes per parameter (fp32 / "
             "8-bit) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        cell = lambda k: f"{r[k]['step_ms']:.1f} ms ({r[k]['cpu_ms']:.0f} ms CPU)"  # noqa: E731
        lines.append(f"| {r['parameters']:,} | {cell('adamw_fused')} | {cell('adamw_foreach')} | {cell('adamw8bit')} | "
                     f"{r['ratio_8bit_vs_fused']:.2f}x | {r['adamw_fused']['state_bytes_per_param']:.2f} / "
                     f"{r['adamw8bit']['state_bytes_per_param']:.3f} |")
    return "\n".join(lines + ["", machine.caption(report["machine"])])


if __name__ == "__main__":
    main()
