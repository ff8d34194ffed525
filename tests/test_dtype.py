"""--dtype auto on a CPU: bf16 where the CPU has it natively, else fp32, decided from what the CPU supports
(lib/device.cpu_has_native_bf16), never from a timing; and the parity pairs under bf16.

bf16 runs about 50x slower than fp32 on a CPU without bf16 units (the AVX2 machines CI runs on), so
the bf16 runs here are tiny: 2 layers, 64 wide, block 32, a few steps.
"""
import os

import pytest
import torch
from safetensors.torch import load_file

import finetune_qlora
import onefile_train
import train
from lib import device as devices
from tests.conftest import TINY, read_metrics, step_losses, val_losses

CPU = torch.device("cpu")


@pytest.mark.parametrize("capability, flags, native", [
    ("AVX512", {"fpu", "avx512f", "avx512_bf16"}, True),           # Zen 4, Cooper Lake
    ("AVX512", {"avx512f", "amx_tile", "amx_bf16"}, True),         # Sapphire Rapids (AMX)
    ("AVX512", {"avx512f", "avx512_vnni"}, False),                 # Skylake-SP, Ice Lake: AVX-512 without bf16
    ("AVX2", {"avx2", "fma"}, False),                              # Zen 2 (CI's machine)
    ("AVX2", {"avx2", "avx512_bf16"}, False),                      # bf16 units, but torch runs AVX2 kernels
    ("DEFAULT", set(), False),                                     # Apple silicon, plain arm64
    ("SVE256", {"sve", "bf16"}, False),                            # arm's bf16: not checked, fp32
])
def test_native_bf16_from_capability_and_flags(capability, flags, native):
    found, why = devices.cpu_has_native_bf16(capability, flags)
    assert found is native
    assert why.startswith("this CPU has native bf16" if native else "this CPU has no native bf16")
    assert f"capability {capability}" in why
    assert ("flag " in why) if flags & {"avx512_bf16", "amx_bf16"} else "no avx512_bf16/amx_bf16 flag" in why


def test_no_cpuinfo_means_fp32(monkeypatch):
    monkeypatch.setattr(devices, "cpu_flags", lambda: None)  # macOS, Windows: no /proc/cpuinfo to read
    assert devices.cpu_has_native_bf16("AVX512") == (False, "this CPU has no native bf16: capability AVX512, "
                                                             "no /proc/cpuinfo")


def test_this_cpu_agrees_with_torchs_own_probe():
    # torch reads the CPU's features through its cpuinfo library, not /proc/cpuinfo: an independent source.
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is None or devices.cpu_flags() is None:
        pytest.skip("no torch.cpu probe or no /proc/cpuinfo here")
    torch_says = probe() or torch.cpu._is_amx_tile_supported()
    native, why = devices.cpu_has_native_bf16()
    assert native == (torch.backends.cpu.get_cpu_capability().startswith("AVX512") and torch_says), why
    assert native == onefile_train.cpu_has_bf16()  # the inline copy decides alike
    assert devices.amp_dtype(CPU, "auto") == (torch.bfloat16 if native else None)


@pytest.mark.parametrize("native", [True, False])
def test_amp_dtype_on_a_cpu(monkeypatch, native):
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx512_bf16"} if native else {"avx2"})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert devices.amp_dtype(CPU, "auto") == (torch.bfloat16 if native else None)
    assert devices.amp_dtype(CPU, "fp32") is None  # --dtype fp32 is fp32 whatever the CPU
    assert devices.amp_dtype(CPU, "bf16") == torch.bfloat16  # and --dtype bf16 forces bf16
    line = devices.dtype_line(CPU, "auto", devices.amp_dtype(CPU, "auto"))
    assert line == ("dtype: bf16 autocast (this CPU has native bf16: capability AVX512, flag avx512_bf16); "
                    "--dtype fp32 forces fp32" if native else
                    "dtype: fp32 (this CPU has no native bf16: capability AVX512, no avx512_bf16/amx_bf16 flag); "
                    "--dtype bf16 forces it")
    assert devices.dtype_line(CPU, "fp32", None) == "dtype: fp32 (--dtype fp32)"


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("script", [train, finetune_qlora])
def test_scripts_follow_the_rule(monkeypatch, capsys, tmp_path, base, script, native):
    # The estimate counts 2-byte activations under bf16: it shows which dtype the script chose.
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: (native, "faked"))
    common = ["--estimate-memory", "--device", "cpu", "--out-dir", str(tmp_path / "out")] + (
        TINY[:-2] if script is train else ["--init-from", base, "--block-size", "32", "--batch-size", "4"])
    assert TINY[-2:] == ["--dtype", "fp32"]  # TINY pins fp32; these runs leave --dtype to auto
    auto, fp32 = script.main(common), script.main([*common, "--dtype", "fp32"])
    out = capsys.readouterr().out
    assert (auto["activations"] < fp32["activations"]) is native
    assert out.count(f"dtype: {'bf16 autocast' if native else 'fp32'} (faked)") == 1
    assert "dtype: fp32 (--dtype fp32)" in out


def test_onefile_equals_train_py_under_bf16(tmp_path, text_dir, monkeypatch):
    monkeypatch.setattr(onefile_train, "cpu_has_bf16", lambda: True)  # onefile has no --dtype: its rule, faked
    flags = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "2",
             "--steps", "2", "--warmup-steps", "1", "--eval-interval", "2", "--eval-batches", "1", "--log-interval",
             "1", "--data", text_dir]
    train.main([*flags, "--dtype", "bf16", "--sample-tokens", "0", "--out-dir", str(tmp_path / "train")])
    onefile_train.main([*flags, "--out-dir", str(tmp_path / "onefile")])
    assert read_metrics(tmp_path / "onefile")[0]["dtype"] == read_metrics(tmp_path / "train")[0]["dtype"] == "bf16"
    a, b = step_losses(tmp_path / "train"), step_losses(tmp_path / "onefile")
    assert sorted(a) == sorted(b) == [0, 1]
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], abs=1e-6)
    assert val_losses(tmp_path / "onefile") == pytest.approx(val_losses(tmp_path / "train"), abs=1e-6)
    wa = load_file(tmp_path / "train" / "model.safetensors")
    wb = load_file(tmp_path / "onefile" / "checkpoint" / "model.safetensors")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_train_py_resume_equals_unbroken_under_bf16(tmp_path, text_dir):
    common = [*TINY, "--batch-size", "2", "--data", text_dir, "--dtype", "bf16", "--eval-interval", "100",
              "--eval-batches", "1", "--dropout", "0.1", "--steps"]
    # 2 steps, split after the first: the resumed step needs the saved weights, optimizer state and random state.
    train.main([*common, "2", "--out-dir", str(tmp_path / "straight")])
    train.main([*common, "1", "--out-dir", str(tmp_path / "split")])
    train.main([*common, "2", "--out-dir", str(tmp_path / "split"), "--resume"])
    straight, split = step_losses(tmp_path / "straight"), step_losses(tmp_path / "split")
    assert read_metrics(tmp_path / "split")[0]["dtype"] == "bf16"
    assert sorted(split) == list(range(2)) and split == straight  # the same bf16 arithmetic: bit for bit
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("straight", "split"))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resumed_fine_tune_keeps_its_saved_dtype(tmp_path, text_dir, base, monkeypatch, capsys):
    # Saved on a CPU with bf16 (faked), resumed where the rule says fp32: --dtype auto keeps the saved run's.
    common = ["--init-from", base, "--data", text_dir, "--block-size", "32", "--batch-size", "2", "--eval-batches",
              "1", "--eval-interval", "100", "--sample-tokens", "0", "--device", "cpu", "--out-dir", str(tmp_path)]
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: (True, "faked"))
    finetune_qlora.main([*common, "--steps", "1"])
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: (False, "faked"))
    finetune_qlora.main([*common, "--steps", "2", "--resume"])
    assert "dtype: bf16 autocast (the resumed run's)" in capsys.readouterr().out
    starts = [r for r in read_metrics(tmp_path) if r.get("event") == "start"]
    assert [r["dtype"] for r in starts] == ["bf16", "bf16"]
    state = torch.load(os.path.join(tmp_path, "training_state.pt"), weights_only=False)
    assert state["compute_dtype"] == "bf16" and state["step"] == 2
