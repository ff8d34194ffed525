"""SPLADE training step: plain batch vs GradCache at the same effective batch, memory-efficient on/off,
naive accumulation vs exact, and encoding throughput. Prints JSON.

    python bench/splade.py                        # the demo model (2 layers, 128 wide, vocabulary 8,192), CPU
    python bench/splade.py --hidden-size 256 --num-layers 4 --batch 32 --micro 4

Each configuration runs in its own process, so its peak memory (CUDA max allocated, or the peak
resident set on CPU) is its own. Targets (docs/memory_optimization.md): a GradCache step costs at
most 1.5x a plain step of the same effective batch; with micro-batch 8 and effective batch 64 the
peak is at most a third of the plain batch-64 peak.
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import train_splade_optimized as optimized  # noqa: E402
import train_splade_unified as unified  # noqa: E402
from lib import bert, optim  # noqa: E402
from lib import device as devices  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary (the demo's learned WordPiece size)")
    p.add_argument("--hidden-size", type=int, default=128, help="model width")
    p.add_argument("--num-layers", type=int, default=2, help="transformer layers")
    p.add_argument("--num-heads", type=int, default=2, help="attention heads")
    p.add_argument("--batch", type=int, default=64, help="effective batch (queries per update)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch for GradCache and naive accumulation")
    p.add_argument("--query-length", type=int, default=32, help="tokens per query")
    p.add_argument("--doc-length", type=int, default=128, help="tokens per document")
    p.add_argument("--negatives", type=int, default=1, help="hard negatives per query")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up step)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    return p.parse_args(argv)


CONFIGS = {
    "plain": dict(micro=None, gradcache=False, efficient=False),
    "plain, memory-efficient": dict(micro=None, gradcache=False, efficient=True),
    "gradcache": dict(micro="micro", gradcache=True, efficient=False),
    "gradcache, memory-efficient": dict(micro="micro", gradcache=True, efficient=True),
    "naive accumulation": dict(micro="micro", gradcache=False, efficient=False),
}


def make_model(args, device):
    torch.manual_seed(0)
    cfg = bert.BertConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                          num_attention_heads=args.num_heads, intermediate_size=4 * args.hidden_size,
                          max_position_embeddings=max(512, args.doc_length), hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return bert.init_weights(bert.build_model(cfg)).to(device).train(), cfg


def make_batch(args, micro, device, seed=0):
    """The effective batch as micro-batches of full-length random texts (the worst case for memory)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(args.batch // micro):
        q = torch.randint(5, args.vocab_size, (micro, args.query_length), generator=g)
        d = torch.randint(5, args.vocab_size, (micro * (1 + args.negatives), args.doc_length), generator=g)
        out.append(unified.Batch(q.to(device), torch.ones_like(q).to(device), d.to(device),
                                 torch.ones_like(d).to(device)))
    return out


def run_one(args, name):
    device = torch.device(args.device)
    spec = CONFIGS[name]
    model, cfg = make_model(args, device)
    model.gradient_checkpointing = spec["efficient"]
    opt = optim.make_adamw(model.parameters(), 1e-4, 0.01, (0.9, 0.999), device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    micro = args.micro if spec["micro"] else args.batch
    step_fn = optimized.gradcache_step if spec["gradcache"] else unified.naive_step
    batches = [make_batch(args, micro, device, seed) for seed in range(args.steps + 1)]
    devices.reset_peak_memory(device)
    times = []
    for i, mbs in enumerate(batches):
        devices.synchronize(device)
        t0 = time.perf_counter()
        stats = step_fn(model, mbs, 1e-4, 1e-4, None, scaler)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if spec["efficient"]:
            import gc
            gc.collect(1)
        devices.synchronize(device)
        if i > 0:  # the first step pays for allocations and kernel selection
            times.append(time.perf_counter() - t0)
    return {"step_s": sum(times) / len(times), "peak_bytes": devices.peak_memory_bytes(device),
            "rank_loss": stats["rank_loss"], "n_params": bert.num_params(model)}


def naive_vs_exact(args):
    """On one batch: the loss and gradient of naive accumulation against the exact (full-batch) ones."""
    device = torch.device(args.device)
    model, _ = make_model(args, device)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    result = {}
    for name, micro, fn in (("exact", args.micro, optimized.gradcache_step), ("naive", args.micro, unified.naive_step)):
        model.zero_grad(set_to_none=True)
        stats = fn(model, make_batch(args, micro, device), 1e-4, 1e-4, None, scaler)
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        result[name] = (stats["rank_loss"], torch.cat(grads))
    (exact_loss, g_exact), (naive_loss, g_naive) = result["exact"], result["naive"]
    return {"negatives_per_query": {"exact": args.batch * (1 + args.negatives) - 1,
                                    "naive": args.micro * (1 + args.negatives) - 1},
            "rank_loss": {"exact": exact_loss, "naive": naive_loss},
            "gradient_cosine": torch.nn.functional.cosine_similarity(g_exact, g_naive, dim=0).item(),
            "gradient_relative_error": ((g_naive - g_exact).norm() / g_exact.norm()).item()}


@torch.no_grad()
def encode_throughput(args, n=256):
    device = torch.device(args.device)
    model, _ = make_model(args, device)
    model.eval()
    ids = torch.randint(5, args.vocab_size, (n, args.doc_length), device=device)
    mask = torch.ones_like(ids)
    unified.encode_batch(model, ids[:64], mask[:64])
    devices.synchronize(device)
    t0 = time.perf_counter()
    for s in range(0, n, 64):
        unified.encode_batch(model, ids[s:s + 64], mask[s:s + 64])
    devices.synchronize(device)
    return n / (time.perf_counter() - t0)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    if args.one:
        print(json.dumps(run_one(args, args.one)))
        return
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = {}
    for name in CONFIGS:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--one", name],
                              capture_output=True, text=True)
        if proc.returncode:
            results[name] = {"error": proc.stderr.strip().splitlines()[-1]}
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, cached = results["plain"], results["gradcache"]
    report = {
        "device": (args.device if args.device != "cpu"
                   else f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"),
        "model": {"vocab_size": args.vocab_size, "hidden_size": args.hidden_size, "num_layers": args.num_layers,
                  "n_params": plain.get("n_params")},
        "batch": {"effective": args.batch, "micro": args.micro, "negatives": args.negatives,
                  "query_length": args.query_length, "doc_length": args.doc_length},
        "configs": results,
        "gradcache_step_vs_plain": (cached["step_s"] / plain["step_s"]
                                    if "step_s" in cached and "step_s" in plain else None),
        "gradcache_peak_vs_plain": (cached["peak_bytes"] / plain["peak_bytes"]
                                    if "peak_bytes" in cached and "peak_bytes" in plain else None),
        "naive_vs_exact": naive_vs_exact(args),
        "encode_texts_per_s": encode_throughput(args),
    }
    report["targets_met"] = {"step <= 1.5x plain": report["gradcache_step_vs_plain"] is not None
                             and report["gradcache_step_vs_plain"] <= 1.5,
                             "peak <= 1/3 plain": report["gradcache_peak_vs_plain"] is not None
                             and report["gradcache_peak_vs_plain"] <= 1 / 3}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
