"""The demo training program: one rank of a data-parallel DeepSpeed job on the tiny GPT.

It never names the checkpoint engine: the ds_config's `"nvcomp_checkpoint"` section and the
import hook installed with the package make DeepSpeed use it, as they would for any user script.

What makes a resumed run reproduce the uninterrupted one bit for bit:
- the model is built from a fixed seed on every rank and has no dropout (no RNG in a step);
- the data order is a pure function of the seed and the number of samples consumed, and that
  number is saved in client_state next to the weights, the optimizer and the LR scheduler;
- the run resumes from whatever `latest` names, which the engine writes only after every rank's
  files are durable.

A job relaunched on another number of ranks keeps its global batch with `--global-batch`
(gradient accumulation makes up for the ranks: the same samples each step, in the same order);
its losses then differ from the uninterrupted run's in the last bits (the ranks add in another
order), while the state it resumes from is the saved one bit for bit: with `--state-dir`, rank
0 writes every parameter's full fp32 master and Adam moments at each save and right after the
resume (DeepSpeed's `safe_get_full_fp32_param` / `safe_get_full_optimizer_state`), for
`compare --states` to hold side by side.

A simulated failure (`--kill-at-step`) SIGKILLs one or all ranks right after a step, before
that step's checkpoint is written. It fires only in a run that started without a checkpoint, so
relaunching the very same command resumes and finishes, as a requeued job would.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from ..deepspeed import jit_env
from .data import SampleOrder, load_corpus
from .model import GPTConfig, TinyGPT

logger = logging.getLogger(__name__)

# DeepSpeed's own default when a launcher sets no MASTER_PORT (used by its MPI discovery).
DEFAULT_MASTER_PORT = 29500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the demo; every option has a default that runs in seconds on a CPU."""
    p = argparse.ArgumentParser(
        prog="python -m nvcomp_ckpt_engine.demo",
        description="Train a tiny byte-level GPT with DeepSpeed, checkpointing through ds_config.",
    )
    p.add_argument("--ds-config", default="configs/ds_zero2.json", help="DeepSpeed config (JSON)")
    p.add_argument(
        "--save-dir",
        default="runs/demo/checkpoints",
        help="checkpoint directory (shared by all ranks)",
    )
    p.add_argument("--steps", type=int, default=40, help="train until this optimizer step")
    p.add_argument("--save-every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--loss-log", type=Path, help="rank 0 appends one JSON line per step here")
    p.add_argument(
        "--kill-at-step",
        type=int,
        default=0,
        help="simulated failure: SIGKILL after this step, unless the run resumed (0: never)",
    )
    p.add_argument("--kill-rank", type=int, default=-1, help="rank to kill (-1: every rank)")
    p.add_argument("--seed", type=int, default=1234, help="model initialisation and data order")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sample")
    p.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="samples per optimizer step over all ranks, kept at any number of ranks by "
        "gradient accumulation (0: the ds_config's batch)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        help="rank 0 writes the full optimizer state at each save and after a resume here",
    )
    # The `deepspeed` launcher appends --local_rank; LOCAL_RANK in the environment says the same.
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1 or args.global_batch < 0:
        p.error("--steps and --save-every must be at least 1, --global-batch at least 0")
    return args


def load_ds_config(path: str) -> dict[str, Any]:
    """Read the ds_config; without CUDA, use torch's Adam, which needs no compiled op; train in
    fp32 where the accelerator lacks the config's half precision (many CPUs lack fp16 or bf16
    kernels, and DeepSpeed refuses them), so the demo runs on any machine."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    accelerator = deepspeed.get_accelerator()
    for key, supported in (("bf16", accelerator.is_bf16_supported), ("fp16", accelerator.is_fp16_supported)):
        section = config.get(key, {})
        if section.get("enabled", False) and not supported():
            logger.warning("%s is not supported by this %s accelerator: training in fp32",
                           key, accelerator.device_name())
            section["enabled"] = False
    optimizer = config.get("optimizer", {})
    if not torch.cuda.is_available() and optimizer.get("type", "").lower() in ("adam", "adamw"):
        params = optimizer.setdefault("params", {})
        if not params.get("torch_adam", False):
            logger.info(
                "no CUDA: setting optimizer.params.torch_adam=true "
                "(DeepSpeed's fused Adam needs a GPU)"
            )
            params["torch_adam"] = True
    return config


def keep_global_batch(config: dict[str, Any], global_batch: int, world: int) -> dict[str, Any]:
    """`config` with the gradient accumulation that makes `global_batch` samples a step at
    `world` ranks (the micro-batch kept); ValueError where it does not divide."""
    micro = int(config.get("train_micro_batch_size_per_gpu", 1))
    if global_batch % (micro * world):
        raise ValueError(f"--global-batch {global_batch} is not a multiple of {world} rank(s) x "
                         f"micro-batch {micro}")
    config = {key: value for key, value in config.items() if key != "train_batch_size"}
    config["gradient_accumulation_steps"] = global_batch // (micro * world)
    return config


def write_full_state(engine: Any, path: Path) -> None:
    """Every parameter's full fp32 master and Adam moments, written by rank 0 (a collective:
    every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {}
    for name, param in engine.module.named_parameters():
        state[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu().clone(),
                       **{key: safe_get_full_optimizer_state(param, key).detach().cpu().clone()
                          for key in ("exp_avg", "exp_avg_sq")}}
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)


def _log_loss(path: Path, step: int, loss: float, start_step: int) -> None:
    """Append one step's loss; JSON writes a float's exact `repr`, so logs compare bit for bit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "loss": loss, "start_step": start_step}) + "\n")


def train(args: argparse.Namespace) -> None:
    """Run (or resume) the job up to `args.steps` optimizer steps."""
    for name, value in jit_env.prepare().items():
        logger.info("for DeepSpeed's op builds: %s=%s", name, "(unset)" if value is None else value)
    # Nothing is printed while DeepSpeed compiles its ops, the first time in an environment.
    logger.info("starting DeepSpeed (its first start in an environment builds its ops: "
                "a minute or more on a CPU)")
    deepspeed.init_distributed(
        distributed_port=int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    )
    rank, world = dist.get_rank(), dist.get_world_size()

    # Bit-identical losses after a resume need kernels that add in a fixed order (on a GPU,
    # e.g. the embedding's backward); it raises rather than silently use one that does not.
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    model = TinyGPT(GPTConfig(seq_len=args.seq_len))
    config = load_ds_config(args.ds_config)
    if args.global_batch:
        config = keep_global_batch(config, args.global_batch, world)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    order = SampleOrder(load_corpus(), args.seq_len, args.seed)

    samples = 0  # samples consumed by all ranks together: the data position
    save_dir = Path(args.save_dir)
    if (save_dir / "latest").exists():
        load_path, client = engine.load_checkpoint(str(save_dir))
        if load_path is None or client is None:
            raise RuntimeError(
                f"{save_dir}/latest exists but DeepSpeed loaded no checkpoint from it"
            )
        expected = {"step": engine.global_steps, "seed": args.seed, "seq_len": args.seq_len}
        found = {key: client.get(key) for key in expected}
        if found != expected:
            raise RuntimeError(
                f"{load_path} was saved by a different run: "
                f"client_state {found}, expected {expected}"
            )
        samples = client["samples_consumed"]
        logger.info(
            "resumed from %s at step %d (%d samples consumed)",
            load_path,
            engine.global_steps,
            samples,
        )
        if args.state_dir is not None:
            write_full_state(engine, args.state_dir / f"step{engine.global_steps}_resumed.pt")
    start_step = engine.global_steps

    while engine.global_steps < args.steps:
        # On the engine's device: NCCL reduces only GPU tensors.
        step_loss = torch.zeros((), dtype=torch.float32, device=engine.device)
        for _ in range(accum):
            tokens, targets = order.batch(samples + rank * micro, micro)
            samples += world * micro
            loss = engine(tokens.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / accum
        step = engine.global_steps
        dist.all_reduce(step_loss)
        mean_loss = step_loss.item() / world
        if rank == 0:
            print(f"step {step:4d}  loss {mean_loss:.6f}", flush=True)
            if args.loss_log is not None:
                _log_loss(args.loss_log, step, mean_loss, start_step)
        if step == args.kill_at_step and start_step == 0 and args.kill_rank in (-1, rank):
            logger.warning("simulated failure: SIGKILL to rank %d after step %d", rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.save_every == 0:
            client_state = {
                "samples_consumed": samples,
                "step": step,
                "seed": args.seed,
                "seq_len": args.seq_len,
            }
            engine.save_checkpoint(str(save_dir), client_state=client_state)
            if args.state_dir is not None:
                write_full_state(engine, args.state_dir / f"step{step}_saved.pt")

    engine.destroy()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python -m nvcomp_ckpt_engine.demo` under any launcher."""
    args = parse_args(argv)
    rank = os.environ.get("RANK", os.environ.get("PMI_RANK", "?"))
    logging.basicConfig(level=logging.INFO, format=f"[demo rank {rank}] %(message)s")
    train(args)
    return 0
