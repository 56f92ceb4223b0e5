"""DCP's ``.metadata`` of a checkpoint: its integrity check, its unpickling through the
allowlist, and the checks of what it says (its shape, every item recorded in a file inside the
checkpoint).

DCP's ``.metadata`` is a pickle without a checksum: a flipped bit in it may still unpickle, into
other metadata. `dcp.load` unpickles it as DCP always does, once its bytes passed the check; the
tools (`tools.py`) read it through `read_metadata` instead, so looking at an untrusted
checkpoint runs no code from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .. import state
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..storage import atomic_write_bytes, fsync_dir, is_inside
from .layout import METADATA_FILE, SHARD_SUFFIX, ItemLocation

#: Appended to a metadata file's name for its checksum file.
CHECKSUM_SUFFIX = ".nvcomp.json"
_CHECKSUM_FORMAT = "nvcomp_ckpt_engine.dcp_metadata"
_CHECKSUM_VERSION = 1


def checksum_path(metadata_file: Path) -> Path:
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
    atomic_write_bytes(checksum_path(file), (json.dumps(record, sort_keys=True) + "\n").encode(),
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
    sidecar = checksum_path(file)
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


def locations_by_file(metadata: Metadata) -> dict[str, list[tuple[MetadataIndex, ItemLocation]]]:
    """Our items of `metadata` grouped by the rank file that holds them (stock records left out)."""
    by_file: dict[str, list[tuple[MetadataIndex, ItemLocation]]] = {}
    for index, location in metadata.storage_data.items():
        if isinstance(location, ItemLocation):
            by_file.setdefault(location.relative_path, []).append((index, location))
    return by_file


def check_coverage(directory: Path, metadata: Metadata) -> None:
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

