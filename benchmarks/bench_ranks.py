"""Bytes each data-parallel rank writes in one DeepSpeed ZeRO-1/2 save: the rank-0 straggler.

DeepSpeed's own engine writes the whole 16-bit module on data-parallel rank 0, on top of the
optimizer shard every rank writes; the engine stores that module as derived from the shards'
fp32 master partitions, so every rank writes about the same. For each data-parallel size this
launches that many ranks (torchrun, gloo, DeepSpeed's CPU accelerator), trains a stack of MLP
blocks in bf16 (fp32 where the accelerator lacks bf16) a few steps on random data (dense
gradients, so every element of the Adam state
moves, as in a real run: a language model's embedding rows of unseen tokens would keep zero
moments, which compress to nothing and make the ranks that hold them look light), saves the
same state with DeepSpeed's engine and with ours, and counts the exact bytes of each rank's files
(file names say which rank wrote a file). Deterministic byte counts, so one run suffices.

    python benchmarks/bench_ranks.py --sizes 4,8 --out results/    # the table in docs/BENCHMARKS.md
    python benchmarks/bench_ranks.py --sizes 2 --layers 1 --width 64 --steps 1 --out /tmp/out   # a smoke run

Writes OUT/bench_ranks.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ENGINES = ("default", "nvcomp")
BATCH = 8


class Blocks(torch.nn.Module):
    """`layers` MLP blocks of `width` (4x inner), residual, and an MSE loss."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width))
            for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return torch.nn.functional.mse_loss(x.float(), y)


def rank_bytes(tag_dir: Path) -> dict[int, int]:
    """Bytes of each rank's files in a tag folder, from DeepSpeed's file names."""
    from nvcomp_ckpt_engine.deepspeed.names import rank_of

    out: dict[int, int] = {}
    for path in sorted(tag_dir.glob("*.pt")):
        rank = rank_of(path.name, 1)
        out[rank] = out.get(rank, 0) + path.stat().st_size
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: train, save with both engines, report the bytes (rank 0 writes the result)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    import nvcomp_ckpt_engine.deepspeed as ours
    from bench_deepspeed import ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Blocks(args.width, args.layers)
    bf16 = deepspeed.get_accelerator().is_bf16_supported()  # fp32 on a CPU without bf16 kernels
    config = ds_config(BATCH, bf16=bf16)
    config["zero_optimization"]["stage"] = args.stage
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        x = torch.randn(BATCH, args.width, generator=gen)
        x = x.bfloat16() if bf16 else x
        loss = engine(x, torch.randn(BATCH, args.width, generator=gen))
        engine.backward(loss)
        engine.step()
    folders = {}
    for name in ENGINES:
        if name == "default":
            engine.checkpoint_engine = TorchCheckpointEngine(engine._config)
        else:
            ours.install(engine, algorithm="auto")
        folders[name] = Path(args.save_dir) / name
        engine.save_checkpoint(str(folders[name]), tag="step2")
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {name: rank_bytes(folder / "step2") for name, folder in folders.items()}
        Path(args.result).write_text(json.dumps({"params": params, "bytes": result,
                                                 "dtype": "bf16" if bf16 else "fp32"}))
    engine.destroy()
    dist.destroy_process_group()


def launch(size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run `size` ranks of `worker`; their byte counts."""
    with tempfile.TemporaryDirectory() as scratch, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        result = Path(scratch) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(size),
                   "--master_addr", "127.0.0.1", "--master_port", str(port), str(Path(__file__).resolve()),
                   "--worker", "--save-dir", scratch, "--result", str(result), "--stage", str(args.stage),
                   "--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        if sys.prefix != sys.base_prefix:  # one JIT-op cache per environment (a shared one is rebuilt)
            env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        subprocess.run(command, env=env, check=True, capture_output=not args.verbose, timeout=1800)
        return json.loads(result.read_text())


def summary(size: int, counts: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Per engine: rank 0's bytes, the others' mean, their ratio, and the total."""
    rows = []
    for name in ENGINES:
        by_rank = {int(rank): n for rank, n in counts[name].items()}
        others = [n for rank, n in by_rank.items() if rank != 0]
        mean = statistics.mean(others) if others else by_rank[0]
        rows.append({"dp": size, "engine": name, "rank0_bytes": by_rank[0], "others_mean_bytes": mean,
                     "rank0_over_others": by_rank[0] / mean, "total_bytes": sum(by_rank.values()),
                     "by_rank": by_rank})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,8", help="data-parallel sizes, comma-separated")
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2), help="ZeRO stage")
    parser.add_argument("--width", type=int, default=512, help="model width")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps before the saves")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(HERE))
        worker(args)
        return 0
    rows, params, dtype = [], None, None
    for size in (int(s) for s in args.sizes.split(",")):
        found = launch(size, args)
        params, dtype = found["params"], found["dtype"]
        rows.extend(summary(size, found["bytes"]))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"params": params, "stage": args.stage, "dtype": dtype, "rows": rows}
    (args.out / "bench_ranks.json").write_text(json.dumps(report, indent=2))
    print(f"MLP blocks, {params:,} parameters, ZeRO-{args.stage} {dtype}; bytes per rank")
    print("| DP | engine | rank 0 | other ranks (mean) | rank 0 / others | all ranks |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dp']} | {r['engine']} | {r['rank0_bytes']:,} | {r['others_mean_bytes']:,.0f} | "
              f"{r['rank0_over_others']:.3f} | {r['total_bytes']:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
