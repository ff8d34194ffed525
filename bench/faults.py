"""Kill real training runs, resume them, count what was lost: bench/results/faults.json.

    nice -n 10 python bench/faults.py --before /tmp/byhand-before   # a copy of the code before (git archive)
    python docs/render.py                                           # the tables in docs/crash_safe_checkpoints.md

Three faults, each tried on this code ("after") and, with --before DIR, on a copy of the code before
crash-safe checkpoints ("before"), run the same way:

1. SIGKILL at random instants: train.py on the GPT-2 124M shape (--batch-size 1 --block-size 64 --steps 8
   --save-interval 1) is killed with SIGKILL at --trials instants drawn uniformly between its first save and
   its end, saves included; then it is resumed (--auto-resume; the code before has only --resume) and run
   to the end. Recorded per trial: the updates done when it was killed, the step it resumed from (none: the
   resume failed, and its one line), the steps lost, and whether the final weights equal an unbroken run's
   bit for bit.
2. SIGTERM after 27 updates of a 40-step run with --save-interval 20 (the tiny model): the exit status and
   the step saved.
3. torchrun --max-restarts 1, 2 ranks, --steps 40 --save-interval 5 (the tiny model): one worker killed with
   SIGKILL after 30 updates; torchrun's exit status and whether the run finished.
And the cost of one save of the 124M model and its AdamW state (time, CPU time, disk once saved).
"""

import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import machine  # noqa: E402

BIG = ["--model-size", "gpt2", "--batch-size", "1", "--block-size", "64", "--eval-batches", "1",
       "--eval-interval", "1000", "--sample-tokens", "0", "--log-interval", "1"]
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "4",
        "--eval-batches", "1", "--eval-interval", "1000", "--sample-tokens", "0", "--log-interval", "1"]


def env():
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}


def updates_done(out):
    """Updates finished, from metrics.jsonl (a line per step, written before the step's save)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(line).get("step") for line in f if '"loss"' in line]
    except (OSError, ValueError):
        return 0
    return max((s + 1 for s in steps if s is not None), default=0)


def saved(out):
    """Whether a first save is complete: a committed checkpoint (after) or a training state (before)."""
    return bool(glob.glob(os.path.join(out, "checkpoints", "step-*"))) or (
        not os.path.isdir(os.path.join(out, "checkpoints")) and os.path.exists(os.path.join(out, "training_state.pt")))


def same_weights(a, b):
    from safetensors.torch import load_file
    import torch

    try:
        x, y = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    except Exception:
        return False
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def run_train(tree, argv, log, **kw):
    return subprocess.Popen([sys.executable, os.path.join(tree, "train.py"), *argv], cwd=tree, env=env(),
                            stdout=log, stderr=subprocess.STDOUT, **kw)


def resume_flag(tree):
    with open(os.path.join(tree, "lib", "guards.py")) as f:
        return "--auto-resume" if "--auto-resume" in f.read() else "--resume"


def kills(tree, data, work, trials, steps, seed):
    """Fault 1: SIGKILL at random instants of a 124M run, then resume."""
    argv = [*BIG, "--steps", str(steps), "--save-interval", "1", "--data", data]
    ref = os.path.join(work, "unbroken")
    with open(ref + ".log", "w") as log:
        t0 = time.perf_counter()
        proc = run_train(tree, [*argv, "--out-dir", ref], log)
        while not saved(ref) and proc.poll() is None:
            time.sleep(0.05)
        first_save = time.perf_counter() - t0
        proc.wait()
        total = time.perf_counter() - t0
    assert proc.returncode == 0, open(ref + ".log").read()[-2000:]
    rng = random.Random(seed)
    results = []
    for trial in range(trials):
        out = os.path.join(work, f"trial-{trial}")
        delay = rng.uniform(0, total - first_save)
        with open(out + ".log", "w") as log:
            proc = run_train(tree, [*argv, "--out-dir", out], log)
            while not saved(out) and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(delay)
            killed = proc.poll() is None
            if killed:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        done = updates_done(out)
        resume = subprocess.run([sys.executable, os.path.join(tree, "train.py"), "--out-dir", out,
                                 resume_flag(tree)], cwd=tree, env=env(), capture_output=True, text=True)
        said = resume.stdout + resume.stderr
        found = re.search(r"resuming from step (\d+)", said)
        error = next((line for line in said.splitlines() if line.startswith("error: ")), None)
        start = int(found.group(1)) if found and resume.returncode == 0 else None
        results.append({"delay_s": round(delay, 2), "killed": killed, "updates_done": done,
                        "resumed_from": start, "resume_exit": resume.returncode,
                        "steps_lost": done if start is None else done - start,
                        "exact": resume.returncode == 0 and same_weights(out, ref),
                        "error": error.replace(work, "OUT") if error else None})
        print(json.dumps(results[-1]), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(ref, ignore_errors=True)
    return {"unbroken_s": round(total, 1), "first_save_s": round(first_save, 1), "trials": results}


def sigterm(tree, data, work):
    """Fault 2: SIGTERM after 27 of 40 updates, --save-interval 20."""
    out = os.path.join(work, "sigterm")
    with open(out + ".log", "w") as log:
        proc = run_train(tree, [*TINY, "--steps", "40", "--save-interval", "20", "--data", data, "--out-dir", out], log)
        while updates_done(out) < 27 and proc.poll() is None:
            time.sleep(0.01)
        done = updates_done(out)
        proc.send_signal(signal.SIGTERM)
        proc.wait()
    import torch

    states = sorted(glob.glob(os.path.join(out, "checkpoints", "step-*", "training_state.pt"))) or [
        os.path.join(out, "training_state.pt")]
    step = torch.load(states[-1], weights_only=True)["step"] if os.path.exists(states[-1]) else None
    return {"updates_done": done, "exit": proc.returncode, "saved_step": step,
            "steps_lost": done - (step or 0)}


def restart(tree, data, work):
    """Fault 3: torchrun --max-restarts 1; a worker killed with SIGKILL after 30 updates."""
    out = os.path.join(work, "restart")
    extra = ["--auto-resume"] if resume_flag(tree) == "--auto-resume" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "1", os.path.join(tree, "train.py"), *TINY, "--steps", "40", "--save-interval", "5", "--data", data,
           "--out-dir", out, *extra]
    with open(out + ".log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=tree, env={**env(), "OMP_NUM_THREADS": "1"}, stdout=log,
                                stderr=subprocess.STDOUT)
        while updates_done(out) < 30 and proc.poll() is None:
            time.sleep(0.01)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(workers[-1]), signal.SIGKILL)
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
    with open(out + ".log") as f:
        said = f.read()
    error = next((line for line in said.splitlines() if "error: " in line), None)
    command = " ".join(["torchrun", *cmd[3:]]).replace(tree + "/", "").replace(work, "X").replace(data, "DATA")
    return {"command": command,
            "torchrun_exit": proc.returncode, "finished": updates_done(out) >= 40 and proc.returncode == 0,
            "error": error[error.index("error: "):].replace(work, "X") if error else None}


def window(tree, data, work, steps):
    """SIGKILL in the window between two renames: the second save's weights already renamed into place, its
    training state still being written (its temporary file has appeared). Then resume, as in kills()."""
    argv = [*BIG, "--steps", str(steps), "--save-interval", "1", "--data", data]
    out = os.path.join(work, "window")
    with open(out + ".log", "w") as log:
        proc = run_train(tree, [*argv, "--out-dir", out], log)
        while updates_done(out) < 2 and proc.poll() is None:  # the first save (step 1) is done
            time.sleep(0.01)
        while not glob.glob(os.path.join(out, "training_state.pt.tmp-*")) and proc.poll() is None:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = updates_done(out)
    resume = subprocess.run([sys.executable, os.path.join(tree, "train.py"), "--out-dir", out, resume_flag(tree)],
                            cwd=tree, env=env(), capture_output=True, text=True)
    said = resume.stdout + resume.stderr
    found = re.search(r"resuming from step (\d+)", said)
    error = next((line for line in said.splitlines() if line.startswith("error: ")), None)
    start = int(found.group(1)) if found and resume.returncode == 0 else None
    shutil.rmtree(out, ignore_errors=True)
    return {"updates_done": done, "resumed_from": start, "resume_exit": resume.returncode,
            "steps_lost": done if start is None else done - start,
            "error": error.replace(work, "OUT") if error else None}


SAVE_COST = r"""
import argparse, json, os, sys, time, torch
sys.path.insert(0, os.getcwd())
import train
from lib import checkpoint, gpt, optim, rundir
cfg = gpt.GPTConfig(**gpt.MODEL_SIZES["gpt2"])
model = gpt.GPT(cfg)
opt = optim.make_adamw(model.parameters(), 1e-4, 0.1, (0.9, 0.95), "cpu")
for p in model.parameters():
    p.grad = torch.zeros_like(p)
opt.step()  # AdamW's two moments now exist: the state is twice the weights
out = sys.argv[1]
os.makedirs(out)
run = rundir.Run(out, train.RUN)
args = argparse.Namespace(keep_last=1, steps=8)
times = []
for step in range(1, 4):
    t0, c0 = time.perf_counter(), time.process_time()
    checkpoint.save_hf(out, cfg, gpt.to_hf_state_dict(model), step=step)
    rundir.save_state(run, args, {"step": step, "optimizer": opt.state_dict()})
    times.append((time.perf_counter() - t0, time.process_time() - c0))
inodes = {}
for root, _, names in os.walk(out):
    for name in names:
        st = os.stat(os.path.join(root, name))
        inodes[st.st_ino] = st.st_blocks * 512
print(json.dumps({"save_s": min(t for t, _ in times), "save_cpu_s": min(c for _, c in times),
                  "disk_bytes": sum(inodes.values())}))
"""


def save_cost(tree, work):
    proc = subprocess.run([sys.executable, "-c", SAVE_COST, os.path.join(work, "save-cost")], cwd=tree, env=env(),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.rmtree(os.path.join(work, "save-cost"), ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(tree, data, trials, steps, seed):
    work = tempfile.mkdtemp(prefix="byhand-faults-")
    try:
        report = {"save": save_cost(tree, work)}
        print("save", report["save"], flush=True)
        report["sigterm"] = sigterm(tree, data, work)
        print("sigterm", report["sigterm"], flush=True)
        report["restart"] = restart(tree, data, work)
        print("restart", report["restart"], flush=True)
        report["kills"] = kills(tree, data, work, trials, steps, seed)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def default_data():
    """A copy of the stdlib's json and email packages, about 400 KB of text."""
    import sysconfig

    data = tempfile.mkdtemp(prefix="byhand-faults-data-")
    for pkg in ("json", "email"):
        for name in sorted(os.listdir(os.path.join(sysconfig.get_paths()["stdlib"], pkg))):
            if name.endswith(".py"):
                shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], pkg, name),
                            os.path.join(data, f"{pkg}_{name}"))
    return data


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=8, help="SIGKILLs at random instants of the 124M run")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="draws the instants")
    p.add_argument("--data", default=None, help="a text file or directory (default: a copy of the stdlib's json "
                   "and email packages, about 400 KB)")
    p.add_argument("--before", help="a copy of the code before crash-safe checkpoints, run the same way")
    p.add_argument("--before-rev", default=None, help="the git revision that copy is (recorded)")
    p.add_argument("--quiet", action="store_true", help="nothing else ran on the machine (recorded)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "faults.json"))
    p.add_argument("--save-only", action="store_true", help="into the existing --out: a SIGKILL in the window "
                   "between two renames (after and before), and the cost of a save measured again, after and before "
                   "in turn, three rounds, the fastest kept (a busy machine makes single measurements unfair to "
                   "whichever ran while it was busier)")
    args = p.parse_args()
    if args.save_only:
        with open(args.out) as f:
            report = json.load(f)
        work = tempfile.mkdtemp(prefix="byhand-faults-")
        trees = {"after": ROOT, "before": os.path.abspath(args.before)} if args.before else {"after": ROOT}
        for side, tree in trees.items():
            report[side]["window"] = window(tree, report.get("data") or default_data(), work, report["steps"])
            print(side, "window", report[side]["window"], flush=True)
        best = {}
        for _ in range(3):
            for side, tree in trees.items():
                cost = save_cost(tree, work)
                print(side, cost, flush=True)
                if side not in best or cost["save_s"] < best[side]["save_s"]:
                    best[side] = cost
        for side, cost in best.items():
            report[side]["save"] = {**cost, "rounds": 3}
        report["save_machine"] = machine.describe(quiet=args.quiet)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
        return
    data = args.data or default_data()
    report = {"machine": machine.describe(quiet=args.quiet), "trials": args.trials, "steps": args.steps,
              "shape": "GPT-2 124M (--model-size gpt2 --batch-size 1 --block-size 64 --save-interval 1)",
              "after": measure(ROOT, data, args.trials, args.steps, args.seed)}
    if args.before:
        report["before"] = measure(os.path.abspath(args.before), data, args.trials, args.steps, args.seed)
        report["before_rev"] = args.before_rev
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


# --- the tables of docs/crash_safe_checkpoints.md ----------------------------------------------------------
def render(path):
    with open(os.path.join(ROOT, path)) as f:
        report = json.load(f)
    sides = [s for s in ("before", "after") if s in report]
    lines = ["| | " + " | ".join(sides) + " |", "|---|" + "---|" * len(sides)]

    def row(label, fn):
        lines.append(f"| {label} | " + " | ".join(fn(report[s]) for s in sides) + " |")

    def kill_summary(r):
        t = r["kills"]["trials"]
        ok = sum(1 for x in t if x["resumed_from"] is not None and x["exact"])
        return f"{ok} of {len(t)} resumed exactly"

    row(f"SIGKILL at {report['trials']} random instants of the 124M run (saves included)", kill_summary)
    row("steps lost per kill (each kill: lost of done)",
        lambda r: ", ".join(f"{x['steps_lost']}/{x['updates_done']}" for x in r["kills"]["trials"]))
    row("most steps lost by one kill", lambda r: str(max(x["steps_lost"] for x in r["kills"]["trials"])))
    if all("window" in report[s] for s in sides):
        row("SIGKILL between two renames (weights renamed, state being written)",
            lambda r: (f"resumed from step {r['window']['resumed_from']}" if r["window"]["resumed_from"] is not None
                       else "resume failed")
                       + f", {r['window']['steps_lost']} of {r['window']['updates_done']} steps lost")
    def status(code):  # Popen's -N: killed by signal N, which a shell reports as 128 + N
        return f"killed by the signal (status {128 - code})" if code < 0 else f"exit {code}"

    row("SIGTERM after update 27 of 40 (`--save-interval 20`)",
        lambda r: f"{status(r['sigterm']['exit'])}, saved step {r['sigterm']['saved_step']}, "
                  f"{r['sigterm']['steps_lost']} steps lost")
    row("torchrun `--max-restarts 1`, a worker killed after update 30",
        lambda r: f"torchrun exit {r['restart']['torchrun_exit']}, "
                  + ("finished" if r["restart"]["finished"] else "not finished"))
    rounds = {report[s]["save"].get("rounds", 1) for s in sides}  # save_cost saves 3 times per round
    tries = f"fastest of {3 * rounds.pop()}" if len(rounds) == 1 else "fastest"
    row(f"one save of the 124M weights and AdamW state: time (CPU time), {tries}",
        lambda r: f"{r['save']['save_s']:.2f} s ({r['save']['save_cpu_s']:.2f} s)")
    row("disk once saved", lambda r: f"{r['save']['disk_bytes'] / 2**30:.2f} GiB")
    out = "\n".join(lines)
    errors = sorted({x["error"] for s in sides for x in [*report[s]["kills"]["trials"], report[s].get("window") or {}]
                     if x.get("error")})
    if errors:
        out += "\n\nWhat the failed resumes said:\n\n" + "\n".join(f"    {e}" for e in errors)
    if "before" in report and report["before"]["restart"]["error"]:
        out += "\n\nWhat the restarted workers said before:\n\n    " + report["before"]["restart"]["error"]
    before = f" Before: the code at {report['before_rev']}." if report.get("before_rev") else ""
    return out + "\n\n" + machine.caption(report["machine"]) + before


if __name__ == "__main__":
    main()
