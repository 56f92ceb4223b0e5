"""Chunked encode → device-to-host → write, and read → host-to-device → decode.

Saving: each storage's bytes are cut into chunks; a chunk is transformed (byte planes) and
encoded where its codec runs — nvCOMP on the tensor's GPU, or the CPU codecs in a thread pool —
and the writer appends finished chunks in file order while later chunks are still being
encoded, so encoding overlaps the writes. A bounded number of chunks (and of GPU batches'
bytes) is in flight, which bounds staging memory whatever the size of the state. A chunk that
the codec does not make smaller is stored as it is, so no file is ever larger than its raw data
plus the index.

Loading is the mirror: chunks are read ahead and checksummed, decoded in the pool (or on the
GPU) into the destination storage — through batch-sized staging buffers only, never a
full-size intermediate copy — and the tensors are rebuilt as views of it, which keeps storage
sharing and strides exactly as saved.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import dataclasses
import functools
import itertools
import logging
import json
import os
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterator, Sequence, TypeVar

import torch

from . import container, derived, selection, staging, transforms
from .codecs import Codec, Plan, candidates_for, decoder_for
from .codecs.base import element_of
from .container import DTYPE_NAMES, DTYPES, Blob, DerivedRange, ShardIndex, StorageEntry, TensorEntry
from .errors import CheckpointError, CodecError, CorruptCheckpointError, UnsupportedCheckpointError

logger = logging.getLogger(__name__)

#: Chunk sizes are multiples of this, so every element width (1..16 bytes) divides them.
_ALIGN = 16
#: Encoded GPU batches waiting for the writer, at most (raw bytes / gpu_batch_bytes): with the
#: one being encoded, a save's pinned host memory stays within 4 batches (1 GiB by default).
_STAGED_BATCHES = 3


def default_workers() -> int:
    """CPU codec threads: every core, since zstd and zlib release the GIL while they work."""
    return max(1, min(8, os.cpu_count() or 1))


def save_staging_bound(*, workers: int, chunk_bytes: int, gpu_batch_bytes: int) -> int:
    """The most host staging memory (`staging.METER`) a save holds at once, whatever the size of
    the state: `_STAGED_BATCHES` + 1 GPU batches of pinned payloads (the batches waiting for the
    writer and the one being copied off the GPU), and for CPU-coded chunks 2 x `workers` + 1
    payloads waiting for the writer plus, in each worker, a chunk's host copy and planes while
    it is coded. Pass ``gpu_batch_bytes=0`` for a save that codes nothing on a GPU."""
    return (_STAGED_BATCHES + 1) * gpu_batch_bytes + (4 * workers + 1) * chunk_bytes


def load_staging_bound(*, workers: int, chunk_bytes: int, gpu_batch_bytes: int) -> int:
    """The most host staging memory (`staging.METER`) a load holds at once, whatever the size of
    the file: `_READ_AHEAD_BATCHES` GPU batches read ahead, one more whose copy to the GPU is in
    flight, and `_COPY_AHEAD` + 1 decoded batches on their way into host memory; for CPU-coded
    chunks, a chunk's read buffer and planes in each worker. Pass ``gpu_batch_bytes=0`` for a
    file that decodes nothing on a GPU."""
    return (_READ_AHEAD_BATCHES + 1 + _COPY_AHEAD + 1) * gpu_batch_bytes + 2 * workers * chunk_bytes


@dataclass(frozen=True)
class ShardInfo:
    """What `save` wrote: the file, its raw and on-disk sizes, its CRC-32 and codecs."""

    path: str
    raw_bytes: int
    file_bytes: int
    crc32: int
    codecs: tuple[str, ...]

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.file_bytes if self.file_bytes else 1.0


@dataclass
class _Storage:
    """A storage to save: the span of it the tensors view, those tensors' dtypes, and the
    ranges of the span that other files of the checkpoint hold (`derived`, not written)."""

    source: torch.Tensor  # a tensor whose untyped storage this is
    lo: int
    hi: int
    dtypes: set[torch.dtype]
    derived: list[DerivedRange] = dataclasses.field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.dtypes)) if len(self.dtypes) == 1 else torch.uint8

    def bytes_view(self) -> torch.Tensor:
        """The span as a 1-D uint8 tensor over the same memory (no copy)."""
        view = torch.empty(0, dtype=torch.uint8, device=self.source.device)
        return view.set_(self.source.untyped_storage(), self.lo, (self.hi - self.lo,), (1,))

    def stored_views(self) -> list[torch.Tensor]:
        """The parts of the span the file holds (all of it, or what its derived ranges leave)."""
        span = self.bytes_view()
        return [span[a:b] for a, b in container.stored_pieces(self.hi - self.lo, self.derived)]


def _extent(t: torch.Tensor) -> int:
    """Elements from the tensor's storage offset to one past its last element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _check_saveable(t: torch.Tensor, key: str) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"tensor {key!r} is a {type(t).__name__}; nvcomp_ckpt_engine.save stores "
                        "plain tensors and nn.Parameter (convert subclasses such as DTensor first)")
    if t.layout != torch.strided or t.is_nested or t.is_quantized or t.device.type == "meta":
        raise TypeError(f"tensor {key!r} ({'nested, ' if t.is_nested else ''}{t.layout}, "
                        f"{t.device}) is not a dense strided tensor with data; "
                        "nvcomp_ckpt_engine.save cannot store it")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which the format does not list")


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """`t` with its conjugate and negative bits applied to the data.

    Such a tensor views memory holding the values before the conjugation or negation, and the
    format stores memory: the bytes alone would load un-conjugated or un-negated. The values are
    computed from that memory, viewed without the bits, by `conj_physical` and `neg` (IEEE
    negation: +0.0 becomes -0.0; torch's own `resolve_neg` and same-layout `copy_` give +0.0
    for a complex zero). The copy has storage of its own (so it no longer shares storage with
    the tensor it viewed) and keeps `requires_grad` and the Parameter type.
    """
    if not (t.is_conj() or t.is_neg()):
        return t
    values = torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    if t.is_conj():
        values = values.conj_physical()
    if t.is_neg():
        values = torch.neg(values)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(values, requires_grad=t.requires_grad)
    return values.requires_grad_(t.requires_grad)


def _span(t: torch.Tensor, key: str) -> tuple[tuple[str, int], int, int, int]:
    """(storage identity, start byte, end byte, storage bytes) of what `t` views.

    torch's own refusals (a tensor without a usable storage) become a `TypeError` naming `key`.
    """
    try:
        itemsize = t.element_size()
        start = t.storage_offset() * itemsize
        end = start + _extent(t) * itemsize
        storage = t.untyped_storage()
        ident = (str(t.device), storage.data_ptr()) if t.numel() else ("empty", id(t))
        return ident, start, end, storage.nbytes()
    except RuntimeError as exc:
        raise TypeError(f"tensor {key!r} ({t.dtype}, {t.device}): torch cannot give its storage "
                        f"({exc}); nvcomp_ckpt_engine.save cannot store it") from exc


def group_storages(tensors: list[torch.Tensor], keys: list[str]) -> tuple[list[_Storage], list[TensorEntry]]:
    """Group tensors by the storage they view; each storage is stored once (its used span).

    Two storages may start at the same address (two `torch.from_numpy` views of one array
    begin where the array does): they are grouped, and the larger one is read.
    """
    storages: list[_Storage] = []
    largest: list[int] = []
    by_key: dict[tuple[str, int], int] = {}
    placed: list[tuple[torch.Tensor, int, int]] = []  # (tensor, storage index, byte start)
    for t, key in zip(tensors, keys):
        _check_saveable(t, key)
        t = _resolved(t)
        ident, start, end, nbytes = _span(t, key)
        if ident not in by_key:
            by_key[ident] = len(storages)
            storages.append(_Storage(t, start - start % _ALIGN, end, {t.dtype}))
            largest.append(nbytes)
        idx = by_key[ident]
        s = storages[idx]
        if nbytes > largest[idx]:
            s.source, largest[idx] = t, nbytes
        s.lo, s.hi = min(s.lo, start - start % _ALIGN), max(s.hi, end)
        s.dtypes.add(t.dtype)
        placed.append((t, idx, start))
    entries = [
        TensorEntry(key, idx, DTYPE_NAMES[t.dtype], tuple(t.shape), tuple(t.stride()),
                    (start - storages[idx].lo) // t.element_size(), t.requires_grad,
                    isinstance(t, torch.nn.Parameter))
        for key, (t, idx, start) in zip(keys, placed)
    ]
    return storages, entries


@dataclass(frozen=True)
class _Encoded:
    """One chunk ready for the file: its stored bytes (host memory) and what the index needs.

    `staged` is the host staging memory its payload holds (`staging.METER`), given back once
    the writer has written it; 0 for a payload that is a view of the state itself or of the
    async arena.
    """

    payload: memoryview
    raw_length: int
    crc32: int
    stored_raw: bool
    staged: int = 0


@dataclass(frozen=True)
class _Job:
    """Chunks of one storage to encode together (one CPU chunk, or a batch for the GPU)."""

    storage: int
    chunks: list[torch.Tensor]
    plan: Plan

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def snapshot(self) -> "_Job":
        """A copy of the chunks in host memory, immune to later changes of the live tensors."""
        return _Job(self.storage, [c.to("cpu", copy=True) for c in self.chunks], self.plan)


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


def _encode_cpu(job: _Job) -> list[_Encoded]:
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


def _gpu_payloads(job: _Job) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
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


def _encode_gpu(job: _Job, pool: cf.Executor) -> cf.Future[list[_Encoded]]:
    """Encode on the GPU, copy the payloads to pinned host memory; checksum in the pool."""
    chunks, sources, stored_raw = _gpu_payloads(job)
    hosts = _pinned_copies(sources)
    return pool.submit(_finish, hosts, [c.numel() for c in chunks], stored_raw, [h.numel() for h in hosts])


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
        #: Payload bytes in `deferred`: the GPU memory they hold.
        self.deferred_bytes = 0

    def start(self, job: _Job) -> cf.Future[list[_Encoded]]:
        chunks, sources, stored_raw = _gpu_payloads(job)
        raw_lengths = [c.numel() for c in chunks]
        nbytes = sum(t.numel() for t in sources)
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


def _run_codec(plan: Plan, planes: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return plan.codec.encode_batch(planes, element=plan.element)
    except CodecError:
        raise
    except Exception as exc:  # zstd/zlib/nvCOMP raise their own types; name the codec
        raise CodecError(f"{plan.codec.name} failed to encode: {exc}") from exc


def _chunk_views(span: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return [span[i : i + chunk_bytes] for i in range(0, span.numel(), chunk_bytes)]


@dataclass
class PreparedShard:
    """A state planned for writing: skeleton, storages, their codecs, and the tensor index."""

    skeleton: bytes
    storages: list[_Storage]
    plans: list[Plan]
    entries: list[TensorEntry]
    chunk_bytes: int
    gpu_batch_bytes: int
    writer_info: dict[str, Any]

    @property
    def raw_bytes(self) -> int:
        return sum(s.hi - s.lo for s in self.storages) + len(self.skeleton)

    @property
    def version(self) -> int:
        """The shard format version this file needs: 2 with derived storages, else 1."""
        return 2 if any(s.derived for s in self.storages) else 1

    def jobs(self) -> Iterator[_Job]:
        """Units of work in file order: one CPU chunk, or a batch of GPU chunks of one storage."""
        for i, (s, plan) in enumerate(zip(self.storages, self.plans)):
            chunks = [c for view in s.stored_views() for c in _chunk_views(view, self.chunk_bytes)]
            if plan.codec.device != "cuda":
                for c in chunks:
                    yield _Job(i, [c], plan)
                continue
            batch: list[torch.Tensor] = []
            for c in chunks:
                if batch and sum(b.numel() for b in batch) + c.numel() > self.gpu_batch_bytes:
                    yield _Job(i, batch, plan)
                    batch = []
                batch.append(c)
            if batch:
                yield _Job(i, batch, plan)


def prepare_shard(
    skeleton: bytes,
    tensors: list[torch.Tensor],
    keys: list[str],
    *,
    algorithm: str,
    portable: bool,
    chunk_bytes: int,
    writer_info: dict[str, Any],
    gpu_batch_bytes: int = 256 << 20,
    derive: Callable[[torch.Tensor], Sequence[derived.Piece]] | None = None,
) -> PreparedShard:
    """Group tensors into storages and choose each storage's codec and transform.

    `derive(tensor)` says which elements of a tensor other files of the checkpoint hold (the
    caller checked them, `derived.same_after_cast`); those bytes are not written but recorded as
    derived ranges of the tensor's storage (`container.DerivedRange`).
    """
    if chunk_bytes < _ALIGN or chunk_bytes > container.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size {chunk_bytes} is outside [{_ALIGN}, {container.MAX_CHUNK_BYTES}] bytes")
    storages, entries = group_storages(tensors, keys)
    if derive is not None:
        _mark_derived(storages, entries, tensors, derive)
    return PreparedShard(skeleton, storages, _choose_plans(storages, entries, algorithm, portable), entries,
                         chunk_bytes - chunk_bytes % _ALIGN, max(gpu_batch_bytes, chunk_bytes), writer_info)


def _choose_plans(storages: list[_Storage], entries: list[TensorEntry], algorithm: str,
                  portable: bool) -> list[Plan]:
    """Each storage's plan: among its dtype's candidates, the one that codes a sample of it
    smallest, chosen once per role of the file (`selection`).

    The candidates (and their codec objects) are made once per (dtype, device type) for the
    whole shard: nvCOMP codecs own CUDA streams and scratch worth creating once, not once per
    parameter. A role's choice is kept once it was made on a storage large enough to sample.
    """
    first_key: dict[int, str] = {}
    for entry in entries:
        first_key.setdefault(entry.storage, entry.key)
    candidates: dict[tuple[torch.dtype, str], list[Plan]] = {}
    chosen: dict[tuple[str, torch.dtype, str], Plan] = {}
    plans = []
    for i, s in enumerate(storages):
        kind = (s.dtype, s.source.device.type)
        if kind not in candidates:
            candidates[kind] = candidates_for(s.dtype, s.source.device, algorithm=algorithm, portable=portable)
        role = (selection.role(first_key.get(i, "")), *kind)
        if role in chosen:
            plans.append(chosen[role])
            continue
        span = max(s.stored_views(), key=lambda view: view.numel(), default=None)
        if span is None:  # nothing stored (empty, or wholly derived)
            plans.append(candidates[kind][0])
            continue
        plans.append(selection.choose(candidates[kind], span))
        if span.numel() >= selection.MIN_SAMPLED_BYTES:
            chosen[role] = plans[-1]
    return plans


def _mark_derived(storages: list[_Storage], entries: list[TensorEntry], tensors: list[torch.Tensor],
                  derive: Callable[[torch.Tensor], Sequence[derived.Piece]]) -> None:
    """Record in each storage the ranges `derive` says other files hold (see `prepare_shard`).

    Only contiguous tensors are derived; a storage whose ranges would overlap other than exactly
    (tensors viewing the same elements) keeps all its bytes.
    """
    wanted: dict[int, list[DerivedRange]] = collections.defaultdict(list)
    for t, entry in zip(tensors, entries):
        pieces = derive(t)
        if pieces and t.is_contiguous():
            base = entry.offset * t.element_size()
            wanted[entry.storage].extend(derived.storage_ranges(base, t.dtype, pieces))
    for i, ranges in wanted.items():
        merged = derived.merge_ranges(ranges)
        if merged is None:
            logger.debug("storage %d: derived ranges overlap; stored whole", i)
            continue
        storages[i].derived = merged


class _Encoder:
    """Starts jobs: CPU jobs in the pool; GPU jobs on the calling thread (nvCOMP needs no
    Python parallelism), their checksums in the pool. Returns futures in submission order."""

    def __init__(self, pool: cf.Executor) -> None:
        self.pool = pool

    def start(self, job: _Job) -> cf.Future[list[_Encoded]]:
        if job.plan.codec.device == "cuda":
            return _encode_gpu(job, self.pool)
        return self.pool.submit(_encode_cpu, job)


def _write_file(
    prepared: PreparedShard,
    path: str | os.PathLike,
    encoded: Iterator[tuple[int, int, cf.Future[list[_Encoded]]]],
    *,
    durable: bool,
    direct: bool,
    max_inflight: int,
) -> ShardInfo:
    """Write the shard from encoded units (storage, raw bytes, future), appending on a writer
    thread while the caller's iterator keeps encoding. At most `max_inflight` units, and
    `_STAGED_BATCHES` GPU batches' worth of raw bytes, wait to be written: that bounds the
    pinned host memory holding encoded GPU payloads (the iterator encodes one more unit)."""
    writer = container.ShardWriter(path, durable=durable, direct=direct, version=prepared.version)
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
                writer.append_chunk(idx, enc.payload, raw_length=enc.raw_length,
                                    stored_raw=enc.stored_raw, crc32=enc.crc32)
        finally:
            staging.METER.give(sum(enc.staged for enc in encoded_chunks))

    try:
        writer.write_skeleton(prepared.skeleton)
        with cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-write") as write_pool:
            pending: collections.deque[tuple[cf.Future[None], int]] = collections.deque()
            held, budget = 0, _STAGED_BATCHES * prepared.gpu_batch_bytes
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
    return ShardInfo(os.fspath(path), prepared.raw_bytes, size, crc, codecs)


def write_prepared(
    prepared: PreparedShard, path: str | os.PathLike, *, durable: bool, direct: bool = False,
    workers: int | None = None,
) -> ShardInfo:
    """Encode and write `prepared` now: the synchronous save, with bounded staging memory."""
    workers = workers or default_workers()
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-encode") as pool:
        encoder = _Encoder(pool)
        encoded = ((job.storage, job.nbytes, encoder.start(job)) for job in prepared.jobs())
        return _write_file(prepared, path, encoded, durable=durable, direct=direct,
                           max_inflight=2 * workers)


@dataclass
class StagedShard:
    """What an asynchronous save captured before returning to training.

    GPU storages are already compressed and in host memory; CPU storages are snapshotted (copied)
    and compressed while the file is written. `complete` is false when the host-memory budget ran
    out: then `rest` still refers to live tensors and must be written before training resumes.
    """

    prepared: PreparedShard
    captured: list[tuple[int, cf.Future[list[_Encoded]] | _Job]]
    held_bytes: int
    rest: Iterator[_Job] | None
    #: GPU payload bytes whose copy to host memory started only as `stage` returned.
    device_bytes: int = 0

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
    captured: list[tuple[int, cf.Future[list[_Encoded]] | _Job]] = []
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
        return StagedShard(prepared, captured, held, None, device_bytes=device_bytes)
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

    return _write_file(staged.prepared, path, encoded(), durable=durable, direct=direct,
                       max_inflight=2 * workers)


# ----------------------------------------------------------------------------- loading


def _read_range(fd: int, offset: int, length: int, *, pinned: bool, path: str) -> torch.Tensor:
    """Read `length` bytes at `offset` straight into a new (pinned, for the GPU) host tensor:
    staging, which the caller gives back to `staging.METER` once it has used the bytes."""
    host = torch.empty(staging.METER.take(length), dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(host.numpy()).cast("B") if length else memoryview(b"")
    done = 0
    while done < length:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CorruptCheckpointError(f"{path}: file ends at byte {offset + done}, inside a "
                                         f"chunk that the index places up to byte {offset + length}")
        done += got
    return host


def _check(index: ShardIndex, storage: int, first: int, blobs: tuple[Blob, ...], host: torch.Tensor,
           verify: bool) -> None:
    """Verify the CRC-32 of each blob inside `host` (which starts at blobs[0].offset)."""
    if not verify:
        return
    base = blobs[0].offset
    data = memoryview(host.numpy()).cast("B") if host.numel() else memoryview(b"")
    for j, blob in enumerate(blobs):
        if zlib.crc32(data[blob.offset - base : blob.offset - base + blob.length]) != blob.crc32:
            raise CorruptCheckpointError(
                f"{index.path}: checksum mismatch in {container.chunk_name(index, storage, first + j)} "
                f"(bytes {blob.offset}..{blob.offset + blob.length})"
            )


#: Reads in flight at once for GPU batches: parallel reads keep a file system's queues full.
_READERS = 4
#: GPU batches' bytes read (or being read) ahead of the decoder, at most, in batches of the
#: reader's size (1 GiB at the default 256 MiB; at least one batch).
_READ_AHEAD_BATCHES = 4
#: Decoded GPU batches on their way into host memory at once (see `_ShardReader`).
_COPY_AHEAD = 2


def _element(dtype_name: str) -> str:
    return element_of(DTYPES[dtype_name])


@dataclass(frozen=True)
class _Batch:
    """Consecutive chunks of one storage, read and decoded together."""

    first: int
    blobs: tuple[Blob, ...]
    out_start: int

    @property
    def raw(self) -> int:
        return sum(b.raw_length for b in self.blobs)

    @property
    def stored(self) -> int:
        return sum(b.length for b in self.blobs)


def _batches(entry: StorageEntry, limit: int, first_chunk: int = 0) -> list[_Batch]:
    """`entry`'s chunks in batches of at most `limit` raw bytes (and one chunk at least);
    `first_chunk` is the number of entry's first chunk in its storage (for error messages)."""
    batches: list[_Batch] = []
    current: list[Blob] = []
    first, out_start, start = first_chunk, 0, 0
    for j, blob in enumerate(entry.chunks, start=first_chunk):
        if current and sum(b.raw_length for b in current) + blob.raw_length > limit:
            batches.append(_Batch(first, tuple(current), start))
            first, start, current = j, out_start, []
        current.append(blob)
        out_start += blob.raw_length
    if current:
        batches.append(_Batch(first, tuple(current), start))
    return batches


@dataclass
class _Target:
    """One storage being loaded: its index entry, codec and destination tensor.

    `stored` receives the decoded chunks: `out` itself, or, for a storage with derived ranges,
    a buffer of the bytes the file holds, spread into `out` around the ranges afterwards
    (`place_stored`).
    """

    i: int
    entry: StorageEntry
    codec: Codec
    width: int
    element: str
    out: torch.Tensor
    stored: torch.Tensor
    #: The number of `entry`'s first chunk in the storage (`entry` may be a run of its chunks).
    first_chunk: int = 0

    def place_stored(self) -> None:
        if self.stored is self.out:
            return
        pos = 0
        for a, b in self.entry.stored_pieces():
            self.out[a:b].copy_(self.stored[pos : pos + b - a])
            pos += b - a

    @property
    def gpu(self) -> torch.device:
        """The GPU that decodes this storage (its destination's, or the current one)."""
        return self.out.device if self.out.is_cuda else torch.device("cuda", torch.cuda.current_device())


def _copy_to_host(ready: torch.cuda.Event, pinned: torch.Tensor, out: torch.Tensor) -> None:
    ready.synchronize()
    out.copy_(pinned)
    staging.METER.give(pinned.numel())


class _ShardReader:
    """Reads, verifies and decodes storages of one shard into new tensors, in file order.

    nvCOMP-coded storages go through one pipeline for the whole shard: batches of chunks are
    read ahead into pinned memory (up to `_READ_AHEAD_BATCHES` batches, across storage
    boundaries, so a file of many small tensors pipelines too) by `_READERS` I/O threads that
    only read — their
    checksums run in the pool — then copied to the GPU and decoded there. A destination on the GPU
    receives the decoded bytes directly; a destination in host memory receives them through a
    batch-sized GPU buffer and a pinned buffer, and the last copy, into the destination, runs in
    the pool: torch copies on several cores there, so the page faults of freshly allocated host
    memory are taken in parallel. (A device-to-pageable copy takes them on one thread, and at
    the speed of first-touch page faults: 1.2 GB/s on the H200 host, slower than the disk.)
    CPU-coded storages are decoded one chunk per pool job, on every core.
    """

    def __init__(self, fd: int, index: ShardIndex, *, verify: bool, pool: cf.Executor,
                 batch_bytes: int, decoders: dict[tuple[str, bool], Codec]) -> None:
        self.fd, self.index, self.verify, self.pool = fd, index, verify, pool
        self.batch_bytes, self.decoders = batch_bytes, decoders

    def read(self, wanted: list[tuple[int, torch.device]]) -> list[torch.Tensor]:
        """Storages `wanted` as (index, destination device); returns one uint8 tensor each."""
        return self._read_targets([self._target(i, device) for i, device in wanted])

    def read_span(self, i: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Bytes [lo, hi) of storage `i`, decoding only the chunks that hold them: a uint8
        tensor that views a buffer of those whole chunks (at most two chunks more than asked)."""
        entry: StorageEntry = self.index.storages[i]
        if entry.derived:
            raise ValueError(f"{self.index.path}: storage {i} has derived ranges, which only a "
                             "whole load rebuilds; read it with nvcomp_ckpt_engine.load")
        if not 0 <= lo <= hi <= entry.nbytes:
            raise ValueError(f"{self.index.path}: bytes [{lo}, {hi}) are outside storage {i} "
                             f"({entry.nbytes} bytes)")
        if lo == hi:
            return torch.empty(0, dtype=torch.uint8, device=device)
        bounds = list(itertools.accumulate((c.raw_length for c in entry.chunks), initial=0))
        first = bisect.bisect_right(bounds, lo) - 1
        last = bisect.bisect_left(bounds, hi)
        run = replace(entry, nbytes=bounds[last] - bounds[first],
                                  chunks=entry.chunks[first:last])
        (buffer,) = self._read_targets([self._target(i, device, run, first)])
        return buffer[lo - bounds[first] : hi - bounds[first]]

    def _read_targets(self, targets: list[_Target]) -> list[torch.Tensor]:
        gpu_work = [(t, b) for t in targets if t.codec.device == "cuda"
                    for b in _batches(t.entry, self.batch_bytes, t.first_chunk)]
        cpu_jobs = [self.pool.submit(self._cpu_batch, t, b) for t in targets if t.codec.device != "cuda"
                    for b in _batches(t.entry, 1, t.first_chunk)]
        try:
            if gpu_work:
                with cf.ThreadPoolExecutor(_READERS, thread_name_prefix="nvckpt-read") as io:
                    self._run_gpu(gpu_work, io)
            for job in cpu_jobs:
                job.result()
        finally:
            for job in cpu_jobs:
                job.cancel()
        for t in targets:
            t.place_stored()
        return [t.out for t in targets]

    def _target(self, i: int, device: torch.device, entry: StorageEntry | None = None,
                first_chunk: int = 0) -> _Target:
        """Storage `i` (or `entry`, a run of its chunks from `first_chunk` on) to decode into a
        new tensor on `device`."""
        entry = self.index.storages[i] if entry is None else entry
        width = transforms.plane_width(entry.transform)
        key = (json.dumps(entry.codec, sort_keys=True), device.type == "cuda")
        if key not in self.decoders:
            try:
                self.decoders[key] = decoder_for(entry.codec, on_cuda=device.type == "cuda")
            except UnsupportedCheckpointError as exc:
                raise UnsupportedCheckpointError(f"{self.index.path}: storage {i}: {exc}") from exc
        try:
            out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
            stored = (torch.empty(entry.stored_nbytes, dtype=torch.uint8, device=device)
                      if entry.derived else out)
        except RuntimeError as exc:  # no memory for it there
            raise CheckpointError(
                f"{self.index.path}: cannot allocate {entry.nbytes} bytes on {device} for storage "
                f"{i} (saved on {entry.device}): {exc}. Pass map_location to load it elsewhere"
            ) from exc
        return _Target(i, entry, self.decoders[key], width, "u1" if width > 1 else _element(entry.dtype),
                       out, stored, first_chunk)

    def _load_batch(self, target: _Target, batch: _Batch, pinned: bool) -> torch.Tensor:
        """The batch's bytes, read and checked."""
        return self._checked(target, batch, self._read(batch, pinned))

    def _read(self, batch: _Batch, pinned: bool) -> torch.Tensor:
        if not batch.blobs:
            return torch.empty(0, dtype=torch.uint8)
        return _read_range(self.fd, batch.blobs[0].offset, batch.stored, pinned=pinned, path=self.index.path)

    def _checked(self, target: _Target, batch: _Batch, host: torch.Tensor) -> torch.Tensor:
        if batch.blobs:
            _check(self.index, target.i, batch.first, batch.blobs, host, self.verify)
        return host

    def _read_then_check(self, target: _Target, batch: _Batch) -> cf.Future[torch.Tensor]:
        """On an I/O thread: read into pinned memory, hand the checksums to the pool, read on."""
        return self.pool.submit(self._checked, target, batch, self._read(batch, True))

    def _decode(self, target: _Target, batch: _Batch, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Decode one batch's payload bytes (on `out`'s device) into `out`, the batch's bytes."""
        payloads, outs, planes = [], [], []
        pos = start = 0
        for blob in batch.blobs:
            piece, part = payload[pos : pos + blob.length], out[start : start + blob.raw_length]
            pos, start = pos + blob.length, start + blob.raw_length
            if blob.stored_raw:
                part.copy_(piece)
                continue
            payloads.append(piece)
            outs.append(part)
            planes.append(part if target.width == 1 else torch.empty_like(part))
        planes_held = sum(p.numel() for p in planes) if target.width > 1 and out.device.type == "cpu" else 0
        staging.METER.take(planes_held)
        try:
            self._decode_planes(target, batch, payloads, planes, outs)
        finally:
            staging.METER.give(planes_held)

    def _decode_planes(self, target: _Target, batch: _Batch, payloads: list[torch.Tensor],
                       planes: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        if payloads:
            try:
                target.codec.decode_batch(payloads, planes, element=target.element)
            except CodecError as exc:
                raise CorruptCheckpointError(
                    f"{self.index.path}: {container.chunk_name(self.index, target.i, batch.first)} "
                    f"(or a later chunk of its batch) does not decode: {exc}") from exc
        if target.width > 1:
            for p, part in zip(planes, outs):
                transforms.from_planes(p, target.width, part)

    def _cpu_batch(self, target: _Target, batch: _Batch) -> None:
        dest = target.stored[batch.out_start : batch.out_start + batch.raw]
        out = dest if dest.device.type == "cpu" else torch.empty(batch.raw, dtype=torch.uint8)
        try:
            self._decode(target, batch, self._load_batch(target, batch, False), out)
        finally:
            staging.METER.give(batch.stored)
        if out is not dest:
            dest.copy_(out)

    def _run_gpu(self, work: list[tuple[_Target, _Batch]], io: cf.Executor) -> None:
        copies: collections.deque[cf.Future[None]] = collections.deque()
        sent: collections.deque[tuple[torch.cuda.Event, int]] = collections.deque()
        reads = _read_ahead(work, lambda item: io.submit(self._read_then_check, *item),
                           size=lambda item: item[1].stored, limit=_READ_AHEAD_BATCHES * self.batch_bytes)
        try:
            for (target, batch), checked in zip(work, reads):
                host = checked.result()
                # The pinned read buffer goes back to torch's caching host allocator once the
                # copy to the GPU is done, so the next reads reuse it; its staging bytes are
                # given back then too.
                payload = host.to(target.gpu, non_blocking=True)
                _give_sent(sent, host.numel(), torch.cuda.current_stream(target.gpu))
                dest = target.stored[batch.out_start : batch.out_start + batch.raw]
                if dest.is_cuda:
                    self._decode(target, batch, payload, dest)
                    continue
                decoded = torch.empty(batch.raw, dtype=torch.uint8, device=target.gpu)
                self._decode(target, batch, payload, decoded)
                pinned = torch.empty(staging.METER.take(batch.raw), dtype=torch.uint8, pin_memory=True)
                pinned.copy_(decoded, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(target.gpu))
                copies.append(self.pool.submit(_copy_to_host, ready, pinned, dest))
                while len(copies) > _COPY_AHEAD:
                    copies.popleft().result()
            while copies:
                copies.popleft().result()
        finally:
            reads.close()  # cancels the reads not started yet
            for future in copies:
                future.cancel()
            for event, nbytes in sent:
                event.synchronize()
                staging.METER.give(nbytes)


def _give_sent(sent: collections.deque[tuple[torch.cuda.Event, int]], nbytes: int,
               stream: torch.cuda.Stream) -> None:
    """Note a read buffer of `nbytes` whose copy to the GPU was just queued on `stream`, and give
    back to `staging.METER` the buffers whose copies have finished."""
    event = torch.cuda.Event()
    event.record(stream)
    sent.append((event, nbytes))
    while sent and sent[0][0].query():
        staging.METER.give(sent.popleft()[1])


T = TypeVar("T")
R = TypeVar("R")


def _read_ahead(items: list[T], start: Callable[[T], cf.Future[R]], *, size: Callable[[T], int],
               limit: int) -> Generator[R, None, None]:
    """The results of `start(item)` for `items`, in order, each started ahead of its turn: at
    most `limit` bytes (`size(item)`) of items started and not yet consumed, and at least one.
    Closing the generator cancels the items that have not started."""
    ahead: collections.deque[cf.Future[R]] = collections.deque()
    queued = held = 0
    try:
        for item in items:
            while queued < len(items) and (not ahead or held + size(items[queued]) <= limit):
                ahead.append(start(items[queued]))
                held += size(items[queued])
                queued += 1
            result = ahead.popleft().result()
            held -= size(item)
            yield result
    finally:
        for future in ahead:
            future.cancel()


def read_storage(
    fd: int, index: ShardIndex, i: int, device: torch.device, *, verify: bool, pool: cf.Executor,
    batch_bytes: int = 256 << 20, decoders: dict[tuple[str, bool], Codec] | None = None,
) -> torch.Tensor:
    """Storage `i` of a shard, read from `fd` (positional reads: safe to share between threads),
    checked and decoded into a new uint8 tensor on `device`. For random access to a few tensors
    of a shard (the DCP reader, the source of a derived range) without decoding the rest.
    A storage that is itself derived from other files is refused: nothing writes such chains."""
    if index.storages[i].derived:
        raise CorruptCheckpointError(f"{index.path}: storage {i} is derived from other files and "
                                     "cannot be read on its own")
    reader = _ShardReader(fd, index, verify=verify, pool=pool, batch_bytes=batch_bytes,
                          decoders={} if decoders is None else decoders)
    return reader.read([(i, device)])[0]


def read_storage_span(
    fd: int, index: ShardIndex, i: int, lo: int, hi: int, device: torch.device, *, verify: bool,
    pool: cf.Executor, batch_bytes: int = 256 << 20,
    decoders: dict[tuple[str, bool], Codec] | None = None,
) -> torch.Tensor:
    """Bytes [lo, hi) of storage `i` as a uint8 tensor on `device`, decoding only the chunks
    that hold them (each checked first, as in `read_storage`): a part of a large tensor costs
    memory for that part and at most two chunks more, never for the whole storage."""
    reader = _ShardReader(fd, index, verify=verify, pool=pool, batch_bytes=batch_bytes,
                          decoders={} if decoders is None else decoders)
    return reader.read_span(i, lo, hi, device)


MapLocation = Any


def destination(location: str, map_location: MapLocation) -> torch.device | None:
    """Where a storage saved on `location` goes, as torch.load would put it (None: a callable
    map_location decides after decoding)."""
    if map_location is None:
        return _restorable(location)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return _restorable(map_location.get(location, location))
    if callable(map_location):
        return None
    raise TypeError(f"map_location must be None, a str, a torch.device, a dict or a callable, "
                    f"not {type(map_location).__name__}")


def _restorable(where: str | torch.device) -> torch.device:
    """The device `where` names if this process can allocate on it (a device the file names, or
    that a dict map_location maps it to); `UnsupportedCheckpointError` naming the way out
    otherwise."""
    try:
        device = torch.device(where)
    except RuntimeError as exc:  # a device type this torch does not know (npu without plugin)
        raise UnsupportedCheckpointError(
            f"the file holds tensors saved on {where!r}, a device this torch does not know "
            f"({exc}); load with map_location='cpu' (or another device)") from exc
    if device.type not in ("cpu", "cuda"):
        # xpu, mps, ...: torch's module for the type says; hpu and npu exist only with their
        # plugins (which add the module).
        available = getattr(getattr(torch, device.type, None), "is_available", None)
        if not callable(available) or not available():
            raise UnsupportedCheckpointError(
                f"the file holds tensors saved on {device}, and this process has no "
                f"{device.type} device; load with map_location='cpu' (or another device)"
            )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedCheckpointError(
                f"the file holds tensors saved on {device}, but CUDA is not available here; "
                "load with map_location='cpu' (or torch.device('cpu'))"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UnsupportedCheckpointError(
                f"the file holds tensors saved on {device}, but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); pass map_location")
    return device


#: `fill_derived(index, outs)`: writes the derived ranges of each storage `i` of `outs` into its
#: decoded span ``outs[i]`` (one call per file, after its chunks are decoded).
DerivedFiller = Callable[[ShardIndex, dict[int, torch.Tensor]], None]


def read_shard(
    path: str | os.PathLike,
    *,
    map_location: MapLocation,
    verify: bool,
    rebuild: Callable[[bytes, list[torch.Tensor]], Any],
    workers: int | None = None,
    gpu_batch_bytes: int = 256 << 20,
    index: ShardIndex | None = None,
    fill_derived: DerivedFiller | None = None,
    decoded: dict[int, torch.Tensor] | None = None,
) -> Any:
    """Read a shard and rebuild its object with `rebuild(skeleton, tensors)`.

    Storages with derived ranges get them from `fill_derived` (required then), on the device
    they were decoded to, before `map_location` moves them. `decoded` holds storages the caller
    decoded already (uint8 spans, by index; the DeepSpeed engine's own ZeRO partitions, read
    while it rebuilt the module): they are used as they are, not read again.
    """
    index = index or container.read_index(path)
    if fill_derived is None and any(entry.derived for entry in index.storages):
        raise CheckpointError(f"{index.path}: storages of this file are derived from other files "
                              "of its checkpoint; read it with nvcomp_ckpt_engine.load")
    decoded = decoded or {}
    fd = os.open(index.path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):  # the whole file is read front to back: read ahead more
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    try:
        with cf.ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="nvckpt-decode") as pool:
            with os.fdopen(os.dup(fd), "rb") as f:
                skeleton = container.read_skeleton(f, index, verify=verify)
            try:
                devices = [destination(entry.device, map_location) for entry in index.storages]
            except UnsupportedCheckpointError as exc:
                raise UnsupportedCheckpointError(f"{index.path}: {exc}") from exc
            reader = _ShardReader(fd, index, verify=verify, pool=pool, batch_bytes=gpu_batch_bytes,
                                  decoders={})
            wanted = [(i, device or torch.device("cpu")) for i, device in enumerate(devices)
                      if i not in decoded]
            buffers = dict(zip((i for i, _ in wanted), reader.read(wanted)))
            buffers.update((i, _checked_decoded(index, i, buf)) for i, buf in decoded.items())
            derived_outs = {i: buffers[i] for i, entry in enumerate(index.storages) if entry.derived}
            if derived_outs:
                fill_derived(index, derived_outs)  # type: ignore[misc]
            placed = [buffers[i] if devices[i] is not None
                      else _apply_callable(map_location, buffers[i], entry.device, index.path)
                      for i, entry in enumerate(index.storages)]
    finally:
        os.close(fd)
    return rebuild(skeleton, [view_tensor(placed[t.storage], t, index.path) for t in index.tensors])


def _checked_decoded(index: ShardIndex, i: int, buf: torch.Tensor) -> torch.Tensor:
    """A storage decoded ahead of time, checked against the index it is used with."""
    if i >= len(index.storages) or buf.dtype != torch.uint8 or buf.numel() != index.storages[i].nbytes:
        raise ValueError(f"{index.path}: a decoded storage {i} of {buf.numel()} bytes does not fit the index")
    return buf


def _apply_callable(map_location: Callable[..., Any], buf: torch.Tensor, location: str,
                    path: str) -> torch.Tensor:
    result = map_location(buf.untyped_storage(), location)
    if result is None:
        try:
            return buf.to(_restorable(location))
        except UnsupportedCheckpointError as exc:
            raise UnsupportedCheckpointError(f"{path}: {exc}") from exc
    return torch.empty(0, dtype=torch.uint8, device=result.device).set_(result)


def view_tensor(buf: torch.Tensor, entry: TensorEntry, path: str) -> torch.Tensor:
    """The tensor `entry` describes, as a view of `buf` (its decoded storage, or the part of it
    that starts at the tensor's first element when `entry.offset` is 0). The index was
    validated; whatever torch still refuses is named as a fault of the file `path`, not left as
    torch's error."""
    try:
        t = torch.empty(0, dtype=DTYPES[entry.dtype], device=buf.device)
        t.set_(buf.untyped_storage(), entry.offset, entry.shape, entry.stride)
        if entry.parameter:
            return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
        return t.requires_grad_(entry.requires_grad) if entry.requires_grad else t
    except RuntimeError as exc:
        raise CorruptCheckpointError(f"{path}: tensor {entry.key!r} cannot be rebuilt as the "
                                     f"index describes it: {exc}") from exc
