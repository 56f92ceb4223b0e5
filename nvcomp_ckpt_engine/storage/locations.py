"""One object named by its location (a path or a URL), for the modules that think in files.

The format modules name a shard by where it is (`ShardIndex.path`, a user's ``nce.load(path)``);
these functions give them the object's storage operations without holding a `Storage`: each
resolves the location's backend (`storage_for`) and does one thing through it. A local path is
resolved first (`os.path.realpath`), so a file the caller named by a link is read where the
link leads, as `open` always did; confinement to a checkpoint folder is the job of the caller
that knows the folder (`opened.py`, `siblings.py`, `manifest_files.py`), or of a `Storage`
rooted at that folder.

The tag-level modules (commit, discovery, retention, the manifest and its checks) build
locations from a save folder, a tag and a file's relative path. `location` gives them a value
that does so for both kinds: a `pathlib.Path` for a path, a `UrlLocation` for a URL (where
``Path("s3://b/x")`` would turn the URL into the path ``s3:/b/x``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import ObjectInfo, Reader, Sink, Storage, check_key


class UrlLocation(os.PathLike):
    """A URL location (``s3://bucket/prefix/tag``) with the few operations of `pathlib.Path` the
    tag-level modules use: ``/`` a relative key, `parent`, `name`, `as_posix`. `os.fspath` and
    `str` give the URL, so `open_storage` and `storage_for` take it as they take the string. A
    joined part is checked as a key (no '..', no leading '/'), so no location leaves the URL."""

    __slots__ = ("_url",)

    def __init__(self, url: str) -> None:
        self._url = url.rstrip("/")

    def __fspath__(self) -> str:
        return self._url

    def __str__(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"UrlLocation({self._url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UrlLocation) and other._url == self._url

    def __hash__(self) -> int:
        return hash(self._url)

    def __truediv__(self, part: str | os.PathLike) -> "UrlLocation":
        return UrlLocation(self._url + "/" + check_key(os.fspath(part)))

    def _split(self) -> tuple[str, str]:
        scheme, _, rest = self._url.partition("://")
        head, _, name = rest.rpartition("/")
        return (f"{scheme}://{head}" if head else self._url), (name if head else "")

    @property
    def parent(self) -> "UrlLocation":
        """The location one segment up; a bucket is its own parent, as ``/`` is."""
        return UrlLocation(self._split()[0])

    @property
    def name(self) -> str:
        """The last segment ('' for a bare bucket)."""
        return self._split()[1]

    def as_posix(self) -> str:
        return self._url


#: A location as the tag-level modules carry it: a path, or a URL.
Location = Path | UrlLocation


def location(where: str | os.PathLike) -> Path | UrlLocation:
    """`where` as a location the tag-level modules can join and split: a `UrlLocation` for a
    URL (or a `UrlLocation` itself), a `pathlib.Path` for a path."""
    from . import url_scheme

    if isinstance(where, UrlLocation):
        return where
    return Path(where) if url_scheme(where) is None else UrlLocation(os.fspath(where))


def is_url(where: str | os.PathLike) -> bool:
    """Whether `where` is a URL location rather than a path."""
    from . import url_scheme

    return url_scheme(where) is not None


def real(where: str | os.PathLike) -> Path | UrlLocation:
    """`where` with every link of a path resolved (`os.path.realpath`); a URL as it is (an
    object store has no links, and its keys never hold '..')."""
    return location(where) if is_url(where) else Path(os.path.realpath(where))


def is_inside(where: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `where`, links resolved, lies inside `root` (resolved too): a checkpoint's
    readers never follow a link out of it. A URL is inside a URL it starts with, '/'-bounded."""
    if is_url(where) or is_url(root):
        inner, outer = os.fspath(location(where)), os.fspath(location(root))
        return is_url(where) and is_url(root) and (inner == outer or inner.startswith(outer + "/"))
    outer = os.path.realpath(root)
    return os.path.commonpath([outer, os.path.realpath(where)]) == outer


def relative_to(where: str | os.PathLike, root: str | os.PathLike) -> str:
    """`where` relative to `root` ('/'-separated; links of paths resolved), for a location
    `is_inside` it."""
    if is_url(where):
        inner, outer = os.fspath(location(where)), os.fspath(location(root))
        return inner[len(outer):].strip("/") or "."
    return Path(os.path.relpath(os.path.realpath(where), os.path.realpath(root))).as_posix()


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


def open_device_sink(location: str | os.PathLike, *, durable: bool = True) -> Sink:
    """A sink that becomes `location` when finished and also takes GPU memory
    (`Sink.append_device`): the GPUDirect Storage sink of `gds.GdsStorage` (kvikio), for a
    local path only (ValueError for a URL or any storage without local files)."""
    storage, key = resolve(location, write=True)
    if is_url(location) or not storage.capabilities.local:
        raise ValueError(f"{location}: GPUDirect Storage writes local files only, not to "
                         f"{type(storage).__name__}")
    from .gds import GdsStorage

    return GdsStorage(storage.local_path()).open_sink(key, durable=durable)


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
