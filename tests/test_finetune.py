"""finetune_lora.py and finetune_qlora.py end to end: learning, PEFT files, merge, interchangeable
adapters, frozen base, the memory estimate, and user mistakes. Ctrl-C and the exact resume are held to
the run contract in tests/test_run_contract.py.

The base is a seeded, untrained 2-layer GPT saved in the Hugging Face layout (a few steps of LoRA
move its held-out loss clearly, which a briefly pretrained base, stuck near the unigram plateau,
does not); the fine-tuning data is the default second domain, the stdlib's own test files.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import finetune_lora
import finetune_qlora
from lib import checkpoint, finetune, gpt, lora, memory, nf4
from tests.conftest import ROOT, read_metrics, step_losses, val_losses

# Fine-tuning flags for the tiny base (the block size, 32, comes from the base's config.json). fp32
# explicitly: on a CPU with native bf16, --dtype auto would compute in bf16 (tests/test_dtype.py).
FT = ["--batch-size", "4", "--eval-batches", "2", "--sample-tokens", "0", "--log-interval", "1", "--eval-interval",
      "100", "--dtype", "fp32"]
SCRIPTS = {"lora": finetune_lora, "qlora": finetune_qlora}


def run(script, base, out_dir, *extra):
    return SCRIPTS[script].main([*FT, "--init-from", base, "--out-dir", str(out_dir), *extra])


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    result = run("lora", base, out, "--steps", "30", "--lr", "1e-2", "--eval-interval", "10",
                 "--lora-targets", "c_attn", "c_proj", "--sample-tokens", "5", "--merge")
    return str(out), result


@pytest.fixture(scope="module")
def qlora_run(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora")
    result = run("qlora", base, out, "--steps", "30", "--lr", "1e-2", "--eval-interval", "10", "--lora-r", "4")
    return str(out), result


def base_model(base_dir):
    cfg, sd = checkpoint.load_hf(base_dir)
    model = gpt.GPT(cfg)
    model.load_state_dict(sd)
    return model.eval(), sd


def logits(model, seed=0):
    idx = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(idx)[0]


def test_lora_run_learns_and_writes_a_peft_adapter(lora_run, base):
    out, result = lora_run
    vals = val_losses(out)
    assert [s for s, _ in vals] == [0, 10, 20, 30]
    assert vals[-1][1] < vals[0][1] - 0.1, vals  # the held-out loss on the new domain drops
    assert result["first_val_loss"] == vals[0][1] and result["val_loss"] == vals[-1][1]
    assert sorted(step_losses(out)) == list(range(30))
    start, end = read_metrics(out)[0], read_metrics(out)[-1]
    assert start["event"] == "start" and start["seed"] == 1337
    assert end["event"] == "end" and isinstance(end["sample_before"], str) and isinstance(end["sample_after"], str)

    # Only A and B train: r * (in + out) per adapted layer; c_proj selects attn.c_proj and mlp.c_proj.
    C, r, L = 64, 8, 2
    assert result["n_trainable"] == L * r * ((C + 3 * C) + (C + C) + (4 * C + C))

    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (8, 16, 0.0)
    assert config["target_modules"] == ["c_attn", "c_proj"]
    assert config["bias"] == "none" and config["fan_in_fan_out"] is True
    assert config["base_model_name_or_path"] == base
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert len(tensors) == L * 3 * 2
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (r, C)
    assert tensors["base_model.model.transformer.h.1.attn.c_attn.lora_B.weight"].shape == (3 * C, r)
    assert tensors["base_model.model.transformer.h.1.mlp.c_proj.lora_A.weight"].shape == (r, 4 * C)


def test_only_the_adapter_changes(lora_run, qlora_run, base):
    _, base_sd = base_model(base)
    model = lora_run[1]["model"]
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(t, base_sd[name.replace(".base_layer", "")]), name  # bit-identical
    # The NF4 base: every stored byte equals a fresh quantisation of the same weights.
    qmodel = qlora_run[1]["model"]
    for name, m in qmodel.named_modules():
        if isinstance(m, nf4.LinearNF4):
            fresh = nf4.LinearNF4.from_linear(_linear(base_sd, name))
            for key, buf in fresh.state_dict().items():
                assert torch.equal(m.state_dict()[key], buf), f"{name}.{key}"
    for name, t in qmodel.named_parameters():
        if not t.requires_grad:
            assert torch.equal(t, base_sd[name.replace(".base_layer", "")]), name
    assert all(".lora_" in n for n, p in qmodel.named_parameters() if p.requires_grad)


def _linear(sd, name):
    w = sd[name.replace(".base_layer", "") + ".weight"]
    linear = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        linear.weight.copy_(w)
        linear.bias.copy_(sd[name.replace(".base_layer", "") + ".bias"])
    return linear


def test_lora_merge_equals_base_plus_adapter(lora_run, base):
    out, result = lora_run
    assert result["merged_dir"] == os.path.join(out, "merged")
    merged, _ = base_model(result["merged_dir"])  # a plain HF GPT-2 directory, as train.py reads it
    with_adapter, _ = base_model(base)
    lora.load_adapter(with_adapter, out)
    torch.testing.assert_close(logits(merged), logits(with_adapter), rtol=0, atol=1e-5)
    assert not torch.allclose(logits(merged), logits(base_model(base)[0]), atol=1e-3)  # the adapter did something


def test_qlora_run_learns_and_merges_the_dequantised_base(qlora_run, base, tmp_path, capsys):
    out, result = qlora_run
    vals = val_losses(out)
    assert vals[-1][1] < vals[0][1] - 0.1, vals
    assert result["n_trainable"] == 2 * 4 * (64 + 3 * 64)  # r=4 on c_attn
    # No --init-from: the base is the one the adapter names (adapter_config.json), not the default out/train.
    merged = finetune_qlora.main([*FT, "--out-dir", str(tmp_path), "--adapter", out, "--steps", "0",
                                  "--merge"])["merged_dir"]
    assert f"--adapter {out} was made on {base} (adapter_config.json); using it as the base" in capsys.readouterr().out
    expected = finetune.load_base(base, "cpu", lambda name, linear: nf4.LinearNF4.from_linear(linear))
    lora.load_adapter(expected, out)
    torch.testing.assert_close(logits(base_model(merged)[0]), logits(expected), rtol=0, atol=1e-4)


def test_adapters_are_interchangeable(lora_run, qlora_run, base, tmp_path):
    # The QLoRA adapter on the full-precision base ...
    q_out, q_result = qlora_run
    res = run("lora", base, tmp_path / "a", "--adapter", q_out, "--steps", "0")
    saved = load_file(os.path.join(q_out, "adapter_model.safetensors"))
    got = lora.adapter_state_dict(res["model"])
    assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    # ... scores as on the NF4 base it was trained on, up to the quantisation error, and far from the base.
    assert res["val_loss"] == pytest.approx(q_result["val_loss"], abs=0.05)
    assert res["val_loss"] < q_result["first_val_loss"] - 0.1
    # And the LoRA adapter on the NF4 base.
    l_out, l_result = lora_run
    res = run("qlora", base, tmp_path / "b", "--adapter", l_out, "--steps", "0")
    assert res["val_loss"] == pytest.approx(l_result["val_loss"], abs=0.05)
    assert res["val_loss"] < l_result["first_val_loss"] - 0.1


@pytest.mark.parametrize("script", ["lora", "qlora"])
def test_missing_default_checkpoint_is_one_line(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no out/train here
    with pytest.raises(SystemExit) as exit_info:
        SCRIPTS[script].main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ")
    assert "python train.py" in err and "--init-from" in err


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_bad_adapter_is_named_before_the_default_base_is_looked_for(damage, tmp_path, monkeypatch, capsys):
    # No --init-from: the base comes from the adapter's config, so a bad --adapter is the one line, not "no base".
    monkeypatch.chdir(tmp_path)  # no out/train here
    adapter = tmp_path / "adapter"
    if damage == "truncated":
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "ba')
    with pytest.raises(SystemExit) as exit_info:
        finetune_lora.main(["--adapter", str(adapter), "--steps", "0"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.count("\n") == 0 and err.startswith(f"error: --adapter {adapter}: ")
    assert ("no such directory" if damage == "missing" else "adapter_config.json line 1") in err, err


def test_estimate_memory_matches_the_loaded_model(base, tmp_path):
    """The arithmetic estimate of the base and LoRA bytes equals what the loaded models hold."""
    for script, base_key in (("lora", "base weights (fp32 blocks, fp32 embeddings)"),
                             ("qlora", "base weights (NF4 blocks, fp32 embeddings)")):
        est = run(script, base, tmp_path, "--estimate-memory", "--lora-targets", "c_fc")
        convert = (lambda n, lin: nf4.LinearNF4.from_linear(lin)) if script == "qlora" else None
        model = finetune.load_base(base, "cpu", convert)
        lora.apply_lora(model, ["c_fc"], r=8)
        frozen = [t for t in [*model.parameters(), *model.buffers()] if not t.requires_grad]
        assert est[base_key] == sum(t.numel() * t.element_size() for t in frozen)
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        assert est["LoRA parameters (fp32)"] == trainable == est["LoRA gradients (fp32)"]
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # nothing trained, nothing written


@pytest.mark.parametrize("targets,amp,dropout", [(["c_attn"], False, 0.0), (["c_attn", "c_proj", "c_fc"], False, 0.0),
                                                 (["c_fc"], True, 0.0), (["c_proj"], False, 0.1),
                                                 (["mlp.c_proj"], True, 0.1), (["attn.c_proj"], False, 0.0)])
def test_activation_estimate_matches_what_autograd_keeps(targets, amp, dropout):
    """lora_activation_bytes against the tensors autograd actually saves (counted with saved-tensor hooks)."""
    cfg = gpt.GPTConfig(n_layer=3, n_head=2, n_embd=64, block_size=32)

    def saved_bytes(batch):
        torch.manual_seed(0)
        model = gpt.GPT(cfg).requires_grad_(False)
        lora.apply_lora(model, targets, r=8, dropout=dropout)
        weights = {t.untyped_storage().data_ptr() for t in model.parameters()}
        seen = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        idx = torch.randint(0, 50257, (batch, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", enabled=amp):
            model(idx, idx)
        return sum(seen.values())

    # The difference between two batch sizes cancels what does not scale with the batch (autocast's
    # weight copies) and leaves activations plus what the chunked loss keeps for backward: the gradient
    # of the final hidden states, made in forward, fp32 (lib/lm_loss; no logits are kept).
    measured = saved_bytes(6) - saved_bytes(2)
    predicted = (memory.lora_activation_bytes(cfg, 6, 32, amp, targets, 8, dropout)
                 - memory.lora_activation_bytes(cfg, 2, 32, amp, targets, 8, dropout) + 4 * 32 * cfg.n_embd * 4)
    assert measured == pytest.approx(predicted, rel=0.005)


def test_estimate_for_gpt2_xl_reads_no_weights(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any download attempt would be an error
    lora_est = finetune_lora.main(["--init-from", "gpt2-xl", "--estimate-memory", "--batch-size", "1"])
    qlora_est = finetune_qlora.main(["--init-from", "gpt2-xl", "--estimate-memory", "--batch-size", "1"])
    fp32_base = lora_est["base weights (fp32 blocks, fp32 embeddings)"]
    nf4_base = qlora_est["base weights (NF4 blocks, fp32 embeddings)"]
    assert 1557e6 * 4 < fp32_base < 1559e6 * 4  # gpt2-xl's 1.558 billion parameters
    block_weights = 48 * 12 * 1600 ** 2
    # 4 bits per weight + int8 absmax per 64 + fp32 scale per 16384, on the block weights only.
    assert nf4_base == pytest.approx(fp32_base - block_weights * 4
                                     + block_weights * (0.5 + 1 / 64 + 4 / 16384), rel=1e-6)


def test_user_mistakes_end_with_one_line(base, lora_run, tmp_path, capsys):
    def expect(script, args, *fragments):
        with pytest.raises(SystemExit) as exit_info:
            run(script, base, tmp_path, *args)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        for fragment in fragments:
            assert fragment in err, err

    expect("lora", ["--adapter", str(tmp_path / "nowhere")], "nowhere: no such directory")
    expect("qlora", ["--lora-targets", "c_attn", "wte"], "--lora-targets wte", "c_fc")
    expect("lora", ["--resume"], "training_state.pt does not exist")
    expect("qlora", ["--nf4-block-size", "7"], "--nf4-block-size")
    expect("lora", ["--block-size", "64"], "exceeds the base model's 32 positions")
    # An adapter whose tensors do not fit: the message names the file and the key.
    bad = tmp_path / "bad_adapter"
    bad.mkdir()
    config = json.load(open(os.path.join(lora_run[0], "adapter_config.json")))
    json.dump(config, open(bad / "adapter_config.json", "w"))
    tensors = load_file(os.path.join(lora_run[0], "adapter_model.safetensors"))
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
    tensors[key] = tensors[key][:, :32].contiguous()
    from safetensors.torch import save_file
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    expect("qlora", ["--adapter", str(bad)], "adapter_model.safetensors", key, "[8, 32]")


def test_each_script_holds_its_base_as_its_recipe_says():
    """finetune_qlora.py's difference is its recipe_for, which finetune_lora.run follows; the GPU
    branches are decided from (device, amp) alone, so they are checked here without a GPU."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    linear = torch.nn.Linear(64, 192)
    args = finetune_qlora.make_parser().parse_args([])
    q = finetune_qlora.recipe_for(args, cpu, None)
    assert (q.base, q.lora_dtype, q.merge_in_place) == ("nf4", torch.float32, True)
    assert q.estimate_kwargs == {"nf4_block_size": 64, "double_quant": True}
    held = q.convert_linear("transformer.h.0.attn.c_attn", linear)
    assert isinstance(held, nf4.LinearNF4) and held.block_size == 64
    assert held.weight_packed.numel() == 64 * 192 // 2 and held.weight_absmax.dtype == torch.int8  # double quant
    # A and B in bf16 only on a GPU computing in bf16 (the QLoRA paper), unless --lora-dtype says otherwise.
    assert finetune_qlora.recipe_for(args, cuda, torch.bfloat16).lora_dtype == torch.bfloat16
    assert finetune_qlora.recipe_for(args, cuda, torch.float16).lora_dtype == torch.float32
    args = finetune_qlora.make_parser().parse_args(["--lora-dtype", "fp32", "--dtype", "bf16", "--nf4-block-size",
                                                    "128", "--no-double-quant"])
    assert finetune_qlora.recipe_for(args, cuda, torch.bfloat16).lora_dtype == torch.float32
    held = finetune_qlora.recipe_for(args, cpu, None).convert_linear("x", linear)
    assert held.block_size == 128 and held.weight_absmax.dtype == torch.float32 and held.weight_absmax.numel() == 96
    # finetune_lora.py: the frozen block weights in the autocast dtype, A and B in fp32, merged into a fresh base.
    lora_args = finetune_lora.make_parser().parse_args([])
    for amp, name in ((None, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        r = finetune_lora.recipe_for(lora_args, cuda, amp)
        assert (r.base, r.lora_dtype, r.merge_in_place) == (name, torch.float32, False)
        assert r.convert_linear("x", linear).weight.dtype == (amp or torch.float32)


def test_help_and_running_as_a_script(capsys):
    for module in SCRIPTS.values():
        with pytest.raises(SystemExit) as exit_info:
            module.main(["--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert "--lora-targets" in text and "(default: 200)" in text and "--estimate-memory" in text
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "scripts.finetune_qlora", "--init-from", "gpt2", "--estimate-memory"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "base weights (NF4 blocks, fp32 embeddings)" in out.stdout


def test_flops_per_token_counts_six_per_trainable_and_four_per_frozen_parameter():
    """Per token: a frozen weight costs 2 (forward) + 2 (input gradient); a LoRA weight 2 more for its own
    gradient. n_params counts both (lora.count_parameters), so 900 frozen + 100 LoRA, no attention term:
    900 * 4 + 100 * 6 = 4200. The attention term is lib.metrics': 12 * layers * width * block."""
    assert finetune.flops_per_token(1000, 100, 0, 64, 128) == 900 * 4 + 100 * 6
    assert finetune.flops_per_token(1000, 100, 2, 64, 128) == 4200 + 12 * 2 * 64 * 128
