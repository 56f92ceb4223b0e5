"""The stall of an async save with the node-local tier against without it, side by side in one run.

Two simulated nodes of one rank each (two ``torchrun --nnodes 2`` launchers on this machine,
gloo, DeepSpeed's CPU accelerator) train two identical DeepSpeed engines (bench_ranks.py's MLP
blocks, ZeRO-2, fp32, the same seed), whose ``"nvcomp_checkpoint"`` sections differ only in the
tier: ``plain`` saves to its save folder, ``tier`` to ``SCRATCH/local/node{node}`` with
``"replicas": 1`` and its save folder as the persistent tier. Both have ``"async": true``,
zstd and ``keep_last`` 2. After a warm-up save each, the two take turns (the order swapped every
round), `--saves` timed saves each; before each save its engine trains `--gap` steps (the
quiet steps), then:

  blocked_s      the seconds `save_checkpoint` blocks (the stall; with the tier it includes any
                 wait for the previous save's persistent copy to be committed);
  commit_step_s  the seconds of the training step at which the deferred commit happens (with
                 the tier: the replicas' agreement and the local commit), against the median
                 quiet step (`quiet_step_s`); `commit_steps`: how many steps after the save;
                 `commit_s`: the part of that step in the engine's `commit`;
  complete_s     from the save's start to the end of that step: the checkpoint complete and
                 durable (with the tier: the local copies and every replica; the persistent copy
                 follows in the background, copied and committed in the drain's thread);
  create_s       the part of `blocked_s` in the engine's `create` (the save's start: the
                 previous save finished, its tag folder made);
  drain_commit_s (the tier) the part of `create_s` spent on the previous save's persistent
                 copy (`NvcompCheckpointEngine._finish_drain`: its commit, or the wait for it).

Reported per rank (medians over the saves) and the ratio of the medians with and without the
tier. Figures are per rank: each rank is a process with its own clock.

    python benchmarks/bench_tier_stall.py --width 256 --layers 4 --saves 12 --scratch /tmp/bts --out results/
    python benchmarks/bench_tier_stall.py --width 64 --layers 1 --saves 1 --gap 2 --scratch /tmp/bts \\
        --out /tmp/out   # a smoke run

Writes OUT/bench_tier_stall_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
CONFIGS = ("plain", "tier")
BATCH = 8
#: Steps after a save within which its deferred commit must come (else the run fails).
MAX_COMMIT_STEPS = 200
FIGURES = ("blocked_s", "create_s", "drain_commit_s", "commit_step_s", "commit_s", "quiet_step_s",
           "commit_steps", "complete_s")


def _config(name: str, scratch: Path) -> dict[str, Any]:
    """ZeRO-2, fp32, async saves; the node-local tier for ``tier``."""
    from bench_deepspeed import ds_config  # benchmarks/ is on sys.path

    config = ds_config(BATCH, bf16=False)
    config["zero_optimization"]["stage"] = 2
    nvcomp: dict[str, Any] = {"enabled": True, "async": True, "algorithm": "zstd", "keep_last": 2}
    if name == "tier":
        nvcomp["local_tier"] = {"path": str(scratch / "local" / "node{node}"), "replicas": 1}
    config["nvcomp_checkpoint"] = nvcomp
    return config


class Job:
    """One configuration's DeepSpeed engine on this rank, its data, and its save folder."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        import deepspeed
        import torch.distributed as dist

        from bench_ranks import Blocks

        torch.manual_seed(0)
        model = Blocks(args.width, args.layers)
        self.name = name
        self.width = args.width
        self.save_dir = str(Path(args.scratch) / f"ckpt_{name}")
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(name, Path(args.scratch)))
        self.gen = torch.Generator().manual_seed(dist.get_rank())

    def step(self) -> float:
        """One training step; its seconds."""
        t0 = time.perf_counter()
        x = torch.randn(BATCH, self.width, generator=self.gen)
        loss = self.engine(x, torch.randn(BATCH, self.width, generator=self.gen))
        self.engine.backward(loss)
        self.engine.step()
        return time.perf_counter() - t0

    def save(self, gap: int) -> dict[str, float]:
        """`gap` quiet steps, a save, then steps until its deferred commit; the save's figures."""
        import torch.distributed as dist

        quiet = [self.step() for _ in range(gap)]
        tag = f"global_step{self.engine.global_steps}"
        ckpt = self.engine.checkpoint_engine
        create, drain_commit = _Timed(ckpt, "create"), _Timed(ckpt, "_finish_drain")
        dist.barrier()
        with create, drain_commit:
            t0 = time.perf_counter()
            self.engine.save_checkpoint(self.save_dir, tag=tag)
            blocked = time.perf_counter() - t0
        committing = _Timed(ckpt, "commit")
        with committing:
            for steps in range(1, MAX_COMMIT_STEPS + 1):
                seconds = self.step()
                if ckpt.committed(tag):
                    break
            else:
                raise RuntimeError(f"{self.name}: {tag} not committed within {MAX_COMMIT_STEPS} steps")
        return {"blocked_s": blocked, "commit_step_s": seconds, "quiet_step_s": statistics.median(quiet),
                "commit_steps": steps, "complete_s": time.perf_counter() - t0,
                "create_s": create.seconds, "drain_commit_s": drain_commit.seconds,
                "commit_s": committing.seconds}


class _Timed:
    """The seconds spent in ``owner.attr`` inside the block (the attribute put back after)."""

    def __init__(self, owner: Any, attr: str) -> None:
        self.owner, self.attr, self.seconds = owner, attr, 0.0

    def __enter__(self) -> None:
        original = getattr(self.owner, self.attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(self.owner, self.attr, timed)

    def __exit__(self, *exc: object) -> None:
        delattr(self.owner, self.attr)  # the instance's shadow goes: the class's method again


def worker(args: argparse.Namespace) -> None:
    import nvcomp_ckpt_engine.deepspeed

    nvcomp_ckpt_engine.deepspeed.enable()
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        jobs = {name: Job(name, args) for name in CONFIGS}
        for job in jobs.values():  # first saves pin, warm the codecs, make the tier's folders
            job.save(args.gap)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
        for round_ in range(args.saves):
            for name in CONFIGS if round_ % 2 == 0 else reversed(CONFIGS):
                runs[name].append(jobs[name].save(args.gap))
        for job in jobs.values():
            job.engine.destroy()  # the last saves' drain committed
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, runs)
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(every))
    finally:
        dist.destroy_process_group()


def launch(args: argparse.Namespace, result: Path) -> list[dict[str, list[dict[str, float]]]]:
    """Two launchers (``--nnodes 2``, one rank each), this script's `worker` on each; the ranks'
    figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if sys.prefix != sys.base_prefix:  # one JIT-op cache per environment (a shared one is rebuilt)
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                 str(Path(__file__).resolve()), "--worker", "--result", str(result),
                 "--scratch", str(args.scratch), "--width", str(args.width), "--layers", str(args.layers),
                 "--saves", str(args.saves), "--gap", str(args.gap)] for node in range(2)]
    logs = [Path(args.scratch) / f"launcher{node}.log" for node in range(2)]
    procs = []
    for command, log in zip(commands, logs):
        with log.open("wb") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=1800))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    if codes != [0, 0]:
        raise RuntimeError(f"the launchers exited with {codes}:\n" + "\n".join(
            log.read_text(errors="replace")[-3000:] for log in logs))
    return json.loads(result.read_text())


def summarize(ranks: list[dict[str, list[dict[str, float]]]]) -> list[dict[str, Any]]:
    """Per rank and configuration the median of each figure; the tier's ratio to plain."""
    out = []
    for rank, runs in enumerate(ranks):
        medians = {name: {key: statistics.median(r[key] for r in runs[name]) for key in FIGURES}
                   for name in CONFIGS}
        ratio = {key: medians["tier"][key] / medians["plain"][key]
                 for key in ("blocked_s", "commit_step_s", "complete_s") if medians["plain"][key] > 0}
        out.append({"rank": rank, "median": medians, "tier_over_plain": ratio})
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    print(f"{'rank':>4} {'config':>6} {'blocked s':>10} {'create s':>9} {'drain commit s':>15} "
          f"{'commit step s':>14} {'commit s':>9} {'quiet step s':>13} {'steps':>6} {'complete s':>11}")
    for row in summary:
        for name in CONFIGS:
            m = row["median"][name]
            print(f"{row['rank']:>4} {name:>6} {m['blocked_s']:>10.4f} {m['create_s']:>9.4f} "
                  f"{m['drain_commit_s']:>15.4f} {m['commit_step_s']:>14.4f} {m['commit_s']:>9.4f} "
                  f"{m['quiet_step_s']:>13.4f} "
                  f"{m['commit_steps']:>6.0f} {m['complete_s']:>11.3f}")
        print(f"{row['rank']:>4} {'ratio':>6} " + ", ".join(
            f"{key} {value:.2f}x" for key, value in row["tier_over_plain"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256, help="MLP width (params ~ 8 width^2 per layer)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--saves", type=int, default=12, help="timed saves per configuration")
    parser.add_argument("--gap", type=int, default=5, help="training steps before each save")
    parser.add_argument("--scratch", type=Path, default=Path("bench_tier_stall"))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.scratch = args.scratch.resolve()
    shutil.rmtree(args.scratch, ignore_errors=True)
    args.scratch.mkdir(parents=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ranks = launch(args, args.scratch / "result.json")
    params = args.layers * (8 * args.width * args.width + 7 * args.width)
    summary = summarize(ranks)
    report = {"device": "cpu", "cpus": os.cpu_count(), "params": params, "zero_stage": 2, "dtype": "fp32",
              "nodes": 2, "ranks_per_node": 1, "replicas": 1, "saves": args.saves, "gap": args.gap,
              "summary": summary, "ranks": ranks}
    (args.out / "bench_tier_stall_cpu.json").write_text(json.dumps(report, indent=2))
    print_table(summary)
    shutil.rmtree(args.scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
