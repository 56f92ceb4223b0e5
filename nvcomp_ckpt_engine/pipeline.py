"""Chunked encode → device-to-host → write, and read → host-to-device → decode.

Saving: each storage's bytes are cut into chunks; a chunk is transformed (byte planes) and
encoded where its codec runs — nvCOMP on the tensor's GPU, or the CPU codecs in a thread pool —
and the writer appends finished chunks in file order while later chunks are still being
encoded, so encoding overlaps the writes. At most `max_inflight` chunks are in flight, which
bounds staging memory whatever the size of the state. A chunk that the codec does not make
smaller is stored as it is, so no file is ever larger than its raw data plus the index.

Loading is the mirror: chunks are read and checksummed, decoded in the pool (or on the GPU)
straight into the destination storage, and the tensors are rebuilt as views of it, which keeps
storage sharing and strides exactly as saved.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from . import container, transforms
from .codecs import Codec, Plan, decoder_for, plan_for
from .container import DTYPE_NAMES, DTYPES, Blob, ShardIndex, StorageEntry, TensorEntry
from .errors import CodecError, CorruptCheckpointError

#: Chunk sizes are multiples of this, so every element width (1..16 bytes) divides them.
_ALIGN = 16


def default_workers() -> int:
    """CPU codec threads: every core, since zstd and zlib release the GIL while they work."""
    return max(1, min(8, os.cpu_count() or 1))


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
    """A storage to save: the span of it the tensors view, and those tensors."""

    source: torch.Tensor  # a tensor whose untyped storage this is
    lo: int
    hi: int
    dtypes: set[torch.dtype]

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.dtypes)) if len(self.dtypes) == 1 else torch.uint8

    def bytes_view(self) -> torch.Tensor:
        """The span as a 1-D uint8 tensor over the same memory (no copy)."""
        view = torch.empty(0, dtype=torch.uint8, device=self.source.device)
        return view.set_(self.source.untyped_storage(), self.lo, (self.hi - self.lo,), (1,))


def _extent(t: torch.Tensor) -> int:
    """Elements from the tensor's storage offset to one past its last element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _check_saveable(t: torch.Tensor, key: str) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"tensor {key!r} is a {type(t).__name__}; nvcomp_ckpt_engine.save stores "
                        "plain tensors and nn.Parameter (convert subclasses such as DTensor first)")
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise TypeError(f"tensor {key!r} ({t.layout}, {t.device}) is not a dense strided tensor "
                        "with data; nvcomp_ckpt_engine.save cannot store it")
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which the format does not list")


def group_storages(tensors: list[torch.Tensor], keys: list[str]) -> tuple[list[_Storage], list[TensorEntry]]:
    """Group tensors by the storage they view; each storage is stored once (its used span)."""
    storages: list[_Storage] = []
    by_key: dict[tuple[str, int], int] = {}
    placed: list[tuple[int, int]] = []  # (storage index, byte start) per tensor
    for t, key in zip(tensors, keys):
        _check_saveable(t, key)
        itemsize = t.element_size()
        start = t.storage_offset() * itemsize
        end = start + _extent(t) * itemsize
        ident = (str(t.device), t.untyped_storage().data_ptr()) if t.numel() else ("empty", id(t))
        if ident not in by_key:
            by_key[ident] = len(storages)
            storages.append(_Storage(t, start - start % _ALIGN, end, {t.dtype}))
        s = storages[by_key[ident]]
        s.lo, s.hi = min(s.lo, start - start % _ALIGN), max(s.hi, end)
        s.dtypes.add(t.dtype)
        placed.append((by_key[ident], start))
    entries = [
        TensorEntry(key, idx, DTYPE_NAMES[t.dtype], tuple(t.shape), tuple(t.stride()),
                    (start - storages[idx].lo) // t.element_size(), t.requires_grad,
                    isinstance(t, torch.nn.Parameter))
        for t, key, (idx, start) in zip(tensors, keys, placed)
    ]
    return storages, entries


@dataclass(frozen=True)
class _Encoded:
    payload: memoryview
    raw_length: int
    crc32: int
    stored_raw: bool


def _host_bytes(t: torch.Tensor) -> memoryview:
    host = t if t.device.type == "cpu" else t.cpu()
    return memoryview(host.contiguous().numpy()).cast("B")


def _encode_chunks(plan: Plan, chunks: list[torch.Tensor]) -> list[_Encoded]:
    """Transform and encode chunks on the codec's device; keep a chunk raw if it did not shrink."""
    device = "cuda" if plan.codec.device == "cuda" else "cpu"
    moved = [c if c.device.type == device else c.to(device) for c in chunks]
    planes = [transforms.to_planes(c, plan.width) for c in moved]
    try:
        payloads = plan.codec.encode_batch(planes, element=plan.element)
    except CodecError:
        raise
    except Exception as exc:  # nvCOMP and zstd raise their own types; name the codec
        raise CodecError(f"{plan.codec.name} failed to encode: {exc}") from exc
    out = []
    for chunk, payload in zip(moved, payloads):
        stored_raw = payload.numel() >= chunk.numel()
        data = _host_bytes(chunk if stored_raw else payload)
        out.append(_Encoded(data, chunk.numel(), zlib.crc32(data), stored_raw))
    return out


def _chunk_views(span: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return [span[i : i + chunk_bytes] for i in range(0, span.numel(), chunk_bytes)]


def _encode_jobs(
    storages: list[_Storage], plans: list[Plan], chunk_bytes: int, gpu_batch_bytes: int
) -> Iterator[tuple[int, list[torch.Tensor], Plan]]:
    """Units of work in file order: one CPU chunk, or a batch of GPU chunks of one storage."""
    for i, (s, plan) in enumerate(zip(storages, plans)):
        chunks = _chunk_views(s.bytes_view(), chunk_bytes)
        if plan.codec.device != "cuda":
            for c in chunks:
                yield i, [c], plan
            continue
        batch: list[torch.Tensor] = []
        for c in chunks:
            if batch and sum(b.numel() for b in batch) + c.numel() > gpu_batch_bytes:
                yield i, batch, plan
                batch = []
            batch.append(c)
        if batch:
            yield i, batch, plan


def write_shard(
    path: str | os.PathLike,
    skeleton: bytes,
    tensors: list[torch.Tensor],
    keys: list[str],
    *,
    algorithm: str,
    portable: bool,
    chunk_bytes: int,
    durable: bool,
    writer_info: dict[str, Any],
    workers: int | None = None,
    gpu_batch_bytes: int = 256 << 20,
) -> ShardInfo:
    """Encode `tensors` and write them with `skeleton` as one shard file at `path`."""
    if chunk_bytes < _ALIGN or chunk_bytes > container.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size {chunk_bytes} is outside [{_ALIGN}, {container.MAX_CHUNK_BYTES}] bytes")
    chunk_bytes -= chunk_bytes % _ALIGN
    storages, entries = group_storages(tensors, keys)
    plans = [plan_for(s.dtype, s.source.device, algorithm=algorithm, portable=portable) for s in storages]
    workers = workers or default_workers()
    writer = container.ShardWriter(path, durable=durable)
    try:
        writer.write_skeleton(skeleton)
        declared = -1

        def declare_through(last: int) -> None:
            """Declare storages up to `last` (storages without chunks have no job of their own)."""
            nonlocal declared
            for idx in range(declared + 1, last + 1):
                s, plan = storages[idx], plans[idx]
                writer.begin_storage(
                    nbytes=s.hi - s.lo, dtype=DTYPE_NAMES[s.dtype], device=str(s.source.device),
                    codec=plan.codec.descriptor(),
                    transform=transforms.byteplanes(plan.width) if plan.width > 1 else transforms.NONE,
                )
            declared = max(declared, last)

        with cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-encode") as pool:
            window: collections.deque[tuple[int, cf.Future[list[_Encoded]]]] = collections.deque()

            def drain_one() -> None:
                idx, future = window.popleft()
                declare_through(idx)
                for enc in future.result():
                    writer.append_chunk(idx, enc.payload, raw_length=enc.raw_length,
                                        stored_raw=enc.stored_raw, crc32=enc.crc32)

            for idx, batch, plan in _encode_jobs(storages, plans, chunk_bytes, gpu_batch_bytes):
                if plan.codec.device == "cuda":
                    done: cf.Future[list[_Encoded]] = cf.Future()
                    done.set_result(_encode_chunks(plan, batch))
                    window.append((idx, done))
                else:
                    window.append((idx, pool.submit(_encode_chunks, plan, batch)))
                while len(window) > 2 * workers:
                    drain_one()
            while window:
                drain_one()
        declare_through(len(storages) - 1)
        size, crc = writer.finish(entries, writer_info)
    except BaseException:
        writer.abort()
        raise
    raw = sum(s.hi - s.lo for s in storages) + len(skeleton)
    return ShardInfo(os.fspath(path), raw, size, crc, tuple(sorted({p.codec.name for p in plans})))


# ----------------------------------------------------------------------------- loading


def _decode_storage(
    f: Any, index: ShardIndex, i: int, device: torch.device, *, verify: bool, pool: cf.Executor
) -> torch.Tensor:
    """Read, check and decode storage `i` of `index` into a new uint8 tensor on `device`."""
    entry: StorageEntry = index.storages[i]
    width = transforms.plane_width(entry.transform)
    if entry.nbytes % width:
        raise CorruptCheckpointError(f"{index.path}: storage {i} is not a whole number of "
                                     f"{width}-byte elements")
    codec = decoder_for(entry.codec, on_cuda=device.type == "cuda")
    decode_device = torch.device("cpu") if codec.device == "cpu" else (
        device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device()))
    element = "u1" if width > 1 else _element(entry.dtype)
    out = torch.empty(entry.nbytes, dtype=torch.uint8, device=decode_device)
    start = 0
    jobs = []
    for c, blob in enumerate(entry.chunks):
        what = container.chunk_name(index, i, c)
        data = container.read_blob(f, blob, path=index.path, what=what, verify=verify)
        target = out[start : start + blob.raw_length]
        start += blob.raw_length
        if codec.device == "cuda":
            _decode_chunk(codec, data, blob, target, width, element, what, index.path)
        else:
            jobs.append(pool.submit(_decode_chunk, codec, data, blob, target, width, element, what, index.path))
    for job in jobs:
        job.result()
    return out if out.device == device else out.to(device)


def _element(dtype_name: str) -> str:
    from .codecs.base import element_of

    return element_of(DTYPES[dtype_name])


def _decode_chunk(codec: Codec, data: bytes, blob: Blob, target: torch.Tensor, width: int,
                  element: str, what: str, path: str) -> None:
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    payload = payload.to(target.device)
    if blob.stored_raw:
        target.copy_(payload)
        return
    planes = target if width == 1 else torch.empty_like(target)
    try:
        codec.decode_batch([payload], [planes], element=element)
    except CodecError as exc:
        raise CorruptCheckpointError(f"{path}: {what} does not decode: {exc}") from exc
    if width > 1:
        transforms.from_planes(planes, width, target)


MapLocation = Any


def destination(location: str, map_location: MapLocation) -> torch.device | None:
    """Where a storage saved on `location` goes, as torch.load would put it (None: a callable
    map_location decides after decoding)."""
    if map_location is None:
        return _restorable(torch.device(location))
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        mapped = map_location.get(location, location)
        return _restorable(torch.device(mapped))
    if callable(map_location):
        return None
    raise TypeError(f"map_location must be None, a str, a torch.device, a dict or a callable, "
                    f"not {type(map_location).__name__}")


def _restorable(device: torch.device) -> torch.device:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"the file holds tensors saved on {device}, but CUDA is not available here; "
                "load with map_location='cpu' (or torch.device('cpu'))"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"the file holds tensors saved on {device}, but this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s); pass map_location")
    return device


def read_shard(
    path: str | os.PathLike,
    *,
    map_location: MapLocation,
    verify: bool,
    rebuild: Callable[[bytes, list[torch.Tensor]], Any],
    workers: int | None = None,
) -> Any:
    """Read a shard and rebuild its object with `rebuild(skeleton, tensors)`."""
    index = container.read_index(path)
    with open(index.path, "rb") as f, cf.ThreadPoolExecutor(
        workers or default_workers(), thread_name_prefix="nvckpt-decode"
    ) as pool:
        skeleton = container.read_skeleton(f, index, verify=verify)
        buffers = []
        for i, entry in enumerate(index.storages):
            device = destination(entry.device, map_location)
            buf = _decode_storage(f, index, i, device or torch.device("cpu"), verify=verify, pool=pool)
            if device is None:
                buf = _apply_callable(map_location, buf, entry.device)
            buffers.append(buf)
    return rebuild(skeleton, [_view(buffers[t.storage], t) for t in index.tensors])


def _apply_callable(map_location: Callable[..., Any], buf: torch.Tensor, location: str) -> torch.Tensor:
    result = map_location(buf.untyped_storage(), location)
    if result is None:
        return buf.to(_restorable(torch.device(location)))
    return torch.empty(0, dtype=torch.uint8, device=result.device).set_(result)


def _view(buf: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    t = torch.empty(0, dtype=DTYPES[entry.dtype], device=buf.device)
    t.set_(buf.untyped_storage(), entry.offset, entry.shape, entry.stride)
    if entry.parameter:
        return torch.nn.Parameter(t, requires_grad=entry.requires_grad)
    return t.requires_grad_(entry.requires_grad) if entry.requires_grad else t
