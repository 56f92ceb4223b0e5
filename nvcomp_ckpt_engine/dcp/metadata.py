"""DCP's ``.metadata`` of a checkpoint: its unpickling through the allowlist, and the checks of
what it says (its shape, every item recorded in a file inside the checkpoint).

DCP's ``.metadata`` is a pickle without a checksum: a flipped bit in it may still unpickle, into
other metadata. Its bytes are checked against the manifest first (`integrity`), then
unpickled through the allowlist, never by plain pickle: by the tools (`tools.py`) and by
`NvcompFileSystemReader` under `dcp.load` alike, so neither looking at nor loading an untrusted
checkpoint runs code from it, even one whose manifest was forged to match.
"""

from __future__ import annotations

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
from ..errors import CorruptCheckpointError
from ..storage import locations
from .integrity import checked_metadata_bytes, open_dcp_checkpoint
from .layout import METADATA_FILE, ItemLocation

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
    data = checked_metadata_bytes(path, checkpoint=open_dcp_checkpoint(path))
    return unpickle_metadata(path, data, trusted=trusted)


def unpickle_metadata(path: str | os.PathLike, data: bytes, *, trusted: bool = False,
                      name: str = METADATA_FILE) -> Metadata:
    """`read_metadata` of bytes already checked (`integrity.checked_metadata_bytes`): the
    bytes that were checked are the bytes unpickled, so a file swapped in between is not read.
    `name` is the metadata file's (``__{rank}.metadata`` for a save without collectives)."""
    file = locations.location(path) / name
    allowed = None if trusted else state.safe_globals(DCP_METADATA_GLOBALS)
    metadata = state.unpickle(data, allowed=allowed, source=str(file), what="the pickle")
    _check_structure(metadata, file)
    return metadata


def _is_offsets(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(v) is int for v in value)


def _check_structure(metadata: Any, file: locations.Location) -> None:
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


def check_coverage(directory: locations.Location, metadata: Metadata) -> None:
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
        if not locations.is_inside(directory / name, directory):
            raise CorruptCheckpointError(
                f"{directory / name}: resolves to {locations.real(directory / name)}, "
                "outside the checkpoint directory")

