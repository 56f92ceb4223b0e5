"""`nvcomp-ckpt cost`: what checkpointing costs in idle GPUs and storage, with and without
compression, from given, measured or default figures (the model is costmodel.py)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from .. import costmodel, manifest
from ..errors import CheckpointError
from ..storage import is_file, locations
from ..storage.locations import Location
from .common import SubParsers, location_exists, resolve_target
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


def measure_checkpoint(path: Location, tag: str | None, ranks: int = 1) -> MeasuredCheckpoint:
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
    elif totals["files"] == 1 and is_file(*locations.resolve(path)):
        world, whose = ranks, "--gpus"
        if location_exists(manifest.manifest_path(path.parent)):
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
        measured = measure_checkpoint(locations.location(args.from_dir), args.tag, ranks=args.gpus)
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


#: Units a row of the table or a figure may be shown in, largest first: a small checkpoint's
#: figures are shown in the unit that fits them, not as "0.0 GB" or "$0".
BYTE_UNITS = (("GB", costmodel.GB), ("MB", 1e6), ("KB", 1e3), ("B", 1.0))
TIME_UNITS = (("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("us", 1e-6),
              ("ns", 1e-9))


def fitting_unit(largest: float, units: tuple[tuple[str, float], ...], start: str
                 ) -> tuple[str, float]:
    """The largest of `units` from `start` down in which `largest` is at least 1 (`start`
    for 0, the smallest unit below that)."""
    names = [name for name, _ in units]
    candidates = units[names.index(start):]
    if largest == 0:
        return candidates[0]
    return next(((n, f) for n, f in candidates if abs(largest) >= f), candidates[-1])


def decimal_size_text(gb: float) -> str:
    """A size given in GB, in the decimal unit that fits it (as the cost model counts: 1 GB =
    1e9 bytes; `common.size_text` is binary, as `du -h`): 782.0 GB, 1.9 MB, 312 B."""
    unit, factor = fitting_unit(gb * costmodel.GB, BYTE_UNITS, "GB")
    value = gb * costmodel.GB / factor
    return f"{value:,.0f} B" if unit == "B" else f"{value:,.1f} {unit}"


def duration_text(seconds: float, start: str = "s") -> str:
    """A duration in the unit that fits it, at most `start`: 156.4 s, 3.2 ms, 62.6 h."""
    unit, factor = fitting_unit(seconds, TIME_UNITS, start)
    return f"{seconds / factor:,.1f} {unit}"


def usd_decimals(largest: float) -> int:
    """Decimals for dollar amounts up to `largest`: none from $100, cents from one cent, and
    below that enough to show two significant digits."""
    largest = abs(largest)
    if largest == 0 or largest >= 100:
        return 0
    if largest >= 0.01:
        return 2
    return min(12, math.floor(-math.log10(largest)) + 2)


def usd_text(usd: float) -> str:
    """$2,202, $3.40, $0.0042."""
    return f"${usd:,.{usd_decimals(usd)}f}"


def _print_cost(report: costmodel.CostReport, sources: dict[str, str]) -> None:
    i = report.inputs
    print(f"checkpoint {decimal_size_text(i.checkpoint_gb)} [{sources['checkpoint_gb']}], storage "
          f"{i.write_gbps:.1f} GB/s [{sources['write_gbps']}], every {i.interval_min:g} min "
          f"({report.checkpoints_per_month:,.0f}/month), {i.gpus} GPUs at "
          f"${i.gpu_hour_usd:.2f}/GPU-hour, keep {i.keep}")
    print(f"compression {i.ratio:.3f}x [{sources['ratio']}], {i.compress_gbps:.1f} GB/s per GPU "
          f"[{sources['compress_gbps']}]")
    per_rank = i.module_gb > 0 or i.rank_write_gbps is not None
    if per_rank:
        limit = "no per-rank limit" if i.rank_write_gbps is None else f"{i.rank_write_gbps:g} GB/s per rank"
        print(f"rank 0 writes the {decimal_size_text(i.module_gb)} module on top of its share; {limit}")
    columns = [("plain", report.baseline, report.ranks_baseline)]
    if i.module_gb > 0:
        columns.append(("module rank 0", report.compressed_module_on_rank0, report.ranks_module_on_rank0))
        columns.append(("derived", report.compressed, report.ranks_compressed))
    else:
        columns.append(("compressed", report.compressed, report.ranks_compressed))
    print(f"{'':34}" + "".join(f"{name:>15}" for name, _, _ in columns))

    def row(label: str, values: list[float], fmt: str) -> None:
        print(f"{label:34}" + "".join(f"{fmt.format(v):>15}" for v in values))

    def scaled_row(label: str, values: list[float], units: tuple[tuple[str, float], ...],
                   start: str, decimals: int) -> None:
        unit, factor = fitting_unit(max(values, key=abs), units, start)
        row(f"{label} ({unit})", [v / factor for v in values], f"{{:,.{decimals}f}}")

    def money_row(label: str, values: list[float]) -> None:
        row(f"{label} ($)", values, f"{{:,.{usd_decimals(max(values, key=abs))}f}}")

    def field(name: str) -> list[float]:
        return [getattr(cost, name) for _, cost, _ in columns]

    scaled_row("wait per checkpoint", field("wait_s"), TIME_UNITS, "s", 1)
    scaled_row("GPU waiting per month", [h * 3600 for h in field("wait_hours_month")],
               TIME_UNITS, "h", 1)
    money_row("idle GPUs per month", field("idle_gpu_usd_month"))
    scaled_row("stored", [gb * costmodel.GB for gb in field("stored_gb")], BYTE_UNITS, "GB", 1)
    money_row("storage per month", field("storage_usd_month"))
    money_row("total per month", field("total_usd_month"))
    if per_rank:
        for label, name in (("rank 0 writes", "rank0_gb"), ("each other rank writes", "other_gb")):
            scaled_row(label, [getattr(ranks, name) * costmodel.GB for _, _, ranks in columns],
                       BYTE_UNITS, "GB", 2)
        row("rank 0 / other ranks", [ranks.straggler for _, _, ranks in columns], "{:,.2f}")
    print(f"pipelined save waits for: {report.bottleneck} (compress "
          f"{duration_text(report.compress_s)}, write {duration_text(report.compressed_write_s)})")
    print(f"savings: {duration_text(report.savings_hours_month * 3600, 'h')} and "
          f"{usd_text(report.savings_usd_month)} per month")


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
                        "bytes) from a real checkpoint: a save dir, tag folder or shard, a path or an "
                        "s3:// URL "
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
