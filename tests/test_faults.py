"""Runs that survive faults (lib/rundir.commit, docs/crash_safe_checkpoints.md), tried for real.

Every crash here is a real process that dies by SIGKILL at a fault point of a save (lib/checkpoint.
fault_point: each write and each rename, the commit's link, rename and prune), or by a signal after an
update; nothing of the file system is mocked. After the faults, the run goes on with --auto-resume, the
command line torchrun's restarts use, and must end where a run never stopped ends: the same weights, bit
for bit on CPU, and the same final loss.

- a chain of crashes at every point of a save of train.py (tests/crash_chain.py: each run a forked
  process, so a dozen crashes cost a dozen tiny runs, not a dozen torch start-ups), and SIGTERM;
- the same for the other scripts that save, at the points where their saves differ;
- torchrun --max-restarts with --auto-resume, 2 ranks: SIGTERM to every rank, a worker killed with
  SIGKILL, and for train_fsdp.py crashes inside the sharded save (a DCP folder half-written);
- --auto-resume on an empty folder, a finished run, contradicting flags; a damaged newest checkpoint
  skipped for the previous one; --keep-last.

The child processes of the first three kinds run two at a time (the fixture `runs`), each test checking its own.
"""

import concurrent.futures
import glob
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, TINY, read_metrics, torchrun
from tests.test_run_contract import CASES, snapshot

# Dropout on, so that a resume that did not restore the random state would differ.
GPT = [*TINY, "--steps", "4", "--eval-interval", "100", "--dropout", "0.1"]


def chain(script, out_flag, ref, out, plan, argv, timeout=300):
    """tests/crash_chain.py: an unbroken run into ref, then one run into out per fault of plan, then a last
    one, all with --auto-resume. Returns its report (the exit status of every run; None if it printed none)
    and its output."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "crash_chain.py"), script, out_flag, str(ref),
                           str(out), ",".join(plan), "--", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = re.search(r"^CHAIN (.*)$", proc.stdout, re.M)
    return (json.loads(found.group(1)) if found else None), proc.stdout + proc.stderr


def assert_same_weights(a, b, names):
    for name in names:
        x, y = load_file(os.path.join(a, name)), load_file(os.path.join(b, name))
        assert sorted(x) == sorted(y), name
        for key in x:
            assert torch.equal(x[key], y[key]), f"{name}:{key} differs from the unbroken run"


def final_event(out):
    return [r for r in read_metrics(out) if r.get("event") == "end"][-1]


def assert_one_checkpoint_and_nothing_left_over(out):
    """Disk stays bounded: one complete checkpoint (--keep-last 1), no staging folder or temporary file."""
    assert len(os.listdir(os.path.join(out, "checkpoints"))) == 1, os.listdir(os.path.join(out, "checkpoints"))
    left = [p for p in glob.glob(os.path.join(out, "**", "*"), recursive=True) if ".tmp" in os.path.basename(p)]
    assert not left, left


# --- the subprocess runs, two at a time -------------------------------------------------------------------------
# Every test below but the last two checks child processes: a crash chain (one process at a time, one thread) or
# torchrun's group. The fixture `runs` starts the runs of every selected test, two at a time on a machine of two
# cores, and each test checks its own. No run depends on another: each writes in its own folder, the shared token
# cache is written under a private temporary name and renamed (lib/data.prepare), and only the judge's chain
# builds the judge's demo base.
def run_selected(request, jobs):
    """jobs: {(test, parameter "name" or None): (function, args)}, the longest first. Those of the selected
    tests run two at a time; returns {(test, name): what the function returned, or the exception it raised}."""
    selected = {(item.originalname, item.callspec.params.get("name") if hasattr(item, "callspec") else None)
                for item in request.session.items if item.module is request.module}

    def one(fn, args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 -- raised again by the test that owns the run
            return e

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(one, fn, args) for key, (fn, args) in jobs.items() if key in selected}
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(scope="module")
def runs(request, text_dir, tmp_path_factory):
    def job(fn, test, name):
        return (test, name), (fn, (name, text_dir, tmp_path_factory.mktemp(f"{fn.__name__}-{name}")))
    other = "test_other_scripts_crash_where_their_saves_differ"
    restarts = "test_torchrun_restarts_with_auto_resume"
    # A torchrun group beside a one-thread chain; the short chains last.
    return run_selected(request, dict([
        job(torchrun_restarts, restarts, "train_fsdp"),
        job(every_point_chain, "test_train_crash_at_every_point_of_a_save", None),
        job(torchrun_restarts, restarts, "train"),
        *[job(other_chain, other, name) for name in ("judge_train_mps", "train_splade_unified", "finetune_lora",
                                                     "train_wpo_sgm_memory_efficient")]]))


def result_of(runs, test, name=None):
    """What the test's runs returned (their folder first); an error they raised is raised here."""
    result = runs[test, name]
    if isinstance(result, Exception):
        raise result
    return result


# --- train.py: every point of a save ---------------------------------------------------------------------
# The points of one save of train.py, in order (BYHAND_FAULT_LOG lists them): three atomic writes (write the
# temporary file, rename it into place), then the commit (link the files into the staging folder, rename it:
# the commit point, prune the older checkpoint).
TRAIN_POINTS = ["write model.safetensors", "rename model.safetensors", "write config.json", "rename config.json",
                "write training_state.pt", "rename training_state.pt", "link step-", "commit step-", "prune step-"]


def every_point_chain(_, text_dir, tmp):
    return tmp, chain("train", "--out-dir", tmp / "unbroken", tmp / "run",
                      ["rename training_state.pt", "TERM@1", *TRAIN_POINTS],
                      [*GPT, "--save-interval", "1", "--data", text_dir])


def test_train_crash_at_every_point_of_a_save(runs):
    """A save every step. The first run is killed in its first save, when nothing is committed yet:
    --auto-resume then starts afresh. The next gets SIGTERM after its first update: it saves and exits 143.
    Each later run resumes and is killed at the next point of its first save, where the top of OUT already
    holds some files of the new save beside the old ones (a crash between two renames). The last run
    finishes: its weights and final loss are those of the unbroken run (every_point_chain)."""
    tmp_path, (report, log) = result_of(runs, "test_train_crash_at_every_point_of_a_save")
    assert report, log[-4000:]
    assert report["unbroken"] == 0 and report["last"] == 0, log[-4000:]
    assert [code for _, code in report["faults"]] == [-9, 143] + [-9] * len(TRAIN_POINTS), (report, log[-4000:])
    assert "holds no saved run; starting a new one" in log and "terminated (SIGTERM): saved step 1" in log
    assert log.count("resuming from step 1") == len(TRAIN_POINTS)  # every crash before the commit kept step 1
    assert_same_weights(tmp_path / "run", tmp_path / "unbroken", ["model.safetensors"])
    assert final_event(tmp_path / "run")["val_loss"] == final_event(tmp_path / "unbroken")["val_loss"]
    assert_one_checkpoint_and_nothing_left_over(tmp_path / "run")


# --- the other scripts: where their saves differ --------------------------------------------------------------
# Each chain starts with SIGTERM after 2 of the run's 4 updates (the save of step 2, exit 143); every later run
# resumes from it and is killed inside the final save, at the points named (the first such point of the run).
OTHER = {
    # The training state is written first, then the adapter: a crash between them leaves a new state beside
    # an old adapter at the top of OUT (a commit misplaced before the adapter would make that pair a checkpoint).
    "finetune_lora": ["rename training_state.pt", "rename adapter_model.safetensors"],
    # Six model files (weights, config, tokenizer) before the state.
    "train_splade_unified": ["rename model.safetensors", "rename tokenizer.json", "rename training_state.pt"],
    # The best adapter is saved at a validation, apart from the state: a crash there, and in the state's save.
    "judge_train_mps": ["rename adapter_model.safetensors", "rename training_state.pt"],
    "train_wpo_sgm_memory_efficient": ["rename model.safetensors", "rename training_state.pt"],
}
# (The commit's own points, link, rename and prune, are the same code in every script: train.py's sweep
# above covers them.)


def other_chain(name, text_dir, tmp):
    case = CASES[name]
    os.makedirs(tmp / "data")
    data = case.make_data(tmp / "data", text_dir) if case.make_data else []
    return tmp, chain(name, case.out_flag, tmp / "unbroken", tmp / "run", ["TERM@2", *OTHER[name]],
                      [*case.args, *data])


@pytest.mark.parametrize("name", sorted(OTHER))
def test_other_scripts_crash_where_their_saves_differ(name, runs):
    tmp, (report, log) = result_of(runs, "test_other_scripts_crash_where_their_saves_differ", name)
    assert report, log[-4000:]
    assert report["unbroken"] == 0 and report["last"] == 0, log[-4000:]
    assert [code for _, code in report["faults"]] == [143] + [-9] * len(OTHER[name]), (report, log[-4000:])
    assert "terminated (SIGTERM): saved step 2" in log
    assert_same_weights(tmp / "run", tmp / "unbroken", CASES[name].weights)
    assert_one_checkpoint_and_nothing_left_over(tmp / "run")


# --- torchrun --max-restarts, 2 ranks ----------------------------------------------------------------------------
RESTARTS = {
    # Every rank gets SIGTERM after update 2 (the ranks agree, save step 2 and exit 143); in the next launch
    # rank 1 is killed with SIGKILL after update 3.
    "train": ["TERM@2", "KILL@3:1"],
    # Rank 0 killed in the second save after writing its shard but before its RNG file (the DCP folder
    # half-written, still step-000002.tmp); then killed between latest.json's write and its rename. (A third
    # launch, rank 1 killed with SIGKILL after update 3, was merged into train's: the same torchrun restart,
    # and train_fsdp.py's resume from its sharded checkpoint is what the two faults before it already reach.)
    "train_fsdp": ["10", "rename latest.json"],
}


def torchrun_restarts(name, text_dir, tmp):
    """An unbroken 2-rank run, then the same command line under torchrun --max-restarts with the faults of
    RESTARTS[name], with --auto-resume."""
    argv = [*GPT, "--save-interval", "1" if name == "train_fsdp" else "2", "--data", text_dir]
    plan = RESTARTS[name]
    unbroken = torchrun([f"{name}.py", *argv, "--out-dir", str(tmp / "unbroken")])
    if unbroken.returncode:
        return tmp, unbroken, None
    return tmp, unbroken, torchrun([f"--max-restarts={len(plan)}", os.path.join("tests", "crash_chain.py"),
                                    "--torchrun", name, ",".join(plan), "--", *argv, "--out-dir", str(tmp / "run"),
                                    "--auto-resume"], timeout=400)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RESTARTS))
def test_torchrun_restarts_with_auto_resume(name, runs):
    """One command line, under torchrun --max-restarts: the group is started again after each fault and goes
    on from the newest complete checkpoint; torchrun exits 0 with the weights of an unbroken 2-rank run."""
    tmp_path, unbroken, proc = result_of(runs, "test_torchrun_restarts_with_auto_resume", name)
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert log.count("--auto-resume: continuing the run saved") == len(RESTARTS[name]), log[-4000:]
    if name == "train":
        assert "terminated (SIGTERM): saved step 2" in log and "exitcode: 143" in log
    assert_same_weights(tmp_path / "run", tmp_path / "unbroken", ["model.safetensors"])
    assert final_event(tmp_path / "run")["val_loss"] == final_event(tmp_path / "unbroken")["val_loss"]
    assert_one_checkpoint_and_nothing_left_over(tmp_path / "run")


# --- --auto-resume, --keep-last, a damaged checkpoint (in-process, train.py) --------------------------------------
def train(out, *argv):
    """train.main in this process; returns its exit code (0 when it returned)."""
    import train as script

    try:
        script.main([*argv, "--out-dir", str(out)])
        return 0
    except SystemExit as e:
        return e.code
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # rundir.begin's handler would stay behind in pytest


def test_auto_resume_starts_continues_finishes_and_refuses(text_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, *TINY, "--steps", "3", "--save-interval", "1", "--keep-last", "2", "--data", text_dir,
                 "--auto-resume") == 0
    assert "holds no saved run; starting a new one" in capsys.readouterr().out
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000002", "step-000003"]  # --keep-last 2
    # Finished: says so, exits 0.
    assert train(out, "--auto-resume") == 0
    said = capsys.readouterr().out
    assert "continuing the run saved" in said and "already ran its --steps 3" in said
    # Contradicting flags: one line, exit 2, nothing changed; --overwrite with it is refused too.
    before = snapshot(out)
    for bad in (["--n-embd", "32"], ["--seed", "7"], ["--overwrite"]):
        assert train(out, "--auto-resume", *bad) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (bad, err)
        assert snapshot(out) == before, bad


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(text_dir, tmp_path, capsys):
    """Two checkpoints kept; the newest one's training state torn. --resume says so in one line, resumes the
    previous one (and puts its files back at the top of OUT), and reaches the unbroken run's weights."""
    flags = [*TINY, "--steps", "4", "--save-interval", "1", "--keep-last", "2", "--dropout", "0.1", "--data", text_dir]
    for out in (tmp_path / "unbroken", tmp_path / "run"):
        assert train(out, *flags) == 0
    newest = tmp_path / "run" / "checkpoints" / "step-000004" / "training_state.pt"
    whole = newest.read_bytes()
    os.remove(newest)  # not in place: the top of OUT keeps its own (linked) copy whole...
    newest.write_bytes(whole[: len(whole) // 3])
    os.remove(tmp_path / "run" / "model.safetensors")  # ...and the top is missing a file
    capsys.readouterr()
    assert train(tmp_path / "run", "--resume") == 0
    said = capsys.readouterr().out
    assert said.count("skipping the checkpoint") == 1 and "step-000004" in said and "resuming from step 3" in said
    assert_same_weights(tmp_path / "run", tmp_path / "unbroken", ["model.safetensors"])
