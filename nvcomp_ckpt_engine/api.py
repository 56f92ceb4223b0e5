"""`save` and `load`: drop-in replacements for `torch.save` / `torch.load` on state dicts.

``save(obj, path)`` writes one compressed, self-describing shard file atomically at exactly
`path` (a temporary name, fsync, rename), so a crash leaves the old file or the new one, never
a torn one. ``load(path, map_location)`` reads it back bit-exact; `map_location` behaves as in
`torch.load`. Loading never runs code from the file unless ``trusted=True`` (see state.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import container, derived, pipeline, staging, state
from ._version import __version__
from .codecs import backend_summary
from .options import DEFAULT_CHUNK_MB, DEFAULT_GPU_BATCH_MB, CompressionOptions, check_io_path, check_workers
from .pipeline import ShardInfo
from .pipeline.io_path import resolve as resolve_io_path
from .selection import ChoiceCache
from .siblings import SiblingSources

#: Longest a background write waits for the `start` signal of `save_async`.
START_WAIT_S = 2.0

#: ``derive(tensor)``: the elements of a tensor being saved that other files hold (`save`).
Deriver = Callable[[torch.Tensor], Sequence[derived.Piece]]


def save(
    obj: Any,
    path: str | os.PathLike,
    *,
    algorithm: str = "auto",
    portable: bool = False,
    chunk_mb: float = DEFAULT_CHUNK_MB,
    durable: bool = True,
    workers: int | None = None,
    gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB,
    o_direct: bool = False,
    derive: Deriver | None = None,
    choices: ChoiceCache | None = None,
    io_path: str = "auto",
) -> ShardInfo:
    """Compress `obj` (a nested state dict) into one shard file at `path`.

    Args:
        algorithm, portable, chunk_mb, gpu_batch_mb: how it is compressed: `CompressionOptions`,
            which checks them and holds their defaults.
        durable: fsync the file and its directory before returning.
        workers: CPU codec threads (default: one per core, at most 8).
        o_direct: write the file with O_DIRECT (bypassing the page cache); buffered writes, the
            default, start their writeback as they go.
        derive: ``derive(tensor)`` -> the elements of `tensor` that other files of the same
            checkpoint folder hold (`derived.Piece` s, checked with `derived.same_after_cast`);
            they are recorded, not written (shard format version 2), and `load` rebuilds them.
        choices: `auto`'s choices kept from earlier saves of the same file name
            (`selection.ChoiceCache`): a job that saves the same files again and again samples
            and makes its codecs once, then at every recheck.
        io_path: how GPU-coded payloads reach the file: ``"pinned"`` (through pinned host
            memory), ``"gds"`` (from GPU memory, GPUDirect Storage through kvikio: a local file,
            the ``gds-cu12``/``gds-cu13`` extra), ``"auto"`` (`options.AUTO_IO_PATH`);
            `pipeline.io_path`. The returned `ShardInfo.io` says which wrote the file.

    The caller must not modify the tensors while `save` runs.
    """
    options = CompressionOptions(algorithm=algorithm, portable=portable, chunk_mb=chunk_mb,
                                 gpu_batch_mb=gpu_batch_mb)
    check_io_path(io_path)
    prepared = _prepare(obj, options, workers=workers, derive=derive, choices=choices,
                        part=os.path.basename(path))
    return pipeline.write_prepared(prepared, path, durable=durable, direct=o_direct, workers=workers,
                                   io_path=io_path)


def _prepare(
    obj: Any, options: CompressionOptions, *, workers: int | None, derive: Deriver | None,
    choices: ChoiceCache | None = None, part: str = "",
) -> pipeline.PreparedShard:
    check_workers(workers)
    flat = state.flatten(obj)
    return pipeline.prepare_shard(
        flat.skeleton, flat.tensors, flat.keys, algorithm=options.algorithm,
        portable=options.portable, chunk_bytes=options.chunk_bytes, writer_info=writer_info(),
        gpu_batch_bytes=options.gpu_batch_bytes, derive=derive,
        tensor_attributes=flat.tensor_attributes, choice_cache=choices, part=part,
    )


def writer_info() -> dict[str, Any]:
    """What a shard's index records about the software that wrote it."""
    return {
        "package": f"nvcomp_ckpt_engine {__version__}",
        "torch": torch.__version__.split("+")[0],
        "nvcomp": backend_summary()["nvcomp"],
    }


class _SaveJobs(cf.Executor):
    """One save's jobs on a pool that may be shared (an engine's, kept from save to save):
    `settle` cancels those not started and waits for the rest, so that the save's staging
    memory is given back only once no job of it reads it, without shutting the pool down."""

    def __init__(self, pool: cf.Executor) -> None:
        self.pool = pool
        self._futures: list[cf.Future[Any]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        future = self.pool.submit(fn, *args, **kwargs)
        with self._lock:
            self._futures.append(future)
        return future

    def settle(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            future.cancel()
        cf.wait(futures)


class PendingSave:
    """A shard being written in the background by `save_async`.

    `blocked` is true when the state did not fit the host-memory budget, so the save wrote the
    file before returning (the caller's log line should say so). `device_bytes` is the GPU
    memory held by payloads still being copied to host memory when `save_async` returned;
    `wanted_device_bytes` what all of them would have held, had the GPU budget allowed it (or
    the raw copy of the GPU state it could not hold). `snapshot_bytes`: the raw copy of the GPU
    state this save took instead of encoding it before returning (0: it encoded).
    `result()` waits and returns the `ShardInfo`, or raises what the background write raised.
    """

    def __init__(self, future: "cf.Future[ShardInfo]", *, staged_bytes: int, blocked: bool,
                 device_bytes: int = 0, wanted_device_bytes: int = 0,
                 snapshot_bytes: int = 0) -> None:
        self._future = future
        self.staged_bytes = staged_bytes
        self.blocked = blocked
        self.device_bytes = device_bytes
        self.wanted_device_bytes = wanted_device_bytes
        self.snapshot_bytes = snapshot_bytes

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> ShardInfo:
        return self._future.result(timeout)


def save_async(
    obj: Any,
    path: str | os.PathLike,
    *,
    algorithm: str = "auto",
    portable: bool = False,
    chunk_mb: float = DEFAULT_CHUNK_MB,
    durable: bool = True,
    host_budget_bytes: int,
    gpu_budget_bytes: int = 0,
    workers: int | None = None,
    gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB,
    o_direct: bool = False,
    start: threading.Event | None = None,
    derive: Deriver | None = None,
    pool: cf.Executor | None = None,
    choices: ChoiceCache | None = None,
    gpu_snapshot: bool = False,
    io_path: str = "auto",
) -> PendingSave:
    """Capture `obj` and write it in the background; returns once training may change it.

    GPU tensors are compressed on the GPU and copied to host memory before this returns (into
    pinned memory that the process keeps for the next async save: `staging`); CPU tensors are
    copied (snapshotted) and compressed in the background. The captured copy is
    immune to later optimizer steps. At most `host_budget_bytes` of host memory is held; above
    that, the save writes the file before returning (`PendingSave.blocked`). With
    `gpu_budget_bytes`, up to that many bytes of compressed payloads may still be on the GPU,
    being copied to host memory, when this returns: the caller blocks for the encoding only
    (`pipeline.gpu_headroom_bytes` says how much a training job can spare).

    With `start`, the background write begins once it is set (at most `START_WAIT_S` later):
    a caller that still has files to capture or write before training resumes sets it then, so
    that gigabytes entering the page cache do not throttle its own writes (Linux slows every
    writer of a device whose dirty pages pile up), which would lengthen the time it blocks.

    With `gpu_snapshot`, where `gpu_budget_bytes` holds a raw copy of the file's
    GPU state (and the file has no derived ranges), that state is copied on its GPU instead of
    encoded (`pipeline.snapshot_on_device`: a device-to-device copy, queued on the current
    stream before the caller's next kernels) and encoded beside them, on a background thread
    (`pipeline.write_snapshot`): the caller blocks for the copy only
    (`PendingSave.snapshot_bytes`: the GPU memory the copy holds until the file is written).
    That write takes `io_path` as `save` does; a capture stages its payloads in pinned host
    memory whatever `io_path` says (they must leave the GPU before training goes on).

    `pool`: the threads that checksum and encode, kept by the caller from save to save (a
    training job's engine, for its life) rather than started inside each stall; it must stay
    open until the save is written. `choices`: `auto`'s choices kept from the caller's earlier
    saves of the same file (`selection.ChoiceCache`, by the file's name). Other options as for
    `save`.
    """
    options = CompressionOptions(algorithm=algorithm, portable=portable, chunk_mb=chunk_mb,
                                 gpu_batch_mb=gpu_batch_mb)
    resolve_io_path(io_path, path)  # "gds" that cannot be had fails here, not in the background
    prepared = _prepare(obj, options, workers=workers, derive=derive, choices=choices,
                        part=os.path.basename(path))
    snapshot = (pipeline.snapshot_on_device(prepared, gpu_budget_bytes, host_budget_bytes)
                if gpu_snapshot and gpu_budget_bytes > 0 else None)
    if snapshot is not None:
        return _write_snapshot(snapshot, path, durable=durable, direct=o_direct, workers=workers,
                               start=start, io_path=io_path)
    workers = workers or pipeline.default_workers()
    own_pool = pool is None
    jobs = _SaveJobs(pool or cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-async"))

    def release() -> None:
        """Once no job of this save may still read the lease's slices: close it."""
        jobs.settle()
        if own_pool:
            jobs.pool.shutdown()
        lease.close()

    lease = staging.ARENA.open()
    future: cf.Future[ShardInfo] = cf.Future()
    try:
        staged = pipeline.stage(prepared, host_budget_bytes=host_budget_bytes, pool=jobs,
                                lease=lease, device_budget_bytes=gpu_budget_bytes)
        if not staged.complete:
            future.set_result(pipeline.write_staged(staged, path, durable=durable, pool=jobs,
                                                    workers=workers, direct=o_direct))
            release()
            return PendingSave(future, staged_bytes=staged.held_bytes, blocked=True)
    except BaseException:
        release()  # checksum jobs may still read the slices
        raise

    def run() -> None:
        try:
            if start is not None:
                start.wait(START_WAIT_S)
            future.set_result(pipeline.write_staged(staged, path, durable=durable, pool=jobs,
                                                    workers=workers, direct=o_direct))
        except BaseException as exc:  # handed to whoever calls result()
            future.set_exception(exc)
        finally:
            release()

    threading.Thread(target=run, name=f"nvckpt-save-{os.path.basename(path)}", daemon=True).start()
    # A budget that could not hold the raw copy asks for it: the caller may cache that much
    # for its next save (`gpu_cache.growth_after_save`), whose stall is then the copy alone.
    wanted = staged.wanted_device_bytes
    if gpu_snapshot and gpu_budget_bytes > 0:
        wanted = max(wanted, pipeline.snapshot_bytes(prepared))
    return PendingSave(future, staged_bytes=staged.held_bytes, blocked=False,
                       device_bytes=staged.device_bytes, wanted_device_bytes=wanted)


def _write_snapshot(snapshot: pipeline.DeviceSnapshot, path: str | os.PathLike, *, durable: bool,
                    direct: bool, workers: int | None, start: threading.Event | None,
                    io_path: str
                    ) -> PendingSave:
    """`save_async`'s background write of a state copied on its GPU (`pipeline.write_snapshot`),
    begun once `start` is set (at most `START_WAIT_S` later)."""
    future: cf.Future[ShardInfo] = cf.Future()

    def run() -> None:
        try:
            if start is not None:
                start.wait(START_WAIT_S)
            future.set_result(pipeline.write_snapshot(snapshot, path, durable=durable,
                                                      direct=direct, workers=workers,
                                                      io_path=io_path))
        except BaseException as exc:  # handed to whoever calls result()
            future.set_exception(exc)

    threading.Thread(target=run, name=f"nvckpt-save-{os.path.basename(path)}", daemon=True).start()
    return PendingSave(future, staged_bytes=snapshot.host_bytes, blocked=False,
                       device_bytes=snapshot.device_bytes,
                       wanted_device_bytes=snapshot.device_bytes,
                       snapshot_bytes=snapshot.device_bytes)


def load(
    path: str | os.PathLike,
    map_location: pipeline.MapLocation = None,
    *,
    trusted: bool = False,
    verify: bool = True,
    safe_classes: Iterable[type | Callable[..., Any] | str] = (),
    workers: int | None = None,
    sources: Mapping[str, str | os.PathLike] | None = None,
    gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB,
) -> Any:
    """Load an object saved by `save`, bit-exact.

    This is the one reader of engine files outside a live DeepSpeed job: a file whose storages
    are derived from other files of its checkpoint (the module of a DeepSpeed ZeRO-1/2 save,
    rebuilt from the fp32 master partitions of the optimizer shards beside it) comes back whole,
    exactly as a plain save would have held it (`siblings`).

    Args:
        map_location: as in `torch.load`: None (devices as saved), a device or string, a dict
            mapping saved locations to new ones, or a callable ``f(storage, location)``.
        trusted: allow the skeleton to create any class (only for files you trust).
        verify: check every chunk's CRC-32 before decoding it (the sources' chunks too).
        safe_classes: classes (or "module.QualName" strings) to allow for this call only.
        sources: where the files a derived storage names are, by name (default: in `path`'s
            folder, where each must resolve: a link out of it is refused); a tool that reads a
            checkpoint through its manifest passes its paths. Whatever the path, a source
            must hold its elements itself and give back the digests the file recorded
            (`siblings`), or the load raises `CorruptCheckpointError` naming both files.
        gpu_batch_mb: compressed MiB read and decoded per nvCOMP call; a load's pinned host
            memory is at most eight times this (five when decoding onto the GPU), whatever the
            file's size.
    """
    index = container.read_index(path)
    siblings = SiblingSources(os.path.dirname(index.path), files=sources, verify=verify, workers=workers)
    if index.derived_files:  # the derived ranges' sizes, bounded by their sources before allocating
        siblings.check_for_load(index)
    return load_shard(index, map_location, trusted=trusted, verify=verify, safe_classes=safe_classes,
                      workers=workers, fill_derived=siblings.fill, gpu_batch_mb=gpu_batch_mb)


def load_shard(
    index: container.ShardIndex,
    map_location: pipeline.MapLocation,
    *,
    trusted: bool,
    verify: bool,
    safe_classes: Iterable[type | Callable[..., Any] | str] = (),
    workers: int | None = None,
    fill_derived: pipeline.DerivedFiller | None = None,
    decoded: dict[int, torch.Tensor] | None = None,
    gpu_batch_mb: float = DEFAULT_GPU_BATCH_MB,
) -> Any:
    """`load` with the derived ranges filled by `fill_derived` and storages the caller decoded
    already (`decoded`, by storage index): the DeepSpeed engine's form, which rebuilds a module
    with an all-gather of the ranks' own partitions and reuses them for the optimizer shard."""
    source = index.path

    def rebuild(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
        return state.unflatten(skeleton, tensors, trusted=trusted, safe_classes=safe_classes,
                               source=source, tensor_attributes=index.tensor_attributes,
                               keys=[t.key for t in index.tensors])

    return pipeline.read_shard(source, map_location=map_location, verify=verify, rebuild=rebuild,
                               workers=workers, gpu_batch_bytes=int(gpu_batch_mb * (1 << 20)), index=index,
                               fill_derived=fill_derived, decoded=decoded)


is_shard_file = container.is_shard_file
