"""The files a manifest lists, checked on disk: present, regular, inside the tag folder, with
the recorded size and CRC-32.

`manifest.py` says what a manifest is; this module says whether a tag folder's files agree with
one. A record's bytes are at its path, or, while an interrupted re-save's rename is pending, under
its staged name (`record_file`; the manifest module's "Re-saving a tag"). Every file is opened
`O_NONBLOCK` and must be a regular file (a FIFO planted in the folder would hang a load), and its
real path, links resolved, must lie inside the real tag folder. Torch-free, as the manifest is:
`nvcomp-ckpt verify` runs without torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import zlib
from collections.abc import Callable, Iterable

from .storage import NotAnObjectError, OutsideRootError, Storage, locations, open_storage
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
) -> tuple[tuple[ShardRecord, ...], list[FileProblem]]:
    """The records checked and every problem found (see `verify_files`, which raises them)."""
    tag_dir = locations.location(tag_dir)
    records = list(manifest.files)
    if ranks is not None:
        wanted = set(ranks)
        records = [r for r in records if r.rank in wanted]
    root = str(tag_dir) if locations.is_url(tag_dir) else os.path.realpath(tag_dir)
    check = _RecordCheck(tag_dir, root, manifest, check_crc, crc_of,
                         allow_pending)
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
) -> tuple[ShardRecord, ...]:
    """Check that the files agree with `manifest`; return the records checked.

    `ranks` limits the check to those ranks' files (a rank checking what it will load).
    `check_crc=False` compares sizes only: a stat per file, cheap enough for every load;
    the CRC reads every byte. `crc_of`, when the CRC is not read, gives a file's CRC-32
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
        local_only=local_only, node=node, allow_pending=allow_pending,
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
                size, crc = _measure(storage, key, self.check_crc)
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


#: Bytes per read of a file's CRC-32 (`_measure`): one buffer of this size, reused.
_CRC_BLOCK = 16 << 20


def file_crc32(path: str | os.PathLike) -> int:
    """The CRC-32 of a whole file, read from one open reader (a file that is not regular is
    refused: `CorruptCheckpointError`)."""
    storage, key = locations.resolve(path)
    try:
        crc = _measure(storage, key, True)[1]
    except NotAnObjectError:
        raise CorruptCheckpointError(f"{path}: not a regular file") from None
    return crc or 0  # always measured here


def _measure(storage: Storage, key: str, check_crc: bool) -> tuple[int, int | None]:
    """Size and (optionally) CRC-32 of one object, from one open reader (which refuses a link
    out of the storage's root, and a FIFO without blocking on it)."""
    with storage.open_reader(key) as reader:
        if not check_crc:
            return reader.size, None
        crc, block = 0, memoryview(bytearray(min(_CRC_BLOCK, reader.size)))
        for offset in range(0, reader.size, _CRC_BLOCK):
            piece = block[: min(_CRC_BLOCK, reader.size - offset)]
            reader.read_into(offset, piece)
            crc = zlib.crc32(piece, crc)
        return reader.size, crc


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


__all__ = ["FileProblem", "check_files", "record_file", "staged_path", "verify_files"]
