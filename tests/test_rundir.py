"""lib/rundir.py: the run contract, on a toy script with a two-file saved run (no model, no data)."""

import argparse
import json
import os
import signal
import threading

import pytest
import torch
from safetensors.torch import save_file

from lib import rundir
from lib.errors import UserError

SPEC = rundir.Spec(saved={"model.safetensors": "safetensors", "config.json": "json", "training_state.pt": "state",
                          "best.json": "json"},
                   optional=("best.json",), written=("metrics.jsonl", "samples"), same_step=("model.safetensors",),
                   fixed=("width", "train_file", "seed"), changeable=("steps", "lr"), data=("train_file",))


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--train-file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--out-dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--auto-resume", action="store_true")
    p.add_argument("--keep-last", type=int, default=1)
    return p


def prepare(argv, log=None):
    p = parser()
    args = p.parse_args(argv)
    messages = []
    run = rundir.prepare(args, p, argv, SPEC, log=log or messages.append)
    return run, args, messages


def save_run(out, train_file, step=3, **flags):
    """What a toy script writes: weights with their step, a config, the training state."""
    run, args, _ = prepare(["--out-dir", str(out), "--train-file", str(train_file),
                            *[f"--{k}={v}" for k, v in flags.items()]])
    log = rundir.begin(run, args)
    log.log(step=0, loss=1.0)
    save_file({"w": torch.ones(2)}, str(out / "model.safetensors"), metadata={"step": str(step)})
    (out / "config.json").write_text(json.dumps({"width": args.width}))
    os.makedirs(out / "samples", exist_ok=True)
    rundir.save_state(run, args, {"step": step})
    return args


def snapshot(d):
    return {os.path.relpath(os.path.join(r, n), d): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(d) for n in names}


@pytest.fixture
def saved(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"x": 1}\n{"x": 2}\n')
    out = tmp_path / "run"
    save_run(out, data, width=16, lr=0.5)
    return out, data


def test_fresh_run_into_a_saved_run_is_refused_and_overwrite_clears_only_at_begin(saved, tmp_path):
    out, data = saved
    before = snapshot(out)
    with pytest.raises(UserError,
                       match=r"already holds a saved run \(model.safetensors, config.json, training_state.pt\)"):
        prepare(["--out-dir", str(out), "--train-file", str(data)])
    run, args, _ = prepare(["--out-dir", str(out), "--train-file", str(data), "--overwrite"])
    assert snapshot(out) == before  # every check passed, but nothing is removed before the first write
    (out / "notes.txt").write_text("mine")  # not the run's: --overwrite must leave it alone
    rundir.begin(run, args)
    assert sorted(os.listdir(out)) == ["checkpoints", "notes.txt"] and os.listdir(out / "checkpoints") == []


def test_resume_and_overwrite_together_are_refused(saved):
    out, data = saved
    with pytest.raises(UserError, match="pass one of them"):
        prepare(["--out-dir", str(out), "--resume", "--overwrite"])


def test_resume_takes_the_saved_flags_refuses_contradictions_reports_changes(saved):
    out, data = saved
    run, args, messages = prepare(["--out-dir", str(out), "--resume"])
    assert (args.width, args.lr, args.train_file, args.steps) == (16, 0.5, str(data), 10) and run.state["step"] == 3
    assert messages == []
    run, args, messages = prepare(["--out-dir", str(out), "--resume", "--lr", "0.25", "--width", "16"])
    assert args.lr == 0.25 and messages == ["--resume: --lr changed from 0.5 to 0.25"]
    with pytest.raises(UserError, match=r"--width 32 contradicts the saved run \(--width 16\)"):
        prepare(["--out-dir", str(out), "--resume", "--width", "32"])
    # Named on the command line, even at its default, and not the saved value: refused too.
    with pytest.raises(UserError, match=r"--width 8 contradicts the saved run \(--width 16\)"):
        prepare(["--out-dir", str(out), "--resume", "--width=8"])


def test_a_moved_data_file_is_accepted_when_its_contents_are_the_same(saved, tmp_path):
    out, data = saved
    moved = tmp_path / "elsewhere.jsonl"
    os.rename(data, moved)
    with pytest.raises(UserError, match="no longer exists; if it moved, pass its new path with --train-file"):
        prepare(["--out-dir", str(out), "--resume"])
    run, args, messages = prepare(["--out-dir", str(out), "--resume", "--train-file", str(moved)])
    assert args.train_file == str(moved) and "moved" in messages[0]
    moved.write_text('{"x": 1}\n{"x": 3}\n')  # same size, other contents
    with pytest.raises(UserError, match=r"contradicts the saved run .*\(the contents differ\)"):
        prepare(["--out-dir", str(out), "--resume", "--train-file", str(moved)])


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "training_state.pt", "best.json"])
def test_each_damaged_saved_file_is_one_line_and_nothing_is_written(saved, name):
    out, data = saved
    if name == "best.json":  # a file written after the save: a second commit of the same step takes it
        (out / name).write_text('{"step": 2}')
        rundir.commit(rundir.Run(str(out), SPEC), argparse.Namespace(keep_last=1), 3)
    # The checkpoint's file: the same file as the one at the top of OUT (a hard link), so damaged in both.
    path = out / "checkpoints" / ("step-000003.2" if name == "best.json" else "step-000003") / name
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    before = snapshot(out)
    with pytest.raises(UserError) as e:
        prepare(["--out-dir", str(out), "--resume"])
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert snapshot(out) == before


def test_missing_and_mismatched_files(saved):
    out, data = saved
    ck = out / "checkpoints" / "step-000003"  # the checkpoint --resume reads (the top of OUT is put back from it)
    os.remove(ck / "model.safetensors")
    save_file({"w": torch.ones(2)}, str(ck / "model.safetensors"), metadata={"step": "2"})
    with pytest.raises(UserError, match="from step 2 but .* from step 3; the save was interrupted"):
        prepare(["--out-dir", str(out), "--resume"])
    os.remove(ck / "model.safetensors")
    with pytest.raises(UserError, match="model.safetensors is missing"):
        prepare(["--out-dir", str(out), "--resume"])
    os.remove(ck / "training_state.pt")
    with pytest.raises(UserError, match="training_state.pt does not exist; run without --resume first"):
        prepare(["--out-dir", str(out), "--resume"])


def test_a_foreign_pickle_is_refused_without_running_it(saved, tmp_path):
    out, data = saved

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"args": "{}", "x": Evil()}, out / "training_state.pt")
    with pytest.raises(UserError, match="training_state.pt is damaged"):
        prepare(["--out-dir", str(out), "--resume"])
    assert not (tmp_path / "pwned").exists()


def test_updates_stop_after_ten_skipped_in_a_row_and_a_run_without_updates_fails():
    updates = rundir.Updates("OUT", last_saved=4)
    for step in range(9):
        updates.record(step, skipped=True)
    updates.record(9, skipped=False)  # one good update resets the count
    for step in range(10, 19):
        updates.record(step, skipped=True)
    with pytest.raises(UserError,
                       match=r"not finite for 10 steps in a row \(steps 10 to 19\).*last finite checkpoint is step 4"):
        updates.record(19, skipped=True)
    updates.finish()  # one update was applied
    nothing = rundir.Updates("OUT")
    for step in range(3):
        nothing.record(step, skipped=True)
    with pytest.raises(UserError, match="no update was applied: all 3 were skipped"):
        nothing.finish()
    rundir.Updates("OUT").finish()  # --steps 0: nothing tried, nothing to report
    with pytest.raises(UserError, match="the loss became nan at step 5; stopped before the update"):
        nothing.check_loss(5, float("nan"))


def test_save_on_interrupt_saves_prints_and_exits_130(capsys):
    calls = []
    with pytest.raises(SystemExit) as e:
        rundir.save_on_interrupt(lambda: calls.append("saved"), 7, "OUT")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    assert e.value.code == 130 and calls == ["saved"]
    assert "interrupted: saved step 7 to OUT; continue with --resume" in capsys.readouterr().err


def test_a_sigterm_is_forgotten_once_saved_so_a_later_ctrl_c_in_the_same_process_exits_130(capsys):
    """A SIGTERM's save reads the stop signal once; a later run in the same process (a test, a notebook) that is
    stopped by Ctrl-C exits 130, not 143."""
    from lib import distributed
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rundir.catch_sigterm()
        with pytest.raises(SystemExit) as e:
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # raises Terminated here, recording SIGTERM
            except KeyboardInterrupt:
                rundir.save_on_interrupt(lambda: None, 3, "OUT")
        assert e.value.code == 143 and distributed.STOP["signal"] is None
        with pytest.raises(SystemExit) as e:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                rundir.save_on_interrupt(lambda: None, 4, "OUT")
        assert e.value.code == 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert "terminated (SIGTERM)" in capsys.readouterr().err


def test_whole_update_holds_a_signal_until_the_block_ends_and_then_delivers_it():
    done = []
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C inside: the block runs to its end, then the interrupt comes
        with rundir.whole_update():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("rest of the update")
        done.append("after the block")
    assert done == ["rest of the update"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler it found is back
    flags = []  # a flag handler (distributed.catch_ctrl_c's, under torchrun) just gets the signal, late
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: flags.append(signum))
    try:
        with rundir.whole_update():
            os.kill(os.getpid(), signal.SIGTERM)
            assert flags == []
        assert flags == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
    found = []  # outside the main thread no handler can be set (signal.signal raises): the block simply runs

    def in_a_thread():
        with rundir.whole_update():
            found.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert found == [signal.default_int_handler]


def test_fingerprint_of_a_directory_covers_names_and_bytes(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "x.txt").write_text("hello")
    first = rundir.fingerprint(str(a))
    (a / "x.txt").rename(a / "y.txt")
    assert rundir.fingerprint(str(a)) != first
    assert rundir.fingerprint("stdlib") is None


def test_auto_resume_starts_continues_and_never_takes_an_uncommitted_save(saved, tmp_path):
    out, data = saved
    run, args, messages = prepare(["--out-dir", str(out), "--auto-resume"])
    assert run.resumed and args.resume and args.width == 16 and "continuing the run saved" in messages[0]
    with pytest.raises(UserError, match="--auto-resume continues .* --overwrite replaces it"):
        prepare(["--out-dir", str(out), "--auto-resume", "--overwrite"])
    with pytest.raises(UserError, match="--width 32 contradicts the saved run"):
        prepare(["--out-dir", str(out), "--auto-resume", "--width", "32"])
    # A first save cut short: files at the top, nothing committed. Not a saved run: a new one replaces them.
    fresh = tmp_path / "fresh"
    run, args, messages = prepare(["--out-dir", str(fresh), "--train-file", str(data), "--auto-resume"])
    assert not run.resumed and "holds no saved run; starting a new one" in messages[0]
    rundir.begin(run, args)
    save_file({"w": torch.ones(2)}, str(fresh / "model.safetensors"), metadata={"step": "1"})
    run, args, messages = prepare(["--out-dir", str(fresh), "--train-file", str(data), "--auto-resume"])
    assert not run.resumed and "model.safetensors at the top are in no commit" in messages[-1]
    # --resume agrees: only a commit counts. It refuses, in one line, and removes nothing.
    with pytest.raises(UserError, match=r"holds no committed checkpoint \(model.safetensors at the top are in no "
                                        r"commit: a first save cut short\); start again with --auto-resume"):
        prepare(["--out-dir", str(fresh), "--resume"])
    assert sorted(os.listdir(fresh)) == ["checkpoints", "model.safetensors"]
    rundir.begin(run, args)
    assert os.listdir(fresh) == ["checkpoints"]  # the uncommitted weights are gone


@pytest.mark.parametrize("flag", ["--resume", "--auto-resume"])
def test_a_file_put_back_at_the_top_is_said_in_one_line(saved, flag):
    out, data = saved
    state = (out / "training_state.pt").read_bytes()
    os.remove(out / "training_state.pt")  # a new name: the checkpoint's link keeps the old bytes whole
    (out / "training_state.pt").write_bytes(state[: len(state) // 2])
    os.remove(out / "config.json")
    os.remove(out / "model.safetensors")
    save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"), metadata={"step": "3"})
    run, args, messages = prepare(["--out-dir", str(out), flag])
    where = f"at the top of {out} was"
    assert [m for m in messages if "put back" in m] == [
        f"--resume: config.json {where} missing; put back from checkpoints/step-000003",
        f"--resume: model.safetensors {where} replaced; put back from checkpoints/step-000003",
        f"--resume: training_state.pt {where} truncated; put back from checkpoints/step-000003"]
    for name in ("config.json", "model.safetensors", "training_state.pt"):
        assert os.path.samefile(out / name, out / "checkpoints" / "step-000003" / name)
    _, _, messages = prepare(["--out-dir", str(out), flag])
    assert not [m for m in messages if "put back" in m]  # nothing to repair: nothing said
    os.remove(out / "config.json")  # a copy of the same bytes (a run folder copied elsewhere): linked again, silently
    (out / "config.json").write_bytes((out / "checkpoints" / "step-000003" / "config.json").read_bytes())
    _, _, messages = prepare(["--out-dir", str(out), flag])
    assert not [m for m in messages if "put back" in m]
    assert os.path.samefile(out / "config.json", out / "checkpoints" / "step-000003" / "config.json")


def test_commit_keeps_the_newest_and_a_second_save_of_a_step_is_newer(saved):
    out, data = saved
    run = rundir.Run(str(out), SPEC)
    for step, keep in ((4, 2), (4, 2), (5, 1)):
        rundir.commit(run, argparse.Namespace(keep_last=keep), step)
    assert os.listdir(out / "checkpoints") == ["step-000005"]
    assert os.path.samefile(out / "checkpoints" / "step-000005" / "model.safetensors", out / "model.safetensors")
    rundir.commit(run, argparse.Namespace(keep_last=2), 5)
    assert [os.path.basename(p) for p in rundir.committed(str(out))] == ["step-000005.2", "step-000005"]


def test_rng_states_keep_and_restore_the_mps_generator_where_there_is_one(monkeypatch):
    """On a Mac the dropout masks come from MPS's generator: it is saved and put back too (faked here)."""
    from lib import device as devices
    mps = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda *a: mps["state"].clone())
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state, *a: mps.update(state=state.clone()))
    saved = devices.rng_states()
    mps["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)
    devices.restore_rng_states(saved)
    assert mps["state"].tolist() == [1, 2, 3]
    del saved["rng_mps"]  # a save from before MPS's state was kept: the rest still restores
    mps["state"] = torch.tensor([7], dtype=torch.uint8)
    devices.restore_rng_states(saved)
    assert mps["state"].tolist() == [7]
