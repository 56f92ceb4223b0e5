"""torch.distributed.checkpoint (DCP) storage that writes each rank's items compressed.

`NvcompFileSystemWriter` and `NvcompFileSystemReader` are DCP's `FileSystemWriter` and
`FileSystemReader` with only `write_data` and `read_data` replaced, so DCP's planning,
resharding, metadata and commit stay DCP's own. A checkpoint directory holds:

    .metadata                  DCP's metadata, written last by the coordinator; its
                               ``storage_data`` maps every item to an `ItemLocation`
    .metadata.nvcomp.json      its size and SHA-256, written right after it (DCP's pickle has
                               no checksum of its own): checked before ``.metadata`` is read
    __{rank}_0.nvcomp.distcp   one shard file per rank that had items (docs/FORMAT.md): every
                               item of that rank, tensors as they are and bytes items as uint8
                               tensors, compressed on the device they live on

One file per rank, not one per item: a large model has thousands of items per rank, and
thousands of small files with their own fsync cost more on Lustre/GPFS than the data. A shard
file's JSON index names every item, so `read_data` decodes only the stored spans that the
requested items view (random access), never the whole file: loading only the model out of a
model+optimizer checkpoint, or resharding N→M, reads what it needs. docs/DCP.md has the rest.

Loading runs no code from the shard files; DCP's own ``.metadata`` is a pickle that
`dcp.load` unpickles as it always does, once its checksum matched. The functions the CLI uses
(`inspect_dcp`, `verify_dcp`, `decompress_dcp`) read ``.metadata`` through the engine's
allowlist instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import container, pipeline, state
from ._version import __version__
from .codecs import backend_summary
from .container import DTYPES, ShardIndex, TensorEntry
from .describe import describe_index
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from .options import DEFAULT_CHUNK_MB, DEFAULT_GPU_BATCH_MB, CompressionOptions, check_workers
from .storage import ShardFileWriter, atomic_write_bytes, fsync_dir, is_inside

logger = logging.getLogger(__name__)

#: Name ending of our per-rank files. It ends in "distcp" like DCP's own files, so tools that
#: pick a checkpoint's data files by that ending (Megatron-Core's `remove_sharded_tensors`)
#: still find them.
SHARD_SUFFIX = ".nvcomp.distcp"
#: DCP's metadata file (written by the coordinator after every rank's data is written).
METADATA_FILE = ".metadata"
#: Suffix of DCP's stock data files, used for the files `decompress_dcp` writes.
STOCK_SUFFIX = ".distcp"
#: Megatron-Core records the sharded backend of a checkpoint here; `decompress_dcp` rewrites
#: our backend name to Megatron's stock one so stock Megatron-Core loads the copy.
MEGATRON_CONFIG_FILE = "metadata.json"
MEGATRON_BACKEND = "nvcomp_torch_dist"
MEGATRON_STOCK_BACKEND = "torch_dist"

#: Appended to a metadata file's name for its checksum file.
CHECKSUM_SUFFIX = ".nvcomp.json"
_CHECKSUM_FORMAT = "nvcomp_ckpt_engine.dcp_metadata"
_CHECKSUM_VERSION = 1
_SKELETON_FORMAT = "nvcomp_ckpt_engine.dcp"
_SKELETON_VERSION = 1
_KINDS = ("tensor", "bytes")
T = TypeVar("T")


#: Attributes DCP's stock `FileSystemReader` reads from a storage record and ours lacks.
_STOCK_READER_FIELDS = frozenset({"offset", "length", "transform_descriptors"})


class StockReaderError(UnsupportedCheckpointError, AttributeError):
    """DCP's stock reader asked one of our records for the byte range of a torch.save blob.

    Also an `AttributeError`, so ``getattr(record, name, default)`` and ``hasattr`` behave as
    for any record lacking the field; a caller that does not expect it sees the way out.
    """


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item is stored: a rank file (relative to the checkpoint) and a key in it.

    DCP pickles these into ``.metadata`` (as `WriteResult.storage_data`), so this class keeps
    its import path, ``nvcomp_ckpt_engine.dcp.ItemLocation``, and its fields.
    """

    relative_path: str
    key: str

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the class lacks. DCP's stock reader asks for the byte
        # range of a torch.save blob; answer with the way out instead of a bare AttributeError.
        if name in _STOCK_READER_FIELDS:
            raise StockReaderError(
                f"{self.relative_path}: this DCP checkpoint was written by nvcomp_ckpt_engine, "
                "whose files DCP's stock FileSystemReader cannot read. Load it with "
                "storage_reader=nvcomp_ckpt_engine.dcp.NvcompFileSystemReader(path), or write a "
                "plain DCP checkpoint with `nvcomp-ckpt decompress CKPT_DIR OUT_DIR`."
            )
        raise AttributeError(name)


# ---------------------------------------------------------------------------------- saving


def item_key(index: MetadataIndex) -> str:
    """The key an item has in its rank file: the FQN, plus the chunk offsets for a tensor."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


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
        {"format": _SKELETON_FORMAT, "version": _SKELETON_VERSION, "kinds": kinds}, protocol=4)
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


def _log_written(info: pipeline.ShardInfo, items: int) -> None:
    logger.debug("wrote %s: %d items, %d -> %d bytes (%.3fx, %s)", info.path, items,
                 info.raw_bytes, info.file_bytes, info.ratio, ",".join(info.codecs))


class NvcompFileSystemWriter(FileSystemWriter):
    """A DCP `StorageWriter` that writes each rank's items as one compressed shard file.

    Call sequence (DCP drives it, on every rank): `set_up_storage_writer`, `prepare_local_plan`;
    the coordinator runs `prepare_global_plan`; every rank runs `write_data`; the coordinator
    runs `finish`, which writes ``.metadata`` once every rank's file is written. With
    `dcp.async_save` this object is also the stager: it copies the state to CPU memory first,
    so later optimizer steps cannot change what is written; the copy is then compressed in the
    background (streamed through the GPU when nvCOMP is usable, else with the CPU codecs).

    Args:
        path: the checkpoint directory.
        algorithm, portable, chunk_mb, gpu_batch_mb: see `options.CompressionOptions`.
        workers: CPU codec threads (None: one per core, at most 8).
        sync_files: fsync each file and the directory (without it a crash can lose the save).
        overwrite: allow saving over an existing checkpoint (DCP's flag).
        cache_staged_state_dict: keep the async staging buffers between saves (DCP's flag).
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
    ) -> None:
        self.options = CompressionOptions(algorithm=algorithm, portable=portable,
                                          chunk_mb=chunk_mb, gpu_batch_mb=gpu_batch_mb)
        self.workers = check_workers(workers)
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1,
                         overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's global plan (coordinator only, before any rank writes), after removing the
        ``.metadata`` of a checkpoint being overwritten: a crash while the new files are
        written then leaves no loadable checkpoint, rather than the old metadata over a mix
        of old and new rank files."""
        plans = super().prepare_global_plan(plans)
        removed = False
        for old in (Path(self.path) / METADATA_FILE, _checksum_path(Path(self.path) / METADATA_FILE)):
            if old.exists():
                old.unlink()
                removed = True
        if removed and self.sync_files:
            fsync_dir(self.path)
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Resolve this rank's items and write them as one shard file (none if no items)."""
        results: list[WriteResult] = []
        if plan.items:
            name = f"{plan.storage_data.prefix}0{SHARD_SUFFIX}"
            items = [(item, planner.resolve_data(item)) for item in plan.items]
            prepared = prepare_items(name, items, self.options)
            info = pipeline.write_prepared(prepared.shard, self.fs.concat_path(self.path, name),
                                           durable=self.sync_files, workers=self.workers)
            _log_written(info, len(items))
            results = prepared.results
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's finish (``.metadata`` via a temporary name), then the metadata's checksum file
        (`write_metadata_checksum`), and an fsync of the directory so both survive a crash."""
        super().finish(metadata, results)
        rank = getattr(self, "rank", None)
        per_rank = not getattr(self, "use_collectives", True) and rank is not None
        write_metadata_checksum(self.path, _metadata_name(rank if per_rank else None),
                                durable=self.sync_files)


def _metadata_name(rank: int | None) -> str:
    """The metadata file DCP writes: ``.metadata``, or ``__{rank}.metadata`` for a save
    without collectives."""
    return METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"


def _checksum_path(metadata_file: Path) -> Path:
    return metadata_file.with_name(metadata_file.name + CHECKSUM_SUFFIX)


def write_metadata_checksum(directory: str | os.PathLike, name: str = METADATA_FILE, *,
                            durable: bool = True) -> None:
    """Record the size and SHA-256 of the metadata file `name` in its checksum file.

    DCP's ``.metadata`` is a pickle without a checksum: a flipped bit in it may still unpickle,
    into other metadata. The coordinator calls this right after DCP wrote the file (our writer's
    `finish`, the Megatron strategy's finalize); a checkpoint that has our rank files but no
    checksum file did not finish saving.
    """
    file = Path(directory) / name
    data = file.read_bytes()
    record = {"format": _CHECKSUM_FORMAT, "version": _CHECKSUM_VERSION, "file": name,
              "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_bytes(_checksum_path(file), (json.dumps(record, sort_keys=True) + "\n").encode(),
                       durable=durable)
    if durable:
        fsync_dir(directory)


def _has_rank_files(directory: Path) -> bool:
    return any(p.name.endswith(SHARD_SUFFIX) for p in directory.iterdir())


def checked_metadata_bytes(directory: str | os.PathLike, name: str = METADATA_FILE) -> bytes:
    """The bytes of metadata file `name`, checked against its checksum file.

    A checkpoint without our rank files (one DCP's own writer wrote) has no checksum file and
    is read unchecked. Raises `IncompleteCheckpointError` when the metadata file, or the
    checksum file of a checkpoint holding our rank files, is missing; `CorruptCheckpointError`
    when they disagree or the checksum file is damaged.
    """
    directory = Path(directory)
    file = directory / name
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory}: no {name}; DCP writes it last, so the save did not finish "
            "(or this is not a DCP checkpoint)") from None
    sidecar = _checksum_path(file)
    try:
        text = sidecar.read_bytes()
    except FileNotFoundError:
        if _has_rank_files(directory):
            raise IncompleteCheckpointError(
                f"{sidecar}: missing; nvcomp_ckpt_engine writes it right after {name}, so the "
                "save did not finish (or the file was removed): the metadata cannot be "
                "checked") from None
        return data
    try:
        record = json.loads(text)
        expected = (record["format"], record["version"], record["file"])
        size, digest = record["bytes"], record["sha256"]
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptCheckpointError(f"{sidecar}: damaged ({type(exc).__name__}: {exc})") from exc
    if expected != (_CHECKSUM_FORMAT, _CHECKSUM_VERSION, name):
        raise CorruptCheckpointError(
            f"{sidecar}: not the checksum file of {name} ({expected}); damaged, or from a newer "
            "nvcomp_ckpt_engine")
    if size != len(data) or digest != hashlib.sha256(data).hexdigest():
        raise CorruptCheckpointError(
            f"{file}: {len(data)} bytes whose SHA-256 differs from the one recorded in "
            f"{sidecar.name} ({size} bytes): the metadata is damaged")
    return data


# ---------------------------------------------------------------------------------- loading


def decode_span(f: Any, index: ShardIndex, i: int, device: torch.device, *, verify: bool,
                pool: cf.Executor, gpu_batch_bytes: int = int(DEFAULT_GPU_BATCH_MB * (1 << 20)),
                ) -> torch.Tensor:
    """Read, check and decode stored span `i` of open shard `f` into a new uint8 tensor on
    `device` (`pipeline.read_storage`): one span, not the whole file."""
    return pipeline.read_storage(f.fileno(), index, i, device, verify=verify, pool=pool,
                                 batch_bytes=gpu_batch_bytes)


def _view(span: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor `entry` describes, as a view of its decoded span (no copy)."""
    t = torch.empty(0, dtype=DTYPES[entry.dtype], device=span.device)
    return t.set_(span.untyped_storage(), entry.offset, entry.shape, entry.stride)


def _read_kinds(f: Any, index: ShardIndex, *, verify: bool) -> dict[str, str]:
    """The rank file's skeleton: which keys are tensors and which are bytes items."""
    data = container.read_skeleton(f, index, verify=verify)
    doc = state.unflatten(data, [], source=index.path)
    if (not isinstance(doc, dict) or doc.get("format") != _SKELETON_FORMAT
            or not isinstance(doc.get("kinds"), dict)):
        raise CorruptCheckpointError(
            f"{index.path}: not a DCP rank file of nvcomp_ckpt_engine (its skeleton is not one)")
    if doc.get("version") != _SKELETON_VERSION:
        raise UnsupportedCheckpointError(
            f"{index.path}: DCP rank file version {doc.get('version')!r}; this "
            f"nvcomp_ckpt_engine reads version {_SKELETON_VERSION}: upgrade it to read the file")
    kinds = doc["kinds"]
    keys = {t.key for t in index.tensors}
    if set(kinds) != keys or any(kind not in _KINDS for kind in kinds.values()):
        raise CorruptCheckpointError(
            f"{index.path}: the skeleton's item list does not match the index")
    return kinds


class RankFile:
    """One rank file open for random access to its items by key.

    Keeps one decoded span and decodes another only when an item of that span is asked for.
    Items listed through `in_span_order` are asked for span by span, each span is decoded
    once, and the next span is decoded (read ahead) while the items of the current one are
    copied out: at most two decoded spans are held.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True,
                 pool: cf.Executor | None = None) -> None:
        self.index = container.read_index(path)
        self.path = self.index.path
        self.verify = verify
        self._own_pool = pool is None
        self._pool = pool or cf.ThreadPoolExecutor(pipeline.default_workers(),
                                                   thread_name_prefix="nvckpt-decode")
        self._ahead = cf.ThreadPoolExecutor(1, thread_name_prefix="nvckpt-readahead")
        self._file = open(self.path, "rb")
        self._entries = {t.key: t for t in self.index.tensors}
        self._span: tuple[int, torch.Tensor] | None = None
        self._next: tuple[int, cf.Future[torch.Tensor]] | None = None
        self._after: dict[int, int] = {}
        try:
            self.kinds = _read_kinds(self._file, self.index, verify=verify)
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

    def tensor(self, key: str, device: torch.device) -> torch.Tensor:
        """Tensor item `key`, as saved (dtype, shape, strides); decoded toward `device`."""
        entry = self.entry(key, "tensor")
        return _view(self._decoded(entry.storage, device), entry)

    def bytes(self, key: str) -> bytes:
        """Bytes item `key`."""
        entry = self.entry(key, "bytes")
        return _view(self._decoded(entry.storage, torch.device("cpu")), entry).cpu().numpy().tobytes()

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


class NvcompFileSystemReader(FileSystemReader):
    """A DCP `StorageReader` for checkpoints written by `NvcompFileSystemWriter`.

    Every rank calls `read_data` with the items DCP's planner assigned it; each requested item
    is read from its rank file by key, its chunks' checksums are checked (unless
    ``verify=False``), only the spans those items view are decoded, and the box the planner
    asks for is copied into the destination tensor (which may be on a GPU: nvCOMP files are
    decoded there). Items that DCP's stock writer wrote (a checkpoint from before compression
    was turned on) are handed to the stock reader, so one reader resumes from either.

    ``.metadata`` is checked against its checksum file before DCP unpickles it
    (`checked_metadata_bytes`). A damaged file raises `CorruptCheckpointError` naming the file
    and item; under `dcp.load` it reaches the caller inside DCP's `CheckpointException`
    (``.failures[rank][0]``).
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True,
                 workers: int | None = None) -> None:
        super().__init__(path)
        self.verify = verify
        self.workers = workers
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's read of the metadata file, once its bytes match their checksum."""
        checked_metadata_bytes(self.path, _metadata_name(kwargs.get("rank")))
        return super().read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

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
            super().read_data(dataclasses.replace(plan, items=stock), planner).wait()
        with cf.ThreadPoolExecutor(self.workers or pipeline.default_workers(),
                                   thread_name_prefix="nvckpt-decode") as pool:
            for relative_path, reqs in sorted(ours.items()):
                self._read_file(relative_path, reqs, planner, pool)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, relative_path: str, reqs: list[ReadItem], planner: LoadPlanner,
                   pool: cf.Executor) -> None:
        path = self.fs.concat_path(self.path, relative_path)
        with RankFile(path, verify=self.verify, pool=pool) as rank_file:
            for req in rank_file.in_span_order(reqs, self._key):
                location: ItemLocation = self.storage_data[req.storage_index]
                check_item(rank_file, self._metadata, req.storage_index, location)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(rank_file.bytes(location.key)))
                    continue
                target = planner.resolve_tensor(req).detach()
                source = _narrow(rank_file.tensor(location.key, target.device),
                                 req.storage_offsets, req.lengths)
                if source.shape != target.shape:
                    raise ValueError(
                        f"{rank_file.path}: item {location.key!r}: the load plan asks for a box "
                        f"of shape {list(source.shape)} but the destination has shape "
                        f"{list(target.shape)}")
                target.copy_(source)
                planner.commit_tensor(req, target)

    def _key(self, req: ReadItem) -> str:
        return self.storage_data[req.storage_index].key


# ------------------------------------------------------------------- what the CLI calls


#: Globals a DCP ``.metadata`` pickle names (torch 2.x, Megatron-Core 0.16), beyond the
#: engine's default allowlist: DCP's metadata dataclasses, both kinds of storage record, and
#: the save plans Megatron-Core keeps in it (``all_local_plans``).
DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.distributed.checkpoint.filesystem._StoragePrefix",
        "torch.distributed.checkpoint.planner.SavePlan",
        "torch.distributed.checkpoint.planner.WriteItem",
        "torch.distributed.checkpoint.planner.WriteItemType",
        "torch.distributed.checkpoint.planner.TensorWriteData",
        "torch.distributed.checkpoint.planner.BytesIOWriteData",
        "nvcomp_ckpt_engine.dcp.ItemLocation",
        # how torch pickles a torch.layout: a lookup of the layout by name
        "torch.serialization._get_layout",
    }
)


def _shard_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(SHARD_SUFFIX) and p.is_file())


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """True if `path` is a directory holding a DCP ``.metadata`` and our rank files (cheap:
    reads no metadata and only the first bytes of one file)."""
    directory = Path(path)
    if not directory.is_dir() or not (directory / METADATA_FILE).is_file():
        return False
    return any(container.is_shard_file(p) for p in _shard_paths(directory))


def read_metadata(path: str | os.PathLike, *, trusted: bool = False) -> Metadata:
    """A checkpoint's DCP ``.metadata``, unpickled through the engine's allowlist.

    ``trusted=True`` allows any class (only for checkpoints you trust); otherwise a class
    outside `DCP_METADATA_GLOBALS` and the default allowlist raises `UnsafeObjectError`.
    """
    file = Path(path) / METADATA_FILE
    data = checked_metadata_bytes(path)
    allowed = None if trusted else state.safe_globals(DCP_METADATA_GLOBALS)
    metadata = state.unpickle(data, allowed=allowed, source=str(file), what="the pickle")
    _check_structure(metadata, file)
    return metadata


def _is_offsets(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(v) is int for v in value)


def _check_structure(metadata: Any, file: Path) -> None:
    """Raise `CorruptCheckpointError` unless `metadata` has the shape DCP gives it, as far as
    the checks of this module read it: an unpickled object may hold anything in any field."""
    def problem() -> str | None:
        if not isinstance(metadata, Metadata):
            return f"it is a {type(metadata).__name__}"
        items = getattr(metadata, "state_dict_metadata", None)
        records = getattr(metadata, "storage_data", None)
        if not isinstance(items, dict) or not isinstance(records, dict):
            return "its item or storage records are not dicts"
        for fqn, md in items.items():
            if not isinstance(fqn, str):
                return f"an item is named {fqn!r}"
            if isinstance(md, BytesStorageMetadata):
                continue
            chunks = getattr(md, "chunks", None)
            if (not isinstance(md, TensorStorageMetadata)
                    or not isinstance(getattr(getattr(md, "properties", None), "dtype", None),
                                      torch.dtype)
                    or not isinstance(chunks, list)
                    or not all(isinstance(c, ChunkStorageMetadata)
                               and _is_offsets(getattr(c, "offsets", None))
                               and _is_offsets(getattr(c, "sizes", None)) for c in chunks)):
                return f"item {fqn!r} is not described as DCP describes one"
        for index, record in records.items():
            offset = getattr(index, "offset", None)
            if (not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str)
                    or not (offset is None or _is_offsets(offset))
                    or not (getattr(index, "index", None) is None or type(index.index) is int)):
                return f"a storage record is keyed {index!r}"
            if not isinstance(getattr(record, "relative_path", None), str) or (
                    isinstance(record, ItemLocation) and not isinstance(
                        getattr(record, "key", None), str)):
                return f"the storage record of {index.fqn!r} is not one of DCP's or ours"
        return None

    found = problem()
    if found is not None:
        raise CorruptCheckpointError(f"{file}: is not DCP metadata with storage records ({found})")


def _locations_by_file(metadata: Metadata) -> dict[str, list[tuple[MetadataIndex, ItemLocation]]]:
    by_file: dict[str, list[tuple[MetadataIndex, ItemLocation]]] = {}
    for index, location in metadata.storage_data.items():
        if isinstance(location, ItemLocation):
            by_file.setdefault(location.relative_path, []).append((index, location))
    return by_file


def _check_coverage(directory: Path, metadata: Metadata) -> None:
    """Every item ``.metadata`` declares has a storage record, and every record a file name
    inside the checkpoint directory."""
    recorded = {(i.fqn, tuple(i.offset) if i.offset is not None else None)
                for i in metadata.storage_data}
    for fqn, md in metadata.state_dict_metadata.items():
        wanted = ([(fqn, None)] if isinstance(md, BytesStorageMetadata)
                  else [(fqn, tuple(c.offsets)) for c in md.chunks])
        for want in wanted:
            if want not in recorded:
                raise CorruptCheckpointError(
                    f"{directory / METADATA_FILE}: item {fqn!r} (offsets {want[1]}) has no "
                    "storage record")
    for location in metadata.storage_data.values():
        name = getattr(location, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CorruptCheckpointError(
                f"{directory / METADATA_FILE}: storage record names {name!r}, not a file of "
                "the checkpoint directory")
        if not is_inside(directory / name, directory):
            raise CorruptCheckpointError(
                f"{directory / name}: resolves to {os.path.realpath(directory / name)}, "
                "outside the checkpoint directory")


def _split_key(key: str, kind: str) -> tuple[str, list[int]]:
    """(FQN, chunk offsets) of an item key (`item_key`); a key that does not parse as a
    tensor chunk's is shown whole."""
    fqn, at, offsets = key.rpartition("@")
    if kind == "bytes" or not at:
        return key, []
    try:
        return fqn, [int(o) for o in offsets.split(",") if o]
    except ValueError:
        return key, []


def _describe_file(path: Path) -> dict[str, Any]:
    """One rank file from its index and skeleton alone (shaped like the CLI's shard rows)."""
    index = container.read_index(path)
    with open(path, "rb") as f:
        kinds = _read_kinds(f, index, verify=True)
    doc = describe_index(index, path.name)
    for row in doc["tensors"]:
        fqn, offsets = _split_key(row["key"], kinds[row["key"]])
        row.update(fqn=fqn, offsets=offsets, kind=kinds[row["key"]])
    return doc


def inspect_dcp(path: str | os.PathLike) -> list[dict[str, Any]]:
    """One dict per rank file of a DCP checkpoint, from indexes only (no decoding, no GPU).

    Each dict has the keys of the CLI's shard description (`describe.describe_index`); each
    tensor row adds the item's ``fqn``, chunk ``offsets`` and ``kind`` ("tensor" or "bytes").
    A file that cannot be read gives ``{"path": name, "error": message}`` instead.
    """
    rows = []
    for file in _shard_paths(Path(path)):
        try:
            rows.append(_describe_file(file))
        except (CheckpointError, OSError) as exc:
            rows.append({"path": file.name, "error": str(exc)})
    return rows


def dcp_faults(path: str | os.PathLike, *, trusted: bool = False) -> list[CheckpointError]:
    """Every fault of a DCP checkpoint found without decoding it, one per damaged file.

    ``.metadata`` must exist, match its checksum file, unpickle through the allowlist
    (`read_metadata`) and record a location for every item it declares; if it does not, that
    is the one fault (nothing else can be checked). Then every rank file it names must exist,
    pass every checksum and hold each item with the kind, dtype and shape ``.metadata`` gives
    it; a file that does not is one fault, and the others are still checked. Each fault is
    `IncompleteCheckpointError` (no ``.metadata``, a missing file) or `CorruptCheckpointError`,
    naming the file and item.
    """
    directory = Path(path)
    try:
        metadata = read_metadata(directory, trusted=trusted)
        _check_coverage(directory, metadata)
    except CheckpointError as exc:
        return [exc]
    faults: list[CheckpointError] = []
    for relative_path, items in sorted(_locations_by_file(metadata).items()):
        file = directory / relative_path
        try:
            if not file.is_file():
                raise IncompleteCheckpointError(
                    f"{file}: missing; .metadata places {len(items)} item(s) in it, e.g. "
                    f"{items[0][1].key!r}")
            container.verify_file(file)
            with RankFile(file) as rank_file:
                for index, location in items:
                    check_item(rank_file, metadata, index, location)
        except CheckpointError as exc:
            faults.append(exc)
        except OSError as exc:
            faults.append(CorruptCheckpointError(f"{file}: cannot be read ({exc})"))
    for index, record in metadata.storage_data.items():
        if not isinstance(record, ItemLocation) and not (directory / record.relative_path).is_file():
            faults.append(IncompleteCheckpointError(
                f"{directory / record.relative_path}: missing; .metadata places item "
                f"{index.fqn!r} in it"))
    return faults


def verify_dcp(path: str | os.PathLike, *, trusted: bool = False) -> None:
    """Check a DCP checkpoint without decoding it; raises the first of `dcp_faults`."""
    faults = dcp_faults(path, trusted=trusted)
    if faults:
        raise faults[0]


def _serialized(rank_file: RankFile, location: ItemLocation, index: MetadataIndex,
                metadata: Metadata) -> bytes:
    """An item as DCP's stock writer stores it: the bytes themselves, or torch.save of the
    tensor with storage of its own size."""
    if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
        return rank_file.bytes(location.key)
    buffer = io.BytesIO()
    torch.save(rank_file.tensor(location.key, torch.device("cpu")).clone(), buffer)
    return buffer.getvalue()


def _decompress_file(src: Path, dst_dir: Path, items: list[tuple[MetadataIndex, ItemLocation]],
                     metadata: Metadata) -> dict[MetadataIndex, Any]:
    """Write one rank file's items as a stock DCP data file; returns their new records."""
    name = src.name[: -len(SHARD_SUFFIX)] + STOCK_SUFFIX
    records = {}
    writer = ShardFileWriter(dst_dir / name)
    try:
        with RankFile(src) as rank_file:
            for index, location in rank_file.in_span_order(items, lambda il: il[1].key):
                check_item(rank_file, metadata, index, location)
                data = _serialized(rank_file, location, index, metadata)
                records[index] = stock_storage_record(name, writer.append(data), len(data))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return records


def _copy_other_file(src: Path, dst: Path) -> None:
    """Copy a file that is not ours (Megatron-Core's common.pt, a stock data file); a
    Megatron-Core metadata.json that names our backend is rewritten to the stock one."""
    if src.name != MEGATRON_CONFIG_FILE:
        shutil.copy2(src, dst)
        return
    try:
        config = json.loads(src.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        shutil.copy2(src, dst)
        return
    if isinstance(config, dict) and config.get("sharded_backend") == MEGATRON_BACKEND:
        config["sharded_backend"] = MEGATRON_STOCK_BACKEND
    atomic_write_bytes(dst, json.dumps(config).encode("utf-8"))


def decompress_dcp(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, *,
                   trusted: bool = False) -> None:
    """Write a plain DCP checkpoint, which stock `dcp.load` reads, from one of ours.

    Each rank file becomes DCP's ``__{rank}_0.distcp`` (items as DCP's FileSystemWriter writes
    them), ``.metadata`` is rewritten to point at them (written last, so an interrupted run
    leaves no loadable half), and other files are copied (a Megatron-Core ``metadata.json``
    then names the stock ``torch_dist`` backend). Every chunk's checksum is checked on the
    way. `dst_dir` must not exist or be empty. ``trusted`` as in `read_metadata`.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    metadata = read_metadata(src, trusted=trusted)
    _check_coverage(src, metadata)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} is not empty; decompress_dcp writes into a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    records = dict(metadata.storage_data)
    ours = _locations_by_file(metadata)
    for relative_path, items in sorted(ours.items()):
        records.update(_decompress_file(src / relative_path, dst, items, metadata))
        logger.info("decompressed %s (%d items)", relative_path, len(items))
    for file in sorted(p for p in src.iterdir() if p.is_file()):
        if file.name.startswith(METADATA_FILE) or file.name.endswith(SHARD_SUFFIX):
            continue  # .metadata is rewritten; its checksum file would not match the new one
        if not is_inside(file, src):
            logger.warning("%s: a link to %s, outside the checkpoint; not copied", file,
                           os.path.realpath(file))
            continue
        _copy_other_file(file, dst / file.name)
    plain = dataclasses.replace(metadata, storage_data=records)
    atomic_write_bytes(dst / METADATA_FILE, pickle.dumps(plain))
    fsync_dir(dst)


# -------------------------------------------- compatibility: DCP's private storage record
#
# DCP's stock FileSystemReader accepts only its own private `_StorageInfo` record in
# ``.metadata`` (torch 2.x). `decompress_dcp` must write that record for the checkpoint it
# produces; this is the one place that names it. Tested with torch 2.13; other versions are
# accepted while the record keeps the three fields the stock reader uses.

_TESTED_TORCH = ("2.13",)


@functools.cache
def _stock_record_class() -> type:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    names = {f.name for f in dataclasses.fields(_StorageInfo)}
    if not {"relative_path", "offset", "length"} <= names:
        raise UnsupportedCheckpointError(
            f"torch {torch.__version__}: DCP's storage record has fields {sorted(names)}, not "
            "relative_path/offset/length; decompress_dcp supports the torch versions "
            f"{', '.join(_TESTED_TORCH)} (and later ones that keep those fields)")
    if ".".join(torch.__version__.split(".")[:2]) not in _TESTED_TORCH:
        logger.info("decompress_dcp: torch %s is untested; its DCP storage record has the "
                    "expected fields", torch.__version__)
    return _StorageInfo


def stock_storage_record(relative_path: str, offset: int, length: int) -> Any:
    """DCP's own record for a byte range of a stock data file."""
    return _stock_record_class()(relative_path, offset, length)


__all__ = [
    "CHECKSUM_SUFFIX",
    "DCP_METADATA_GLOBALS",
    "ItemLocation",
    "NvcompFileSystemReader",
    "NvcompFileSystemWriter",
    "PreparedItems",
    "RankFile",
    "SHARD_SUFFIX",
    "StockReaderError",
    "checked_metadata_bytes",
    "dcp_faults",
    "decompress_dcp",
    "inspect_dcp",
    "is_dcp_checkpoint",
    "prepare_items",
    "read_metadata",
    "verify_dcp",
    "write_metadata_checksum",
]
