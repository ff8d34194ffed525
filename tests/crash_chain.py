"""Kill a training script again and again in one output directory, and let --auto-resume carry it on.

    python tests/crash_chain.py SCRIPT OUT_FLAG REF OUT PLAN -- ARGV...
    torchrun --max-restarts N ... tests/crash_chain.py --torchrun SCRIPT PLAN -- ARGV...

Used by tests/test_faults.py (not a test itself). First SCRIPT runs once, unbroken, into REF. Then it runs
into OUT once per entry of PLAN (comma-separated), always with --auto-resume, as torchrun --max-restarts or
a requeued job would start it, and each of these runs is cut short:
  - a fault point of lib/checkpoint.fault_point (a number, or a name such as "rename training_state.pt"):
    the process is killed with SIGKILL there, in the middle of a save;
  - TERM@N: the process sends itself SIGTERM once N updates are done, as a scheduler would.
A last run without a fault finishes the run. One JSON line reports each run's exit status (-9: killed by
SIGKILL, 143: SIGTERM handled, 0: finished).

Under torchrun (--torchrun), torchrun's own restarts make the chain: each launch of the group takes the
entry of PLAN numbered by TORCHELASTIC_RESTART_COUNT: TERM@N (every rank gets SIGTERM after N updates),
KILL@N:R (rank R is killed with SIGKILL after N updates), a fault point (rank 0 is killed there), or
nothing (an empty entry, or past the end of PLAN).

Outside torchrun, every run is a new process, forked from this one after SCRIPT is imported, so that a chain of a dozen
crashes costs a dozen tiny runs, not a dozen Python and torch start-ups. This process itself never
computes anything (a fork after OpenMP has started its threads would not be safe).
"""

import importlib
import json
import os
import signal
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)


def arm(fault, rank=0):
    """Make rundir.Updates.record (called after every optimizer update) send the signal of fault."""
    from lib import rundir

    what, _, where = fault.partition("@")
    stop_at, _, who = where.partition(":")
    if what not in ("TERM", "KILL") or (who and int(who) != rank):
        return
    real = rundir.Updates.record

    def record(self, step, skipped):
        real(self, step, skipped)
        if step + 1 == int(stop_at):
            os.kill(os.getpid(), signal.SIGTERM if what == "TERM" else signal.SIGKILL)

    rundir.Updates.record = record


def run_once(module, argv, fault):
    """Fork; the child runs module.main(argv) with the fault armed. Returns the child's exit status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if fault and "@" in fault:
                arm(fault)
            elif fault:
                os.environ["BYHAND_CRASH_AT"] = fault
            module.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main():
    if sys.argv[1] == "--torchrun":
        script, plan = sys.argv[2:4]
        entries = plan.split(",")
        launch = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        fault = entries[launch] if launch < len(entries) else ""
        if "@" in fault:
            arm(fault, int(os.environ["RANK"]))
        elif fault:
            os.environ["BYHAND_CRASH_AT"] = fault  # lib/checkpoint.fault_point kills rank 0 there
        importlib.import_module(script).main(sys.argv[sys.argv.index("--") + 1:])
        return
    script, out_flag, ref, out, plan = sys.argv[1:6]
    argv = sys.argv[sys.argv.index("--") + 1:]
    module = importlib.import_module(script)
    report = {"unbroken": run_once(module, [*argv, out_flag, ref], None), "faults": []}
    for fault in [f for f in plan.split(",") if f]:
        report["faults"].append([fault, run_once(module, [*argv, out_flag, out, "--auto-resume"], fault)])
    report["last"] = run_once(module, [*argv, out_flag, out, "--auto-resume"], None)
    print("CHAIN " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
