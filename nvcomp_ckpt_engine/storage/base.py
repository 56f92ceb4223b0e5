"""What the engine does with bytes, as one small interface that every backend implements.

A checkpoint needs little from where it lives: a sink that takes a shard's bytes in order and
makes them durable at the end (or leaves nothing behind), ranged reads into a caller's buffer,
small reads with a size cap (manifests, `latest`, indexes), an atomic publish of a small object
(the commit point: the manifest, `latest`), and list / stat / delete. A POSIX file system gives
these with temp files, fsync and rename; an object store with multipart uploads, ranged GETs
and a put of the manifest last. What differs between them is said by `Capabilities`, so callers
ask instead of guessing from the backend's type.

Keys are '/'-separated paths relative to the storage's root; a key never starts with '/', never
holds an empty, '.' or '..' segment (`check_key` refuses them), so no key leaves the root.
This module imports neither torch nor nvCOMP.
"""

from __future__ import annotations

import abc
import dataclasses
import io
from typing import Iterator


class StorageError(OSError):
    """A backend could not do what was asked; the message names the URL or key at fault."""


class PreconditionFailed(StorageError):
    """A conditional publish found the object already there (another writer committed first)."""


class TooLargeError(ValueError):
    """An object holds more bytes than its reader takes (`Storage.read_small`): refused unread.
    Added so callers tell this case from others whatever the backend; `size` and `limit` in
    bytes."""

    def __init__(self, message: str, *, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit


class OutsideRootError(StorageError):
    """A key whose path leads out of the storage's root (a symbolic link): refused unread."""


class NotAnObjectError(StorageError):
    """A key that names something without bytes to read (a folder, a FIFO, a device)."""


class ShortReadError(StorageError):
    """A ranged read asked for bytes past the object's end (`Reader.read_into`). `end` is the
    offset where the object's bytes ran out, so a caller can say which record it cut into."""

    def __init__(self, message: str, *, end: int) -> None:
        super().__init__(message)
        self.end = end


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can promise, so that callers choose a path without naming backends.

    atomic_rename: a finished object appears under its name in one step and a folder can be
        renamed as a whole (POSIX); without it, visibility comes from publishing a manifest last.
    local: the bytes are on this machine (page cache, readahead and O_DIRECT make sense).
    device_buffers: a sink accepts GPU memory directly (GPUDirect Storage).
    conditional_publish: `publish(..., if_absent=True)` is enforced by the backend itself.
    """

    atomic_rename: bool
    local: bool
    device_buffers: bool = False
    conditional_publish: bool = False


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What `stat` and `list` say of one object: its key, its size in bytes, its modification
    time (seconds since the epoch) and whether it is a folder-like prefix rather than an object.
    Added for POSIX callers that never follow a link (retention, discovery), always False where
    there are no such things: `is_link`, the entry is a symbolic link (listed with its own size
    and time; `is_prefix` says whether it leads to a folder); `special`, it is neither a regular
    file, a folder nor a link (a FIFO, a socket, a device).
    `etag` (added for object stores): the store's version tag of the object's bytes (S3's ETag),
    which changes when the object is replaced; None where the backend has none (POSIX)."""

    key: str
    size: int
    mtime: float
    is_prefix: bool = False
    is_link: bool = False
    special: bool = False
    etag: str | None = None


def check_key(key: str) -> str:
    """Return `key` if it names something inside the root, else raise ValueError naming it."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or "\0" in key:
        raise ValueError(f"storage key {key!r} is not a relative '/'-separated path")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"storage key {key!r} has an empty, '.' or '..' segment")
    return key


def join(*parts: str) -> str:
    """Join key segments with '/', dropping empty ones (a prefix of '' is the root)."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Sink(abc.ABC):
    """One object being written front to back. Nothing is visible under its key until `finish`
    returns; `abort` (or an exception before `finish`) leaves nothing behind."""

    @abc.abstractmethod
    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Write `data` after what came before; return the offset it starts at. The caller may
        reuse `data`'s memory once this returns (a backend that sends later keeps a copy)."""

    def append_device(self, buffer: object, nbytes: int) -> int:
        """Write `nbytes` of GPU memory (`buffer`: a contiguous 1-D byte array exposing
        ``__cuda_array_interface__``, a torch CUDA tensor) after what came before; return the
        offset it starts at. Only sinks of a storage whose `capabilities.device_buffers` is
        true take it (GPUDirect Storage: `storage.gds`); the caller leaves `buffer` unchanged
        until `finish` or `abort` returns, and has finished the GPU work that fills it."""
        raise NotImplementedError(f"{type(self).__name__} takes host memory only")

    @abc.abstractmethod
    def finish(self) -> int:
        """Make the object durable and visible under its key; return its size in bytes."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop everything written; safe to call more than once and after a failure."""

    def __enter__(self) -> "Sink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class Reader(abc.ABC):
    """An object opened for ranged reads (a shard's chunks, its trailer). Thread-safe: the data
    path reads ranges of one object from several threads at once."""

    key: str
    size: int

    @abc.abstractmethod
    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at [offset, offset + len(buffer)); a short object raises
        StorageError naming the key, never a partly filled buffer."""

    def read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def advise_sequential(self) -> None:
        """A hint that the whole object will be read front to back (readahead); may do nothing."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the handle."""

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReaderIO(io.RawIOBase):
    """A `Reader` as a seekable binary file, for code that reads files (zipfile, torch's zip
    reader): reads become ranged reads. Added for callers; wrap it in `io.BufferedReader` for
    small reads. Closing it leaves the reader open."""

    def __init__(self, reader: Reader) -> None:
        super().__init__()
        self.reader, self._pos = reader, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.reader.size}[whence]
        if base + offset < 0:
            raise ValueError(f"{self.reader.key}: seek to a negative offset")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.reader.size - self._pos))
        if n:
            self.reader.read_into(self._pos, view[:n])
            self._pos += n
        return n


class SinkIO(io.RawIOBase):
    """A `Sink` as a write-only binary file, for code that writes files (`torch.save`): each
    write is an append. Added for callers; closing it neither finishes nor aborts the sink."""

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self.sink, self._written = sink, 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self.sink.append(view)
        self._written += len(view)
        return len(view)


class Storage(abc.ABC):
    """A root (a folder, or a bucket and prefix) that holds checkpoints under '/'-separated keys."""

    #: Where this storage is, as users write it: a path or an ``s3://bucket/prefix`` URL.
    url: str
    capabilities: Capabilities

    def check(self) -> None:
        """Raise StorageError naming the URL if this storage cannot be used (an unreachable
        endpoint, refused credentials, a missing bucket), so a job fails at start rather than at
        its first save. Local storage has nothing to check here."""

    def describe(self, key: str = "") -> str:
        """The user-facing name of `key` (a path or URL), for messages."""
        return self.url.rstrip("/") + ("/" + key if key else "")

    @abc.abstractmethod
    def open_sink(self, key: str, *, durable: bool = True, direct: bool = False) -> Sink:
        """Start writing `key`. `durable`: `finish` returns only once the bytes survive a crash.
        `direct`: bypass the page cache where the backend can (ignored elsewhere)."""

    @abc.abstractmethod
    def open_reader(self, key: str) -> Reader:
        """Open `key` for ranged reads; FileNotFoundError names it when it is missing."""

    @abc.abstractmethod
    def read_small(self, key: str, limit: int, *, what: str = "this object") -> bytes:
        """The whole of a small object, refusing (`TooLargeError` naming the key, the size and
        the limit) one larger than `limit` bytes without reading it."""

    @abc.abstractmethod
    def publish(self, key: str, data: bytes, *, durable: bool = True, if_absent: bool = False) -> None:
        """Replace `key` with `data` in one step: a reader sees the old object or the new one.
        `if_absent`: raise PreconditionFailed if `key` exists (where the backend can enforce it;
        see `capabilities.conditional_publish`)."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and time of `key`; FileNotFoundError naming it when it is missing."""

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except (FileNotFoundError, NotADirectoryError):  # (a file where a folder of the key is)
            return False
        return True

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """The objects and sub-prefixes directly under `prefix` (one level, like a folder), in
        key order; nothing for a missing prefix."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; a missing one is not an error."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under `prefix` (a tag folder); a missing one is not an error, a
        plain object (a file) is NotADirectoryError and stays."""

    # Added for the engine's callers; each has a default that suits a backend without folders.

    def ensure_prefix(self, prefix: str) -> None:
        """Make `prefix` able to hold objects (a folder on POSIX, created with its parents);
        nothing to do where prefixes exist by being named (object stores)."""

    def sync_prefix(self, prefix: str = "") -> None:
        """Make the creations, renames and removals of entries directly under `prefix` durable
        (the fsync of a folder on POSIX); nothing to do where `finish`/`publish` are durable on
        their own."""

    def rename(self, src: str, dst: str) -> None:
        """Move the object or prefix `src` to `dst` in one step (`dst`, an object or an empty
        prefix, is replaced). Only backends with `capabilities.atomic_rename`; the others raise
        NotImplementedError, and their callers publish a manifest instead."""
        raise NotImplementedError(f"{self.describe(src)}: this storage cannot rename in one step")

    def prefetch(self, keys: list[str], limit_bytes: int) -> None:
        """A hint that the first `limit_bytes` of `keys` (in order) will be read soon: a local
        backend has them read into the page cache in the background. Added for the DeepSpeed
        adapter's load; may do nothing."""

    def local_path(self, key: str = "") -> str:
        """The file system path of `key`, checked inside the root, for the few callers that must
        hand a path to code they do not control (docs/STORAGE.md lists them). Only local
        backends (`capabilities.local`); the others raise NotImplementedError."""
        raise NotImplementedError(f"{self.describe(key)}: not a local file")
