"""Megatron-Core `dist_checkpointing` with compressed shards: the ``nvcomp_torch_dist`` backend.

Megatron-Core's ``torch_dist`` backend saves through torch.distributed.checkpoint (DCP): its
save strategy plans with DCP, lets a `FileSystemWriterAsync` gather each rank's items into
write buckets, and returns an `AsyncRequest` (stage to host, write, finalize on all ranks). This
module keeps all of that and replaces what touches the bytes:

- `NvcompTorchDistSaveShardedStrategy` builds the request from the writer's buckets: its
  stage step (`stage_buckets`, run where Megatron stages: in the training process, before any
  forked writer starts) compresses GPU tensors on their GPU into host memory and snapshots
  CPU tensors; its write step (`write_staged_buckets`) writes each bucket as one of our shard
  files (the DCP package's rank-file format, so the same reader, CLI and checks apply); its finalize
  step is Megatron's minus the CUDA-only calls, so it also runs on the CPU (gloo).
- `NvcompTorchDistLoadShardedStrategy` is Megatron's load strategy reading with
  `NvcompFileSystemReader`, which also reads stock ``torch_dist`` items.

Both are registered under the backend name ``nvcomp_torch_dist`` (version 1) when this module
is imported. Megatron writes the backend name into the checkpoint's ``metadata.json``, so a
plain ``dist_checkpointing.load(sharded_state_dict, ckpt_dir)`` picks the compressed reader
by itself. (``torch_dist`` itself cannot be taken over: Megatron re-registers it on every
lookup.) docs/MEGATRON.md shows how to turn it on in a training script.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import package_info
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.storage import WriteResult

from . import pipeline
from .dcp import (
    SHARD_SUFFIX,
    STOCK_SUFFIX,
    NvcompFileSystemReader,
    describe_writer,
    prepare_items,
)
from .options import DEFAULT_CHUNK_MB, DEFAULT_GPU_BATCH_MB, CompressionOptions, check_workers
from .dcp.integrity import file_result, split_results, write_checkpoint_manifest
from .megatron_files import BACKEND

logger = logging.getLogger(__name__)

#: Version of the backend's on-disk layout (DCP metadata + the DCP package's rank files).
VERSION = 1


@dataclass(frozen=True)
class StagedBucket:
    """One write bucket captured in host memory, ready to be written as a shard file."""

    path: str
    staged: pipeline.StagedShard
    results: list[WriteResult]


def _shard_name(file_name: str) -> str:
    """Megatron's bucket file name with our suffix (``__0_0.distcp`` → ``__0_0.nvcomp.distcp``)."""
    return file_name.removesuffix(STOCK_SUFFIX) + SHARD_SUFFIX


def stage_buckets(buckets: list[Any], options: CompressionOptions, workers: int | None,
                  writer_info: dict[str, Any]) -> list[StagedBucket]:
    """Megatron's `preload_fn`: capture every bucket in host memory before writing starts.

    With nvCOMP and a GPU, every chunk is compressed on the GPU here and only the compressed
    bytes are held; otherwise CPU tensors are copied (snapshots). Either way the capture is
    immune to later optimizer steps, and it holds the whole rank's state in host memory, as
    Megatron's own staging does. Every GPU job and checksum has finished when this returns
    (the write step gets a pool of its own), so the write step, which Megatron runs in a
    forked process, only writes bytes or runs CPU codecs. (A forked process must not use
    CUDA; that this path never does is tested on the CPU only so far.)
    """
    staged = []
    for file_path, file_name, (bytes_data, tensor_data) in buckets:
        name = _shard_name(file_name)
        prepared = prepare_items(name, [*bytes_data, *tensor_data], options,
                                 writer_info=writer_info)
        # The pool's shutdown (leaving the block) waits for the GPU chunks' checksums.
        with cf.ThreadPoolExecutor(workers or pipeline.default_workers(),
                                   thread_name_prefix="nvckpt-stage") as pool:
            shard = pipeline.stage(prepared.shard, host_budget_bytes=sys.maxsize, pool=pool)
        staged.append(StagedBucket(os.path.join(os.path.dirname(file_path), name), shard,
                                   prepared.results))
    return staged


def write_staged_buckets(workers: int | None, rank: int, staged: list[StagedBucket],
                         results_queue: Any) -> None:
    """Megatron's `async_fn`: write each staged bucket as a shard file.

    Reports through `results_queue` exactly as `FileSystemWriterAsync`'s workers do (a dict
    bucket index → WriteResults, or the exception), so the writer's `retrieve_write_results`
    collects it. Runs in a forked process for async saves and inline for synchronous ones.
    """
    workers = workers or pipeline.default_workers()
    results: dict[int, list[WriteResult]] | Exception
    try:
        results = {}
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-write") as pool:
            for i, bucket in enumerate(staged):
                info = pipeline.write_staged(bucket.staged, bucket.path, durable=True,
                                             pool=pool, workers=workers)
                logger.debug("rank %d wrote %s: %d -> %d bytes (%.3fx)", rank, info.path,
                             info.raw_bytes, info.file_bytes, info.ratio)
                results[i] = [*bucket.results,
                              file_result(info, os.path.basename(bucket.path))]
    except Exception as exc:  # handed to the training process, which raises it at finalize
        results = exc
    results_queue.put(results)


def _is_failure(result: Any) -> bool:
    """A result DCP's collectives carry for a failed rank: (exception, stack summary)."""
    return isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], BaseException)


def finalize_save(save_state_dict_ret: tuple[Any, Any, Any]) -> None:
    """Megatron's `save_state_dict_async_finalize` without its CUDA-only calls.

    Every rank hands its write results to the coordinator; if none failed, the coordinator
    writes DCP's ``.metadata`` and then the manifest of the rank files and ``.metadata`` (the
    commit point of the DCP files, as for `NvcompFileSystemWriter`) and makes both durable; the
    outcome is broadcast, and every rank raises DCP's `CheckpointException` if any failed.
    """
    writer, global_metadata, dist_wrapper = save_state_dict_ret
    all_results = dist_wrapper.gather_object(writer.retrieve_write_results())
    failures: dict[int, Any] = {}
    if dist_wrapper.is_coordinator:
        failures = {rank: r for rank, r in enumerate(all_results) if _is_failure(r)}
        if not failures:
            items, records = split_results(all_results)
            writer.finish(global_metadata, items)
            write_checkpoint_manifest(  # also makes both renames durable
                writer.checkpoint_dir, records, world_size=len(all_results),
                coordinator_rank=dist_wrapper.rank, framework="megatron")
    failures = dist_wrapper.broadcast_object(failures)
    if failures:
        raise CheckpointException("write", failures)


class NvcompTorchDistSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """Megatron-Core's ``torch_dist`` save strategy writing compressed shard files.

    Keyword options are those of `NvcompFileSystemWriter` (algorithm, portable, chunk_mb,
    workers, gpu_batch_mb) and of Megatron's strategy (keep_only_main_replica, thread_count:
    files per rank, cached_metadata, separation_hint). Sync saves (``dist_checkpointing.save``)
    and async ones (``async_sharded_save=True``, scheduled with Megatron's `AsyncCallsQueue`)
    run the same request.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        *,
        algorithm: str = "auto",
        portable: bool = False,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        workers: int | None = None,
        gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB,
        keep_only_main_replica: bool = True,
        thread_count: int = 1,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
    ) -> None:
        super().__init__(backend, version, keep_only_main_replica=keep_only_main_replica,
                         thread_count=thread_count, cached_metadata=cached_metadata,
                         separation_hint=separation_hint)
        self.options = CompressionOptions(algorithm=algorithm, portable=portable,
                                          chunk_mb=chunk_mb, gpu_batch_mb=gpu_batch_mb)
        self.workers = check_workers(workers)

    def _get_save_and_finalize_callbacks(self, writer: Any,
                                         save_state_dict_ret: Any) -> AsyncRequest:
        """The request for the buckets Megatron's writer prepared (see the module docstring)."""
        finalize = functools.partial(finalize_save, save_state_dict_ret)
        if not writer.write_buckets:
            return AsyncRequest(None, (), [finalize])
        return AsyncRequest(
            functools.partial(write_staged_buckets, self.workers),
            [torch.distributed.get_rank(), writer.write_buckets, writer.results_queue],
            [finalize],
            preload_fn=functools.partial(stage_buckets, writer.write_buckets, self.options,
                                         self.workers, describe_writer()),
        )


class NvcompTorchDistLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Megatron-Core's ``torch_dist`` load strategy reading through `NvcompFileSystemReader`.

    Resharding (a different tensor/pipeline/data-parallel layout than at save time) works as
    with ``torch_dist``; ShardedObjects do not reshard (their key encodes the sharding).
    """

    def __init__(self, *, verify: bool = True, workers: int | None = None) -> None:
        super().__init__()
        self.verify = verify
        self.workers = workers

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        def reader(path: str | os.PathLike, cache_metadata: bool = False) -> NvcompFileSystemReader:
            return NvcompFileSystemReader(path, verify=self.verify, workers=self.workers)

        with _filesystem_reader(reader):
            return super().load(sharded_state_dict, checkpoint_dir)


def register_strategies(**save_options: Any) -> None:
    """Register the ``nvcomp_torch_dist`` save and load strategies with Megatron-Core.

    Done once with default options when this module is imported; call it again with
    `NvcompTorchDistSaveShardedStrategy` keyword options to change what
    ``sharded_strategy=("nvcomp_torch_dist", 1)`` saves with.
    """
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION,
                              NvcompTorchDistSaveShardedStrategy(**save_options))
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION,
                              NvcompTorchDistLoadShardedStrategy())


# ------------------------------------------- compatibility: Megatron-Core's private names
#
# Two private names of Megatron-Core are used, here and in the override above:
# - `TorchDistSaveShardedStrategy._get_save_and_finalize_callbacks(writer, ret)`, overridden:
#   the one hook between planning (kept) and writing (replaced);
# - `strategies.torch._get_filesystem_reader(dir, cache_metadata)`, which the stock `load`
#   calls for its reader, replaced for the duration of our strategy's `load`.
# Tested with Megatron-Core 0.16. If either name is gone the import fails here, rather than a
# save silently writing uncompressed files.

_TESTED_MEGATRON = ("0.16",)
_reader_lock = threading.Lock()


def _check_megatron() -> None:
    missing = [name for owner, name in (
        (TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks"),
        (megatron_torch, "_get_filesystem_reader"),
    ) if not callable(getattr(owner, name, None))]
    version = package_info.__version__
    if missing:
        raise ImportError(
            f"nvcomp_ckpt_engine.megatron supports Megatron-Core {', '.join(_TESTED_MEGATRON)}; "
            f"Megatron-Core {version} lacks {', '.join(missing)}")
    if ".".join(version.split(".")[:2]) not in _TESTED_MEGATRON:
        logger.warning("nvcomp_ckpt_engine.megatron is tested with Megatron-Core %s, not %s",
                       ", ".join(_TESTED_MEGATRON), version)


@contextlib.contextmanager
def _filesystem_reader(factory: Callable[..., Any]) -> Iterator[None]:
    """Make Megatron's load strategies build their DCP reader with `factory` in this block.

    Process-wide while it lasts (a lock serializes such blocks); a stock load running in
    another thread meanwhile gets our reader too, which reads stock checkpoints as well.
    """
    with _reader_lock:
        original = megatron_torch._get_filesystem_reader
        megatron_torch._get_filesystem_reader = factory
        try:
            yield
        finally:
            megatron_torch._get_filesystem_reader = original


_check_megatron()
register_strategies()

__all__ = [
    "BACKEND",
    "NvcompTorchDistLoadShardedStrategy",
    "NvcompTorchDistSaveShardedStrategy",
    "StagedBucket",
    "VERSION",
    "finalize_save",
    "register_strategies",
    "stage_buckets",
    "write_staged_buckets",
]
