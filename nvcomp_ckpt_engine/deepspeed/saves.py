"""One `save_checkpoint` in progress on a rank, and what its commit records.

`CheckpointSave` is what the engine knows of a save between `create` and `commit`: where its
files go, their shard records (or the background writes that will give them), its first error,
and an async save's memory budgets. `commit_record` is the save as rank 0 logs it (`log_line`)
and appends it to ``log_jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from .. import api, commit, manifest
from ..storage.locations import Location
from . import derived_module

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CheckpointSave:
    """One `save_checkpoint` in progress on this rank: where files go and what was written.

    `plan` is None only when preparing the tag folder failed; `error` then says why.
    """

    info: CheckpointCommitInfo
    tag_dir: Location
    plan: commit.TagPlan | None
    started: float = dataclasses.field(default_factory=time.monotonic)
    records: list[manifest.ShardRecord] = dataclasses.field(default_factory=list)
    error: BaseException | None = None
    #: Async saves: files still being written in the background, by relative path.
    writing: list[tuple[str, api.PendingSave]] = dataclasses.field(default_factory=list)
    #: Seconds from `create` to the return of the last `save`: what the training loop waited.
    blocked_s: float = 0.0
    #: An async save that went over its host-memory cap and wrote the rest before returning.
    over_budget: bool = False
    host_budget_bytes: int = 0
    #: Async saves: GPU memory the captures' payloads may still hold when training resumes
    #: (within `gpu_cap_bytes`, what the allocator had cached: `pipeline.gpu_cache`).
    gpu_budget_bytes: int = 0
    gpu_cap_bytes: int = 0
    #: GPU memory the payloads would have held with every copy deferred, and do hold still.
    gpu_wanted_bytes: int = 0
    gpu_held_bytes: int = 0
    #: GPU memory of the raw copies of state its files took instead of encoding in the stall
    #: (``async_gpu_snapshot``), encoded beside training.
    gpu_snapshot_bytes: int = 0
    #: Whether the engine points ``latest`` at this save once it is committed: DeepSpeed's
    #: ``save_latest``, also when DeepSpeed was told not to write it (a URL save folder).
    publish_latest: bool = False
    #: Set once `save_checkpoint` has returned: the background writes start then (`api.save_async`).
    may_write: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: ZeRO-1/2: the module parameters this save stores as derived from the fp32 partitions.
    module: derived_module.ModulePlan | None = None
    #: The parallel layout the manifest records, taken from the engine when the save started
    #: (None: `_compat.parallel_layout`'s alone; see `reshard.save_layout`).
    layout: dict[str, Any] | None = None

    #: The node-local tier: this save's replicas, sent in the background (`LocalTier.replicate_in_background`).
    replication: Any = None

    def writes_done(self) -> bool:
        return all(handle.done() for _, handle in self.writing)

    def finished_records(self, rank: int) -> tuple[list[manifest.ShardRecord], BaseException | None]:
        """Every record of this save once its background writes are done (waiting for them),
        and its first error, leaving the save as it is (`collect` takes them in)."""
        records, error = list(self.records), self.error
        for relative, handle in list(self.writing):
            try:
                records.append(shard_record(relative, rank, handle.result()))
            except Exception as exc:  # the commit reports it, on every rank
                error = error or exc
        return records, error

    def collect(self, rank: int) -> None:
        """Wait for the background writes; their records (or the first error) join the save."""
        self.may_write.set()
        for relative, handle in self.writing:
            try:
                shard = handle.result()
            except Exception as exc:  # reported by commit, on every rank
                logger.error("rank %d: writing %s failed: %s", rank, relative, exc)
                self.error = self.error or exc
                continue
            self.records.append(shard_record(relative, rank, shard))
        self.writing = []


def shard_record(relative: str, rank: int, shard: api.ShardInfo) -> manifest.ShardRecord:
    return manifest.ShardRecord(
        path=relative, rank=rank, raw_bytes=shard.raw_bytes, file_bytes=shard.file_bytes,
        crc32=shard.crc32, codecs=shard.codecs, io=shard.io,
    )


def commit_record(
    pending: CheckpointSave, result: commit.CommitResult, commit_s: float, *, asynchronous: bool
) -> dict[str, Any]:
    """One save, as logged and as appended to ``log_jsonl`` (rank 0's view of the timing)."""
    durable_s = time.monotonic() - pending.started
    return {
        "event": "commit",
        "unix_time": time.time(),
        "tag": result.tag,
        "save_dir": str(pending.info.save_dir),
        "world_size": result.world_size,
        "files": result.files,
        "raw_bytes": result.raw_bytes,
        "file_bytes": result.file_bytes,
        "ratio": result.raw_bytes / result.file_bytes if result.file_bytes else 1.0,
        "async": asynchronous,
        "over_host_memory_cap": pending.over_budget,
        "gpu_snapshot_bytes": pending.gpu_snapshot_bytes,
        "blocked_s": pending.blocked_s,
        "durable_s": durable_s,
        "commit_s": commit_s,
        "gbps": result.raw_bytes / durable_s / 1e9 if durable_s > 0 else None,
    }


def log_line(record: dict[str, Any]) -> str:
    """The one line every save logs."""
    mode = "sync"
    if record["async"]:
        mode = "async, over the host-memory cap: blocked for the rest" if record[
            "over_host_memory_cap"] else "async"
        if record.get("gpu_snapshot_bytes"):
            mode += f", {record['gpu_snapshot_bytes'] / 1e9:.3f} GB copied on the GPU"
    return (
        f"checkpoint {record['tag']!r} ({mode}): {record['raw_bytes'] / 1e9:.3f} GB "
        f"raw -> {record['file_bytes'] / 1e9:.3f} GB written ({record['ratio']:.3f}x) in "
        f"{record['files']} files; training blocked {record['blocked_s']:.2f} s, durable after "
        f"{record['durable_s']:.2f} s ({record['gbps'] or 0:.2f} GB/s raw)"
    )


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    """One line per commit; a failed log write is reported and never fails the checkpoint."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    except OSError as exc:
        logger.warning("could not append to log_jsonl %s: %s", path, exc)


__all__ = ["CheckpointSave", "append_jsonl", "commit_record", "log_line", "shard_record"]
