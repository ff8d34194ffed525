"""bench/gpu.py, the one command a GPU visit runs: its --device cpu --tiny form runs every row (the same
code paths, tiny shapes), a failed row is recorded while the rest go on, and docs/render.py fills the
pages' CUDA columns from its result file only where a GPU wrote one."""

import json
import os
import subprocess
import sys

import pytest

from bench import gpu
from docs import render
from tests.conftest import ROOT


def test_tiny_run_gives_every_row_ok_with_numbers(tmp_path):
    # The rows in two halves at once (--only), each with its own models folder: each row's child processes use
    # one thread, so on a two-core machine the halves take about half the time of one run of all eight.
    names = [name for name, _ in gpu.ROWS]
    halves = [names[:4], names[4:]]  # train before onefile: row onefile compares with row train's losses
    procs = [subprocess.Popen([sys.executable, "bench/gpu.py", "--device", "cpu", "--tiny", "--out",
                               str(tmp_path / f"gpu{i}.json"), "--models", str(tmp_path / f"models{i}"), "--only",
                               *half], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, half in enumerate(halves)]
    outputs = [proc.communicate(timeout=1500) for proc in procs]
    log = "".join(out + err for out, err in outputs)[-6000:]
    rows = {r["row"]: r for i in range(2) for r in json.loads((tmp_path / f"gpu{i}.json").read_text())["rows"]}
    assert list(rows) == names, log
    assert [name for name, r in rows.items() if not r["ok"]] == [], log
    assert [proc.returncode for proc in procs] == [0, 0]
    assert all(r["machine"]["torch"] and r["machine"]["date"] for r in rows.values())
    assert rows["train"]["tokens_per_s"] > 0 and rows["train"]["last5_mean_loss"] < rows["train"]["first_loss"]
    assert rows["onefile"]["max_abs_diff"] <= gpu.LOSS_TOL["fp32"] and len(rows["onefile"]["first5_onefile"]) == 5
    assert rows["fsdp"]["peak_bytes"] > 0 and rows["fsdp"]["ranks"] == 1
    for run in ("lora", "qlora", "qlora_grad_checkpoint"):
        assert rows["finetune"][run]["step_s"] > 0 and 0.5 < rows["finetune"][run]["peak_over_estimate"] < 2
    assert rows["finetune"]["nf4_codes_equal_cpu"] is True
    assert rows["judge"]["base"] == "nf4" and 0 < rows["judge"]["adam8bit_weights_apart_over_moved"] < 0.1
    splade = rows["splade"]  # on a CPU both runs are the same fp32 command, run once: the comparison's plumbing
    assert splade["max_rel_diff"] == 0.0 and len(splade["first3_mixed"]) == 3 and splade["steps_per_s"] > 0
    assert 0.5 < splade["peak_over_estimate"] < 2
    assert rows["wpo"]["max_rel_loss_diff"] <= 1e-4 and len(rows["wpo"]["chunked"]["loss"]) == 2
    assert rows["memory"]["cases"][0]["script"] == "train.py" and rows["memory"]["cases"][0]["measured"] > 0


def test_a_failed_row_is_recorded_and_the_rest_go_on(tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("train.py exited 1; last lines:\nCUDA out of memory")

    monkeypatch.setattr(gpu, "ROWS", [("train", broken), ("onefile", lambda ctx: {"ok": True, "max_abs_diff": 0.01}),
                                      ("fsdp", lambda ctx: {"ok": True}), ("wpo", lambda ctx: {"ok": True})])
    out = tmp_path / "gpu.json"
    code = gpu.main(["--device", "cpu", "--tiny", "--out", str(out), "--fail-row", "fsdp", "--only", "train",
                     "onefile", "fsdp"])
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert code == 1 and list(rows) == ["train", "onefile", "fsdp"]
    assert rows["train"]["ok"] is False and "CUDA out of memory" in rows["train"]["error"]
    assert rows["onefile"] == {**rows["onefile"], "ok": True, "max_abs_diff": 0.01}
    assert rows["fsdp"]["ok"] is False and "--fail-row fsdp" in rows["fsdp"]["error"]
    assert "3 rows, 2 failed: train, fsdp" in capsys.readouterr().err


def test_budget_spent_rows_are_recorded_as_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "ROWS", [("train", lambda ctx: {"ok": True})])
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--tiny", "--out", str(out), "--budget", "5"]) == 1
    assert "budget" in json.loads(out.read_text())["rows"][0]["error"]


GPU_PAGES = ["docs/choosing_a_script.md", "docs/training_architecture.md", "docs/qlora_explained.md",
             "docs/fsdp2_explained.md", "docs/judge_mps_vs_cuda.md"]


def fake_report(tiny=False):
    """A GPU run as bench/gpu.py writes one, with the memory row holding one real-size case of the CPU table."""
    with open(os.path.join(ROOT, "bench", "results", "memory_cpu.json")) as f:
        case = next(r for r in json.load(f)["rows"] if r["size"] == "real" and r["script"] == "train.py")
    gpu_machine = {"cpu": "Intel Xeon", "cores": 16, "gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1,
                   "gpu_memory_gib": 79.1, "driver": "550.54.15", "cuda": "12.8", "torch": "2.13.0+cu128",
                   "python": "3.12", "date": "2027-01-02", "load_avg_1m": 1.0, "quiet": None}
    rows = [{"row": name, "ok": True, "machine": gpu_machine, "seconds": 12.5, "peak_bytes": 3 * 2**30,
             "peak_over_estimate": 0.97} for name, _ in gpu.ROWS if name != "memory"]
    rows.append({"row": "memory", "ok": True, "machine": gpu_machine, "seconds": 90.0, "cases": [
        {**case, "estimate": 5 * 2**30, "measured": int(4.5 * 2**30), "measured_over_estimate": 0.9}]})
    return {"bench": "gpu", "device": "cpu" if tiny else "cuda", "tiny": tiny, "machine": gpu_machine, "rows": rows}


@pytest.mark.parametrize("present", [True, False])
def test_render_fills_cuda_columns_only_from_a_gpu_run(tmp_path, monkeypatch, present):
    path = tmp_path / "gpu.json"
    if present:
        path.write_text(json.dumps(fake_report()))
    # Only the blocks that read the fabricated file are rendered here; the pages' others are tests/test_docs.py's.
    real_call = render.call
    monkeypatch.setattr(render, "call", lambda source: real_call(source) if str(path) in source else "-")
    for page in GPU_PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read().replace("bench/results/gpu.json", str(path))  # the page, reading the fabricated file
        new, _ = render.render_page(text)
        lines = new.split("\n")
        blocks = "\n".join("\n".join(lines[a + 1:b]) for a, b, source in render.blocks(new) if str(path) in source)
        assert blocks, page
        if present:
            assert "Not measured yet" not in blocks and "has not been measured" not in blocks, page
            assert "NVIDIA H100 80GB HBM3 (1 x 79.1 GiB, driver 550.54.15, CUDA 12.8)" in blocks, page
        else:
            assert "Not measured yet" in blocks or "has not been measured yet" in blocks, page
            assert "NVIDIA H100" not in blocks
    table = render.call(f"bench.memory_estimate.render bench/results/memory_cpu.json real {path}")
    if present:
        line = next(x for x in table.splitlines() if x.startswith("| train.py |"))
        assert line.endswith("| 5.00 GiB | 4.50 GiB | 0.90 |") and "CUDA max allocated" in table
        assert table.count("| - | - | - |") == table.count("\n| ") - 1  # the other scripts: no CUDA figure
    else:
        assert "CUDA" not in table.splitlines()[0] and "CUDA has not been measured yet (no GPU was available)" in table


def test_a_cpu_tiny_run_fills_no_page(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(fake_report(tiny=True)))
    assert gpu.render(str(path)) == gpu.NOT_MEASURED and gpu.render_row(str(path), "fsdp") == gpu.NOT_MEASURED
