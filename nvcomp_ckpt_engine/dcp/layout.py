"""What a DCP checkpoint folder of ours holds: file names, the item records DCP pickles, item keys.

A checkpoint directory holds DCP's ``.metadata`` (written last by the coordinator; its
``storage_data`` maps every item to an `ItemLocation`) and one shard file per rank that had
items, ``__{rank}_0.nvcomp.distcp`` (docs/FORMAT.md): every item of that rank, tensors as they
are and bytes items as uint8 tensors. This module is the vocabulary the writer, the reader and
the tools share; it reads no file but the first bytes of one (`is_dcp_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from .. import container
from ..errors import UnsupportedCheckpointError
from ..storage import is_file, locations, open_storage

#: Name ending of our per-rank files. It ends in "distcp" like DCP's own files, so tools that
#: pick a checkpoint's data files by that ending (Megatron-Core's `remove_sharded_tensors`)
#: still find them.
SHARD_SUFFIX = ".nvcomp.distcp"
#: DCP's metadata file (written by the coordinator after every rank's data is written).
METADATA_FILE = ".metadata"
#: Suffix of DCP's stock data files, used for the files `decompress_dcp` writes.
STOCK_SUFFIX = ".distcp"
#: The skeleton of a rank file: which of its keys are tensors and which bytes items.
SKELETON_FORMAT = "nvcomp_ckpt_engine.dcp"
SKELETON_VERSION = 1
ITEM_KINDS = ("tensor", "bytes")
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
    its import path, ``nvcomp_ckpt_engine.dcp.ItemLocation``, and its fields: the class lives
    in this module but is pickled (and found again) under the package's name, which exports it.
    """

    __module__ = "nvcomp_ckpt_engine.dcp"

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


def item_key(index: MetadataIndex) -> str:
    """The key an item has in its rank file: the FQN, plus the chunk offsets for a tensor."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def split_key(key: str, kind: str) -> tuple[str, list[int]]:
    """(FQN, chunk offsets) of an item key (`item_key`); a key that does not parse as a
    tensor chunk's is shown whole."""
    fqn, at, offsets = key.rpartition("@")
    if kind == "bytes" or not at:
        return key, []
    try:
        return fqn, [int(o) for o in offsets.split(",") if o]
    except ValueError:
        return key, []


def metadata_name(rank: int | None) -> str:
    """The metadata file DCP writes: ``.metadata``, or ``__{rank}.metadata`` for a save
    without collectives."""
    return METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"


def shard_paths(directory: locations.Location) -> list[locations.Location]:
    """Our rank files in `directory`, in name order."""
    storage = open_storage(directory)
    return [directory / entry.key for entry in storage.list()
            if entry.key.endswith(SHARD_SUFFIX) and is_file(storage, entry.key)]


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """True if `path` is a directory holding a DCP ``.metadata`` and our rank files (cheap:
    reads no metadata and only the first bytes of one file)."""
    directory = locations.location(path)
    try:
        if not is_file(open_storage(directory), METADATA_FILE):
            return False
    except (ValueError, OSError):  # not a folder
        return False
    return any(container.is_shard_file(p) for p in shard_paths(directory))

