"""nvcomp_ckpt_engine: lossless, GPU-compressed, crash-safe checkpoints for large-model training.

The public surface is short on purpose: `save` / `load` for one shard file, the exceptions in
`errors`, `add_safe_classes` for the skeleton allowlist, and the DeepSpeed engine in
`nvcomp_ckpt_engine.deepspeed`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__
from .errors import (
    CheckpointError,
    CodecError,
    CommitError,
    CorruptCheckpointError,
    DataParallelSizeError,
    IncompleteCheckpointError,
    UnsafeObjectError,
    UnsupportedCheckpointError,
)

#: Public name -> the module of this package that defines it, imported on first use: torch loads
#: with them, not with the package, so the torch-free parts (`manifest`, `container`, the
#: `inspect`/`verify` commands) run where torch is not installed.
_EXPORTS = {
    "PendingSave": "api",
    "ShardInfo": "pipeline",
    "add_safe_classes": "state",
    "is_shard_file": "container",
    "load": "api",
    "save": "api",
    "save_async": "api",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = [
    "CheckpointError",
    "CodecError",
    "CommitError",
    "CorruptCheckpointError",
    "DataParallelSizeError",
    "IncompleteCheckpointError",
    "UnsafeObjectError",
    "UnsupportedCheckpointError",
    "__version__",
    *_EXPORTS,
]
