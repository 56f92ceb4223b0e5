"""The POSIX backend: a folder, with today's file behaviour behind the storage interface.

Everything here is `fileio.py`'s: sinks are `ShardFileWriter`s (a temporary name, early
writeback or O_DIRECT, fsync, rename, fsync of the folder), publishes are `atomic_write_bytes`,
small reads are `read_bounded`. Ranged reads are positional (``preadv``), so threads share one
reader. No key reaches outside the root: keys are checked (`check_key`), and a key whose path
resolves out of the root through a symbolic link is refused (`fileio.is_inside`).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

from .. import fileio
from .base import (Capabilities, NotAnObjectError, ObjectInfo, OutsideRootError, PreconditionFailed, Reader,
                   ShortReadError, Sink, Storage, check_key, join)


class PosixStorage(Storage):
    """A folder as a storage root. Keys are paths relative to it."""

    capabilities = Capabilities(atomic_rename=True, local=True, conditional_publish=True)

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(os.path.abspath(root))
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"PosixStorage({str(self.root)!r})"

    def describe(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    # -------------------------------------------------------------------------------- paths

    def _path(self, key: str, *, resolve: bool = True, root_ok: bool = False) -> Path:
        """The path of `key`. `resolve`: the path itself must resolve inside the root (reads);
        otherwise only its folder must (writes, deletes, renames: the entry is replaced or
        removed, never followed). `root_ok`: the key "" names the root (a prefix)."""
        if key == "" and root_ok:
            return self.root
        path = self.root / check_key(key)
        if not fileio.is_inside(path if resolve else path.parent, self.root):
            raise OutsideRootError(f"{path}: resolves to {os.path.realpath(path)}, outside "
                                   f"{self.root}; a link out of the folder is not followed")
        return path

    def prefetch(self, keys: list[str], limit_bytes: int) -> None:
        fileio.prefetch([str(self._path(key, resolve=False)) for key in keys], limit_bytes)

    def local_path(self, key: str = "") -> str:
        return str(self._path(key, root_ok=True))

    # ------------------------------------------------------------------------------ writing

    def open_sink(self, key: str, *, durable: bool = True, direct: bool = False) -> Sink:
        return PosixSink(self._path(key, resolve=False), durable=durable, direct=direct)

    def publish(self, key: str, data: bytes, *, durable: bool = True, if_absent: bool = False) -> None:
        path = self._path(key, resolve=False)
        if if_absent:
            try:
                fileio.write_if_absent(path, data, durable=durable)
            except FileExistsError:
                raise PreconditionFailed(f"{path}: already exists; another writer published it "
                                         "first") from None
        else:
            fileio.atomic_write_bytes(path, data, durable=durable)

    def ensure_prefix(self, prefix: str) -> None:
        os.makedirs(self._path(prefix, resolve=False, root_ok=True), exist_ok=True)
        self._path(prefix, root_ok=True)  # a link out, made or found, is refused

    def sync_prefix(self, prefix: str = "") -> None:
        fileio.fsync_dir(self._path(prefix, root_ok=True))

    def rename(self, src: str, dst: str) -> None:
        os.replace(self._path(src, resolve=False), self._path(dst, resolve=False))

    # ------------------------------------------------------------------------------ reading

    def open_reader(self, key: str) -> Reader:
        return PosixReader(self._path(key), key)

    def read_small(self, key: str, limit: int, *, what: str = "this object") -> bytes:
        return fileio.read_bounded(self._path(key), limit, what=what)

    def stat(self, key: str) -> ObjectInfo:
        """The entry `key` as `list` shows it (a link as itself: see `_info`)."""
        path = self._path(key, resolve=False)
        return _info(key, os.lstat(path), path)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(self._path(prefix, root_ok=True)))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in sorted(entries, key=lambda e: e.name):
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed since the listing
                continue
            yield _info(join(prefix, entry.name), info, entry.path)

    # ----------------------------------------------------------------------------- deleting

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key, resolve=False))
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix, resolve=False)
        if path.is_symlink():
            path.unlink()  # the link, never what it points to
        elif path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            raise NotADirectoryError(f"{path}: not a folder")


def _info(key: str, info: os.stat_result, path: str | os.PathLike) -> ObjectInfo:
    """`key`'s entry from its `lstat`: a link as itself, typed by where it leads (as a
    DirEntry's ``is_dir()``); describing a link reads nothing through it."""
    link, mode = stat.S_ISLNK(info.st_mode), info.st_mode
    if link:
        try:
            mode = os.stat(path).st_mode
        except OSError:  # dangling, or a loop
            pass
    return ObjectInfo(key, info.st_size, info.st_mtime, is_prefix=stat.S_ISDIR(mode), is_link=link,
                      special=not (link or stat.S_ISREG(mode) or stat.S_ISDIR(mode)))


class PosixSink(Sink):
    """A shard file written through `fileio.ShardFileWriter`."""

    def __init__(self, path: Path, *, durable: bool, direct: bool) -> None:
        self.path = path
        self._writer = fileio.ShardFileWriter(path, durable=durable, direct=direct, checksum=False)

    @property
    def direct(self) -> bool:
        """Whether the bytes bypass the page cache (O_DIRECT was granted)."""
        return self._writer.direct

    def append(self, data: bytes | bytearray | memoryview) -> int:
        return self._writer.append(data)

    def finish(self) -> int:
        return self._writer.finish()

    def abort(self) -> None:
        self._writer.abort()


class PosixReader(Reader):
    """A file opened once; `read_into` is a positional read, safe from several threads."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode):
                raise NotAnObjectError(f"{path}: not a regular file")
        except BaseException:
            os.close(self._fd)
            raise
        self.size = info.st_size

    def read_into(self, offset: int, buffer: memoryview) -> None:
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        done, length = 0, len(view)
        while done < length:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise ShortReadError(f"{self.path}: ends at byte {offset + done}, before byte "
                                     f"{offset + length} that a read asked for", end=offset + done)
            done += got

    def read(self, offset: int, length: int) -> bytes:
        """`read_into` a new bytes object (one copy fewer than the generic form)."""
        parts, done = [], 0
        while done < length:
            got = os.pread(self._fd, length - done, offset + done)
            if not got:
                raise ShortReadError(f"{self.path}: ends at byte {offset + done}, before byte "
                                     f"{offset + length} that a read asked for", end=offset + done)
            parts.append(got)
            done += len(got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def advise_sequential(self) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
