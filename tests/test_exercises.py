"""exercises/: every exercise's tests pass with the project's own code and fail on the untouched stubs, and a
learner's solution (written here, differently from lib/lora.py) trains the real finetune_lora.py and merges.

The exercise tests run in subprocesses (pytest on exercises/, which is not in testpaths); exercises/test_*.py are
found by glob, so a new exercise is held to the same rules without an edit here.
"""

import glob
import os
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
import torch

from lib import checkpoint, gpt, lora
from tests.conftest import ROOT

TEST_FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "exercises", "test_*.py")))


def clean_env(**extra):
    """The suite's environment without any BYHAND_EXERCISE* of the caller's, one thread: the shapes are tiny."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BYHAND_EXERCISE")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run_exercise_tests(tmp_path, **env):
    """{test file: [(test name, passed)]} from one pytest run over exercises/, read from its JUnit XML."""
    report = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                           *TEST_FILES], cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=300)
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname").replace(".", "/") + ".py"
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        results.setdefault(path, []).append((case.get("name"), not failed))
    return proc, results


def test_every_exercise_has_a_stub_and_a_reference():
    assert len(TEST_FILES) >= 4, TEST_FILES
    for test_file in TEST_FILES:
        stub = test_file.replace("test_", "", 1)
        assert os.path.isfile(os.path.join(ROOT, stub)), f"{test_file} has no stub {stub}"
        assert "REFERENCE = {" in open(os.path.join(ROOT, stub)).read(), f"{stub} names no REFERENCE"


def test_the_reference_passes_every_exercise_test(tmp_path):
    proc, results = run_exercise_tests(tmp_path, BYHAND_EXERCISE_REFERENCE="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert sorted(results) == TEST_FILES
    for path, cases in results.items():
        assert len(cases) >= 3, f"{path} has {len(cases)} tests; an exercise needs at least 3"
        assert all(ok for _, ok in cases), (path, cases)


def test_the_untouched_stubs_fail_every_exercise_test(tmp_path):
    changed = subprocess.run(["git", "status", "--porcelain", "--", "exercises"], cwd=ROOT, capture_output=True,
                             text=True)
    if changed.returncode != 0 or changed.stdout.strip():
        pytest.skip("exercises/ has local changes (a learner's work, or no git): the stubs are not untouched")
    proc, results = run_exercise_tests(tmp_path)
    assert proc.returncode == 1 and sorted(results) == TEST_FILES, proc.stdout[-3000:] + proc.stderr[-2000:]
    for path, cases in results.items():
        passing = [name for name, ok in cases if ok]
        assert not passing, f"{path}: {passing} pass on the untouched stub, so they cannot tell a solution from none"


# A learner's LoRA, written unlike lib/lora.py: the update by F.linear, the merge by addmm, found by its class.
LEARNER_LORA = '''
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from lib.nf4 import LinearNF4, dequantize_linear, replace_submodule
REFERENCE = {"LoRALinear": "lib.lora.LoRALinear", "merge_lora": "lib.lora.merge_lora"}


class LoRALinear(nn.Module):
    def __init__(self, base, r=8, alpha=16, dropout=0.0, rslora=False, dtype=None):
        super().__init__()
        self.base_layer, self.r, self.alpha, self.rslora, self.dropout_p = base, r, alpha, rslora, dropout
        self.in_features, self.out_features = base.in_features, base.out_features
        quantised = isinstance(base, LinearNF4)
        device = base.weight_packed.device if quantised else base.weight.device
        dtype = dtype or (base.weight_dtype if quantised else base.weight.dtype)
        self.scale = alpha / (math.sqrt(r) if rslora else r)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        out = self.base_layer(x)
        down = F.linear(self.lora_dropout(x).to(self.lora_A.weight.dtype), self.lora_A.weight)
        return out + self.scale * F.linear(down, self.lora_B.weight).to(out.dtype)


@torch.no_grad()
def merge_lora(model):
    for name, m in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        plain = dequantize_linear(m.base_layer) if isinstance(m.base_layer, LinearNF4) else m.base_layer
        plain.weight.copy_(torch.addmm(plain.weight.float(), m.lora_B.weight.float(), m.lora_A.weight.float(),
                                       alpha=m.scale))
        replace_submodule(model, name, plain)
    return model
'''


def test_a_learners_lora_trains_and_merges_in_finetune_lora(tmp_path, base, text_dir):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "lora.py").write_text(textwrap.dedent(LEARNER_LORA))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "finetune_lora.py", "--init-from", base, "--data", text_dir,
                           "--out-dir", str(out), "--steps", "10", "--warmup-steps", "2", "--lr", "2e-2",
                           "--batch-size", "4", "--eval-batches", "2", "--sample-tokens", "0", "--log-interval", "100",
                           "--dtype", "fp32", "--merge"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=clean_env(BYHAND_EXERCISE="lora", BYHAND_EXERCISE_DIR=str(tmp_path / "mine")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("LoRALinear", "merge_lora"):
        assert f"exercise lora: using your {name} from " in proc.stdout
    before, after = map(float, re.search(r"held-out loss on .*: ([\d.]+) before, ([\d.]+) after", proc.stdout).groups())
    assert after < before - 0.05, (before, after)  # it learned, as the script reports it

    # The merged directory the learner's merge_lora wrote computes what the base plus the adapter compute
    # (the adapter loaded by lib/lora.py here: the learner's files are the PEFT layout).
    cfg, sd = checkpoint.load_hf(str(out / "merged"))
    merged = gpt.GPT(cfg)
    merged.load_state_dict(sd)
    adapted = gpt.GPT(cfg)
    adapted.load_state_dict(checkpoint.load_hf(base)[1])
    lora.load_adapter(adapted, str(out))
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(idx)[0], adapted.eval()(idx)[0], atol=1e-4, rtol=1e-4)
