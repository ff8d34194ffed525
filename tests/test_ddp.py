"""DDP for real: torchrun --nproc_per_node=2 on CPU (gloo) against one process with the same global batch."""

import os

import pytest

import train
from tests import conftest
from tests.conftest import TINY, step_losses, val_losses

pytestmark = pytest.mark.multiprocess


def torchrun(script, args, env_cache):
    res = conftest.torchrun([script, *args], env={"BYHAND_CACHE": env_cache})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def test_two_ranks_match_one_process_and_resume_on_one_as_the_unbroken_run(tmp_path, text_dir, isolated_cache, capsys):
    # One process accumulating 4 micro-batches of 2 == 2 ranks accumulating 2 micro-batches of 2 each: the ranks
    # skip the gradient all-reduce (no_sync) on the first micro-batch and sync on the last. One launch covers both
    # paths: the last micro-batch is the whole step of a run without accumulation. The launch stops after 3 of
    # the 6 steps and one plain process resumes it (elastic: the same global batch, --grad-accum 4 recomputed);
    # a constant learning rate makes that the unbroken run. (Once three launches: this test without the resume,
    # one without accumulation, and tests/test_elastic.py's train.py run saved by 2 ranks, resumed on 1.)
    common = [*TINY, "--data", text_dir, "--eval-interval", "3", "--batch-size", "2", "--warmup-steps", "0",
              "--min-lr-ratio", "1"]
    train.main([*common, "--grad-accum", "4", "--steps", "6", "--out-dir", str(tmp_path / "single")])
    out = str(tmp_path / "ddp")
    res = torchrun("train.py", [*common, "--grad-accum", "2", "--steps", "3", "--out-dir", out], isolated_cache)
    assert "x 2 ranks" in res.stdout
    # Only rank 0 writes.
    assert sorted(os.listdir(out)) == ["checkpoints", "config.json", "metrics.jsonl", "model.safetensors",
                                       "training_state.pt"]
    capsys.readouterr()
    train.main(["--resume", "--steps", "6", "--out-dir", out])
    said = capsys.readouterr().out
    assert "saved by 2 process(es) with --grad-accum 2, continued by 1 with --grad-accum 4" in said
    assert "8,192 tokens per step" not in said and "256 tokens per step" in said  # 2 x 32 x 4 x 1
    single, ddp = step_losses(tmp_path / "single"), step_losses(out)
    assert sorted(ddp) == list(range(6))
    for step in range(6):
        assert ddp[step] == pytest.approx(single[step], abs=1e-5), step
    single_val, ddp_val = dict(val_losses(tmp_path / "single")), dict(val_losses(out))
    assert sorted(single_val) == sorted(ddp_val) and len(single_val) >= 3, (single_val, ddp_val)  # 0, 3, the end
    for step, v in single_val.items():
        assert ddp_val[step] == pytest.approx(v, abs=1e-5), step
    # Halving the global batch is refused in one line, before anything is written.
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", "--steps", "7", "--grad-accum", "1", "--out-dir", out])
    assert e.value.code == 2
    assert "drop --grad-accum" in capsys.readouterr().err
