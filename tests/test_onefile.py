"""onefile_train.py: the same training as train.py (+ lib/), written out in one file.

Both scripts run in-process with the same tiny flags; their losses, validation losses and saved
weights must agree, and onefile's checkpoint must load with lib/ and resume exactly.
"""
import argparse
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import onefile_train
from tests import conftest
from tests.conftest import read_metrics as records, step_losses as losses, val_losses
import train
from lib import checkpoint, gpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 6 steps of 2 micro-batches of 2 x 32 tokens; validation at steps 0, 3 and 6.
FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "2",
         "--steps", "6", "--warmup-steps", "2", "--eval-interval", "3", "--eval-batches", "2", "--sample-tokens", "0", "--log-interval", "1"]
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
    text = "".join(open(os.path.join(src, n), encoding="utf-8").read() for n in sorted(os.listdir(src)) if n.endswith(".py"))
    (d / "corpus.txt").write_text((PROSE + "\n\n" + text)[:40_000], encoding="utf-8")
    return {"dir": d, "common": ["--data", str(d / "corpus.txt"), "--cache-dir", str(d / "cache")] + FLAGS}


def run(script, env, out, *extra):
    out_dir = str(env["dir"] / out)
    script.main(env["common"] + ["--out-dir", out_dir, *extra])
    return out_dir


@pytest.fixture(scope="module")
def runs(env):
    """train.py and onefile_train.py, 6 steps each with grad-accum 2."""
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
    wb = load_file(os.path.join(runs["onefile"], "model.safetensors"))
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wb[name], wa[name]), name  # the same arithmetic in the same order: bit for bit
    with open(os.path.join(runs["train"], "config.json")) as fa, open(os.path.join(runs["onefile"], "config.json")) as fb:
        assert json.load(fa) == json.load(fb)

    # The same kinds of records, with the same fields, in the same order.
    ra, rb = records(runs["train"]), records(runs["onefile"])
    assert [sorted(r) for r in ra] == [sorted(r) for r in rb]
    assert rb[0]["event"] == "start" and rb[0]["seed"] == 1337 and rb[-1]["event"] == "end"


def test_checkpoint_layout_and_state(runs):
    out = runs["onefile"]
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert f.metadata()["step"] == "6"
        names = set(f.keys())
        c_attn = f.get_tensor("transformer.h.0.attn.c_attn.weight")
    assert "lm_head.weight" not in names  # tied to wte
    assert tuple(c_attn.shape) == (64, 192)  # Conv1D: [in, out]
    state = torch.load(os.path.join(out, "training_state.pt"), weights_only=True)
    assert state["step"] == 6 and json.loads(state["args"])["grad_accum"] == 2


def test_checkpoint_loads_with_lib_and_gives_the_same_logits(runs, tmp_path):
    # A fresh onefile model, saved by onefile and loaded by lib/: the logits must not change.
    cfg = onefile_train.GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)
    torch.manual_seed(0)
    model = onefile_train.GPT(cfg).eval()
    opt = onefile_train.make_adamw(model, 1e-3, 0.1, (0.9, 0.95), "cpu")
    onefile_train.save_checkpoint(str(tmp_path), model, opt, 0, argparse.Namespace(seed=0))
    lib_cfg, sd = checkpoint.load_hf(str(tmp_path))
    lib_model = gpt.GPT(lib_cfg).eval()
    lib_model.load_state_dict(sd)
    idx = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lib_model(idx)[0], model(idx)[0], rtol=0, atol=1e-5)

    # And the trained checkpoint reads the same through both loaders.
    cfg_a, sd_a = checkpoint.load_hf(runs["onefile"])
    cfg_b, sd_b = onefile_train.load_hf(runs["onefile"])
    assert vars(cfg_a) == vars(cfg_b) and sorted(sd_a) == sorted(sd_b)
    for name in sd_a:
        assert torch.equal(sd_a[name], sd_b[name]), name


def test_resume_after_ctrl_c_is_exact(runs, env, monkeypatch):
    # Ctrl-C at the start of step 3: the run saves step 3 and exits 130; --resume finishes steps 3..5.
    real_lr_at = onefile_train.lr_at

    def interrupt_at_3(step, *a):
        if step == 3:
            raise KeyboardInterrupt
        return real_lr_at(step, *a)

    monkeypatch.setattr(onefile_train, "lr_at", interrupt_at_3)
    with pytest.raises(SystemExit) as exit_info:
        run(onefile_train, env, "resumed", "--grad-accum", "2")
    assert exit_info.value.code == 130
    monkeypatch.setattr(onefile_train, "lr_at", real_lr_at)
    out = run(onefile_train, env, "resumed", "--grad-accum", "2", "--resume")

    straight, resumed = losses(runs["onefile"]), losses(out)
    assert sorted(resumed) == list(range(6))  # metrics.jsonl continued, not restarted
    for step in (3, 4, 5):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), step
    assert val_losses(out)[-1][1] == pytest.approx(val_losses(runs["onefile"])[-1][1], abs=1e-6)


@pytest.mark.parametrize("case", ["missing data", "empty corpus", "block larger than corpus", "not gpt2", "vocab"])
def test_user_mistakes_exit_2_with_one_line(case, env, tmp_path, capsys):
    data = env["common"][1]
    extra = []
    if case == "missing data":
        data = str(tmp_path / "no-such-file.txt")
    elif case == "empty corpus":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "a.txt").write_text("  \n\n")
        data = str(tmp_path / "empty")
    elif case == "block larger than corpus":
        (tmp_path / "short.txt").write_text("a few words only, " * 3)
        data = str(tmp_path / "short.txt")
    elif case == "not gpt2":
        (tmp_path / "m").mkdir()
        config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 32000}
        (tmp_path / "m" / "config.json").write_text(json.dumps(config))
        extra = ["--init-from", str(tmp_path / "m")]
    else:  # a well-formed GPT-2 checkpoint with a 1,000-token vocabulary
        model = onefile_train.GPT(onefile_train.GPTConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=2, n_embd=64))
        opt = onefile_train.make_adamw(model, 1e-3, 0.1, (0.9, 0.95), "cpu")
        onefile_train.save_checkpoint(str(tmp_path / "m"), model, opt, 0, argparse.Namespace())
        extra = ["--init-from", str(tmp_path / "m")]
    argv = env["common"] + ["--out-dir", str(tmp_path / "out"), *extra]
    argv[argv.index("--data") + 1] = data
    with pytest.raises(SystemExit) as exit_info:
        onefile_train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert {"missing data": "does not exist", "empty corpus": "is empty", "block larger than corpus": "block_size+1",
            "not gpt2": "not a GPT-2 config", "vocab": "vocabulary mismatch"}[case] in err


@pytest.mark.multiprocess
def test_torchrun_two_ranks_match_one_process(runs, env):
    # 2 ranks x grad-accum 1 read the same windows as 1 process x grad-accum 2 (see onefile_train.Batches).
    out = str(env["dir"] / "ddp")
    proc = conftest.torchrun([os.path.join(ROOT, "onefile_train.py"), *env["common"], "--out-dir", out,
                              "--grad-accum", "1"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "x 2 ranks" in proc.stdout
    single, ddp = losses(runs["onefile"]), losses(out)
    assert sorted(ddp) == list(range(6))
    for step in single:
        assert ddp[step] == pytest.approx(single[step], abs=1e-5), step
    # Validation batches are split between the ranks, so the validation loss does not change either.
    assert [v for _, v in val_losses(out)] == pytest.approx([v for _, v in val_losses(runs["onefile"])], abs=1e-5)
    assert records(out)[0]["world_size"] == 2
