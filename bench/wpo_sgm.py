"""Step time and peak memory of each strategy of train_wpo_sgm_memory_efficient.py over a range of K.

    python bench/wpo_sgm.py                      # the default sweep, JSON on stdout (several minutes on a CPU)
    python bench/wpo_sgm.py --dim 32 --ks 64 256 1024 --chunk 16
    python bench/wpo_sgm.py --one '{"strategy": "chunked", "dim": 32, "centres": 256, "chunk": 16}'
    python bench/wpo_sgm.py --sampling '{"dim": 3072, "centres": 5, "num_samples": 2000}'   # sample(): time, peak

Every configuration runs in its own subprocess, so that one configuration's freed memory cannot
inflate the next one's peak. Peak memory on CPU is the process's peak resident set (VmHWM from
/proc/self/status, via lib.device): the runtime baseline (VmRSS right after the imports, before any
data or model exists) is recorded, the high-water mark is reset (lib.device.reset_peak_memory writes
to /proc/self/clear_refs) and read after a few training steps. That is what the script itself
reports and what its estimate predicts, baseline included. On CUDA it is max_memory_allocated.
On CPU each subprocess runs with MALLOC_MMAP_THRESHOLD_=131072 (glibc then maps every block over
128 KiB on its own and unmaps it when freed), so the resident set follows the tensors; without it
glibc keeps freed blocks of up to 32 MiB in its heap, and the peak then depends on the allocation
history: --glibc-default measures that way too (the chunked peak then grows with the number of chunks).
Targets: at a fixed chunk size, quadrupling K raises the chunked peak by at most 10%;
a chunked step costs at most 1.5x a single_gpu step where both fit; the estimate is within 25% of
the measured peak. model_parallel runs under torchrun (gloo on CPU); its row is the rank with the
higher peak, and its estimate is the per-rank one.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(cfg, first=True):
    """Run a few training steps of one configuration in this process; return its figures.

    first=False: an earlier configuration already ran in this process, so the first step's kernels
    and threads (CPU_STEP_OVERHEAD) are in the baseline already and are not added again."""
    sys.path.insert(0, ROOT)
    import torch

    import train_wpo_sgm_memory_efficient as w
    from lib import device as devices

    from lib import distributed

    device = devices.pick_device(cfg.get("device"))
    baseline = w.runtime_baseline(device)  # after the imports, before any data or model: as the script measures it
    info = distributed.setup(device.type) if cfg["strategy"] == "model_parallel" else distributed.DistInfo()
    device = distributed.device_for(info, device)
    d, k, b = cfg["dim"], cfg["centres"], cfg.get("batch", 64)
    n = max(k, cfg.get("train_samples", k))
    shape = w.Shape(d, k, b, n, cfg.get("depth", 2), cfg.get("hidden", 64))
    plan = w.Plan(cfg["strategy"], cfg.get("chunk"), cfg.get("accumulation_steps", 1), info.world_size)
    estimate = w.estimate_memory(shape, plan, baseline)
    if not first and device.type == "cpu":
        estimate = {k: v for k, v in estimate.items() if not k.startswith("runtime: first step")}
    devices.reset_peak_memory(device)
    torch.manual_seed(0)
    train_x = torch.randn(n, d, device=device) * 0.5
    centres = train_x[:k].tensor_split(info.world_size)[info.rank]  # model_parallel: this rank's share
    net = w.FactorNet(d, shape.depth, shape.hidden).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    times = []
    for step in range(cfg.get("steps", 4)):
        x = train_x[torch.randint(n, (b,))]
        devices.synchronize(device)
        t = time.perf_counter()
        w.forward_backward(net, x, centres, 0.01, plan)
        opt.step()
        opt.zero_grad(set_to_none=True)
        devices.synchronize(device)
        times.append(time.perf_counter() - t)
    peak = devices.peak_memory_bytes(device)
    total = sum(estimate.values())
    distributed.cleanup(info)
    return {**cfg, "device": str(device), "rank": info.rank, "world_size": info.world_size,
            "step_s": min(times[1:] or times), "peak_bytes": peak, "baseline_bytes": baseline, "estimate_bytes": total,
            "estimate_over_peak": round(total / peak, 3), "peak_above_baseline": peak - baseline,
            "estimate_above_baseline": total - baseline}


def measure_sampling(cfg):
    """Peak memory of sample() above what the process held before it, against sampling_memory()."""
    sys.path.insert(0, ROOT)
    import torch

    import train_wpo_sgm_memory_efficient as w
    from lib import device as devices

    device = devices.pick_device(cfg.get("device"))
    d, k, n = cfg["dim"], cfg["centres"], cfg["num_samples"]
    torch.manual_seed(0)
    net, centres = w.FactorNet(d, 1, 8).to(device), torch.rand(k, d, device=device)
    w.sample(w.FactorNet(4, 1, 8).to(device), torch.rand(2, 4, device=device), 0.01, 10, 0)  # load the kernels first
    before = w.runtime_baseline(device)
    devices.reset_peak_memory(device)
    t = time.perf_counter()
    w.sample(net, centres, 0.01, n, seed=0, log=lambda *a: None)
    seconds = time.perf_counter() - t
    peak = devices.peak_memory_bytes(device) - before
    estimate = sum(w.sampling_memory(w.Shape(d, k, 1, k, 1, 8, num_samples=n)).values())
    return {**cfg, "device": str(device), "seconds": round(seconds, 2), "peak_above_before": peak,
            "estimate": estimate, "estimate_over_peak": round(estimate / peak, 3)}


def time_interleaved(cfg):
    """Step time of each strategy at one K, measured in one process, strategies taking turns: on a
    shared machine the load drifts, and taking turns exposes every strategy to the same drift."""
    sys.path.insert(0, ROOT)
    import torch

    import train_wpo_sgm_memory_efficient as w
    from lib import device as devices

    device = devices.pick_device(cfg.get("device"))
    d, k, b = cfg["dim"], cfg["centres"], cfg.get("batch", 64)
    torch.manual_seed(0)
    centres = torch.randn(k, d, device=device) * 0.5
    net = w.FactorNet(d, cfg.get("depth", 2), cfg.get("hidden", 64)).to(device)
    plans = {"single_gpu": w.Plan("single_gpu"), "chunked": w.Plan("chunked", cfg["chunk"]),
             "gradient_accumulation": w.Plan("gradient_accumulation", None, 4)}
    plans = {name: plans[name] for name in cfg["strategies"] if name in plans}
    best = {name: float("inf") for name in plans}
    x = centres[torch.randint(k, (b,))] + 0.1
    for _ in range(cfg.get("rounds", 5)):
        for name, plan in plans.items():
            devices.synchronize(device)
            t = time.perf_counter()
            w.forward_backward(net, x, centres, 0.01, plan)
            net.zero_grad(set_to_none=True)
            devices.synchronize(device)
            best[name] = min(best[name], time.perf_counter() - t)
    return {"centres": k, "dim": d, "batch": b, "chunk": cfg["chunk"], "best_step_s": best}


def measure_in_subprocess(cfg, timeout=600, glibc_default=False):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if not glibc_default and "strategies" not in cfg:
        # Memory only: a fresh mapping per large block costs page faults, which would slow the
        # strategy that allocates most often (chunked) in the timings.
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    mode = "--time" if "strategies" in cfg else "--one"
    launch = [sys.executable]
    if cfg.get("strategy") == "model_parallel":  # one process per rank; each prints its own figures
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg['ranks']}"]
    proc = subprocess.run([*launch, os.path.abspath(__file__), mode, json.dumps(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {**cfg, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                else f"exit {proc.returncode}"}
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return max(results, key=lambda r: r.get("peak_bytes", 0))  # model_parallel: the rank with the highest peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--one",
                   help="measure one JSON configuration (or a list, in turn) in this process and print JSON lines")
    p.add_argument("--time", help="time the JSON configuration's strategies in turns in this process")
    p.add_argument("--sampling", help='measure sample() for one JSON configuration {"dim", "centres", "num_samples"}')
    p.add_argument("--dim", type=int, default=64, help="data dimension D")
    p.add_argument("--ks", type=int, nargs="+", default=[64, 256, 1024], help="numbers of centres K")
    p.add_argument("--chunk", type=int, default=32, help="chunk size for chunked")
    p.add_argument("--steps", type=int, default=2,
                   help="training steps per configuration (time: the fastest after the first)")
    p.add_argument("--ranks", type=int, default=2, help="torchrun processes for model_parallel")
    p.add_argument("--rounds", type=int, default=5,
                   help="timing rounds per K (strategies take turns; the fastest counts)")
    p.add_argument("--glibc-default", action="store_true", help="leave glibc's malloc thresholds alone (see above)")
    p.add_argument("--batch", type=int, default=64, help="batch size")
    p.add_argument("--strategies", nargs="+",
                   default=["single_gpu", "chunked", "gradient_accumulation", "model_parallel"],
                   help="strategies to run (model_parallel is launched with torchrun, --ranks CPU processes, gloo)")
    p.add_argument("--device", help="cuda, mps or cpu")
    args = p.parse_args(argv)
    if args.one:
        cfgs = json.loads(args.one)
        for i, cfg in enumerate(cfgs if isinstance(cfgs, list) else [cfgs]):  # a list: one after another
            print(json.dumps(measure(cfg, first=i == 0)), flush=True)
        return
    if args.time:
        print(json.dumps(time_interleaved(json.loads(args.time))))
        return
    if args.sampling:
        print(json.dumps(measure_sampling(json.loads(args.sampling))))
        return
    rows = []
    for k in args.ks:
        for strategy in args.strategies:
            cfg = {"strategy": strategy, "dim": args.dim, "centres": k, "batch": args.batch, "device": args.device,
                   "steps": args.steps}
            if strategy == "chunked":
                cfg["chunk"] = args.chunk
            if strategy == "gradient_accumulation":
                cfg["accumulation_steps"] = 4
            if strategy == "model_parallel":
                cfg["ranks"] = args.ranks
            rows.append(measure_in_subprocess(cfg, glibc_default=args.glibc_default))
            print(json.dumps(rows[-1]), file=sys.stderr)
    timings = []
    for k in args.ks:
        cfg = {"dim": args.dim, "centres": k, "batch": args.batch, "chunk": args.chunk, "device": args.device,
               "strategies": args.strategies, "rounds": args.rounds}
        timings.append(measure_in_subprocess(cfg))
        print(json.dumps(timings[-1]), file=sys.stderr)
    meta = {"device": rows[0].get("device") if rows else None, "threads": os.environ.get("OMP_NUM_THREADS", "1"),
            "malloc_mmap_threshold": None if args.glibc_default else 131072}
    print(json.dumps({"meta": meta, "memory_rows": rows, "timing_rows": timings,
                      "summary": summarise(rows, timings, args)}, indent=1))


def summarise(rows, timings, args):
    ok = [r for r in rows if "error" not in r]
    by = {(r["strategy"], r["centres"]): r for r in ok}
    out = {}
    chunked = sorted((r["centres"], r["peak_above_baseline"], r["peak_bytes"]) for r in ok
                     if r["strategy"] == "chunked")
    growth = []
    for k, _, peak in chunked:
        if ("chunked", 4 * k) in by:
            growth.append({"K": k, "K4": 4 * k, "peak_ratio": round(by[("chunked", 4 * k)]["peak_bytes"] / peak, 3)})
    out["chunked_peak_growth_when_K_x4"] = growth
    out["chunked_over_single_step_time"] = [
        {"K": t["centres"], "single_s": round(t["best_step_s"]["single_gpu"], 4),
         "chunked_s": round(t["best_step_s"]["chunked"], 4),
         "ratio": round(t["best_step_s"]["chunked"] / t["best_step_s"]["single_gpu"], 2)}
        for t in timings if "error" not in t and {"chunked", "single_gpu"} <= set(t["best_step_s"])]
    out["estimate_over_peak"] = {f"{r['strategy']} K={r['centres']}": r["estimate_over_peak"] for r in ok}
    return out


if __name__ == "__main__":
    main()
