"""The DCP writer: each rank's items compressed into one shard file per rank.

`NvcompFileSystemWriter` is DCP's `FileSystemWriter` with `write_data` replaced and `finish`
extended (the manifest, `integrity`), so DCP's planning and metadata stay DCP's own. One file
per rank, not one per item: a large model has thousands of items per rank, and thousands of
small files with their own fsync cost more on Lustre/GPFS than the data. `prepare_items`
(shared with the Megatron-Core strategy) turns a rank's resolved items into one planned shard.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import manifest, pipeline
from .._version import __version__
from ..options import DEFAULT_CHUNK_MB, DEFAULT_GPU_BATCH_MB, CompressionOptions, check_workers
from ..pipeline.io_path import check_here
from ..codecs import backend_summary
from ..errors import UnsupportedCheckpointError
from ..storage import open_storage
from .integrity import (
    checkpoint_manifest, file_result, remove_commit, split_results, write_checkpoint_manifest,
)
from .storefs import OnStorage, StorageFileSystem
from .layout import SHARD_SUFFIX, SKELETON_FORMAT, SKELETON_VERSION, ItemLocation, item_key

logger = logging.getLogger(__name__)


def describe_writer() -> dict[str, Any]:
    """What a rank file records about the software that wrote it."""
    return {
        "package": f"nvcomp_ckpt_engine {__version__}",
        "torch": torch.__version__.split("+")[0],
        "nvcomp": backend_summary()["nvcomp"],
        "adapter": "torch.distributed.checkpoint",
    }


def _payload(item: WriteItem, data: torch.Tensor | io.BytesIO) -> torch.Tensor:
    """The tensor stored for an item: the tensor itself (no copy), or the bytes as uint8."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"item {item.index.fqn!r} is a bytes item, but the planner resolved "
                            f"it to a {type(data).__name__}")
        raw = data.getbuffer()
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(
            0, dtype=torch.uint8)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"item {item.index.fqn!r} is a tensor item, but the planner resolved it "
                        f"to a {type(data).__name__}")
    return data.detach()


@dataclasses.dataclass(frozen=True)
class PreparedItems:
    """A rank's items planned for one shard file, and the `WriteResult`s DCP gets for them."""

    shard: pipeline.PreparedShard
    results: list[WriteResult]


def prepare_items(
    relative_path: str,
    items: Sequence[tuple[WriteItem, torch.Tensor | io.BytesIO]],
    options: CompressionOptions,
    *,
    writer_info: dict[str, Any] | None = None,
) -> PreparedItems:
    """Plan resolved DCP items as one shard file named `relative_path` in the checkpoint.

    Tensors are referenced, not copied: they are compressed where they live (nvCOMP on a GPU
    when one is usable, CPU codecs otherwise) when the shard is written or staged, and the
    caller must not modify them before that.
    """
    keys = [item_key(item.index) for item, _ in items]
    if len(set(keys)) != len(keys):
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"the save plan lists these items more than once: {duplicates}")
    tensors = [_payload(item, data) for item, data in items]
    kinds = {key: "bytes" if item.type == WriteItemType.BYTE_IO else "tensor"
             for key, (item, _) in zip(keys, items)}
    skeleton = pickle.dumps(
        {"format": SKELETON_FORMAT, "version": SKELETON_VERSION, "kinds": kinds}, protocol=4)
    shard = pipeline.prepare_shard(
        skeleton, tensors, keys, algorithm=options.algorithm, portable=options.portable,
        chunk_bytes=options.chunk_bytes, writer_info=writer_info or describe_writer(),
        gpu_batch_bytes=options.gpu_batch_bytes,
    )
    results = [
        WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(),
                    storage_data=ItemLocation(relative_path, key))
        for (item, _), t, key in zip(items, tensors, keys)
    ]
    return PreparedItems(shard, results)


def _naming(exc: OSError, path: str | os.PathLike) -> OSError:
    """`exc` as an error naming the rank file `path`, if it names no file (a full disk or an
    I/O error from ``write`` or ``fsync`` does not): DCP reports only the error text to the
    caller, and a full disk on one rank of hundreds must say where."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, os.fspath(path))


def _log_written(info: pipeline.ShardInfo, items: int) -> None:
    logger.debug("wrote %s: %d items, %d -> %d bytes (%.3fx, %s)", info.path, items,
                 info.raw_bytes, info.file_bytes, info.ratio, ",".join(info.codecs))


class NvcompFileSystemWriter(OnStorage, FileSystemWriter):
    """A DCP `StorageWriter` that writes each rank's items as one compressed shard file.

    Call sequence (DCP drives it, on every rank): `set_up_storage_writer`, `prepare_local_plan`;
    the coordinator runs `prepare_global_plan`; every rank runs `write_data`; the coordinator
    runs `finish`, which writes ``.metadata`` once every rank's file is written, and then the
    manifest (the commit point). With `dcp.async_save` this object is also the stager: it
    copies the state to CPU memory first, so later optimizer steps cannot change what is
    written; the copy is then compressed in the background (streamed through the GPU when
    nvCOMP is usable, else with the CPU codecs).

    Args:
        path: the checkpoint directory.
        algorithm, portable, chunk_mb, gpu_batch_mb: see `options.CompressionOptions`.
        workers: CPU codec threads (None: one per core, at most 8).
        sync_files: fsync each file and the directory (without it a crash can lose the save).
        overwrite: allow saving over an existing checkpoint (DCP's flag).
        cache_staged_state_dict: keep the async staging buffers between saves (DCP's flag).
        io_path: how GPU-coded payloads reach the rank files (`nvcomp_ckpt_engine.save`'s
            option: ``"pinned"``, ``"gds"``, ``"auto"``; docs/STORAGE.md).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        algorithm: str = "auto",
        portable: bool = False,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        workers: int | None = None,
        gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB,
        sync_files: bool = True,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        io_path: str = "auto",
    ) -> None:
        self.options = CompressionOptions(algorithm=algorithm, portable=portable,
                                          chunk_mb=chunk_mb, gpu_batch_mb=gpu_batch_mb)
        self.workers = check_workers(workers)
        check_here(io_path)  # "gds" without kvikio or a GPU fails here, not in write_data
        self.io_path = io_path
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1,
                         overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self._locate(path)
        #: The manifest `finish` made (the coordinator's, after a save; None elsewhere): what
        #: the node-local tier's commit lists (`dcp.tiered`).
        self.committed: manifest.Manifest | None = None

    #: Whether `finish` writes the manifest. The node-local tier's writer does not: the tier's
    #: commit writes it on every node once the replicas are in (`dcp.tiered`).
    publishes_manifest = True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's set-up; a save without collectives is refused: each rank would write a
        ``.metadata`` of its own, which no one manifest can commit."""
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not getattr(self, "use_collectives", True):
            raise UnsupportedCheckpointError(
                "NvcompFileSystemWriter saves with collectives only (use_collectives=True, the "
                "default): its manifest commits one .metadata for all ranks")

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's global plan (coordinator only, before any rank writes), after removing the
        manifest and ``.metadata`` of a checkpoint being overwritten: a crash while the new
        files are written then leaves no loadable checkpoint, rather than the old metadata over
        a mix of old and new rank files."""
        plans = super().prepare_global_plan(plans)
        if remove_commit(self.path) and self.sync_files:
            open_storage(self.path).sync_prefix()
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Resolve this rank's items and write them as one shard file (none if no items)."""
        results: list[WriteResult] = []
        if plan.items:
            name = f"{plan.storage_data.prefix}0{SHARD_SUFFIX}"
            items = [(item, planner.resolve_data(item)) for item in plan.items]
            prepared = prepare_items(name, items, self.options)
            target = self.fs.concat_path(self.path, name)
            try:
                info = pipeline.write_prepared(prepared.shard, target, durable=self.sync_files,
                                               workers=self.workers, io_path=self.io_path)
            except OSError as exc:
                named = _naming(exc, target)
                if named is exc:
                    raise
                raise named from exc
            _log_written(info, len(items))
            results = [*prepared.results, file_result(info, name)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's finish (``.metadata`` via a temporary name) with the items' results, then the
        manifest of the rank files the results report and of ``.metadata`` (the commit point,
        durable with the directory when `sync_files`; made but not written unless
        `publishes_manifest`)."""
        items, records = split_results(results)
        if isinstance(self.fs, StorageFileSystem):
            # DCP's finish fsyncs .metadata's stream, or syncs the whole machine where the stream
            # has no descriptor; a stored object is durable once its stream closes.
            sync_files, self.sync_files = self.sync_files, False
            try:
                super().finish(metadata, items)
            finally:
                self.sync_files = sync_files
        else:
            super().finish(metadata, items)
        if not self.publishes_manifest:
            self.committed = checkpoint_manifest(self.path, records, world_size=len(results),
                                                 coordinator_rank=self.rank or 0, framework="dcp")
            return
        self.committed = write_checkpoint_manifest(self.path, records, world_size=len(results),
                                  coordinator_rank=self.rank or 0, framework="dcp",
                                  durable=self.sync_files)
