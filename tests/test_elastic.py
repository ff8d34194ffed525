"""Elastic resume: a run saved by N processes continues on M with the same global batch, exactly."""

import pytest

import train_fsdp
from lib import data
from lib.errors import UserError
from tests import conftest
from tests.conftest import TINY, step_losses

# A constant learning rate, so an unbroken run of 6 steps and a run of 3 then resumed to 6 are the same run.
FLAT = ["--warmup-steps", "0", "--min-lr-ratio", "1", "--eval-interval", "100", "--eval-batches", "1"]


def test_keep_global_batch_recomputes_checks_and_refuses():
    said = []
    assert data.keep_global_batch(4, 1, 2, 1, log=said.append) == 2  # 4 x 1 x 2 ranks == 4 x 2 x 1
    assert "the same 8 sequences per step" in said[0]
    assert data.keep_global_batch(4, 2, 1, 2, log=said.append) == 1
    assert data.keep_global_batch(4, 3, 2, 3, log=said.append) == 2  # 24 sequences: 4 x 2 x 3
    assert data.keep_global_batch(4, 2, 2, 2, given_accum=2) == 2
    with pytest.raises(UserError, match="cannot share evenly"):
        data.keep_global_batch(4, 1, 2, 3)  # 8 sequences over 3 processes of 4
    with pytest.raises(UserError, match="drop --grad-accum"):
        data.keep_global_batch(4, 1, 2, 1, given_accum=1)  # would halve the global batch


# train.py saved by 2 ranks and resumed on 1 is tests/test_ddp.py's launch, resumed: one torchrun for both.


@pytest.mark.multiprocess
def test_fsdp_resumes_two_then_one_then_two_ranks_as_the_unbroken_run(tmp_path, text_dir, isolated_cache, capsys):
    common = [*TINY, *FLAT, "--data", text_dir, "--no-export"]
    train_fsdp.main([*common, "--grad-accum", "2", "--steps", "6", "--out-dir", str(tmp_path / "one")])
    out = str(tmp_path / "elastic")
    env = {"BYHAND_CACHE": isolated_cache}
    proc = conftest.torchrun(["train_fsdp.py", *common, "--steps", "2", "--out-dir", out], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    capsys.readouterr()
    train_fsdp.main(["--resume", "--steps", "4", "--out-dir", out])  # DCP reshards 2 -> 1
    assert "continued by 1 with --grad-accum 2" in capsys.readouterr().out
    proc = conftest.torchrun(["train_fsdp.py", "--resume", "--steps", "6", "--out-dir", out], env=env)  # 1 -> 2
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continued by 2 with --grad-accum 1" in proc.stdout
    one, elastic = step_losses(tmp_path / "one"), step_losses(out)
    assert sorted(elastic) == list(range(6))
    assert [elastic[s] for s in range(6)] == pytest.approx([one[s] for s in range(6)], abs=1e-5)
