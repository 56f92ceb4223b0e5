"""The files a manifest lists, checked on disk (`manifest_files`): sizes, CRCs, links out of the
tag folder, files that are not regular, node-local storage, a re-save's pending renames.

Framework-free and fast: no torch, no processes. Every error path checks the text a user sees.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import zlib
from pathlib import Path

import pytest

from nvcomp_ckpt_engine import manifest as mf
from nvcomp_ckpt_engine import manifest_files as mff
from nvcomp_ckpt_engine.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from nvcomp_ckpt_engine.manifest import ShardRecord
from nvcomp_ckpt_engine.storage import open_storage
from test_manifest import SUFFIX_R1, record, small_manifest


def write_files(tag_dir: Path, files: dict[str, bytes]) -> list[ShardRecord]:
    records = []
    for rank, (path, data) in enumerate(files.items()):
        (tag_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (tag_dir / path).write_bytes(data)
        records.append(record(path, rank, data))
    return records


@pytest.fixture
def tag_dir(tmp_path: Path) -> Path:
    path = tmp_path / "global_step1"
    path.mkdir()
    return path


def test_verify_files_ok_and_rank_filter(tag_dir: Path) -> None:
    records = write_files(tag_dir, {"a.pt": b"alpha", "sub/b.pt": b"beta!", "c.pt": b""})
    manifest = small_manifest(files=records, world_size=3, pending={})
    assert mff.verify_files(tag_dir, manifest) == manifest.files
    assert [r.path for r in mff.verify_files(tag_dir, manifest, ranks=[1])] == ["sub/b.pt"]


def test_verify_files_reports_every_problem_with_expected_and_actual(tag_dir: Path) -> None:
    records = write_files(tag_dir, {"a.pt": b"alpha", "b.pt": b"beta!", "c.pt": b"gamma"})
    manifest = small_manifest(files=records, world_size=3, pending={})
    (tag_dir / "a.pt").write_bytes(b"alphaX")  # size
    (tag_dir / "b.pt").write_bytes(b"BETA!")  # same size, other bytes
    (tag_dir / "c.pt").unlink()
    with pytest.raises(CorruptCheckpointError) as info:
        mff.verify_files(tag_dir, manifest)
    text = str(info.value)
    assert text.startswith(f"{tag_dir / mf.MANIFEST_NAME}: 3 of 3 files disagree")
    assert f"{tag_dir / 'a.pt'}: 6 bytes, the manifest says 5 (rank 0)" in text
    assert (f"{tag_dir / 'b.pt'}: crc32 0x{zlib.crc32(b'BETA!'):08x}, the manifest says "
            f"0x{zlib.crc32(b'beta!'):08x} (rank 1, 5 bytes)") in text
    assert f"{tag_dir / 'c.pt'}: missing (rank 2, 5 bytes expected, node 'node0')" in text
    # Sizes only: the changed bytes of b.pt go unnoticed, by design.
    (tag_dir / "a.pt").write_bytes(b"alpha")
    (tag_dir / "c.pt").write_bytes(b"gamma")
    mff.verify_files(tag_dir, manifest, check_crc=False)


def test_verify_files_missing_only_is_incomplete(tag_dir: Path) -> None:
    records = write_files(tag_dir, {"a.pt": b"alpha"})
    (tag_dir / "a.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="a.pt: missing"):
        mff.verify_files(tag_dir, small_manifest(files=records, pending={}))


def test_verify_files_lists_at_most_twenty_problems(tag_dir: Path) -> None:
    records = [record(f"f{i}.pt", 0, b"x") for i in range(25)]
    with pytest.raises(IncompleteCheckpointError, match="25 of 25 files .*; and 5 more$"):
        mff.verify_files(tag_dir, small_manifest(files=records, pending={}))


def test_verify_files_refuses_symlinks_out_of_the_tag_folder(tag_dir: Path) -> None:
    outside = tag_dir.parent / "secret"
    outside.write_bytes(b"alpha")
    (tag_dir / "a.pt").symlink_to(outside)
    (tag_dir / "d").symlink_to(tag_dir.parent)
    records = [record("a.pt", 0, b"alpha"), record("d/secret", 1, b"alpha")]
    with pytest.raises(CorruptCheckpointError) as info:
        mff.verify_files(tag_dir, small_manifest(files=records, pending={}))
    assert str(info.value).count("outside the tag folder") == 2
    # A symlink that stays inside is fine.
    (tag_dir / "real.pt").write_bytes(b"alpha")
    (tag_dir / "link.pt").symlink_to("real.pt")
    mff.verify_files(tag_dir, small_manifest(files=[record("link.pt", 0, b"alpha")], pending={}))


def test_verify_files_refuses_non_regular_files(tag_dir: Path) -> None:
    os.mkfifo(tag_dir / "a.pt")
    (tag_dir / "b.pt").mkdir()
    records = [record("a.pt", 0, b""), record("b.pt", 1, b"")]
    with pytest.raises(CorruptCheckpointError) as info:
        mff.verify_files(tag_dir, small_manifest(files=records, pending={}))
    assert str(info.value).count("not a regular file") == 2


def test_verify_files_local_only(tag_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_files(tag_dir, {"a.pt": b"alpha"})
    records = [record("a.pt", 0, b"alpha", node="n0"), record("a.pt", 1, b"other", node="n1"),
               record("b.pt", 2, b"beta", node="n1")]
    manifest = small_manifest(files=records, world_size=3, pending={}, node_local_storage=True)
    assert [r.rank for r in mff.verify_files(tag_dir, manifest, local_only=True, node="n0")] == [0]
    with pytest.raises(CorruptCheckpointError, match="a.pt: crc32 .*rank 1"):
        mff.verify_files(tag_dir, manifest, local_only=True, node="n1")  # n1's a.pt is 'other'
    with pytest.raises(CheckpointError):
        mff.verify_files(tag_dir, manifest)  # everything: b.pt is on n1 only
    # Restarted on other hosts: check what exists here against any record with its path.
    with caplog.at_level(logging.WARNING):
        checked = mff.verify_files(tag_dir, manifest, local_only=True, node="elsewhere")
    assert [r.path for r in checked] == ["a.pt"]
    assert "no file of this manifest was written on this host ('elsewhere')" in caplog.text


def test_verify_files_with_a_pending_rename(tag_dir: Path) -> None:
    (tag_dir / "b.pt").write_bytes(b"old")
    (tag_dir / ("b.pt" + SUFFIX_R1)).write_bytes(b"new!")
    records = [record("b.pt", 1, b"new!")]
    manifest = small_manifest(files=records)
    with pytest.raises(IncompleteCheckpointError, match="rename of an interrupted re-save is "
                       "pending .*finish_pending_renames"):
        mff.verify_files(tag_dir, manifest)
    mff.verify_files(tag_dir, manifest, allow_pending=True)  # the staged file counts
    os.replace(tag_dir / ("b.pt" + SUFFIX_R1), tag_dir / "b.pt")
    mff.verify_files(tag_dir, manifest)
    mff.verify_files(tag_dir, manifest, allow_pending=True)


def test_staged_path() -> None:
    manifest = small_manifest()
    assert mff.staged_path("t", manifest, manifest.files[1]) == Path("t") / ("sub/b.pt" + SUFFIX_R1)
    assert mff.staged_path("t", manifest, manifest.files[0]) is None


# ------------------------------------------- a large file's CRC-32 in segments on several threads

#: The block and segment sizes the tests below patch in (the real ones: 16 and 64 MiB), so that
#: files of a few segments stay small.
BLOCK, SEGMENT = 4096, 4 * 4096


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Segments of `SEGMENT` bytes read in blocks of `BLOCK`, and every range read for a CRC
    from now on, as (thread name, start, length)."""
    monkeypatch.setattr(mff, "_CRC_BLOCK", BLOCK)
    monkeypatch.setattr(mff, "_CRC_SEGMENT", SEGMENT)
    ranges: list[tuple[str, int, int]] = []
    crc_of_range = mff._crc_of_range

    def recorded(reader, start, length, buffer):  # type: ignore[no-untyped-def]
        ranges.append((threading.current_thread().name, start, length))
        return crc_of_range(reader, start, length, buffer)

    monkeypatch.setattr(mff, "_crc_of_range", recorded)
    return ranges


SIZES = (0, 1, BLOCK - 1, BLOCK, SEGMENT - 1, SEGMENT, SEGMENT + 1, 3 * SEGMENT,
         3 * SEGMENT + 1, 5 * SEGMENT + 777)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_a_files_crc_on_a_pool_equals_zlibs_of_the_whole_file(
        tmp_path: Path, small_segments: list, threads: int) -> None:
    storage = open_storage(tmp_path)
    rng = random.Random(threads)
    with mff.CrcPool(threads) as pool:
        for size in SIZES:
            data = rng.randbytes(size)
            (tmp_path / "f.pt").write_bytes(data)
            assert mff._measure(storage, "f.pt", True, pool) == (size, zlib.crc32(data)), size
            with storage.open_reader("f.pt") as reader:
                assert pool.crc(reader) == zlib.crc32(data), size


def test_a_large_files_segments_are_read_on_threads_of_their_own(
        tmp_path: Path, small_segments: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a pool, a file of more than one segment is read in whole segments (each a whole
    number of blocks, the last one shorter) on a pool of its own, two at once at least; a file
    of one segment is read on the caller's thread, as it always was."""
    monkeypatch.setattr(mff, "default_crc_threads", lambda: 4)
    both_waiting, calls = threading.Barrier(2, timeout=10), itertools.count()
    crc_of_range = mff._crc_of_range

    def concurrent(reader, start, length, buffer):  # type: ignore[no-untyped-def]
        if next(calls) < 2:
            both_waiting.wait()  # the first two segments meet: a serial read never would
        return crc_of_range(reader, start, length, buffer)

    monkeypatch.setattr(mff, "_crc_of_range", concurrent)
    size = 5 * SEGMENT + 777
    data = random.Random(5).randbytes(size)
    (tmp_path / "big.pt").write_bytes(data)
    assert mff.file_crc32(tmp_path / "big.pt") == zlib.crc32(data)
    assert sorted(start for _, start, _ in small_segments) == [i * SEGMENT for i in range(6)]
    assert [length for _, _, length in sorted(small_segments, key=lambda r: r[1])] == [SEGMENT] * 5 + [777]
    assert all(name.startswith("nvckpt-crc-segment_") for name, _, _ in small_segments)
    small_segments.clear()
    (tmp_path / "small.pt").write_bytes(data[:SEGMENT])
    assert mff.file_crc32(tmp_path / "small.pt") == zlib.crc32(data[:SEGMENT])
    assert small_segments == [(threading.current_thread().name, 0, SEGMENT)]


def test_a_damaged_byte_in_a_middle_segment_is_found(tag_dir: Path, small_segments: list,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mff, "default_crc_threads", lambda: 3)
    data = random.Random(3).randbytes(3 * SEGMENT + 5)
    records = write_files(tag_dir, {"a.pt": data})
    manifest = small_manifest(files=records, world_size=1, pending={})
    assert mff.verify_files(tag_dir, manifest) == manifest.files
    damaged = bytearray(data)
    damaged[SEGMENT + SEGMENT // 2] ^= 0x01
    (tag_dir / "a.pt").write_bytes(bytes(damaged))
    small_segments.clear()
    with mff.CrcPool(2) as pool:
        for crc_pool in (None, pool):
            _, problems = mff.check_files(tag_dir, manifest, crc_pool=crc_pool)
            assert [(p.kind, p.message) for p in problems] == [("crc", (
                f"{tag_dir / 'a.pt'}: crc32 0x{zlib.crc32(damaged):08x}, the manifest says "
                f"0x{zlib.crc32(data):08x} (rank 0, {len(data)} bytes)"))]
    assert len(small_segments) == 2 * 4  # both checks read the file in its 4 segments
    with pytest.raises(CorruptCheckpointError, match="a.pt: crc32 "):
        mff.verify_files(tag_dir, manifest)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_file_cut_short_while_its_segments_are_read_is_refused_as_before(
        tag_dir: Path, small_segments: list, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """The file shrinks after it was opened, before any of its bytes are read: whether read on
    one thread or in segments on several, the problem is the first short read in file order."""
    monkeypatch.setattr(mff, "default_crc_threads", lambda: threads)
    data = random.Random(4).randbytes(3 * SEGMENT + 5)
    records = write_files(tag_dir, {"a.pt": data})
    manifest = small_manifest(files=records, world_size=1, pending={})
    cut, lock = SEGMENT + SEGMENT // 2 + 100, threading.Lock()
    crc_of_range = mff._crc_of_range

    def shrinking(reader, start, length, buffer):  # type: ignore[no-untyped-def]
        with lock:  # every read starts after the cut
            if os.path.getsize(tag_dir / "a.pt") > cut:
                os.truncate(tag_dir / "a.pt", cut)
        return crc_of_range(reader, start, length, buffer)

    monkeypatch.setattr(mff, "_crc_of_range", shrinking)
    _, problems = mff.check_files(tag_dir, manifest)
    block_end = (cut // BLOCK + 1) * BLOCK
    assert [(p.kind, p.message) for p in problems] == [("refused", (
        f"{tag_dir / 'a.pt'}: cannot be read: {tag_dir / 'a.pt'}: ends at byte {cut}, before "
        f"byte {block_end} that a read asked for (rank 0)"))]


@pytest.mark.parametrize("cpus, sharing, threads", [(16, 1, mff.MAX_CRC_THREADS), (16, 8, 2),
                                                    (16, 32, 1), (3, 2, 1), (1, 1, 1)])
def test_the_crc_threads_split_the_cpus_over_the_processes_sharing_them(
        monkeypatch, cpus: int, sharing: int, threads: int) -> None:
    """A node's ranks at a restore split its CPUs (`default_crc_threads(sharing=...)`): never
    no thread, never more than the cap."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert mff.default_crc_threads(sharing=sharing) == threads
