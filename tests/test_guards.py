"""lib/guards.py: the checks every script runs before it spends time, memory or a saved run."""

import argparse
import os
import stat

import pytest
import torch

from lib import guards
from lib.errors import UserError


@pytest.mark.parametrize("parse,text,ok", [
    (guards.positive_int, "1", 1), (guards.positive_int, "0", None), (guards.positive_int, "1.5", None),
    (guards.nonneg_int, "0", 0), (guards.nonneg_int, "-1", None),
    (guards.positive_float, "3e-4", 3e-4), (guards.positive_float, "0", None), (guards.positive_float, "nan", None),
    (guards.nonneg_float, "inf", None), (guards.finite_float, "-2.5", -2.5), (guards.finite_float, "-inf", None),
    (guards.probability, "0", 0.0), (guards.probability, "0.99", 0.99), (guards.probability, "1", None),
    (guards.probability, "1.5", None),
])
def test_argparse_types(parse, text, ok):
    if ok is None:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    else:
        assert parse(text) == ok


def test_bad_flag_value_is_one_usage_line_exit_2(capsys):
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=guards.positive_float, default=1e-3)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--lr", "nan"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()

    assert "argument --lr: 'nan' is not a finite number" in err[-1]


def test_output_dir_checks(tmp_path, monkeypatch):
    guards.check_output_dir(str(tmp_path / "new" / "deeper"))  # not there yet: fine, nothing created
    assert not (tmp_path / "new").exists()
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError, match="is an existing file"):
        guards.check_output_dir(str(f))
    with pytest.raises(UserError, match="which is a file"):
        guards.check_output_dir(str(f / "sub"), "--cache-dir")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(ro, os.W_OK):  # root writes anywhere: pretend to be a user the mode stops
            monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(ro)))
        with pytest.raises(UserError, match="not writable"):
            guards.check_output_dir(str(ro / "out"))
    finally:
        ro.chmod(stat.S_IRWXU)


def test_nonfinite_and_check_finite_weights(tmp_path):
    good = {"a": torch.ones(3), "steps": torch.tensor([3])}
    bad = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]), "c": torch.tensor([float("inf")])}
    assert guards.nonfinite(good) == []
    assert guards.nonfinite(bad) == ["b", "c"]
    assert guards.nonfinite(list(bad.items())) == ["b", "c"]
    guards.check_finite_weights(good, 5, None, str(tmp_path))
    with pytest.raises(UserError,
                       match=r"not finite at step 5 \(2 tensors, e.g. b\).*last finite checkpoint is step 4"):
        guards.check_finite_weights(bad, 5, 4, str(tmp_path))
    with pytest.raises(UserError, match="no finite checkpoint was saved"):
        guards.check_finite_weights(bad, 5, None, str(tmp_path))


def test_check_memory():
    cpu = torch.device("cpu")
    available, what = guards.available_memory(cpu)
    assert available > 0 and what
    guards.check_memory(available // 2, cpu, force=False, hint="lower --batch-size")
    guards.check_memory(available * 2, cpu, force=True, hint="lower --batch-size")  # --force
    with pytest.raises(UserError, match="exceeds .* lower --batch-size, or pass --force"):
        guards.check_memory(available * 2, cpu, force=False, hint="lower --batch-size")


def test_ctrl_c_or_sigterm_outside_the_loop_is_one_line_and_the_shells_code(capsys):
    """A KeyboardInterrupt reaching main (setup, final evaluation) is one line, exit 130; SIGTERM's 143."""
    from lib.errors import Terminated, report_and_exit
    for err, code, what in ((KeyboardInterrupt(), 130, "Ctrl-C"), (Terminated(), 143, "SIGTERM")):
        with pytest.raises(SystemExit) as e:
            report_and_exit(err)
        err_text = capsys.readouterr().err.strip()
        assert e.value.code == code and len(err_text.splitlines()) == 1 and f"stopped by {what}" in err_text
