"""`nvcomp-ckpt cost`: what checkpointing costs in idle GPUs and storage, with and without
compression, from given, measured or default figures (the model is costmodel.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from .. import costmodel, manifest
from ..errors import CheckpointError
from .common import SubParsers, resolve_target
from .inspect import inspect_target


#: Default figures for `cost` when nothing measured is given: nvCOMP ANS (float modes, 1 MiB
#: chunks) on DeepSpeed bf16 training state (14 bytes/param), measured on one H200.
DEFAULT_RATIO = 1.22
DEFAULT_COMPRESS_GBPS = 100.0


#: NVIDIA's example: a 70B model's checkpoint (GB) written at this storage bandwidth (GB/s).
DEFAULT_CHECKPOINT_GB = 782.0
DEFAULT_WRITE_GBPS = 5.0


@dataclass(frozen=True)
class MeasuredCheckpoint:
    """What `cost --from` reads from a real checkpoint, and how to say where it came from."""

    raw_bytes: int
    ratio: float
    size_source: str


def measure_checkpoint(path: Path, tag: str | None, ranks: int = 1) -> MeasuredCheckpoint:
    """A real checkpoint's raw size and ratio (raw / on-disk bytes), from its indexes.

    The size is the manifest's: the raw bytes of every rank's files (all `world_size` ranks,
    also where this host sees only its own). One shard file is taken for one rank's of a world
    of ranks alike (its raw bytes × the world: a whole checkpoint, as with a manifest), the
    world being its tag folder's manifest's, else `ranks`; a folder without a manifest counts
    the shard files read. The source says which.
    """
    doc = inspect_target(resolve_target(path, tag))
    totals = doc["totals"]
    if not totals["files"]:
        raise CheckpointError(f"{path}: no readable shard files to measure a ratio from")
    found = doc["manifest"]
    if found is not None:
        raw = found["raw_bytes"]
        what = f"raw bytes of the files of all {found['world_size']} rank(s)"
    elif totals["files"] == 1 and path.is_file():
        world, whose = ranks, "--gpus"
        if manifest.manifest_path(path.parent).exists():
            world, whose = manifest.read_manifest(path.parent).world_size, "its manifest's"
        raw = totals["raw_bytes"] * world
        what = f"raw bytes of 1 shard file x {world} ranks ({whose})"
    else:
        raw = totals["raw_bytes"]
        what = f"raw bytes of the {totals['files']} shard file(s) read; no manifest names others"
    return MeasuredCheckpoint(raw, totals["ratio"], f"measured in {path}: {what}")


def cost_inputs(args: argparse.Namespace) -> tuple[costmodel.CostInputs, dict[str, str]]:
    """The model's inputs and where each figure came from (given > measured > default)."""
    figures: dict[str, tuple[float | None, str]] = {
        "checkpoint_gb": (DEFAULT_CHECKPOINT_GB, "default"),
        "write_gbps": (DEFAULT_WRITE_GBPS, "default"),
        "ratio": (DEFAULT_RATIO, "default (nvCOMP ANS, H200)"),
        "compress_gbps": (DEFAULT_COMPRESS_GBPS, "default (nvCOMP ANS, H200)"),
    }
    if args.from_dir:
        measured = measure_checkpoint(Path(args.from_dir), args.tag, ranks=args.gpus)
        figures["checkpoint_gb"] = (measured.raw_bytes / costmodel.GB, measured.size_source)
        figures["ratio"] = (measured.ratio, f"measured in {args.from_dir}")
    if args.from_bench:
        bench = costmodel.read_bench_json(args.from_bench)
        for name in ("ratio", "compress_gbps", "write_gbps"):
            value = getattr(bench, name)
            if value is not None:
                note = bench.notes.get(name)
                figures[name] = (value, f"from {args.from_bench}" + (f" ({note})" if note else ""))
    for name in figures:
        given = getattr(args, name)
        if given is not None:
            figures[name] = (given, "given")
    inputs = costmodel.CostInputs(
        **{name: value for name, (value, _) in figures.items()},
        interval_min=args.interval_min, gpus=args.gpus, gpu_hour_usd=args.gpu_hour_usd,
        keep=args.keep, storage_usd_per_gb_month=args.storage_usd_per_gb_month,
        copy_gbps=args.copy_gbps, days_per_month=args.days, module_gb=args.module_gb,
        rank_write_gbps=args.rank_write_gbps,
    )
    return inputs, {name: source for name, (_, source) in figures.items()}


def _print_cost(report: costmodel.CostReport, sources: dict[str, str]) -> None:
    i = report.inputs
    print(f"checkpoint {i.checkpoint_gb:,.1f} GB [{sources['checkpoint_gb']}], storage "
          f"{i.write_gbps:.1f} GB/s [{sources['write_gbps']}], every {i.interval_min:g} min "
          f"({report.checkpoints_per_month:,.0f}/month), {i.gpus} GPUs at "
          f"${i.gpu_hour_usd:.2f}/GPU-hour, keep {i.keep}")
    print(f"compression {i.ratio:.3f}x [{sources['ratio']}], {i.compress_gbps:.1f} GB/s per GPU "
          f"[{sources['compress_gbps']}]")
    per_rank = i.module_gb > 0 or i.rank_write_gbps is not None
    if per_rank:
        limit = "no per-rank limit" if i.rank_write_gbps is None else f"{i.rank_write_gbps:g} GB/s per rank"
        print(f"rank 0 writes the {i.module_gb:,.1f} GB module on top of its share; {limit}")
    columns = [("plain", report.baseline, report.ranks_baseline)]
    if i.module_gb > 0:
        columns.append(("module rank 0", report.compressed_module_on_rank0, report.ranks_module_on_rank0))
        columns.append(("derived", report.compressed, report.ranks_compressed))
    else:
        columns.append(("compressed", report.compressed, report.ranks_compressed))
    print(f"{'':34}" + "".join(f"{name:>15}" for name, _, _ in columns))
    rows = [
        ("wait per checkpoint (s)", "wait_s", "{:,.1f}"),
        ("GPU waiting per month (h)", "wait_hours_month", "{:,.1f}"),
        ("idle GPUs per month ($)", "idle_gpu_usd_month", "{:,.0f}"),
        ("stored (GB)", "stored_gb", "{:,.1f}"),
        ("storage per month ($)", "storage_usd_month", "{:,.0f}"),
        ("total per month ($)", "total_usd_month", "{:,.0f}"),
    ]
    for label, field, fmt in rows:
        print(f"{label:34}" + "".join(f"{fmt.format(getattr(cost, field)):>15}" for _, cost, _ in columns))
    if per_rank:
        for label, field in (("rank 0 writes (GB)", "rank0_gb"), ("each other rank writes (GB)", "other_gb"),
                             ("rank 0 / other ranks", "straggler")):
            print(f"{label:34}" + "".join(f"{getattr(ranks, field):>15,.2f}" for _, _, ranks in columns))
    print(f"pipelined save waits for: {report.bottleneck} (compress {report.compress_s:.1f} s, "
          f"write {report.compressed_write_s:.1f} s)")
    print(f"savings: {report.savings_hours_month:,.1f} h and ${report.savings_usd_month:,.0f} "
          "per month")


def run(args: argparse.Namespace) -> int:
    inputs, sources = cost_inputs(args)
    report = costmodel.estimate(inputs)
    if args.json:
        print(json.dumps({**report.to_dict(), "sources": sources}, indent=2))
    else:
        _print_cost(report, sources)
    return 0


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("cost", help="what checkpointing costs in idle GPUs and storage",
                       description="Price a checkpoint policy with and without compression. "
                       "Defaults reproduce NVIDIA's example (782 GB at 5 GB/s every 30 min, "
                       "8 GPUs at $4.40/GPU-hour: 156.4 s per checkpoint, $2,202/month). "
                       "The output says where each figure came from.")
    p.add_argument("--size-gb", dest="checkpoint_gb", type=float,
                   help="raw checkpoint size in GB (1e9 bytes) "
                   f"(default: {DEFAULT_CHECKPOINT_GB:g}, or measured with --from)")
    p.add_argument("--write-gbps", type=float,
                   help="aggregate storage write bandwidth in GB/s "
                   f"(default: {DEFAULT_WRITE_GBPS:g}, or measured with --from-bench)")
    p.add_argument("--interval-min", type=float, default=30.0,
                   help="minutes between saves (default: %(default)g)")
    p.add_argument("--gpus", type=int, default=8,
                   help="GPUs idle during a save (default: %(default)s)")
    p.add_argument("--gpu-hour-usd", type=float, default=4.40,
                   help="$ per GPU-hour (default: %(default).2f)")
    p.add_argument("--keep", type=int, default=1,
                   help="checkpoints retained (default: %(default)s)")
    p.add_argument("--storage-usd-per-gb-month", type=float, default=0.0,
                   help="storage price in $ per GB-month (default: %(default)g: storage not "
                   "priced)")
    p.add_argument("--ratio", type=float,
                   help="compression ratio, raw / on-disk bytes "
                   f"(default: {DEFAULT_RATIO}, or measured with --from or --from-bench)")
    p.add_argument("--compress-gbps", type=float,
                   help="GPU compress throughput per GPU in GB/s "
                   f"(default: {DEFAULT_COMPRESS_GBPS:g}, or measured with --from-bench)")
    p.add_argument("--copy-gbps", type=float,
                   help="device-to-host copy GB/s per GPU (default: none, not a bottleneck)")
    p.add_argument("--module-gb", type=float, default=0.0,
                   help="of --size-gb, the 16-bit module that DeepSpeed ZeRO-1/2 writes on rank 0 "
                   "alone (2 bytes/param in bf16), priced both on rank 0 and derived from the "
                   "optimizer shards, as the engine stores it (default: %(default)g)")
    p.add_argument("--rank-write-gbps", type=float,
                   help="the most one rank can write, GB/s (a node's link or file-system client): "
                   "a save waits for its slowest rank or for the aggregate --write-gbps, whichever "
                   "binds (default: none, no per-rank limit)")
    p.add_argument("--days", type=float, default=30.0,
                   help="days per month (default: %(default)g)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--from", dest="from_dir", metavar="CKPT",
                        help="take the raw size (every rank's files; for a single shard file, "
                        "its raw bytes x --gpus) and the compression ratio (raw / on-disk "
                        "bytes) from a real checkpoint: a save dir, tag folder or shard "
                        "(default: none)")
    source.add_argument("--from-bench", metavar="FILE.json",
                        help='take ratio and throughput from a benchmark JSON: {"ratio": float, '
                        '"compress_gbps": float, "write_gbps": float (optional)}, or the report '
                        "of benchmarks/bench_deepspeed.py (default: none)")
    p.add_argument("--tag", help="with --from on a save directory: the tag to measure "
                   "(default: the one 'latest' names)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (default: a table)")
    p.set_defaults(func=run)
