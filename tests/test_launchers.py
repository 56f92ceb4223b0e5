"""Kill-and-resume round trips of the demo job through every launcher script, on the CPU.

Each launch test runs one script of `launch_scripts/` twice with 2 ranks, as a user would:
attempt 1 trains, saves `global_step4` and is SIGKILLed after step 6 (every rank or one,
depending on the case); attempt 2 is the very same command, which must resume from
`global_step4` and recompute steps 5 and 6 with bit-identical losses (step 5 checks the weights
and the data position, step 6 the optimizer state), then finish. The checkpoints must be the
engine's: a manifest, shard files in its format, and `nvcomp-ckpt verify` content.

The scripts never name the engine; ds_config's "nvcomp_checkpoint" section and the import hook
installed with the package (`pip install -e .`) turn it on. A launch takes 5-15 s once
DeepSpeed's JIT op is built (the first launch in an environment builds it, ~1 min).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from capabilities import unsupported_reason
from nvcomp_ckpt_engine import is_shard_file
from nvcomp_ckpt_engine.cli import main as nvcomp_ckpt_cli
from nvcomp_ckpt_engine.demo.compare import LossRecord, compare, read_loss_log
from nvcomp_ckpt_engine.demo.data import SampleOrder, load_corpus
from nvcomp_ckpt_engine.manifest import MANIFEST_NAME

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "launch_scripts"
STEPS, SAVE_EVERY, KILL_AT = 8, 4, 6
# Generous: the first launch in a fresh environment JIT-builds DeepSpeed's CPU op.
LAUNCH_TIMEOUT_S = 600
#: Placeholder in a launch command for the path of the test's ds_config.
CONFIG = "{ds_config}"


@dataclass(frozen=True)
class Case:
    """One launcher run: the DeepSpeed setup it trains with and the rank(s) the failure kills."""

    stage: int
    bf16: bool
    kill_rank: int  # -1: every rank
    accumulation: int = 1


def write_ds_config(path: Path, case: Case) -> Path:
    """A small ds_config that turns the engine on; torch's Adam, since no fused op runs on a CPU."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": case.accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": case.stage},
        "bf16": {"enabled": case.bf16},
        "nvcomp_checkpoint": {"enabled": True},
    }
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def free_port() -> int:
    """A TCP port that is free now on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a launch: this interpreter's tools first on PATH, the CPU accelerator,
    one JIT-op cache per environment (a shared one is rebuilt at every switch)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DS_ACCELERATOR"] = "cpu"
    if sys.prefix != sys.base_prefix:
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env.update(extra)
    return env


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start one launcher process from the repository root, its output into `log`, in a session
    of its own: the launch scripts run the launcher as a child (to explain a failure after it),
    so a hung launch is ended by killing the whole group, launcher and ranks."""
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> list[int]:
    """Wait for the processes; return their exit codes (a hung launch fails the test)."""
    codes = []
    for proc, log in zip(procs, logs):
        try:
            codes.append(proc.wait(timeout=LAUNCH_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"launch did not finish in {LAUNCH_TIMEOUT_S} s:\n{tail(log)}")
    return codes


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def assert_engine_checkpoint(save_dir: Path, tag: str) -> None:
    """The tag was written and committed by the engine, and every checksum in it is right."""
    tag_dir = save_dir / tag
    assert (tag_dir / MANIFEST_NAME).is_file(), (
        f"{tag_dir} has no {MANIFEST_NAME}: is the package installed (pip install -e .), so that "
        f"its DeepSpeed import hook runs?"
    )
    shards = sorted(tag_dir.glob("*.pt"))
    assert shards and all(is_shard_file(p) for p in shards), [p.name for p in shards]
    assert nvcomp_ckpt_cli(["verify", "-q", str(save_dir), "--tag", tag]) == 0


def run_round_trip(
    tmp_path: Path, case: Case, commands: list[list[str]], env: dict[str, str]
) -> None:
    """Attempt 1 (killed), then attempt 2 (the same commands); check the resume.

    The commands of one attempt run at the same time (one per fake node); `CONFIG` in them
    stands for the ds_config written for `case`. A bf16 case is skipped where DeepSpeed's CPU
    accelerator does not support bf16.
    """
    reason = unsupported_reason("bf16" if case.bf16 else "fp32")
    if reason is not None:
        pytest.skip(reason)
    save_dir, loss_log = tmp_path / "checkpoints", tmp_path / "losses.jsonl"
    config = str(write_ds_config(tmp_path / "ds_config.json", case))
    demo_args = [
        "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--save-dir", str(save_dir),
        "--loss-log", str(loss_log),
        "--kill-at-step", str(KILL_AT), "--kill-rank", str(case.kill_rank),
    ]  # fmt: skip
    for attempt in (1, 2):
        logs = [tmp_path / f"attempt{attempt}.{i}.log" for i in range(len(commands))]
        argvs = [[config if a == CONFIG else a for a in cmd] + demo_args for cmd in commands]
        codes = finish([start(argv, env, log) for argv, log in zip(argvs, logs)], logs)
        output = "\n".join(tail(log) for log in logs)
        if attempt == 1:
            assert all(
                code != 0 for code in codes
            ), f"attempt 1 should have died, exit codes {codes}:\n{output}"
            assert (save_dir / "latest").read_text().strip() == "global_step4", output
            assert not (save_dir / "global_step8").exists()
            assert_engine_checkpoint(save_dir, "global_step4")
        else:
            assert codes == [0] * len(codes), f"attempt 2 failed, exit codes {codes}:\n{output}"

    records = read_loss_log(loss_log)
    first = {r.step: r.loss for r in records if r.start_step == 0}
    resumed = {r.step: r.loss for r in records if r.start_step == 4}
    assert sorted(first) == list(range(1, KILL_AT + 1)), records
    assert sorted(resumed) == list(range(5, STEPS + 1)), records
    assert {s: resumed[s] for s in (5, 6)} == {s: first[s] for s in (5, 6)}
    assert (save_dir / "latest").read_text().strip() == "global_step8"
    assert_engine_checkpoint(save_dir, "global_step8")


def script(name: str, *args: str) -> list[str]:
    """`bash launch_scripts/NAME CONFIG ARGS...`: every script takes the ds_config first."""
    return ["bash", str(SCRIPTS / name), CONFIG, *args]


@pytest.mark.slow
def test_torchrun_single_node(tmp_path: Path) -> None:
    run_round_trip(
        tmp_path,
        Case(stage=2, bf16=False, kill_rank=-1),
        [script("torchrun.sh", "2")],
        launch_env(),
    )


@pytest.mark.slow
def test_deepspeed_launcher_single_node(tmp_path: Path) -> None:
    env = launch_env(MASTER_PORT=str(free_port()))
    run_round_trip(
        tmp_path, Case(stage=3, bf16=False, kill_rank=1), [script("deepspeed.sh", "2")], env
    )


@pytest.mark.slow
def test_mpirun(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py", reason="mpirun test needs mpi4py (pip install mpi4py mpich)")
    env = launch_env(MASTER_PORT=str(free_port()))
    if shutil.which("mpirun", path=env["PATH"]) is None:
        pytest.skip("mpirun test needs an MPI launcher (pip install mpich)")
    # DeepSpeed's MPI discovery takes the master address from `hostname -I`, which is not a
    # loopback address here: a shim answers 127.0.0.1 and passes everything else on.
    shim = tmp_path / "bin"
    shim.mkdir()
    real_hostname = shutil.which("hostname")
    (shim / "hostname").write_text(
        f'#!/bin/sh\nif [ "$1" = "-I" ]; then echo 127.0.0.1; else exec {real_hostname} "$@"; fi\n'
    )
    (shim / "hostname").chmod(0o755)
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    case = Case(stage=1, bf16=True, kill_rank=0, accumulation=2)
    run_round_trip(tmp_path, case, [script("mpirun.sh", "2")], env)


@pytest.mark.slow
def test_torchrun_two_nodes(tmp_path: Path) -> None:
    """Two torchrun agents on this machine, one rank each, meeting in a c10d rendezvous."""
    env = launch_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID=tmp_path.name)
    node = script("torchrun_multinode.sh", "2", "1")
    run_round_trip(tmp_path, Case(stage=2, bf16=True, kill_rank=1), [node, node], env)


@pytest.mark.slow
def test_deepspeed_launcher_two_nodes(tmp_path: Path) -> None:
    """Two `deepspeed` launchers with one hostfile, started per host (--no_ssh: no sshd here)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    env = launch_env(HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    commands = [
        ["env", f"NODE_RANK={rank}", *script("deepspeed_multinode.sh", "2", "1")] for rank in (0, 1)
    ]
    run_round_trip(tmp_path, Case(stage=3, bf16=True, kill_rank=0), commands, env)


@pytest.mark.slow
def test_slurm_sbatch_script(tmp_path: Path) -> None:
    """The sbatch script on one "node", with stand-ins for Slurm's srun and scontrol."""
    shim = tmp_path / "bin"
    shim.mkdir()
    # srun: drop its options and run the command once; scontrol: the node list is this host.
    (shim / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    (shim / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    for tool in shim.iterdir():
        tool.chmod(0o755)
    env = launch_env(
        SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NODELIST="node-a", SLURM_NNODES="1",
        SLURM_JOB_ID=tmp_path.name, MASTER_PORT=str(free_port()),
    )  # fmt: skip
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    run_round_trip(
        tmp_path, Case(stage=1, bf16=False, kill_rank=-1), [script("slurm.sbatch", "2")], env
    )


@pytest.mark.slow
def test_demo_failure_resume_script(tmp_path: Path) -> None:
    """The README's main command, shortened: reference run, killed job, relaunch, same losses."""
    env = launch_env(
        STEPS=str(STEPS), SAVE_EVERY=str(SAVE_EVERY), KILL_AT=str(KILL_AT), RUN_DIR=str(tmp_path)
    )
    # Installed, not merely importable from the source tree: otherwise the script would build a
    # virtual environment of its own.
    installed = subprocess.run(
        [sys.executable, "-c", "import nvcomp_ckpt_engine.demo"], cwd="/", env=env
    )
    assert installed.returncode == 0, "install the package first: pip install -e '.[deepspeed]'"
    result = subprocess.run(
        ["bash", str(SCRIPTS / "demo_failure_resume.sh")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3 * LAUNCH_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"IDENTICAL: {STEPS} steps, resumed at step(s) [4]" in result.stdout, result.stdout
    assert_engine_checkpoint(tmp_path / "job", "global_step8")
    assert_one_line_per_phase(result.stdout.splitlines())


@pytest.mark.slow
def test_demo_failure_resume_script_relaunched_on_fewer_ranks(tmp_path: Path) -> None:
    """RESUME_NPROC=1 after a 2-rank job: the global batch kept by gradient accumulation, the
    checkpoint resharded by a plain load, the state after the resume the saved one bit for bit,
    the losses shown beside the reference."""
    env = launch_env(STEPS=str(STEPS), SAVE_EVERY=str(SAVE_EVERY), KILL_AT=str(KILL_AT),
                     RUN_DIR=str(tmp_path), RESUME_NPROC="1")
    result = subprocess.run(
        ["bash", str(SCRIPTS / "demo_failure_resume.sh"), "configs/ds_zero2.json", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3 * LAUNCH_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "relaunched on 1 rank(s), the global batch of 2 samples kept" in out, out
    assert "RESUMED STATE IDENTICAL: every parameter's fp32 master and Adam moments after the " \
           "resume at step(s) [4] equal the saved ones bit for bit" in out, out
    assert f"LOSSES BESIDE THE REFERENCE: {STEPS} steps, resumed at step(s) [4]" in out, out
    assert (tmp_path / "attempt2.log").read_text().count("[demo rank 1]") == 0
    assert_engine_checkpoint(tmp_path / "job", "global_step8")


def assert_one_line_per_phase(lines: list[str]) -> None:
    """Each phase says what it does as it starts, before what it produces: the user is never
    left wondering for a minute whether anything is happening."""
    starts = [i for i, line in enumerate(lines) if line.startswith("phase ")]
    assert [lines[i].split(":")[0] for i in starts] == [f"phase {k}/4" for k in (1, 2, 3, 4)], lines
    assert f"{STEPS} steps" in lines[starts[0]] and f"after step {KILL_AT}" in lines[starts[1]]

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    killed = first("simulated failure: SIGKILL")
    resumed, verdict = first("resumed from"), first("IDENTICAL")
    assert starts[0] < starts[1] < killed < starts[2] < resumed < starts[3] < verdict, lines
    # Within a launch, its progress: DeepSpeed starting (it may build its ops then), the first
    # step, each committed checkpoint.
    building, stepping = first("starting DeepSpeed"), first("step    1 ")
    committed = first(f"/reference/global_step{SAVE_EVERY}: ")
    assert starts[0] < building < stepping < committed < starts[1], lines


@pytest.mark.slow
def test_demo_failure_resume_script_shows_the_first_error(tmp_path: Path) -> None:
    """A phase that fails ends with the error that explains it, not only torchrun's report."""
    result = subprocess.run(
        ["bash", str(SCRIPTS / "demo_failure_resume.sh"), str(tmp_path / "missing.json"), "1"],
        cwd=ROOT, env=launch_env(RUN_DIR=str(tmp_path / "run")), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert result.returncode == 1 and "ChildFailedError" in result.stdout, result.stdout
    assert lines[-1].startswith("FileNotFoundError: ") and "missing.json" in lines[-1], lines
    assert lines[-3].startswith("--- the first error in"), lines


def test_compare_accepts_only_identical_losses_after_a_resume() -> None:
    reference = [LossRecord(step, 5.0 - step / 8, 0) for step in (1, 2, 3)]
    job = [*reference[:2], LossRecord(2, reference[1].loss, 1), LossRecord(3, reference[2].loss, 1)]
    assert compare(reference, job) == []
    off_by_one_ulp = [*job[:3], LossRecord(3, math.nextafter(reference[2].loss, 0.0), 1)]
    assert [p.split(":")[0] for p in compare(reference, off_by_one_ulp)] == [
        "step 3 (attempt from step 1)"
    ]
    assert compare(reference, job[:3]) == ["the job never logged steps [3]"]
    assert compare(reference, reference) == [
        "the job log shows no resumed attempt, so it proves nothing about resuming"
    ]


def test_sample_order_depends_only_on_the_data_position() -> None:
    """A resumed run jumps straight to its position and must read what the first run would."""
    corpus = load_corpus()
    sequential, resumed = SampleOrder(corpus, 16, seed=7), SampleOrder(corpus, 16, seed=7)
    position = sequential.windows - 3  # the batch below crosses into the second epoch
    for first in range(0, position, 64):
        sequential.batch(first, 64)
    tokens, targets = sequential.batch(position, 8)
    again, _ = resumed.batch(position, 8)
    assert torch.equal(tokens, again)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert not torch.equal(tokens, SampleOrder(corpus, 16, seed=8).batch(position, 8)[0])


def test_compare_states_requires_the_resumed_state_bit_for_bit(tmp_path: Path) -> None:
    """One flipped bit of one Adam moment after the resume is named; -0.0 for 0.0 too."""
    from nvcomp_ckpt_engine.demo.compare import compare_states

    saved = {"w": {"fp32": torch.tensor([1.0, 0.0]), "exp_avg": torch.tensor([0.5, 0.25]),
                   "exp_avg_sq": torch.tensor([2.0, 3.0])}}
    torch.save(saved, tmp_path / "step4_saved.pt")
    torch.save(saved, tmp_path / "step4_resumed.pt")
    assert compare_states(tmp_path) == ([], [4])
    flipped = {"w": {**saved["w"], "exp_avg": torch.tensor([0.5, 0.25]).view(torch.int32).add(1)
                     .view(torch.float32)}}
    torch.save(flipped, tmp_path / "step4_resumed.pt")
    assert compare_states(tmp_path) == (["step 4: w exp_avg after the resume is not the saved one"], [4])
    torch.save({"w": {**saved["w"], "fp32": torch.tensor([1.0, -0.0])}}, tmp_path / "step4_resumed.pt")
    assert compare_states(tmp_path)[0] == ["step 4: w fp32 after the resume is not the saved one"]


@pytest.mark.parametrize(("world", "accumulation"), [(2, 1), (1, 2)])
def test_the_global_batch_is_kept_by_gradient_accumulation(world: int, accumulation: int) -> None:
    from nvcomp_ckpt_engine.demo.train import keep_global_batch

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "train_batch_size": 2}
    kept = keep_global_batch(config, 2, world)
    assert kept["gradient_accumulation_steps"] == accumulation and "train_batch_size" not in kept
    with pytest.raises(ValueError, match="--global-batch 3 is not a multiple of 2 rank"):
        keep_global_batch(config, 3, 2)
