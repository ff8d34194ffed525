"""train.py end to end: learning, exact resume, the HF layout, memory estimate, and user mistakes. Ctrl-C,
saved runs and damaged files: tests/test_run_contract.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import train
from lib import checkpoint, gpt
from tests.conftest import ROOT, TINY, read_metrics, step_losses, val_losses


def run_train(out_dir, data_dir, *extra):
    return train.main([*TINY, "--data", data_dir, "--out-dir", str(out_dir), *extra])


def test_tiny_run_learns_and_writes_everything(tmp_path, text_dir):
    result = run_train(tmp_path, text_dir, "--steps", "30", "--eval-interval", "10", "--lr", "3e-3",
                       "--warmup-steps", "5", "--sample-tokens", "8", "--peak-flops", "1e12")
    vals = val_losses(tmp_path)
    assert [s for s, _ in vals] == [0, 10, 20, 30]
    assert vals[0][1] > 10.0  # ~ln(50257) at the start
    assert vals[-1][1] < vals[0][1] - 3.0  # 30 steps on real Python source: far below the start
    records = read_metrics(tmp_path)
    start, end = records[0], records[-1]
    assert start["event"] == "start" and start["seed"] == 1337 and start["n_params"] > 0
    assert end["event"] == "end" and end["peak_memory"] > 0 and isinstance(end["sample"], str)
    assert sorted(step_losses(tmp_path)) == list(range(30))
    logged = [r for r in records if "tokens_per_s" in r]
    assert len(logged) == 30 and all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in logged)
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.json", "metrics.jsonl", "model.safetensors",
                                       "training_state.pt"]
    assert result["val_loss"] == vals[-1][1]


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path, text_dir):
    common = ["--steps", "8", "--eval-interval", "4", "--grad-accum", "2", "--dropout", "0.1"]
    run_train(tmp_path / "straight", text_dir, *common)
    # Stop after 4 steps (as if interrupted), then resume to 8.
    run_train(tmp_path / "split", text_dir, *common[:1], "4", *common[2:])
    run_train(tmp_path / "split", text_dir, *common, "--resume")
    straight, split = step_losses(tmp_path / "straight"), step_losses(tmp_path / "split")
    assert sorted(split) == list(range(8))
    for step in range(8):  # dropout on: the RNG state is restored too
        assert split[step] == pytest.approx(straight[step], abs=1e-6), step
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(tmp_path / "split" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_checkpoint_is_the_transformers_gpt2_layout(tmp_path, text_dir):
    run_train(tmp_path, text_dir, "--steps", "2")
    config = json.load(open(tmp_path / "config.json"))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["n_positions"],
            config["vocab_size"]) == (2, 2, 64, 32, 50257)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["transformer.wte.weight"].shape == (50257, 64)
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: [in, out]
    assert tensors["transformer.h.1.mlp.c_proj.weight"].shape == (256, 64)
    assert "lm_head.weight" not in tensors
    assert checkpoint.weights_step(str(tmp_path / "model.safetensors")) == 2
    # Round trip: the loader rebuilds a model whose logits equal a fresh conversion's.
    cfg, sd = checkpoint.load_hf(str(tmp_path))
    model = gpt.GPT(cfg)
    model.load_state_dict(sd)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    hf_again = gpt.to_hf_state_dict(model)
    assert set(hf_again) == set(tensors)
    for k in tensors:
        assert torch.equal(hf_again[k], tensors[k])


def test_init_from_a_local_checkpoint_starts_where_it_ended(tmp_path, text_dir):
    run_train(tmp_path / "base", text_dir, "--steps", "10", "--eval-interval", "100")
    end_val = val_losses(tmp_path / "base")[-1][1]
    run_train(tmp_path / "more", text_dir, "--steps", "1", "--eval-interval", "1", "--init-from",
              str(tmp_path / "base"))
    assert val_losses(tmp_path / "more")[0][1] == pytest.approx(end_val, abs=1e-5)


def test_estimate_memory_prints_and_exits(tmp_path, capsys):
    est = train.main(["--model-size", "gpt2", "--batch-size", "8", "--estimate-memory", "--out-dir",
                      str(tmp_path), "--device", "cpu"])
    out = capsys.readouterr().out
    assert "124,439,808 parameters" in out and "memory estimate" in out
    assert est["parameters (fp32)"] == 124_439_808 * 4
    assert est["AdamW moments (2 x fp32)"] == 124_439_808 * 8
    # The loss never holds the 8 x 1024 x 50,257 logits (lib/lm_loss): one chunk of fp32 logits (128 MiB are 647 rows
    # of 50,257 + 2 x 768 floats, so 8,192 tokens are 13 chunks of 631 rows), and d_hidden, [8 x 1024, 768] in fp32,
    # from forward to backward; the tied embedding has a second [50,257, 768] gradient for a moment.
    assert est["loss (one chunk of logits)"] == 631 * 50257 * 4 + 8 * 1024 * 768 * 4
    assert est["tied embedding's second gradient"] == 50257 * 768 * 4
    assert not os.listdir(tmp_path)  # nothing trained, nothing written


def test_measured_peak_is_printed_beside_the_estimate(tmp_path, text_dir, capsys):
    run_train(tmp_path, text_dir, "--steps", "1")
    out = capsys.readouterr().out
    assert "total (predicted peak)" in out and "measured (peak RSS)" in out


def expect_user_error(capsys, argv, pattern):
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert pattern in err[0], err[0]


def test_user_mistakes_end_with_one_line(tmp_path, text_dir, capsys):
    out = ["--out-dir", str(tmp_path / "o")]
    expect_user_error(capsys, [*TINY, *out, "--data", str(tmp_path / "missing.txt")], "does not exist")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("\n")
    expect_user_error(capsys, [*TINY, *out, "--data", str(tmp_path / "empty")], "is empty")
    (tmp_path / "small.txt").write_text("tiny corpus " * 20)
    expect_user_error(capsys, [*TINY, *out, "--data", str(tmp_path / "small.txt")], "fewer than block_size")
    not_gpt2 = tmp_path / "not_gpt2"
    not_gpt2.mkdir()
    (not_gpt2 / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    expect_user_error(capsys, [*TINY, *out, "--data", text_dir, "--init-from", str(not_gpt2)], "not a GPT-2 config")
    expect_user_error(capsys, [*TINY, *out, "--data", text_dir, "--init-from", str(tmp_path / "no_such_dir")],
                      "does not exist")
    small_vocab = tmp_path / "small_vocab"
    cfg = gpt.GPTConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=2, n_embd=64)  # TINY's shape
    checkpoint.save_hf(str(small_vocab), cfg, gpt.to_hf_state_dict(gpt.GPT(cfg)))
    expect_user_error(capsys, [*TINY, *out, "--data", text_dir, "--init-from", str(small_vocab)], "vocabulary mismatch")
    expect_user_error(capsys, [*TINY, *out, "--data", text_dir, "--resume"], "training_state.pt does not exist")


def test_nan_loss_stops_names_the_step_and_keeps_the_last_checkpoint(tmp_path, text_dir, capsys, monkeypatch):
    run_train(tmp_path, text_dir, "--steps", "4", "--save-interval", "2")
    saved = load_file(tmp_path / "model.safetensors")
    real_forward = gpt.GPT.forward

    def nan_after_two_steps(self, idx, targets=None):
        logits, loss = real_forward(self, idx, targets)
        calls.append(1)
        return logits, (loss * float("nan") if targets is not None and len(calls) > 2 and self.training else loss)

    calls = []
    monkeypatch.setattr(gpt.GPT, "forward", nan_after_two_steps)
    expect_user_error(capsys, [*TINY, "--data", text_dir, "--out-dir", str(tmp_path), "--steps", "8", "--resume",
                               "--eval-interval", "100", "--save-interval", "100"],
                      "loss became nan at step 6")  # steps 4, 5 fine
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main([*TINY, "--data", text_dir, "--out-dir", str(tmp_path), "--steps", "8", "--resume",
                    "--save-interval", "100"])
    assert f"the last finite checkpoint is step 4 in {tmp_path}" in capsys.readouterr().err
    after = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(saved[k], after[k]) for k in saved)  # the last good checkpoint is untouched


def test_runs_as_module_and_through_the_scripts_package(tmp_path):
    for args in (["-m", "scripts.train", "--help"], ["train.py", "--help"]):  # python -m NAME: tests/test_cli.py
        res = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "--model-size" in res.stdout and "(default: tiny)" in res.stdout, res.stderr
