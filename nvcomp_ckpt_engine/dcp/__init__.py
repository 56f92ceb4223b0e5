"""torch.distributed.checkpoint (DCP) storage that writes each rank's items compressed.

`NvcompFileSystemWriter` and `NvcompFileSystemReader` are DCP's `FileSystemWriter` and
`FileSystemReader` with only the data paths replaced, so DCP's planning, resharding, metadata
and commit stay DCP's own. docs/DCP.md has the user's view. One job per module:

    layout.py            file names, the `ItemLocation` record DCP pickles, item keys
    writer.py            `NvcompFileSystemWriter`, `prepare_items` (also Megatron's)
    reader.py            `NvcompFileSystemReader`, `RankFile`, `check_item`
    tiered.py            `DcpLocalTier`: the node-local tier around `dcp.save`,
                         `dcp.async_save` and `dcp.load`
    integrity.py         the manifest of a save (its commit point); at load, the folder opened
                         through opened.py as a tag folder is, and .metadata's own checks
    metadata.py          ``.metadata``: allowlisted unpickling, shape and coverage checks
    tools.py             what the CLI calls: inspect, verify, decompress
    _torch_internals.py  DCP's private storage record, the torch versions tested with it
"""

from .layout import (
    METADATA_FILE,
    SHARD_SUFFIX,
    STOCK_SUFFIX,
    ItemLocation,
    StockReaderError,
    is_dcp_checkpoint,
)
from .metadata import DCP_METADATA_GLOBALS, read_metadata
from .reader import NvcompFileSystemReader, RankFile
from .tiered import DcpLocalTier
from .tools import dcp_faults, decompress_dcp, inspect_dcp, verify_dcp
from .writer import NvcompFileSystemWriter, PreparedItems, describe_writer, prepare_items

__all__ = [
    "DCP_METADATA_GLOBALS",
    "DcpLocalTier",
    "ItemLocation",
    "METADATA_FILE",
    "NvcompFileSystemReader",
    "NvcompFileSystemWriter",
    "PreparedItems",
    "RankFile",
    "SHARD_SUFFIX",
    "STOCK_SUFFIX",
    "StockReaderError",
    "dcp_faults",
    "decompress_dcp",
    "describe_writer",
    "inspect_dcp",
    "is_dcp_checkpoint",
    "prepare_items",
    "read_metadata",
    "verify_dcp",
]
