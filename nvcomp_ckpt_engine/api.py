"""`save` and `load`: drop-in replacements for `torch.save` / `torch.load` on state dicts.

``save(obj, path)`` writes one compressed, self-describing shard file atomically at exactly
`path` (a temporary name, fsync, rename), so a crash leaves the old file or the new one, never
a torn one. ``load(path, map_location)`` reads it back bit-exact; `map_location` behaves as in
`torch.load`. Loading never runs code from the file unless ``trusted=True`` (see state.py).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Iterable

import torch

from . import __version__, container, pipeline, state
from .codecs import backend_summary, validate_algorithm
from .errors import CheckpointError
from .pipeline import ShardInfo

#: Default chunk size: large enough for nvCOMP and zstd to reach full speed, small enough that
#: chunks pipeline well and a damaged chunk costs little.
DEFAULT_CHUNK_MB = 16


def save(
    obj: Any,
    path: str | os.PathLike,
    *,
    algorithm: str = "auto",
    portable: bool = False,
    chunk_mb: float = DEFAULT_CHUNK_MB,
    durable: bool = True,
    workers: int | None = None,
) -> ShardInfo:
    """Compress `obj` (a nested state dict) into one shard file at `path`.

    Args:
        algorithm: "auto" (per dtype, from measurements: nvCOMP ANS on a GPU, zstd with byte
            planes on the CPU), or one of "ans", "zstd", "gdeflate", "deflate", "bitcomp",
            "cascaded", "lz4", "none". GPU-only codecs need nvCOMP and CUDA.
        portable: use only codecs a machine without a GPU can decode (zstd, deflate).
        chunk_mb: chunk size in MiB; each chunk is compressed, checksummed and written apart.
        durable: fsync the file and its directory before returning.
        workers: CPU codec threads (default: one per core, at most 8).

    The caller must not modify the tensors while `save` runs.
    """
    validate_algorithm(algorithm, portable=portable)
    if not isinstance(chunk_mb, (int, float)) or not 1 / 1024 <= chunk_mb <= 1024:
        raise ValueError(f"chunk_mb must be between 1/1024 and 1024 MiB, got {chunk_mb!r}")
    flat = state.flatten(obj)
    writer_info = {
        "package": f"nvcomp_ckpt_engine {__version__}",
        "torch": torch.__version__.split("+")[0],
        "nvcomp": backend_summary()["nvcomp"],
    }
    return pipeline.write_shard(
        path, flat.skeleton, flat.tensors, flat.keys,
        algorithm=algorithm, portable=portable, chunk_bytes=int(chunk_mb * (1 << 20)),
        durable=durable, writer_info=writer_info, workers=workers,
    )


def load(
    path: str | os.PathLike,
    map_location: pipeline.MapLocation = None,
    *,
    trusted: bool = False,
    verify: bool = True,
    safe_classes: Iterable[type | Callable[..., Any] | str] = (),
    workers: int | None = None,
) -> Any:
    """Load an object saved by `save`, bit-exact.

    Args:
        map_location: as in `torch.load`: None (devices as saved), a device or string, a dict
            mapping saved locations to new ones, or a callable ``f(storage, location)``.
        trusted: allow the skeleton to create any class (only for files you trust).
        verify: check every chunk's CRC-32 before decoding it.
        safe_classes: classes (or "module.QualName" strings) to allow for this call only.
    """
    source = os.fspath(path)

    def rebuild(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
        try:
            return state.unflatten(skeleton, tensors, trusted=trusted, safe_classes=safe_classes,
                                   source=source)
        except CheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError,
                KeyError, TypeError, ValueError, MemoryError, RecursionError) as exc:
            raise container.skeleton_error(source, exc) from exc

    return pipeline.read_shard(source, map_location=map_location, verify=verify, rebuild=rebuild,
                               workers=workers)


is_shard_file = container.is_shard_file
