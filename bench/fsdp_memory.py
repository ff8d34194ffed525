"""FSDP2 memory benchmark: what each rank of train_fsdp.py holds and its peak, and tokens/s, for N ranks.

Two ways to run it; both print JSON on stdout (progress lines go to stderr):

    python bench/fsdp_memory.py --ranks 1 2 4 --model-size gpt2 --batch-size 1 --block-size 128 [--ddp]
        launches `torchrun --standalone --nproc_per_node=N` on this file once per N and prints a JSON list,
        one object per run; --ddp adds a run of train.py (DDP, every rank holds everything) per N.
    torchrun --standalone --nproc_per_node=2 bench/fsdp_memory.py --model-size gpt2 ...
        runs as one of the ranks (rank 0 prints one JSON object); the way to use it on several nodes.

Any other flag is passed on to train_fsdp.py (e.g. --mixed-precision bf16 --activation-checkpointing).
Per rank: the bytes of the parameter, gradient and AdamW shards it holds (the DTensors' local tensors,
after the last optimizer step) and its peak memory (CUDA max allocated; CPU peak RSS, which includes
the ~250 MB of Python and torch). tokens/s is over all ranks, the first (warm-up) step left out.

On Linux the launcher sets MALLOC_MMAP_THRESHOLD_=65536 for every run (train.py's too) unless it is
already set: glibc otherwise keeps freed heap pages, and a CPU peak RSS then remembers every temporary
(all-gather buffers, the initialisation's full layers) as if it were still alive: without it, an FSDP
rank's peak was once measured well above its estimate (bench/results/fsdp_memory.json holds the run with it).
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="launcher: the N to run")
    ap.add_argument("--ddp", action="store_true", help="launcher: also run train.py (DDP) for each N")
    ap.add_argument("--model-size", default="tiny")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--data", default="stdlib")
    return ap.parse_known_args(argv)


def common_flags(args, out_dir):
    return ["--model-size", args.model_size, "--batch-size", str(args.batch_size), "--block-size", str(args.block_size),
            "--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--data", args.data,
            "--warmup-steps", "1", "--eval-interval", "1000000", "--eval-batches", "1", "--log-interval", "1",
            "--save-interval", "1000000", "--out-dir", out_dir]


def worker(args, extra):
    """One rank under torchrun: train, then rank 0 prints what train_fsdp.main measured."""
    with tempfile.TemporaryDirectory() as out_dir, contextlib.redirect_stdout(sys.stderr):
        result = train_fsdp.main(common_flags(args, out_dir) + ["--no-export"] + extra)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({
            "script": "train_fsdp.py", "ranks": result["world_size"], "model_size": args.model_size,
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "batch_size": args.batch_size, "block_size": args.block_size, "flags": extra,
            "params_per_rank": result["params_per_rank"],
            "per_rank": [{"rank": r, **{k: m[k] for k in ("parameters", "gradients", "optimizer", "peak")}}
                         for r, m in enumerate(result["memory_per_rank"])],
            "unsharded": {k: result["memory_per_rank"][0][k + "_unsharded"]
                          for k in ("parameters", "gradients", "optimizer")},
            "estimate_per_rank": result["memory_estimate"],
            "tokens_per_s": result["tokens_per_s"],
        }))


def run_env():
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # see the docstring: freed memory leaves the RSS
    return env


def ddp_run(args, n):
    """train.py under torchrun: rank 0's peak and its last tokens/s, from its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train.py",
               *common_flags(args, out_dir), "--sample-tokens", "0"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr, env=run_env())
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    end = next(r for r in records if r.get("event") == "end")
    steps = [r for r in records if "tokens_per_s" in r and "event" not in r and r["step"] > 0]
    return {"script": "train.py (DDP)", "ranks": n, "model_size": args.model_size, "batch_size": args.batch_size,
            "malloc_mmap_threshold": run_env()["MALLOC_MMAP_THRESHOLD_"],
            "block_size": args.block_size, "peak_rank0": end["peak_memory"],
            "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / max(1, len(steps))}


def main(argv=None):
    args, extra = parse_args(argv)
    if "RANK" in os.environ:
        return worker(args, extra)
    rows = []
    # The workers get the same run flags (and the pass-through ones), not the launcher's.
    forwarded = ["--model-size", args.model_size, "--batch-size", str(args.batch_size), "--block-size",
                 str(args.block_size), "--grad-accum", str(args.grad_accum), "--steps", str(args.steps),
                 "--data", args.data, *extra]
    for n in args.ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               os.path.abspath(__file__), *forwarded]
        proc = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True, env=run_env())
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        if args.ddp:
            rows.append(ddp_run(args, n))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
