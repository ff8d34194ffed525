"""Transcripts of real runs of train.py, rendered into the docs like a figure block:

    <!-- figures: docs.transcripts.render interrupt -->
    ...the commands and what they printed...
    <!-- /figures -->

Each scenario below is a few commands of train.py at a tiny shape (seconds each), run in a fresh
folder with --out-dir OUT. A command may be cut short as the page says: INT@N / TERM@N send the process
SIGINT (a terminal's Ctrl-C) or SIGTERM once N updates are done; BYHAND_CRASH_AT (a fault point of
lib/checkpoint.fault_point) kills it with SIGKILL in the middle of a save. Of what it printed, the lines
about the run contract and the step lines are kept (less their rate, memory and ETA); '...' marks the
others. Paths are OUT: the commands run in the scenario's folder.

All five cost minutes on a busy 2-core CPU, so the rendering is cached in bench/results/transcripts.json
with the sha256 of the code it depends on (CODE); when that code changes, the scenario runs again, and
`python docs/render.py` keeps the new run. Each scenario runs in a process of its own (run), which forks
one child per command after train is imported (one torch start-up); torchrun commands are subprocesses.
"""

import ast
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, "bench", "results", "transcripts.json")
CODE = ("train.py", "lib/*.py", "docs/transcripts.py")
TINY = "--n-layer 2 --n-embd 64 --block-size 32 --eval-batches 2 --sample-tokens 0 --log-interval 1"
SET = f'TINY="{TINY}"'  # the first line of every transcript: $TINY in its commands is these flags
FLAT = "--warmup-steps 0 --min-lr-ratio 1"  # a constant learning rate: 2 processes then 1 is the unbroken run
RUN = "python train.py $TINY --steps 6"

# name: [(command, how it is cut short or None)]
SCENARIOS = {
    "interrupt": [(f"{RUN} --out-dir OUT", "INT@3"), ("python train.py --resume --out-dir OUT", None)],
    "kill_in_save": [(f"BYHAND_CRASH_AT='commit step-000004' {RUN} --save-interval 2 --out-dir OUT", None),
                     (f"{RUN} --save-interval 2 --out-dir OUT --auto-resume", None)],
    "auto_resume": [("python train.py $TINY --steps 2 --out-dir OUT --auto-resume", None),
                    ("python train.py $TINY --steps 2 --out-dir OUT --auto-resume", None),
                    ("python train.py $TINY --steps 2 --out-dir OUT --auto-resume --n-embd 128", None)],
    "sigterm": [(f"{RUN} --out-dir OUT", "TERM@4"), (f"{RUN} --out-dir OUT --auto-resume", None)],
    "elastic": [(f"torchrun --standalone --nproc_per_node=2 train.py $TINY {FLAT} --steps 3 --out-dir OUT", None),
                ("torchrun --standalone --nproc_per_node=1 train.py --resume --steps 6 --out-dir OUT", None)],
}
KEEP = re.compile(r"^(step +\d+/|saved |--resume|--auto-resume|OUT: |interrupted|terminated|error:|\^C|\[exit)")
CUT = re.compile(r"^(step +\d+/\d+ \| loss [\d.]+) \|.*$")  # a step line less its rate, memory and ETA


def code_hash() -> str:
    """sha256 of what the code does: each file's syntax tree without its docstrings, so that a comment, a
    docstring or a line wrapped differently keeps the cache."""
    h = hashlib.sha256()
    for path in sorted(p for pattern in CODE for p in glob.glob(os.path.join(ROOT, pattern))):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        h.update(os.path.relpath(path, ROOT).encode() + b"\0" + ast.dump(tree).encode())
    return h.hexdigest()


def fork_run(argv, env, cut, log_path):
    """train.main(argv) in a forked child whose stdout and stderr go to log_path; returns its exit status."""
    import train
    from lib import rundir
    pid = os.fork()
    if pid == 0:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.update(env)
        if cut and "@" in cut:
            what, n = cut.split("@")
            real = rundir.Updates.record

            def record(self, step, skipped):
                real(self, step, skipped)
                if step + 1 == int(n):
                    if what == "INT":
                        print("^C")
                    os.kill(os.getpid(), signal.SIGINT if what == "INT" else signal.SIGTERM)
            rundir.Updates.record = record
        code = 0
        try:
            train.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run(name) -> str:
    """Run one scenario now, in a process of its own (it forks: the caller may have started threads)."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), name], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"transcript {name} failed: {proc.stderr[-2000:]}")
    return proc.stdout.strip("\n")


def run_here(name) -> str:
    """Run one scenario in a fresh folder; returns the transcript (commands and kept output)."""
    sys.path.insert(0, ROOT)
    shown = [f"$ {SET}"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            for command, cut in SCENARIOS[name]:
                env = dict(re.findall(r"(\w+)='([^']*)'", command))  # NAME='value' before the command
                words = re.sub(r"\w+='[^']*' ", "", command).replace("$TINY", TINY).split()
                log = os.path.join(tmp, "log")
                open(log, "w").close()
                if words[0] == "torchrun":
                    argv = [os.path.join(ROOT, w) if w == "train.py" else w for w in words[1:]]
                    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *argv], capture_output=True,
                                          text=True, timeout=300, env={**os.environ, **env})
                    out, code = proc.stdout + proc.stderr, proc.returncode
                else:
                    code = fork_run(words[2:], env, cut, log)
                    out = open(log).read()
                shown.append(f"$ {command}")
                shown += tidy(out)
                shown.append("[killed by SIGKILL]" if code == -9 else f"[exit status {code}]")
        finally:
            os.chdir(cwd)
    return "```\n" + "\n".join(shown) + "\n```"


def tidy(out: str) -> list:
    """The lines a reader needs, with '...' where others were left out, the machine's numbers cut."""
    lines, gap = [], False
    for line in out.splitlines():
        line = line.rstrip()
        if not KEEP.match(line):
            gap = True
            continue
        if gap and lines[-1:] != ["..."]:
            lines.append("...")
        gap = False
        lines.append(CUT.sub(r"\1 | ...", line))
    if gap:
        lines.append("...")
    return lines


def stable(text: str) -> str:
    """What a run on any machine prints alike: the transcript less its loss values."""
    return re.sub(r"loss [\d.]+", "loss X", text)


_cache, _fresh = None, {}


def render(name) -> str:
    """The transcript of one scenario: from the cache while the code it ran is unchanged, else run now (a
    fresh run that prints what the cache holds, losses aside, keeps the cached text)."""
    global _cache
    if _cache is None:
        _cache = json.load(open(CACHE)) if os.path.exists(CACHE) else {"code": None, "transcripts": {}}
    cached, code = _cache["transcripts"].get(name), code_hash()  # the code as it is before the run
    if cached is not None and _cache["code"] == code:
        return cached
    _fresh.setdefault("code", code)
    text = run(name)
    if cached is not None and stable(cached) == stable(text):
        text = cached
    _fresh[name] = text
    return text


def write_cache():
    """docs/render.py: keep what ran now, with the hash of the code it ran."""
    if not _fresh:
        return
    from bench import machine
    code = _fresh.pop("code")
    transcripts = {**(_cache or {}).get("transcripts", {}), **_fresh}
    if code != code_hash() or set(transcripts) - set(_fresh):  # the code changed meanwhile, or some did not run
        return
    with open(CACHE, "w", encoding="utf-8") as f:
        json.dump({"code": code, "machine": machine.describe(quiet=False), "transcripts": transcripts}, f,
                  indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    print(run_here(sys.argv[1]))
