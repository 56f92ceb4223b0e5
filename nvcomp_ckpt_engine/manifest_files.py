"""The files a manifest lists, checked on disk: present, regular, inside the tag folder, with
the recorded size and CRC-32.

`manifest.py` says what a manifest is; this module says whether a tag folder's files agree with
one. A record's bytes are at its path, or, while an interrupted re-save's rename is pending, under
its staged name (`record_file`; the manifest module's "Re-saving a tag"). Every file is opened
`O_NONBLOCK` and must be a regular file (a FIFO planted in the folder would hang a load), and its
real path, links resolved, must lie inside the real tag folder. A file's CRC-32 reads every
byte, which one thread does at the speed of one core's zlib: a file larger than a segment
(64 MiB) is read in segments on several threads and their CRC-32s combined in order
(`CrcPool`, `checksums`), so a restore's or a verify's check of a large file is not bound by one
core. Torch-free, as the manifest is: `nvcomp-ckpt verify` runs without torch.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextvars
import dataclasses
import logging
import os
import socket
import threading
import zlib
from collections.abc import Callable, Iterable

from . import checksums
from .storage import NotAnObjectError, OutsideRootError, Reader, Storage, locations, open_storage
from .errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from .manifest import Manifest, ShardRecord, manifest_path

logger = logging.getLogger(__name__)

_MAX_REPORTED_PROBLEMS = 20

Location = locations.Location


def staged_path(tag_dir: str | os.PathLike, manifest: Manifest, record: ShardRecord) -> Location | None:
    """The staged name of `record`'s file while a re-save's rename is pending, else None."""
    suffix = manifest.pending.get(record.rank)
    return None if suffix is None else locations.location(tag_dir) / (record.path + suffix)


def record_file(tag_dir: Location, found: Manifest, record: ShardRecord) -> Location:
    """The file holding a record's bytes: its staged name while a re-save's rename is pending
    (`manifest`'s "Re-saving a tag"), else its own."""
    suffix = found.pending.get(record.rank)
    if suffix is not None and open_storage(tag_dir).exists(record.path + suffix):
        return locations.location(tag_dir) / (record.path + suffix)
    return locations.location(tag_dir) / record.path


@dataclasses.dataclass(frozen=True)
class FileProblem:
    """How one file disagrees with its record.

    `kind` is "missing"; "size" (another size than the record's); "crc" (the size is right,
    the CRC-32 is not: reading the file may say which part is damaged); or "refused" (outside
    the folder, not a regular file, unreadable: never to be opened).
    """

    record: ShardRecord
    kind: str
    message: str


def check_files(
    tag_dir: str | os.PathLike,
    manifest: Manifest,
    *,
    ranks: Iterable[int] | None = None,
    check_crc: bool = True,
    crc_of: Callable[[Location], int | None] | None = None,
    local_only: bool = False,
    node: str | None = None,
    allow_pending: bool = False,
    crc_pool: CrcPool | None = None,
) -> tuple[tuple[ShardRecord, ...], list[FileProblem]]:
    """The records checked and every problem found (see `verify_files`, which raises them)."""
    tag_dir = locations.location(tag_dir)
    records = list(manifest.files)
    if ranks is not None:
        wanted = set(ranks)
        records = [r for r in records if r.rank in wanted]
    root = str(tag_dir) if locations.is_url(tag_dir) else os.path.realpath(tag_dir)
    check = _RecordCheck(tag_dir, root, manifest, check_crc, crc_of, allow_pending, crc_pool)
    if local_only:
        return _check_local(check, records, node)
    problems = [problem for problem in map(check, records) if problem is not None]
    return tuple(records), problems


def verify_files(
    tag_dir: str | os.PathLike,
    manifest: Manifest,
    *,
    ranks: Iterable[int] | None = None,
    check_crc: bool = True,
    crc_of: Callable[[Location], int | None] | None = None,
    local_only: bool = False,
    node: str | None = None,
    allow_pending: bool = False,
    crc_pool: CrcPool | None = None,
) -> tuple[ShardRecord, ...]:
    """Check that the files agree with `manifest`; return the records checked.

    `ranks` limits the check to those ranks' files (a rank checking what it will load).
    `check_crc=False` compares sizes only: a stat per file, cheap enough for every load;
    the CRC reads every byte: a file larger than one segment (64 MiB) in segments on several
    threads, those of `crc_pool` (shared by several callers' files), else a few of its own
    (`default_crc_threads`). `crc_of`, when the CRC is not read, gives a file's CRC-32
    cheaply where it can (a shard's index records it; None: it cannot say): then sizes and
    those CRCs are compared; an exception of the engine it raises is a problem of that file.
    `local_only` is for node-local storage, where each node sees only
    its own files: only records whose `node` is this host (or `node`) are checked; if no record
    names this host (the job restarted on other hosts), the files that exist here are checked
    against the records with their path, and missing ones are skipped, with a warning.

    While an interrupted re-save's renames are pending (`manifest`'s "Re-saving a tag"), a
    record's bytes may still be under its staged name. By default that is a problem ("rename pending"): whoever
    loads reads the final name, so `commit.finish_pending_renames` must run first.
    `allow_pending=True` accepts the staged file instead: the question is then "is this
    checkpoint complete", not "can it be read at its final paths now".

    Raises IncompleteCheckpointError if files are missing, CorruptCheckpointError if any file
    differs (size, CRC, not a regular file, outside the tag folder); the message lists every
    problem found (up to 20) with expected and actual values.
    """
    records, problems = check_files(
        tag_dir, manifest, ranks=ranks, check_crc=check_crc, crc_of=crc_of,
        local_only=local_only, node=node, allow_pending=allow_pending, crc_pool=crc_pool,
    )
    if problems:
        _raise_problems(problems, manifest_path(tag_dir), len(records))
    return records


def _check_local(
    check: _RecordCheck, records: list[ShardRecord], node: str | None
) -> tuple[tuple[ShardRecord, ...], list[FileProblem]]:
    host = node or socket.gethostname()
    mine = [r for r in records if r.node == host]
    if mine or not records:
        return tuple(mine), [problem for problem in map(check, mine) if problem is not None]
    logger.warning(
        "%s: no file of this manifest was written on this host (%r); checking the files that "
        "exist here against the records with their path (node-local storage after a restart on "
        "other hosts?)", check.tag_dir, host,
    )
    by_path: dict[str, list[ShardRecord]] = {}
    for record in records:
        by_path.setdefault(record.path, []).append(record)
    checked, problems = [], []
    for path, group in by_path.items():
        storage = open_storage(check.tag_dir)
        if not storage.exists(path) and not any(
            (suffix := check.manifest.pending.get(r.rank)) is not None and storage.exists(r.path + suffix)
            for r in group
        ):
            continue
        results = [check(r) for r in group]
        if all(result is not None for result in results):
            problems.append(results[0])
        checked.append(group[0])
    return tuple(checked), problems


@dataclasses.dataclass(frozen=True)
class _RecordCheck:
    """Checks one record's file (see `verify_files` for the options)."""

    tag_dir: Location
    root: str
    manifest: Manifest
    check_crc: bool
    crc_of: Callable[[Location], int | None] | None
    allow_pending: bool
    crc_pool: CrcPool | None

    def __call__(self, record: ShardRecord) -> FileProblem | None:
        """None if the record's file agrees with it, else what is wrong."""
        final = self.tag_dir / record.path
        staged = staged_path(self.tag_dir, self.manifest, record)
        storage = open_storage(self.tag_dir)
        staged_key = None if staged is None else record.path + self.manifest.pending[record.rank]
        if staged_key is not None and not self.allow_pending and storage.exists(staged_key):
            return FileProblem(record, "missing", (
                f"{final}: the rename of an interrupted re-save is pending ({staged.name} holds "
                f"the committed bytes, rank {record.rank}); commit.finish_pending_renames (which "
                "resolve_load_tag calls) completes it"
            ))
        # A pending re-save: the staged file, while it exists, is the record's file. If it
        # vanishes between our look and our open, another process just renamed it, and the
        # final name holds the same bytes (the rename is atomic).
        for candidate, key in ([(staged, staged_key)] if staged is not None else []) + [(final, record.path)]:
            try:
                size, crc = _measure(storage, key, self.check_crc, self.crc_pool)
                if size == record.file_bytes and crc is None and self.crc_of is not None:
                    crc = self.crc_of(candidate)
            except FileNotFoundError:
                continue
            except OutsideRootError:
                return FileProblem(record, "refused", (
                    f"{final}: resolves to {os.path.realpath(candidate)}, outside the tag "
                    f"folder {self.root} (rank {record.rank})"
                ))
            except NotAnObjectError:
                return FileProblem(record, "refused", f"{candidate}: not a regular file (rank {record.rank})")
            except OSError as exc:
                return FileProblem(record, "refused",
                                   f"{candidate}: cannot be read: {exc} (rank {record.rank})")
            except CheckpointError as exc:  # from crc_of: the file's own index is damaged
                return FileProblem(record, "crc", f"{exc} (rank {record.rank})")
            if size != record.file_bytes:
                return FileProblem(record, "size", (
                    f"{candidate}: {size} bytes, the manifest says {record.file_bytes} (rank "
                    f"{record.rank})"
                ))
            if crc is not None and crc != record.crc32:
                return FileProblem(record, "crc", (
                    f"{candidate}: crc32 0x{crc:08x}, the manifest says 0x{record.crc32:08x} "
                    f"(rank {record.rank}, {size} bytes)"
                ))
            return None
        return FileProblem(record, "missing", (
            f"{final}: missing (rank {record.rank}, {record.file_bytes} bytes expected, node "
            f"{record.node!r})"
        ))


#: Bytes per read of a file's CRC-32 (`_measure`): one buffer of this size per thread, reused.
_CRC_BLOCK = 16 << 20

#: A file larger than this has its CRC-32 computed in segments of this size (a whole number of
#: blocks) on several threads (`CrcPool`), the segments' CRCs combined in file order
#: (`checksums`); a smaller file is read front to back on the caller's thread.
_CRC_SEGMENT = 4 * _CRC_BLOCK

#: At most this many threads compute one file's CRC-32 when the caller gives no pool: enough to
#: keep a fast disk or the page cache busy (zlib's CRC-32 runs at a few GB/s per core), few
#: enough not to turn a local disk's sequential reads into random ones.
MAX_CRC_THREADS = 8


def default_crc_threads(sharing: int = 1) -> int:
    """The threads of a file's CRC-32 when the caller gives no pool, or of one of `sharing`
    processes checking at once (a node's ranks at a restore): the CPUs this process may run on,
    split over them, at least 1 and at most `MAX_CRC_THREADS` (enough to overlap reads and
    CRCs, few enough not to turn a local disk's sequential reads into random ones)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_CRC_THREADS, cpus // sharing))


class CrcPool:
    """Threads that read and CRC segments of files, shared by the checks of several files so
    that their CRC work together runs on at most `threads` threads (the tier's restore: a
    rank's share of a node's files, `tiers.local.check_share`). Each thread reuses one read
    buffer (at most `_CRC_BLOCK` bytes) for every segment it reads (allocating and faulting in a fresh
    16 MiB buffer costs about as much as its CRC). A segment's read runs in a copy of the
    context of the thread that asked for the file's CRC (`contextvars`), as if it read it
    itself. Use as a context manager: its threads end, and their buffers go, on exit."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a CRC pool needs at least one thread, got {threads}")
        self.threads = threads
        self._executor = cf.ThreadPoolExecutor(threads, thread_name_prefix="nvckpt-crc-segment")
        self._buffers = threading.local()

    def __enter__(self) -> CrcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def crc(self, reader: Reader) -> int:
        """The CRC-32 of `reader`'s whole object: its segments on the pool's threads, their
        CRCs combined in order. A failed segment's error is raised (the first in file order)
        once no segment is still being read, so `reader` may be closed at once."""
        size = reader.size
        starts = range(0, size, _CRC_SEGMENT)
        futures = [self._executor.submit(contextvars.copy_context().run, self._segment_crc,
                                         reader, start, min(_CRC_SEGMENT, size - start))
                   for start in starts]
        try:
            crcs = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            cf.wait(futures)
            raise
        crc, whole = 0, checksums.ZeroBytes(_CRC_SEGMENT)
        for start, segment_crc in zip(starts, crcs):
            length = min(_CRC_SEGMENT, size - start)
            crc = (whole.combine(crc, segment_crc) if length == _CRC_SEGMENT
                   else checksums.crc32_combine(crc, segment_crc, length))
        return crc

    def _segment_crc(self, reader: Reader, start: int, length: int) -> int:
        wanted = min(_CRC_BLOCK, length)  # (small files need no whole block)
        buffer = getattr(self._buffers, "block", None)
        if buffer is None or len(buffer) < wanted:
            buffer = self._buffers.block = memoryview(bytearray(wanted))
        return _crc_of_range(reader, start, length, buffer)


def _crc_of_range(reader: Reader, start: int, length: int, buffer: memoryview) -> int:
    """The CRC-32 of `reader`'s bytes [start, start + length), read in pieces of `buffer`."""
    crc, block = 0, len(buffer) or 1  # (an empty object's buffer is empty)
    for offset in range(start, start + length, block):
        piece = buffer[: min(block, start + length - offset)]
        reader.read_into(offset, piece)
        crc = zlib.crc32(piece, crc)
    return crc


def file_crc32(path: str | os.PathLike) -> int:
    """The CRC-32 of a whole file, read from one open reader (a file that is not regular is
    refused: `CorruptCheckpointError`); a large one on a few threads (`_measure`)."""
    storage, key = locations.resolve(path)
    try:
        crc = _measure(storage, key, True)[1]
    except NotAnObjectError:
        raise CorruptCheckpointError(f"{path}: not a regular file") from None
    return crc or 0  # always measured here


def _measure(storage: Storage, key: str, check_crc: bool,
             pool: CrcPool | None = None) -> tuple[int, int | None]:
    """Size and (optionally) CRC-32 of one object, from one open reader (which refuses a link
    out of the storage's root, and a FIFO without blocking on it). The CRC is computed on
    `pool`'s threads, else, for an object of more than one segment, on a pool of its own of
    `default_crc_threads()`, else on this thread."""
    with storage.open_reader(key) as reader:
        if not check_crc:
            return reader.size, None
        if pool is not None:
            return reader.size, pool.crc(reader)
        segments = -(-reader.size // _CRC_SEGMENT)
        threads = min(default_crc_threads(), segments)
        if threads > 1:
            with CrcPool(threads) as own:
                return reader.size, own.crc(reader)
        block = memoryview(bytearray(min(_CRC_BLOCK, reader.size)))
        return reader.size, _crc_of_range(reader, 0, reader.size, block)


def _raise_problems(problems: list[FileProblem], source: Location, checked: int) -> None:
    shown = [problem.message for problem in problems[:_MAX_REPORTED_PROBLEMS]]
    more = len(problems) - len(shown)
    text = (
        f"{source}: {len(problems)} of {checked} files disagree with the manifest: "
        + "; ".join(shown)
        + (f"; and {more} more" if more else "")
    )
    if any(problem.kind != "missing" for problem in problems):
        raise CorruptCheckpointError(text)
    raise IncompleteCheckpointError(text)


__all__ = ["MAX_CRC_THREADS", "CrcPool", "FileProblem", "check_files", "default_crc_threads", "record_file", "staged_path", "verify_files"]
