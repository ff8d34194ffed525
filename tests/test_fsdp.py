"""FSDP2 (train_fsdp.py) against single-process train.py: the same losses, half the parameters per rank,
and an export that train.py's loader reads. Ctrl-C, the exact sharded resume and damaged shard files are
held to the run contract in tests/test_run_contract.py.

The multi-process tests launch `torchrun --nproc_per_node=2` (gloo, CPU) in a subprocess with a timeout.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train
from tests import conftest
import train_fsdp
from lib import checkpoint, data, gpt
from lib import device as devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2 layers, 64 wide; 6 steps with a checkpoint-free middle: every path, a few seconds per run.
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "2",
        "--steps", "6", "--warmup-steps", "2", "--lr", "3e-3", "--eval-interval", "100", "--eval-batches", "3",
        "--log-interval", "1", "--save-interval", "100", "--seed", "7", "--sample-tokens", "0", "--dtype", "fp32"]
TIMEOUT = 150


def torchrun(script, args, timeout=TIMEOUT):
    return conftest.torchrun([script, *args], timeout=timeout)


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def per_step(out_dir, key="loss"):
    return {r["step"]: r[key] for r in metrics(out_dir) if key in r and "event" not in r}


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory):
    """The stdlib's json package (five files, about 20k tokens) and a cache of its own."""
    corpus = tmp_path_factory.mktemp("corpus")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            with open(os.path.join(src, name)) as f, open(corpus / name, "w") as g:
                g.write(f.read())
    return ["--data", str(corpus), "--cache-dir", str(tmp_path_factory.mktemp("cache"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_flags):
    """One uninterrupted 2-rank FSDP run and train.py in one process with twice the accumulation:
    the same global batch (2 ranks x 1 micro-batch = 1 process x 2 micro-batches) and the same windows."""
    fsdp_dir, ref_dir = tmp_path_factory.mktemp("fsdp"), tmp_path_factory.mktemp("train")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Prepare the data once, so the FSDP run and train.py (started side by side) do not both tokenise.
    data.prepare(data_flags[1], data_flags[3], log=lambda *a: None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_fsdp.py",
           *TINY, *data_flags, "--out-dir", str(fsdp_dir)]
    fsdp = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        train.main([*TINY, *data_flags, "--grad-accum", "2", "--sample-tokens", "0", "--out-dir", str(ref_dir)])
        out, err = fsdp.communicate(timeout=TIMEOUT)
    finally:
        fsdp.kill()
    returncode = fsdp.returncode
    if returncode != 0 and "SIGABRT" in err:  # the rare gloo teardown abort: see conftest.torchrun
        shutil.rmtree(fsdp_dir)
        proc = conftest.torchrun(cmd[5:], timeout=TIMEOUT)  # cmd[5:]: what follows --nproc_per_node=2
        returncode, out, err = proc.returncode, proc.stdout, proc.stderr
    assert returncode == 0, out[-3000:] + err[-3000:]
    return str(fsdp_dir), str(ref_dir), out


@pytest.mark.multiprocess
def test_losses_and_gradient_norms_match_single_process_train_py(runs):
    fsdp_dir, ref_dir, _ = runs
    fsdp, ref = per_step(fsdp_dir), per_step(ref_dir)
    assert sorted(fsdp) == sorted(ref) == list(range(6))
    for step in ref:
        assert fsdp[step] == pytest.approx(ref[step], abs=1e-4), step
    assert ref[5] < ref[0] - 0.05  # it learned something, so the comparison is not between two constants
    # Validation: 3 batches over 2 ranks (one rank runs a padding forward), before and after training.
    fsdp_val, ref_val = per_step(fsdp_dir, "val_loss"), per_step(ref_dir, "val_loss")
    assert sorted(fsdp_val) == sorted(ref_val) == [0, 6]
    for step in ref_val:
        assert fsdp_val[step] == pytest.approx(ref_val[step], abs=1e-4), step
    # Clipping saw the same global norm, computed from the DTensor gradient shards.
    fsdp_norm, ref_norm = per_step(fsdp_dir, "grad_norm"), per_step(ref_dir, "grad_norm")
    for step in ref_norm:
        assert fsdp_norm[step] == pytest.approx(ref_norm[step], rel=1e-4), step


@pytest.mark.multiprocess
def test_each_rank_holds_about_half_of_every_parameter(runs):
    fsdp_dir, _, out = runs
    start = next(r for r in metrics(fsdp_dir) if r.get("event") == "start")
    n = start["n_params"]
    assert sum(start["params_per_rank"]) == n
    assert all(abs(c - n / 2) < 0.001 * n for c in start["params_per_rank"])
    # Independent of the script's own counting: the checkpoint's metadata says which rank wrote which
    # rows of each tensor. Every tensor has two pieces, each about half of its first dimension.
    latest = json.load(open(os.path.join(fsdp_dir, "sharded", "latest.json")))
    path = os.path.join(fsdp_dir, "sharded", latest["checkpoint"])
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    weights = {k: v for k, v in meta.items() if k.startswith("model.")}
    assert len(weights) == 2 + 12 * 2 + 2  # wte, wpe, 12 tensors per block, ln_f (lm_head is wte)
    for name, m in weights.items():
        rows = m.size[0]
        assert len(m.chunks) == 2, name
        assert sorted(c.sizes[0] for c in m.chunks) == [rows // 2, rows - rows // 2], name
    assert os.path.isfile(os.path.join(path, "__0_0.distcp")) and os.path.isfile(os.path.join(path, "__1_0.distcp"))
    assert "rank 1: parameters" in out and "peak" in out  # the per-rank memory lines were printed


@pytest.mark.multiprocess
def test_export_loads_with_train_py_loader_and_gives_the_same_logits(runs, tmp_path):
    fsdp_dir, ref_dir, _ = runs
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))

    def logits(cfg, sd):
        model = gpt.GPT(cfg)
        model.load_state_dict(sd)
        model.eval()
        with torch.no_grad():
            return model(idx)[0]

    exported = logits(*checkpoint.load_hf(fsdp_dir))  # train.py's loader: names, shapes and config checked
    # The same weights reassembled from the two ranks' shard files, by torch's own converter.
    latest = json.load(open(os.path.join(fsdp_dir, "sharded", "latest.json")))
    dcp_to_torch_save(os.path.join(fsdp_dir, "sharded", latest["checkpoint"]), tmp_path / "full.pt")
    sd = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied: stored once
    assert torch.allclose(exported, logits(gpt.GPTConfig(**latest["config"]), sd), atol=1e-6)
    # And what train.py trained in one process. Not bit-identical: the ranks sum gradients in another
    # order, and six AdamW steps carry those last-bit differences into the weights.
    reference = logits(*checkpoint.load_hf(ref_dir))
    assert torch.allclose(exported, reference, atol=1e-3), (exported - reference).abs().max()


@pytest.mark.multiprocess
def test_estimate_for_gpt2_xl_on_two_ranks_is_half_the_parameters_each():
    proc = check(torchrun("train_fsdp.py", ["--model-size", "gpt2-xl", "--estimate-memory"], timeout=90))
    counts = [int(c.replace(",", "")) for c in re.findall(r"rank \d ([\d,]+)", proc.stdout)]
    assert len(counts) == 2 and sum(counts) == 1_557_611_200
    assert all(abs(c - 1_557_611_200 / 2) < 10_000 for c in counts)  # dim-0 padding moves a few rows
    assert "DDP gradient buckets" in proc.stdout  # the DDP column on 2 ranks is train.py's DDP estimate
    # 778,805,600 fp32 parameters per rank = 2.90 GiB, beside 5.80 GiB for the unsharded (DDP) rank.
    assert re.search(r"parameters \(fp32\)\s+2\.90 GiB\s+5\.80 GiB", proc.stdout), proc.stdout


def test_one_rank_starts_from_exactly_train_py_initial_weights(tmp_path, data_flags):
    """`python train_fsdp.py` is a world of one; with no steps, the export is the initial weights."""
    train_fsdp.main([*TINY, *data_flags, "--steps", "0", "--out-dir", str(tmp_path)])
    _, sd = checkpoint.load_hf(str(tmp_path))
    devices.seed_everything(7)  # what train.py does before gpt.GPT(cfg)
    ref = gpt.GPT(gpt.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)).state_dict()
    assert sorted(sd) == sorted(ref)
    for name in ref:
        assert torch.equal(sd[name], ref[name]), name


@pytest.mark.parametrize("flags, message", [
    (["--cpu-offload"], "--cpu-offload"),
    (["--resume"], "--resume"),
    (["--n-embd", "65"], "not divisible"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_user_mistakes_end_with_one_line(tmp_path, data_flags, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        train_fsdp.main([*TINY, *data_flags, "--out-dir", str(tmp_path), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if ": error: argument " in err[-1]:  # argparse's own: the usage, then one error line
        assert message in err[-1]
        return
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_help_shows_the_flags_and_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        train_fsdp.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--reshard-after-forward", "--no-reshard-after-forward", "--mixed-precision", "--cpu-offload",
                 "--activation-checkpointing", "--export", "--estimate-memory", "out/train_fsdp"):
        assert flag in out
