"""Megatron-Core's own files in a checkpoint folder: what the DCP tools must know of them.

Megatron-Core records the sharded backend of a checkpoint in ``metadata.json``; saves with
`nvcomp_ckpt_engine.megatron` record ``nvcomp_torch_dist``. A decompressed copy must name the
stock ``torch_dist`` backend so that stock Megatron-Core loads it. This module imports neither
Megatron-Core nor torch, so `nvcomp-ckpt decompress` works where Megatron-Core is not installed;
the Megatron adapter (`megatron.py`, which needs Megatron-Core) takes its backend name from here.
"""

from __future__ import annotations

import json
from pathlib import Path

from .storage import locations

#: Megatron-Core's checkpoint config file, beside the DCP files.
CONFIG_FILE = "metadata.json"
#: The backend name ``metadata.json`` records for checkpoints saved with our strategy.
BACKEND = "nvcomp_torch_dist"
#: Megatron-Core's stock backend, which reads plain DCP files.
STOCK_BACKEND = "torch_dist"
#: Megatron-Core's ``metadata.json`` is a few hundred bytes; a larger file is copied unread.
MAX_CONFIG_BYTES = 1 << 20


def copy_as_stock(src: Path, dst: Path) -> None:
    """Copy `src`; a Megatron-Core ``metadata.json`` naming our backend names the stock one in
    the copy (anything else is copied as it is)."""
    if src.name != CONFIG_FILE:
        locations.copy(src, dst)
        return
    try:
        config = json.loads(locations.read_small(src, MAX_CONFIG_BYTES, what="Megatron's config")
                            .decode("utf-8"))
    except (ValueError, RecursionError):  # not Megatron's config: too large, not JSON, nested
        locations.copy(src, dst)
        return
    if isinstance(config, dict) and config.get("sharded_backend") == BACKEND:
        config["sharded_backend"] = STOCK_BACKEND
    locations.publish(dst, json.dumps(config).encode("utf-8"))


__all__ = ["BACKEND", "CONFIG_FILE", "STOCK_BACKEND", "copy_as_stock"]
