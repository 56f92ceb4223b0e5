"""Read → host-to-device → decode: a shard's storages, whole or in parts, into new tensors.

Chunks are read ahead and checksummed, decoded in the pool (or on the GPU) into the destination
storage — through batch-sized staging buffers only, never a full-size intermediate copy — and the
tensors are rebuilt as views of it (`map_location.view_tensor`), which keeps storage sharing and
strides exactly as saved. What is read ahead at once is bounded (`bounds`).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures as cf
import itertools
import json
import os
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, TypeVar

import torch

from .. import container, formats, staging, transforms
from ..codecs import Codec, decoder_for
from ..codecs.base import element_of
from ..container import DTYPES, Blob, ShardIndex, StorageEntry
from ..storage import Reader, ShortReadError, locations
from ..errors import CheckpointError, CodecError, CorruptCheckpointError, UnsupportedCheckpointError
from .bounds import COPY_AHEAD, READ_AHEAD_BATCHES, default_workers
from .map_location import MapLocation, apply_callable, destination, view_tensor


def _read_range(reader: Reader, offset: int, length: int, *, pinned: bool, path: str) -> torch.Tensor:
    """Read `length` bytes at `offset` straight into a new (pinned, for the GPU) host tensor:
    staging, which the caller gives back to `staging.METER` once it has used the bytes."""
    host = torch.empty(staging.METER.take(length), dtype=torch.uint8, pin_memory=pinned)
    if length:
        try:
            reader.read_into(offset, memoryview(host.numpy()).cast("B"))
        except ShortReadError as exc:
            raise CorruptCheckpointError(f"{path}: file ends at byte {exc.end}, inside a chunk "
                                         f"that the index places up to byte {offset + length}") from None
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


def _stored_bytes(entry: StorageEntry) -> int:
    """The bytes `entry`'s chunks take in the file: what they were written from."""
    return sum(c.length for c in entry.chunks)


def _implausible(entry: StorageEntry) -> bool:
    """True when `entry` declares more bytes than its chunks plausibly hold
    (`formats.plausible_raw`): they must then decode that far before it is allocated."""
    return entry.stored_nbytes > formats.plausible_raw(_stored_bytes(entry))


def _copy_to_host(ready: torch.cuda.Event, pinned: torch.Tensor, out: torch.Tensor) -> None:
    ready.synchronize()
    out.copy_(pinned)
    staging.METER.give(pinned.numel())


class _ShardReader:
    """Reads, verifies and decodes storages of one shard into new tensors, in file order.

    nvCOMP-coded storages go through one pipeline for the whole shard: batches of chunks are
    read ahead into pinned memory (up to `READ_AHEAD_BATCHES` batches, across storage
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

    def __init__(self, reader: Reader, index: ShardIndex, *, verify: bool, pool: cf.Executor,
                 batch_bytes: int, decoders: dict[tuple[str, bool], Codec]) -> None:
        self.reader, self.index, self.verify, self.pool = reader, index, verify, pool
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
        new tensor on `device`. A storage declaring more than its stored bytes plausibly hold
        (`formats.plausible_raw`) is allocated only once its chunks have proven it (`_prove`)."""
        entry = self.index.storages[i] if entry is None else entry
        target = self._target_maker(i, entry, device)
        if _implausible(entry):
            self._prove(i, entry, first_chunk, device, target)
        return target(entry, first_chunk, self._allocate(i, entry, device))

    def prove(self, i: int, device: torch.device) -> None:
        """Prove storage `i` by decoding (`_prove`) if it declares more than its stored bytes
        plausibly hold; allocate nothing for it beyond that scratch."""
        entry = self.index.storages[i]
        if _implausible(entry):
            self._prove(i, entry, 0, device, self._target_maker(i, entry, device))

    def _target_maker(self, i: int, entry: StorageEntry, device: torch.device
                      ) -> Callable[[StorageEntry, int, tuple[torch.Tensor, torch.Tensor]], _Target]:
        """What makes the `_Target`s of storage `i`'s chunks (all of `entry`, or runs of it)."""
        width = formats.plane_width(entry.transform)
        codec = self._decoder(i, entry, device)
        element = "u1" if width > 1 else _element(entry.dtype)

        def target(part: StorageEntry, first: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> _Target:
            return _Target(i, part, codec, width, element, *buffers, first)

        return target

    def _decoder(self, i: int, entry: StorageEntry, device: torch.device) -> Codec:
        """The codec object that decodes `entry`'s chunks for `device`, made once per reader."""
        key = (json.dumps(entry.codec, sort_keys=True), device.type == "cuda")
        if key not in self.decoders:
            try:
                self.decoders[key] = decoder_for(entry.codec, on_cuda=device.type == "cuda")
            except UnsupportedCheckpointError as exc:
                raise UnsupportedCheckpointError(f"{self.index.path}: storage {i}: {exc}") from exc
        return self.decoders[key]

    def _allocate(self, i: int, entry: StorageEntry, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`entry`'s destination on `device`, and the buffer its chunks decode into (the
        destination itself, or for derived ranges a buffer of the bytes the file holds)."""
        try:
            out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
            stored = (torch.empty(entry.stored_nbytes, dtype=torch.uint8, device=device)
                      if entry.derived else out)
        except RuntimeError as exc:  # no memory for it there
            raise CheckpointError(
                f"{self.index.path}: cannot allocate {entry.nbytes} bytes on {device} for storage "
                f"{i} (saved on {entry.device}): {exc}. Pass map_location to load it elsewhere"
            ) from exc
        return out, stored

    def _prove(self, i: int, entry: StorageEntry, first_chunk: int, device: torch.device,
               target: Callable[[StorageEntry, int, tuple[torch.Tensor, torch.Tensor]], _Target]) -> None:
        """Decode storage `i`'s chunks (`entry`'s, from `first_chunk` on; `target` makes their
        `_Target`s) in runs, into scratch that is then dropped, so that a file cannot make the
        reader allocate what its bytes do not decode to: each run is at most what the
        storage's stored bytes plausibly hold (or one chunk), and every chunk must decode to
        exactly its declared size (else `CorruptCheckpointError` naming it) before the storage
        is allocated and decoded for real. Honest float data never comes here; zero-filled
        buffers do, and decode twice (fast: they are what codes smallest)."""
        budget = formats.plausible_raw(_stored_bytes(entry))
        for run in _batches(entry, budget, first_chunk):
            part = replace(entry, nbytes=run.raw, chunks=run.blobs, derived=())
            self._read_targets([target(part, run.first, self._allocate(i, part, device))])

    def _load_batch(self, target: _Target, batch: _Batch, pinned: bool) -> torch.Tensor:
        """The batch's bytes, read and checked."""
        return self._checked(target, batch, self._read(batch, pinned))

    def _read(self, batch: _Batch, pinned: bool) -> torch.Tensor:
        if not batch.blobs:
            return torch.empty(0, dtype=torch.uint8)
        return _read_range(self.reader, batch.blobs[0].offset, batch.stored, pinned=pinned, path=self.index.path)

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
                           size=lambda item: item[1].stored, limit=READ_AHEAD_BATCHES * self.batch_bytes)
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
                while len(copies) > COPY_AHEAD:
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
    reader: Reader, index: ShardIndex, i: int, device: torch.device, *, verify: bool, pool: cf.Executor,
    batch_bytes: int = 256 << 20, decoders: dict[tuple[str, bool], Codec] | None = None,
) -> torch.Tensor:
    """Storage `i` of a shard, read through `reader` (ranged reads: safe to share between threads),
    checked and decoded into a new uint8 tensor on `device`. For random access to a few tensors
    of a shard (the DCP reader, the source of a derived range) without decoding the rest.
    A storage that is itself derived from other files is refused: nothing writes such chains."""
    if index.storages[i].derived:
        raise CorruptCheckpointError(f"{index.path}: storage {i} is derived from other files and "
                                     "cannot be read on its own")
    shard = _ShardReader(reader, index, verify=verify, pool=pool, batch_bytes=batch_bytes,
                         decoders={} if decoders is None else decoders)
    return shard.read([(i, device)])[0]


def prove_storage(reader: Reader, index: ShardIndex, i: int, device: torch.device, *, verify: bool,
                  pool: cf.Executor) -> None:
    """Decode storage `i`'s chunks into dropped scratch if it declares more than they plausibly
    hold, so that what is allocated on the word of its index (another file's derived ranges)
    is proven first: a chunk that does not decode to its declared size is a
    `CorruptCheckpointError` naming it. Nothing is decoded for a plausible storage."""
    _ShardReader(reader, index, verify=verify, pool=pool, batch_bytes=256 << 20, decoders={}).prove(i, device)


def read_storage_span(
    reader: Reader, index: ShardIndex, i: int, lo: int, hi: int, device: torch.device, *, verify: bool,
    pool: cf.Executor, batch_bytes: int = 256 << 20,
    decoders: dict[tuple[str, bool], Codec] | None = None,
) -> torch.Tensor:
    """Bytes [lo, hi) of storage `i` as a uint8 tensor on `device`, decoding only the chunks
    that hold them (each checked first, as in `read_storage`): a part of a large tensor costs
    memory for that part and at most two chunks more, never for the whole storage."""
    shard = _ShardReader(reader, index, verify=verify, pool=pool, batch_bytes=batch_bytes,
                         decoders={} if decoders is None else decoders)
    return shard.read_span(i, lo, hi, device)


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
    source = locations.open_reader(index.path)
    source.advise_sequential()  # the whole file is read front to back: read ahead more
    try:
        with cf.ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="nvckpt-decode") as pool:
            skeleton = container.read_skeleton(source, index, verify=verify)
            try:
                devices = [destination(entry.device, map_location) for entry in index.storages]
            except UnsupportedCheckpointError as exc:
                raise UnsupportedCheckpointError(f"{index.path}: {exc}") from exc
            reader = _ShardReader(source, index, verify=verify, pool=pool, batch_bytes=gpu_batch_bytes,
                                  decoders={})
            wanted = [(i, device or torch.device("cpu")) for i, device in enumerate(devices)
                      if i not in decoded]
            buffers = dict(zip((i for i, _ in wanted), reader.read(wanted)))
            buffers.update((i, _checked_decoded(index, i, buf)) for i, buf in decoded.items())
            derived_outs = {i: buffers[i] for i, entry in enumerate(index.storages) if entry.derived}
            if derived_outs:
                fill_derived(index, derived_outs)  # type: ignore[misc]
            placed = [buffers[i] if devices[i] is not None
                      else apply_callable(map_location, buffers[i], entry.device, index.path)
                      for i, entry in enumerate(index.storages)]
    finally:
        source.close()
    return rebuild(skeleton, [view_tensor(placed[t.storage], t, index.path) for t in index.tensors])


def _checked_decoded(index: ShardIndex, i: int, buf: torch.Tensor) -> torch.Tensor:
    """A storage decoded ahead of time, checked against the index it is used with."""
    if i >= len(index.storages) or buf.dtype != torch.uint8 or buf.numel() != index.storages[i].nbytes:
        raise ValueError(f"{index.path}: a decoded storage {i} of {buf.numel()} bytes does not fit the index")
    return buf
