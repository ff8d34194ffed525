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
    common = [*TINY, "--data", text_dir, "--steps", "6", "--eval-interval", "3"]
    # One process accumulating 2 micro-batches of 4 == 2 ranks with one micro-batch of 4 each.
    train.main([*common, "--grad-accum", "2", "--out-dir", str(tmp_path / "single")])
    res = torchrun("train.py", [*common, "--grad-accum", "1", "--out-dir", str(tmp_path / "ddp")], isolated_cache)
    assert "x 2 ranks" in res.stdout
    single, ddp = step_losses(tmp_path / "single"), step_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(6))
    for step in range(6):
        assert ddp[step] == pytest.approx(single[step], abs=1e-5), step
    for (s1, v1), (s2, v2) in zip(val_losses(tmp_path / "single"), val_losses(tmp_path / "ddp")):
        assert s1 == s2 and v1 == pytest.approx(v2, abs=1e-5)
    # Only rank 0 writes.
    assert sorted(os.listdir(tmp_path / "ddp")) == ["checkpoints", "config.json", "metrics.jsonl",
                                                    "model.safetensors", "training_state.pt"]


def test_ddp_with_accumulation_uses_no_sync_and_still_matches(tmp_path, text_dir, isolated_cache):
    common = [*TINY, "--data", text_dir, "--steps", "3", "--eval-interval", "100", "--batch-size", "2"]
    train.main([*common, "--grad-accum", "4", "--out-dir", str(tmp_path / "single")])
    torchrun("train.py", [*common, "--grad-accum", "2", "--out-dir", str(tmp_path / "ddp")], isolated_cache)
    single, ddp = step_losses(tmp_path / "single"), step_losses(tmp_path / "ddp")
    assert [ddp[s] for s in range(3)] == pytest.approx([single[s] for s in range(3)], abs=1e-5)
