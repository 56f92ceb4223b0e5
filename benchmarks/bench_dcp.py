"""torch.distributed.checkpoint: DCP's own writer and nvcomp_ckpt_engine's, side by side.

One model, one training state (a transformer trained a few AdamW steps on random tokens), saved
and loaded with every variant, round-robin for `--reps` rounds on the same state:

  dcp               DCP's FileSystemWriter / FileSystemReader (torch.save per item)
  dcp-zstd          the same with DCP's experimental ZStandard stream extension, if this torch
                    has it (torch.distributed.checkpoint._extension)
  nvcomp            NvcompFileSystemWriter, algorithm "auto" (nvCOMP ANS on a GPU, zstd on a CPU)
  nvcomp-portable   NvcompFileSystemWriter, portable=True (zstd, CPU-readable)
  dcp-async, nvcomp-async   dcp.async_save with those writers (each is its own CPU stager)

Per variant (medians over the rounds): save_s (until the files are fsynced and .metadata is
written), for async blocked_s (until `async_save` returns and training may go on) and save_s
(until durable), load_s (checkpoint pages dropped from the page cache first), bytes on disk and
the ratio to the raw state, read_s (the same files read cold with large parallel reads and
nothing else, `common.cold_read`: the disk bound of the load, compressed bytes / read bandwidth,
measured in the same run) and load_vs_read (load_s / read_s: 1.0 is a load at the disk bound).
Every load is compared bit for bit with the saved state.

Each variant's checkpoint is deleted once its load has been checked, so the scratch disk holds
one checkpoint at a time (at most about the raw state, the size of DCP's own), and a save does
not start without that much room: a save that fills the disk fails inside `torch.save`, whose
zip writer reports `unexpected pos 704 vs 598` in place of the `No space left on device` under
it (docs/BENCHMARKS.md).

    python benchmarks/bench_dcp.py --device cuda --size 1.3b --reps 3 --out runs/bench_dcp
    python benchmarks/bench_dcp.py --device cpu --size tiny --out runs/bench_dcp_cpu
    torchrun --nproc_per_node 8 benchmarks/bench_dcp.py --device cuda --size 1.3b   # FSDP2

Under torchrun (WORLD_SIZE > 1) the model is sharded with FSDP2 (`fully_shard`) and every rank
saves its shard; otherwise one process saves the whole state (``no_dist``). Writes
OUT/bench_dcp.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from nvcomp_ckpt_engine.dcp import NvcompFileSystemReader, NvcompFileSystemWriter
from common import cold_read, drop_page_cache, folder_bytes  # benchmarks/ is on sys.path when run as a script

logger = logging.getLogger("bench_dcp")

#: width, layers, heads, sequence length, batch
SIZES = {
    "tiny": (128, 2, 4, 64, 4),
    "125m": (768, 12, 12, 256, 8),
    "1.3b": (2048, 24, 16, 256, 8),
}
VOCAB = 32000
VARIANTS = ("dcp", "dcp-zstd", "nvcomp", "nvcomp-portable", "dcp-async", "nvcomp-async")
#: room a save needs on the scratch disk, as a multiple of the raw state: DCP's torch.save files
#: are the largest a variant writes, the raw bytes and about 2 KB of zip records per tensor
#: (0.2% of the tiny state, 0.01% of the 1.3B one); the rest is a margin
ROOM_PER_RAW_BYTE = 1.05


def build_model(size: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    d, layers, heads, _, _ = SIZES[size]
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                         norm_first=True) for _ in range(layers)]
    model = nn.Sequential(nn.Embedding(VOCAB, d), *blocks, nn.LayerNorm(d), nn.Linear(d, VOCAB))
    return model.to(device=device, dtype=dtype)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, size: str, steps: int,
          device: torch.device) -> None:
    """A few steps on random tokens: enough for real Adam moments, not for a good model."""
    _, _, _, seq, batch = SIZES[size]
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(device)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor of a nested state dict (a DTensor as its local shard), in a fixed order."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in tensors_of(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    return [state] if isinstance(state, torch.Tensor) else []


def blank_like(state: Any) -> Any:
    """The same structure with fresh tensors (same device, dtype, placement) filled with 0xFF."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: blank_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank_like(v) for v in state]
    if isinstance(state, (DTensor, torch.Tensor)):
        fresh = state.detach().clone()
        poison(fresh.to_local() if isinstance(fresh, DTensor) else fresh)
        return fresh
    return state


def poison(t: torch.Tensor) -> None:
    """Overwrite `t` with all-ones bits (not zeros, which real state often holds)."""
    if t.numel() and t.is_contiguous():
        t.view(-1).view(torch.uint8).fill_(0xFF)
    else:
        t.zero_()


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.contiguous().view(-1).view(torch.uint8),
                        y.contiguous().view(-1).view(torch.uint8))
        for x, y in zip(a, b))


# ----------------------------------------------------------- compatibility: DCP's zstd
#
# DCP's ZStandard stream extension is experimental and private (the `_extension` module and
# FileSystemWriter's `_extensions` argument; torch 2.7+, tested with 2.13). The variant is
# skipped, with a log line, where either is missing.


def dcp_zstd_extensions() -> list[Any] | None:
    if "_extensions" not in inspect.signature(dcp.FileSystemWriter.__init__).parameters:
        return None
    try:
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError:
        return None
    return [ZStandard()] if ZStandard.is_available() else None


# ------------------------------------------------------------------------- the scratch disk


def lack_of_room(folder: Path, needed: int) -> str | None:
    """Why the disk under `folder` cannot hold a save of `needed` bytes, or None if it can: a
    save is refused before it starts rather than failing midway behind torch's misleading
    message (see `first_error`)."""
    free = shutil.disk_usage(folder).free
    if free >= needed:
        return None
    return (f"{folder} has {free / 1e9:.2f} GB free, and a save of this state needs up to "
            f"{needed / 1e9:.2f} GB; free some room or point --scratch at a larger disk")


def first_error(exc: BaseException) -> BaseException:
    """The error a chain of exceptions began with. `torch.save` reports a failed write (a full
    disk) as the RuntimeError of its zip writer's close, `unexpected pos 704 vs 598`, raised
    while handling the OSError that says what went wrong."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    return exc


# ------------------------------------------------------------------------- the variants


def make_io(variant: str, path: Path, zstd: list[Any] | None) -> tuple[Any, Any]:
    """(storage writer, storage reader) for a variant."""
    base = variant.removesuffix("-async")
    if base == "dcp":
        return dcp.FileSystemWriter(path), dcp.FileSystemReader(path)
    if base == "dcp-zstd":
        return dcp.FileSystemWriter(path, _extensions=zstd), dcp.FileSystemReader(path)
    if base == "nvcomp":
        return NvcompFileSystemWriter(path), NvcompFileSystemReader(path)
    if base == "nvcomp-portable":
        return NvcompFileSystemWriter(path, portable=True), NvcompFileSystemReader(path)
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


class Bench:
    """The state under test and how to save and load it (one process, or FSDP2 ranks)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.distributed:
            backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
            dist.init_process_group(backend)
        self.rank = dist.get_rank() if self.distributed else 0
        index = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", index) if args.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        model = build_model(args.size, self.device, dtype)
        if self.distributed:
            self._shard(model)
        self.params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train(model, optimizer, args.size, args.steps, self.device)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        self.state = {"model": model_sd, "optim": optim_sd}
        self.reference = [t.detach().clone() for t in tensors_of(self.state)]
        self.raw_bytes = self.total(sum(t.numel() * t.element_size() for t in self.reference))
        # Background saves get their own gloo group (see docs/DCP.md).
        self.async_group = dist.new_group(backend="gloo") if self.distributed else None

    @staticmethod
    def _shard(model: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.TransformerEncoderLayer):
                fully_shard(layer)
        fully_shard(model)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.barrier()
        synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        synchronize(self.device)
        self.barrier()
        return time.perf_counter() - t0, out

    def save(self, variant: str, writer: Any) -> dict[str, float]:
        no_dist = not self.distributed
        if not variant.endswith("-async"):
            seconds, _ = self.timed(lambda: dcp.save(self.state, storage_writer=writer,
                                                      no_dist=no_dist))
            return {"save_s": seconds}
        self.barrier()
        synchronize(self.device)
        t0 = time.perf_counter()
        response = dcp.async_save(self.state, storage_writer=writer, no_dist=no_dist,
                                  process_group=self.async_group)
        blocked = time.perf_counter() - t0
        getattr(response, "upload_completion", response).result()
        self.barrier()
        return {"blocked_s": blocked, "save_s": time.perf_counter() - t0}

    def load(self, reader: Any) -> tuple[float, bool]:
        target = blank_like(self.state)
        seconds, _ = self.timed(lambda: dcp.load(target, storage_reader=reader,
                                                 no_dist=not self.distributed))
        return seconds, self.everywhere(same_bits(tensors_of(target), self.reference))

    def everywhere(self, ok: bool) -> bool:
        """True only if `ok` on every rank."""
        if not self.distributed:
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def share(self) -> tuple[int, int]:
        """(rank, ranks): which part of a folder this rank reads (`common.cold_read`)."""
        return (self.rank, dist.get_world_size()) if self.distributed else (0, 1)

    def slowest(self, seconds: float) -> float:
        """The longest of every rank's `seconds` (a load is done when the last rank is)."""
        if not self.distributed:
            return seconds
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def total(self, nbytes: int) -> int:
        """Sum over ranks."""
        if not self.distributed:
            return nbytes
        value = torch.tensor([nbytes], dtype=torch.int64)
        dist.all_reduce(value)
        return int(value.item())


def run_round(bench: Bench, variants: list[str], scratch: Path,
              zstd: list[Any] | None) -> list[dict[str, Any]]:
    """Save, measure and load every variant once, one checkpoint on the disk at a time."""
    rows = []
    for variant in variants:
        path = scratch / variant
        remove(bench, path)  # left by an interrupted run
        lack = lack_of_room(scratch, int(ROOM_PER_RAW_BYTE * bench.raw_bytes))
        if not bench.everywhere(lack is None):
            raise RuntimeError(f"{variant}: not saved: {lack or 'another rank lacks room'}")
        writer, reader = make_io(variant, path, zstd)
        try:
            row: dict[str, Any] = {"variant": variant, **bench.save(variant, writer)}
        except Exception as exc:
            raise RuntimeError(f"{variant}: the save into {path} failed: "
                               f"{first_error(exc)!r}") from exc
        row["bytes"] = folder_bytes(path)
        bench.barrier()  # every rank's file written and closed
        row["read_s"] = bench.slowest(cold_read(path, bench.share())[1])
        row["cache_drop"] = drop_page_cache(path)
        row["load_s"], row["bit_exact"] = bench.load(reader)
        row["load_vs_read"] = row["load_s"] / row["read_s"]
        rows.append(row)
        if bench.rank == 0:
            logger.info("%s", row)
        remove(bench, path)
    return rows


def remove(bench: Bench, path: Path) -> None:
    """Delete a checkpoint folder (rank 0; every rank waits for it)."""
    if bench.rank == 0 and path.exists():
        shutil.rmtree(path)
    bench.barrier()


def summarize(rounds: list[list[dict[str, Any]]], raw_bytes: int) -> list[dict[str, Any]]:
    """Medians per variant, and each variant's time relative to stock DCP's."""
    summary = []
    for rows in zip(*rounds):
        row = {"variant": rows[0]["variant"], "rounds": len(rows),
               "bytes": rows[-1]["bytes"], "ratio": raw_bytes / rows[-1]["bytes"],
               "read_gbps": rows[-1]["bytes"] / 1e9 / statistics.median(r["read_s"] for r in rows),
               "bit_exact": all(r["bit_exact"] for r in rows)}
        for key in ("save_s", "blocked_s", "load_s", "read_s", "load_vs_read"):
            if key in rows[0]:
                row[key] = statistics.median(r[key] for r in rows)
        summary.append(row)
    stock = {r["variant"]: r for r in summary if r["variant"] in ("dcp", "dcp-async")}
    for row in summary:
        base = stock.get("dcp-async" if row["variant"].endswith("-async") else "dcp")
        if base is not None:
            row["save_vs_dcp"] = row["save_s"] / base["save_s"]
            row["load_vs_dcp"] = row["load_s"] / base["load_s"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="parameter dtype (Adam moments follow it)")
    parser.add_argument("--steps", type=int, default=5, help="training steps before saving")
    parser.add_argument("--reps", type=int, default=3, help="rounds over all variants")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--scratch", type=Path, default=Path("bench_dcp_ckpt"),
                        help="where checkpoints are written (use the storage you care about)")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    bench = Bench(args)
    zstd = dcp_zstd_extensions()
    variants = args.variants.split(",")
    if zstd is None and any(v.startswith("dcp-zstd") for v in variants):
        logger.info("this torch has no DCP ZStandard extension; skipping dcp-zstd")
        variants = [v for v in variants if not v.startswith("dcp-zstd")]
    args.scratch.mkdir(parents=True, exist_ok=True)
    rounds = [run_round(bench, variants, args.scratch, zstd) for _ in range(args.reps)]
    summary = summarize(rounds, bench.raw_bytes)
    if bench.rank == 0:
        report = {
            "device": torch.cuda.get_device_name() if bench.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "size": args.size, "dtype": args.dtype,
            "params": bench.params, "ranks": dist.get_world_size() if bench.distributed else 1,
            "raw_bytes": bench.raw_bytes, "summary": summary, "rounds": rounds,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_dcp.json").write_text(json.dumps(report, indent=2))
        for row in summary:
            stall = f"stall {row['blocked_s']:7.3f}s" if "blocked_s" in row else " " * 14
            logger.info("%-16s %s  save %7.3fs  load %7.3fs  %12d bytes  ratio %.3fx  "
                        "cold read %7.3fs (%.2f GB/s)  load/read %.2f  bit-exact %s",
                        row["variant"], stall, row["save_s"], row["load_s"], row["bytes"],
                        row["ratio"], row["read_s"], row["read_gbps"], row["load_vs_read"],
                        row["bit_exact"])
    if bench.distributed:
        dist.destroy_process_group()
    return 0 if all(r["bit_exact"] for r in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
