"""The DCP reader: items read by key from the rank files, decoding only the spans they view.

`NvcompFileSystemReader` is DCP's `FileSystemReader` with `read_data` and `read_metadata`
replaced (``.metadata`` checked, then unpickled through the allowlist), so DCP's planning and
resharding stay DCP's own. DCP's planner reads a bytes item (a value that is not a tensor, which
its save planner stored as ``torch.save`` bytes) with ``torch.load(weights_only=False)``; the
planner is handed only what `torchsave.safe_bytes` made of it: the value read through the
allowlist, saved again. A shard file's JSON index names every item, so a read decodes
only the stored spans that the requested items view (random access), never the whole file:
loading only the model out of a model+optimizer checkpoint, or resharding N→M, reads what it
needs. `RankFile` and `check_item` are shared with the tools (verify, decompress). Loading runs
no code from the shard files or ``.metadata``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import io
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import container, manifest_files, opened, pipeline, state, torchsave
from ..lazy import contiguous_strides
from ..options import DEFAULT_GPU_BATCH_MB
from ..container import DTYPES, ShardIndex, TensorEntry
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from .integrity import checked_metadata_bytes, checked_rank_file, open_dcp_checkpoint
from .layout import ITEM_KINDS, SKELETON_FORMAT, SKELETON_VERSION, ItemLocation, metadata_name
from .metadata import unpickle_metadata
from .storefs import OnStorage
from ..storage import Reader, locations

T = TypeVar("T")


def decode_span(f: Reader, index: ShardIndex, i: int, device: torch.device, *, verify: bool,
                pool: cf.Executor, gpu_batch_bytes: int = int(DEFAULT_GPU_BATCH_MB * (1 << 20)),
                ) -> torch.Tensor:
    """Read, check and decode stored span `i` of open shard `f` into a new uint8 tensor on
    `device` (`pipeline.read_storage`): one span, not the whole file."""
    return pipeline.read_storage(f, index, i, device, verify=verify, pool=pool,
                                 batch_bytes=gpu_batch_bytes)


def _view(span: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor `entry` describes, as a view of its decoded span (no copy)."""
    t = torch.empty(0, dtype=DTYPES[entry.dtype], device=span.device)
    return t.set_(span.untyped_storage(), entry.offset, entry.shape, entry.stride)


def read_kinds(f: Reader, index: ShardIndex, *, verify: bool) -> dict[str, str]:
    """The rank file's skeleton: which keys are tensors and which are bytes items."""
    data = container.read_skeleton(f, index, verify=verify)
    doc = state.unflatten(data, [], source=index.path)
    if (not isinstance(doc, dict) or doc.get("format") != SKELETON_FORMAT
            or not isinstance(doc.get("kinds"), dict)):
        raise CorruptCheckpointError(
            f"{index.path}: not a DCP rank file of nvcomp_ckpt_engine (its skeleton is not one)")
    if doc.get("version") != SKELETON_VERSION:
        raise UnsupportedCheckpointError(
            f"{index.path}: DCP rank file version {doc.get('version')!r}; this "
            f"nvcomp_ckpt_engine reads version {SKELETON_VERSION}: upgrade it to read the file")
    kinds = doc["kinds"]
    keys = {t.key for t in index.tensors}
    if set(kinds) != keys or any(kind not in ITEM_KINDS for kind in kinds.values()):
        raise CorruptCheckpointError(
            f"{index.path}: the skeleton's item list does not match the index")
    return kinds


class RankFile:
    """One rank file open for random access to its items by key.

    Keeps one decoded span and decodes another only when an item of that span is asked for.
    Items listed through `in_span_order` are asked for span by span, each span is decoded
    once, and the next span is decoded (read ahead) while the items of the current one are
    copied out: at most two decoded spans are held. `index`: the file's index as the open step
    read it (`integrity.checked_rank_file`), else it is read here.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True,
                 pool: cf.Executor | None = None, index: ShardIndex | None = None) -> None:
        self.index = container.read_index(path) if index is None else index
        self.path = self.index.path
        self.verify = verify
        self._own_pool = pool is None
        self._pool = pool or cf.ThreadPoolExecutor(pipeline.default_workers(),
                                                   thread_name_prefix="nvckpt-decode")
        self._ahead = cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-readahead")
        self._file = locations.open_reader(self.path)
        self._entries = {t.key: t for t in self.index.tensors}
        self._span: tuple[int, torch.Tensor] | None = None
        self._next: tuple[int, cf.Future[torch.Tensor]] | None = None
        self._after: dict[int, int] = {}
        try:
            self.kinds = read_kinds(self._file, self.index, verify=verify)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RankFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # The read-ahead thread reads the file: stop it before closing the file.
        self._ahead.shutdown(wait=True, cancel_futures=True)
        self._span = self._next = None
        self._file.close()
        if self._own_pool:
            self._pool.shutdown()

    def entry(self, key: str, kind: str) -> TensorEntry:
        """The index entry of item `key`, which must be a `kind` ("tensor" or "bytes") item."""
        entry = self._entries.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"{self.path}: .metadata places item {key!r} in this file, but the file has no "
                "such item (the checkpoint's files do not belong together)")
        if self.kinds[key] != kind:
            raise CorruptCheckpointError(
                f"{self.path}: item {key!r} is stored as {self.kinds[key]}, but .metadata "
                f"describes it as {kind}")
        return entry

    def in_span_order(self, items: Iterable[T], key: Callable[[T], str]) -> list[T]:
        """`items` sorted by the span their item ``key(item)`` lives in; reading them in this
        order decodes each span once, the next one while the current one is used."""
        def span(item: T) -> int:
            entry = self._entries.get(key(item))
            return -1 if entry is None else entry.storage

        ordered = sorted(items, key=span)
        spans = [s for s, _ in itertools.groupby(span(i) for i in ordered) if s >= 0]
        self._after = dict(zip(spans, spans[1:]))
        return ordered

    def destination_bytes(self, key: str, target: torch.Tensor, offsets: Sequence[int],
                          lengths: Sequence[int]) -> torch.Tensor | None:
        """`target`'s memory as the uint8 tensor that tensor item `key`'s stored span decodes
        straight into (`decode_into`), or None when it cannot: the request must be the whole
        item, the item its span's only tensor (a contiguous view from its first byte to its
        last) and `target` a contiguous tensor of the item's dtype and shape."""
        entry = self.entry(key, "tensor")
        span = self.index.storages[entry.storage]
        dtype = DTYPES[entry.dtype]
        shape = tuple(entry.shape)
        whole = (all(o == 0 for o in offsets) and tuple(lengths) == shape
                 and entry.offset == 0 and not span.derived
                 and tuple(entry.stride) == contiguous_strides(shape)
                 and span.nbytes == target.numel() * target.element_size())
        if not (whole and target.dtype == dtype and tuple(target.shape) == shape
                and target.is_contiguous() and target.numel() > 0):
            return None
        return target.reshape(-1).view(torch.uint8)

    def decode_into(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Decode tensor items straight into their destinations: (key, `destination_bytes`
        of the target) pairs, each key's span at most once. One pipeline for the whole list
        (`pipeline.read_storages_into`): large reads in file order, run ahead of the decode,
        across span boundaries; no decoded copy on the way."""
        wanted = [(self._entries[key].storage, dest) for key, dest in items]
        gpus = [dest.device for _, dest in wanted if dest.is_cuda]
        with torch.cuda.device(gpus[0]) if gpus else contextlib.nullcontext():
            pipeline.read_storages_into(self._file, self.index, wanted,
                                        verify=self.verify, pool=self._pool)

    def tensor(self, key: str, device: torch.device) -> torch.Tensor:
        """Tensor item `key`, as saved (dtype, shape, strides); decoded toward `device`."""
        entry = self.entry(key, "tensor")
        return _view(self._decoded(entry.storage, device), entry)

    def bytes(self, key: str) -> bytes:
        """Bytes item `key`, as stored (`item_bytes`: what may be handed to a planner)."""
        entry = self.entry(key, "bytes")
        return _view(self._decoded(entry.storage, torch.device("cpu")), entry).cpu().numpy().tobytes()

    def item_bytes(self, key: str, *, trusted: bool = False) -> bytes:
        """Bytes item `key` as DCP's planner may `torch.load` them: its value read through the
        allowlist and saved again (`torchsave.safe_bytes`; the stored bytes when `trusted`)."""
        return torchsave.safe_bytes(self.bytes(key), source=f"{self.path}: item {key!r}",
                                    trusted=trusted)

    def _decode(self, span: int, device: torch.device) -> torch.Tensor:
        """Decode a span; runs on the read-ahead thread too, hence the explicit device and
        the stream sync: the buffer is then used from another thread's CUDA stream."""
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            buf = decode_span(self._file, self.index, span, device, verify=self.verify,
                              pool=self._pool)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
        return buf

    def _decoded(self, span: int, device: torch.device) -> torch.Tensor:
        if self._span is not None and self._span[0] == span:
            return self._span[1]
        self._span = None  # free the previous span before holding another
        pending, self._next = self._next, None
        if pending is not None and pending[0] == span:
            buf = pending[1].result()
        else:
            if pending is not None:
                cf.wait([pending[1]])  # one reader of the file at a time
            buf = self._decode(span, device)
        following = self._after.get(span)
        if following is not None:
            self._next = (following, self._ahead.submit(self._decode, following, device))
        self._span = (span, buf)
        return buf


def _find_chunk(md: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata | None:
    """The chunk of `md` at `index.offset` (trying DCP's index hint first)."""
    offset = torch.Size(index.offset or ())
    hint = index.index
    if hint is not None and 0 <= hint < len(md.chunks) and md.chunks[hint].offsets == offset:
        return md.chunks[hint]
    return next((c for c in md.chunks if c.offsets == offset), None)


def check_item(rank_file: RankFile, metadata: Metadata, index: MetadataIndex,
               location: ItemLocation) -> None:
    """Check that the rank file stores item `index` as ``.metadata`` describes it.

    The kind must agree; a tensor item must have the dtype and the chunk shape that
    ``.metadata`` lists (a mismatch means the files do not belong to this metadata).
    """
    md = metadata.state_dict_metadata.get(index.fqn)
    if isinstance(md, BytesStorageMetadata):
        rank_file.entry(location.key, "bytes")
        return
    if not isinstance(md, TensorStorageMetadata):
        raise CorruptCheckpointError(
            f"{rank_file.path}: item {location.key!r} has no entry in .metadata")
    entry = rank_file.entry(location.key, "tensor")
    chunk = _find_chunk(md, index)
    if chunk is None:
        raise CorruptCheckpointError(
            f"{rank_file.path}: item {location.key!r}: .metadata lists no chunk of "
            f"{index.fqn!r} at offsets {list(index.offset or ())}")
    if DTYPES[entry.dtype] != md.properties.dtype or tuple(entry.shape) != tuple(chunk.sizes):
        raise CorruptCheckpointError(
            f"{rank_file.path}: item {location.key!r} is {entry.dtype}{list(entry.shape)} in "
            f"the file but {md.properties.dtype}{list(chunk.sizes)} in .metadata")


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The box [offsets, offsets + lengths) of `t` (a view)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != t.size(dim):
            t = t.narrow(dim, offset, length)
    return t


class NvcompFileSystemReader(OnStorage, FileSystemReader):
    """A DCP `StorageReader` for checkpoints written by `NvcompFileSystemWriter`.

    Every rank calls `read_data` with the items DCP's planner assigned it; each requested item
    is read from its rank file by key, its chunks' checksums are checked (unless
    ``verify=False``), only the spans those items view are decoded, and the box the planner
    asks for is copied into the destination tensor (which may be on a GPU: nvCOMP files are
    decoded there). Items that DCP's stock writer wrote (a checkpoint from before compression
    was turned on) are handed to the stock reader, so one reader resumes from either.

    The checkpoint is opened as a DeepSpeed tag is (`opened.py`, through
    `integrity.open_dcp_checkpoint`): its manifest intact and every file it lists present with
    its size, ``.metadata``'s bytes against their record before they are unpickled through the
    allowlist (``trusted=True``: any class, only for checkpoints you trust), each rank file's
    real path inside the folder, its index read once and its CRC (as the index gives it)
    against its record before its items are read; each bytes item is handed to the planner only
    as its value read through the allowlist and saved again (`RankFile.item_bytes`; DCP's own
    files' items too). A damaged file raises
    `CorruptCheckpointError` naming the file and item; under `dcp.load` it reaches the caller
    inside DCP's `CheckpointException` (``.failures[rank][0]``).
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True,
                 workers: int | None = None, trusted: bool = False) -> None:
        super().__init__(path)
        self._locate(path)
        self.verify = verify
        self.workers = workers
        self.trusted = trusted
        self._metadata: Metadata | None = None
        self._checkpoint: opened.OpenedCheckpoint | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata file, once the manifest is intact and the file's bytes match their
        record (`integrity`), unpickled from those very bytes through the allowlist
        (`metadata.unpickle_metadata`). Not DCP's own read: it re-reads the file and unpickles
        it with plain pickle, which runs whatever code a forged file names."""
        self._checkpoint = open_dcp_checkpoint(self.path, verify=self.verify)
        name = metadata_name(kwargs.get("rank"))
        data = checked_metadata_bytes(self.path, name, checkpoint=self._checkpoint)
        metadata = unpickle_metadata(self.path, data, trusted=self.trusted, name=name)
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's read does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """DCP's set-up, then the check that every file the manifest lists is present with its
        size. Here rather than in `read_metadata`, whose errors DCP turns into an
        AssertionError: from here the engine's error reaches the caller as it is."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        if self._checkpoint is not None:
            manifest_files.verify_files(self.path, self._checkpoint.manifest, check_crc=False)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ours: dict[str, list[ReadItem]] = {}
        stock: list[ReadItem] = []
        for req in plan.items:
            location = self.storage_data[req.storage_index]
            if isinstance(location, ItemLocation):
                ours.setdefault(location.relative_path, []).append(req)
            else:
                stock.append(req)
        if stock:
            restricted = _RestrictedBytes(planner, self, trusted=self.trusted)
            super().read_data(dataclasses.replace(plan, items=stock), restricted).wait()
        with cf.ThreadPoolExecutor(self.workers or pipeline.default_workers(),
                                   thread_name_prefix="nvckpt-decode") as pool:
            for relative_path, reqs in sorted(ours.items()):
                self._read_file(relative_path, reqs, planner, pool)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, relative_path: str, reqs: list[ReadItem], planner: LoadPlanner,
                   pool: cf.Executor) -> None:
        """Load the items `reqs` of one rank file. Tensor items the planner wants whole, in a
        destination laid out as stored (a load at the saved layout: nearly all of them), decode
        straight into it, all of the file's at once in one pipeline (`RankFile.decode_into`);
        the rest (boxes of an item, strided destinations, bytes items) are read span by span
        and copied."""
        path, index = checked_rank_file(self._checkpoint, self.path, relative_path)
        with RankFile(path, verify=self.verify, pool=pool, index=index) as rank_file:
            direct: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
            rest: list[tuple[ReadItem, torch.Tensor | None]] = []
            spans: set[int] = set()
            for req in reqs:
                location: ItemLocation = self.storage_data[req.storage_index]
                check_item(rank_file, self._metadata, req.storage_index, location)
                if req.type == LoadItemType.BYTE_IO:
                    rest.append((req, None))
                    continue
                target = planner.resolve_tensor(req).detach()
                dest = rank_file.destination_bytes(location.key, target, req.storage_offsets,
                                                   req.lengths)
                span = rank_file.entry(location.key, "tensor").storage
                if dest is None or span in spans:
                    rest.append((req, target))
                    continue
                spans.add(span)
                direct.append((req, target, dest))
            if direct:
                rank_file.decode_into([(self._key(req), dest) for req, _, dest in direct])
                for req, target, _ in direct:
                    planner.commit_tensor(req, target)
            for req, target in rank_file.in_span_order(rest, lambda item: self._key(item[0])):
                key = self._key(req)
                if target is None:
                    planner.load_bytes(req, io.BytesIO(
                        rank_file.item_bytes(key, trusted=self.trusted)))
                    continue
                source = _narrow(rank_file.tensor(key, target.device),
                                 req.storage_offsets, req.lengths)
                if source.shape != target.shape:
                    raise ValueError(
                        f"{rank_file.path}: item {key!r}: the load plan asks for a box "
                        f"of shape {list(source.shape)} but the destination has shape "
                        f"{list(target.shape)}")
                target.copy_(source)
                planner.commit_tensor(req, target)

    def _key(self, req: ReadItem) -> str:
        return self.storage_data[req.storage_index].key


class _RestrictedBytes:
    """The planner as DCP's stock reader sees it, for items of DCP's own files (a folder saved
    before compression was turned on): its bytes items go through `torchsave.safe_bytes` before
    the planner's ``torch.load`` meets them; everything else is the planner's."""

    def __init__(self, planner: LoadPlanner, reader: NvcompFileSystemReader, *,
                 trusted: bool) -> None:
        self._planner = planner
        self._reader = reader
        self._trusted = trusted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        record = self._reader.storage_data[read_item.storage_index]
        source = (f"{os.path.join(self._reader.path, record.relative_path)}: item "
                  f"{read_item.storage_index.fqn!r}")
        data = torchsave.safe_bytes(value.read(), source=source, trusted=self._trusted)
        self._planner.load_bytes(read_item, io.BytesIO(data))
