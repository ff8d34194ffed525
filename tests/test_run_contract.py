"""The run contract (lib/rundir.py; README "What happens to a saved run"), held against every script that saves.

One parametrised test per rule, over the ten scripts. Adding a script to the repository means adding
it to CASES below. Each case runs the script in-process (its main(argv)) with tiny settings, or under
`torchrun --nproc_per_node=2` where the script needs ranks (but for the refusals every rank makes before
it joins the others: before_any_rank_work):

- a fresh run into a saved directory is refused, and every file is left as it was;
- --resume with no other flags after Ctrl-C continues exactly: the saved weights of a run stopped at a
  step and resumed equal those of an unbroken run;
- a signal that arrives inside optimizer.step() waits for the update and its counting (lib/rundir.whole_update):
  train.py and onefile_train.py then resume exactly, and every other loop saves as many steps as it applied updates;
- Ctrl-C inside a step's forward, once its dropout drew, saves the random state that step began with (the step does
  not count, and --resume redoes it): train.py and onefile_train.py then resume bit for bit;
- --resume --overwrite is refused;
- --overwrite with a bad flag, or with a memory request the machine cannot have, leaves the old run
  byte-identical;
- each saved file of the newest checkpoint truncated in turn makes --resume fail with one line and exit 2,
  nothing changed (with one checkpoint kept there is no older one to fall back on);
- a diverging run never saves non-finite weights and exits non-zero.
"""

import contextlib
import dataclasses
import importlib
import inspect
import os
import re
import shutil
import signal
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from lib import rundir
from tests.conftest import TINY, ctrl_c_launcher, torchrun


@dataclasses.dataclass
class Case:
    script: str  # the module name of the top-level script
    args: list  # a tiny run of a few optimizer steps, without --out-dir (the flag is out_flag)
    stop_at: int  # Ctrl-C arrives once this many updates are done (fewer than the run's steps)
    weights: tuple  # the saved weight files compared between the resumed and the unbroken run
    bad_overwrite: list  # flag sets that must fail with --overwrite before anything is removed
    diverge: list  # flags that make the run diverge (non-finite gradients or weights)
    out_flag: str = "--out-dir"
    saved: tuple = ()  # the saved files; by default the script's rundir.Spec's
    torchrun: bool = False
    make_data: Callable = None  # (directory to write in, a directory of Python source) -> data flags
    # What Ctrl-C is sent from, "module:attribute": a function called once per optimizer step with a `step`
    # argument. rundir.Updates.record comes after the update, so the save holds stop_at updates; onefile_train.py
    # (no lib/) has its lr_at, called before the update: its save holds stop_at - 1.
    hook: str = "lib.rundir:Updates.record"

    def saved_files(self):
        return self.saved or tuple(importlib.import_module(self.script).RUN.saved)


GPT_TINY = [*TINY, "--steps", "4", "--eval-interval", "100", "--save-interval", "100", "--dropout", "0.1"]
HUGE_BATCH = ["--batch-size", "100000000"]


def without(flags, *names):
    """The flags less the named ones and their values (onefile_train.py has no --sample-tokens or --dtype)."""
    return [f for i, f in enumerate(flags) if f not in names and (i == 0 or flags[i - 1] not in names)]


# The fine-tuning scripts: 4 steps of 2 x 32 tokens in fp32 (as every tiny run here: conftest.TINY).
FT_TINY = ["--batch-size", "2", "--eval-batches", "1", "--sample-tokens", "0", "--log-interval", "1", "--steps", "4",
           "--eval-interval", "100", "--save-interval", "100", "--lora-dropout", "0.1", "--dtype", "fp32"]


def base_and_data(tmp, source):
    """A seeded, untrained GPT of 2 layers, 64 wide, saved as a Hugging Face GPT-2 directory: the base."""
    from lib import checkpoint, gpt

    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    checkpoint.save_hf(str(tmp / "base"), cfg, gpt.to_hf_state_dict(gpt.GPT(cfg)))
    return ["--init-from", str(tmp / "base"), "--data", source]


SPLADE_TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "2", "--vocab-size", "400",
               "--max-length", "32", "--max-query-length", "16", "--device", "cpu", "--lr", "1e-2", "--warmup-steps",
               "2", "--steps", "4", "--batch-size", "8", "--log-interval", "1"]
JUDGE_TINY = ["--model", "tiny", "--device", "cpu", "--max_samples", "24", "--epochs", "1", "--eval_steps", "2",
              "--skip_eval", "--log_interval", "1"]
HUGE_LORA = ["--lora_r", "100000000"]  # the judge's batches are at most its data: a rank no machine can hold

CASES = {
    # --- the pretraining scripts --------------------------------------------------------------------
    "train": Case("train", GPT_TINY, stop_at=2, weights=("model.safetensors",),
                  bad_overwrite=[["--data", "/no/such/corpus"], HUGE_BATCH],
                  diverge=["--lr", "1e38", "--grad-clip", "0"], make_data=lambda tmp, source: ["--data", source]),
    # Two ranks: of the saved files, latest.json (the training state), the DCP metadata and one rank's shard file
    # are truncated in turn (the export is train.py's safetensors check), each --resume in this process.
    "train_fsdp": Case("train_fsdp", GPT_TINY, stop_at=2, weights=("model.safetensors",), torchrun=True,
                       saved=("sharded/latest.json", "sharded/step-000004/.metadata",
                              "sharded/step-000004/__1_0.distcp"),
                       bad_overwrite=[["--data", "/no/such/corpus"], HUGE_BATCH],
                       diverge=["--lr", "1e38", "--grad-clip", "0"], make_data=lambda tmp, source: ["--data", source]),
    # The compact inline contract (no lib/): one folder, OUT/checkpoint, renamed into place; its hook is named here.
    "onefile_train": Case("onefile_train", without(GPT_TINY, "--sample-tokens", "--dtype"), stop_at=2,
                          weights=("checkpoint/model.safetensors",),
                          saved=("checkpoint/model.safetensors", "checkpoint/training_state.pt"),
                          bad_overwrite=[["--data", "/no/such/corpus"], HUGE_BATCH],
                          diverge=["--lr", "1e38", "--grad-clip", "0"], hook="onefile_train:lr_at",
                          make_data=lambda tmp, source: ["--data", source]),
    # --- the fine-tuning scripts -------------------------------------------------------------------
    # A seeded 2-layer base in the Hugging Face layout; --merge, so that OUT/merged is part of the saved run.
    "finetune_lora": Case("finetune_lora", [*FT_TINY, "--merge"], stop_at=2,
                          weights=("adapter_model.safetensors", "merged/model.safetensors"),
                          bad_overwrite=[["--data", "/no/such/corpus"], HUGE_BATCH],
                          diverge=["--lr", "1e38", "--grad-clip", "0"], make_data=base_and_data),
    "finetune_qlora": Case("finetune_qlora", FT_TINY, stop_at=2, weights=("adapter_model.safetensors",),
                           bad_overwrite=[["--data", "/no/such/corpus"], HUGE_BATCH],
                           diverge=["--lr", "1e38", "--grad-clip", "0"], make_data=base_and_data),

    # --- SPLADE --------------------------------------------------------------------------------------
    # A 2-layer, 64-wide BERT from scratch on 48 synthetic records (tests/test_splade.py: contract_data),
    # validated on 16 more, so the finished run holds every saved file: the model, best/, the index.
    "train_splade_unified": Case(
        "train_splade_unified", SPLADE_TINY, stop_at=2, weights=("model.safetensors",),
        bad_overwrite=[["--train-file", "/no/such/train.json"], HUGE_BATCH],
        diverge=["--lambda-q", "1e30", "--lambda-d", "1e30", "--reg-warmup-steps", "0"], out_flag="--output-dir",
        make_data=lambda tmp, source: importlib.import_module("test_splade").contract_data(tmp)),
    "train_splade_optimized": Case(
        "train_splade_optimized", [*SPLADE_TINY, "--batch-size", "4", "--gradient-accumulation-steps", "2"], stop_at=2,
        weights=("model.safetensors",), bad_overwrite=[["--val-file", "/no/such/val.jsonl"], HUGE_BATCH],
        diverge=["--lambda-q", "1e30", "--lambda-d", "1e30", "--reg-warmup-steps", "0"], out_flag="--output-dir",
        make_data=lambda tmp, source: importlib.import_module("test_splade").contract_data(tmp)),

    # --- the judge scripts ---------------------------------------------------------------------------
    # The tiny demo base (built once per test session, in its cache), 24 conversations of the embedded set:
    # 3 steps of 8, validations at steps 0, 2 and 3. The saved weights are the best adapter's.
    "judge_train_mps": Case("judge_train_mps", JUDGE_TINY, stop_at=2, weights=("adapter_model.safetensors",),
                            bad_overwrite=[["--data_dir", "/no/such/judge_data"], HUGE_LORA], diverge=["--lr", "1e30"],
                            out_flag="--output_dir"),
    "judge_train_cuda": Case("judge_train_cuda", JUDGE_TINY, stop_at=2, weights=("adapter_model.safetensors",),
                             bad_overwrite=[["--data_dir", "/no/such/judge_data"], HUGE_LORA], diverge=["--lr", "1e30"],
                             out_flag="--output_dir"),

    # --- WPO-SGM -------------------------------------------------------------------------------------
    "train_wpo_sgm_memory_efficient": Case(
        "train_wpo_sgm_memory_efficient",
        ["--train_samples_size", "200", "--test_samples_size", "40", "--train_kernel_size", "9", "--batch_size", "16",
         "--depth", "2", "--hiddenunits", "16", "--niters", "4", "--strategy", "chunked", "--chunk_size", "4",
         "--eval-interval", "2", "--log-interval", "1", "--num-samples", "20"],
        stop_at=2, weights=("model.safetensors",),
        bad_overwrite=[["--data", "cifar10", "--data-dir", "/no/such/cifar-10-batches-bin"],
                       ["--train_samples_size", "10000000000"]],  # 80 GB of samples: no plan fits
        diverge=["--lr", "1e38", "--grad_clip", "0"]),
}


def snapshot(directory):
    """Every file under directory, with its bytes."""
    out = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def weights_of(directory, case):
    tensors = {}
    for name in case.weights:
        tensors.update({f"{name}:{k}": v for k, v in load_file(os.path.join(directory, name)).items()})
    return tensors


def run_script(case, out_dir, *extra, data_flags=()):
    """Run the script; returns its exit code (0 when main returned)."""
    argv = [*case.args, *data_flags, case.out_flag, str(out_dir), *extra]
    if case.torchrun:
        proc = torchrun([f"{case.script}.py", *argv])
        # torchrun itself exits 1 when a worker fails (and stops the others): the first failure's code is in
        # its report.
        first = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", proc.stderr, re.S)
        return (int(first.group(1)) if first else proc.returncode), proc.stdout + proc.stderr
    module = importlib.import_module(case.script)
    try:
        module.main(argv)
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), ""
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return 0, ""


@pytest.fixture(scope="module")
def data_flags(text_dir, tmp_path_factory):
    """Each script's data flags, its small data set made once."""
    return {name: case.make_data(tmp_path_factory.mktemp(f"data-{name}"), text_dir) if case.make_data else []
            for name, case in CASES.items()}


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, data_flags):
    """One finished tiny run per script, made once and copied by each test that needs one."""
    made = {}

    def get(name):
        if name not in made:
            case = CASES[name]
            out = tmp_path_factory.mktemp(f"unbroken-{name}")
            code, log = run_script(case, out, data_flags=data_flags.get(name, ()))
            assert code == 0, log[-3000:]
            made[name] = out
        return made[name]

    return get


def before_any_rank_work(case):
    """The case run in this process, for a refusal: --resume's checks, a saved run that a fresh run would replace,
    --resume --overwrite and a bad flag are lib/rundir.prepare's and check_args', which every rank runs alike
    before any process group exists (train_fsdp.run), so a torchrun launch (three torch start-ups) reaches no
    other code. The memory check comes after the group is joined, but is the same guards.check_memory on one
    rank; Ctrl-C and a diverging run, where the ranks must agree, are still launched under torchrun."""
    return dataclasses.replace(case, torchrun=False)


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1] if err else ""


@pytest.fixture(params=sorted(CASES))
def case(request):
    return request.param, CASES[request.param]


def copy_of(unbroken, name, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(unbroken(name), out)
    return out


def test_a_fresh_run_never_replaces_a_saved_one(case, unbroken, data_flags, tmp_path, capsys):
    name, case = case[0], before_any_rank_work(case[1])
    out = copy_of(unbroken, name, tmp_path)
    before = snapshot(out)
    code, log = run_script(case, out, data_flags=data_flags.get(name, ()))
    assert code == 2
    message = log if case.torchrun else one_error_line(capsys)
    assert "already holds a saved run" in message and "--overwrite" in message, message
    assert snapshot(out) == before


def test_resume_with_overwrite_is_refused(case, unbroken, data_flags, tmp_path, capsys):
    name, case = case[0], before_any_rank_work(case[1])
    out = copy_of(unbroken, name, tmp_path)
    before = snapshot(out)
    code, log = run_script(case, out, "--resume", "--overwrite", data_flags=data_flags.get(name, ()))
    assert code == 2 and "pass one of them" in (log if case.torchrun else one_error_line(capsys))
    assert snapshot(out) == before


def test_overwrite_checks_everything_before_it_removes_anything(case, unbroken, data_flags, tmp_path, capsys):
    name, case = case[0], before_any_rank_work(case[1])
    out = copy_of(unbroken, name, tmp_path)
    before = snapshot(out)
    for bad in case.bad_overwrite:
        code, log = run_script(case, out, "--overwrite", *bad, data_flags=data_flags.get(name, ()))
        assert code == 2, bad
        message = log if case.torchrun else one_error_line(capsys)
        assert message.startswith("error: ") or case.torchrun, message
        assert snapshot(out) == before, bad


def test_each_damaged_saved_file_is_one_line_and_nothing_is_written(case, unbroken, data_flags, tmp_path, capsys):
    name, case = case[0], before_any_rank_work(case[1])
    out = copy_of(unbroken, name, tmp_path)
    # copytree made the top's hard links separate copies; onefile_train.py's one folder is OUT/checkpoint
    newest = sorted((out / "checkpoints").iterdir())[-1] if (out / "checkpoints").is_dir() else out
    for saved in case.saved_files():
        path = newest / saved
        if not path.is_file():
            continue  # an optional file this run did not write
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
        if (out / saved).is_file():
            (out / saved).write_bytes(whole[: len(whole) // 2])
        before = snapshot(out)
        code, log = run_script(case, out, "--resume", data_flags=data_flags.get(name, ()))
        message = log if case.torchrun else capsys.readouterr().err.strip()
        if not case.torchrun:  # a warning before it (judge_train_cuda.py on a machine without CUDA) is not the error
            message = "\n".join(line for line in message.splitlines() if not line.startswith("warning: "))
        assert code == 2, saved
        assert case.torchrun or (len(message.splitlines()) == 1 and message.startswith("error: ")), message
        assert str(path) in message or saved in message, message
        assert snapshot(out) == before, saved
        path.write_bytes(whole)
        if (out / saved).is_file():
            (out / saved).write_bytes(whole)


def interrupt_after(monkeypatch, updates_done, hook="lib.rundir:Updates.record"):
    """Ctrl-C once `updates_done` optimizer updates are finished: rundir.Updates.record is called
    after every update, so the save that follows holds exactly those updates."""
    module, attribute = hook.split(":")
    owner = importlib.import_module(module)
    for name in attribute.split(".")[:-1]:
        owner = getattr(owner, name)
    name = attribute.split(".")[-1]
    real = getattr(owner, name)

    def record(*args, **kwargs):
        result = real(*args, **kwargs)
        if inspect.signature(real).bind(*args, **kwargs).arguments["step"] + 1 == updates_done:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(owner, name, record)


def test_ctrl_c_saves_and_resume_continues_exactly(case, unbroken, data_flags, tmp_path, monkeypatch):
    name, case = case
    out = tmp_path / "split"
    flags = data_flags.get(name, ())
    if case.torchrun:  # each rank sends itself SIGINT after the same update, as a terminal's Ctrl-C would
        helper = ctrl_c_launcher(tmp_path, case.script, case.stop_at)
        proc = torchrun([helper, *case.args, *flags, case.out_flag, str(out)])
        assert f"interrupted: saved step {case.stop_at}" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    else:
        interrupt_after(monkeypatch, case.stop_at, case.hook)
        code, _ = run_script(case, out, data_flags=flags)
        assert code == 130
        monkeypatch.undo()
    code, log = run_script(case, out, "--resume")  # no other flag: the saved run's own
    assert code == 0, log[-3000:]
    resumed, straight = weights_of(out, case), weights_of(unbroken(name), case)
    assert sorted(resumed) == sorted(straight)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=1e-6, msg=key)


@contextlib.contextmanager
def at_update(updates_done, action, armed=False):
    """Call action() from inside optimizer.step() of update `updates_done`, once the weights hold it and before the
    loop has counted it: a global optimizer post-hook (what scaler.step and a Python optimizer such as
    lib/adam8bit's go through too). It is armed at rundir.begin, as the judge's tiny demo base pretrains with its
    own AdamW before that; onefile_train.py, which has no lib/, is armed at once. Yields the updates it saw."""
    seen, started, real_begin = [], [armed], rundir.begin

    def begin(*args, **kwargs):
        started[0] = True
        return real_begin(*args, **kwargs)

    def after_update(optimizer, args, kwargs):
        if started[0]:
            seen.append(1)
            if len(seen) == updates_done:
                action()

    handle = register_optimizer_step_post_hook(after_update)
    rundir.begin = begin
    try:
        yield seen
    finally:
        rundir.begin = real_begin
        handle.remove()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # rundir.begin's handler would stay behind in pytest


def signal_inside_update(updates_done, signum, armed=False):
    """Send signum to this process from inside update `updates_done` (at_update)."""
    return at_update(updates_done, lambda: os.kill(os.getpid(), signum), armed)


@pytest.mark.parametrize("name", ["train", "onefile_train"])
def test_a_signal_inside_the_update_saves_it_whole_and_resume_continues_exactly(name, unbroken, data_flags, tmp_path):
    """Ctrl-C that arrives while optimizer.step() runs (here: just after its last tensor) waits for the update and
    its counting to end: the save holds exactly the updates it says, and --resume equals the unbroken run."""
    case, out = CASES[name], tmp_path / "split"
    with signal_inside_update(case.stop_at, signal.SIGINT, armed=name == "onefile_train") as seen:
        code, _ = run_script(case, out, data_flags=data_flags.get(name, ()))
    assert code == 130 and len(seen) == case.stop_at
    code, log = run_script(case, out, "--resume")
    assert code == 0, log[-3000:]
    resumed, straight = weights_of(out, case), weights_of(unbroken(name), case)
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", [name for name, case in sorted(CASES.items())
                                  if not case.torchrun and name not in ("train", "onefile_train")])
def test_sigterm_inside_the_update_saves_as_many_steps_as_updates(name, data_flags, tmp_path):
    """The other loops, cheaply: SIGTERM inside update stop_at, and the saved step counts every applied update."""
    case, out = CASES[name], tmp_path / "run"
    with signal_inside_update(case.stop_at, signal.SIGTERM) as seen:
        code, _ = run_script(case, out, data_flags=data_flags.get(name, ()))
    assert code == 143 and len(seen) == case.stop_at
    state = rundir.load_state(os.path.join(out, importlib.import_module(case.script).RUN.state_file))
    assert state["step"] == case.stop_at


@contextlib.contextmanager
def signal_inside_forward(updates_done, armed=False):
    """Send SIGINT to this process from inside the forward of the step after update `updates_done`, once a dropout
    there has drawn its mask (a global forward hook): the generators have moved on, and that step will not count.
    Armed as at_update. Yields a dict whose "began" is the CPU random state that step began with (taken at the end
    of update `updates_done`: nothing draws between it and the next step's forward)."""
    at = {"began": None, "sent": False}

    def after_forward(module, args, output):
        drew = isinstance(module, torch.nn.Dropout) and module.training and module.p > 0  # p = 0 draws nothing
        if drew and at["began"] is not None and not at["sent"]:
            at["sent"] = True
            os.kill(os.getpid(), signal.SIGINT)

    handle = register_module_forward_hook(after_forward)
    try:
        with at_update(updates_done, lambda: at.update(began=torch.get_rng_state()), armed):
            yield at
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["train", "onefile_train"])
def test_ctrl_c_after_dropout_drew_resumes_bit_for_bit(name, unbroken, data_flags, tmp_path):
    """Ctrl-C inside a step's forward, after its dropout masks were drawn: the step does not count, the save holds
    the random state it began with, and --resume redraws the same masks: the weights equal the unbroken run's."""
    case, out = CASES[name], tmp_path / "split"
    with signal_inside_forward(case.stop_at, armed=name == "onefile_train") as at:
        code, _ = run_script(case, out, data_flags=data_flags.get(name, ()))
    assert code == 130 and at["sent"]
    state = rundir.load_state(str(out / ("checkpoint/training_state.pt" if name == "onefile_train" else rundir.STATE)))
    assert state["step"] == case.stop_at and torch.equal(state["rng_cpu"], at["began"])
    code, log = run_script(case, out, "--resume")
    assert code == 0, log[-3000:]
    resumed, straight = weights_of(out, case), weights_of(unbroken(name), case)
    assert all(torch.equal(resumed[key], straight[key]) for key in straight)


@pytest.mark.parametrize("name", ["finetune_lora", "train_splade_unified", "train_splade_optimized", "judge_train_mps"])
def test_ctrl_c_after_dropout_drew_saves_the_random_state_the_step_began_with(name, data_flags, tmp_path):
    """The other loops with dropout, cheaply: the same Ctrl-C, and the saved step and random state are those the step
    began with. finetune_qlora.py and judge_train_cuda.py run the loops of finetune_lora.py and judge_train_mps.py;
    train_splade_optimized.py's GradCache sets the state back and forth inside its step. (train_fsdp.py's loop is
    train.py's, per rank; train_wpo_sgm_memory_efficient.py draws from generators of its own, seeded by the step.)"""
    case, out = CASES[name], tmp_path / "run"
    with signal_inside_forward(case.stop_at) as at:
        code, _ = run_script(case, out, data_flags=data_flags.get(name, ()))
    assert code == 130 and at["sent"]
    state = rundir.load_state(os.path.join(out, importlib.import_module(case.script).RUN.state_file))
    assert state["step"] == case.stop_at and torch.equal(state["rng_cpu"], at["began"])


def test_a_diverging_run_never_saves_non_finite_weights(case, data_flags, tmp_path, capsys):
    name, case = case
    out = tmp_path / "diverge"
    code, log = run_script(case, out, *case.diverge, data_flags=data_flags.get(name, ()))
    assert code != 0
    for root, _, names in os.walk(out):
        for file in names:
            if file.endswith(".safetensors"):
                for key, t in load_file(os.path.join(root, file)).items():
                    assert torch.isfinite(t).all(), f"{file}:{key}"


def test_every_flag_is_fixed_changeable_or_local(case):
    """A flag --resume does not know about would silently take today's value: each script declares all."""
    name, case = case
    module = importlib.import_module(case.script)
    if not hasattr(module, "RUN"):
        pytest.skip(f"{case.script} keeps a compact inline copy of the contract")
    parser = module.build_parser() if hasattr(module, "build_parser") else module.make_parser()
    spec = module.RUN
    known = {*spec.fixed, *spec.changeable, *spec.local, *rundir.PER_INVOCATION, "help"}
    unknown = sorted({a.dest for a in parser._actions} - known)
    assert not unknown, f"{case.script}: declare these in RUN (fixed, changeable or local): {unknown}"
    assert not set(spec.fixed) & set(spec.changeable)
