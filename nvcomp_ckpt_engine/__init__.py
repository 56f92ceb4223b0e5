"""nvcomp_ckpt_engine: lossless, GPU-compressed, crash-safe checkpoints for large-model training.

The public surface is short on purpose: `save` / `load` for one shard file, the exceptions in
`errors`, `add_safe_classes` for the skeleton allowlist, and the DeepSpeed engine in
`nvcomp_ckpt_engine.deepspeed`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .api import PendingSave, is_shard_file, load, save, save_async  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    CodecError,
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeObjectError,
    UnsupportedCheckpointError,
)
from .pipeline import ShardInfo  # noqa: E402
from .state import add_safe_classes  # noqa: E402

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
