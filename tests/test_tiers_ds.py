"""The node-local tier end to end: two simulated nodes of two ranks (two torchrun launchers,
``--nnodes 2``), ZeRO-1, 2 and 3, on the CPU (tests/tier_job.py runs the ranks).

A save (ZeRO-2's async), then node 1's local folder deleted: the relaunch resumes from node 0's copies and the
replicas, reading nothing from the save folder; then node 1's folder deleted again and the save
folder too: the relaunch resumes all the same. Each time every rank's fp32 master weights and
optimizer moments equal the saved ones bit for bit. And a resume on fewer nodes: node 1 lost
for good, the job goes on with node 0 alone (one launcher, two ranks, ZeRO-2 resharded at load
from four ranks to two), from node 0's copies and the replicas it holds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import assert_same_object
from test_launchers import finish, free_port, launch_env, start, tail

from nvcomp_ckpt_engine.manifest import MANIFEST_NAME

JOB = Path(__file__).resolve().parent / "tier_job.py"


def launch(phase: str, stage: int, out: Path, *extra: str, nodes: int = 2) -> None:
    """Every simulated node's launcher at once; fails the test on a failed rank."""
    port = str(free_port())
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                 "--nproc_per_node", "2", "--node_rank", str(node), "--master_addr", "127.0.0.1",
                 "--master_port", port, str(JOB), phase, str(stage), str(out), *extra]
                for node in range(nodes)]
    logs = [out / f"{phase}.{node}.log" for node in range(nodes)]
    codes = finish([start(c, launch_env(), log) for c, log in zip(commands, logs)], logs)
    failures = "\n".join(p.read_text() for p in sorted(out.glob(f"failed_{phase}_rank*.txt")))
    assert codes == [0] * nodes and not failures, f"{phase}: exit codes {codes}\n{failures}\n" + "\n".join(
        tail(log) for log in logs)


def assert_resumed(out: Path) -> list[int]:
    """Every rank's parameters, optimizer state (fp32 master, moments) and step as saved; the
    bytes each read from the save folder."""
    read = []
    for rank in range(4):
        saved = torch.load(out / f"save_rank{rank}.pt", weights_only=False)
        loaded = torch.load(out / f"load_rank{rank}.pt", weights_only=False)
        assert "local" in Path(loaded["load_path"]).parts, loaded["load_path"]
        for key in ("params", "optimizer", "global_steps"):
            assert_same_object(loaded[key], saved[key], f"rank {rank} {key}")
        read.append(loaded["persistent_read_bytes"])
        (out / f"load_rank{rank}.pt").unlink()
    return read


@pytest.mark.slow
@pytest.mark.parametrize("stage, mode", [(1, "sync"), (2, "async"), (3, "sync")])
def test_a_lost_node_resumes_from_the_replicas(tmp_path: Path, stage: int, mode: str) -> None:
    launch("save", stage, tmp_path, mode)
    if mode == "async":
        assert all(torch.load(tmp_path / f"save_rank{rank}.pt", weights_only=False)[
            "committed_while_training"] for rank in range(4))
    assert (tmp_path / "ckpt" / "global_step3" / MANIFEST_NAME).is_file()  # drained at destroy()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step3"
    for node in (0, 1):
        assert (tmp_path / "local" / f"node{node}" / "global_step3" / MANIFEST_NAME).is_file()

    shutil.rmtree(tmp_path / "local" / "node1")
    launch("load", stage, tmp_path)
    assert assert_resumed(tmp_path) == [0, 0, 0, 0]  # nothing read from the save folder

    shutil.rmtree(tmp_path / "local" / "node1")
    shutil.rmtree(tmp_path / "ckpt")
    launch("load", stage, tmp_path)
    assert_resumed(tmp_path)
    completed = subprocess.run(
        [sys.executable, "-m", "nvcomp_ckpt_engine", "verify", "-q",
         str(tmp_path / "local" / "node1"), "--tag", "global_step3"], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


@pytest.mark.slow
def test_a_job_resumes_on_fewer_nodes_from_the_copies_one_node_holds(tmp_path: Path) -> None:
    launch("save", 2, tmp_path)
    shutil.rmtree(tmp_path / "local" / "node1")
    launch("load", 2, tmp_path, "one-node", nodes=1)
    saved = torch.load(tmp_path / "save_rank0.pt", weights_only=False)
    for rank in range(2):
        loaded = torch.load(tmp_path / f"load_rank{rank}.pt", weights_only=False)
        assert Path(loaded["load_path"]).is_relative_to(tmp_path / "local" / "node0"), loaded["load_path"]
        assert loaded["global_steps"] == saved["global_steps"]
        # every parameter's fp32 master and both moments, gathered from the two ranks' partitions
        assert_same_object(loaded["full"], saved["full"], f"rank {rank} full state")
        assert loaded["persistent_read_bytes"] == 0, f"rank {rank} read the save folder"
