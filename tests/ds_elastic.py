"""DeepSpeed runs that save at one data-parallel size and resume at another, for
tests/test_elastic.py; one process per rank (torchrun, DS_ACCELERATOR=cpu, gloo).

Usage: ds_elastic.py OUT JOB ... (several jobs per launch: starting the processes costs more
than a job). A job works in OUT/CASE:
    save:CASE            train `ds_train.STEPS_BEFORE` steps, save with the engine (ds_config
                         turns it on) to OUT/CASE/checkpoints, then give the DeepSpeed engine its
                         default checkpoint engine and save the same step to
                         OUT/CASE/plain_checkpoints; rank 0 writes every parameter's full fp32
                         weights and Adam moments at that step: saved.pt;
    resume:CASE:ROUTE    load a universal checkpoint with ``"load_universal": true`` at this
                         world size, train `ds_train.STEPS_AFTER` steps, and write what a resume
                         must reproduce (`ds_train.snapshot`, plus every parameter's full state
                         right after the load): resume_ROUTE_dpN_rankR.pt. ROUTE "plain": the
                         engine on, a plain load_checkpoint(OUT/CASE/checkpoints), resharded at
                         load; "ours": the engine on, from OUT/CASE/ours.json ({"load_dir",
                         "ds_config"}: what docs/DEEPSPEED.md says, written by the test);
                         "deepspeed": DeepSpeed's own engine, from OUT/CASE/universal_deepspeed
                         (ds_to_universal's); "dsconv": the engine on, from
                         OUT/CASE/universal_of_ours, ds_to_universal run on the engine's own
                         checkpoint (it copies our model-states shards as they are);
    load:CASE[:FOLDER]   the engine on, load OUT/CASE/FOLDER (default checkpoints) as saved, at
                         this world size, and record what it raised (and whether it is
                         DeepSpeed's ZeRORuntimeException too): outcome_dpN.json;
    damaged:CASE         as load, with a byte of the last rank's saved exp_avg partition flipped
                         (put back afterwards), every rank recording what it raised:
                         damaged_dpN_rankR.json.
    fault:CASE           resume:CASE:ours with a codec missing on rank 1 only (its reads of the
                         universal files under zero/ raise UnsupportedCheckpointError), and
                         record on every rank what load_checkpoint raised: fault_rankR.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from worker_exit import exit_worker_now

from ds_train import (
    PROCESS_GROUP_TIMEOUT, STEPS_AFTER, STEPS_BEFORE, Case, make_engine, snapshot, train,
)

CASES: dict[str, Case] = {
    **{f"z{stage}-{dtype}": Case(stage, dtype) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")},
    "z2-fp16": Case(2, "fp16"),
    # ZeRO-1 with bf16 weights and fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer.
    "bf16opt-z1": Case(1, "bf16", extra={"data_types": {"grad_accum_dtype": "fp32"}}),
    # Node-local storage turns the derived module off: the module is stored whole, and the
    # reshard rebuilds nothing from the fp32 partitions.
    "z2-fp32-whole-module": Case(2, "fp32", node_local=True),
    # Saved at two ranks, resumed at four.
    "z2-fp32-dp2": Case(2, "fp32"),
    "z3-bf16-dp2": Case(3, "bf16"),
}


def full_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's full fp32 master weights and Adam moments (a collective: every rank
    calls it), copied to the CPU."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {}
    for name, param in engine.module.named_parameters():
        state[name] = {
            "fp32": safe_get_full_fp32_param(param).detach().cpu().clone(),
            **{key: safe_get_full_optimizer_state(param, key).detach().cpu().clone()
               for key in ("exp_avg", "exp_avg_sq")},
        }
    return state


def _save(case: Case, case_dir: str) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine = make_engine(case, seed=1234, engine_on=True, case_dir=case_dir)
    train(engine, range(STEPS_BEFORE))
    engine.save_checkpoint(os.path.join(case_dir, "checkpoints"))
    engine.checkpoint_engine = TorchCheckpointEngine(None)
    engine.save_checkpoint(os.path.join(case_dir, "plain_checkpoints"))
    state = full_state(engine)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(case_dir, "saved.pt"))
    engine.destroy()


def _resume(case: Case, case_dir: str, route: str) -> None:
    if route == "ours":
        with open(os.path.join(case_dir, "ours.json")) as f:
            documented = json.load(f)
        load_dir, extra = os.path.join(case_dir, documented["load_dir"]), documented["ds_config"]
    elif route == "plain":
        load_dir, extra = os.path.join(case_dir, "checkpoints"), {}
    elif route == "deepspeed":
        load_dir = os.path.join(case_dir, "universal_deepspeed")
        extra = {"checkpoint": {"load_universal": True}}
    elif route == "dsconv":
        load_dir = os.path.join(case_dir, "universal_of_ours")
        extra = {"checkpoint": {"load_universal": True}}
    else:
        raise ValueError(f"unknown route {route!r}")
    case = dataclasses.replace(case, extra={**case.extra, **extra})
    engine = make_engine(case, seed=999, engine_on=route != "deepspeed", case_dir=case_dir)
    load_path, _ = engine.load_checkpoint(load_dir)
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found nothing in {load_dir}")
    loaded = full_state(engine)
    losses = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    result = {**snapshot(engine, case, losses), "loaded": loaded}
    name = f"resume_{route}_dp{dist.get_world_size()}_rank{dist.get_rank()}.pt"
    torch.save(result, os.path.join(case_dir, name))
    engine.destroy()


def _load(case: Case, case_dir: str, folder: str) -> None:
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
    try:
        engine.load_checkpoint(os.path.join(case_dir, folder or "checkpoints"))
        outcome: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # the test checks the type and the message
        outcome = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc(),
                   "deepspeeds_type": isinstance(exc, ZeRORuntimeException)}
    if dist.get_rank() == 0:
        with open(os.path.join(case_dir, f"outcome_dp{dist.get_world_size()}.json"), "w") as f:
            json.dump(outcome, f)
    engine.destroy()


def _flip_moment_byte(case_dir: str) -> str:
    """Flip one byte inside the first chunk of the last saved rank's exp_avg partition (which
    only the optimizer load reads); its path."""
    from nvcomp_ckpt_engine import container

    folder = os.path.join(case_dir, "checkpoints")
    with open(os.path.join(folder, "latest")) as f:
        tag_dir = os.path.join(folder, f.read().strip())
    last = max(n for n in os.listdir(tag_dir) if n.endswith("_optim_states.pt"))
    path = os.path.join(tag_dir, last)
    index = container.read_index(path)
    (entry,) = [t for t in index.tensors if t.key.endswith("/state/0/exp_avg")]
    blob = index.storages[entry.storage].chunks[0]
    with open(path, "r+b") as f:
        f.seek(blob.offset + blob.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def _damaged(case: Case, case_dir: str) -> None:
    engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
    path = _flip_moment_byte(case_dir) if dist.get_rank() == 0 else ""
    dist.barrier()
    try:
        engine.load_checkpoint(os.path.join(case_dir, "checkpoints"))
        outcome: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # the test checks the type and the message
        outcome = {"type": type(exc).__name__, "message": str(exc)}
    name = f"damaged_dp{dist.get_world_size()}_rank{dist.get_rank()}.json"
    with open(os.path.join(case_dir, name), "w") as f:
        json.dump(outcome, f)
    dist.barrier()
    if path:
        _flip_moment_byte(case_dir)  # the same byte flipped back
    dist.barrier()
def _fault_on_rank_1(case: Case, case_dir: str) -> None:
    from nvcomp_ckpt_engine import api
    from nvcomp_ckpt_engine.errors import UnsupportedCheckpointError

    with open(os.path.join(case_dir, "ours.json")) as f:
        documented = json.load(f)
    case = dataclasses.replace(case, extra={**case.extra, **documented["ds_config"]})
    engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
    real = api.load_shard

    def load_shard(index: Any, *args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1 and f"{os.sep}zero{os.sep}" in index.path:
            raise UnsupportedCheckpointError(
                f"{index.path}: codec 'zstd' is not available on this node (injected)")
        return real(index, *args, **kwargs)

    api.load_shard = load_shard
    try:
        engine.load_checkpoint(os.path.join(case_dir, documented["load_dir"]))
        outcome: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # the test checks the type and the message
        outcome = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    finally:
        api.load_shard = real
    with open(os.path.join(case_dir, f"fault_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(outcome, f)
    engine.destroy()


def run_job(job: str, out: str) -> None:
    phase, _, spec = job.partition(":")
    name, _, route = spec.partition(":")
    case_dir = os.path.join(out, name)
    if phase == "save":
        _save(CASES[name], case_dir)
    elif phase == "resume":
        _resume(CASES[name], case_dir, route)
    elif phase == "load":
        _load(CASES[name], case_dir, route)
    elif phase == "damaged":
        _damaged(CASES[name], case_dir)
    elif phase == "fault":
        _fault_on_rank_1(CASES[name], case_dir)
    else:
        raise ValueError(f"unknown phase {phase!r} in job {job!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("jobs", nargs="+", help="PHASE:CASE[:ROUTE]")
    parser.add_argument("--enable", action="store_true", help="call enable() (hook not installed)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.enable:
        import nvcomp_ckpt_engine.deepspeed

        nvcomp_ckpt_engine.deepspeed.enable()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        for job in args.jobs:
            run_job(job, args.out)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


if __name__ == "__main__":
    main()
