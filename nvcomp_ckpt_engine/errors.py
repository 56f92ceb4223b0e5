"""The exceptions users of nvcomp_ckpt_engine catch.

Every failure the engine can detect in a file, a codec or the distributed commit is a
`CheckpointError`, so a training script can catch one type. Caller mistakes (a wrong argument
type, an unknown option) stay built-in `TypeError` / `ValueError` with the remedy in the message.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error the engine raises about a checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, damaged or not what its index or the manifest says.

    The message names the file and, where it applies, the tensor key and chunk at fault.
    """


class UnsupportedCheckpointError(CheckpointError):
    """A well-formed file this installation cannot read.

    Unknown format version, a codec that is not available here (for example an nvCOMP ANS file
    on a machine without a GPU), or an nvCOMP bitstream from an incompatible nvCOMP release.
    """


class DataParallelSizeError(UnsupportedCheckpointError):
    """A checkpoint's optimizer state refused at a data-parallel size other than its own.

    Raised where a load cannot reshard it (the checkpoint records no partitions, or the job's
    optimizer is not cut as the plan needs); the message names what differs and the conversion
    that works. With DeepSpeed the error is also DeepSpeed's own refusal of such a load,
    `ZeRORuntimeException`, so code that catches DeepSpeed's catches it.
    """


class UnsafeObjectError(CheckpointError):
    """The file's skeleton names a class outside the allowlist.

    Loading never runs code from a file by default; the message names the class and the two ways
    out: `nvcomp_ckpt_engine.add_safe_classes(...)` or `trusted=True` for files you trust.
    """


class CodecError(CheckpointError):
    """A codec failed while encoding or decoding (for example nvCOMP reported an error)."""


class CommitError(CheckpointError):
    """The distributed commit failed: a rank reported an error, died, or timed out.

    The message names the ranks at fault and their errors.
    """


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory has no valid manifest, or its files disagree with it."""


__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsupportedCheckpointError",
    "DataParallelSizeError",
    "UnsafeObjectError",
    "CodecError",
    "CommitError",
    "IncompleteCheckpointError",
]
