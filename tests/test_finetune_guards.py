"""finetune_lora.py and finetune_qlora.py as a careless user drives them: nothing saved is
lost or replaced, non-finite weights are never written, --resume refuses flags that contradict the
saved run, every mistake is one line and exit 2 before any work, and a run that cannot fit in memory
stops before it allocates. Tiny base (2 layers, 64 wide), a one-file corpus, a few steps at most.
"""

import functools
import http.server
import json
import os
import shutil
import stat
import sysconfig
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import finetune_lora
import finetune_qlora
from lib import guards, optim
from lib.checkpoint import current_umask
from tests.conftest import read_metrics, val_losses

SCRIPTS = {"lora": finetune_lora, "qlora": finetune_qlora}
HUGE = {"model_type": "gpt2", "n_layer": 96, "n_head": 128, "n_embd": 16384, "n_positions": 2048, "vocab_size": 50257}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One small text file (the stdlib's json package, about 60 KB): tokenised in a moment."""
    path = tmp_path_factory.mktemp("corpus") / "json.txt"
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    path.write_text("".join(open(os.path.join(src, n)).read() for n in sorted(os.listdir(src)) if n.endswith(".py")))
    return str(path)


@pytest.fixture
def ft(base, corpus):
    """main([...]) of a script with the tiny flags; returns its result."""
    def run(script, out_dir, *extra, init_from=base):
        flags = ["--data", corpus, "--batch-size", "2", "--eval-batches", "1", "--sample-tokens", "0",
                 "--log-interval", "1", "--eval-interval", "100", "--dtype", "fp32", "--out-dir", str(out_dir)]
        return SCRIPTS[script].main([*flags, *(["--init-from", init_from] if init_from else []), *extra])
    return run


@pytest.fixture(scope="module")
def done(base, corpus, tmp_path_factory):
    """A finished 2-step LoRA run with --merge; tests copy it before touching it."""
    out = tmp_path_factory.mktemp("done")
    finetune_lora.main(["--init-from", base, "--data", corpus, "--batch-size", "2", "--eval-batches", "1",
                        "--sample-tokens", "0", "--dtype", "fp32", "--out-dir", str(out), "--steps", "2", "--merge"])
    return str(out)


def copy_of(done, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(done, dest)
    return str(dest)


def snapshot(out_dir):
    return {name: open(os.path.join(out_dir, name), "rb").read()
            for name in sorted(os.listdir(out_dir)) if os.path.isfile(os.path.join(out_dir, name))}


def fails(capsys, call, *fragments):
    """call() exits 2 with one `error: ...` line on stderr (argparse: its usage, then one error line)."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    line = err.splitlines()[-1]
    assert "error: " in line and (line == err or err.startswith("usage: ")), err
    for fragment in fragments:
        assert fragment in line, line
    return line


# --- work is never lost ---------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["lora", "qlora"])
def test_nonfinite_adapter_is_never_saved_and_the_stop_names_the_last_finite_one(script, ft,
                                                                                 tmp_path, monkeypatch, capsys):
    real_lr_at = optim.lr_at  # finetune_qlora.py runs finetune_lora.py's loop, which calls lib.optim.lr_at
    # Steps 0 and 1 are ordinary; step 2's learning rate sends A and B to infinity.
    monkeypatch.setattr(optim, "lr_at", lambda step, *a: 1e39 if step == 2 else real_lr_at(step, *a))
    out = tmp_path / "out"
    line = fails(capsys, lambda: ft(script, out, "--steps", "5", "--save-interval", "1"),
                 "weights are not finite at step 3", "nothing was saved",
                 f"the last finite checkpoint is step 2 in {out}")
    state = torch.load(out / "training_state.pt", weights_only=True)
    assert state["step"] == 2 and all(torch.isfinite(t).all() for t in state["trainable"].values())
    adapter = load_file(out / "adapter_model.safetensors")
    assert len(adapter) == 4 and all(torch.isfinite(t).all() for t in adapter.values()), line
    # The adapter on disk is step 2's, the one the training state holds.
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"
    assert torch.equal(adapter[key], state["trainable"]["transformer.h.0.attn.c_attn.lora_B.weight"])


def test_nan_loss_with_nothing_saved_says_so(ft, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(optim, "lr_at", lambda step, *a: 1e39)  # step 0 ruins A and B, step 1's loss is NaN
    out = tmp_path / "out"
    fails(capsys, lambda: ft("lora", out, "--steps", "3"),
          "loss became nan at step 1", "no finite checkpoint was saved in this run")
    assert not (out / "adapter_model.safetensors").exists() and not (out / "training_state.pt").exists()


def test_nonfinite_gradient_skips_the_update(ft, tmp_path, monkeypatch):
    real_clip, calls = torch.nn.utils.clip_grad_norm_, []

    def clip(params, max_norm):
        calls.append(real_clip(params, max_norm))
        return torch.tensor(float("nan")) if len(calls) == 2 else calls[-1]  # step 1's gradient "overflows"

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    out = tmp_path / "out"
    ft("lora", out, "--steps", "3")
    records = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert [records[s]["skipped"] for s in range(3)] == [False, True, False]
    assert records[1]["grad_norm"] is None and records[2]["grad_norm"] > 0
    state = torch.load(out / "training_state.pt", weights_only=True)
    # AdamW stepped twice, not three times
    assert all(int(s["step"]) == 2 for s in state["optimizer"]["state"].values())


def test_fresh_run_refuses_a_saved_run_and_overwrite_replaces_it(ft, done, base, tmp_path, capsys, monkeypatch):
    out = copy_of(done, tmp_path)
    before = snapshot(out)
    fails(capsys, lambda: ft("lora", out, "--steps", "0"), f"{out} already holds a saved run",
          "--resume", "--overwrite")
    fails(capsys, lambda: ft("qlora", out, "--steps", "3"), "already holds a saved run")
    fails(capsys, lambda: ft("lora", out, "--steps", "0", "--adapter", out), "already holds a saved run")
    fails(capsys, lambda: ft("lora", out, "--steps", "0", "--adapter", out, "--overwrite"),
          "--adapter and --out-dir are the same directory")  # refused before --overwrite removes anything
    assert snapshot(out) == before and snapshot(os.path.join(out, "merged")) == snapshot(os.path.join(done, "merged"))
    # Nothing, not even --overwrite, writes into the base directory; a merged model is replaced only with --overwrite.
    fails(capsys, lambda: ft("lora", base, "--steps", "1", "--overwrite"), "is the base model's directory")
    os.makedirs(tmp_path / "cwd" / "out")  # the default base, out/train, as train.py leaves it
    shutil.copytree(base, tmp_path / "cwd" / "out" / "train")
    monkeypatch.chdir(tmp_path / "cwd")
    fails(capsys, lambda: ft("qlora", "out/train", "--steps", "1", "--overwrite", init_from=None),
          "--out-dir out/train is the base model's directory")
    fails(capsys, lambda: ft("lora", out, "--steps", "1", "--merge", "--overwrite",
                             init_from=os.path.join(out, "merged")),
          "--merge would write", "the base model's directory")
    os.makedirs(tmp_path / "m" / "merged")
    shutil.copy(os.path.join(out, "merged", "model.safetensors"), tmp_path / "m" / "merged")
    fails(capsys, lambda: ft("lora", tmp_path / "m", "--steps", "0", "--merge"),
          "already holds a saved run (merged/model.safetensors)", "--overwrite")

    ft("lora", out, "--steps", "1", "--overwrite")
    assert snapshot(out)["adapter_model.safetensors"] != before["adapter_model.safetensors"]
    starts = [r for r in read_metrics(out) if r.get("event") == "start"]
    # a fresh metrics.jsonl, not the old run's plus this one
    assert len(starts) == 1 and starts[0]["args"]["steps"] == 1


def test_resume_refuses_contradicting_flags_and_reports_changed_ones(ft, done, base, tmp_path, capsys):
    out = copy_of(done, tmp_path)
    before = snapshot(out)
    fails(capsys, lambda: ft("lora", out, "--resume", "--lora-r", "16"),
          "--lora-r 16 contradicts the saved run (--lora-r 8)")
    fails(capsys, lambda: ft("lora", out, "--resume", "--batch-size", "4"),
          "--batch-size 4 contradicts", "(--batch-size 2)")
    fails(capsys, lambda: ft("lora", out, "--resume", "--lora-targets", "c_fc"), "--lora-targets")
    fails(capsys, lambda: ft("lora", out, "--resume", "--block-size", "16"),
          "--block-size 16 contradicts", "(--block-size 32)")
    fails(capsys, lambda: ft("lora", out, "--resume", init_from=os.path.join(out, "merged")), "--init-from", base)
    fails(capsys, lambda: ft("lora", out, "--resume", "--overwrite"), "pass one of them")
    fails(capsys, lambda: ft("qlora", out, "--resume"), "was made by finetune_lora.py",
          "continue it with finetune_lora.py")
    pretrained = tmp_path / "pretrained"  # what train.py leaves: a training state without LoRA in it
    pretrained.mkdir()
    torch.save({"step": 3, "optimizer": {}}, pretrained / "training_state.pt")
    fails(capsys, lambda: ft("lora", pretrained, "--resume", init_from=None), "adapter_model.safetensors is missing")
    assert snapshot(out) == before
    capsys.readouterr()
    # Given again with the saved value, or not given: fine. Steps and learning rate may change, and say so.
    result = ft("lora", out, "--resume", "--block-size", "32", "--lora-r", "8", "--steps", "3", "--lr", "1e-3")
    said = capsys.readouterr().out
    assert "--resume: --steps changed from 2 to 3" in said and "--resume: --lr changed from 0.005 to 0.001" in said
    # "before" is the run's real first held-out loss, from the saved state, not the resumed model's.
    first = val_losses(done)[0]
    assert first[0] == 0 and result["first_val_loss"] == first[1]
    assert torch.load(os.path.join(out, "training_state.pt"), weights_only=True)["step"] == 3


# --- one line, exit 2, before any work -----------------------------------------------------------
def test_mistakes_are_one_line_before_any_work(ft, done, base, tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    (tmp_path / "merged").write_text("x")  # where --merge would write, with --out-dir tmp_path
    out = tmp_path / "never"
    cases = [
        (["--out-dir", str(a_file)], "--out-dir", "is an existing file"),
        (["--out-dir", str(a_file / "sub")], "which is a file"),
        (["--cache-dir", str(a_file)], "--cache-dir", "is an existing file"),
        (["--device", "tpu"], "--device 'tpu'"),
        (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
        (["--dropout", "1.5"], "unrecognized arguments: --dropout"),
        (["--lora-dropout", "1.5"], "argument --lora-dropout: '1.5' must be at least 0 and below 1"),
        (["--eval-batches", "0"], "argument --eval-batches"),
        (["--top-k", "0"], "argument --top-k"),
        (["--temperature", "0"], "argument --temperature"),
        (["--lora-r", "0"], "argument --lora-r"),
        (["--lora-alpha", "0"], "argument --lora-alpha"),
        (["--steps", "-1"], "argument --steps"),
        (["--block-size", "0"], "argument --block-size"),
        (["--grad-clip", "inf"], "argument --grad-clip"),
        (["--beta2", "1"], "argument --beta2"),
        (["--seed", "-1"], "argument --seed"),
        (["--seed", str(2**40)], "--seed"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio"),
        (["--save-interval", "0"], "argument --save-interval"),
        (["--data", str(tmp_path / "nowhere")], "--data", "does not exist"),
        (["--merge", "--out-dir", str(tmp_path)], "--merge writes the directory", "which is an existing file"),
        (["--adapter", str(a_file)], f"--adapter {a_file}: no such directory"),
        (["--block-size", "64"], "exceeds the base model's 32 positions"),
    ]
    for args, *fragments in cases:
        fails(capsys, lambda: ft("lora", out, *args), *fragments)
    fails(capsys, lambda: ft("qlora", out, "--nf4-block-size", "0"), "argument --nf4-block-size")
    fails(capsys, lambda: ft("qlora", out, "--lora-dropout", "1"), "argument --lora-dropout")

    # Broken adapters: each a copy of a good one with one thing wrong.
    def adapter(name, config=None, tensors=None, raw=None):
        d = tmp_path / name
        d.mkdir()
        good = json.load(open(os.path.join(done, "adapter_config.json")))
        if config != "missing":
            (d / "adapter_config.json").write_text(config if isinstance(config, str)
                                                   else json.dumps({**good, **(config or {})}))
        if raw is not None:
            (d / "adapter_model.safetensors").write_bytes(raw)
        else:
            save_file(tensors or load_file(os.path.join(done, "adapter_model.safetensors")),
                      str(d / "adapter_model.safetensors"))
        return str(d)

    whole = open(os.path.join(done, "adapter_model.safetensors"), "rb").read()
    nan = load_file(os.path.join(done, "adapter_model.safetensors"))
    nan[next(iter(nan))][0, 0] = float("nan")
    for script in ("lora", "qlora"):
        broken = [
            (adapter(f"{script}-truncated", raw=whole[: len(whole) // 2]), "adapter_model.safetensors cannot be read",
             "truncated or corrupted"),
            (adapter(f"{script}-garbage", raw=b"\x00" * 4 + os.urandom(60)), "cannot be read as safetensors"),
            (adapter(f"{script}-nan", tensors=nan), "holds NaN or inf in 1 tensors"),
            (adapter(f"{script}-noconfig", config="missing"), "adapter_config.json not found"),
            (adapter(f"{script}-garbled", config='{"r": 8,'), "adapter_config.json line 1 column"),
            (adapter(f"{script}-rank", config={"r": "eight"}), "has r 'eight'; it must be a positive integer"),
            (adapter(f"{script}-r4", config={"r": 4}), "has shape [8, 64]", "imply [4, 64]"),
            (adapter(f"{script}-targets", config={"target_modules": ["c_fc"]}), "is not a LoRA matrix of the layers"),
            (adapter(f"{script}-llama", config={"target_modules": ["q_proj"]}), "target 'q_proj'",
             "selects no block linear"),
        ]
        for path, *fragments in broken:
            fails(capsys, lambda: ft(script, out, "--adapter", path, "--steps", "0"), f"--adapter {path}", *fragments)

    # A read-only --out-dir (root writes anywhere: pretend to be a user the mode stops).
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(ro, os.W_OK):
            monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(ro)))
        fails(capsys, lambda: ft("qlora", ro / "out"), "--out-dir", "is not writable")
    finally:
        ro.chmod(stat.S_IRWXU)
    if os.path.isdir("/sys/kernel"):  # Linux: a file system that refuses even root, caught by a probe write
        fails(capsys, lambda: ft("lora", "/sys/byhand-test", "--steps", "1"),
              "--out-dir /sys/byhand-test cannot be written")
    assert not out.exists() or not any(out.iterdir())  # every one stopped before writing anything


def test_memory_precheck_stops_an_impossible_run_before_it_allocates(ft, tmp_path, capsys):
    huge = tmp_path / "huge"  # config.json only: a 100-billion-parameter shape, and no weights at all
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps(HUGE))
    available, what = guards.available_memory(torch.device("cpu"))
    for script in ("lora", "qlora"):
        fails(capsys, lambda: ft(script, tmp_path / "out", "--steps", "1", init_from=str(huge)),
              "the memory estimate (", f"exceeds the {guards.format_bytes(available)} of {what} on cpu",
              "lower --batch-size", "or pass --force")
    # --force goes on to the next check, the missing weights: nothing was allocated or prepared on the way.
    fails(capsys, lambda: ft("lora", tmp_path / "out", "--steps", "1", "--force", init_from=str(huge)),
          "model.safetensors is missing")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.fixture
def hub_with_only_a_config(tmp_path, monkeypatch):
    """A local stand-in for the hub that serves someone/huge's config.json and nothing else."""
    www = tmp_path / "www" / "someone" / "huge" / "resolve" / "main"
    www.mkdir(parents=True)
    (www / "config.json").write_text(json.dumps(HUGE))
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Handler, directory=str(tmp_path / "www")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield requests
    server.shutdown()
    server.server_close()


def test_estimate_and_memory_check_download_only_config_json(hub_with_only_a_config, ft, tmp_path, capsys):
    requests = hub_with_only_a_config
    estimate = ft("qlora", tmp_path / "out", "--estimate-memory", "--cache-dir", str(tmp_path / "cache"),
                  init_from="someone/huge")
    assert sum(estimate.values()) > 100 * 2**30  # the NF4 base alone is 152 GiB
    assert requests == ["/someone/huge/resolve/main/config.json"]
    fails(capsys, lambda: ft("lora", tmp_path / "out", "--cache-dir", str(tmp_path / "cache"),
                             init_from="someone/huge"),
          "the memory estimate")
    assert requests == ["/someone/huge/resolve/main/config.json"]  # the weights were never asked for


# --- smaller things -------------------------------------------------------------------------------
def test_help_has_one_default_per_flag_and_help_for_every_flag():
    for module in SCRIPTS.values():
        parser = module.make_parser()
        formatter = parser.formatter_class(prog="x")
        for action in parser._actions:
            text = formatter._get_help_string(action)
            assert text and text.strip(), action.option_strings
            assert text.count("(default:") <= 1 and "(default: None)" not in text, text
        assert "--overwrite" in parser.format_help() and "--force" in parser.format_help()


def test_adapter_and_merged_files_keep_the_umask_mode(done):
    mode = 0o666 & ~current_umask()
    for path in ("adapter_model.safetensors", "adapter_config.json", "training_state.pt", "merged/model.safetensors"):
        assert stat.S_IMODE(os.stat(os.path.join(done, path)).st_mode) == mode, path
