"""Data preparation: MB/s and peak memory at 50, 400 and 1,600 MB of text, streaming against the old way.

    nice -n 10 python bench/prepare.py --scratch /tmp/prep --quiet no > bench/results/prepare.json
    python bench/prepare.py --sizes 50 --impls streaming --scratch /tmp/prep     # one quick point

Each point runs in a fresh process: build (or reuse) a corpus of SIZE MB in --scratch, import a
`prepare`, tokenise into an empty cache, and report wall and CPU seconds and the process's peak RSS
(VmHWM, Linux), beside the RSS right after the imports (torch is imported by lib.data either way).

"streaming" is today's lib/data.prepare. "in_memory" is the earlier one, read from git (commit
OLD_COMMIT): it read every file into a list of strings, tokenised it all into Python lists and only then
wrote the shards, so its peak grew about 15 bytes per byte of text; a size whose predicted peak does
not fit in the RAM available is skipped and said so, not run.

Targets (read by `check`, not by the test suite): the streaming peak at 400 MB (and at 1,600 MB) is
at most 1.15 x the peak at 50 MB, and the streaming tokens equal the in-memory ones where both ran.
The corpus: a directory of 8 MB text files, each the stdlib's .py files concatenated from a different
starting file, so that no two files are the same.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OLD_COMMIT = "5795e58"  # the last commit with the in-memory lib/data.prepare
FILE_MB = 8
MAX_PEAK_RATIO = 1.15
OLD_BYTES_PER_BYTE = 17  # the in-memory peak per byte of text, measured: skip sizes that would not fit

CHILD = r"""
import hashlib, json, os, sys, time
sys.path.insert(0, {root!r})
impl, corpus, cache = sys.argv[1], sys.argv[2], sys.argv[3]
if impl == "in_memory":
    import importlib.util
    spec = importlib.util.spec_from_file_location("old_data", sys.argv[4])
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
else:
    from lib import data as mod
from lib import tokenizer
tokenizer.get_encoding()
def hwm():  # this process's peak RSS: VmHWM is the memory map's own (ru_maxrss would include the parent's at fork)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
base = hwm()
t0, c0 = time.perf_counter(), os.times()
out = mod.prepare(corpus, cache, log=lambda *a: None)
t1, c1 = time.perf_counter(), os.times()
peak = hwm()
meta = json.load(open(os.path.join(out, "meta.json")))
h = hashlib.sha256()
for split in ("train", "val"):
    for name in meta[split + "_shards"]:
        with open(os.path.join(out, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
print(json.dumps(dict(wall_s=t1 - t0, cpu_s=(c1.user - c0.user) + (c1.system - c0.system), peak_rss=peak,
                      rss_after_imports=base, train_tokens=meta["train_tokens"], val_tokens=meta["val_tokens"],
                      tokens_sha256=h.hexdigest())))
"""


def make_corpus(folder, mb):
    """SIZE MB of real text in files of FILE_MB (the last one shorter), made once and reused."""
    import sysconfig

    from lib import data

    os.makedirs(folder, exist_ok=True)
    if sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) == mb * 1_000_000:
        return
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = [open(os.path.join(stdlib, f), "rb").read() for f in data.stdlib_files()]
    sources = [s for s in sources if _utf8(s)]
    left, k = mb * 1_000_000, 0
    while left > 0:
        size, parts, i = min(left, FILE_MB * 1_000_000), [], (k * 97) % len(sources)
        total = 0
        while total < size:
            parts.append(sources[i % len(sources)])
            total += len(parts[-1])
            i += 1
        blob = b"".join(parts)[:size]
        while not _utf8(blob):  # do not cut a character in two
            blob = blob[:-1]
        with open(os.path.join(folder, f"part{k:05d}.txt"), "wb") as f:
            f.write(blob)
        left -= len(blob)
        k += 1


def _utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def available_bytes():
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def run_point(impl, corpus, scratch, old_file):
    with tempfile.TemporaryDirectory(dir=scratch) as cache:
        cmd = [sys.executable, "-c", CHILD.format(root=ROOT), impl, corpus, cache, old_file or ""]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scratch", required=True, help="where the corpora and caches go (outside the repository)")
    p.add_argument("--sizes", default="50,400,1600", help="MB of text, comma-separated")
    p.add_argument("--impls", default="streaming,in_memory")
    p.add_argument("--quiet", choices=["yes", "no"], required=True, help="was nothing else running on the machine?")
    p.add_argument("--keep", action="store_true", help="keep the corpora in --scratch")
    args = p.parse_args(argv)
    from bench import machine

    old_file = os.path.join(args.scratch, "old_data.py")
    os.makedirs(args.scratch, exist_ok=True)
    with open(old_file, "w") as f:
        f.write(subprocess.run(["git", "show", f"{OLD_COMMIT}:lib/data.py"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout)
    points = []
    for mb in [int(s) for s in args.sizes.split(",")]:
        corpus = os.path.join(args.scratch, f"corpus-{mb}mb")
        make_corpus(corpus, mb)
        for impl in args.impls.split(","):
            point = {"impl": impl, "text_mb": mb}
            need = OLD_BYTES_PER_BYTE * mb * 1_000_000
            if impl == "in_memory" and need > 0.8 * available_bytes():
                point["skipped"] = (f"needs about {need / 2**30:.0f} GiB ({OLD_BYTES_PER_BYTE} bytes per byte of "
                                    f"text), {available_bytes() / 2**30:.0f} GiB available")
            else:
                point.update(run_point(impl, corpus, args.scratch, old_file))
                point["mb_per_s"] = mb / point["wall_s"]
                point["mb_per_cpu_s"] = mb / point["cpu_s"]
            print(json.dumps(point), file=sys.stderr, flush=True)
            points.append(point)
        if not args.keep:
            import shutil

            shutil.rmtree(corpus, ignore_errors=True)
    report = {"machine": machine.describe(quiet=args.quiet == "yes"), "file_mb": FILE_MB, "points": points}
    report["checks"] = check(report)
    print(json.dumps(report, indent=2))
    return report


def check(report):
    """The targets: flat streaming memory, and the same tokens as the in-memory way where both ran."""
    stream = {p["text_mb"]: p for p in report["points"] if p["impl"] == "streaming" and "peak_rss" in p}
    out = {}
    if stream:
        smallest = stream[min(stream)]["peak_rss"]
        out["peak_ratio_to_smallest"] = {mb: round(p["peak_rss"] / smallest, 3) for mb, p in sorted(stream.items())}
        out["flat_memory"] = all(r <= MAX_PEAK_RATIO for r in out["peak_ratio_to_smallest"].values())
        if 50 in stream and 400 in stream:  # the target as first stated: 400 MB peaks within 15% of 50 MB
            out["flat_400_vs_50"] = stream[400]["peak_rss"] <= MAX_PEAK_RATIO * stream[50]["peak_rss"]
    same = [p["tokens_sha256"] == stream[p["text_mb"]]["tokens_sha256"] for p in report["points"]
            if p["impl"] == "in_memory" and "tokens_sha256" in p and p["text_mb"] in stream]
    out["same_tokens_as_in_memory"] = all(same) if same else None
    return out


def render(path):
    """The docs' table: one row per corpus size, the two ways side by side."""
    from bench.machine import caption

    with open(os.path.join(ROOT, path)) as f:
        report = json.load(f)
    rows = ["| text | streaming: MB/s (per CPU-s) | streaming: peak RSS | in memory: MB/s (per CPU-s) | "
            "in memory: peak RSS |", "|---:|---:|---:|---:|---:|"]
    for mb in sorted({p["text_mb"] for p in report["points"]}):
        cells = [f"{mb:,} MB"]
        for impl in ("streaming", "in_memory"):
            p = next((q for q in report["points"] if q["impl"] == impl and q["text_mb"] == mb), None)
            if p is None:
                cells += ["not run", "not run"]
            elif "skipped" in p:
                cells += ["skipped", f"would need {p['skipped'].split('(')[0].replace('needs about ', '').strip()}"]
            else:
                cells += [f"{p['mb_per_s']:.2f} ({p['mb_per_cpu_s']:.2f})", f"{p['peak_rss'] / 2**20:,.0f} MiB"]
        rows.append("| " + " | ".join(cells) + " |")
    base = [p["rss_after_imports"] for p in report["points"] if p["impl"] == "streaming" and "rss_after_imports" in p]
    checks = report.get("checks", {})
    lines = rows + [""]
    if base:
        lines.append(f"Peak RSS is the whole process's, torch and the tokenizer included ({min(base) / 2**20:,.0f} MiB "
                     f"after the imports). Streaming peak relative to the smallest corpus: "
                     + ", ".join(f"{int(k):,} MB {v:.2f}x" for k, v in checks.get("peak_ratio_to_smallest", {}).items())
                     + "; the same tokens as the in-memory way: "
                       f"{'yes' if checks.get('same_tokens_as_in_memory') else 'not compared'}.")
    if report.get("note"):
        lines.append(report["note"][0].upper() + report["note"][1:] + ".")
    if checks.get("flat_memory") is False:
        worst = max(checks["peak_ratio_to_smallest"].items(), key=lambda kv: kv[1])
        lines.append(f"Not yet flat everywhere: at {int(worst[0]):,} MB the streaming peak is {worst[1]:.2f}x the "
                     f"smallest corpus's, above the {MAX_PEAK_RATIO:.2f}x target. What a batch holds does not grow "
                     "with the corpus (8 chunks of 1 MiB and their tokens); the slow growth on top of it is not "
                     "explained yet.")
    lines.append(caption(report["machine"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
