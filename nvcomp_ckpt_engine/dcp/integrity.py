"""Which files a DCP checkpoint of ours consists of, and their checks: the project's manifest.

A DCP checkpoint gets the completeness and integrity story of a DeepSpeed tag (manifest.py):
once DCP's coordinator has written ``.metadata``, it writes ``nvcomp_manifest.json`` listing
every rank file and ``.metadata`` itself with their sizes and CRC-32s (the commit point: a folder
holding our rank files and no manifest did not finish saving). Each rank reports its file's
record to the coordinator inside its DCP write results (`file_result`), which the coordinator
takes out again before DCP builds ``.metadata`` (`split_results`): no file is read back but
``.metadata``. A load opens the folder as any tag folder of ours is opened (`opened.py`,
`open_dcp_checkpoint`): the manifest read and checked once (intact, every file present with its
size), each listed file's real path inside the folder, each rank file's index read once and its
CRC, as the index describes it, against its record before its items are read
(`checked_rank_file`). What is DCP's own stays here: the bytes of ``.metadata`` are checked
against their record (every byte: they are unpickled next) before anything reads them, and a
rank file ``.metadata`` places items in must be one the manifest lists. Every chunk's own CRC is
checked as it is decoded.

Folders that earlier builds of nvcomp_ckpt_engine saved before the DCP manifest (a
``.metadata.nvcomp.json`` checksum file beside ``.metadata``, no manifest) are still read: their
``.metadata`` is checked against that file, their rank files by their chunk checksums only.
Nothing writes that file any more; a re-save removes it (`remove_commit`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zlib
from collections.abc import Sequence
from typing import NoReturn

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from .. import manifest, opened, pipeline
from .._version import __version__
from ..container import ShardIndex
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..storage import TooLargeError, locations, open_storage
from .layout import METADATA_FILE, SHARD_SUFFIX

#: The FQN of the write results that carry a rank file's record to the coordinator (a label for
#: logs: they are told from the items' results by their record, a `manifest.ShardRecord`).
FILE_RECORD_FQN = "nvcomp_ckpt_engine.dcp/file-record"
#: Appended to a metadata file's name for the checksum file of folders saved before the manifest.
LEGACY_CHECKSUM_SUFFIX = ".nvcomp.json"
_LEGACY_FORMAT = "nvcomp_ckpt_engine.dcp_metadata"
_LEGACY_VERSION = 1
#: The tag a manifest records when the folder's name cannot be one (manifest.validate_tag).
_FALLBACK_TAG = "dcp"
#: The largest ``.metadata`` read where nothing records its size (a folder DCP's own writer
#: saved): DCP's metadata of the largest models is tens of megabytes.
MAX_UNRECORDED_METADATA_BYTES = 1 << 30
#: An older version's checksum file is about 200 bytes of JSON.
_MAX_LEGACY_CHECKSUM_BYTES = 64 << 10


# ------------------------------------------------------------------------------ saving


def file_result(info: pipeline.ShardInfo, relative_path: str) -> WriteResult:
    """The write result that reports one written rank file to the coordinator (added to the
    rank's item results; `split_results` takes it out)."""
    record = manifest.ShardRecord(path=relative_path, rank=0, raw_bytes=info.raw_bytes,
                                  file_bytes=info.file_bytes, crc32=info.crc32,
                                  codecs=info.codecs, io=info.io)
    return WriteResult(index=MetadataIndex(FILE_RECORD_FQN), size_in_bytes=0,
                       storage_data=record)


def split_results(results: Sequence[Sequence[WriteResult]],
                  ) -> tuple[list[list[WriteResult]], list[manifest.ShardRecord]]:
    """Every rank's item results without the file reports, and the reported file records with
    the rank that reported them (its place in `results`)."""
    items: list[list[WriteResult]] = []
    records: list[manifest.ShardRecord] = []
    for rank, rank_results in enumerate(results):
        items.append([r for r in rank_results if not _is_file_report(r)])
        records.extend(dataclasses.replace(r.storage_data, rank=rank) for r in rank_results
                       if _is_file_report(r))
    return items, records


def _is_file_report(result: WriteResult) -> bool:
    return isinstance(result.storage_data, manifest.ShardRecord)


def write_checkpoint_manifest(directory: str | os.PathLike,
                              records: Sequence[manifest.ShardRecord], *, world_size: int,
                              coordinator_rank: int, framework: str,
                              durable: bool = True) -> manifest.Manifest:
    """Publish the manifest of a DCP save (the coordinator, once ``.metadata`` is written):
    `checkpoint_manifest`, written. The commit point."""
    found = checkpoint_manifest(directory, records, world_size=world_size,
                                coordinator_rank=coordinator_rank, framework=framework)
    manifest.write_manifest(directory, found, durable=durable)
    return found


def checkpoint_manifest(directory: str | os.PathLike, records: Sequence[manifest.ShardRecord], *,
                        world_size: int, coordinator_rank: int, framework: str) -> manifest.Manifest:
    """The manifest of a DCP save, not written: the rank files' `records` and ``.metadata``,
    measured here, and the `framework` that saved it (``"dcp"``, ``"megatron"``) as its layout."""
    directory = locations.location(directory)
    data = open_storage(directory).read_small(METADATA_FILE, MAX_UNRECORDED_METADATA_BYTES,
                                              what="the metadata")
    metadata_record = manifest.ShardRecord(path=METADATA_FILE, rank=coordinator_rank,
                                           raw_bytes=len(data), file_bytes=len(data),
                                           crc32=zlib.crc32(data))
    found = manifest.build_manifest(
        tag=_tag_of(directory), world_size=world_size, files=[*records, metadata_record],
        layout=manifest.layout_record(framework),
        versions={"nvcomp_ckpt_engine": __version__, "torch": torch.__version__.split("+")[0]},
        created_unix_ns=time.time_ns(),
    )
    return found


def _tag_of(directory: locations.Location) -> str:
    name = locations.real(directory).name
    try:
        return manifest.validate_tag(name)
    except (TypeError, ValueError):
        return _FALLBACK_TAG


def remove_commit(directory: str | os.PathLike) -> bool:
    """Remove what makes `directory` a loadable checkpoint, commit point first (the manifest,
    ``.metadata``, an older version's checksum file); True if anything was removed."""
    storage = open_storage(directory)
    removed = False
    for old in (manifest.MANIFEST_NAME, METADATA_FILE, METADATA_FILE + LEGACY_CHECKSUM_SUFFIX):
        if storage.exists(old):
            storage.delete(old)
            removed = True
    return removed


# ----------------------------------------------------------------------------- loading


def open_dcp_checkpoint(directory: str | os.PathLike, *,
                        verify: bool = True) -> opened.OpenedCheckpoint | None:
    """A DCP checkpoint folder opened as a tag folder as it is (`opened.OpenedCheckpoint`): its
    manifest read and validated once; its files compared with it as they are used. None for a
    folder without a manifest (`checked_metadata_bytes` says whether that may be read). Raises
    `CorruptCheckpointError` for a damaged manifest. `verify`: compare each rank file's index
    CRC with its record before its items are read."""
    if not open_storage(directory).exists(manifest.MANIFEST_NAME):
        return None
    return opened.OpenedCheckpoint(directory, manifest.read_manifest(directory), verify=verify)


def checked_metadata_bytes(directory: str | os.PathLike, name: str = METADATA_FILE, *,
                           checkpoint: opened.OpenedCheckpoint | None = None) -> bytes:
    """The bytes of metadata file `name`, checked before anything unpickles them.

    Against `checkpoint`'s manifest (`open_dcp_checkpoint`): the file must lie inside the
    folder, and its size and CRC-32 must be the record's. Without a manifest, against an older
    version's checksum file, if the folder has one; a folder without our rank files (DCP's own
    writer's) is read unchecked. Raises `IncompleteCheckpointError` when the file is missing,
    `CorruptCheckpointError` when it disagrees with its record.
    """
    directory = locations.location(directory)
    file = directory / name
    records = () if checkpoint is None else checkpoint.records(name)
    if checkpoint is not None:
        if not records:
            if not open_storage(directory).exists(name):  # said first: an unfinished save
                _missing(directory, name)
            raise CorruptCheckpointError(
                f"{manifest.manifest_path(directory)}: lists no {name}: the manifest and the "
                "metadata do not belong together")
        record = records[0]
        data = _read_metadata(checkpoint.real_path(name), file, record.file_bytes,
                              "the manifest records")
        if len(data) != record.file_bytes or zlib.crc32(data) != record.crc32:
            raise CorruptCheckpointError(
                f"{file}: {len(data)} bytes with CRC-32 {zlib.crc32(data):#010x}, the manifest "
                f"records {record.file_bytes} bytes with {record.crc32:#010x}: the metadata is "
                "damaged")
        return data
    if not open_storage(directory).exists(name):
        _missing(directory, name)
    legacy = _legacy_record(directory, name)
    if legacy is None:
        return _read_metadata(file, file, MAX_UNRECORDED_METADATA_BYTES,
                              "nvcomp_ckpt_engine reads without a record of its size, at most")
    size, digest, sidecar = legacy
    data = _read_metadata(file, file, size, f"{sidecar.name} records")
    if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
        raise CorruptCheckpointError(
            f"{file}: {len(data)} bytes whose SHA-256 differs from the one recorded "
            f"in {sidecar.name} ({size} bytes): the metadata is damaged")
    return data


def _missing(directory: locations.Location, name: str) -> NoReturn:
    raise IncompleteCheckpointError(
        f"{directory}: no {name}; DCP writes it last, so the save did not finish "
        "(or this is not a DCP checkpoint)")


def _read_metadata(path: locations.Location, file: locations.Location, limit: int, recorded: str) -> bytes:
    """The bytes of metadata file `file` (at `path`, its real path), refused by its size from
    `fstat`, unread, when they are more than `limit` (what its record says, `recorded`)."""
    try:
        return locations.read_small(path, limit, what="the metadata")
    except FileNotFoundError:
        _missing(file.parent, file.name)
    except TooLargeError as exc:
        raise CorruptCheckpointError(
            f"{file}: {exc.size} bytes, more than the {limit} {recorded}: the metadata is "
            "damaged (refused unread)") from None
    except ValueError as exc:  # not a regular file
        raise CorruptCheckpointError(str(exc)) from None


def checked_rank_file(checkpoint: opened.OpenedCheckpoint | None, directory: str | os.PathLike,
                      relative_path: str) -> tuple[locations.Location, ShardIndex | None]:
    """The rank file ``.metadata`` places items in at `relative_path`, and its index as the open
    step read it (None: the reader reads it).

    Without a manifest (a folder an older version saved), the file as named. With one, only a
    file the manifest lists (else `CorruptCheckpointError`: only the files a save committed are
    read), checked as every listed file of a tag is at its first use
    (`opened.OpenedCheckpoint.checked`): its real path inside the folder, its size, and with
    `verify` the CRC-32 its index implies against its record, which equals the file's real CRC
    once every chunk matches its own, as every read checks: no file is read twice.
    """
    if checkpoint is None:
        return locations.location(directory) / relative_path, None
    if not checkpoint.records(relative_path):
        raise CorruptCheckpointError(
            f"{locations.location(directory) / relative_path}: .metadata places items in it, but the manifest "
            "does not list it: it is not a file this checkpoint committed")
    path = checkpoint.checked(relative_path)
    return path, checkpoint.indexes.get(path)


def _has_rank_files(directory: locations.Location) -> bool:
    return any(entry.key.endswith(SHARD_SUFFIX) for entry in open_storage(directory).list())


def _legacy_checksum_path(metadata_file: locations.Location) -> locations.Location:
    return metadata_file.parent / (metadata_file.name + LEGACY_CHECKSUM_SUFFIX)


def _legacy_record(directory: locations.Location, name: str) -> tuple[int, str, locations.Location] | None:
    """The size and SHA-256 an older version's checksum file records for metadata file `name`,
    and that file; None where there is none and the folder holds no rank files of ours (DCP's
    own writer's folder, read unchecked)."""
    sidecar = _legacy_checksum_path(directory / name)
    try:
        text = locations.read_small(sidecar, _MAX_LEGACY_CHECKSUM_BYTES, what="a checksum file")
    except FileNotFoundError:
        if _has_rank_files(directory):
            raise IncompleteCheckpointError(
                f"{directory}: no {manifest.MANIFEST_NAME} and no {sidecar.name}; "
                "nvcomp_ckpt_engine writes one of them last, so the save did not finish (or the "
                "file was removed): the metadata cannot be checked") from None
        return None
    except ValueError as exc:  # too large, or not a regular file (a folder)
        raise CorruptCheckpointError(f"{sidecar}: not the checksum file ({exc})") from None
    try:
        record = json.loads(text)
        expected = (record["format"], record["version"], record["file"])
        size, digest = record["bytes"], record["sha256"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:  # RecursionError: nesting
        raise CorruptCheckpointError(f"{sidecar}: damaged ({type(exc).__name__}: {exc})") from exc
    if expected != (_LEGACY_FORMAT, _LEGACY_VERSION, name):
        raise CorruptCheckpointError(
            f"{sidecar}: not the checksum file of {name} ({expected}); damaged, or from a newer "
            "nvcomp_ckpt_engine")
    if type(size) is not int or size < 0 or not isinstance(digest, str):
        raise CorruptCheckpointError(f"{sidecar}: damaged (bytes {size!r}, sha256 {digest!r})")
    return size, digest, sidecar
