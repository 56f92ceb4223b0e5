"""nvcomp_ckpt_engine: lossless, GPU-compressed, crash-safe checkpoints for large-model training.

The public surface is short on purpose: `save` / `load` for one shard file, the exceptions in
`errors`, `add_safe_classes` for the skeleton allowlist, and the DeepSpeed engine in
`nvcomp_ckpt_engine.deepspeed`.
"""

from __future__ import annotations

from ._version import __version__
from .api import PendingSave, is_shard_file, load, save, save_async
from .errors import (
    CheckpointError,
    CodecError,
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeObjectError,
    UnsupportedCheckpointError,
)
from .pipeline import ShardInfo
from .state import add_safe_classes

__all__ = [
    "CheckpointError",
    "CodecError",
    "CommitError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "PendingSave",
    "ShardInfo",
    "UnsafeObjectError",
    "UnsupportedCheckpointError",
    "__version__",
    "add_safe_classes",
    "is_shard_file",
    "load",
    "save",
    "save_async",
]
