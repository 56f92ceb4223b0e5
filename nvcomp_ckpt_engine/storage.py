"""Bytes on disk: positional writes, durability and atomic publication.

This module knows files, not tensors: it imports neither torch nor nvCOMP. Everything that must
survive a crash goes through `atomic_write_bytes` (temp file, fsync, rename, fsync of the
directory) or through `ShardFileWriter.finish` (the same steps for a large shard written in
pieces), so a reader either sees the old file or the whole new one, never a mix.
"""

from __future__ import annotations

import os
import secrets
import zlib
from pathlib import Path

#: Suffix of files being written; anything carrying it is an unfinished write.
PARTIAL_SUFFIX = ".nvckpt-partial"


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
    """
    while True:
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}{PARTIAL_SUFFIX}"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)
        except FileExistsError:
            continue


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically: readers see the old content or all of the new."""
    path = Path(path)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os_error():
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


class _suppress_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


class ShardFileWriter:
    """Writes one shard file in order, under a temporary name, and publishes it atomically.

    Chunks are appended in file order (`append`), which keeps a running CRC-32 of the whole file
    so the commit can record it without reading the file again. `finish` fsyncs (when `durable`),
    renames the temporary file over `path` and fsyncs the directory; `abort` removes the
    temporary file. Appends are large sequential writes with no locking, which is what parallel
    file systems (Lustre, GPFS) handle best.
    """

    def __init__(self, path: str | os.PathLike, *, durable: bool = True) -> None:
        self.path = Path(path)
        self.durable = durable
        fd, self._tmp = _create_temp(self.path)
        self._file = os.fdopen(fd, "wb", buffering=0)
        self.offset = 0
        self.crc32 = 0

    def append(self, data: bytes | bytearray | memoryview, *, crc32: int | None = None) -> int:
        """Write `data` at the current end; returns the offset it was written at.

        Pass `crc32` when the caller already has the CRC-32 of `data` (the pipeline computes
        chunk checksums in its worker threads): the file's running CRC is then combined from it
        instead of hashing the bytes a second time on the writing thread.
        """
        view = memoryview(data).cast("B")
        start = self.offset
        written = 0
        while written < len(view):
            written += self._file.write(view[written:])
        if crc32 is None:
            self.crc32 = zlib.crc32(view, self.crc32)
        else:
            self.crc32 = crc32_combine(self.crc32, crc32, len(view))
        self.offset += len(view)
        return start

    def pad_to(self, alignment: int) -> None:
        """Append zero bytes up to the next multiple of `alignment`."""
        gap = -self.offset % alignment
        if gap:
            self.append(bytes(gap))

    def finish(self) -> int:
        """Make the file durable and visible at its final path; returns its size in bytes."""
        try:
            if self.durable:
                os.fsync(self._file.fileno())
            self._file.close()
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
            self._file.close()
        with _suppress_os_error():
            os.unlink(self._tmp)


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _zero_operators() -> list[tuple[int, ...]]:
    """GF(2) operators that append 2**k zero *bytes* to a CRC-32 register, k = 0..63."""
    one_bit = (0xEDB88320,) + tuple(1 << n for n in range(31))
    op = one_bit
    for _ in range(3):  # 1 bit -> 8 bits (one byte)
        op = tuple(_gf2_times(op, op[n]) for n in range(32))
    ops = [op]
    for _ in range(63):
        op = tuple(_gf2_times(op, op[n]) for n in range(32))
        ops.append(op)
    return ops


_ZERO_OPS: list[tuple[int, ...]] = []


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B), as zlib's crc32_combine computes it.

    Python's zlib module does not expose crc32_combine; this is the same GF(2) algebra with the
    64 "append 2**k zero bytes" operators built once, so a combine costs microseconds.
    """
    if not _ZERO_OPS:
        _ZERO_OPS.extend(_zero_operators())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def file_crc32(path: str | os.PathLike, *, block: int = 16 << 20) -> int:
    """CRC-32 of a whole file, read in blocks (used by verification, not by saves)."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(block)
            if not data:
                return crc
            crc = zlib.crc32(data, crc)
