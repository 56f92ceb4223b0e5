"""One shard opened for reading parts of it: its objects now, its tensors piece by piece.

`load` decodes a whole file at once, which costs memory for all of it. A converter that needs
one parameter's slice of a rank's flat optimizer partition at a time opens the shard with
`LazyShard` instead: the skeleton is unpickled (through the same allowlist as `load`) with a
`TensorRef` in place of every tensor, and `read` decodes only the chunks that hold the asked
elements, each checked against its CRC-32 first. `copy` writes a new shard of objects taken
from this one, copying the stored (compressed) bytes of their tensors without decoding them.

Thread safety: `read` may be called from several threads at once (positional reads, a shared
decode pool, one set of codec objects per thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import dataclasses
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from . import api, container, pipeline, state
from .codecs import Codec
from .container import DTYPES, ShardIndex, TensorEntry
from .pipeline import ShardInfo
from .storage import Reader, locations

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a `LazyShard`, not read yet: where the object held the tensor.

    `shard` identifies the file it belongs to (its path), so a ref is never read from, or
    copied out of, another shard by mistake.
    """

    shard: str
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: The Python attributes the tensor carries (its skeleton sets them as it is unpickled).
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _contiguous(entry: TensorEntry) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(entry.shape, entry.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class LazyShard:
    """A shard whose skeleton is read and whose tensors are read on demand; close it after use.

    `obj` is the saved object with a `TensorRef` for each tensor. `trusted`, `verify` and
    `safe_classes` mean what they mean for `nvcomp_ckpt_engine.load`. Chunks are decoded in
    `pool` (one of its own, of `workers` threads, if None; many shards open at once should
    share one). `index`: the shard's index, when the caller has read it already.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trusted: bool = False,
        verify: bool = True,
        safe_classes: Iterable[type | Callable[..., Any] | str] = (),
        workers: int | None = None,
        pool: cf.Executor | None = None,
        index: ShardIndex | None = None,
    ) -> None:
        self.index: ShardIndex = index or container.read_index(path)
        self.path = self.index.path
        self.verify = verify
        self._reader: Reader | None = locations.open_reader(self.path)
        try:
            skeleton = container.read_skeleton(self._reader, self.index, verify=verify)
            refs = [TensorRef(self.path, i, DTYPES[t.dtype], t.shape)
                    for i, t in enumerate(self.index.tensors)]
            self.obj = state.unflatten(skeleton, refs, trusted=trusted, safe_classes=safe_classes,
                                       source=self.path,
                                       tensor_attributes=self.index.tensor_attributes,
                                       keys=[t.key for t in self.index.tensors])
        except BaseException:
            self._reader.close()
            raise
        self._own_pool = pool is None
        self._pool = pool or cf.ThreadPoolExecutor(workers or pipeline.default_workers(),
                                                   thread_name_prefix="nvckpt-lazy")
        self._local = threading.local()

    def __enter__(self) -> LazyShard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._reader is not None:
            if self._own_pool:
                self._pool.shutdown()
            self._reader.close()
            self._reader = None

    def _open(self) -> Reader:
        if self._reader is None:
            raise ValueError(f"{self.path}: read after close")
        return self._reader

    def _entry(self, ref: TensorRef) -> TensorEntry:
        if not isinstance(ref, TensorRef) or ref.shard != self.path:
            raise ValueError(f"{ref!r} is not a tensor of {self.path}")
        return self.index.tensors[ref.index]

    def _decoders(self) -> dict[tuple[str, bool], Codec]:
        """This thread's codec objects (nvCOMP's are not shared between threads)."""
        if not hasattr(self._local, "decoders"):
            self._local.decoders = {}
        return self._local.decoders

    def read(self, ref: TensorRef, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of the tensor in row-major order, as a 1-D CPU tensor.

        A contiguous tensor costs the decoding of the chunks that hold those elements only, and
        memory for them and at most two chunks more. The result may view a larger buffer.
        """
        entry = self._entry(ref)
        numel = ref.numel - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > ref.numel:
            raise ValueError(f"{self.path}: elements [{start}, {start + numel}) are outside tensor "
                             f"{entry.key!r} of {ref.numel} elements")
        if numel == 0:
            return torch.empty(0, dtype=ref.dtype)
        if _contiguous(entry):
            itemsize = ref.dtype.itemsize
            lo = (entry.offset + start) * itemsize
            span = pipeline.read_storage_span(
                self._open(), self.index, entry.storage, lo, lo + numel * itemsize, _CPU,
                verify=self.verify, pool=self._pool, decoders=self._decoders())
            return span.view(ref.dtype)
        whole = pipeline.read_storage(self._open(), self.index, entry.storage, _CPU, verify=self.verify,
                                      pool=self._pool, decoders=self._decoders())
        return pipeline.view_tensor(whole, entry, self.path).reshape(-1)[start : start + numel]

    def read_tensor(self, ref: TensorRef) -> torch.Tensor:
        """The whole tensor, as `load` would return it (shape, and Parameter or requires_grad
        as saved, with its Python attributes), in host memory."""
        entry = self._entry(ref)
        flat = self.read(ref).clone()
        tensor = pipeline.view_tensor(flat, dataclasses.replace(
            entry, offset=0, stride=contiguous_strides(entry.shape)), self.path)
        vars(tensor).update(ref.attributes)
        return tensor

    def materialize(self, obj: Any) -> Any:
        """`obj` with every `TensorRef` of this shard in it replaced by the tensor it stands for
        (`read_tensor`); containers are copied, other objects kept as they are."""
        if isinstance(obj, TensorRef):
            return self.read_tensor(obj)
        if isinstance(obj, dict):  # the same kind of dict: an OrderedDict, a defaultdict's factory
            result = copy.copy(obj)
            for key, value in obj.items():
                result[key] = self.materialize(value)
            return result
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self.materialize(v) for v in obj)
        return obj

    def copy(self, obj: Any, path: str | os.PathLike, *, durable: bool = True) -> ShardInfo:
        """Write `obj` to a new shard at `path`; its tensors must be `TensorRef`s of this shard.

        The storages those tensors view are copied as they are stored (compressed, with their
        codec, transform, CRCs and derived ranges), checked chunk by chunk against their CRCs
        as they are read: no decoding, and memory for one chunk at a time. The file is written
        as `save` writes one (a temporary name, then a rename; fsynced with `durable`), in the
        lowest format version that holds what it copies (`container.version_for`).
        """
        flat = state.flatten(obj, leaf=TensorRef)
        entries = [self._entry(ref) for ref in flat.tensors]
        renumbered: dict[int, int] = {}
        for entry in entries:
            renumbered.setdefault(entry.storage, len(renumbered))
        ranges = [r for i in renumbered for r in self.index.storages[i].derived]
        version = container.version_for(
            derived=bool(ranges), tensor_attributes=flat.tensor_attributes,
            derived_digests=any(r.digest is not None for r in ranges))
        writer = container.ShardWriter(path, durable=durable, version=version)
        try:
            writer.write_skeleton(flat.skeleton)
            for old in renumbered:
                self._copy_storage(self._open(), writer, old)
            size, crc = writer.finish(
                [dataclasses.replace(e, key=key, storage=renumbered[e.storage])
                 for e, key in zip(entries, flat.keys)],
                api.writer_info(),
            )
        except BaseException:
            writer.abort()
            raise
        stored = [self.index.storages[i] for i in renumbered]
        raw = sum(s.nbytes for s in stored) + len(flat.skeleton)
        return ShardInfo(os.fspath(path), raw, size, crc, tuple(sorted({s.codec["name"] for s in stored})))

    def _copy_storage(self, f: Reader, writer: container.ShardWriter, i: int) -> None:
        entry = self.index.storages[i]
        new = writer.begin_storage(nbytes=entry.nbytes, dtype=entry.dtype, device=entry.device,
                                   codec=entry.codec, transform=entry.transform,
                                   derived=entry.derived)
        for j, blob in enumerate(entry.chunks):
            data = container.read_blob(f, blob, path=self.path,
                                       what=container.chunk_name(self.index, i, j))
            writer.append_chunk(new, data, raw_length=blob.raw_length, stored_raw=blob.stored_raw,
                                crc32=blob.crc32)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, as a shard's index records them (a size-0
    dimension counted as 1, as torch does)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
