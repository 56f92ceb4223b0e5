"""Encode → device-to-host → write: the synchronous save and the asynchronous capture.

Each storage's bytes are cut into chunks; a chunk is transformed (byte planes) and encoded where
its codec runs — nvCOMP on the tensor's GPU, or the CPU codecs in a thread pool — and the writer
appends finished chunks in file order while later chunks are still being encoded, so encoding
overlaps the writes. A bounded number of chunks (and of GPU batches' bytes) is in flight, which
bounds staging memory whatever the size of the state (`bounds`). A chunk that the codec does not
make smaller is stored as it is, so no file is ever larger than its raw data plus the index.

GPU payloads reach the file one of two ways (`io_path`): through pinned host memory, which
the storage's sink writes from (every backend), or, for a sink that takes device buffers (the
GPUDirect Storage sink, `storage.gds`), from GPU memory itself, with a host copy only for their
checksums (`_encode_gpu_direct`).

An asynchronous save captures first (`stage`: GPU chunks encoded and copied into the pinned
arena, CPU chunks snapshotted) and writes later (`write_staged`). Where its GPU budget holds a
raw copy of the file's state, it copies instead (`snapshot_on_device`: a device-to-device copy,
ordered on the training stream before the optimizer's next kernels) and encodes that copy beside
the next training steps (`write_snapshot`): the stall is the copy, not the encoding.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import functools
import itertools
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .. import codecs, container, staging, transforms
from ..codecs import Plan
from ..container import DTYPE_NAMES
from ..errors import CheckpointError, CodecError
from ..storage import Sink, gds, locations
from . import io_path as io_paths
from .bounds import STAGED_BATCHES, default_workers
from .gpu_cache import SEGMENT_BYTES
from .plan import Job, PreparedShard


@dataclass(frozen=True)
class ShardInfo:
    """What `save` wrote: the file, its raw and on-disk sizes, its CRC-32 and codecs, and the
    way its GPU payloads reached it (`io`: ``"gds"``, ``"gds-compat"``, ``"pinned"``, or
    ``"host"`` for a file with none; `pipeline.io_path`), which the manifest records."""

    path: str
    raw_bytes: int
    file_bytes: int
    crc32: int
    codecs: tuple[str, ...]
    io: str = "host"

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.file_bytes if self.file_bytes else 1.0


@dataclass(frozen=True)
class _Encoded:
    """One chunk ready for the file: its stored bytes (host memory) and what the index needs.

    `staged` is the host staging memory its payload holds (`staging.METER`), given back once
    the writer has written it; 0 for a payload that is a view of the state itself or of the
    async arena. `device`: the payload still in GPU memory, for a sink that takes device
    buffers (`payload` is then empty: its host copy was for the checksum only).
    """

    payload: memoryview
    raw_length: int
    crc32: int
    stored_raw: bool
    staged: int = 0
    device: torch.Tensor | None = None


def _pinned_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy CUDA tensors into one pinned host buffer (one sync), as host views (staging: the
    caller gives the bytes back to `staging.METER` once they are written)."""
    total = staging.METER.take(sum(t.numel() for t in tensors))
    host = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    views, start = [], 0
    for t in tensors:
        view = host[start : start + t.numel()]
        view.copy_(t, non_blocking=True)
        views.append(view)
        start += t.numel()
    if tensors:
        torch.cuda.current_stream(tensors[0].device).synchronize()
    return views


def _finish(chunk_host: list[torch.Tensor], raw_lengths: list[int], stored_raw: list[bool],
            staged: list[int]) -> list[_Encoded]:
    """Checksums of host payloads (run in a pool thread: zlib releases the GIL)."""
    out = []
    for data, raw, is_raw, held in zip(chunk_host, raw_lengths, stored_raw, staged):
        view = memoryview(data.numpy()).cast("B")
        out.append(_Encoded(view, raw, zlib.crc32(view), is_raw, held))
    return out


def _encode_cpu(job: Job) -> list[_Encoded]:
    """Transform + encode + checksum on the CPU (a pool thread). Staging held: a host copy of
    a chunk that lives on a GPU, the chunk's planes while it is coded, and its payload."""
    meter = staging.METER
    chunks, copied = [], []
    for c in job.chunks:
        copied.append(meter.take(c.numel()) if c.device.type != "cpu" else 0)
        chunks.append(c if c.device.type == "cpu" else c.cpu())
    planes_held = meter.take(sum(c.numel() for c in chunks)) if job.plan.width > 1 else 0
    try:
        payloads = _run_codec(job.plan, [transforms.to_planes(c, job.plan.width) for c in chunks])
    finally:
        meter.give(planes_held)
    stored_raw = [p.numel() >= c.numel() for p, c in zip(payloads, chunks)]
    hosts, staged = [], []
    for c, p, raw, held in zip(chunks, payloads, stored_raw, copied):
        if raw:
            hosts.append(c)
            staged.append(held)
        else:
            meter.give(held)
            hosts.append(p)
            staged.append(meter.take(p.numel()))
    return _finish(hosts, [c.numel() for c in chunks], stored_raw, staged)


def _gpu_payloads(job: Job) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """Encode a GPU job: (chunks on the GPU, what to store for each, stored raw?)."""
    device = job.chunks[0].device if job.chunks[0].is_cuda else torch.device("cuda", torch.cuda.current_device())
    try:
        chunks = [c if c.device == device else c.to(device, non_blocking=True) for c in job.chunks]
        planes = [transforms.to_planes(c, job.plan.width) for c in chunks]
        payloads = _run_codec(job.plan, planes)
    except torch.cuda.OutOfMemoryError as exc:
        raise CheckpointError(
            f"could not allocate GPU staging memory for {job.nbytes >> 20} MiB of chunks on "
            f"{device}: lower the staging batch (gpu_batch_mb, ds_config "
            '"nvcomp_checkpoint": {"gpu_batch_mb": ...}) or free GPU memory before saving'
        ) from exc
    stored_raw = [p.numel() >= c.numel() for p, c in zip(payloads, chunks)]
    return chunks, [c if raw else p for c, p, raw in zip(chunks, payloads, stored_raw)], stored_raw


def _encode_gpu(job: Job, pool: cf.Executor) -> cf.Future[list[_Encoded]]:
    """Encode on the GPU, copy the payloads to pinned host memory; checksum in the pool."""
    chunks, sources, stored_raw = _gpu_payloads(job)
    hosts = _pinned_copies(sources)
    return pool.submit(_finish, hosts, [c.numel() for c in chunks], stored_raw, [h.numel() for h in hosts])


def _encode_gpu_direct(job: Job, pool: cf.Executor) -> cf.Future[list[_Encoded]]:
    """Encode on the GPU for a sink that takes device buffers: the payloads stay in GPU memory
    for the sink; a pinned host copy of them (which also waits for the encoding to finish) is
    checksummed in the pool and given back then, not held until the write."""
    chunks, sources, stored_raw = _gpu_payloads(job)
    hosts = _pinned_copies(sources)
    return pool.submit(_checksum_device, sources, hosts, [c.numel() for c in chunks], stored_raw,
                       sum(h.numel() for h in hosts))


def _checksum_device(sources: list[torch.Tensor], hosts: list[torch.Tensor], raw_lengths: list[int],
                     stored_raw: list[bool], held: int) -> list[_Encoded]:
    """The chunks of `_encode_gpu_direct`, their CRC-32s from the host copies (a pool thread)."""
    try:
        encoded = _finish(hosts, raw_lengths, stored_raw, [0] * len(hosts))
    finally:
        staging.METER.give(held)
    return [dataclasses.replace(enc, payload=memoryview(b""), device=source)
            for enc, source in zip(encoded, sources)]


#: Bytes of each dtype `warm_up` encodes with each plan.
WARM_UP_BYTES = 1 << 16


def warm_up(dtypes: Iterable[torch.dtype], device: torch.device, *, algorithm: str, portable: bool) -> None:
    """Encode a small sample of each dtype on `device` with every plan `auto` may choose for it
    (`codecs.candidates_for`), so that a job's first save does not load the codecs' GPU kernels
    (CUDA loads a kernel at its first launch) and set nvCOMP up inside its stall."""
    for dtype in dtypes:
        sample = torch.randn(WARM_UP_BYTES // 4, device=device).to(dtype).view(-1).view(torch.uint8)
        for plan in codecs.candidates_for(dtype, device, algorithm=algorithm, portable=portable):
            _run_codec(plan, [transforms.to_planes(sample, plan.width)])


def _run_codec(plan: Plan, planes: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return plan.codec.encode_batch(planes, element=plan.element)
    except CodecError:
        raise
    except Exception as exc:  # zstd/zlib/nvCOMP raise their own types; name the codec
        raise CodecError(f"{plan.codec.name} failed to encode: {exc}") from exc


#: GPU batches whose copy into host memory may still run while the next batch is encoded.
_CAPTURE_WINDOW = 2


def gpu_headroom_bytes(device: torch.device | int | None = None) -> int:
    """GPU memory an async capture may leave its payloads in while training resumes: what the
    device has free plus what torch's allocator holds cached, less the growth from now to this
    process's peak so far (a training step's transient memory), halved as a margin. 0 without
    CUDA. Measure it before the first capture: a capture's own payloads raise the peak."""
    if not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    spare = free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device)
    return max(0, spare // 2)


def _held_bytes(sources: list[torch.Tensor], stored_raw: list[bool]) -> int:
    """GPU memory one batch's payloads hold while they wait: each encode output buffer whole
    (payloads are slices of it, sized by nvCOMP's bound) and a copy of each stored-raw chunk."""
    buffers = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes()
               for s, raw in zip(sources, stored_raw) if not raw}
    return sum(buffers.values()) + sum(s.numel() for s, raw in zip(sources, stored_raw) if raw)


def _finish_after(copied: torch.cuda.Event, hosts: list[torch.Tensor], raw_lengths: list[int],
                  stored_raw: list[bool]) -> list[_Encoded]:
    copied.synchronize()
    return _finish(hosts, raw_lengths, stored_raw, [0] * len(hosts))


class _Capture:
    """An async save's GPU capture: each batch is encoded, and its payloads are copied into the
    pinned arena on a side stream.

    Without a device budget, a batch's copy runs while the next batch is encoded, at most
    `_CAPTURE_WINDOW` copies in flight (which bounds the GPU memory their payloads hold), and the
    capture ends once every copy is done: the stall is the device-to-host copy of the compressed
    state. With `device_budget_bytes`, payloads up to that many bytes wait on the GPU and their
    copies start only once the encoding is done (`flush`; or once the budget is full, the rest
    then captured as without one): queued copies would delay each batch's
    read of its compressed sizes, a small device-to-host copy, behind them. The copies then run
    while training resumes, so the stall is the encoding alone. Stored-raw chunks (views of the
    live state) are first copied on the GPU, in stream order before training's next kernels.
    """

    def __init__(self, pool: cf.Executor, lease: staging.Lease | None, device_budget_bytes: int = 0) -> None:
        self.pool, self.lease = pool, lease
        self.budget = device_budget_bytes
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        #: Copies the capture waits for: a window of them while encoding, all at its end.
        self.copies: collections.deque[torch.cuda.Event] = collections.deque()
        #: Copies of deferred batches, left running when the capture returns.
        self.background: collections.deque[torch.cuda.Event] = collections.deque()
        #: Encoded batches whose copies wait for `flush`: (payloads, raw lengths, stored raw, future).
        self.deferred: list[tuple[list[torch.Tensor], list[int], list[bool], cf.Future[list[_Encoded]]]] = []
        #: GPU memory the payloads in `deferred` hold.
        self.deferred_bytes = 0
        #: GPU memory every batch's payloads would hold if all were deferred (`_held_bytes`).
        self.wanted_bytes = 0

    def start(self, job: Job) -> cf.Future[list[_Encoded]]:
        chunks, sources, stored_raw = _gpu_payloads(job)
        raw_lengths = [c.numel() for c in chunks]
        nbytes = _held_bytes(sources, stored_raw)
        self.wanted_bytes += nbytes
        if self.deferred_bytes + nbytes > self.budget:  # over the budget: the rest as without one
            self.flush()
            self.budget = 0
        if self.budget:
            sources = [s.clone() if raw else s for s, raw in zip(sources, stored_raw)]
            future: cf.Future[list[_Encoded]] = cf.Future()
            self.deferred.append((sources, raw_lengths, stored_raw, future))
            self.deferred_bytes += nbytes
            return future
        copied = self._copy(sources, raw_lengths, stored_raw, self.copies)
        while len(self.copies) > _CAPTURE_WINDOW:
            self.copies.popleft().synchronize()
        return copied

    def _copy(self, sources: list[torch.Tensor], raw_lengths: list[int], stored_raw: list[bool],
              events: collections.deque[torch.cuda.Event]) -> cf.Future[list[_Encoded]]:
        """Queue the copy of one batch's payloads into host memory; its checksums follow in the pool."""
        device = sources[0].device
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        stream = self.streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        hosts = [self.lease.take(t.numel()) if self.lease is not None
                 else torch.empty(t.numel(), dtype=torch.uint8, pin_memory=True) for t in sources]
        with torch.cuda.stream(stream):
            for host, source in zip(hosts, sources):
                host.copy_(source, non_blocking=True)
                source.record_stream(stream)  # its GPU memory is not reused before the copy ends
        copied = torch.cuda.Event()
        copied.record(stream)
        events.append(copied)
        return self.pool.submit(_finish_after, copied, hosts, raw_lengths, stored_raw)

    def flush(self) -> None:
        """Start the copies of the deferred batches (they run on while the caller goes on)."""
        for sources, raw_lengths, stored_raw, future in self.deferred:
            self._copy(sources, raw_lengths, stored_raw, self.background).add_done_callback(
                functools.partial(_pass_on, future))
        self.deferred, self.deferred_bytes = [], 0

    def wait(self, *, background: bool = True) -> None:
        """Wait for the copies (those read from the live state at least: not `background`)."""
        if background:
            self.flush()
        for events in (self.copies, self.background) if background else (self.copies,):
            while events:
                events.popleft().synchronize()


def _pass_on(to: cf.Future, done: cf.Future) -> None:
    """Give `to` the outcome of `done`."""
    if done.exception() is not None:
        to.set_exception(done.exception())
    else:
        to.set_result(done.result())


class _Encoder:
    """Starts jobs: CPU jobs in the pool; GPU jobs on the calling thread (nvCOMP needs no
    Python parallelism), their checksums in the pool. Returns futures in submission order.
    `device_sink`: GPU payloads stay in GPU memory for a sink that takes them."""

    def __init__(self, pool: cf.Executor, *, device_sink: bool = False) -> None:
        self.pool = pool
        self.encode_gpu = _encode_gpu_direct if device_sink else _encode_gpu

    def start(self, job: Job) -> cf.Future[list[_Encoded]]:
        if job.plan.codec.device == "cuda":
            return self.encode_gpu(job, self.pool)
        return self.pool.submit(_encode_cpu, job)


def _io_record(prepared: PreparedShard, way: str) -> str:
    """What the manifest records of how the file's GPU payloads were written (`ShardInfo.io`)."""
    if not any(plan.codec.device == "cuda" for plan in prepared.plans):
        return "host"
    return gds.io_mode() if way == "gds" else "pinned"


def _write_file(
    prepared: PreparedShard,
    path: str | os.PathLike,
    encoded: Iterator[tuple[int, int, cf.Future[list[_Encoded]]]],
    *,
    sink: Sink,
    io: str,
    max_inflight: int,
) -> ShardInfo:
    """Write the shard through `sink` from encoded units (storage, raw bytes, future),
    appending on a writer thread while the caller's iterator keeps encoding. At most
    `max_inflight` units, and `STAGED_BATCHES` GPU batches' worth of raw bytes, wait to be
    written: that bounds the pinned host memory holding encoded GPU payloads (the iterator
    encodes one more unit), or the GPU memory holding them for a sink that takes device
    buffers (with what that sink keeps in flight: `storage.gds.INFLIGHT_BYTES`). `io` is
    what `ShardInfo.io` says."""
    try:
        writer = container.ShardWriter(path, version=prepared.version, sink=sink)
    except BaseException:
        sink.abort()
        raise
    declared = -1

    def declare_through(last: int) -> None:
        nonlocal declared
        for idx in range(declared + 1, last + 1):
            s, plan = prepared.storages[idx], prepared.plans[idx]
            writer.begin_storage(
                nbytes=s.hi - s.lo, dtype=DTYPE_NAMES[s.dtype], device=str(s.source.device),
                codec=plan.codec.descriptor(),
                transform=transforms.byteplanes(plan.width) if plan.width > 1 else transforms.NONE,
                derived=tuple(s.derived),
            )
        declared = max(declared, last)

    def append(idx: int, future: cf.Future[list[_Encoded]]) -> None:
        declare_through(idx)
        encoded_chunks = future.result()
        try:
            for enc in encoded_chunks:
                if enc.device is not None:
                    writer.append_device_chunk(idx, enc.device, length=enc.device.numel(),
                                               raw_length=enc.raw_length,
                                               stored_raw=enc.stored_raw, crc32=enc.crc32)
                else:
                    writer.append_chunk(idx, enc.payload, raw_length=enc.raw_length,
                                        stored_raw=enc.stored_raw, crc32=enc.crc32)
        finally:
            staging.METER.give(sum(enc.staged for enc in encoded_chunks))

    try:
        writer.write_skeleton(prepared.skeleton)
        with cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-write") as write_pool:
            pending: collections.deque[tuple[cf.Future[None], int]] = collections.deque()
            held, budget = 0, STAGED_BATCHES * prepared.gpu_batch_bytes
            for idx, nbytes, future in encoded:
                pending.append((write_pool.submit(append, idx, future), nbytes))
                held += nbytes
                while len(pending) > max_inflight or (held > budget and len(pending) > 1):
                    done, size = pending.popleft()
                    done.result()
                    held -= size
            while pending:
                pending.popleft()[0].result()
        declare_through(len(prepared.storages) - 1)
        size, crc = writer.finish(prepared.entries, prepared.writer_info)
    except BaseException:
        writer.abort()
        raise
    codecs = tuple(sorted({p.codec.name for p in prepared.plans}))
    return ShardInfo(os.fspath(path), prepared.raw_bytes, size, crc, codecs, io)


def write_prepared(
    prepared: PreparedShard, path: str | os.PathLike, *, durable: bool, direct: bool = False,
    workers: int | None = None, io_path: str = "auto",
) -> ShardInfo:
    """Encode and write `prepared` now: the synchronous save, with bounded staging memory.
    `io_path`: how GPU payloads reach the file (`pipeline.io_path`)."""
    workers = workers or default_workers()
    way = io_paths.resolve(io_path, path)
    sink = io_paths.open_sink(path, way=way, durable=durable, direct=direct)
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-encode") as pool:
        encoder = _Encoder(pool, device_sink=way == "gds")
        encoded = ((job.storage, job.nbytes, encoder.start(job)) for job in prepared.jobs())
        return _write_file(prepared, path, encoded, sink=sink, io=_io_record(prepared, way),
                           max_inflight=2 * workers)


@dataclass
class StagedShard:
    """What an asynchronous save captured before returning to training.

    GPU storages are already compressed and in host memory; CPU storages are snapshotted (copied)
    and compressed while the file is written. `complete` is false when the host-memory budget ran
    out: then `rest` still refers to live tensors and must be written before training resumes.
    """

    prepared: PreparedShard
    captured: list[tuple[int, cf.Future[list[_Encoded]] | Job]]
    held_bytes: int
    rest: Iterator[Job] | None
    #: GPU memory held by payloads whose copy to host memory started only as `stage` returned.
    device_bytes: int = 0
    #: GPU memory all its payloads would have held had the budget deferred every copy.
    wanted_device_bytes: int = 0

    @property
    def complete(self) -> bool:
        return self.rest is None


def stage(prepared: PreparedShard, *, host_budget_bytes: int, pool: cf.Executor,
          lease: staging.Lease | None = None, device_budget_bytes: int = 0) -> StagedShard:
    """Capture `prepared` into host memory, up to `host_budget_bytes` (see `StagedShard`).

    GPU payloads go into slices of `lease`, which must stay open until the file is written;
    without one (a capture whose lifetime the caller does not control), into pinned memory
    of torch's caching allocator. Up to `device_budget_bytes` of GPU payloads may still be on
    their way to host memory when this returns (`_Capture`); the write waits for them."""
    captured: list[tuple[int, cf.Future[list[_Encoded]] | Job]] = []
    held = 0
    capture = _Capture(pool, lease, device_budget_bytes)
    jobs = prepared.jobs()
    try:
        for job in jobs:
            if held + job.nbytes > host_budget_bytes and held > 0:
                capture.wait()
                return StagedShard(prepared, captured, held, itertools.chain([job], jobs))
            if job.plan.codec.device == "cuda":
                captured.append((job.storage, capture.start(job)))
            else:
                captured.append((job.storage, job.snapshot()))
            held += job.nbytes  # for GPU jobs an upper bound: a payload is at most its raw chunk
        device_bytes = capture.deferred_bytes
        capture.flush()
        capture.wait(background=False)  # copies not deferred read stored-raw chunks from the live state
        return StagedShard(prepared, captured, held, None, device_bytes=device_bytes,
                           wanted_device_bytes=capture.wanted_bytes)
    except BaseException:
        capture.wait()  # nothing may still be copying into the lease the caller closes
        raise


def write_staged(
    staged: StagedShard, path: str | os.PathLike, *, durable: bool, pool: cf.Executor, workers: int,
    direct: bool = False,
) -> ShardInfo:
    """Write what `stage` captured (compressing the CPU snapshots now), then any `rest`.

    `pool` runs the CPU snapshots' encoding; the futures `stage` captured (GPU chunks'
    checksums) may come from another executor, which must stay alive until they are done.
    """
    encoder = _Encoder(pool)

    def encoded() -> Iterator[tuple[int, int, cf.Future[list[_Encoded]]]]:
        for idx, item in staged.captured:  # held already (the async budget): not counted again
            yield idx, 0, item if isinstance(item, cf.Future) else encoder.start(item)
        for job in staged.rest or ():
            yield job.storage, job.nbytes, encoder.start(job)

    sink = locations.open_sink(path, durable=durable, direct=direct)
    return _write_file(staged.prepared, path, encoded(), sink=sink,
                       io=_io_record(staged.prepared, "pinned"), max_inflight=2 * workers)


@dataclass
class DeviceSnapshot:
    """An async save's file with every storage copied (`snapshot_on_device`): its GPU storages
    on their GPU, its host storages in host memory. `copied` holds, per GPU, the event recorded
    on the stream the copies were queued on; `device_bytes` and `host_bytes` are the memory the
    copies hold until the file is written."""

    prepared: PreparedShard
    device_bytes: int
    copied: dict[torch.device, torch.cuda.Event]
    host_bytes: int = 0


def snapshot_bytes(prepared: PreparedShard) -> int:
    """The GPU memory a raw copy of `prepared`'s GPU storages takes (`snapshot_on_device`); 0
    for a file it does not copy whatever the budget: one with derived ranges, whose stored
    bytes are few (the ZeRO-1/2 model states), or without GPU storages."""
    if any(s.derived for s in prepared.storages):
        return 0
    return sum(s.hi - s.lo for s in prepared.storages if s.source.is_cuda)


def snapshot_on_device(prepared: PreparedShard, device_budget_bytes: int,
                       host_budget_bytes: int) -> DeviceSnapshot | None:
    """Copy the state of `prepared` so that it can be encoded after training goes on, or None
    where this cannot be: no GPU storage, a storage with derived ranges (a file whose stored
    bytes are few: the capture encodes them), a raw copy larger than `device_budget_bytes` (or
    of its host storages, than `host_budget_bytes`), or no GPU memory for it.

    Each GPU storage is copied on its GPU, on the caller's current stream (so before whatever
    that stream queues next: the optimizer's step), into pieces of at most `SEGMENT_BYTES`, each
    a whole number of chunks: the pieces fit the segments the async GPU budget is cached in
    (`gpu_cache`), and chunk the state exactly as the live span would (the file is the same).
    Host storages are copied in host memory. Nothing waits for the GPU copies here."""
    if not torch.cuda.is_available():
        return None
    device_bytes = snapshot_bytes(prepared)
    host_bytes = sum(s.hi - s.lo for s in prepared.storages) - device_bytes
    if not 0 < device_bytes <= device_budget_bytes or host_bytes > host_budget_bytes:
        return None
    piece = max(prepared.chunk_bytes, SEGMENT_BYTES // prepared.chunk_bytes * prepared.chunk_bytes)
    try:
        storages = [dataclasses.replace(s, copies=_copied(s.bytes_view(), piece))
                    for s in prepared.storages]
    except torch.cuda.OutOfMemoryError:
        return None
    copied = {}
    for device in {s.source.device for s in prepared.storages if s.source.is_cuda}:
        copied[device] = torch.cuda.Event()
        copied[device].record(torch.cuda.current_stream(device))
    return DeviceSnapshot(dataclasses.replace(prepared, storages=storages), device_bytes, copied,
                          host_bytes)


def _copied(span: torch.Tensor, piece: int) -> tuple[torch.Tensor, ...]:
    """A copy of `span` on its device, in pieces of `piece` bytes (the last shorter)."""
    copies = []
    for start in range(0, span.numel(), piece):
        source = span[start : start + piece]
        copies.append(torch.empty_like(source).copy_(source, non_blocking=True))
    return tuple(copies) or (torch.empty(0, dtype=torch.uint8, device=span.device),)


#: The stream of each GPU that snapshots are encoded on (`_background_stream`).
_BACKGROUND_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_BACKGROUND_STREAMS_LOCK = threading.Lock()


def _background_stream(device: torch.device) -> torch.cuda.Stream:
    """`device`'s stream for encoding snapshots, at CUDA's lowest priority, one for the process:
    torch's allocator caches freed GPU memory per stream, so a new stream per save would make
    each save's working memory anew beside the last one's."""
    with _BACKGROUND_STREAMS_LOCK:
        if device not in _BACKGROUND_STREAMS:
            _BACKGROUND_STREAMS[device] = torch.cuda.Stream(device, priority=0)
        return _BACKGROUND_STREAMS[device]


def write_snapshot(snapshot: DeviceSnapshot, path: str | os.PathLike, *, durable: bool,
                   direct: bool = False, workers: int | None = None,
                   io_path: str = "auto") -> ShardInfo:
    """Encode and write what `snapshot_on_device` copied, as a synchronous save of it
    (`write_prepared`: bounded staging, the same file), on the calling thread: a background
    thread, beside training. It waits for the copies first, then encodes on the GPU's snapshot
    stream (`_background_stream`), at CUDA's lowest priority (training's default stream has no
    lower one, and a job that trains on a higher-priority stream goes first), with codecs made
    for this thread (nvCOMP's codec objects belong to the thread that made them). The copies'
    GPU memory goes back to torch's allocator once the file is written."""
    for event in snapshot.copied.values():
        event.synchronize()
    own = {id(plan.codec): codecs.encoder_for_this_thread(plan.codec) for plan in snapshot.prepared.plans}
    plans = [dataclasses.replace(plan, codec=own[id(plan.codec)]) for plan in snapshot.prepared.plans]
    prepared = dataclasses.replace(snapshot.prepared, plans=plans)
    devices = sorted(snapshot.copied, key=str)
    if not devices:
        return write_prepared(prepared, path, durable=durable, direct=direct, workers=workers,
                              io_path=io_path)
    stream = _background_stream(devices[0])
    with torch.cuda.device(devices[0]), torch.cuda.stream(stream):
        info = write_prepared(prepared, path, durable=durable, direct=direct, workers=workers,
                              io_path=io_path)
    stream.synchronize()  # nothing reads the copies once they go back to the allocator
    return info
