"""Tiny DeepSpeed ZeRO-1/2 runs for tests/test_derived_module.py, one process per rank.

Started by torchrun with DS_ACCELERATOR=cpu; builds on tests/ds_train.py (its model, config,
data and snapshot). Usage: ds_derived_job.py OUT JOB ... where a JOB is PHASE:CASE[@SOURCE] and
works in OUT/CASE-dpN (N: this launch's world size):
    save        train 3 steps, save with the engine (ckpt/), train 3 more, write save_rank<R>.pt;
    plain       the same run saved by DeepSpeed's own engine (plain/), for byte comparisons;
    resume      another seed, load ckpt/, train 3 steps, write resume_rank<R>.pt;
    moduleonly  another seed, load_checkpoint(load_module_only=True) from OUT/SOURCE/ckpt (SOURCE
                a CASE-dpM folder, maybe of another world size); write the module's parameters
                to moduleonly_<SOURCE>_rank<R>.pt.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from ds_train import STEPS_AFTER, STEPS_BEFORE, Case, make_engine, snapshot, train
from worker_exit import exit_worker_now

CASES = {f"z{stage}-{dtype}": Case(stage, dtype) for stage in (1, 2) for dtype in ("fp32", "bf16")}


def run_job(job: str, out: str) -> None:
    phase, _, spec = job.partition(":")
    name, _, source = spec.partition("@")
    case = CASES[name]
    case_dir = os.path.join(out, f"{name}-dp{dist.get_world_size()}")
    os.makedirs(case_dir, exist_ok=True)
    rank = dist.get_rank()
    if phase in ("save", "plain"):
        engine = make_engine(case, seed=1234, engine_on=phase == "save", case_dir=case_dir)
        train(engine, range(STEPS_BEFORE))
        engine.save_checkpoint(os.path.join(case_dir, "ckpt" if phase == "save" else "plain"))
        losses = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        if phase == "save":
            torch.save(snapshot(engine, case, losses), os.path.join(case_dir, f"save_rank{rank}.pt"))
    elif phase == "resume":
        engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
        load_path, _ = engine.load_checkpoint(os.path.join(case_dir, "ckpt"))
        if load_path is None:
            raise RuntimeError(f"{name}: nothing loaded from {case_dir}")
        losses = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        torch.save(snapshot(engine, case, losses), os.path.join(case_dir, f"resume_rank{rank}.pt"))
    elif phase == "moduleonly":
        engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
        load_path, _ = engine.load_checkpoint(os.path.join(out, source, "ckpt"), load_module_only=True)
        if load_path is None:
            raise RuntimeError(f"{name}: nothing loaded from {source}")
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        torch.save(params, os.path.join(case_dir, f"moduleonly_{source}_rank{rank}.pt"))
    else:
        raise ValueError(f"unknown phase {phase!r} in job {job!r}")
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("jobs", nargs="+", help="PHASE:CASE[@SOURCE]")
    parser.add_argument("--enable", action="store_true", help="call enable() (hook not installed)")
    args = parser.parse_args()
    if args.enable:
        import nvcomp_ckpt_engine.deepspeed

        nvcomp_ckpt_engine.deepspeed.enable()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for job in args.jobs:
            run_job(job, args.out)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


if __name__ == "__main__":
    main()
