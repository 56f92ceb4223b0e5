"""One object named by its location (a path or a URL), for the modules that think in files.

The format modules name a shard by where it is (`ShardIndex.path`, a user's ``nce.load(path)``);
these functions give them the object's storage operations without holding a `Storage`: each
resolves the location's backend (`storage_for`) and does one thing through it. A local path is
resolved first (`os.path.realpath`), so a file the caller named by a link is read where the
link leads, as `open` always did; confinement to a checkpoint folder is the job of the caller
that knows the folder (`opened.py`, `siblings.py`, `manifest_files.py`), or of a `Storage`
rooted at that folder.
"""

from __future__ import annotations

import os

from .base import ObjectInfo, Reader, Sink, Storage


def resolve(location: str | os.PathLike, *, write: bool = False) -> tuple[Storage, str]:
    """The storage holding `location` and its key there, links of a local path resolved: all of
    them for a read; for a `write`, those of its folder only (the entry itself is replaced, a
    link by a file, as a rename does)."""
    from . import storage_for, url_scheme

    if url_scheme(location) is None:
        if write:
            folder, name = os.path.split(os.path.abspath(location))
            location = os.path.join(os.path.realpath(folder), name)
        else:
            location = os.path.realpath(location)
    return storage_for(location)


def open_reader(location: str | os.PathLike) -> Reader:
    """`location` opened for ranged reads (FileNotFoundError names it when it is missing)."""
    storage, key = resolve(location)
    return storage.open_reader(key)


def open_sink(location: str | os.PathLike, *, durable: bool = True, direct: bool = False) -> Sink:
    """A sink that becomes `location` when finished (`Storage.open_sink`)."""
    storage, key = resolve(location, write=True)
    return storage.open_sink(key, durable=durable, direct=direct)


def read_small(location: str | os.PathLike, limit: int, *, what: str = "this object") -> bytes:
    """The whole of a small object, refused unread when larger than `limit`."""
    storage, key = resolve(location)
    return storage.read_small(key, limit, what=what)


def publish(location: str | os.PathLike, data: bytes, *, durable: bool = True, if_absent: bool = False) -> None:
    """Replace `location` with `data` in one step (`Storage.publish`)."""
    storage, key = resolve(location, write=True)
    storage.publish(key, data, durable=durable, if_absent=if_absent)


#: Bytes per read and append of `copy` (one buffer of this size, reused).
COPY_BLOCK = 4 << 20


def copy(src: str | os.PathLike, dst: str | os.PathLike, *, durable: bool = True) -> int:
    """Copy the object `src` to `dst` (published whole, as a sink finishes), in `COPY_BLOCK`
    pieces; returns its size. The bytes only: no permission bits or times come along."""
    with open_reader(src) as reader:
        sink = open_sink(dst, durable=durable)
        with sink:
            block = memoryview(bytearray(min(COPY_BLOCK, reader.size)))
            for offset in range(0, reader.size, COPY_BLOCK):
                piece = block[: min(COPY_BLOCK, reader.size - offset)]
                reader.read_into(offset, piece)
                sink.append(piece)
            return sink.finish()


def stat(location: str | os.PathLike) -> ObjectInfo:
    """Size and time of `location` (FileNotFoundError when missing)."""
    storage, key = resolve(location)
    return storage.stat(key)
