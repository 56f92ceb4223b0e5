"""Bytes on disk: positional writes, durability and atomic publication.

This module knows files, not tensors: it imports neither torch nor nvCOMP. Everything that must
survive a crash goes through `atomic_write_bytes` (temp file, fsync, rename, fsync of the
directory) or through `ShardFileWriter.finish` (the same steps for a large shard written in
pieces), so a reader either sees the old file or the whole new one, never a mix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import shutil
import stat
import threading
import warnings
import zlib
from pathlib import Path
from typing import Iterator

from .checksums import crc32_combine
from .storage.base import TooLargeError

#: Suffix of files being written; anything carrying it is an unfinished write.
PARTIAL_SUFFIX = ".nvckpt-partial"


def is_inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path`, every symlink along it resolved, lies inside `root` (resolved too): a
    checkpoint's reader and converters never follow a link out of the checkpoint."""
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) == real_root


class FileTooLargeError(TooLargeError):
    """A file holds more bytes than its reader takes (`read_bounded`): refused unread."""


def read_bounded(path: str | os.PathLike, limit: int, *, what: str = "this file") -> bytes:
    """The bytes of the regular file `path`, read only once `fstat` says it holds at most
    `limit` bytes (and never more than that read, should it grow meanwhile).

    A checkpoint's small files (its manifest, DCP's ``.metadata``, ``latest``, a checksum or
    config file) are read whole; one a damaged or hostile folder made huge, or sparse, is
    refused by its size before a byte of it is read or allocated. Raises FileNotFoundError,
    `FileTooLargeError` (naming the file, its size and the limit, for `what`), or ValueError for
    something that is not a regular file (a folder, a FIFO: opened without blocking).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise FileTooLargeError(f"{path}: {info.st_size} bytes, more than the {limit} "
                                    f"{what} may have; refused unread",
                                    size=info.st_size, limit=limit)
        parts, size = [], 0
        while size <= limit:  # asking for what fstat said, + 1 (os.read allocates what it asks)
            block = os.read(fd, min(limit + 1 - size, max(info.st_size + 1 - size, 1), 16 << 20))
            if not block:
                break
            parts.append(block)
            size += len(block)
    finally:
        os.close(fd)
    if size > limit:
        raise FileTooLargeError(f"{path}: grew past the {limit} bytes {what} may have while "
                                "it was read", size=size, limit=limit)
    return b"".join(parts)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or creation inside `directory` durable (POSIX needs the directory fsynced)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(final: Path) -> tuple[int, str]:
    """Create a new temporary file beside `final`, with the permissions umask gives a new file.

    (tempfile.mkstemp would make it 0600, and the rename would carry that onto the checkpoint.)
    A missing folder is reported for `final`, which the caller asked for, not for the
    temporary name.
    """
    while True:
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}{PARTIAL_SUFFIX}"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue
        except FileNotFoundError as exc:
            if final.parent.is_dir():
                raise
            raise FileNotFoundError(
                errno.ENOENT, f"cannot write {final}: its folder {final.parent} does not exist"
            ) from exc


def _write_temp(final: Path, data: bytes, *, durable: bool) -> str:
    """Write `data` to a new temporary file beside `final` (fsynced if `durable`) and return its
    name; nothing is left behind if the write fails."""
    fd, tmp = _create_temp(final)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with _suppress_os_error():
            os.unlink(tmp)
        raise
    return tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically: readers see the old content or all of the new."""
    path = Path(path)
    tmp = _write_temp(path, data, durable=durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os_error():
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_if_absent(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Publish `data` at `path` only if nothing is there, atomically: written under a temporary
    name, then hard-linked to `path` (which fails with FileExistsError if `path` exists, even
    against a writer racing this one) and the temporary name removed."""
    path = Path(path)
    tmp = _write_temp(path, data, durable=durable)
    try:
        os.link(tmp, path)
    finally:
        with _suppress_os_error():
            os.unlink(tmp)
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def staged_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary sibling name and publish it by one rename at the end.

    The block writes into the yielded folder. If it raises, the folder is removed, with any
    parent folders created for it, so a failed conversion leaves nothing behind; an existing
    empty `final` stays as it was. On success the folder is renamed to `final` (replacing it if
    it is an existing empty folder, whose permission bits it takes) and the rename is made
    durable. A crash meanwhile leaves a hidden ``.NAME.*.nvckpt-partial`` folder beside `final`.
    """
    final = Path(final)
    created = [p for p in final.parents if not p.exists()]
    final.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}{PARTIAL_SUFFIX}"
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        if final.is_dir():
            os.chmod(tmp, stat.S_IMODE(final.stat().st_mode))
        os.replace(tmp, final)  # an existing folder is replaced only while it is empty
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # deepest first
            with _suppress_os_error():
                folder.rmdir()
        raise
    fsync_dir(final.parent)


class _suppress_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


#: Bytes written between two requests to start writeback (`ShardFileWriter`).
WRITEBACK_STEP = 64 << 20
#: O_DIRECT writes go out in blocks of this size, from one page-aligned buffer.
DIRECT_BLOCK = 16 << 20
#: Offsets and lengths of O_DIRECT writes are multiples of this (the largest common block size).
DIRECT_ALIGN = 4096


class ShardFileWriter:
    """Writes one shard file in order, under a temporary name, and publishes it atomically.

    Chunks are appended in file order (`append`), which keeps a running CRC-32 of the whole file
    so the commit can record it without reading the file again. `finish` fsyncs (when `durable`),
    renames the temporary file over `path` and fsyncs the directory; `abort` removes the
    temporary file. Appends are large sequential writes with no locking, which is what parallel
    file systems (Lustre, GPFS) handle best.

    A durable writer asks the kernel to start writing back every `WRITEBACK_STEP` bytes as soon
    as they are written (``posix_fadvise(DONTNEED)``, which also lets the page cache drop them
    once clean), so the disk works while later chunks are still being compressed and the final
    fsync has little left to do. With `direct`, the file is written with ``O_DIRECT``: through
    a page-aligned buffer in `DIRECT_BLOCK` writes, bypassing the page cache; the last block is
    padded and the file truncated to its size. A file system that refuses ``O_DIRECT`` gets
    buffered writes and a warning.
    """

    def __init__(self, path: str | os.PathLike, *, durable: bool = True, direct: bool = False,
                 checksum: bool = True) -> None:
        """`checksum=False`: keep no running CRC (`crc32` stays 0), for callers that keep their
        own (a storage sink's user)."""
        self.path = Path(path)
        self.durable = durable
        self._checksum = checksum
        fd, self._tmp = _create_temp(self.path)
        self._fd = fd
        self._block: mmap.mmap | None = None
        if direct:
            self._block = _reopen_direct(fd, self._tmp)
        self._filled = 0  # bytes waiting in the O_DIRECT block
        self._block_at = 0  # file offset of the block's first byte
        self._kicked = 0  # bytes whose writeback has been started
        self.offset = 0
        self.crc32 = 0

    @property
    def direct(self) -> bool:
        return self._block is not None

    @property
    def temp_path(self) -> str:
        """The temporary file's path, for a second handle that writes into it (`reserve`)."""
        return self._tmp

    def fileno(self) -> int:
        """The temporary file's descriptor (to check that a second handle opened this file)."""
        return self._fd

    def reserve(self, nbytes: int) -> int:
        """Count `nbytes` at the current end as written by another handle of this file (the
        GPUDirect Storage sink's device writes); returns their offset. Buffered writers only:
        an O_DIRECT block would be written over them."""
        if self._block is not None:
            raise ValueError(f"{self.path}: an O_DIRECT writer cannot leave bytes to another handle")
        start = self.offset
        self.offset += nbytes
        return start

    def append(self, data: bytes | bytearray | memoryview, *, crc32: int | None = None) -> int:
        """Write `data` at the current end; returns the offset it was written at.

        Pass `crc32` when the caller already has the CRC-32 of `data` (the pipeline computes
        chunk checksums in its worker threads): the file's running CRC is then combined from it
        instead of hashing the bytes a second time on the writing thread.
        """
        view = memoryview(data).cast("B")
        start = self.offset
        if self._block is not None:
            self._append_direct(view)
        else:
            _pwrite_all(self._fd, view, start)
        if not self._checksum:
            pass
        elif crc32 is None:
            self.crc32 = zlib.crc32(view, self.crc32)
        else:
            self.crc32 = crc32_combine(self.crc32, crc32, len(view))
        self.offset += len(view)
        if self.durable and self._block is None and self.offset - self._kicked >= WRITEBACK_STEP:
            _start_writeback(self._fd, self._kicked, self.offset - self._kicked)
            self._kicked = self.offset
        return start

    def _append_direct(self, view: memoryview) -> None:
        """Copy into the aligned block; each full block is written at its (aligned) offset."""
        block = self._block
        assert block is not None
        done = 0
        while done < len(view):
            n = min(len(view) - done, len(block) - self._filled)
            block[self._filled : self._filled + n] = view[done : done + n]
            self._filled += n
            done += n
            if self._filled == len(block):
                _pwrite_all(self._fd, memoryview(block), self._block_at)
                self._block_at += len(block)
                self._filled = 0

    def pad_to(self, alignment: int) -> None:
        """Append zero bytes up to the next multiple of `alignment`."""
        gap = -self.offset % alignment
        if gap:
            self.append(bytes(gap))

    def finish(self) -> int:
        """Make the file durable and visible at its final path; returns its size in bytes."""
        try:
            if self._block is not None:
                tail = self._filled + (-self._filled % DIRECT_ALIGN)
                self._block[self._filled : tail] = bytes(tail - self._filled)
                _pwrite_all(self._fd, memoryview(self._block)[:tail], self._block_at)
                os.ftruncate(self._fd, self.offset)  # drops the padding (and the probe block)
            if self.durable:
                os.fsync(self._fd)
            self._close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        if self.durable:
            fsync_dir(self.path.parent)
        return self.offset

    def abort(self) -> None:
        """Drop the unfinished file; the final path is left untouched."""
        with _suppress_os_error():
            self._close()
        with _suppress_os_error():
            os.unlink(self._tmp)

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if self._block is not None:
            self._block.close()
            self._block = None
        if fd >= 0:
            os.close(fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range back now (Linux: posix_fadvise DONTNEED starts
    writeback of its dirty pages and drops the clean ones); a no-op where that is unavailable."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with _suppress_os_error():
            advise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _reopen_direct(fd: int, path: str) -> mmap.mmap | None:
    """Switch `fd` to O_DIRECT and return its aligned block buffer; None (buffered writes, with a
    warning) where the platform or file system refuses O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    try:
        if not flag:
            raise OSError("O_DIRECT is not available on this platform")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
        block = mmap.mmap(-1, DIRECT_BLOCK)
        _pwrite_all(fd, memoryview(block)[:DIRECT_ALIGN], 0)  # probe: refused writes fail here
        return block
    except OSError as exc:
        with _suppress_os_error():
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~flag)
        warnings.warn(f"{path}: O_DIRECT writes are not possible here ({exc}); writing through "
                      "the page cache instead", RuntimeWarning, stacklevel=3)
        return None


def prefetch(paths: list[str], limit_bytes: int) -> threading.Thread | None:
    """Have the kernel read the first `limit_bytes` of `paths` (in order) into the page cache.

    A background thread asks for each file's range with ``posix_fadvise(WILLNEED)``, which
    queues the reads and returns. A loader calls it for the files it will read later, so the
    disk works while the caller is busy elsewhere (DeepSpeed decodes and copies its model states
    before it asks for the optimizer shard); the real read then finds those pages cached.
    Best effort: a file that cannot be opened is skipped, its read will say why. Returns the
    thread, or None where there is nothing to do or no ``posix_fadvise``.
    """
    if not paths or limit_bytes <= 0 or not hasattr(os, "posix_fadvise"):
        return None

    def run() -> None:
        left = limit_bytes
        for path in paths:
            if left <= 0:
                return
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                length = min(left, os.fstat(fd).st_size)
                os.posix_fadvise(fd, 0, length, os.POSIX_FADV_WILLNEED)
                left -= length
            except OSError:
                pass
            finally:
                os.close(fd)

    thread = threading.Thread(target=run, name="nvckpt-prefetch", daemon=True)
    thread.start()
    return thread
