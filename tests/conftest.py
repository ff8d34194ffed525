"""Shared fixtures: a tiny text corpus, an isolated cache, and the tiny model flags every test uses."""

import os
import shutil
import sysconfig
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 2 layers, 64 wide: enough to exercise every code path in well under a second per step. fp32 explicitly:
# --dtype auto would compute in bf16 on a CPU that has it natively, and the parity tests compare fp32 runs.
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "4",
        "--eval-batches", "2", "--sample-tokens", "0", "--log-interval", "1", "--dtype", "fp32"]

# For a child process that must compute in fp32 whatever the CPU (onefile_train.py has no --dtype): torch runs
# its AVX2 kernels, and --dtype auto's rule (lib/device.cpu_has_native_bf16) then says fp32.
FP32_CPU = {"ATEN_CPU_CAPABILITY": "avx2"}


def pytest_configure(config):
    """Point BYHAND_CACHE at a temporary directory for the whole session, before any test module is
    imported and before any fixture runs: a function-scoped monkeypatch alone came too late for the
    module- and session-scoped fixtures, whose runs (and torchrun's children, which inherit
    os.environ) then prepared their data in ~/.cache/byhand."""
    config._byhand_saved_cache = os.environ.get("BYHAND_CACHE")
    # The user's real cache, as the scripts would find it without the tests (test_hardening checks it).
    config._byhand_real_cache = os.environ.get("BYHAND_CACHE",
                                               os.path.join(os.path.expanduser("~"), ".cache", "byhand"))
    config._byhand_cache = tempfile.mkdtemp(prefix="byhand-test-cache-")
    os.environ["BYHAND_CACHE"] = config._byhand_cache


def pytest_unconfigure(config):
    if getattr(config, "_byhand_cache", None):
        shutil.rmtree(config._byhand_cache, ignore_errors=True)
        if config._byhand_saved_cache is None:
            os.environ.pop("BYHAND_CACHE", None)
        else:
            os.environ["BYHAND_CACHE"] = config._byhand_saved_cache


@pytest.fixture(autouse=True)
def isolated_cache(request, monkeypatch):
    """Prepared shards and hub downloads go to the session's temporary cache, never ~/.cache."""
    cache = request.config._byhand_cache
    monkeypatch.setenv("BYHAND_CACHE", cache)  # a test that changed it gets it back
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """A directory of real Python source (the stdlib's json and email packages), about 400 KB."""
    d = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    for pkg in ("json", "email"):
        for name in sorted(os.listdir(os.path.join(stdlib, pkg))):
            if name.endswith(".py"):
                shutil.copy(os.path.join(stdlib, pkg, name), d / f"{pkg}_{name}")
    return str(d)


def read_metrics(out_dir):
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def step_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def val_losses(out_dir):
    return [(r["step"], r["val_loss"]) for r in read_metrics(out_dir) if "val_loss" in r and "event" not in r]


def torchrun(args, timeout=240, env=None):
    """`torchrun --standalone --nproc_per_node=2 <args>` on CPU (gloo), one thread per rank. Run once: every
    multi-process script exits 0 (tests/test_teardown.py holds them to it), so a failure is a failure."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def ctrl_c_launcher(tmp_path, script, stop_at):
    """A file for torchrun to start instead of script: it runs script's main with each rank sending
    itself SIGINT after update stop_at (counted by lib/rundir.Updates.record), as a terminal's Ctrl-C
    would. Returns its path."""
    helper = tmp_path / "ctrl_c.py"
    helper.write_text(f"""import os, signal, sys
sys.path.insert(0, {ROOT!r})
from lib import rundir
real = rundir.Updates.record
def record(self, step, skipped):
    real(self, step, skipped)
    if step + 1 == {stop_at}:
        os.kill(os.getpid(), signal.SIGINT)
rundir.Updates.record = record
import {script}
{script}.main(sys.argv[1:])
""")
    return str(helper)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A seeded GPT of 2 layers, 64 wide, saved as a Hugging Face GPT-2 directory (the fine-tuning tests' base)."""
    import torch

    from lib import checkpoint, gpt

    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    out = str(tmp_path_factory.mktemp("base"))
    checkpoint.save_hf(out, cfg, gpt.to_hf_state_dict(gpt.GPT(cfg)))
    return out
