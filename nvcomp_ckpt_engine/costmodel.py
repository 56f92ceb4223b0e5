"""What a checkpoint policy costs in idle GPUs and storage, with and without compression.

Pure arithmetic, no torch: the `nvcomp-ckpt cost` command and the docs use it to turn measured
figures (a compression ratio, a GPU compress throughput, a storage bandwidth) into hours and
dollars per month, so a team can decide whether compressing checkpoints pays for itself.

Units are decimal: 1 GB = 1e9 bytes and GB/s = 1e9 bytes per second, because storage vendors
and NVIDIA's write-up quote them that way. With the write-up's inputs (782 GB at 5 GB/s, every
30 minutes, a 30-day month, 8 GPUs at $4.40/GPU-hour) the baseline is 156.4 s per checkpoint,
62.6 hours of waiting per month and about $2,202 per month of idle GPUs.

The model's assumptions, stated where a reader of the numbers will look for them:
- a synchronous save blocks every GPU until the last byte is on storage;
- storage bandwidth is shared by all writers (the figure is the aggregate, not per GPU), and
  one rank may be limited further (`rank_write_gbps`: its node's link or file-system client);
  a save then waits for its slowest rank or for the aggregate, whichever binds:
  max(max over ranks of bytes / rank bandwidth, total bytes / aggregate bandwidth);
- each GPU compresses its own share of the checkpoint, in parallel with the others; with
  DeepSpeed ZeRO-1/2, rank 0 also writes the whole 16-bit module (`module_gb`) on top of its
  equal share of the rest: the straggler. The engine stores that module as derived from the
  optimizer shards (every rank writes only its share), which the "derived module" column prices;
- pipelined compression overlaps compress, device-to-host copy and write, so a checkpoint
  waits for the slowest of the three stages, not their sum;
- every retained checkpoint is a full checkpoint (no deduplication between checkpoints).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from .storage import locations

#: Bytes per decimal gigabyte.
GB = 1e9
SECONDS_PER_HOUR = 3600.0
MINUTES_PER_DAY = 24 * 60


@dataclass(frozen=True)
class CostInputs:
    """One checkpoint policy and the figures that price it.

    `compress_gbps` and `copy_gbps` are per GPU; `write_gbps` is the storage system's aggregate
    bandwidth and `rank_write_gbps` the most one rank can write (None: no per-rank bound).
    `copy_gbps=None` leaves the device-to-host copy out of the pipelined wait (on a GPU with
    pinned buffers it is ~55 GB/s, rarely the slowest stage). `module_gb` is the part of
    `checkpoint_gb` that rank 0 alone writes (DeepSpeed ZeRO-1/2's 16-bit module: 2 bytes per
    parameter in bf16); the rest is shared equally by the `gpus` ranks.
    """

    checkpoint_gb: float
    write_gbps: float
    interval_min: float
    gpus: int
    gpu_hour_usd: float
    keep: int = 1
    storage_usd_per_gb_month: float = 0.0
    ratio: float = 1.0
    compress_gbps: float = math.inf
    copy_gbps: float | None = None
    days_per_month: float = 30.0
    module_gb: float = 0.0
    rank_write_gbps: float | None = None

    def __post_init__(self) -> None:
        """Reject figures that would make the arithmetic meaningless, naming the bad input."""
        positive = ("checkpoint_gb", "write_gbps", "interval_min", "gpus", "ratio",
                    "compress_gbps", "days_per_month")
        for name in positive:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name in ("copy_gbps", "rank_write_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 when given, got {value!r}")
        for name in ("keep", "gpu_hour_usd", "storage_usd_per_gb_month", "module_gb"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if not self.module_gb < self.checkpoint_gb:
            raise ValueError(f"module_gb ({self.module_gb!r}) must be below checkpoint_gb "
                             f"({self.checkpoint_gb!r}): the optimizer state is the rest")


@dataclass(frozen=True)
class RankBytes:
    """What the ranks of one save write (GB): rank 0, and each of the `ranks - 1` others."""

    rank0_gb: float
    other_gb: float
    ranks: int

    @property
    def total_gb(self) -> float:
        return self.rank0_gb + self.other_gb * (self.ranks - 1)

    @property
    def max_gb(self) -> float:
        return max(self.rank0_gb, self.other_gb)

    @property
    def straggler(self) -> float:
        """Rank 0's bytes over the others' (1.0: balanced, or a single rank)."""
        return self.rank0_gb / self.other_gb if self.ranks > 1 and self.other_gb > 0 else 1.0

    def write_s(self, inputs: CostInputs) -> float:
        """Seconds until the slowest rank's bytes are written: its own bandwidth or the
        storage's aggregate, whichever binds."""
        aggregate = self.total_gb / inputs.write_gbps
        if inputs.rank_write_gbps is None:
            return aggregate
        return max(aggregate, self.max_gb / inputs.rank_write_gbps)

    def scaled(self, factor: float) -> RankBytes:
        return RankBytes(self.rank0_gb * factor, self.other_gb * factor, self.ranks)


def rank_bytes(inputs: CostInputs, *, derived_module: bool) -> RankBytes:
    """Raw bytes per rank: an equal share of the optimizer state each, plus the module on rank
    0 unless it is derived from the shards (then nobody writes it)."""
    share = (inputs.checkpoint_gb - inputs.module_gb) / inputs.gpus
    return RankBytes(share + (0.0 if derived_module else inputs.module_gb), share, inputs.gpus)


@dataclass(frozen=True)
class PolicyCost:
    """What one way of saving (plain or compressed) costs per checkpoint and per month."""

    wait_s: float
    wait_hours_month: float
    idle_gpu_usd_month: float
    stored_gb: float
    storage_usd_month: float

    @property
    def total_usd_month(self) -> float:
        """Idle GPUs plus storage: the figure a budget owner compares."""
        return self.idle_gpu_usd_month + self.storage_usd_month


@dataclass(frozen=True)
class CostReport:
    """The baseline (synchronous, uncompressed) and the compressed, pipelined save side by side.

    `compressed` is the engine's save, with the module derived from the optimizer shards;
    `compressed_module_on_rank0` the same save with rank 0 still writing the whole module (what
    the engine wrote before deriving it, and what it writes for a module it cannot derive).
    The stage times (`compress_s`, `copy_s`, `compressed_write_s`) are the derived save's.
    """

    inputs: CostInputs
    checkpoints_per_month: float
    compress_s: float
    compressed_write_s: float
    copy_s: float
    baseline: PolicyCost
    compressed: PolicyCost
    compressed_module_on_rank0: PolicyCost
    ranks_baseline: RankBytes
    ranks_compressed: RankBytes
    ranks_module_on_rank0: RankBytes

    @property
    def bottleneck(self) -> str:
        """The stage the pipelined save waits for: "compress", "copy" or "write"."""
        stages = {"compress": self.compress_s, "copy": self.copy_s,
                  "write": self.compressed_write_s}
        return max(stages, key=stages.__getitem__)

    @property
    def savings_usd_month(self) -> float:
        """Dollars per month the compressed save saves over the baseline (negative: it costs)."""
        return self.baseline.total_usd_month - self.compressed.total_usd_month

    @property
    def savings_hours_month(self) -> float:
        """Hours of GPU waiting per month the compressed save saves over the baseline."""
        return self.baseline.wait_hours_month - self.compressed.wait_hours_month

    def to_dict(self) -> dict:
        """A JSON-able form for `nvcomp-ckpt cost --json` (infinite throughput becomes null)."""
        inputs = {k: (None if v == math.inf else v) for k, v in asdict(self.inputs).items()}
        return {
            "inputs": inputs,
            "checkpoints_per_month": self.checkpoints_per_month,
            "compress_s": self.compress_s,
            "copy_s": self.copy_s,
            "compressed_write_s": self.compressed_write_s,
            "bottleneck": self.bottleneck,
            "baseline": _policy_dict(self.baseline, self.ranks_baseline),
            "compressed": _policy_dict(self.compressed, self.ranks_compressed),
            "compressed_module_on_rank0": _policy_dict(self.compressed_module_on_rank0,
                                                       self.ranks_module_on_rank0),
            "savings_usd_month": self.savings_usd_month,
            "savings_hours_month": self.savings_hours_month,
        }


def _policy_dict(policy: PolicyCost, ranks: RankBytes) -> dict:
    return {**asdict(policy), "total_usd_month": policy.total_usd_month,
            "rank0_gb": ranks.rank0_gb, "other_rank_gb": ranks.other_gb, "straggler": ranks.straggler}


def checkpoints_per_month(inputs: CostInputs) -> float:
    """48 a day at a 30-minute interval; times the days in a month."""
    return MINUTES_PER_DAY / inputs.interval_min * inputs.days_per_month


def _policy(inputs: CostInputs, wait_s: float, stored_gb_each: float) -> PolicyCost:
    """Price one way of saving: every GPU idles `wait_s` per checkpoint; `keep` copies stored."""
    hours = wait_s * checkpoints_per_month(inputs) / SECONDS_PER_HOUR
    stored_gb = stored_gb_each * inputs.keep
    return PolicyCost(
        wait_s=wait_s,
        wait_hours_month=hours,
        idle_gpu_usd_month=hours * inputs.gpus * inputs.gpu_hour_usd,
        stored_gb=stored_gb,
        storage_usd_month=stored_gb * inputs.storage_usd_per_gb_month,
    )


def _stages(inputs: CostInputs, raw: RankBytes) -> tuple[float, float, float]:
    """(compress, copy, write) seconds of a pipelined compressed save of `raw` bytes per rank:
    compression and copies run on each rank's own bytes (the largest share binds), the write as
    `RankBytes.write_s`."""
    compress_s = raw.max_gb / inputs.compress_gbps
    copy_s = 0.0 if inputs.copy_gbps is None else raw.max_gb / inputs.ratio / inputs.copy_gbps
    return compress_s, copy_s, raw.scaled(1 / inputs.ratio).write_s(inputs)


def estimate(inputs: CostInputs) -> CostReport:
    """Price the baseline (DeepSpeed's default engine: plain bytes, the module on rank 0) and the
    pipelined compressed save, with the module derived and with it on rank 0.

    The pipelined wait is max(compress time, copy time, compressed write time) (`_stages`).
    """
    plain = rank_bytes(inputs, derived_module=False)
    derived = rank_bytes(inputs, derived_module=True)
    compress_s, copy_s, write_s = _stages(inputs, derived)
    on_rank0 = _stages(inputs, plain)
    return CostReport(
        inputs=inputs,
        checkpoints_per_month=checkpoints_per_month(inputs),
        compress_s=compress_s,
        compressed_write_s=write_s,
        copy_s=copy_s,
        baseline=_policy(inputs, plain.write_s(inputs), plain.total_gb),
        compressed=_policy(inputs, max(compress_s, copy_s, write_s), derived.total_gb / inputs.ratio),
        compressed_module_on_rank0=_policy(inputs, max(on_rank0), plain.total_gb / inputs.ratio),
        ranks_baseline=plain,
        ranks_compressed=derived.scaled(1 / inputs.ratio),
        ranks_module_on_rank0=plain.scaled(1 / inputs.ratio),
    )


@dataclass(frozen=True)
class BenchFigures:
    """The measured figures a benchmark JSON hands to the cost model.

    Two shapes are read (other keys are allowed and ignored):
    - ``{"ratio": float > 0, "compress_gbps": float > 0, "write_gbps": float > 0 (optional)}``:
      whole-state compression ratio (raw / stored bytes), per-GPU compress throughput in GB/s of
      raw bytes, and, if the benchmark measured it, the storage write bandwidth in GB/s;
    - the report of ``benchmarks/bench_deepspeed.py`` (``{"results": [...], "bandwidth": {...}}``):
      the ratio is the default engine's bytes over the engine's (``auto``, else the first other
      sync variant); the compress throughput is an async variant's capture rate (raw bytes over
      the time a save after the first blocked: compression and the copy to host memory together,
      so a lower bound), absent without an async variant; the write bandwidth is the run's
      write+fsync figure.
    `notes` says, per figure, how it was derived where that is not just a copy.
    """

    ratio: float
    compress_gbps: float | None
    write_gbps: float | None = None
    notes: dict[str, str] = field(default_factory=dict)


#: The largest benchmark JSON `read_bench_json` reads.
MAX_BENCH_JSON_BYTES = 64 << 20


def read_bench_json(path: str | os.PathLike) -> BenchFigures:
    """Read and validate a benchmark JSON; a bad file raises ValueError naming the file and key."""
    try:
        data = json.loads(locations.read_small(path, MAX_BENCH_JSON_BYTES, what="a benchmark JSON"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'ratio' and 'compress_gbps'")
    if "results" in data:
        return _from_deepspeed_report(path, data)
    return BenchFigures(ratio=_positive(path, "ratio", data.get("ratio")),
                        compress_gbps=_positive(path, "compress_gbps", data.get("compress_gbps")),
                        write_gbps=_optional_positive(path, "write_gbps", data.get("write_gbps")))


def _from_deepspeed_report(path: str | os.PathLike, data: dict) -> BenchFigures:
    results = data["results"]
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise ValueError(f"{path}: 'results' must be a list of variant objects")
    variants = {r.get("variant"): r for r in results}
    if "default" not in variants:
        raise ValueError(f"{path}: no 'default' variant, whose bytes the ratio is measured against")
    raw = _positive(path, "results[default].bytes", variants["default"].get("bytes"))
    ours = variants.get("auto") or next(
        (r for name, r in variants.items() if name != "default" and not str(name).endswith("async")),
        None)
    if ours is None:
        raise ValueError(f"{path}: no sync variant of the engine to take the ratio from")
    name = ours["variant"]
    ratio = raw / _positive(path, f"results[{name}].bytes", ours.get("bytes"))
    notes = {"ratio": f"default engine's bytes / {name}'s"}
    compress = None
    captured = next((r for n, r in variants.items() if str(n).endswith("async")), None)
    if captured is not None:
        key = "blocked_s_later" if "blocked_s_later" in captured else "blocked_s"
        seconds = _positive(path, f"results[{captured['variant']}].{key}", captured.get(key))
        compress = raw / GB / seconds
        notes["compress_gbps"] = f"{captured['variant']}'s capture: compress + copy, a lower bound"
    bandwidth = data.get("bandwidth") or {}
    write = _optional_positive(path, "bandwidth.write_fsync_gbps", bandwidth.get("write_fsync_gbps"))
    return BenchFigures(ratio=ratio, compress_gbps=compress, write_gbps=write, notes=notes)


def _optional_positive(path: str | os.PathLike, key: str, value: object) -> float | None:
    return None if value is None else _positive(path, key, value)


def _positive(path: str | os.PathLike, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{path}: '{key}' must be a positive number, got {value!r}")
    return float(value)


__all__ = [
    "GB",
    "CostInputs",
    "PolicyCost",
    "CostReport",
    "RankBytes",
    "BenchFigures",
    "checkpoints_per_month",
    "estimate",
    "rank_bytes",
    "read_bench_json",
]
