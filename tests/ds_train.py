"""Tiny DeepSpeed training runs for tests/test_deepspeed_engine.py, one process per rank.

Started by torchrun (or as one plain process for world size 1) with DS_ACCELERATOR=cpu. It never
mentions the engine: ds_config alone turns it on, through the installed import hook, exactly
as in a user's job (``--enable`` calls `nvcomp_ckpt_engine.deepspeed.enable()` instead, for a
source checkout that is not installed).

Usage: ds_train.py OUT PHASE:CASE[=LABEL] ... (several jobs per launch, since starting the
processes costs more than a job). Each job works in OUT/LABEL (default: OUT/CASE):
    save      train STEPS_BEFORE steps, save_checkpoint, train STEPS_AFTER more steps and write
              the reference (parameters, full optimizer state, losses): save_rank<R>.pt;
    resume    start from another seed, load_checkpoint, train STEPS_AFTER steps, write the
              same: resume_rank<R>.pt;
    load, load-module-only
              load_checkpoint and record what it raised: outcome_rank<R>_ws<N>.json;
    savefail  save tag "good", then tag "bad" with rank 1's writes failing; record the outcome.
Results are plain torch or JSON files, compared by the test. A job that raises writes its
traceback to OUT/LABEL/failed_<PHASE>_rank<R>.txt and the launch goes on with the next job, so one
case's failure (e.g. a dtype this CPU does not support) fails only that case's tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from worker_exit import exit_worker_now

STEPS_BEFORE = 3
STEPS_AFTER = 3
HIDDEN = 32
BATCH = 4
#: A collective one rank never joins (it failed alone) ends the launch after this, not 30 min.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class Case:
    """One training configuration.

    `engine_on_save` False writes a plain DeepSpeed checkpoint; `install` saves with an engine
    given by `nvcomp_ckpt_engine.deepspeed.install` after initialize instead of ds_config;
    `first_save_at` adds an earlier save at that step (for retention), and a save of the loaded
    tag right after the resume (a re-save of an existing tag). `on_store`: the save folder is a
    URL on an object store, ``$DS_TRAIN_STORE/LABEL``, and the script is otherwise unchanged.
    """

    stage: int
    dtype: str  # "fp32" | "bf16" | "fp16"
    engine_on_save: bool = True
    install: bool = False
    first_save_at: int | None = None
    moe: bool = False
    node_local: bool = False
    export_16bit: bool = False
    on_store: bool = False
    nvcomp: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


CASES: dict[str, Case] = {
    **{
        f"z{stage}-{dtype}": Case(stage, dtype, export_16bit=(stage == 3 and dtype == "bf16"))
        for stage in (0, 1, 2, 3)
        for dtype in ("fp32", "bf16")
    },
    # A run that turns the engine on resumes from its last plain checkpoint.
    "plain-to-engine": Case(2, "fp32", engine_on_save=False),
    "moe-z2-fp32": Case(2, "fp32", moe=True),
    "nodelocal-z1-bf16": Case(1, "bf16", node_local=True, nvcomp={"algorithm": "deflate"}),
    # ZeRO-1 with bf16 weights and fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer.
    "bf16opt-z1": Case(1, "bf16", extra={"data_types": {"grad_accum_dtype": "fp32"}}),
    "fp16-z2": Case(2, "fp16"),
    "install-z2-bf16": Case(2, "bf16", engine_on_save=False, install=True),
    # Async saves: written in the background, committed at a later step (or at destroy()).
    "async-z2-bf16": Case(2, "bf16", nvcomp={"async": True}),
    # A host-memory cap far below the state: the save blocks for the rest, still bit-exact.
    "async-capped-z1-fp32": Case(1, "fp32", nvcomp={"async": True, "async_host_memory_gb": 1e-6}),
    "refuse-z1-fp32": Case(1, "fp32", nvcomp={"async": True, "async_if_busy": "refuse"}),
    "retention-z1-fp32": Case(
        1, "fp32", first_save_at=1,
        nvcomp={"keep_last": 1, "log_jsonl": "{case_dir}/commits.jsonl"},
    ),
    # save_dir as s3://bucket/prefix: a sync ZeRO-1 save (its module derived from the fp32
    # partitions) and a model export beside it, and async ZeRO-3 saves with retention and a
    # re-save of the loaded tag.
    "store-z1-fp32": Case(1, "fp32", on_store=True, export_16bit=True),
    "store-async-z3-fp32": Case(3, "fp32", on_store=True, first_save_at=1,
                                nvcomp={"async": True, "keep_last": 1}),
}


#: Cases for a GPU (tests/test_deepspeed_gpu.py): fp16 needs CUDA, nvCOMP compresses there.
GPU_CASES: dict[str, Case] = {
    **{f"gpu-z{stage}-{dtype}": Case(stage, dtype) for stage in (1, 2, 3) for dtype in ("bf16", "fp16")},
    # Async saves whose optimizer state the GPU budget holds a raw copy of: copied on the GPU and
    # encoded beside the next steps; and the same with the copy turned off (encoded in the stall).
    # Three saves each (`first_save_at`, and the resume's re-save): the budget a job caches
    # ahead of its first save grows beside training, the next saves find it whole.
    "gpu-async-z2-bf16": Case(2, "bf16", first_save_at=2, nvcomp={
        "async": True, "async_gpu_snapshot": True, "log_jsonl": "{case_dir}/commits.jsonl"}),
    "gpu-async-nosnapshot-z1-bf16": Case(1, "bf16", first_save_at=2, nvcomp={
        "async": True, "async_gpu_snapshot": False, "log_jsonl": "{case_dir}/commits.jsonl"}),
    "gpu-portable-z1-bf16": Case(1, "bf16", nvcomp={"portable": True}),
    # The ZeRO shard decoded into host memory, as DeepSpeed asks (the others: onto the GPU).
    "gpu-hostload-z1-bf16": Case(1, "bf16", nvcomp={"load_to_gpu": False}),
}
ALL_CASES = {**CASES, **GPU_CASES}


def ds_config(case: Case, *, engine_on: bool, case_dir: str) -> dict[str, Any]:
    nvcomp = {
        key: value.format(case_dir=case_dir) if isinstance(value, str) else value
        for key, value in case.nvcomp.items()
    }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": case.stage},
        "checkpoint": {"use_node_local_storage": case.node_local},
        "nvcomp_checkpoint": {"enabled": engine_on, **nvcomp},
        **case.extra,
    }
    if case.stage == 3:
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    if case.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif case.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


class TinyModel(torch.nn.Module):
    """Two layers (optionally an MoE layer between them) and an MSE loss."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = None
        if moe:
            from deepspeed.moe.layer import MoE

            expert = torch.nn.Linear(HIDDEN, HIDDEN)
            self.moe = MoE(HIDDEN, expert=expert, num_experts=2, ep_size=1, k=1)
        self.out = torch.nn.Linear(HIDDEN, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if self.moe is not None:
            h, _, _ = self.moe(h)
        return torch.nn.functional.mse_loss(self.out(h).float(), y)


def make_engine(case: Case, *, seed: int, engine_on: bool, case_dir: str) -> Any:
    import deepspeed

    torch.manual_seed(seed)
    model = TinyModel(case.moe)
    params: Any = model.parameters()
    if case.moe:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer(
            [{"params": list(model.parameters()), "name": "params"}]
        )
    config = ds_config(case, engine_on=engine_on, case_dir=case_dir)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    if case.install and not engine_on:
        import nvcomp_ckpt_engine.deepspeed

        nvcomp_ckpt_engine.deepspeed.install(engine, algorithm="deflate")
        engine_on = True
    expected = "NvcompCheckpointEngine" if engine_on else "TorchCheckpointEngine"
    actual = type(engine.checkpoint_engine).__name__
    if actual != expected:
        raise RuntimeError(f"DeepSpeed uses {actual}, expected {expected}")
    return engine


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data for a given step and rank, whatever the seed of the run."""
    generator = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
    x = torch.randn(BATCH, HIDDEN, generator=generator).to(dtype)
    y = torch.randn(BATCH, 8, generator=generator)
    return x, y


def train(engine: Any, steps: range) -> list[torch.Tensor]:
    dtype = engine.module.inp.weight.dtype
    losses = []
    for step in steps:
        loss = engine(*(t.to(engine.device) for t in batch(step, dtype)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def snapshot(engine: Any, case: Case, losses: list[torch.Tensor]) -> dict[str, Any]:
    """Everything a resume must reproduce bit for bit, copied to the CPU."""
    import deepspeed

    if case.stage == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {
        "params": params,
        "optimizer": _cpu_copy(engine.optimizer.state_dict()),
        "lr_scheduler": engine.lr_scheduler.state_dict(),
        "global_steps": engine.global_steps,
        "optimizer_class": type(engine.optimizer).__name__,
        "losses": losses,
    }


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def job_dir(job: str, out: str) -> str:
    """OUT/LABEL of a ``PHASE:CASE[=LABEL]`` job (LABEL defaults to CASE)."""
    _, _, spec = job.partition(":")
    name, _, label = spec.partition("=")
    return os.path.join(out, label or name)


def run_recorded(job: str, out: str) -> None:
    """Run one job; if it raises, write its traceback for the test (see the module docstring)."""
    try:
        run_job(job, out)
    except Exception:  # the test reads the file and fails this case alone
        phase = job.partition(":")[0]
        case_dir = job_dir(job, out)
        os.makedirs(case_dir, exist_ok=True)
        path = os.path.join(case_dir, f"failed_{phase}_rank{dist.get_rank()}.txt")
        with open(path, "w") as f:
            f.write(f"{job} failed on rank {dist.get_rank()}:\n{traceback.format_exc()}")


def run_job(job: str, out: str) -> None:
    """Run one ``PHASE:CASE[=LABEL]`` job; see the module docstring."""
    phase, _, spec = job.partition(":")
    name = spec.partition("=")[0]
    case = ALL_CASES[name]
    case_dir = job_dir(job, out)
    ckpt_dir = (f"{os.environ['DS_TRAIN_STORE']}/{os.path.basename(case_dir)}" if case.on_store
                else os.path.join(case_dir, "ckpt"))
    os.makedirs(case_dir, exist_ok=True)  # the results' folder (the save folder may be a URL)
    rank = dist.get_rank()
    if phase == "save":
        engine = make_engine(case, seed=1234, engine_on=case.engine_on_save, case_dir=case_dir)
        if case.first_save_at is not None:
            train(engine, range(case.first_save_at))
            engine.save_checkpoint(ckpt_dir)
        train(engine, range(case.first_save_at or 0, STEPS_BEFORE))
        engine.save_checkpoint(ckpt_dir)
        if case.export_16bit:
            engine.save_16bit_model(f"{ckpt_dir}-export" if case.on_store
                                    else os.path.join(case_dir, "export"))
        losses = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        torch.save(snapshot(engine, case, losses), os.path.join(case_dir, f"save_rank{rank}.pt"))
    elif phase == "resume":
        engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
        with _placement_log(os.path.join(case_dir, f"placement_rank{rank}.json")):
            load_path, _ = engine.load_checkpoint(ckpt_dir)
        if load_path is None:
            raise RuntimeError(f"{name}: load_checkpoint found nothing in {ckpt_dir}")
        if case.first_save_at is not None:
            engine.save_checkpoint(ckpt_dir)  # the loaded tag again: a re-save, staged
        losses = train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        torch.save(snapshot(engine, case, losses), os.path.join(case_dir, f"resume_rank{rank}.pt"))
    elif phase in ("load", "load-module-only"):
        engine = make_engine(case, seed=999, engine_on=True, case_dir=case_dir)
        _record_outcome(case_dir, lambda: engine.load_checkpoint(
            ckpt_dir, load_module_only=phase == "load-module-only"))
    elif phase == "asyncrefuse":
        # A save while the previous async save is still being written is refused on every rank.
        engine = make_engine(case, seed=1234, engine_on=True, case_dir=case_dir)
        train(engine, range(1))
        with _slow_finish(seconds=3.0):
            engine.save_checkpoint(ckpt_dir, tag="first")
            _record_outcome(case_dir, lambda: engine.save_checkpoint(ckpt_dir, tag="second"))
            engine.checkpoint_engine.wait()
    elif phase == "savefail":
        # The second save fails on rank 1 only; every rank must learn it at the commit.
        engine = make_engine(case, seed=1234, engine_on=True, case_dir=case_dir)
        train(engine, range(1))
        engine.save_checkpoint(ckpt_dir, tag="good")
        with _failing_saves(rank == 1):
            _record_outcome(case_dir, lambda: engine.save_checkpoint(ckpt_dir, tag="bad"))
    else:
        raise ValueError(f"unknown phase {phase!r} in job {job!r}")
    engine.destroy()


@contextlib.contextmanager
def _placement_log(path: str) -> Iterator[None]:
    """Write the engine's placement decisions (`deepspeed.placement` log lines) to `path`."""
    from nvcomp_ckpt_engine.deepspeed import placement

    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(placement.__name__)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        with open(path, "w") as f:
            json.dump(messages, f)


def _record_outcome(case_dir: str, action: Any) -> None:
    """Run `action`; write what it raised (type and message), or that it did not, for the test."""
    try:
        action()
        outcome: dict[str, Any] = {"type": None, "message": ""}
    except Exception as exc:  # the test checks the type and the message
        outcome = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    path = os.path.join(case_dir, f"outcome_rank{dist.get_rank()}_ws{dist.get_world_size()}.json")
    with open(path, "w") as f:
        json.dump(outcome, f)


@contextlib.contextmanager
def _slow_finish(seconds: float) -> Iterator[None]:
    """Within the block, every shard file takes `seconds` longer to finish writing."""
    from nvcomp_ckpt_engine import fileio

    real = fileio.ShardFileWriter.finish

    def finish(self: Any) -> int:
        time.sleep(seconds)
        return real(self)

    fileio.ShardFileWriter.finish = finish
    try:
        yield
    finally:
        fileio.ShardFileWriter.finish = real


@contextlib.contextmanager
def _failing_saves(active: bool) -> Iterator[None]:
    """Within the block, shard writes of this process fail as on a full disk (if `active`)."""
    import nvcomp_ckpt_engine.api

    def save(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device (injected by the test)")

    real = nvcomp_ckpt_engine.api.save
    if active:
        nvcomp_ckpt_engine.api.save = save
    try:
        yield
    finally:
        nvcomp_ckpt_engine.api.save = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("jobs", nargs="+", help="PHASE:CASE[=LABEL]")
    parser.add_argument("--enable", action="store_true", help="call enable() (hook not installed)")
    parser.add_argument("--local_rank", type=int, help="set by the deepspeed launcher; unused")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.enable:
        import nvcomp_ckpt_engine.deepspeed

        nvcomp_ckpt_engine.deepspeed.enable()
    import deepspeed

    # gloo on the CPU; a GPU run passes DS_TRAIN_BACKEND=nccl.
    deepspeed.init_distributed(dist_backend=os.environ.get("DS_TRAIN_BACKEND", "gloo"),
                               timeout=PROCESS_GROUP_TIMEOUT)
    try:
        for job in args.jobs:
            run_recorded(job, args.out)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


if __name__ == "__main__":
    main()
