"""The shard file writer: buffered writes that start their writeback as they go, O_DIRECT writes
through an aligned block, the fallback when a file system refuses O_DIRECT, and prefetching."""

from __future__ import annotations

import fcntl
import os
import zlib

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import fileio
from nvcomp_ckpt_engine.config import NvcompConfig

SIZES = [0, 1, 4095, 4096, 4097, fileio.DIRECT_BLOCK - 1, fileio.DIRECT_BLOCK, 2 * fileio.DIRECT_BLOCK + 5]


def _pieces(total: int, seed: int) -> list[bytes]:
    """`total` random bytes cut into uneven appends."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    cuts = sorted({0, total, *torch.randint(0, total + 1, (5,), generator=gen).tolist()})
    return [data[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("total", SIZES)
def test_written_file_holds_exactly_the_appended_bytes(tmp_path, total, direct):
    pieces = _pieces(total, seed=total)
    path = tmp_path / "shard.bin"
    writer = fileio.ShardFileWriter(path, durable=True, direct=direct)
    offsets = [writer.append(p) for p in pieces]
    assert writer.finish() == total
    data = b"".join(pieces)
    assert path.read_bytes() == data
    assert writer.crc32 == zlib.crc32(data)
    assert offsets == [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def test_direct_mode_is_used_where_the_file_system_allows_it(tmp_path):
    writer = fileio.ShardFileWriter(tmp_path / "f", direct=True)
    try:
        flags = fcntl.fcntl(writer._fd, fcntl.F_GETFL)
        assert writer.direct == bool(flags & os.O_DIRECT)
    finally:
        writer.abort()
    assert not list(tmp_path.iterdir())


def test_refused_o_direct_falls_back_to_buffered_writes_with_a_warning(tmp_path, monkeypatch):
    real = fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", refuse)
    with pytest.warns(RuntimeWarning, match="O_DIRECT writes are not possible here"):
        writer = fileio.ShardFileWriter(tmp_path / "f", direct=True)
    assert not writer.direct
    writer.append(b"abc" * 5000)
    writer.finish()
    assert (tmp_path / "f").read_bytes() == b"abc" * 5000


def test_durable_writes_start_writeback_of_every_written_range(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "WRITEBACK_STEP", 1000)
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    writer = fileio.ShardFileWriter(tmp_path / "f", durable=True)
    for piece in _pieces(10_000, seed=1):
        writer.append(piece)
    writer.finish()
    assert all(advice == os.POSIX_FADV_DONTNEED for *_, advice in calls)
    ranges = [(off, off + n) for off, n, _ in calls]
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1][1] > 10_000 - 1000 and all(b - a >= 1000 for a, b in ranges)


def test_writes_that_need_not_be_durable_leave_writeback_to_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "WRITEBACK_STEP", 10)
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: calls.append(args))
    writer = fileio.ShardFileWriter(tmp_path / "f", durable=False)
    writer.append(b"x" * 100)
    writer.finish()
    assert calls == []


def test_o_direct_save_loads_bit_exact(tmp_path):
    state = {"w": torch.randn(300_000), "b": torch.arange(1000, dtype=torch.int64), "step": 3}
    nce.save(state, tmp_path / "a.nvckpt", o_direct=True)
    nce.save(state, tmp_path / "b.nvckpt")
    back = nce.load(tmp_path / "a.nvckpt")
    for key in ("w", "b"):
        assert torch.equal(back[key].view(torch.uint8), state[key].view(torch.uint8))
    assert back["step"] == 3
    assert os.path.getsize(tmp_path / "a.nvckpt") == os.path.getsize(tmp_path / "b.nvckpt")


def test_o_direct_config_key_is_validated():
    assert NvcompConfig.from_mapping({"o_direct": True}).o_direct is True
    with pytest.raises(ValueError, match="'o_direct'"):
        NvcompConfig.from_mapping({"o_direct": "yes"})


def test_prefetch_asks_for_the_leading_bytes_of_each_file_in_order(tmp_path, monkeypatch):
    sizes = {"a": 3 << 20, "b": 5 << 20, "c": 1 << 20}
    for name, size in sizes.items():
        (tmp_path / name).write_bytes(b"\0" * size)
    asked = []

    def fadvise(fd, offset, length, advice):
        asked.append((os.fstat(fd).st_size, offset, length, advice))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    paths = [str(tmp_path / n) for n in ("a", "missing", "b", "c")]
    fileio.prefetch(paths, 6 << 20).join(10)
    # a whole, the missing file skipped, the first 3 MiB of b, then the budget is spent
    assert asked == [(3 << 20, 0, 3 << 20, os.POSIX_FADV_WILLNEED),
                     (5 << 20, 0, 3 << 20, os.POSIX_FADV_WILLNEED)]
    assert fileio.prefetch([], 1 << 20) is None and fileio.prefetch(paths, 0) is None


def test_a_staged_directory_appears_whole_or_not_at_all(tmp_path):
    final = tmp_path / "a" / "b" / "out"
    with fileio.staged_directory(final) as staging:
        assert staging.parent == final.parent and staging.name.endswith(fileio.PARTIAL_SUFFIX)
        (staging / "x").write_text("done")
        assert not final.exists()
    assert (final / "x").read_text() == "done" and sorted(os.listdir(final.parent)) == ["out"]

    failed = tmp_path / "c" / "d" / "out"
    with pytest.raises(RuntimeError, match="half way"):
        with fileio.staged_directory(failed) as staging:
            (staging / "x").write_text("half")
            raise RuntimeError("half way")
    assert not (tmp_path / "c").exists()  # the parents it created are gone too

    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o750)
    with pytest.raises(RuntimeError):
        with fileio.staged_directory(empty):
            raise RuntimeError("half way")
    assert os.listdir(empty) == [] and sorted(os.listdir(tmp_path)) == ["a", "empty"]
    with fileio.staged_directory(empty) as staging:
        (staging / "y").write_text("done")
    assert os.listdir(empty) == ["y"] and empty.stat().st_mode & 0o777 == 0o750


def test_read_bounded_refuses_a_file_larger_than_its_limit_unread(tmp_path):
    """The size comes from fstat: a sparse 1 GiB file is refused without a byte read or
    allocated; a file within the limit is read whole; a folder or a FIFO is not a file."""
    import tracemalloc

    path = tmp_path / "small"
    path.write_bytes(b"12345")
    assert fileio.read_bounded(path, 5) == b"12345"
    os.truncate(path, 1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(fileio.FileTooLargeError, match=rf"{path}: 1073741824 bytes, more "
                           "than the 4096 a record may have; refused unread") as info:
            fileio.read_bounded(path, 4096, what="a record")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (info.value.size, info.value.limit) == (1 << 30, 4096) and peak < 1 << 20
    with pytest.raises(ValueError, match="not a regular file"):
        fileio.read_bounded(tmp_path, 4096)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        fileio.read_bounded(tmp_path / "fifo", 4096)
