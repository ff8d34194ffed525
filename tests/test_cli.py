"""Every script's --help: each flag has help text and shows its default once, and it runs three ways."""

import argparse
import importlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPTS = ["onefile_train", "train", "train_fsdp", "finetune_lora", "finetune_qlora", "judge_train_mps",
           "judge_train_cuda", "train_wpo_sgm_memory_efficient", "train_splade_unified", "train_splade_optimized"]


def parser_of(name, monkeypatch, capsys):
    """Run `name.main(["--help"])` and keep the parser it built."""
    import os

    if not os.path.exists(os.path.join(ROOT, name + ".py")):
        pytest.skip(f"{name}.py is not in this checkout")
    built = []
    original = argparse.ArgumentParser.parse_args

    def keep(self, *a, **k):
        built.append(self)
        return original(self, *a, **k)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(name).main(["--help"])
    assert e.value.code == 0
    return built[0], capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_has_text_and_one_default_per_flag(name, monkeypatch, capsys):
    parser, text = parser_of(name, monkeypatch, capsys)
    no_help = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert no_help == [], f"{name}: flags without help text: {no_help}"
    flat = " ".join(text.split())
    assert "(default: None)" not in flat
    assert not re.search(r"\(default[^)]*\) \(default", flat), "a default shown twice"
    # The common safety flags every script has (onefile_train.py leaves --force, with the memory estimate, to train.py).
    for flag in ("--overwrite", "--resume", *(["--force"] if name != "onefile_train" else [])):
        assert flag in parser._option_string_actions, f"{name} lacks {flag}"


def test_scripts_run_as_module_and_through_scripts_package():
    for args in (["-m", "scripts.judge_train_mps", "--help"], ["-m", "train_wpo_sgm_memory_efficient", "--help"]):
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "--out-dir" in proc.stdout, proc.stderr
