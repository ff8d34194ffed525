"""Careless use of the pretraining scripts (train.py, onefile_train.py, train_fsdp.py) and the shared lib/
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


# --- the three pretraining scripts ------------------------------------------------------------------
import shutil
import sysconfig

from safetensors.torch import load_file

import onefile_train
import train
import train_fsdp
from lib import guards
from tests import conftest
from tests.conftest import read_metrics, step_losses, val_losses
from tests.test_hub import hub_server  # noqa: F401  (the fixture: a fake hub on 127.0.0.1)

SCRIPTS = {"train": train, "onefile": onefile_train, "fsdp": train_fsdp}
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "2",
         "--eval-batches", "2", "--log-interval", "1", "--eval-interval", "100", "--warmup-steps", "1"]


def small(script):
    """The tiny flags; onefile_train.py leaves the sample at the end to train.py."""
    return SMALL if script == "onefile" else [*SMALL, "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The stdlib's json package, about 20k tokens: tokenised once (into the session's cache)."""
    d = tmp_path_factory.mktemp("hardening-corpus")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            shutil.copy(os.path.join(src, name), d / name)
    data.prepare(str(d), log=lambda *a: None)
    return str(d)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A 3-step train.py run: the saved run the tests below try to replace, contradict or resume."""
    out = str(tmp_path_factory.mktemp("trained"))
    result = train.main([*small("train"), "--data", corpus, "--steps", "3", "--eval-interval", "2", "--out-dir", out,
                         "--overwrite"])
    return out, result


def main_exits_2(script, argv, capsys):
    """Run script.main(argv); it must exit 2 with one line (argparse's own: a usage, then one line)."""
    with pytest.raises(SystemExit) as e:
        script.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    if ": error: argument " in err[-1]:
        assert err[0].startswith("usage:"), err
    else:
        assert len(err) == 1 and err[0].startswith("error: "), err
    return err[-1]


def files_of(out_dir):
    return {n: (tmp / n).read_bytes() for tmp in [__import__("pathlib").Path(out_dir)] for n in os.listdir(out_dir)
            if (tmp / n).is_file()}


def saved_weights(script, out):
    """The saved weights' path: onefile_train.py saves into OUT/checkpoint, the others at the top of OUT."""
    return os.path.join(out, "checkpoint" if script == "onefile" else "", "model.safetensors")


@pytest.fixture(scope="module")
def trained_onefile(corpus, tmp_path_factory):
    """The same 3-step run by onefile_train.py, which reads only its own layout (OUT/checkpoint)."""
    out = str(tmp_path_factory.mktemp("trained-onefile"))
    onefile_train.main([*small("onefile"), "--data", corpus, "--steps", "3", "--eval-interval", "2", "--out-dir", out,
                        "--overwrite"])
    return out


# 1. a checkpoint is only good if it is finite (onefile_train.py stops at the first non-finite gradient instead of
# skipping it: tests/test_run_contract.py)
@pytest.mark.parametrize("script", ["train"])
def test_non_finite_gradients_skip_the_update_and_every_checkpoint_is_finite(script, corpus, tmp_path, capsys):
    out = str(tmp_path / "nan")
    every = "1" if script == "train" else "4"  # a save every step for train.py; fewer saves (and seconds) for onefile
    message = main_exits_2(SCRIPTS[script], [*small(script), "--data", corpus, "--lr", "1e4", "--save-interval", every,
                                             "--steps", "40", "--out-dir", out], capsys)
    records = [r for r in read_metrics(out) if "loss" in r]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped and all(not torch.isfinite(torch.tensor(r["grad_norm"])) for r in records if r.get("skipped"))
    saved = checkpoint.weights_step(os.path.join(out, "model.safetensors"))
    assert "not finite for 10 steps in a row" in message or "loss became" in message, message
    assert f"the last finite checkpoint is step {saved} in {out}" in message, message
    assert guards.nonfinite(load_file(os.path.join(out, "model.safetensors"))) == []


@pytest.mark.parametrize("script", ["train"])
def test_a_run_whose_every_update_was_skipped_says_so_and_exits_2(script, corpus, tmp_path, capsys, monkeypatch):
    # 3 steps, each gradient non-finite: fewer than the 10 in a row that stop a run, yet nothing was trained.
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: torch.tensor(float("inf")))
    out = str(tmp_path / "skipped")
    message = main_exits_2(SCRIPTS[script], [*small(script), "--data", corpus, "--steps", "3", "--out-dir", out],
                           capsys)
    assert "no update was applied" in message, message
    assert [r["step"] for r in read_metrics(out) if r.get("skipped")] == [0, 1, 2]


@pytest.mark.parametrize("script", ["train", "onefile"])
def test_non_finite_weights_are_never_saved_and_the_last_finite_checkpoint_is_named(script, corpus, tmp_path,
                                                                                     capsys, monkeypatch):
    real_step = torch.optim.AdamW.step

    def poisoned_after_two(self, *a, **k):  # a finite gradient whose update still overflows, at step 2
        result = real_step(self, *a, **k)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        return result

    calls = []
    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_after_two)
    out = str(tmp_path / "inf")
    message = main_exits_2(SCRIPTS[script], [*small(script), "--data", corpus, "--save-interval", "1", "--steps", "6",
                                             "--out-dir", out], capsys)
    assert message.startswith("error: weights are not finite at step 3"), message
    assert f"nothing was saved, the last finite checkpoint is step 2 in {out}" in message
    assert checkpoint.weights_step(saved_weights(script, out)) == 2
    assert guards.nonfinite(load_file(saved_weights(script, out))) == []


# 2. a new run must not silently replace a finished one (for every script: tests/test_run_contract.py); here
# what onefile_train.py's compact copy of the contract does with --overwrite
def test_a_fresh_run_refuses_a_saved_run_and_overwrite_replaces_it(trained_onefile, corpus, tmp_path, capsys):
    out, script = str(tmp_path / "saved"), "onefile"
    shutil.copytree(trained_onefile, out)
    before = files_of(out)
    message = main_exits_2(SCRIPTS[script], [*SMALL, "--data", corpus, "--steps", "0", "--out-dir", out], capsys)
    assert "already holds a saved run" in message and "--resume" in message and "--overwrite" in message
    assert files_of(out) == before  # nothing changed
    SCRIPTS[script].main([*SMALL, "--data", corpus, "--steps", "0", "--out-dir", out, "--overwrite"])
    starts = [r for r in read_metrics(out) if r.get("event") == "start"]
    assert len(starts) == 1 and step_losses(out) == {}  # a fresh log, not the old one continued
    assert checkpoint.weights_step(saved_weights(script, out)) == 0


# 3. --resume must not ignore what the user asked
@pytest.mark.parametrize("script", ["train", "onefile"])
def test_resume_refuses_conflicting_flags_and_reports_changed_ones(script, trained, trained_onefile, corpus, tmp_path,
                                                                   capsys):
    out = str(tmp_path / "resumed")
    shutil.copytree(trained_onefile if script == "onefile" else trained[0], out)
    for flags, saved in ((["--model-size", "gpt2"], "--model-size tiny"), (["--n-embd", "256", "--n-layer", "8"], None),
                         (["--batch-size", "4"], "--batch-size 2"), (["--data", "stdlib"], "--data " + corpus)):
        message = main_exits_2(SCRIPTS[script], [*flags, "--resume", "--out-dir", out], capsys)
        assert "contradicts the saved run" in message and (saved is None or saved in message), message
    result = SCRIPTS[script].main(["--resume", "--out-dir", out, "--steps", "4", "--lr", "1e-3",
                                   *(["--sample-tokens", "0"] if script == "train" else [])])
    printed = capsys.readouterr().out
    assert "--resume: --steps changed from 3 to 4" in printed
    assert "--resume: --lr changed from 0.002 to 0.001" in printed
    assert "--eval-interval" not in printed  # not given: the saved run's 2 is kept, not the default 100
    first = val_losses(out)[0][1]
    if script == "train":  # onefile_train.py leaves "(started at ...)" to train.py
        assert result["first_val_loss"] == first and f"(started at {first:.4f})" in printed
    assert sorted(step_losses(out)) == [0, 1, 2, 3]


# 4. user mistakes get one line, never a traceback
def mistakes(tmp_path):
    (tmp_path / "file").write_text("x")
    return [
        (["--out-dir", str(tmp_path / "file")], "is an existing file"),
        (["--out-dir", str(tmp_path / "file" / "sub")], "which is a file"),
        (["--out-dir", str(tmp_path / "ro" / "out")], "not writable"),
        (["--cache-dir", str(tmp_path / "file")], "--cache-dir"),
        (["--device", "tpu"], "'tpu' is not a device"),
        (["--device", "cuda:9"], "cuda"),
        (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
        (["--dropout", "1.5"], "argument --dropout"),
        (["--eval-batches", "0"], "argument --eval-batches"),
        (["--top-k", "0"], "argument --top-k"),
        (["--temperature", "-1"], "argument --temperature"),
        (["--steps", "-1"], "argument --steps"),
        (["--beta2", "1"], "argument --beta2"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio"),
        (["--n-embd", "65"], "not divisible"),
        (["--init-from", "out/trian"], "does not exist"),
        (["--resume", "--overwrite"], "pass one of them"),
    ]


# onefile_train.py: one check of --out-dir (made, and a file written in it, so "is a file" and "not writable"
# are the system's words), no --cache-dir or --init-from, and its own wording for --device and numbers.
ONEFILE_SAYS = {"is an existing file": "cannot be written (File exists)", "which is a file": "cannot be written",
                "'tpu' is not a device": "'tpu' is not available here", "'nan' is not a finite number": "'nan' is not"}


@pytest.mark.parametrize("script", ["train", "onefile", "fsdp"])
def test_user_mistakes_end_with_one_line_before_any_work(script, corpus, tmp_path, capsys, monkeypatch):
    (tmp_path / "out").mkdir()  # so that out/trian "looks like" a mistyped local path
    (tmp_path / "ro").mkdir()
    monkeypatch.chdir(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p).startswith(str(tmp_path / "ro"))
                        else real_access(p, mode, **k))
    for flags, expected in mistakes(tmp_path):
        if script == "onefile" and (flags[0] in ("--cache-dir", "--init-from", "--top-k", "--temperature")
                                    or str(tmp_path / "ro" / "out") in flags):
            continue  # not flags onefile has; a read-only directory stops it at the probe file (root passes access)
        if script == "onefile":
            expected = next((said for key, said in ONEFILE_SAYS.items() if key in expected), expected)
        message = main_exits_2(SCRIPTS[script], [*small(script), "--data", corpus, "--out-dir", str(tmp_path / "o"),
                                                 *flags], capsys)
        assert expected in message, (flags, message)
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")  # no run started


# 5. before spending memory, check it (onefile_train.py: a lower bound, and no --force; the estimate is train.py's)
@pytest.mark.parametrize("script", ["train", "onefile", "fsdp"])
def test_an_impossible_run_stops_before_allocating(script, corpus, tmp_path, capsys):
    out = str(tmp_path / "big")
    # 8 x 1,000,000 tokens: hundreds of GiB of activations alone, on any machine (the loss, chunked,
    # no longer makes a block size of 100,000 impossible by its logits).
    message = main_exits_2(SCRIPTS[script], ["--data", corpus, "--block-size", "1000000", "--out-dir", out], capsys)
    assert "the memory estimate" in message and "GiB" in message and "--block-size" in message
    assert "--force" in message or script == "onefile"
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))


def test_force_runs_anyway(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(guards, "available_memory", lambda device: (1 << 20, "available RAM"))
    with pytest.raises(SystemExit):
        train.main([*small("train"), "--data", corpus, "--steps", "1", "--out-dir", str(tmp_path / "a")])
    train.main([*small("train"), "--data", corpus, "--steps", "1", "--out-dir", str(tmp_path / "a"), "--force"])
    assert sorted(step_losses(tmp_path / "a")) == [0]


# 7. estimating never downloads more than config.json
@pytest.mark.parametrize("script", ["train", "fsdp"])
def test_estimate_memory_downloads_only_config_json(script, hub_server, tmp_path, monkeypatch):  # noqa: F811
    endpoint, _, requests, _ = hub_server
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    SCRIPTS[script].main(["--init-from", "gpt2", "--estimate-memory", "--cache-dir", str(tmp_path / "c"),
                          "--out-dir", str(tmp_path / "o"), "--device", "cpu"])
    assert [r.rsplit("/", 1)[-1] for r in requests] == ["config.json"]


# 10. --help: one default per flag, and every flag says what it does
@pytest.mark.parametrize("script", ["train", "onefile", "fsdp"])
def test_help_has_text_and_one_default_per_flag(script):
    parser = SCRIPTS[script].make_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
        assert "default" not in action.help.replace("%(default)s", ""), action.option_strings
    text = parser.format_help()
    assert "(default: the shape's" not in text and text.count("(default: None) (default") == 0


def test_compile_says_so_before_step_0(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda model, **k: model)  # the message is what is tested, not inductor
    train.main([*small("train"), "--data", corpus, "--steps", "1", "--out-dir", str(tmp_path / "c"), "--compile"])
    out = capsys.readouterr().out
    assert "torch.compile: the first step compiles the model" in out
    assert out.index("torch.compile:") < out.index("step     0/1")


# 6. train_fsdp.py --init-from: each rank loads its shards of a train.py checkpoint
@pytest.mark.multiprocess
def test_fsdp_init_from_a_train_py_checkpoint_on_two_ranks(trained, corpus, tmp_path):
    base = trained[0]
    ref = train.main([*small("train"), "--data", corpus, "--steps", "0", "--init-from", base, "--out-dir",
                      str(tmp_path / "t")])
    proc = conftest.torchrun(["train_fsdp.py", *small("fsdp"), "--data", corpus, "--steps", "0", "--init-from", base,
                              "--out-dir", str(tmp_path / "f"), "--no-export"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = read_metrics(tmp_path / "f")
    assert records[-1]["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-5)
    assert ref["val_loss"] == pytest.approx(trained[1]["val_loss"], abs=1e-6)  # the trained weights, not new ones
    per_rank, n_params = records[0]["params_per_rank"], records[0]["n_params"]
    assert len(per_rank) == 2 and max(per_rank) < 0.51 * n_params  # each rank holds about half
