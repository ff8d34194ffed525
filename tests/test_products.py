"""What a run writes at its end, after its last commit (rundir.Spec.products: train_fsdp.py's export, the
fine-tuning scripts' merged/, SPLADE's index and documents), across run -> --resume (train on) -> --resume:
never taken into a commit, never put back by --resume, so the top of OUT keeps the newest one. A resumed
run cut short (Ctrl-C) commits its state without them and leaves the previous end's products at the top."""

import argparse
import json
import os
import signal
import sysconfig

import pytest
import torch
from safetensors import safe_open

import finetune_lora
import train_fsdp
import train_splade_unified as splade
from lib import rundir
from tests.test_splade import TINY as SPLADE_TINY, synthetic

FSDP_TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "2",
             "--eval-interval", "100", "--eval-batches", "1", "--log-interval", "1", "--save-interval", "100",
             "--sample-tokens", "0", "--dtype", "fp32"]
FT_TINY = ["--batch-size", "2", "--eval-batches", "1", "--sample-tokens", "0", "--log-interval", "1",
           "--eval-interval", "100", "--save-interval", "100", "--dtype", "fp32", "--merge"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The stdlib's json package: a one-file text corpus (finetune) and a directory of .py files (train_fsdp)."""
    d = tmp_path_factory.mktemp("corpus")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    texts = {n: open(os.path.join(src, n)).read() for n in sorted(os.listdir(src)) if n.endswith(".py")}
    (d / "py").mkdir()
    for name, text in texts.items():
        (d / "py" / name).write_text(text)
    (d / "json.txt").write_text("".join(texts.values()))
    (d / "train.json").write_text(json.dumps(synthetic(96, 0)))
    return d


def family(name, corpus, base, tmp):
    """(main, the flags of a tiny run, the product files) of one script family."""
    if name == "fsdp":
        flags = [*FSDP_TINY, "--data", str(corpus / "py"), "--cache-dir", str(tmp / "cache")]
        return train_fsdp.main, flags, ["config.json", "model.safetensors"]
    if name == "finetune":
        return finetune_lora.main, [*FT_TINY, "--init-from", base, "--data", str(corpus / "json.txt")], [
            "merged/config.json", "merged/model.safetensors"]
    return splade.main, [*SPLADE_TINY, "--train-file", str(corpus / "train.json"), "--batch-size", "8",
                         "--warmup-steps", "1"], [splade.INDEX_FILE, splade.DOCUMENTS_FILE]


def products_of(out, names):
    return {name: (out / name).read_bytes() for name in names}


def in_commits(out, names):
    return [n for folder in rundir.committed(str(out)) for n in names if os.path.exists(os.path.join(folder, n))]


@pytest.mark.parametrize("name", ["fsdp", "finetune", "splade"])
def test_the_newest_product_stays_at_the_top_across_resumes(name, corpus, base, tmp_path, capsys, monkeypatch):
    main, flags, names = family(name, corpus, base, tmp_path)
    out = tmp_path / "run"
    flags = [*flags, "--out-dir" if name != "splade" else "--output-dir", str(out)]
    main([*flags, "--steps", "2"])
    first = products_of(out, names)
    main([*flags, "--resume", "--steps", "4"])  # trains on: its commit at step 4 must not take step 2's products
    second = products_of(out, names)
    assert all(second[n] != first[n] for n in names if n.endswith(".safetensors"))
    assert in_commits(out, names) == []
    # A resume cut short (Ctrl-C after step 4's update): its state is committed at step 5 without the products,
    # and the top keeps the previous end's (step 4's); nothing is put back over them.
    real = rundir.Updates.record

    def ctrl_c_after_step_4(self, step, skipped):
        real(self, step, skipped)
        if step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(rundir.Updates, "record", ctrl_c_after_step_4)
    with pytest.raises(SystemExit) as stopped:
        main([*flags, "--resume", "--steps", "6"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # save_on_interrupt ignores a second Ctrl-C
    assert stopped.value.code == 130
    monkeypatch.undo()
    assert os.path.basename(rundir.committed(str(out))[0]) == "step-000005"
    assert products_of(out, names) == second and in_commits(out, names) == []
    printed = capsys.readouterr()
    said = printed.out + printed.err
    if name == "splade":  # the index is older than the weights now, and a search says so
        splade.main(["--search", str(out), "--query", "find the code t1"])
        assert ("the index was built by the model of step 4, the saved model is from step 5 (a resumed run that has "
                "not finished)") in capsys.readouterr().err
    main([*flags, "--resume"])  # the saved --steps 6: finishes, and writes its products at its end
    third = products_of(out, names)
    assert all(third[n] != second[n] for n in names if n.endswith(".safetensors"))
    assert in_commits(out, names) == []
    printed = capsys.readouterr()
    assert "put back" not in said + printed.out + printed.err
    if name != "finetune":  # the export's and the index's metadata name the step of the weights they came from
        with safe_open(str(out / names[1 if name == "fsdp" else 0]), framework="pt") as f:
            assert int(f.metadata()["step"]) == 6


def test_a_commit_takes_no_product_and_resume_ignores_an_old_copy_in_a_checkpoint(tmp_path):
    """On a toy run directory: the product at the top is newer than the state; a commit leaves it out, and a
    checkpoint that holds an older copy (committed before products were declared) has it neither checked
    nor put back."""
    spec = rundir.Spec(saved={"training_state.pt": "state", "export/model.json": "json"}, products=("export",))
    assert spec.committed_files == ("training_state.pt",)
    out = tmp_path / "run"
    run = rundir.Run(str(out), spec)
    (out / "export").mkdir(parents=True)
    (out / "export" / "model.json").write_text('{"step": 2}')  # the previous end's product
    torch.save({"step": 3, "args": "{}"}, out / "training_state.pt")
    rundir.commit(run, argparse.Namespace(keep_last=1), 3)
    assert sorted(os.listdir(out / "checkpoints" / "step-000003")) == ["training_state.pt"]
    old = out / "checkpoints" / "step-000003" / "export"
    old.mkdir()
    (old / "model.json").write_text('{"step"')  # an old, damaged copy in the checkpoint: not resume state
    (out / "export" / "model.json").write_text('{"step": 5}')  # this end's product
    messages = []
    where, state = rundir.check_saved_run(str(out), spec, messages.append)
    rundir.restore_top(str(out), where, spec, messages.append)
    assert state["step"] == 3 and messages == []
    assert json.loads((out / "export" / "model.json").read_text()) == {"step": 5}
