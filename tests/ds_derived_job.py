"""Tiny DeepSpeed ZeRO-1/2 runs for tests/test_derived_module.py, one process per rank.

Started by torchrun with DS_ACCELERATOR=cpu; builds on tests/ds_train.py (its model, config,
data and snapshot). Usage: ds_derived_job.py OUT CASE@SOURCE ... Each job works in OUT/CASE-dpN
(N: this launch's world size), in one engine, as starting one costs more than its steps:
  1. train 3 steps; save with the engine (ckpt/) and, from the same state, with DeepSpeed's own
     engine (plain/, the reference); export the 16-bit model with the engine on (export/);
     train 3 more steps and write save_rank<R>.pt;
  2. load_checkpoint(load_module_only=True) from OUT/SOURCE/ckpt (SOURCE: a CASE-dpM folder,
     maybe of another world size) and write the module's parameters to
     moduleonly_<SOURCE>_rank<R>.pt;
  3. load ckpt/ (the whole state), train the same 3 steps again and write resume_rank<R>.pt,
     which must equal save_rank<R>.pt bit for bit.
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
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    name, _, source = job.partition("@")
    case = CASES[name]
    case_dir = os.path.join(out, f"{name}-dp{dist.get_world_size()}")
    os.makedirs(case_dir, exist_ok=True)
    rank = dist.get_rank()
    after = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)

    engine = make_engine(case, seed=1234, engine_on=True, case_dir=case_dir)
    train(engine, range(STEPS_BEFORE))
    engine.save_checkpoint(os.path.join(case_dir, "ckpt"))
    ours, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine(engine._config)
    engine.save_checkpoint(os.path.join(case_dir, "plain"))
    engine.checkpoint_engine = ours
    engine.save_16bit_model(os.path.join(case_dir, "export"))
    torch.save(snapshot(engine, case, train(engine, after)), os.path.join(case_dir, f"save_rank{rank}.pt"))

    if engine.load_checkpoint(os.path.join(out, source, "ckpt"), load_module_only=True)[0] is None:
        raise RuntimeError(f"{name}: nothing loaded from {source}")
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    torch.save(params, os.path.join(case_dir, f"moduleonly_{source}_rank{rank}.pt"))

    if engine.load_checkpoint(os.path.join(case_dir, "ckpt"))[0] is None:
        raise RuntimeError(f"{name}: nothing loaded from {case_dir}")
    torch.save(snapshot(engine, case, train(engine, after)), os.path.join(case_dir, f"resume_rank{rank}.pt"))
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("jobs", nargs="+", help="CASE@SOURCE")
    args = parser.parse_args()
    import deepspeed

    import nvcomp_ckpt_engine.deepspeed

    nvcomp_ckpt_engine.deepspeed.enable()  # what the installed import hook does; idempotent
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for job in args.jobs:
            run_job(job, args.out)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


if __name__ == "__main__":
    main()
