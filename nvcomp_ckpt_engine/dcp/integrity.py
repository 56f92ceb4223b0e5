"""Which files a DCP checkpoint of ours consists of, and their checks: the project's manifest.

A DCP checkpoint gets the completeness and integrity story of a DeepSpeed tag (manifest.py):
once DCP's coordinator has written ``.metadata``, it writes ``nvcomp_manifest.json`` listing
every rank file and ``.metadata`` itself with their sizes and CRC-32s (the commit point: a folder
holding our rank files and no manifest did not finish saving). Each rank reports its file's
record to the coordinator inside its DCP write results (`file_result`), which the coordinator
takes out again before DCP builds ``.metadata`` (`split_results`): no file is read back but
``.metadata``. A load checks the manifest (intact, every file present with its size), the bytes
of ``.metadata`` against their record before they are unpickled, and each rank file's CRC as its
index describes it before its items are read (`check_rank_file`); every chunk's own CRC is
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from .. import manifest, pipeline
from .._version import __version__
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
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


# ------------------------------------------------------------------------------ saving


def file_result(info: pipeline.ShardInfo, relative_path: str) -> WriteResult:
    """The write result that reports one written rank file to the coordinator (added to the
    rank's item results; `split_results` takes it out)."""
    record = manifest.ShardRecord(path=relative_path, rank=0, raw_bytes=info.raw_bytes,
                                  file_bytes=info.file_bytes, crc32=info.crc32,
                                  codecs=info.codecs)
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
                              coordinator_rank: int, layout: Mapping[str, Any],
                              durable: bool = True) -> manifest.Manifest:
    """Publish the manifest of a DCP save (the coordinator, once ``.metadata`` is written):
    the rank files' `records` and ``.metadata``, measured here. The commit point."""
    directory = Path(directory)
    data = (directory / METADATA_FILE).read_bytes()
    metadata_record = manifest.ShardRecord(path=METADATA_FILE, rank=coordinator_rank,
                                           raw_bytes=len(data), file_bytes=len(data),
                                           crc32=zlib.crc32(data))
    found = manifest.build_manifest(
        tag=_tag_of(directory), world_size=world_size, files=[*records, metadata_record],
        layout=layout, versions={"nvcomp_ckpt_engine": __version__,
                                 "torch": torch.__version__.split("+")[0]},
        created_unix_ns=time.time_ns(),
    )
    manifest.write_manifest(directory, found, durable=durable)
    return found


def _tag_of(directory: Path) -> str:
    name = directory.resolve().name
    try:
        return manifest.validate_tag(name)
    except (TypeError, ValueError):
        return _FALLBACK_TAG


def remove_commit(directory: str | os.PathLike) -> bool:
    """Remove what makes `directory` a loadable checkpoint, commit point first (the manifest,
    ``.metadata``, an older version's checksum file); True if anything was removed."""
    directory = Path(directory)
    removed = False
    for old in (manifest.manifest_path(directory), directory / METADATA_FILE,
                _legacy_checksum_path(directory / METADATA_FILE)):
        if old.exists():
            old.unlink()
            removed = True
    return removed


# ----------------------------------------------------------------------------- loading


def find_manifest(directory: str | os.PathLike) -> manifest.Manifest | None:
    """The manifest of a DCP checkpoint, parsed and validated (not yet compared with the
    files); None for a folder without one (`checked_metadata_bytes` says whether that may be
    read). Raises `CorruptCheckpointError` for a damaged manifest."""
    if not os.path.lexists(manifest.manifest_path(directory)):
        return None
    return manifest.read_manifest(directory)


def checked_metadata_bytes(directory: str | os.PathLike, name: str = METADATA_FILE, *,
                           found: manifest.Manifest | None = None) -> bytes:
    """The bytes of metadata file `name`, checked before anything unpickles them.

    Against `found` (the manifest `find_manifest` returned): its size and CRC-32 must
    be the record's. Without a manifest, against an older version's checksum file, if the
    folder has one; a folder without our rank files (DCP's own writer's) is read unchecked.
    Raises `IncompleteCheckpointError` when the file is missing, `CorruptCheckpointError` when
    it disagrees with its record.
    """
    directory = Path(directory)
    file = directory / name
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory}: no {name}; DCP writes it last, so the save did not finish "
            "(or this is not a DCP checkpoint)") from None
    if found is not None:
        record = next((r for r in found.files if r.path == name), None)
        if record is None:
            raise CorruptCheckpointError(
                f"{manifest.manifest_path(directory)}: lists no {name}: the manifest and the "
                "metadata do not belong together")
        if len(data) != record.file_bytes or zlib.crc32(data) != record.crc32:
            raise CorruptCheckpointError(
                f"{file}: {len(data)} bytes with CRC-32 {zlib.crc32(data):#010x}, the manifest "
                f"records {record.file_bytes} bytes with {record.crc32:#010x}: the metadata is "
                "damaged")
        return data
    _check_legacy(directory, name, data)
    return data


def rank_file_record(found: manifest.Manifest | None, path: str | os.PathLike,
                     ) -> manifest.ShardRecord | None:
    """The manifest's record of rank file `path` (None without a manifest); a file the manifest
    does not list is refused: only the files a save committed are read."""
    if found is None:
        return None
    name = Path(path).name
    record = next((r for r in found.files if r.path == name), None)
    if record is None:
        raise CorruptCheckpointError(
            f"{path}: .metadata places items in it, but the manifest does not list it: it is "
            "not a file this checkpoint committed")
    return record


def check_rank_file(path: str | os.PathLike, index_crc: int,
                    record: manifest.ShardRecord | None) -> None:
    """Refuse a rank file whose index does not describe the file the manifest committed.

    The CRC-32 its index implies equals the file's real CRC once every chunk matches its own
    CRC, which every read checks before decoding a chunk: the file is checked without being
    read twice."""
    if record is not None and index_crc != record.crc32:
        raise CorruptCheckpointError(
            f"{path}: CRC-32 {index_crc:#010x} differs from the manifest's {record.crc32:#010x}: "
            "the file is not the one this checkpoint committed")


def _has_rank_files(directory: Path) -> bool:
    return any(p.name.endswith(SHARD_SUFFIX) for p in directory.iterdir())


def _legacy_checksum_path(metadata_file: Path) -> Path:
    return metadata_file.with_name(metadata_file.name + LEGACY_CHECKSUM_SUFFIX)


def _check_legacy(directory: Path, name: str, data: bytes) -> None:
    """Check metadata bytes against the checksum file of an older version, if there is one."""
    sidecar = _legacy_checksum_path(directory / name)
    try:
        text = sidecar.read_bytes()
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{sidecar}: a folder, not the checksum file") from None
    except FileNotFoundError:
        if _has_rank_files(directory):
            raise IncompleteCheckpointError(
                f"{directory}: no {manifest.MANIFEST_NAME} and no {sidecar.name}; "
                "nvcomp_ckpt_engine writes one of them last, so the save did not finish (or the "
                "file was removed): the metadata cannot be checked") from None
        return
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
    if size != len(data) or digest != hashlib.sha256(data).hexdigest():
        raise CorruptCheckpointError(
            f"{directory / name}: {len(data)} bytes whose SHA-256 differs from the one recorded "
            f"in {sidecar.name} ({size} bytes): the metadata is damaged")
