"""The one place that names DCP's private storage record, and the torch versions tested with it.

DCP's stock FileSystemReader accepts only its own private `_StorageInfo` record in
``.metadata`` (torch 2.x). `decompress_dcp` must write that record for the checkpoint it
produces. Tested with torch 2.13; other versions are accepted while the record keeps the three
fields the stock reader uses.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from ..errors import UnsupportedCheckpointError

logger = logging.getLogger(__name__)

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

