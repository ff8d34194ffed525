"""The README's main job, `python train.py`, in two checkouts side by side: wall, user and system
CPU time, minor page faults and peak RSS of each run, printed as JSON.

    git worktree add /tmp/before 7ae2391          # or: git archive 7ae2391 | tar -x -C /tmp/before
    python bench/default_run.py /tmp/before .                      # the whole default run, both
    python bench/default_run.py /tmp/before . --steps 40 --repeats 2  # a shorter check

The chunked loss's targets, after against before: wall time at least 1.25x shorter, system time at most
10% of the CPU time (user + system), and a peak RSS no higher. Each run is a child process of its
own, measured with os.wait4, so each figure is that run's alone. Both checkouts read the same
token cache, prepared by an untimed run first, so tokenising the corpus is not part of the time.
With --repeats the runs alternate (before, after, before, ...) and the best wall time of each
side is compared, which is fair when something else shares the machine. On a busy machine say so:
the figures are then "loaded" and only the peak RSS is to be trusted.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time


def run_once(checkout, flags, out_dir, env):
    """One `python train.py` in checkout; its wall time, CPU times, minor faults and peak RSS."""
    cmd = [sys.executable, "train.py", *flags, "--out-dir", out_dir, "--overwrite"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{checkout}: train.py failed:\n{output[-3000:]}")
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # kilobytes on Linux
    val = [line for line in output.splitlines() if "val loss" in line]
    return {"wall_s": round(wall, 2), "user_s": round(usage.ru_utime, 2), "sys_s": round(usage.ru_stime, 2),
            "sys_share_of_cpu": round(usage.ru_stime / max(usage.ru_utime + usage.ru_stime, 1e-9), 3),
            "minor_faults": usage.ru_minflt, "peak_rss_mib": round(peak / 2**20, 1),
            "last_val_line": val[-1].strip() if val else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("before", help="checkout of the code before (e.g. main at 7ae2391)")
    p.add_argument("after", help="checkout of the code after")
    p.add_argument("--steps", type=int, help="train.py --steps (default: train.py's own, the whole default run)")
    p.add_argument("--repeats", type=int, default=1, help="runs per checkout, alternating")
    p.add_argument("--cache-dir", help="token cache both share (default: a fresh temporary directory)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the runs (default: torch's own choice)")
    p.add_argument("--extra", default="", help="more train.py flags, e.g. '--eval-interval 1000'")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="byhand-default-run-")
    cache = args.cache_dir or os.path.join(work, "cache")
    flags = ["--cache-dir", cache, *args.extra.split()]
    flags += ["--steps", str(args.steps)] if args.steps is not None else []
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    # Untimed: tokenise the corpus into the shared cache (one step, no sample).
    run_once(args.after, ["--cache-dir", cache, "--steps", "1", "--sample-tokens", "0"],
             os.path.join(work, "prep"), env)

    results = {"before": [], "after": []}
    for i in range(args.repeats):
        for side in ("before", "after"):
            checkout = getattr(args, side)
            results[side].append(run_once(checkout, flags, os.path.join(work, f"{side}{i}"), env))
            print(json.dumps({"side": side, "repeat": i, **results[side][-1]}), file=sys.stderr, flush=True)
    best = {side: min(runs, key=lambda r: r["wall_s"]) for side, runs in results.items()}
    b, a = best["before"], best["after"]
    report = {
        "bench": "default_run",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_avg_1m_at_end": os.getloadavg()[0], "python": platform.python_version()},
        "flags": flags,
        "before": {"checkout": os.path.abspath(args.before), **b},
        "after": {"checkout": os.path.abspath(args.after), **a},
        "all_runs": results,
        "speedup_wall": round(b["wall_s"] / a["wall_s"], 3),
        "targets": {
            "wall_speedup_at_least_1.25": b["wall_s"] / a["wall_s"] >= 1.25,
            "after_sys_at_most_10pct_of_cpu": a["sys_share_of_cpu"] <= 0.10,
            "after_peak_not_higher": a["peak_rss_mib"] <= b["peak_rss_mib"],
        },
    }
    print(json.dumps(report, indent=2))
    shutil.rmtree(work, ignore_errors=True)  # the runs' checkpoints (and the cache, unless --cache-dir)
    return report


if __name__ == "__main__":
    main()
