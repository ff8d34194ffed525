"""onefile_train.py: the same training as train.py (+ lib/), written out in one file.

Both scripts run in-process with the same tiny flags; their losses, validation losses and saved
weights must agree, and onefile's checkpoint (OUT/checkpoint) must load with lib/. Its run directory
(no silent overwrite, exact resume after Ctrl-C, damaged files, finite saves) is held to the run
contract in tests/test_run_contract.py; its save's one rename is tried here.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import onefile_train
from tests import conftest
from tests.conftest import ROOT, read_metrics as records, step_losses as losses, val_losses
import train
from lib import checkpoint, data, gpt

# 6 steps of 2 micro-batches of 2 x 32 tokens; validation at steps 0, 3 and 6.
FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "2",
         "--steps", "6", "--warmup-steps", "2", "--eval-interval", "3", "--eval-batches", "2", "--log-interval", "1"]
# What onefile leaves to train.py: the token cache, the sample at the end (and MFU in the progress records), and
# --dtype: these runs are fp32 (onefile's CPU rule pinned in `runs`) even on a CPU with bf16 (tests/test_dtype.py).
TRAIN_ONLY = ["--sample-tokens", "0", "--dtype", "fp32"]
PROSE = """The quick brown fox jumps over the lazy dog. Numbers: 3.14159, 2.71828, 1,000,000 and 42.
Ünïcödé text, emoji 🙂, tabs\tand
blank lines, and a quote: "it's a trap," she said; 'we'll see'."""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Ops this small gain nothing from a second thread, and lose a lot when the cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A ~40 KB corpus (Python source and some prose) and a cache that both scripts share."""
    d = tmp_path_factory.mktemp("onefile")
    src = os.path.dirname(json.__file__)  # the stdlib's json package
    text = "".join(open(os.path.join(src, n), encoding="utf-8").read() for n in sorted(os.listdir(src))
                   if n.endswith(".py"))
    (d / "corpus.txt").write_text((PROSE + "\n\n" + text)[:40_000], encoding="utf-8")
    return {"dir": d, "common": ["--data", str(d / "corpus.txt")] + FLAGS}


def run(script, env, out, *extra):
    out_dir = str(env["dir"] / out)
    only = [*TRAIN_ONLY, "--cache-dir", str(env["dir"] / "cache")] if script is train else []
    script.main(env["common"] + only + ["--out-dir", out_dir, *extra])
    return out_dir


@pytest.fixture(scope="module")
def runs(env):
    """train.py and onefile_train.py, 6 steps each with grad-accum 2, in fp32."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onefile_train, "cpu_has_bf16", lambda: False)
        return {"train": run(train, env, "train", "--grad-accum", "2"),
                "onefile": run(onefile_train, env, "onefile", "--grad-accum", "2")}


def test_same_losses_and_weights_as_train_py(runs):
    a, b = losses(runs["train"]), losses(runs["onefile"])
    assert sorted(a) == sorted(b) == list(range(6))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    va, vb = val_losses(runs["train"]), val_losses(runs["onefile"])
    assert [s for s, _ in va] == [s for s, _ in vb] == [0, 3, 6]
    assert [v for _, v in vb] == pytest.approx([v for _, v in va], abs=1e-6)
    assert a[5] < a[0]  # it learns

    wa = load_file(os.path.join(runs["train"], "model.safetensors"))
    wb = load_file(os.path.join(runs["onefile"], "checkpoint", "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wb[name], wa[name]), name  # the same arithmetic in the same order: bit for bit
    train_config, onefile_config = (os.path.join(runs["train"], "config.json"),
                                    os.path.join(runs["onefile"], "checkpoint", "config.json"))
    with open(train_config) as fa, open(onefile_config) as fb:
        assert json.load(fa) == json.load(fb)

    # The same kinds of records, with the same fields (but train.py's MFU, sample and memory), in the same order.
    ra, rb = records(runs["train"]), records(runs["onefile"])
    train_only = {"mfu", "sample", "peak_memory", "memory_estimate"}
    assert [sorted(set(r) - train_only) for r in ra] == [sorted(r) for r in rb]
    assert rb[0]["event"] == "start" and rb[0]["seed"] == 1337 and rb[-1]["event"] == "end"


def test_checkpoint_layout_and_state(runs):
    out = os.path.join(runs["onefile"], "checkpoint")
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert f.metadata()["step"] == "6"
        names = set(f.keys())
        c_attn = f.get_tensor("transformer.h.0.attn.c_attn.weight")
    assert "lm_head.weight" not in names  # tied to wte
    assert tuple(c_attn.shape) == (64, 192)  # Conv1D: [in, out]
    state = torch.load(os.path.join(out, "training_state.pt"), weights_only=True)
    assert state["step"] == 6 and state["world_size"] == 1 and json.loads(state["args"])["grad_accum"] == 2
    assert sorted(os.listdir(runs["onefile"])) == ["checkpoint", "metrics.jsonl"]  # no .tmp or .old left behind


def test_a_save_cut_between_its_two_renames_resumes_from_the_old_folder(runs, tmp_path):
    # save_checkpoint moves OUT/checkpoint aside to checkpoint.old, then renames checkpoint.tmp into place: a crash
    # between the two leaves no OUT/checkpoint, a complete checkpoint.old and a checkpoint.tmp that may be partial.
    out = tmp_path / "cut"
    shutil.copytree(runs["onefile"], out)
    (out / "checkpoint").rename(out / "checkpoint.old")
    (out / "checkpoint.tmp").mkdir()
    (out / "checkpoint.tmp" / "model.safetensors").write_bytes(b"half a file")
    onefile_train.main(["--resume", "--out-dir", str(out)])  # 6 of 6 steps done: it saves the same weights again
    assert sorted(os.listdir(out)) == ["checkpoint", "metrics.jsonl"]
    before = load_file(os.path.join(runs["onefile"], "checkpoint", "model.safetensors"))
    after = load_file(out / "checkpoint" / "model.safetensors")
    assert sorted(after) == sorted(before) and all(torch.equal(after[name], before[name]) for name in before)


def test_checkpoint_loads_with_lib_and_gives_the_same_loss(runs):
    # The trained onefile checkpoint, loaded by lib/ (names, layouts and config.json checked there), scores a
    # batch as onefile's own model with the trained weights does.
    lib_cfg, sd = checkpoint.load_hf(os.path.join(runs["onefile"], "checkpoint"))
    lib_model = gpt.GPT(lib_cfg).eval()
    lib_model.load_state_dict(sd)
    model = onefile_train.GPT(onefile_train.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)).eval()
    model.load_state_dict(sd)
    assert vars(lib_cfg) == {**vars(model.config), "bias": True}
    idx = torch.randint(0, 50257, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert model(idx[:, :-1], idx[:, 1:]).item() == pytest.approx(lib_model(idx[:, :-1], idx[:, 1:])[1].item(),
                                                                        abs=1e-5)


@pytest.mark.multiprocess
def test_torchrun_two_ranks_match_one_process(runs, env):
    # 2 ranks x grad-accum 1 read the same windows as 1 process x grad-accum 2 (see onefile_train.Batches).
    out = str(env["dir"] / "ddp")
    proc = conftest.torchrun([os.path.join(ROOT, "onefile_train.py"), *env["common"], "--out-dir", out,
                              "--grad-accum", "1"], env=conftest.FP32_CPU)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "x 2 ranks" in proc.stdout
    single, ddp = losses(runs["onefile"]), losses(out)
    assert sorted(ddp) == list(range(6))
    for step in single:
        assert ddp[step] == pytest.approx(single[step], abs=1e-5), step
    # Validation batches are split between the ranks, so the validation loss does not change either.
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(runs["onefile"])], abs=1e-5)
    assert records(out)[0]["world_size"] == 2
    # The weights after 6 steps: the same update from the same averaged gradient, up to the sum's order.
    one, two = (load_file(os.path.join(d, "checkpoint", "model.safetensors")) for d in (runs["onefile"], out))
    for name in one:
        assert torch.allclose(two[name], one[name], atol=1e-5), name


@pytest.mark.parametrize("case", ["missing data", "empty corpus", "block larger than corpus"])
def test_user_mistakes_exit_2_with_one_line(case, env, tmp_path, capsys):
    data = {"missing data": str(tmp_path / "no-such-file.txt"), "empty corpus": str(tmp_path / "empty"),
            "block larger than corpus": str(tmp_path / "short.txt")}[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n\n")
    (tmp_path / "short.txt").write_text("a few words only, " * 3)
    argv = env["common"] + ["--out-dir", str(tmp_path / "out")]
    argv[argv.index("--data") + 1] = data
    with pytest.raises(SystemExit) as exit_info:
        onefile_train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert {"missing data": "does not exist", "empty corpus": "is empty", "block larger than corpus": "block_size+1"}[
        case] in err


def test_tokenises_text_as_train_py_does_line_endings_included(tmp_path):
    # \r\n and \r are text like any other: read as they are, not translated to \n as a text-mode read would.
    (tmp_path / "a.txt").write_bytes(b"one\r\ntwo\rthree\n" * 50)
    ids = onefile_train.tokenize(str(tmp_path / "a.txt"), lambda *a: None)
    prepared = data.prepare(str(tmp_path / "a.txt"), str(tmp_path / "cache"), log=lambda *a: None)
    for split in ("train", "val"):
        assert ids[split].tolist() == [t for shard in data.TokenSplit(prepared, split).shards for t in shard.tolist()]
