"""Reliability of whole DeepSpeed jobs: kills, re-saves, unusable `latest`, write failures,
stalled ranks and retention, each injected at a known point of a real save.

Every job is tests/reliability_ds_job.py: DeepSpeed on its CPU accelerator, ZeRO-2 in `DTYPE`
(bf16, or fp32 where this CPU has no bf16: no fault here depends on the dtype), 2 ranks under torchrun with gloo, the engine on through ds_config. A fault is armed by a step of
the job and fires at the n-th time a rank reaches one of the save's code points (see the
script's docstring): SIGKILL of one rank or of the whole job, a raised ENOSPC/EIO, a stall. A
kill is checked the way an operator would meet it: a fresh job resumes from the save folder and
its parameters, full optimizer and scheduler state (and the loss of the next step) must be
bit-identical to those of a reference run that never stopped, at the step of the checkpoint
that must have been loaded. Nothing partial may ever be loaded.

The commit layer's own crash suite (every file-system operation of the save sequence, fake ranks
in one process) is tests/test_commit.py; docs/RELIABILITY.md lists what each file proves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from capabilities import unsupported_reason
from nvcomp_ckpt_engine import container, discovery, fileio, manifest, manifest_files

from test_deepspeed_engine import (
    ROOT, _assert_same, _extensions_dir, _free_port, _site_packages_with_hook,
)

pytestmark = pytest.mark.slow


def training_dtype() -> str:
    """bf16, the dtype these jobs are meant for, where DeepSpeed's CPU accelerator supports it;
    else fp32, so that a CPU without bf16 still runs every fault (none depends on the dtype)."""
    return "bf16" if unsupported_reason("bf16") is None else "fp32"


DTYPE = training_dtype()

JOB = Path(__file__).resolve().with_name("reliability_ds_job.py")
#: No launch may take longer; a hang fails the test instead of stalling CI.
LAUNCH_TIMEOUT_S = 300
#: commit_timeout_s of the stall tests: small, so that a missing rank is named quickly.
COMMIT_TIMEOUT_S = 4

# Steps shared by the jobs (see reliability_ds_job.py for their meaning).
SAVE2_THEN_TRAIN2 = [["train", 2], ["save", {}], ["train", 2]]
RESUME = [["load", {}], ["snapshot", "loaded"], ["train", 1], ["snapshot", "next"]]


def _fault(rank: Any, point: str, action: str, nth: int = 1, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "point": point, "action": action, "nth": nth, **extra}


# ------------------------------------------------------------------------------- launching


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a launch ended: the launcher's exit status and the tail of its output."""

    returncode: int
    output: str


class Jobs:
    """Launches reliability_ds_job.py on 2 ranks and reads back what each rank recorded."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.hooked = _site_packages_with_hook() is not None
        self.env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                    "TORCH_EXTENSIONS_DIR": _extensions_dir()}
        self.env.pop("NVCOMP_CKPT_DEEPSPEED_HOOK", None)
        if not self.hooked:  # a source checkout: make the package importable, enable explicitly
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

    def dir(self, name: str) -> Path:
        return self.out / name

    def launch(self, name: str, jobs: list[dict[str, Any]], *, bare: bool = False) -> Outcome:
        """Run `jobs` (each a dict with "dir" relative to the output folder) in one launch.

        `bare` starts the two ranks directly, without torchrun, so that a rank that dies does
        not take the others down with it (torchrun's agent would kill them at once).
        """
        spec = {"pg_timeout_s": 60, "dtype": DTYPE, "jobs": [
            {**job, **{key: str(self.out / job[key]) for key in ("dir", "ckpt") if key in job}}
            for job in jobs]}
        spec_path = self.out / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        port = _free_port()
        script = [str(JOB), str(spec_path)] + ([] if self.hooked else ["--enable"])
        if bare:
            procs = [subprocess.Popen(
                [sys.executable, *script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                env={**self.env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)},
                start_new_session=True) for r in range(2)]
        else:
            procs = [subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_addr", "127.0.0.1", "--master_port", str(port), *script],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True)]
        return _wait(procs, name)

    def results(self, job_dir: str) -> list[dict[str, Any]]:
        """What each rank recorded, by rank."""
        found = []
        for rank in (0, 1):
            path = self.out / job_dir / f"result_rank{rank}.pt"
            assert path.exists(), f"rank {rank} of {job_dir} recorded nothing"
            found.append(torch.load(path, weights_only=False))
        return found

    def event(self, job_dir: str, rank: int, index: int) -> dict[str, Any]:
        """The event of step `index` on `rank` (asserting that the rank got there)."""
        events = self.results(job_dir)[rank]["events"]
        assert len(events) > index, f"{job_dir}: rank {rank} did not reach step {index}: {events}"
        return events[index]


def _wait(procs: list[subprocess.Popen], name: str) -> Outcome:
    """Wait for every process; past LAUNCH_TIMEOUT_S kill them all and fail: nothing may hang."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                _kill_tree(p.pid)
            raise AssertionError(f"launch {name} hung for {LAUNCH_TIMEOUT_S} s") from None
        outputs.append(out.decode(errors="replace"))
    codes = [p.returncode for p in procs]
    worst = next((c for c in codes if c != 0), 0)
    return Outcome(worst, "\n".join(outputs)[-8000:])


def _kill_tree(pid: int) -> None:
    """SIGKILL a launcher and the workers it started in their own sessions."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        children.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    for victim in [pid, *children]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------ comparing


def assert_same_state(got: dict[str, Any], want: dict[str, Any], where: str, *,
                      losses: bool) -> int:
    """Parameters, optimizer and scheduler state and step count equal bit for bit (uint8 views
    of every tensor); `losses` also compares the losses of the steps trained since. Returns how
    many tensors were compared."""
    keys = ["params", "optimizer", "lr_scheduler", "global_steps"] + (["losses"] if losses else [])
    return sum(_assert_same(got[k], want[k], f"{where}/{k}") for k in keys)


def assert_whole(save_dir: Path) -> list[str]:
    """Every checkpoint that counts as complete is whole: manifest, sizes and CRC-32s agree
    (with an interrupted re-save's staged files taken for what they hold). Returns the tags."""
    tags = discovery.find_complete_checkpoints(save_dir)
    for tag in tags:
        found = manifest.read_manifest(save_dir / tag)
        manifest_files.verify_files(save_dir / tag, found, check_crc=True, allow_pending=True)
    return tags


def leftovers(folder: Path) -> list[str]:
    """Temp files of interrupted writes under `folder`."""
    return sorted(p.name for p in folder.rglob(f"*{fileio.PARTIAL_SUFFIX}"))


# ------------------------------------------------------------------------------- scenarios


@dataclasses.dataclass(frozen=True)
class Kill:
    """A save interrupted by SIGKILL at one point; `step` is the checkpoint a resume loads."""

    name: str
    fault: dict[str, Any]
    step: int
    where: str
    nvcomp: dict[str, Any] = dataclasses.field(default_factory=dict)
    resume_nvcomp: dict[str, Any] = dataclasses.field(default_factory=dict)


#: The second save (global_step4) of a job is interrupted; global_step2 is complete and
#: `latest`. keep_last=1 everywhere: retention must never delete global_step2 before
#: global_step4 is committed.
KILLS = [
    Kill("job-before-payload", _fault(0, "save", "killjob"), 2,
         "the whole job, before the first byte of the save"),
    Kill("rank1-during-payload", _fault(1, "append", "kill", nth=2), 2,
         "rank 1, in the middle of a payload write (half of it lands)"),
    Kill("job-after-payload", _fault(0, "finish", "killjob"), 2,
         "the whole job, a file written but not yet fsynced and renamed"),
    Kill("rank1-after-payload", _fault(1, "commit", "kill"), 2,
         "rank 1, all its files durable, entering the commit"),
    Kill("job-manifest-rename", _fault(0, "replace:" + manifest.MANIFEST_NAME, "killjob"), 2,
         "the whole job, the manifest written to its temp file but not renamed"),
    Kill("job-manifest-before-latest", _fault(0, "write_latest", "killjob"), 2,
         "the whole job, the manifest durable, `latest` not yet moved"),
    Kill("job-ds-latest-torn", _fault(0, "ds_latest", "killjob"), 4,
         "the whole job, DeepSpeed's own rewrite of `latest` truncated (empty file)",
         resume_nvcomp={"fallback_to_complete": True}),
    Kill("rank1-async-background", _fault(1, "append", "kill", nth=2), 2,
         "rank 1, in its background writer thread during an async save",
         nvcomp={"async": True}),
]

#: A tag that exists is saved again after a resume (global_step4 holding step 5's state).
#: `step` 4 is the old checkpoint whole, 5 the new one whole; never a mix.
RESAVE_KILLS = [
    Kill("resave-rank1-staged-payload", _fault(1, "append", "kill", nth=2), 4,
         "rank 1, writing its staged file"),
    Kill("resave-job-manifest-rename", _fault(0, "replace:" + manifest.MANIFEST_NAME, "killjob"),
         4, "the whole job, the new manifest not yet renamed over the old one"),
    Kill("resave-rank1-finalize", _fault(1, "replace:.pt", "kill"), 5,
         "rank 1, the new manifest published, its staged file not yet renamed into place"),
]

#: What `latest` may hold after a power loss (DeepSpeed writes it without fsync), and the
#: tag a plain DeepSpeed-style load would then have to guess.
BAD_LATEST = {
    "empty": b"",
    "zeros": b"\x00" * 12,  # a torn write can expose zeroed blocks
    "missing-tag": b"global_step9",
    "incomplete-tag": b"global_step6",
    "marker-only-tag": b"global_step7",
}


def _reference_job() -> dict[str, Any]:
    """The run that never stops: snapshots after 2..6 steps, checkpoints at steps 2 and 4."""
    return {"dir": "reference", "steps": [
        ["train", 2], ["save", {}], ["snapshot", 2], ["train", 1], ["snapshot", 3],
        ["train", 1], ["save", {}], ["snapshot", 4], ["train", 1], ["snapshot", 5],
        ["train", 1], ["snapshot", 6]]}


def _write_failure_job() -> dict[str, Any]:
    """Three saves fail (ENOSPC on rank 1's payload, EIO at rank 0's first fsync, ENOSPC while
    rank 0 writes the manifest); global_step2 before them must stay intact and `latest`."""
    return {"dir": "writefail", "nvcomp": {"commit_timeout_s": 60}, "steps": [
        ["train", 2], ["save", {}], ["train", 1],
        ["arm", _fault(1, "append", "enospc", nth=2)], ["save", {}], ["disarm"],
        ["arm", _fault(0, "fsync", "eio")], ["save", {"tag": "eio"}], ["disarm"],
        ["arm", _fault(0, "replace:" + manifest.MANIFEST_NAME, "enospc")],
        ["save", {"tag": "manifest_full"}], ["disarm"]]}


#: Step indexes of the three failing saves of the write-failure job, and what each names.
WRITE_FAILURES = {4: (1, "No space left on device"), 7: (0, "Input/output error"),
                  10: (0, "No space left on device")}


def _retention_job() -> dict[str, Any]:
    """keep_last=2 through DeepSpeed; `listdir` snapshots after each save (see the test)."""
    save, quiet = ["save", {}], ["save", {"save_latest": False}]
    return {"dir": "retention", "nvcomp": {"keep_last": 2}, "steps": [
        ["train", 1], save, ["train", 1], save, ["train", 1], save, ["listdir"],  # 6
        ["train", 1], quiet, ["listdir"],  # 9: global_step4 saved, latest still global_step3
        ["train", 1], quiet, ["listdir"],  # 12: global_step5
        ["train", 1], ["arm", _fault(1, "append", "enospc")], save, ["disarm"],
        ["listdir"],  # 17: global_step6 failed
        ["train", 1], save, ["listdir"]]}  # 20: global_step7


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("reliability_ds"))


@pytest.fixture(scope="module")
def first(jobs: Jobs) -> Jobs:
    """One launch: the reference run, the write failures, retention, and an async probe."""
    outcome = jobs.launch("first", [
        _reference_job(), _write_failure_job(), _retention_job(),
        {"dir": "async-probe", "nvcomp": {"async": True}, "steps": [["probe_async"]]}])
    assert outcome.returncode == 0, outcome.output
    return jobs


def async_works(jobs: Jobs) -> bool:
    return bool(jobs.event("async-probe", 0, 0).get("decoupled"))


@pytest.fixture(scope="module")
def crashes(first: Jobs) -> dict[str, Outcome]:
    """Every kill and re-save kill in its own launch, the `latest` variants prepared, then one
    launch that resumes from all of them."""
    jobs, outcomes = first, {}
    reference_ckpt = jobs.dir("reference") / "ckpt"
    for kill in KILLS:
        if kill.nvcomp.get("async") and not async_works(jobs):
            continue
        outcomes[kill.name] = jobs.launch(kill.name, [{
            "dir": kill.name, "nvcomp": {"keep_last": 1, **kill.nvcomp},
            "steps": SAVE2_THEN_TRAIN2 + [["arm", kill.fault], ["save", {}], ["train", 1]]}])
    for kill in RESAVE_KILLS:
        shutil.copytree(reference_ckpt, jobs.dir(kill.name) / "ckpt")
        outcomes[kill.name] = jobs.launch(kill.name, [{
            "dir": kill.name, "steps": [["load", {}], ["train", 1], ["arm", kill.fault],
                                        ["save", {"tag": "global_step4"}]]}])
    _prepare_bad_latest(jobs, reference_ckpt)
    resumes = [{"dir": f"{kill.name}/resume", "nvcomp": kill.resume_nvcomp,
                "ckpt": f"{kill.name}/ckpt", "steps": RESUME}
               for kill in KILLS + RESAVE_KILLS if kill.name in outcomes]
    resumes.append({"dir": "writefail/resume", "ckpt": "writefail/ckpt", "steps": RESUME})
    for name in [*BAD_LATEST, "older-tag"]:
        for fallback in (True, False):
            resumes.append({"dir": f"latest-{name}/resume-{fallback}",
                            "ckpt": f"latest-{name}/ckpt",
                            "nvcomp": {"fallback_to_complete": fallback},
                            "steps": [["load", {}], ["snapshot", "loaded"]]})
    outcome = jobs.launch("resume", resumes)
    assert outcome.returncode == 0, outcome.output
    return outcomes


def _prepare_bad_latest(jobs: Jobs, reference_ckpt: Path) -> None:
    """Copies of the reference checkpoints (global_step2, global_step4) with `latest` spoiled."""
    for name, content in BAD_LATEST.items():
        ckpt = jobs.dir(f"latest-{name}") / "ckpt"
        shutil.copytree(reference_ckpt, ckpt)
        if name == "incomplete-tag":  # a save that wrote its files but never committed
            shutil.copytree(ckpt / "global_step4", ckpt / "global_step6")
            (ckpt / "global_step6" / manifest.MANIFEST_NAME).unlink()
        if name == "marker-only-tag":  # a save killed before its first file was published
            (ckpt / "global_step7").mkdir()
            shutil.copy(ckpt / "global_step4" / manifest.TAG_MARKER_NAME, ckpt / "global_step7")
        (ckpt / discovery.LATEST_NAME).write_bytes(content)
    ckpt = jobs.dir("latest-older-tag") / "ckpt"  # rolled back by hand, or a crash in between
    shutil.copytree(reference_ckpt, ckpt)
    (ckpt / discovery.LATEST_NAME).write_text("global_step2")


def _reference(jobs: Jobs) -> list[dict[Any, Any]]:
    """The uninterrupted run's snapshots, by rank, then by step count."""
    return [result["snapshots"] for result in jobs.results("reference")]


def assert_resumed(jobs: Jobs, job_dir: str, step: int, tag: str | None = None) -> None:
    """Both ranks loaded the checkpoint of `step` (tag `tag`, default global_step<step>) and
    match the uninterrupted run bit for bit, then and after one more step."""
    reference = _reference(jobs)
    tag = tag or f"global_step{step}"
    for rank, result in enumerate(jobs.results(job_dir)):
        load = result["events"][0]
        assert load["error"] is None, load["error"]
        assert load["load_path"] is not None, f"{job_dir}: rank {rank} started from scratch"
        assert Path(load["load_path"]).parent.name == tag, load["load_path"]
        snapshots = result["snapshots"]
        assert snapshots["loaded"]["global_steps"] == step, (job_dir, rank)
        compared = assert_same_state(snapshots["loaded"], reference[rank][step],
                                     f"{job_dir} rank {rank}", losses=False)
        assert compared >= 8, "too few tensors compared: the snapshot is missing state"
        if "next" in snapshots:
            assert_same_state(snapshots["next"], reference[rank][step + 1],
                              f"{job_dir} rank {rank} next step", losses=True)


def warnings_of(jobs: Jobs, job_dir: str) -> str:
    """The engine's warnings on rank 0 (the rank that resolves the tag to load)."""
    return "\n".join(r["message"] for r in jobs.results(job_dir)[0]["logs"])


# ------------------------------------------------------------- 1, 2: kills and re-saves


@pytest.mark.parametrize("kill", KILLS + RESAVE_KILLS, ids=lambda kill: kill.name)
def test_kill_then_resume_is_bit_exact(first: Jobs, crashes: dict[str, Outcome],
                                       kill: Kill) -> None:
    if kill.name not in crashes:
        pytest.skip('"async": true does not make the engine decoupled here: no background '
                    "write to interrupt")
    outcome = crashes[kill.name]
    assert outcome.returncode != 0, f"{kill.name}: the fault never fired:\n{outcome.output}"
    if kill.fault["action"] == "killjob":
        assert outcome.returncode == -signal.SIGKILL, outcome.output
    else:
        assert "Signal 9 (SIGKILL)" in outcome.output, outcome.output
    save_dir = first.dir(kill.name) / "ckpt"
    # Checked before anything loads (a load may complete an interrupted re-save's renames).
    complete = assert_whole(save_dir)
    if kill in KILLS and kill.step == 2:
        # keep_last=1 deletes nothing before the new checkpoint is committed.
        assert "global_step2" in complete, complete
    if kill in RESAVE_KILLS:
        assert complete == ["global_step4", "global_step2"], complete
    assert_resumed(first, f"{kill.name}/resume", kill.step,
                   "global_step4" if kill in RESAVE_KILLS else None)


def test_kill_between_manifest_and_latest_names_the_newer_checkpoint(
        first: Jobs, crashes: dict[str, Outcome]) -> None:
    """`latest` still names global_step2, which is complete: it is honoured, and the warning
    names global_step4, complete but never pointed at."""
    save_dir = first.dir("job-manifest-before-latest") / "ckpt"
    assert (save_dir / discovery.LATEST_NAME).read_text() == "global_step2"
    assert "global_step4" in warnings_of(first, "job-manifest-before-latest/resume")


def test_torn_deepspeed_latest_falls_back_with_a_warning(
        first: Jobs, crashes: dict[str, Outcome]) -> None:
    save_dir = first.dir("job-ds-latest-torn") / "ckpt"
    assert (save_dir / discovery.LATEST_NAME).read_bytes() == b""
    text = warnings_of(first, "job-ds-latest-torn/resume")
    assert "global_step4" in text and "empty" in text, text


def test_interrupted_resave_leaves_no_staged_files_after_the_resume(
        first: Jobs, crashes: dict[str, Outcome]) -> None:
    """The resume completed the renames of the re-save whose manifest was published."""
    tag_dir = first.dir("resave-rank1-finalize") / "ckpt" / "global_step4"
    found = manifest.read_manifest(tag_dir)
    assert found.pending  # the new manifest, written by the re-save
    manifest_files.verify_files(tag_dir, found, check_crc=True)  # every file at its final name
    assert not [p.name for p in tag_dir.iterdir() if manifest.RESERVED_MARK in p.name]


# --------------------------------------------------------------------- 3: unusable latest




@pytest.mark.parametrize("name", BAD_LATEST)
def test_unusable_latest_falls_back_only_when_asked(
        first: Jobs, crashes: dict[str, Outcome], name: str) -> None:
    job = f"latest-{name}"
    assert_resumed(first, f"{job}/resume-True", 4)
    text = warnings_of(first, f"{job}/resume-True")
    assert "falling back" in text and "global_step4" in text, text
    for rank in (0, 1):
        error = first.event(f"{job}/resume-False", rank, 0)["error"]
        assert error is not None, f"{job}: rank {rank} loaded without fallback_to_complete"
        assert error["type"] == "IncompleteCheckpointError", error
        assert "fallback_to_complete" in error["message"], error["message"]
        assert "global_step4" in error["message"], error["message"]


@pytest.mark.parametrize("fallback", [True, False])
def test_latest_naming_an_older_complete_checkpoint_is_honoured(
        first: Jobs, crashes: dict[str, Outcome], fallback: bool) -> None:
    job = f"latest-older-tag/resume-{fallback}"
    assert_resumed(first, job, 2)
    assert "global_step4" in warnings_of(first, job)


# ---------------------------------------------------------------------- 4: write failures


def test_write_failures_fail_every_rank_and_keep_the_previous_checkpoint(
        first: Jobs, crashes: dict[str, Outcome]) -> None:
    for index, (rank, text) in WRITE_FAILURES.items():
        for reporter in (0, 1):
            error = first.event("writefail", reporter, index)["error"]
            assert error is not None, f"step {index}: rank {reporter} did not learn of it"
            assert error["type"] == "CommitError", error
            assert f"rank {rank}:" in error["message"] and text in error["message"], error
    save_dir = first.dir("writefail") / "ckpt"
    assert (save_dir / discovery.LATEST_NAME).read_text() == "global_step2"
    assert assert_whole(save_dir) == ["global_step2"]
    for failed in ("global_step3", "eio", "manifest_full"):
        assert not (save_dir / failed / manifest.MANIFEST_NAME).exists(), failed
    assert leftovers(save_dir) == []  # every temp file of the failed writes was removed
    assert_resumed(first, "writefail/resume", 2)


# ------------------------------------------------------------------------- 6: retention


def _tags(event: dict[str, Any]) -> list[str]:
    return [name for name in event["entries"] if name.startswith("global_step")]


def test_keep_last_through_deepspeed(first: Jobs) -> None:
    event = lambda index: first.event("retention", 0, index)  # noqa: E731
    after3 = event(6)
    assert _tags(after3) == ["global_step2", "global_step3"] and after3["latest"] == "global_step3"
    # Saved without moving `latest`: the newest two, plus the one `latest` names.
    assert _tags(event(9)) == ["global_step3", "global_step4"]
    after5 = event(12)
    assert _tags(after5) == ["global_step3", "global_step4", "global_step5"]
    assert after5["latest"] == "global_step3"
    # A failed save deletes nothing, and its folder waits for the next commit.
    assert event(15)["error"]["type"] == "CommitError"
    after_fail = event(17)
    assert _tags(after_fail) == ["global_step3", "global_step4", "global_step5", "global_step6"]
    assert after_fail["complete"] == ["global_step5", "global_step4", "global_step3"]
    after7 = event(20)
    assert _tags(after7) == ["global_step5", "global_step7"] and after7["latest"] == "global_step7"
    assert after7["complete"] == ["global_step7", "global_step5"]
    assert leftovers(first.dir("retention") / "ckpt") == []


# ----------------------------------------------------------- 5: stalled and dead ranks


@pytest.fixture(scope="module")
def stalls(first: Jobs) -> dict[str, Outcome]:
    """A rank stalls (or dies) on entering the commit of the second save."""
    outcomes = {}
    for name, fault, bare in [
        ("stall-rank1", _fault(1, "commit", "stall", seconds=COMMIT_TIMEOUT_S + 6), False),
        ("stall-rank0", _fault(0, "commit", "stall", seconds=COMMIT_TIMEOUT_S + 6), False),
        ("die-rank1", _fault(1, "commit", "exit"), True),
    ]:
        outcomes[name] = first.launch(name, [{
            "dir": name, "nvcomp": {"commit_timeout_s": COMMIT_TIMEOUT_S},
            "steps": [["train", 1], ["save", {}], ["arm", fault], ["save", {}], ["disarm"]]}],
            bare=bare)
    return outcomes


def _commit_error(jobs: Jobs, job: str, rank: int) -> str:
    error = jobs.event(job, rank, 3)["error"]
    assert error is not None and error["type"] == "CommitError", error
    return error["message"]


def _previous_checkpoint_intact(jobs: Jobs, job: str) -> None:
    save_dir = jobs.dir(job) / "ckpt"
    assert (save_dir / discovery.LATEST_NAME).read_text() == "global_step1"
    assert assert_whole(save_dir) == ["global_step1"]


def test_a_stalled_rank_is_named_within_the_commit_timeout(
        first: Jobs, stalls: dict[str, Outcome]) -> None:
    assert stalls["stall-rank1"].returncode == 0, stalls["stall-rank1"].output
    message = _commit_error(first, "stall-rank1", 0)
    assert "rank(s) [1]" in message and f"within {COMMIT_TIMEOUT_S} s" in message, message
    _commit_error(first, "stall-rank1", 1)  # the late rank fails too, once it arrives
    _previous_checkpoint_intact(first, "stall-rank1")


def test_a_stalled_rank_0_is_named_by_the_others(first: Jobs, stalls: dict[str, Outcome]) -> None:
    assert stalls["stall-rank0"].returncode == 0, stalls["stall-rank0"].output
    message = _commit_error(first, "stall-rank0", 1)
    assert f"within {COMMIT_TIMEOUT_S} s" in message, message
    assert "rank(s) [0]" in message, message
    _previous_checkpoint_intact(first, "stall-rank0")


def test_a_rank_that_dies_in_the_commit_is_named(first: Jobs, stalls: dict[str, Outcome]) -> None:
    outcome = stalls["die-rank1"]
    assert outcome.returncode == 137, outcome.output
    # Raised within the timeout on the survivor, naming the dead rank: from gloo's barrier
    # timeout, or, when gloo sees the socket close first, from the arrival keys in the store.
    message = _commit_error(first, "die-rank1", 0)
    assert "rank(s) [1]" in message, message
    _previous_checkpoint_intact(first, "die-rank1")


def test_kill_point_count() -> None:
    """docs/RELIABILITY.md reports this count; every point is a different moment of a save."""
    points = {json.dumps(kill.fault, sort_keys=True) + str(kill.nvcomp) for kill in KILLS}
    assert len(points) == len(KILLS) >= 8
    assert len(RESAVE_KILLS) >= 3
    logging.getLogger(__name__).info(
        "DeepSpeed kill points: %d (%d during a first save, %d during a re-save)",
        len(KILLS) + len(RESAVE_KILLS), len(KILLS), len(RESAVE_KILLS))


# ------------------------------------------------ 6: one verdict on every rank, and the fallback


#: The checkpoints both verdict jobs resume from: global_step2, then global_step4, whose ZeRO
#: shard of rank 1 each job damages (16 bytes of a payload chunk flipped).
VERDICT_SOURCE = {"dir": "verdict-source", "steps": [
    ["train", 2], ["save", {}], ["snapshot", 2], ["train", 2], ["save", {}]]}


def _flip_16_bytes_of_rank1_shard(tag_dir: Path) -> Path:
    """Flip 16 bytes in the middle of a payload chunk of rank 1's ZeRO shard; returns it."""
    shard, = tag_dir.glob("*zero_pp_rank_1_*optim_states.pt")
    index = container.read_index(shard)
    chunk = max((c for s in index.storages for c in s.chunks), key=lambda c: c.length)
    data = bytearray(shard.read_bytes())
    start = chunk.offset + chunk.length // 2
    data[start:start + 16] = bytes(b ^ 0xFF for b in data[start:start + 16])
    shard.write_bytes(bytes(data))
    return shard


@pytest.fixture(scope="module")
def verdicts(jobs: Jobs) -> tuple[Jobs, Path]:
    """Two checkpoints saved, rank 1's shard of the newer damaged in two copies, then one
    launch resuming from each: without the fallback (both ranks must raise), and with it
    (both must load global_step2, then save with keep_last=1)."""
    outcome = jobs.launch("verdict-source", [VERDICT_SOURCE])
    assert outcome.returncode == 0, outcome.output
    damaged = None
    for name in ("verdict-damaged", "verdict-fallback"):
        shutil.copytree(jobs.dir("verdict-source") / "ckpt", jobs.dir(name) / "ckpt")
        damaged = _flip_16_bytes_of_rank1_shard(jobs.dir(name) / "ckpt" / "global_step4")
    outcome = jobs.launch("verdict-resume", [
        {"dir": "verdict-damaged", "steps": [["load", {}]]},
        {"dir": "verdict-fallback", "nvcomp": {"fallback_to_complete": True, "keep_last": 1},
         "steps": [["load", {}], ["snapshot", "loaded"], ["train", 1], ["save", {}],
                   ["listdir"]]}])
    assert outcome.returncode == 0, outcome.output
    return jobs, Path(damaged.name)


def test_a_damaged_shard_on_rank_1_fails_the_load_on_every_rank(
        verdicts: tuple[Jobs, Path]) -> None:
    """Rank 1's optimizer shard damaged: neither rank returns from load_checkpoint; both raise
    CorruptCheckpointError naming the file and rank 1 (rank 0's own files are intact)."""
    jobs, shard = verdicts
    for rank in (0, 1):
        event = jobs.event("verdict-damaged", rank, 0)
        assert event["error"] is not None, f"rank {rank} returned from load_checkpoint: {event}"
        assert event["error"]["type"] == "CorruptCheckpointError", event["error"]
        message = event["error"]["message"]
        assert "failed on rank 1" in message and shard.name in message, message


def test_fallback_to_complete_true_falls_back_past_a_damaged_shard_on_every_rank(
        verdicts: tuple[Jobs, Path]) -> None:
    """With "fallback_to_complete": true both ranks load global_step2 bit-exact, rank 0 warns
    naming the damaged file, and retention says why it deletes the newer, damaged global_step4."""
    jobs, shard = verdicts
    source = [result["snapshots"] for result in jobs.results("verdict-source")]
    for rank, result in enumerate(jobs.results("verdict-fallback")):
        load = result["events"][0]
        assert load["error"] is None, load["error"]
        assert Path(load["load_path"]).parent.name == "global_step2", load["load_path"]
        assert assert_same_state(result["snapshots"]["loaded"], source[rank][2],
                                 f"fallback rank {rank}", losses=False) >= 8
    warnings = warnings_of(jobs, "verdict-fallback")
    assert "falling back to the newest intact checkpoint 'global_step2'" in warnings, warnings
    assert shard.name in warnings and "failed on rank 1" in warnings, warnings
    listing = jobs.event("verdict-fallback", 0, 4)
    assert _tags(listing) == ["global_step3"], listing
    deleted = [line for line in warnings.splitlines() if "retention: deleting" in line]
    assert any("global_step4" in line and "newer than 'global_step2'" in line
               and shard.name in line for line in deleted), warnings
