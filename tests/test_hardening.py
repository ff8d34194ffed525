"""Issue 7 for the pretraining scripts (train.py, onefile_train.py, train_fsdp.py) and the shared lib/
pieces: no lost work, one line and exit 2 for user mistakes, memory checked before it is spent, and a
test suite that never touches the user's cache."""

import os
import stat
import time

import pytest
import torch

from lib import checkpoint, data, hub, metrics
from lib import device as devices
from lib.errors import UserError


# --- shared lib pieces --------------------------------------------------------------------------
@pytest.mark.parametrize("name,match", [("tpu", "'tpu' is not a device"), ("xla:0", "is not a device"),
                                        ("cuda:9", "cuda"), ("cpu:1", "one cpu device"), ("mps", "MPS")])
def test_pick_device_rejects_unknown_devices(name, match):
    if name == "mps" and torch.backends.mps.is_available():
        pytest.skip("MPS is here")
    with pytest.raises(UserError, match=match):
        devices.pick_device(name)
    assert devices.pick_device("cpu") == torch.device("cpu")


def test_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing below may reach for the network anyway
    for name in ("out/trian", "./model", "~/no-such-model-dir", "a/b/c"):
        with pytest.raises(UserError, match="the local path .* does not exist"):
            hub.resolve_pretrained(name, str(tmp_path / "cache"))
    # A hub-shaped id whose "parent" is no local directory is a hub id; the hub's error names both readings.
    with pytest.raises(UserError, match="HF_HUB_OFFLINE.*read as a hub id: no local directory"):
        hub.resolve_pretrained("someone/model", str(tmp_path / "cache"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        hub.resolve_pretrained("file", str(tmp_path / "cache"))


def test_eta_comes_from_steady_state_steps(monkeypatch):
    clock = iter([0.0,  # constructed
                  10.0,  # step 0 done: a 10 s warm-up step
                  12.0])  # report after steps 1 and 2, 1 s each
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    speed = metrics.Throughput(total_steps=10)
    speed.add(100)
    speed.add(100)
    speed.add(100)
    tok_s, sec_per_step, eta = speed.report(3)
    assert eta == pytest.approx(7.0)  # 7 steps left at 1 s, not at the 4 s the warm-up step makes the mean
    assert sec_per_step == pytest.approx(4.0) and tok_s == pytest.approx(25.0)
    clock2 = iter([0.0, 10.0, 10.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock2))
    speed = metrics.Throughput(total_steps=10)
    speed.add(100)
    assert metrics.format_seconds(speed.report(1)[2]) == "?"  # one step says nothing about the steady state


def test_checkpoint_files_keep_the_umask_mode(tmp_path):
    from lib import gpt
    old = os.umask(0o022)
    try:
        cfg = gpt.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
        checkpoint.save_hf(str(tmp_path), cfg, gpt.to_hf_state_dict(gpt.GPT(cfg)))
        checkpoint.save_training_state(str(tmp_path), {"step": 0})
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json", "training_state.pt"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


# --- the test suite leaves the user's cache alone ------------------------------------------------
@pytest.fixture(scope="module")
def default_cache_run(tmp_path_factory):
    """Prepare data with the default cache from a MODULE-scoped fixture: the kind of fixture that
    used to run before the function-scoped cache isolation and write into ~/.cache/byhand."""
    corpus = tmp_path_factory.mktemp("leak") / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    return data.prepare(str(corpus), log=lambda *a: None)


def test_the_suite_never_writes_into_the_users_cache(default_cache_run, isolated_cache, request):
    real_cache = request.config._byhand_real_cache
    assert os.path.realpath(default_cache_run).startswith(os.path.realpath(isolated_cache))
    assert os.path.realpath(data.default_cache_dir()) == os.path.realpath(isolated_cache)
    leaked = os.path.join(real_cache, "data", os.path.basename(default_cache_run))
    assert not os.path.exists(leaked)
    assert not os.path.realpath(isolated_cache).startswith(os.path.realpath(real_cache))
