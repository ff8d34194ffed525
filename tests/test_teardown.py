"""Multi-process runs end cleanly: two 2-rank train.py runs in a row both exit 0, and two torchrun launches
joined as two nodes (--nnodes=2, c10d rendezvous) train exactly what one 2-process launch trains.

A gloo process group freed while the interpreter shuts down (held by a DDP model that was cyclic garbage)
used to abort a rank at exit now and then with "terminate called without an active exception";
lib/distributed.leave_before_exit frees it at exit while Python is whole (onefile_train.py: the same).
"""

import os
import re
import socket
import subprocess
import sys

import pytest

from tests import conftest
from tests.conftest import ROOT, step_losses

pytestmark = pytest.mark.multiprocess

# The cheapest run that still trains, saves and leaves the group: a tiny model, 2 steps, one batch of eval.
# Two runs in a row, not ten: each launch is three torch start-ups (about 9 s here) and the eight more repeated
# the same code. The suite's other 2-rank launches (over twenty: tests/test_ddp.py, test_elastic.py, test_fsdp.py,
# test_faults.py, test_run_contract.py, ...) each check their exit status too (conftest.torchrun runs each once).
RUNS = 2
CHEAP = [*conftest.TINY, "--steps", "2", "--eval-batches", "1", "--eval-interval", "100", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory, text_dir):
    """RUNS 2-rank runs in a row, each replacing the last (--overwrite); returns the last one's directory."""
    out = str(tmp_path_factory.mktemp("teardown") / "run")
    cache = str(tmp_path_factory.mktemp("teardown-cache"))
    failures = []
    for i in range(RUNS):
        proc = conftest.torchrun(["train.py", *CHEAP, "--data", text_dir, "--out-dir", out, "--overwrite"],
                                 timeout=180, env={"BYHAND_CACHE": cache})
        if proc.returncode != 0:
            failures.append(f"run {i + 1}: exit {proc.returncode}\n{proc.stderr[-1500:]}")
    return out, failures


def test_two_rank_runs_in_a_row_exit_cleanly(single_node):
    out, failures = single_node
    assert not failures, "\n".join(failures)
    assert sorted(step_losses(out)) == [0, 1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_what_one_two_process_node_trains(single_node, tmp_path, text_dir):
    """The README's multi-machine command, as two launches on this machine: one process each, a cache each
    (each node's local rank 0 tokenises for it), one shared output directory (rank 0 writes)."""
    out = str(tmp_path / "two-nodes")
    port = free_port()
    # The README's line: "replace `--standalone` with `--nnodes=2 --rdzv-id=JOB --rdzv-backend=c10d ...`".
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().replace("\n", " ")
    flags = re.search(r"`(--nnodes=2 [^`]+)`", readme).group(1).split()
    assert any(f.startswith("--rdzv-endpoint=HOST:") for f in flags) and "--rdzv-id=JOB" in flags
    procs = []
    for node in range(2):
        mine = [f.replace("=JOB", "=byhand-two-nodes").replace("HOST:29500", f"127.0.0.1:{port}") for f in flags]
        cmd = [sys.executable, "-m", "torch.distributed.run", *mine, "--nproc_per_node=1",
               "train.py", *CHEAP, "--data", text_dir, "--out-dir", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "BYHAND_CACHE": str(tmp_path / f"cache-node{node}")}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, stdout, stderr))
    for node, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"node {node}: {stderr[-2000:]}"
    assert "x 2 ranks" in "".join(stdout for _, stdout, _ in results)
    for node in range(2):  # each node prepared its own copy of the data
        assert os.listdir(tmp_path / f"cache-node{node}" / "data")
    one_node = step_losses(single_node[0])
    two_nodes = step_losses(out)
    assert sorted(two_nodes) == [0, 1]
    assert [two_nodes[s] for s in (0, 1)] == pytest.approx([one_node[s] for s in (0, 1)], abs=1e-6)
