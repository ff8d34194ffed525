"""The judge's learning curve: test MAE and Pearson r of judge_train_mps.py against the number of
training conversations, on a real model (NOT run by the test suite: each point is a real training run).

    python bench/judge_curve.py --model DIR                          # 100, 300, 600 and 1,200 conversations
    nice -n 10 python bench/judge_curve.py --model DIR --sizes 100 300
    python bench/judge_curve.py --add-run out/judge_600 --wall-s 1500 --cpu-s 1400   # a run made by hand
    python bench/judge_curve.py --render                             # the markdown figure, from the JSON

Each point is one process, `python judge_train_mps.py --model DIR --max_samples N --epochs 2
--test_samples 60` with every other flag at its default (the embedded judge set), timed: wall time
and the CPU time (user + sys) the process used. Its figures are read back from the run's own files:
test_predictions.json (the judge's metrics and the constant guess, the training median) and
metrics.jsonl (the validation losses). Points are merged into bench/results/judge_curve.json (a size
measured again replaces its old point); `render` turns the JSON into the table of
docs/judge_mps_vs_cuda.md, naming the sizes not measured yet.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.machine import describe  # noqa: E402

RESULT = os.path.join(ROOT, "bench", "results", "judge_curve.json")
SIZES = (100, 300, 600, 1200)
EPOCHS, TEST_SAMPLES = 2, 60


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="the real model's Hugging Face directory (e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="how the table names the model")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="training conversations per point")
    p.add_argument("--out-root", default=os.path.join(ROOT, "out", "judge_curve"), help="the runs' output directories")
    p.add_argument("--add-run", help="record an existing run's directory (made with the flags above) instead")
    p.add_argument("--wall-s", type=float, help="with --add-run: its wall time in seconds")
    p.add_argument("--cpu-s", type=float, help="with --add-run: its CPU time (user + sys) in seconds")
    p.add_argument("--threads", help="with --add-run: the OMP_NUM_THREADS it ran with (default: torch's default)")
    p.add_argument("--quiet", action="store_true", help="nothing else ran on the machine (else: shared)")
    p.add_argument("--result", default=RESULT, help="the JSON to merge the points into")
    p.add_argument("--render", action="store_true", help="print the markdown table from --result and exit")
    return p.parse_args(argv)


def read_point(out_dir: str) -> dict:
    """A finished run's figures, from its test_predictions.json and metrics.jsonl."""
    with open(os.path.join(out_dir, "test_predictions.json"), encoding="utf-8") as f:
        saved = json.load(f)
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    start = next(r for r in records if r.get("event") == "start")
    end = [r for r in records if r.get("event") == "end"][-1]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    m, const = saved["metrics"], saved["constant_guess"]
    args = start["args"]
    return {
        "n_train": args["max_samples"], "epochs": args["epochs"], "lr": args["lr"], "lora_r": args["lora_r"],
        # the steps run: fewer than planned when early stopping ended the run
        "optimizer_steps": end.get("step", start["total_steps"]), "n_test": m["n"], "n_scored": m["n_scored"],
        "unparseable": m["unparseable"], "mae": m["mae"], "rmse": m["rmse"], "cohen_kappa": m["cohen_kappa"],
        "pearson_r": m["pearson_r"], "rouge_l_f1": m["rouge_l_f1"], "constant_score": const["score"],
        "constant_mae": const["mae"], "val_loss_first": vals[0] if vals else None,
        "val_loss_best": end["best_val"], "best_step": end["best_step"], "peak_memory": end["peak_memory"],
    }


def measure(model: str, n: int, out_root: str) -> dict:
    """One point: the training run in its own process, timed (wall, and user + sys CPU of the child)."""
    out = os.path.join(out_root, f"n{n}")
    cmd = [sys.executable, os.path.join(ROOT, "judge_train_mps.py"), "--model", model, "--max_samples", str(n),
           "--epochs", str(EPOCHS), "--test_samples", str(TEST_SAMPLES), "--output_dir", out, "--overwrite"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**read_point(out), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "threads": os.environ.get("OMP_NUM_THREADS")}  # the child's torch threads (None: torch's default)


def merge(path: str, points: list, machine: dict, model_name: str) -> dict:
    report = {"points": []}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    for p in points:
        p["machine"] = machine
        report["points"] = [q for q in report["points"] if q["n_train"] != p["n_train"]] + [p]
    report["points"].sort(key=lambda q: q["n_train"])
    report.update(model=model_name, planned=list(SIZES), machine=machine,
                  command=f"judge_train_mps.py --model DIR --max_samples N --epochs {EPOCHS} --test_samples "
                          f"{TEST_SAMPLES}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    return report


def minutes(seconds) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 60} min {s % 60:02d} s"


def render(path: str = RESULT) -> str:
    """The learning-curve table for the docs, from the committed JSON."""
    with open(os.path.join(ROOT, path) if not os.path.isabs(path) else path, encoding="utf-8") as f:
        report = json.load(f)
    rows = ["| training conversations | optimizer steps | test MAE | constant guess's MAE | Pearson r | "
            "Cohen's kappa | answers without a score | wall time (CPU user + sys) | the machine then |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in report["points"]:
        load = {True: "quiet", False: "shared (time rough)"}.get(p.get("machine", {}).get("quiet"), "load not recorded")
        threads = f"OMP_NUM_THREADS={p['threads']}" if p.get("threads") else "torch's default threads"
        rows.append(f"| {p['n_train']:,} | {p['optimizer_steps']} | {p['mae']:.2f} | {p['constant_mae']:.2f} | "
                    f"{p['pearson_r']:.2f} | {p['cohen_kappa']:.2f} | {p['unparseable']}/{p['n_test']} | "
                    f"{minutes(p.get('wall_s'))} ({minutes(p.get('cpu_s'))}) | {load}, {threads} |")
    done = {p["n_train"] for p in report["points"]}
    missing = [n for n in report["planned"] if n not in done]
    lines = [f"{report['model']}, `{report['command']}` (every other flag at its default), on the CPU; "
             f"each row one run.", "", *rows, ""]
    if missing:
        lines += [f"Not measured yet: {', '.join(f'{n:,}' for n in missing)} conversations "
                  f"(`python bench/judge_curve.py --model DIR --sizes {' '.join(map(str, missing))}`).", ""]
    m = report["machine"]  # the rows' load and threads are their own (the last column)
    dates = sorted({p.get("machine", {}).get("date") or m["date"] for p in report["points"]} or {m["date"]})
    lines.append(f"Measured on {m.get('gpu') or m['cpu'] + ', ' + str(m['cores']) + ' cores'}, torch {m['torch']}, "
                 f"{dates[0] if len(dates) == 1 else dates[0] + ' to ' + dates[-1]}.")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        print(render(args.result))
        return
    if args.add_run:
        point = {**read_point(args.add_run), "wall_s": args.wall_s, "cpu_s": args.cpu_s, "threads": args.threads}
        points = [point]
    else:
        if not args.model:
            sys.exit("error: --model DIR is needed to measure (or --add-run, or --render)")
        points = []
        for n in args.sizes:
            points.append(measure(args.model, n, args.out_root))
            # each point is written as soon as it is measured: a long curve cut short keeps what it has
            merge(args.result, points[-1:], describe(quiet=args.quiet), args.model_name)
            print(json.dumps(points[-1]))
        return
    report = merge(args.result, points, describe(quiet=args.quiet), args.model_name)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
