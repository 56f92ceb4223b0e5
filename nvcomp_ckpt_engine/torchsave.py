"""Bytes that `torch.save` wrote, read through the allowlist instead of `torch.load`.

Some of what a checkpoint holds is `torch.save`'s own output, not a shard of ours: DCP's planner
turns every value that is not a tensor (a step count, a config dict, a scheduler's state) into
a "bytes item" by ``torch.save(value, buffer)`` and reads it back with
``torch.load(buffer, weights_only=False)``, which runs any code the bytes name. Here such bytes
are read by the skeleton's `state.RestrictedUnpickler` instead: the same allowlist, the same
checks of what the pickle may build. The archive is torch's zip format (``data.pkl`` and one
``data/<key>`` entry per storage, stored uncompressed); the tensors it holds are rebuilt as
views of those entries' bytes, their extent checked against them first (torch's own `set_`
does not check that).

What comes back is the object itself; `safe_bytes` gives it back as new `torch.save` bytes of
it, for a reader that must hand bytes to code that will `torch.load` them (DCP's planner): an
object made only of allowlisted classes pickles to references to those classes alone.

A whole plain torch file (`load_file`: a DeepSpeed checkpoint saved before the engine was turned
on) can be gigabytes, which this module would hold several times over; it is read by torch's
own ``weights_only`` unpickler instead (memory-mapped storages, `map_location`), with the
engine's allowlist as the globals it may name.
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import math
import os
import pickle
import re
import zipfile
from typing import Any

import torch

from . import state
from .errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError

#: How torch.save names a tensor's storage type inside the pickle ("torch.FloatStorage"), and
#: the dtype each stands for.
_STORAGE_TYPES: dict[str, torch.dtype] = {
    f"torch.{name}Storage": dtype for name, dtype in (
        ("Float", torch.float32), ("Double", torch.float64), ("Half", torch.float16),
        ("BFloat16", torch.bfloat16), ("Long", torch.int64), ("Int", torch.int32),
        ("Short", torch.int16), ("Char", torch.int8), ("Byte", torch.uint8), ("Bool", torch.bool),
        ("ComplexFloat", torch.complex64), ("ComplexDouble", torch.complex128),
    )
}
_REBUILD_TENSOR = "torch._utils._rebuild_tensor_v2"
#: How pickle's protocol 2, torch.save's, writes a `bytes` object: ``_codecs.encode(text,
#: "latin1")``.
_ENCODE = "_codecs.encode"


class _StorageType:
    """What a storage type's name resolves to here: its dtype, nothing callable."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Storage:
    """One ``data/<key>`` entry of the archive, as the pickle's persistent id refers to it."""

    def __init__(self, data: bytes, dtype: torch.dtype) -> None:
        # One storage for every tensor that views it, as torch.load gives them.
        self.untyped = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).clone().untyped_storage()
            if data else torch.UntypedStorage(0))
        self.dtype = dtype


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                    backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """torch's `_rebuild_tensor_v2` for the archive's own storages only, its extent checked."""
    if not isinstance(storage, _Storage):
        raise ValueError(f"a tensor rebuilt from a {type(storage).__name__}, not a storage")
    dims = (size, stride)
    if (type(offset) is not int or offset < 0 or not all(isinstance(d, tuple) for d in dims)
            or len(size) != len(stride)
            or not all(type(n) is int and n >= 0 for n in (*size, *stride))):
        raise ValueError(f"a tensor of offset {offset!r}, size {size!r}, stride {stride!r}")
    if backward_hooks or metadata:
        raise ValueError("a tensor carrying backward hooks or metadata")
    itemsize = torch.empty(0, dtype=storage.dtype).element_size()
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if math.prod(size) else -1
    if (last + 1) * itemsize > storage.untyped.nbytes():
        raise ValueError(
            f"a tensor reaching element {last} of a storage of {storage.untyped.nbytes()} bytes")
    tensor = torch.empty(0, dtype=storage.dtype).set_(storage.untyped, offset, size, stride)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _latin1_bytes(text: Any, encoding: Any) -> bytes:
    """`_codecs.encode` as protocol 2 uses it, and for nothing else."""
    if type(text) is not str or encoding != "latin1":
        raise ValueError(f"_codecs.encode of a {type(text).__name__} as {encoding!r}")
    return text.encode("latin1")


class _ArchiveUnpickler(state.RestrictedUnpickler):
    """`RestrictedUnpickler` for a torch.save archive's ``data.pkl``: its storages are the
    archive's entries, its tensors rebuilt by `_rebuild_tensor` (charged nothing: a view)."""

    call_bytes = {**state.RestrictedUnpickler.call_bytes, _REBUILD_TENSOR: lambda a, k: 0}

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, *,
                 allowed: frozenset[str], source: str) -> None:
        super().__init__(data, [], allowed=allowed, source=source, tensor_attributes=False)
        self._archive = archive
        self._prefix = prefix
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if self.proto < 3:  # torch.save's protocol 2 names builtins as Python 2 did
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            else:
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        qualified = f"{module}.{name}"
        if qualified in _STORAGE_TYPES:
            return _StorageType(_STORAGE_TYPES[qualified])
        replacement = {_REBUILD_TENSOR: _rebuild_tensor, _ENCODE: _latin1_bytes}.get(qualified)
        if replacement is not None:
            self._names[id(replacement)] = (qualified, replacement)
            return replacement
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or type(pid[2]) is not str
                or type(pid[4]) is not int):
            raise CorruptCheckpointError(f"{self._source}: invalid storage reference {pid!r}")
        key = pid[2]
        if key not in self._storages:
            entry = _entry(self._archive, f"{self._prefix}data/{key}", self._source)
            self._storages[key] = _Storage(entry, pid[1].dtype)
        storage = self._storages[key]
        if storage.dtype != pid[1].dtype:
            raise CorruptCheckpointError(f"{self._source}: storage {key} referred to as two dtypes")
        return storage


def _entry(archive: zipfile.ZipFile, name: str, source: str) -> bytes:
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise CorruptCheckpointError(f"{source}: the torch.save archive has no {name}") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise CorruptCheckpointError(f"{source}: {name} is compressed; torch.save stores entries")
    return archive.read(info)


def load_bytes(data: bytes, *, source: str, trusted: bool = False,
               safe_classes: tuple[str, ...] = ()) -> Any:
    """The object `torch.save` wrote as `data`, read through the allowlist (`state`).

    `source` names where the bytes come from in every error. ``trusted=True``: any class, read
    by `torch.load` itself (only for checkpoints you trust). A class off the allowlist raises
    `UnsafeObjectError`; anything else wrong with the bytes `CorruptCheckpointError`. Tensors
    come back on the CPU, whatever device they were saved from.
    """
    if trusted:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise CorruptCheckpointError(f"{source}: a torch.save archive holds one data.pkl, "
                                         f"this one {len(pickles)}")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = f"{prefix}byteorder"
        if byteorder in archive.namelist() and _entry(archive, byteorder, source) != b"little":
            raise CorruptCheckpointError(f"{source}: saved on a big-endian machine")
        unpickler = _ArchiveUnpickler(_entry(archive, pickles[0], source), archive, prefix,
                                      allowed=state.safe_globals(safe_classes), source=source)
        return unpickler.load()
    except CheckpointError:
        raise
    except zipfile.BadZipFile as exc:
        raise CorruptCheckpointError(
            f"{source}: not a torch.save archive ({exc}); only the zip format torch.save writes "
            "is read without trusted=True") from exc
    except Exception as exc:  # everything the unpickler does is driven by the bytes
        raise CorruptCheckpointError(
            f"{source}: the torch.save bytes do not decode ({type(exc).__name__}: {exc})") from exc


def safe_bytes(data: bytes, *, source: str, trusted: bool = False,
               safe_classes: tuple[str, ...] = ()) -> bytes:
    """`data` as bytes that `torch.load(weights_only=False)` may read: the bytes themselves when
    `trusted`, else `torch.save` of what `load_bytes` read from them through the allowlist."""
    if trusted:
        return data
    buffer = io.BytesIO()
    torch.save(load_bytes(data, source=source, safe_classes=safe_classes), buffer)
    return buffer.getvalue()


def load_file(path: str | os.PathLike, map_location: Any = None, *, trusted: bool = False,
              safe_classes: tuple[str, ...] = ()) -> Any:
    """A plain torch file, as `torch.load` reads it, but naming only allowlisted globals.

    torch's ``weights_only`` unpickler, with the engine's allowlist (`state.safe_globals`:
    defaults, adapters' registrations such as DeepSpeed's loss scalers, `safe_classes`) added
    for this call. A global off the list raises `UnsafeObjectError` naming the file and the
    global; ``trusted=True`` reads with ``weights_only=False`` (only for files you trust).
    """
    if trusted:
        return torch.load(path, map_location=map_location, weights_only=False)
    # (object, name) pairs: torch.dtype and the like have no __qualname__ of their own.
    allowed = [(obj, name) for name in sorted(state.safe_globals(safe_classes))
               if (obj := _resolve(name)) is not None]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"it names {named.group(1)!r}" if named else str(exc).split(". ")[0]
        raise UnsafeObjectError(
            f"{path}: {what}, which is not on the allowlist of what a checkpoint may create; "
            "torch.load(weights_only=False) would run whatever the file names, so it is refused"
        ) from exc


def _resolve(qualified: str) -> Any:
    """The object a "module.QualName" names, or None where this process lacks it (NumPy 1
    has no ``numpy._core``): a name nothing can resolve is one no file can use either."""
    module, _, name = qualified.rpartition(".")
    while module:
        try:
            obj: Any = importlib.import_module(module)
        except ImportError:
            module, _, head = module.rpartition(".")
            name = f"{head}.{name}"
            continue
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


__all__ = ["load_bytes", "load_file", "safe_bytes"]
