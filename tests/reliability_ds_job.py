"""DeepSpeed jobs with injected faults, for tests/test_reliability_ds.py; one process per rank.

Started by torchrun with DS_ACCELERATOR=cpu (2 ranks, gloo), like tests/ds_train.py, whose tiny
model, data and training loop it reuses. What a job does is a list of steps in a JSON spec, so
the test, not this script, decides each scenario:

    reliability_ds_job.py SPEC.json [--enable]

SPEC is ``{"pg_timeout_s": 120, "dtype": "bf16", "jobs": [JOB, ...]}``; a JOB is ``{"dir": ...,
"nvcomp": {...}, "seed": 1234, "steps": [STEP, ...]}`` and every rank runs the jobs in order,
each with a fresh DeepSpeed engine (ZeRO-2, in the spec's training dtype: "bf16", "fp16" or
"fp32"; the faults do not depend on it) saving into ``dir/ckpt`` (or the job's "ckpt"). Steps:

    ["train", n]                 train n steps (the data depends only on the step and the rank)
    ["save", {kwargs}]           engine.save_checkpoint(dir/ckpt, **kwargs)
    ["load", {kwargs}]           engine.load_checkpoint(dir/ckpt, **kwargs)
    ["snapshot", label]          parameters, full optimizer and scheduler state, step count
    ["arm", FAULT] / ["disarm"]  inject FAULT from now on / stop injecting
    ["probe_async"]              record whether the engine saves asynchronously (decoupled)
    ["listdir"]                  record the save folder's entries, `latest` and the complete tags

A FAULT is ``{"rank": 0 | 1 | "all", "point": P, "nth": n, "action": A, "seconds": s}``: on the
given rank, the n-th time (counted from "arm") the code reaches point P, do A. Points are the
places a save can be interrupted: the storage operations through a `FaultPlan` wrapped around
every storage of this process (`storage.wrap_storages`), the others by wrapping a function here:

    save          nvcomp_ckpt_engine.api.save is called (before a file's first byte)
    append        a storage sink's append (a payload write; torn: half lands before the action)
    finish        a storage sink's finish (a file written, not yet durable and visible)
    fsync         the first step that makes something durable: a sink's finish, a publish, a
                  folder's sync
    commit        commit.commit_checkpoint is called (this rank's files are all durable)
    replace:NAME  a finish, publish or rename onto a key ending in NAME (nvcomp_manifest.json:
                  the commit point; .pt: a re-save's staged file renamed into place)
    write_latest  discovery.write_latest is called (manifest durable, `latest` not yet moved)
    ds_latest     DeepSpeed opens `latest` for writing: the file is truncated, then A happens
                  (what a power loss can leave: DeepSpeed writes it without fsync)

Actions: "kill" (SIGKILL this rank), "killjob" (SIGKILL the whole job: torchrun's agent and
every worker, as when a node loses power), "enospc" / "eio" (raise that OSError), "stall" (sleep
`seconds`), "exit" (os._exit(137): the rank dies without cleanup).

Each rank writes ``dir/result_rank<R>.pt`` after every step: snapshots by label, and one event
per step (its error type and message if it raised, the load path, seconds taken), plus the
warnings the engine logged. A step that raises is recorded and the job goes on (every rank
raises at the same commit, so the ranks stay in step).
"""

from __future__ import annotations

import argparse
import builtins
import errno
import json
import logging
import os
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

import ds_train
from nvcomp_ckpt_engine.storage import wrap_storages
from nvcomp_ckpt_engine.storage.faults import Fault, FaultPlan
from worker_exit import exit_worker_now

STAGE = 2


# ------------------------------------------------------------------------------ fault injection


#: Points that are storage operations: the `FaultPlan` ops and key pattern each stands for.
STORAGE_POINTS = {"append": (("append",), "*"), "finish": (("finish",), "*"),
                  "fsync": (("finish", "publish", "sync_prefix"), "*")}


def storage_fault(fault: dict[str, Any]) -> Fault | None:
    """The storage-level form of `fault`, None for a point that is not a storage operation."""
    point = fault["point"]
    if point.startswith("replace:"):
        ops, key = ("finish", "publish", "rename"), "*" + point[len("replace:"):]
    elif point in STORAGE_POINTS:
        ops, key = STORAGE_POINTS[point]
    else:
        return None
    return Fault(ops, nth=fault.get("nth", 1), key=key, tear=point == "append",
                 action=lambda: act(fault))


class Faults:
    """The armed fault of this rank, and a counter per point since it was armed."""

    def __init__(self) -> None:
        self.fault: dict[str, Any] | None = None
        self.count = 0

    def arm(self, fault: dict[str, Any]) -> None:
        rank = fault.get("rank", "all")
        self.fault = fault if rank in ("all", dist.get_rank()) else None
        self.count = 0
        at_storage = storage_fault(fault) if self.fault is not None else None
        wrap_storages(None if at_storage is None else FaultPlan(at_storage).wrap)

    def disarm(self) -> None:
        self.fault = None
        wrap_storages(None)

    def hit(self, point: str, before_act: Callable[[], None] | None = None) -> None:
        """Called at `point`; performs the fault's action on its n-th hit."""
        fault = self.fault
        if fault is None or not _matches(fault["point"], point):
            return
        self.count += 1
        if self.count != fault.get("nth", 1):
            return
        if before_act is not None:
            before_act()
        act(fault)


def _matches(wanted: str, point: str) -> bool:
    return wanted == point


def act(fault: dict[str, Any]) -> None:
    action = fault["action"]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "killjob":
        _kill_job()
    elif action == "exit":
        os._exit(137)
    elif action == "stall":
        time.sleep(float(fault["seconds"]))
    elif action == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    elif action == "eio":
        raise OSError(errno.EIO, "Input/output error (injected)")
    else:
        raise ValueError(f"unknown fault action {action!r}")


def _kill_job() -> None:
    """SIGKILL the launcher and every worker it started, this one last (kill -9 of the job).

    torchrun starts each worker in its own session, so a process-group kill would miss them:
    the siblings are found as the launcher's children.
    """
    agent = os.getppid()
    victims = [pid for pid in _children(agent) if pid != os.getpid()]
    for pid in [agent, *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _children(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(entry))
    return found


def install(faults: Faults) -> None:
    """Wrap the fault points that are not storage operations (module attributes the engine
    looks up at call time); the storage points are armed through `wrap_storages`."""
    import deepspeed.runtime.engine as ds_engine

    from nvcomp_ckpt_engine import api, commit, discovery

    def wrap(owner: Any, name: str, point: str) -> None:
        real = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            faults.hit(point)
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    wrap(api, "save", "save")
    wrap(commit, "commit_checkpoint", "commit")
    wrap(discovery, "write_latest", "write_latest")

    def ds_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if os.path.basename(os.fspath(file)) == "latest" and "w" in mode:
            faults.hit("ds_latest", before_act=lambda: builtins.open(file, "w").close())
        return builtins.open(file, mode, *args, **kwargs)

    ds_engine.open = ds_open  # module globals come before builtins in name lookup


# ------------------------------------------------------------------------------------ the job


class Recorder:
    """Collects this rank's events, snapshots and the engine's warnings; written after every
    step, so a rank that is killed later still leaves what it did before."""

    def __init__(self, job_dir: str) -> None:
        self.path = os.path.join(job_dir, f"result_rank{dist.get_rank()}.pt")
        self.result: dict[str, Any] = {"events": [], "snapshots": {}, "logs": []}
        self.handler = _ListHandler(self.result["logs"])
        logging.getLogger("nvcomp_ckpt_engine").addHandler(self.handler)

    def close(self) -> None:
        logging.getLogger("nvcomp_ckpt_engine").removeHandler(self.handler)

    def write(self) -> None:
        tmp = self.path + ".tmp"
        torch.save(self.result, tmp)
        os.replace(tmp, self.path)


class _ListHandler(logging.Handler):
    def __init__(self, records: list[dict[str, Any]]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"level": record.levelname, "message": record.getMessage()})


def snapshot(engine: Any, case: ds_train.Case, losses: list[torch.Tensor]) -> dict[str, Any]:
    """What a resume must reproduce bit for bit (ds_train.snapshot), plus the step count."""
    snap = ds_train.snapshot(engine, case, losses)
    snap["global_steps"] = engine.global_steps
    return snap


def _listing(ckpt: str) -> dict[str, Any]:
    from nvcomp_ckpt_engine import discovery

    latest = os.path.join(ckpt, discovery.LATEST_NAME)
    return {
        "entries": sorted(os.listdir(ckpt)),
        "latest": open(latest).read() if os.path.exists(latest) else None,
        "complete": discovery.find_complete_checkpoints(ckpt),
    }


def run_job(job: dict[str, Any], dtype: str, faults: Faults) -> None:
    case = ds_train.Case(STAGE, dtype, nvcomp=job.get("nvcomp", {}))
    job_dir = job["dir"]
    ckpt = job.get("ckpt") or os.path.join(job_dir, "ckpt")
    os.makedirs(job_dir, exist_ok=True)
    engine = ds_train.make_engine(case, seed=job.get("seed", 1234), engine_on=True,
                                  case_dir=job_dir)
    recorder = Recorder(job_dir)
    losses: list[torch.Tensor] = []
    try:
        for index, (action, *args) in enumerate(job["steps"]):
            event: dict[str, Any] = {"index": index, "action": action, "error": None}
            started = time.monotonic()
            try:
                if action == "train":
                    start = engine.global_steps
                    losses = ds_train.train(engine, range(start, start + args[0]))
                elif action == "save":
                    engine.save_checkpoint(ckpt, **args[0])
                elif action == "load":
                    load_path, _ = engine.load_checkpoint(ckpt, **args[0])
                    event["load_path"] = load_path
                    event["global_steps"] = engine.global_steps
                elif action == "snapshot":
                    recorder.result["snapshots"][args[0]] = snapshot(engine, case, losses)
                elif action == "arm":
                    faults.arm(args[0])
                elif action == "disarm":
                    faults.disarm()
                elif action == "probe_async":
                    event["decoupled"] = bool(engine.checkpoint_engine.is_decoupled())
                elif action == "listdir":
                    event.update(_listing(ckpt))
                else:
                    raise ValueError(f"unknown step {action!r}")
            except Exception as exc:  # recorded for the test; the ranks fail alike
                event["error"] = {"type": type(exc).__name__, "message": str(exc),
                                  "trace": traceback.format_exc()}
            event["seconds"] = time.monotonic() - started
            recorder.result["events"].append(event)
            recorder.write()
    finally:
        faults.disarm()
        recorder.close()
        engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec")
    parser.add_argument("--enable", action="store_true", help="call enable() (hook not installed)")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    logging.basicConfig(level=logging.WARNING)
    if args.enable:
        import nvcomp_ckpt_engine.deepspeed

        nvcomp_ckpt_engine.deepspeed.enable()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo",
                               timeout=timedelta(seconds=spec.get("pg_timeout_s", 120)))
    faults = Faults()
    install(faults)
    try:
        for job in spec["jobs"]:
            run_job(job, spec["dtype"], faults)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


if __name__ == "__main__":
    main()
