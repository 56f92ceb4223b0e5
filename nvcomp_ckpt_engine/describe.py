"""What one shard holds, in figures, from its index alone: the rows of `nvcomp-ckpt inspect`.

Each size is reported where it belongs, so that none is counted twice or shown as something it
is not:
- a tensor has its own size (elements × element size), never its storage's: ZeRO keeps many
  parameters as views of one flat buffer, whose size belongs to the buffer;
- a storage has its raw and stored bytes, codec, transform and chunk count, once, with the keys
  of the tensors that view it;
- a file has its fixed overhead (header, index, trailer), which is independent of the data. In a
  file that holds little data -- a ZeRO-3 model-states file, whose parameters live in the
  optimizer shards -- it outweighs the data and makes the file's ratio fall below 1;
- bytes a storage leaves to other files of its checkpoint (derived ranges: a ZeRO-1/2 module
  rebuilt from the optimizer shards' fp32 partitions) are counted as its raw bytes and named
  with the files they come from; they take no space in this file.
"""

from __future__ import annotations

import math
from typing import Any

from .container import ShardIndex, TensorEntry
from .formats import ITEMSIZES


def tensor_nbytes(tensor: TensorEntry) -> int:
    """The bytes of the tensor's own elements (a view of part of a storage counts its part)."""
    return math.prod(tensor.shape) * ITEMSIZES[tensor.dtype]


def overhead_bytes(index: ShardIndex) -> int:
    """The file's bytes that are neither tensor data nor the skeleton: header, index, trailer."""
    payload = sum(c.length for s in index.storages for c in s.chunks)
    return index.file_bytes - payload - index.skeleton.length


def describe_index(index: ShardIndex, name: str) -> dict[str, Any]:
    """The JSON document of one shard: file totals, its storages, and its tensors."""
    storages = []
    for s in index.storages:
        stored = sum(c.length for c in s.chunks)
        storages.append({
            "raw_bytes": s.nbytes, "stored_bytes": stored,
            "derived_bytes": s.nbytes - s.stored_nbytes,
            "derived_from": sorted({r.file for r in s.derived}),
            "ratio": s.nbytes / stored if stored else 1.0, "codec": s.codec,
            "transform": s.transform, "chunks": len(s.chunks), "tensors": [],
        })
    tensors = []
    for t in index.tensors:
        storages[t.storage]["tensors"].append(t.key)
        tensors.append({"key": t.key, "dtype": t.dtype, "shape": list(t.shape),
                        "nbytes": tensor_nbytes(t), "storage": t.storage})
    return {
        "path": name,
        "format_version": index.format_version,
        "writer": index.writer,
        "file_bytes": index.file_bytes,
        "raw_bytes": index.raw_bytes,
        "tensor_raw_bytes": sum(s["raw_bytes"] for s in storages),
        "stored_bytes": sum(s["stored_bytes"] for s in storages),
        "derived_bytes": sum(s["derived_bytes"] for s in storages),
        "derived_from": list(index.derived_files),
        "overhead_bytes": overhead_bytes(index),
        "ratio": index.raw_bytes / index.file_bytes if index.file_bytes else 1.0,
        "codecs": list(index.codecs),
        "storages": storages,
        "tensors": tensors,
    }


__all__ = ["describe_index", "overhead_bytes", "tensor_nbytes"]
