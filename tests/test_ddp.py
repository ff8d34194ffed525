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


def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path, text_dir, isolated_cache):
    # One process accumulating 4 micro-batches of 2 == 2 ranks accumulating 2 micro-batches of 2 each: the ranks
    # skip the gradient all-reduce (no_sync) on the first micro-batch and sync on the last. One launch covers both
    # paths: the last micro-batch is the whole step of a run without accumulation (once two tests, two launches;
    # tests/test_elastic.py still compares 2 ranks without accumulation to one process, step by step).
    common = [*TINY, "--data", text_dir, "--steps", "6", "--eval-interval", "3", "--batch-size", "2"]
    train.main([*common, "--grad-accum", "4", "--out-dir", str(tmp_path / "single")])
    res = torchrun("train.py", [*common, "--grad-accum", "2", "--out-dir", str(tmp_path / "ddp")], isolated_cache)
    assert "x 2 ranks" in res.stdout
    single, ddp = step_losses(tmp_path / "single"), step_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(6))
    for step in range(6):
        assert ddp[step] == pytest.approx(single[step], abs=1e-5), step
    assert len(val_losses(tmp_path / "ddp")) == len(val_losses(tmp_path / "single")) == 3  # steps 0 and 3, the end
    for (s1, v1), (s2, v2) in zip(val_losses(tmp_path / "single"), val_losses(tmp_path / "ddp")):
        assert s1 == s2 and v1 == pytest.approx(v2, abs=1e-5)
    # Only rank 0 writes.
    assert sorted(os.listdir(tmp_path / "ddp")) == ["checkpoints", "config.json", "metrics.jsonl",
                                                    "model.safetensors", "training_state.pt"]
