"""The distributed commit, `latest`, retention, and crash consistency of the save sequence.

Fake ranks are threads of this process talking through `StoreCollective` over a `MemoryStore`;
shard files are written through a storage sink by a tiny fake writer, so nothing here
depends on the container format or torch (one test runs the torch.distributed collective in two
real processes, and is marked `slow`).

The crash suite runs DeepSpeed 0.19.8's save sequence (makedirs, barrier, create, save..., commit,
latest, barrier, plus retention) for a scenario of five saves in a forked child, and kills the
child (`os._exit`, no cleanup, like kill -9) at each of its file-system operations in turn: every
write (torn in half), fsync, rename, unlink, mkdir and rmdir, on every rank. After each kill it
checks that `resolve_load_tag(..., fallback_to_complete=True)` yields a checkpoint that is whole
(manifest, sizes, CRCs, and every file from the same save) and not older than the last save whose
`latest` was written, and that a restarted job saves, loads and cleans up normally.

The same scenario, on one rank and in this process, is also crashed through the storage layer
(`storage.faults`): at each storage operation in turn, just before and just after it takes
effect, with the same checks after each crash.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import join_ranks

from nvcomp_ckpt_engine import collectives, discovery, fileio, retention
from nvcomp_ckpt_engine import commit as cm
from nvcomp_ckpt_engine import manifest as mf
from nvcomp_ckpt_engine import manifest_files as mff
from nvcomp_ckpt_engine.errors import (
    CommitError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from nvcomp_ckpt_engine.manifest import ShardRecord
from nvcomp_ckpt_engine.storage import locations, wrap_storages
from nvcomp_ckpt_engine.storage.faults import Fault, FaultPlan, SimulatedCrash

HOST = "node0"
LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}


# ---------------------------------------------------------------------------------------------
# Hooks: no-ops here; the crash child replaces them with its injector.


class _NoHooks:
    def point(self, name: str, torn: Callable[[], Any] | None = None) -> None:
        pass

    def milestone(self, name: str, index: int) -> None:
        pass

    def enter_rank(self, rank: int) -> None:
        pass


HOOKS: Any = _NoHooks()


# ---------------------------------------------------------------------------------------------
# A fake shard writer and fake ranks.


def shard_bytes(tag: str, gen: int, rank: int, idx: int, size: int = 2500) -> bytes:
    """Deterministic content that says which save, rank and file it belongs to."""
    header = f"NVFAKE|{tag}|{gen}|{rank}|{idx}|".encode()
    return header + random.Random(zlib.crc32(header)).randbytes(size + 97 * idx)


def parse_shard(data: bytes) -> tuple[str, int, int, int]:
    _, tag, gen, rank, idx, _ = data.split(b"|", 5)
    return tag.decode(), int(gen), int(rank), int(idx)


def names_of(rank: int) -> list[str]:
    """DeepSpeed's files: rank 0 also writes the model states."""
    optim = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return ["mp_rank_00_model_states.pt", optim] if rank == 0 else [optim]


def write_shard(
    plan: cm.TagPlan, name: str, data: bytes, *, rank: int, durable: bool = True
) -> ShardRecord:
    """What the engine's save() does, minus compression: three appends, then publish."""
    requested = plan.tag_dir / name  # the path DeepSpeed passes
    with locations.open_sink(plan.write_path(requested), durable=durable) as writer:
        third = len(data) // 3 + 1
        for start in range(0, len(data), third):
            writer.append(data[start:start + third])
        size = writer.finish()
    return ShardRecord(
        path=plan.record_path(requested), rank=rank, raw_bytes=2 * size, file_bytes=size,
        crc32=zlib.crc32(data), codecs=("none",), node=HOST,
    )


def run_ranks(world_size: int, fn: Callable[[int, Any], Any], *, timeout: float = 10.0) -> list:
    """Run fn(rank, collective) on `world_size` threads; each result or exception, by rank.

    Fails the test if any rank is still running after `timeout` plus a margin: nothing may hang.
    """
    store = collectives.MemoryStore(timeout_s=timeout)
    results: list[Any] = [None] * world_size

    def body(rank: int) -> None:
        HOOKS.enter_rank(rank)
        collective = collectives.StoreCollective(store, rank=rank, world_size=world_size, timeout_s=timeout)
        try:
            results[rank] = fn(rank, collective)
        except BaseException as exc:
            results[rank] = exc

    join_ranks(body, world_size, timeout)
    return results


def ds_write_latest(save_dir: Path, tag: str) -> None:
    """DeepSpeed's own `latest` write after commit: truncate, write, no fsync."""
    HOOKS.point("ds-latest:truncate")
    fd = os.open(save_dir / discovery.LATEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = tag.encode()
        HOOKS.point("ds-latest:write", torn=lambda: os.write(fd, data[: len(data) // 2]))
        os.write(fd, data)
    finally:
        os.close(fd)


def ds_save(
    save_dir: Path,
    tag: str,
    gen: int,
    *,
    index: int = 0,
    world_size: int = 2,
    keep_last: int | None = None,
    fail_rank: int | None = None,
    timeout: float = 10.0,
    durable: bool = True,
) -> list:
    """DeepSpeed 0.19.8's save_checkpoint on fake ranks, with the engine's calls filled in."""

    def rank_main(rank: int, collective: Any) -> cm.CommitResult:
        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
        collective.barrier(step="makedirs")
        plan = cm.prepare_tag_dir(save_dir, tag, rank=rank, durable=durable)  # engine.create
        records, error = [], None
        for idx, name in enumerate(names_of(rank)):  # engine.save(state, path), no barrier
            try:
                if rank == fail_rank:
                    raise OSError(28, "No space left on device")
                data = shard_bytes(tag, gen, rank, idx)
                records.append(write_shard(plan, name, data, rank=rank, durable=durable))
            except OSError as exc:
                error = exc
                break
        result = cm.commit_checkpoint(  # engine.commit(info)
            plan.tag_dir, records, collective=collective, layout=LAYOUT, timeout_s=timeout,
            plan=plan, error=error, step=gen, durable=durable,
        )
        if rank == 0:
            HOOKS.milestone("committed", index)
            discovery.write_latest(save_dir, tag, durable=durable)  # the engine, right after commit
            HOOKS.milestone("latest", index)
            ds_write_latest(save_dir, tag)  # then DeepSpeed itself
        collective.barrier(step="final")
        if rank == 0 and keep_last is not None:
            retention.apply_retention(save_dir, keep_last, protect={tag})
            HOOKS.milestone("retained", index)
        return result

    return run_ranks(world_size, rank_main, timeout=timeout)


def check_whole(save_dir: Path, tag: str, *, allow_pending: bool = False) -> int:
    """Assert the checkpoint is whole (manifest, sizes, CRCs, one save's files); its generation."""
    tag_dir = save_dir / tag
    manifest = mf.read_manifest(tag_dir)
    mff.verify_files(tag_dir, manifest, check_crc=True, allow_pending=allow_pending)
    expected = {(rank, name) for rank in range(manifest.world_size) for name in names_of(rank)}
    assert {(r.rank, r.path) for r in manifest.files} == expected
    gens = set()
    for record in manifest.files:
        staged = mff.staged_path(tag_dir, manifest, record)
        path = staged if staged is not None and staged.exists() else tag_dir / record.path
        data = path.read_bytes()
        file_tag, gen, rank, idx = parse_shard(data)
        assert (file_tag, rank) == (tag, record.rank), path
        assert data == shard_bytes(tag, gen, rank, idx), path
        gens.add(gen)
    assert len(gens) == 1, f"{tag} mixes saves {sorted(gens)}"
    return gens.pop()


# ---------------------------------------------------------------------------------------------
# Collectives.


def test_memory_store_collective_gathers_in_rank_order() -> None:
    def fn(rank: int, collective: Any) -> list:
        first = collective.all_gather_object({"r": rank}, step="a")
        collective.barrier(step="b")
        return first + collective.all_gather_object([rank, "x"], step="c")

    results = run_ranks(5, fn)
    for result in results:
        assert result == [{"r": r} for r in range(5)] + [[r, "x"] for r in range(5)]


def test_all_true_is_true_only_when_every_rank_says_so() -> None:
    assert run_ranks(3, lambda rank, c: c.all_true(True, step="poll")) == [True] * 3
    assert run_ranks(3, lambda rank, c: c.all_true(rank != 1, step="poll")) == [False] * 3
    assert collectives.LocalCollective().all_true(True) and not collectives.LocalCollective().all_true(False)


def test_store_collective_deletes_keys_it_no_longer_needs() -> None:
    store = collectives.MemoryStore()
    collective = collectives.StoreCollective(store, rank=0, world_size=1, prefix="p")
    for step in range(5):
        collective.barrier(step=f"s{step}")
    assert len(store._data) == 1  # only the last step's key


def test_store_collective_names_missing_ranks_within_the_timeout() -> None:
    store = collectives.MemoryStore()
    collective = collectives.StoreCollective(store, rank=0, world_size=4, timeout_s=0.2)
    store.set("nvcomp_ckpt_engine/commit/0/report/2", b"null")
    started = time.monotonic()
    with pytest.raises(CommitError, match=r"step 'report': rank\(s\) \[1, 3\] did not arrive "
                       r"within 0.2 s"):
        collective.all_gather_object(None, step="report")
    assert time.monotonic() - started < 5


def test_store_collective_over_torch_stores(tmp_path: Path) -> None:
    """Works with torch's stores as well (the same methods)."""
    dist = pytest.importorskip("torch.distributed")
    for store in (dist.HashStore(), dist.FileStore(str(tmp_path / "filestore"), 1)):
        collective = collectives.StoreCollective(store, rank=0, world_size=1, timeout_s=1)
        assert collective.all_gather_object({"a": [1]}, step="x") == [{"a": [1]}]
        missing = collectives.StoreCollective(store, rank=0, world_size=2, timeout_s=0.2, prefix="q")
        with pytest.raises(CommitError, match=r"rank\(s\) \[1\] did not arrive"):
            missing.barrier(step="y")


def test_local_and_torch_collectives_without_a_process_group() -> None:
    assert collectives.LocalCollective().all_gather_object(3) == [3]
    assert isinstance(collectives.LocalCollective(), collectives.Collective)
    pytest.importorskip("torch.distributed")
    collective = collectives.TorchDistributedCollective(timeout_s=5)
    assert (collective.rank, collective.world_size) == (0, 1)
    assert collective.all_gather_object({"x": 1}) == [{"x": 1}]
    collective.barrier()


# ---------------------------------------------------------------------------------------------
# The commit.


def test_single_rank_commit(tmp_path: Path) -> None:
    plan = cm.prepare_tag_dir(tmp_path, "global_step1", rank=0)
    records = [write_shard(plan, n, shard_bytes("global_step1", 1, 0, i), rank=0)
               for i, n in enumerate(names_of(0))]
    result = cm.commit_checkpoint(
        plan.tag_dir, records, collective=collectives.LocalCollective(), layout=LAYOUT, timeout_s=5,
        plan=plan, step=1, versions={"container": "1"},
    )
    manifest = result.manifest
    assert mf.read_manifest(plan.tag_dir) == manifest
    assert (result.tag, result.world_size, result.files, result.staged) == ("global_step1", 1, 2,
                                                                            False)
    assert result.raw_bytes == 2 * result.file_bytes == 2 * sum(r.file_bytes for r in records)
    assert manifest.step == 1 and manifest.world_size == 1 and manifest.layout == LAYOUT
    assert manifest.versions["container"] == "1" and "nvcomp_ckpt_engine" in manifest.versions
    assert check_whole(tmp_path, "global_step1") == 1


def test_many_ranks_commit_and_none_returns_before_the_manifest(tmp_path: Path) -> None:
    world = 16

    def fn(rank: int, collective: Any) -> mf.Manifest:
        plan = cm.prepare_tag_dir(tmp_path, "t", rank=rank)
        records = [write_shard(plan, n, shard_bytes("t", 1, rank, i), rank=rank)
                   for i, n in enumerate(names_of(rank))]
        manifest = cm.commit_checkpoint(plan.tag_dir, records, collective=collective,
                                        layout=LAYOUT, timeout_s=10, plan=plan).manifest
        assert mf.read_manifest(plan.tag_dir) == manifest  # durable before anyone returns
        return manifest

    results = run_ranks(world, fn)
    assert all(r == results[0] for r in results), results
    assert len(results[0].files) == world + 1
    check_whole(tmp_path, "t")


def test_one_failing_rank_makes_every_rank_raise_naming_it(tmp_path: Path) -> None:
    started = time.monotonic()
    results = ds_save(tmp_path, "global_step1", 1, world_size=4, fail_rank=2, timeout=30)
    assert time.monotonic() - started < 10  # reported at once, not by a timeout
    for result in results:
        assert isinstance(result, CommitError)
        text = str(result)
        assert ("commit of checkpoint 'global_step1' failed on 1 of 4 ranks [2]: rank 2: "
                "OSError: [Errno 28] No space left on device (at test_commit.py:") in text
        assert "No manifest was written, so the checkpoint is incomplete" in text
    assert not (tmp_path / "global_step1" / mf.MANIFEST_NAME).exists()
    assert not (tmp_path / discovery.LATEST_NAME).exists()


def test_a_rank_that_never_arrives_is_named_within_the_timeout(tmp_path: Path) -> None:
    def fn(rank: int, collective: Any) -> cm.CommitResult | None:
        plan = cm.prepare_tag_dir(tmp_path, "t", rank=rank)
        records = [write_shard(plan, n, shard_bytes("t", 1, rank, i), rank=rank)
                   for i, n in enumerate(names_of(rank))]
        if rank == 1:
            return None  # died before its commit
        return cm.commit_checkpoint(plan.tag_dir, records, collective=collective,
                                    layout=LAYOUT, timeout_s=0.5, plan=plan)

    started = time.monotonic()
    results = run_ranks(3, fn, timeout=0.5)
    assert time.monotonic() - started < 5
    for rank in (0, 2):
        assert isinstance(results[rank], CommitError)
        assert re.search(r"commit of checkpoint 't': collective step 'report': rank\(s\) \[1\] did "
                         r"not arrive within 0.5 s", str(results[rank]))
    assert not (tmp_path / "t" / mf.MANIFEST_NAME).exists()


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda recs, rank: [dataclass_replace(recs[0], rank=0)] if rank == 1 else recs,
         r"rank 1: ValueError: record 'zero_pp_rank_1_mp_rank_00_optim_states.pt' says rank 0, "
         r"but this is rank 1"),
        (lambda recs, rank: [dataclass_replace(recs[0], file_bytes=1)] if rank == 1 else recs,
         r"rank 1: ValueError: .*zero_pp_rank_1_mp_rank_00_optim_states.pt has \d+ bytes but its "
         r"record says 1"),
        (lambda recs, rank: recs + [dataclass_replace(recs[0], path="gone.pt")] if rank == 1
         else recs, r"rank 1: FileNotFoundError: the file of record 'gone.pt'"),
        (lambda recs, rank: recs + ["not a record"] if rank == 1 else recs,
         r"rank 1: TypeError: records must be ShardRecord"),
    ],
)
def test_bad_records_fail_the_commit_on_every_rank(tmp_path: Path, spoil, message: str) -> None:
    def fn(rank: int, collective: Any) -> cm.CommitResult:
        plan = cm.prepare_tag_dir(tmp_path, "t", rank=rank)
        records = [write_shard(plan, n, shard_bytes("t", 1, rank, i), rank=rank)
                   for i, n in enumerate(names_of(rank))]
        return cm.commit_checkpoint(plan.tag_dir, spoil(records, rank), collective=collective,
                                    layout=LAYOUT, timeout_s=5, plan=plan)

    for result in run_ranks(2, fn):
        assert isinstance(result, CommitError) and re.search(message, str(result)), result
    assert not (tmp_path / "t" / mf.MANIFEST_NAME).exists()


def dataclass_replace(record: ShardRecord, **kw: Any) -> ShardRecord:
    import dataclasses

    return dataclasses.replace(record, **kw)


def test_two_ranks_writing_the_same_path_fail_on_every_rank(tmp_path: Path) -> None:
    def fn(rank: int, collective: Any) -> cm.CommitResult:
        plan = cm.prepare_tag_dir(tmp_path, "t", rank=rank)
        record = write_shard(plan, "same.pt", shard_bytes("t", 1, rank, 0), rank=rank)
        return cm.commit_checkpoint(plan.tag_dir, [record], collective=collective,
                                    layout=LAYOUT, timeout_s=5, plan=plan)

    for result in run_ranks(3, fn):
        assert isinstance(result, CommitError)
        assert ("the ranks' records do not fit together: path 'same.pt' is listed twice"
                in str(result))
    assert not (tmp_path / "t" / mf.MANIFEST_NAME).exists()


def test_ranks_disagreeing_on_the_tag_fail(tmp_path: Path) -> None:
    def fn(rank: int, collective: Any) -> cm.CommitResult:
        plan = cm.prepare_tag_dir(tmp_path, f"t{rank}", rank=rank)
        return cm.commit_checkpoint(plan.tag_dir, [], collective=collective, layout=LAYOUT,
                                    timeout_s=5, plan=plan)

    for result in run_ranks(2, fn):
        assert isinstance(result, CommitError)
        assert "rank 1: is committing tag 't1', not 't0'" in str(result) or (
            "rank 0: is committing tag 't0', not 't1'" in str(result))


def test_a_failed_manifest_write_fails_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cm, "write_manifest", no_space)

    def fn(rank: int, collective: Any) -> cm.CommitResult:
        plan = cm.prepare_tag_dir(tmp_path, "t", rank=rank)
        return cm.commit_checkpoint(plan.tag_dir, [], collective=collective, layout=LAYOUT,
                                    timeout_s=5, plan=plan)

    for result in run_ranks(3, fn):
        assert isinstance(result, CommitError)
        assert ("failed on 1 of 3 ranks [0]: rank 0: OSError: [Errno 28] No space left on device"
                in str(result))
        assert "The manifest could not be written (or not made durable)" in str(result)


def test_node_local_storage_writes_one_manifest_per_node(tmp_path: Path) -> None:
    nodes = ["n0", "n0", "n1", "n1"]

    def fn(rank: int, collective: Any) -> mf.Manifest:
        save_dir = tmp_path / nodes[rank]  # each node's own disk
        plan = cm.prepare_tag_dir(save_dir, "t", rank=rank, leader=rank % 2 == 0)
        local = rank % 2  # DeepSpeed names files by local rank with node-local storage
        record = dataclass_replace(
            write_shard(plan, f"zero_pp_rank_{local}.pt", shard_bytes("t", 1, rank, 0), rank=rank),
            node=nodes[rank],
        )
        return cm.commit_checkpoint(plan.tag_dir, [record], collective=collective, layout=LAYOUT,
                                    timeout_s=5, plan=plan, node_local_storage=True,
                                    node=nodes[rank]).manifest

    results = run_ranks(4, fn)
    assert all(isinstance(r, mf.Manifest) for r in results), results
    for node in ("n0", "n1"):
        found = mf.read_manifest(tmp_path / node / "t")
        assert found == results[0] and found.node_local_storage
        mff.verify_files(tmp_path / node / "t", found, local_only=True, node=node)


# ---------------------------------------------------------------------------------------------
# prepare_tag_dir and re-saves.


def test_prepare_fresh_tag(tmp_path: Path) -> None:
    plan = cm.prepare_tag_dir(tmp_path, "global_step5", rank=3)
    assert plan.staging_suffix is None
    assert (plan.tag_dir / mf.TAG_MARKER_NAME).is_file()
    assert plan.write_path(tmp_path / "global_step5" / "a.pt") == tmp_path / "global_step5" / "a.pt"
    assert plan.record_path(tmp_path / "global_step5" / "d" / "a.pt") == "d/a.pt"
    with pytest.raises(ValueError, match="path '../other/a.pt' has an empty, '.' or '..'"):
        plan.write_path(tmp_path / "other" / "a.pt")
    with pytest.raises(ValueError, match="tag '../x'"):
        cm.prepare_tag_dir(tmp_path, "../x", rank=0)


def test_prepare_existing_tag_stages_and_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    assert all(isinstance(r, cm.CommitResult) for r in ds_save(tmp_path, "t", 1))
    plan = cm.prepare_tag_dir(tmp_path, "t", rank=1)
    assert re.fullmatch(r"\.nvckpt-stage-r1-[0-9a-f]{12}", plan.staging_suffix)
    staged = plan.write_path(tmp_path / "t" / "zero.pt")
    assert staged.name == "zero.pt" + plan.staging_suffix
    assert plan.record_path(tmp_path / "t" / "zero.pt") == "zero.pt"
    assert cm.prepare_tag_dir(tmp_path, "t", rank=1).staging_suffix != plan.staging_suffix


def test_resave_replaces_the_checkpoint_atomically(tmp_path: Path) -> None:
    ds_save(tmp_path, "t", 1)
    results = ds_save(tmp_path, "t", 2)
    assert all(isinstance(r, cm.CommitResult) and r.staged and r.manifest.pending
               for r in results)
    assert check_whole(tmp_path, "t") == 2
    assert not [p for p in (tmp_path / "t").iterdir() if mf.RESERVED_MARK in p.name]


def test_interrupted_resave_before_publish_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    ds_save(tmp_path, "t", 1)
    for rank in (0, 1):  # a re-save that wrote every file but never committed
        plan = cm.prepare_tag_dir(tmp_path, "t", rank=rank)
        for idx, name in enumerate(names_of(rank)):
            write_shard(plan, name, shard_bytes("t", 2, rank, idx), rank=rank)
    assert discovery.resolve_load_tag(tmp_path) == "t"
    assert check_whole(tmp_path, "t") == 1


def test_interrupted_resave_after_publish_is_rolled_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ds_save(tmp_path, "t", 1)

    def crash(*args: Any, **kwargs: Any) -> int:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cm, "_rename_staged", crash)
    results = ds_save(tmp_path, "t", 2)
    monkeypatch.undo()
    for result in results:
        assert isinstance(result, CommitError)
        assert "The manifest is written and the checkpoint complete, but renames" in str(result)
    manifest = mf.read_manifest(tmp_path / "t")
    with pytest.raises(IncompleteCheckpointError, match="rename of an interrupted re-save"):
        mff.verify_files(tmp_path / "t", manifest)
    assert check_whole(tmp_path, "t", allow_pending=True) == 2
    with caplog.at_level(logging.WARNING):
        assert discovery.resolve_load_tag(tmp_path, "t") == "t"
    assert "completed 3 renames of staged files" in caplog.text
    assert check_whole(tmp_path, "t") == 2
    assert cm.finish_pending_renames(tmp_path / "t", manifest) == 0  # idempotent


# ---------------------------------------------------------------------------------------------
# latest.


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"  \n\t", "is empty"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"global_step1\x00", "does not hold a usable tag"),
        (b"../../etc", "does not hold a usable tag"),
        (b"a" * 5000, "is longer than 4096 bytes"),
        (b"global_st", "names tag 'global_st', but there is no such folder"),
    ],
)
def test_unusable_latest(tmp_path: Path, content: bytes | None, reason: str) -> None:
    (tmp_path / "global_step1").mkdir()
    if content is not None:
        (tmp_path / discovery.LATEST_NAME).write_bytes(content)
    pointer = discovery.inspect_latest(tmp_path)
    assert pointer.tag is None and reason in pointer.reason
    assert discovery.read_latest(tmp_path) is None


def test_latest_round_trip_and_whitespace(tmp_path: Path) -> None:
    (tmp_path / "global_step1").mkdir()
    (tmp_path / discovery.LATEST_NAME).write_text("global_step1\n")
    assert discovery.read_latest(tmp_path) == "global_step1"
    (tmp_path / "global_step2").mkdir()
    discovery.write_latest(tmp_path, "global_step2")
    assert (tmp_path / discovery.LATEST_NAME).read_text() == "global_step2"
    assert sorted(os.listdir(tmp_path)) == ["global_step1", "global_step2", "latest"]
    with pytest.raises(ValueError, match="tag '/abs' is absolute"):
        discovery.write_latest(tmp_path, "/abs")


# ---------------------------------------------------------------------------------------------
# Resolving what to load.


@pytest.fixture
def three_saves(tmp_path: Path) -> Path:
    """global_step1 and global_step2 complete (latest: 2), global_step3 a failed save."""
    ds_save(tmp_path, "global_step1", 1)
    ds_save(tmp_path, "global_step2", 1)
    ds_save(tmp_path, "global_step3", 1, fail_rank=1)
    return tmp_path


def test_find_complete_checkpoints_newest_first(three_saves: Path) -> None:
    (three_saves / ".global_step0.nvckpt-deleting").mkdir()
    assert discovery.find_complete_checkpoints(three_saves) == ["global_step2", "global_step1"]
    assert discovery.find_complete_checkpoints(three_saves / "missing") == []


def test_resolve_follows_a_complete_latest(three_saves: Path) -> None:
    assert discovery.resolve_load_tag(three_saves) == "global_step2"
    assert discovery.resolve_load_tag(three_saves, "global_step1") == "global_step1"


def test_resolve_incomplete_latest(three_saves: Path, caplog: pytest.LogCaptureFixture) -> None:
    (three_saves / discovery.LATEST_NAME).write_text("global_step3")
    with pytest.raises(IncompleteCheckpointError, match=(
        r"cannot load from .*: latest names 'global_step3', which is not complete: .*no "
        r"nvcomp_manifest.json.*; the newest complete checkpoint is 'global_step2': pass "
        r"fallback_to_complete=True to load it instead, or load it by tag"
    )):
        discovery.resolve_load_tag(three_saves)
    with caplog.at_level(logging.WARNING):
        assert discovery.resolve_load_tag(three_saves, fallback_to_complete=True) == "global_step2"
    assert "falling back to the newest complete checkpoint 'global_step2'" in caplog.text


@pytest.mark.parametrize("content", [b"", b" \n", b"glob", b"\x00\x01"])
def test_resolve_with_empty_or_garbage_latest(three_saves: Path, content: bytes) -> None:
    (three_saves / discovery.LATEST_NAME).write_bytes(content)
    with pytest.raises(IncompleteCheckpointError, match="fallback_to_complete=True"):
        discovery.resolve_load_tag(three_saves)
    assert discovery.resolve_load_tag(three_saves, fallback_to_complete=True) == "global_step2"


def test_resolve_latest_naming_a_damaged_checkpoint(three_saves: Path) -> None:
    victim = three_saves / "global_step2" / names_of(1)[0]
    victim.write_bytes(victim.read_bytes()[:-1])  # a size change: seen without reading CRCs
    assert discovery.resolve_load_tag(three_saves, fallback_to_complete=True) == "global_step1"
    (three_saves / "global_step1" / mf.MANIFEST_NAME).write_bytes(b"{}")
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint to fall back to"):
        discovery.resolve_load_tag(three_saves, fallback_to_complete=True)


def test_resolve_explicit_incomplete_tag_is_never_substituted(three_saves: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match=(
        r"checkpoint 'global_step3' in .* is not complete: .*; the newest complete checkpoint "
        r"is 'global_step2'"
    )):
        discovery.resolve_load_tag(three_saves, "global_step3", fallback_to_complete=True)


def test_resolve_honours_latest_set_back_by_hand(
    three_saves: Path, caplog: pytest.LogCaptureFixture
) -> None:
    discovery.write_latest(three_saves, "global_step1")
    with caplog.at_level(logging.WARNING):
        assert discovery.resolve_load_tag(three_saves) == "global_step1"
    assert "'global_step2' in" in caplog.text and "pass tag='global_step2'" in caplog.text


def test_resolve_in_an_empty_save_dir(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError, match="does not exist; there is no complete"):
        discovery.resolve_load_tag(tmp_path)
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint to fall back to"):
        discovery.resolve_load_tag(tmp_path, fallback_to_complete=True)


# ---------------------------------------------------------------------------------------------
# Retention.


def make_saves(save_dir: Path, count: int) -> list[str]:
    tags = [f"global_step{i}" for i in range(1, count + 1)]
    for tag in tags:
        ds_save(save_dir, tag, 1)
    return tags


def test_retention_keeps_the_newest_and_protected(tmp_path: Path) -> None:
    tags = make_saves(tmp_path, 6)
    discovery.write_latest(tmp_path, "global_step2")  # latest is never deleted
    report = retention.apply_retention(tmp_path, 2, protect={"global_step3", None})
    assert report.kept == ("global_step6", "global_step5")
    assert report.deleted == ("global_step1", "global_step4")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [discovery.LATEST_NAME, "global_step2", "global_step3", "global_step5", "global_step6"]
    )
    for tag in tags[1:3] + tags[4:]:
        check_whole(tmp_path, tag)


def _with_layout(found: mf.Manifest, layout: dict[str, Any]) -> mf.Manifest:
    return mf.build_manifest(tag=found.tag, world_size=found.world_size, files=found.files,
                             layout=layout, step=found.step, created_unix_ns=found.created_unix_ns)


def test_retention_never_deletes_a_universal_checkpoint(tmp_path: Path) -> None:
    """`nvcomp-ckpt to-universal` into the save folder writes a checkpoint the job did not save:
    keep_last neither counts nor deletes it, however old."""
    make_saves(tmp_path, 4)
    converted = mf.read_manifest(tmp_path / "global_step1")
    universal = mf.layout_record("deepspeed", kind=mf.UNIVERSAL_LAYOUT_KIND, zero_stage=2,
                                 source_dp=2, source_tp=1, source_pp=1)
    mf.write_manifest(tmp_path / "global_step1", _with_layout(converted, universal))
    report = retention.apply_retention(tmp_path, 2)
    assert report.kept == ("global_step4", "global_step3") and report.deleted == ("global_step2",)
    assert report.left_alone[0].startswith("global_step1: a universal checkpoint")
    check_whole(tmp_path, "global_step1")


def test_retention_says_why_it_deletes_a_checkpoint_newer_than_the_one_resumed_from(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A job resumed from global_step2, past a damaged global_step3 ("fallback_to_complete"),
    with global_step4 newer still (latest named global_step2), then saved global_step5."""
    make_saves(tmp_path, 5)
    with caplog.at_level(logging.INFO, logger="nvcomp_ckpt_engine.retention"):
        report = retention.apply_retention(
            tmp_path, 1, protect={"global_step5"}, resumed_from="global_step2",
            passed_over={"global_step3": "CorruptCheckpointError: x.pt: checksum mismatch"})
    assert report.deleted == ("global_step1", "global_step2", "global_step3", "global_step4")
    said = {r.getMessage().split(os.sep)[-1].split(" ")[0]: r for r in caplog.records}
    assert said["global_step3"].levelno == logging.WARNING
    assert ("newer than 'global_step2', which this job resumed from: its load was passed over "
            "(CorruptCheckpointError: x.pt: checksum mismatch)") in said["global_step3"].getMessage()
    assert said["global_step4"].levelno == logging.WARNING
    assert "newer than 'global_step2'" in said["global_step4"].getMessage()
    for routine in ("global_step1", "global_step2"):
        assert said[routine].levelno == logging.INFO
        assert said[routine].getMessage().endswith("(older than the ones kept)")


def test_retention_deletes_nothing_with_too_few_complete(tmp_path: Path) -> None:
    make_saves(tmp_path, 2)
    ds_save(tmp_path, "global_step3", 1, fail_rank=0)
    report = retention.apply_retention(tmp_path, 3)
    assert report.deleted == () and len(report.kept) == 2
    with pytest.raises(ValueError, match="keep_last must be an int >= 1, got 0"):
        retention.apply_retention(tmp_path, 0)


def test_retention_cleans_failed_saves_but_never_foreign_folders(tmp_path: Path) -> None:
    ds_save(tmp_path, "global_step1", 1, fail_rank=1)  # ours, failed: marker + regular files
    foreign = tmp_path / "my_notes"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    odd = tmp_path / "global_step0"  # ours, but it holds a folder we did not make
    cm.prepare_tag_dir(tmp_path, "global_step0", rank=0)
    (odd / "offloaded_tensors").mkdir()
    crashed = tmp_path / "global_step9x"  # a crash before the marker: only our temp files
    crashed.mkdir()
    (crashed / ".a.pt.abc.nvckpt-partial").write_bytes(b"x")
    past = time.time() - 3600
    for path in (foreign, odd, crashed, tmp_path / "global_step1"):
        os.utime(path, (past, past))
    ds_save(tmp_path, "global_step2", 1)
    newer_orphan = cm.prepare_tag_dir(tmp_path, "global_step3", rank=0).tag_dir  # maybe in flight
    report = retention.apply_retention(tmp_path, 1)
    assert sorted(report.deleted) == ["global_step1", "global_step9x"]
    assert foreign.is_dir() and (foreign / "notes.txt").read_text() == "keep me"
    assert odd.is_dir() and newer_orphan.is_dir()
    assert [s.split(":")[0] for s in report.left_alone] == ["global_step0", "my_notes"]
    assert "'offloaded_tensors', which is not a regular file" in report.left_alone[0]


def test_retention_removes_leftovers_and_finishes_interrupted_deletions(tmp_path: Path) -> None:
    make_saves(tmp_path, 3)
    old = tmp_path / "global_step1"
    (old / ".x.pt.12345678.nvckpt-partial").write_bytes(b"torn")
    (old / "x.pt.nvckpt-stage-r0-0123456789ab").write_bytes(b"staged, never committed")
    (tmp_path / ".latest.abcdefgh.nvckpt-partial").write_bytes(b"glo")
    (tmp_path / ".global_step0.nvckpt-deleting").mkdir()
    (tmp_path / ".global_step0.nvckpt-deleting" / "f").write_bytes(b"half deleted")
    latest_dir = tmp_path / "global_step3"
    (latest_dir / ".y.12345678.nvckpt-partial").write_bytes(b"")
    report = retention.apply_retention(tmp_path, 3)
    assert sorted(report.leftovers_removed) == sorted([
        ".global_step0.nvckpt-deleting", "global_step1/.x.pt.12345678.nvckpt-partial",
        "global_step1/x.pt.nvckpt-stage-r0-0123456789ab", ".latest.abcdefgh.nvckpt-partial",
    ])
    assert report.left_alone == (
        "global_step3/.y.12345678.nvckpt-partial: leftover in protected tag 'global_step3'",
    )
    for tag in ("global_step1", "global_step2", "global_step3"):
        check_whole(tmp_path, tag)


def test_retention_never_deletes_through_a_symlink(tmp_path: Path) -> None:
    make_saves(tmp_path, 1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ds_save(elsewhere, "global_step0", 1)
    (tmp_path / "global_step0").symlink_to(elsewhere / "global_step0")
    os.utime(elsewhere / "global_step0" / mf.MANIFEST_NAME)
    ds_save(tmp_path, "global_step5", 1)
    report = retention.apply_retention(tmp_path, 1)
    assert "global_step0: a symlink, never deleted" in report.left_alone
    check_whole(elsewhere, "global_step0")


def _damage_manifest(tag_dir: Path, how: str) -> None:
    """A manifest that cannot be read: a flipped byte, or a valid document of another version."""
    path = tag_dir / mf.MANIFEST_NAME
    if how == "flipped byte":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "another version":
        document = json.loads(path.read_text())
        document["version"] = mf.FORMAT_VERSION + 1
        covered = {k: document[k] for k in ("body", "format", "version")}
        canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        document["sha256"] = hashlib.sha256(canonical.encode("ascii")).hexdigest()
        path.write_text(json.dumps(document))
    elif how == "emptied":
        path.write_bytes(b"")
    else:
        path.write_bytes(b'{"format": "nvcomp_ckpt_engine.manifest", "version": 1}')


@pytest.mark.parametrize("how", ["flipped byte", "another version", "emptied", "no body"])
@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_retention_never_deletes_a_checkpoint_whose_manifest_it_cannot_read(
        tmp_path: Path, how: str, keep_last: int) -> None:
    """Such a folder may be a whole checkpoint (a failed save never publishes a manifest):
    it is left alone and reported, however few or many complete checkpoints there are."""
    make_saves(tmp_path, 2)
    _damage_manifest(tmp_path / "global_step1", how)
    past = time.time() - 3600
    os.utime(tmp_path / "global_step1", (past, past))
    report = retention.apply_retention(tmp_path, keep_last)
    assert report.deleted == ()
    assert (tmp_path / "global_step1" / names_of(0)[0]).is_file()
    (note,) = [n for n in report.left_alone if n.startswith("global_step1:")]
    assert "cannot be read" in note, note


def test_resolve_checks_crcs_when_asked_and_names_the_newest_intact_checkpoint(
        three_saves: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file of the newest checkpoint damaged in place (same size): sizes alone pass it; a
    CRC from `crc_of` (or every byte, with `check_crc`) does not."""
    victim = three_saves / "global_step2" / names_of(1)[0]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x01
    victim.write_bytes(bytes(data))
    assert discovery.resolve_load_tag(three_saves) == "global_step2"
    read_crc = lambda path: zlib.crc32(Path(path).read_bytes())  # noqa: E731
    for checks in ({"crc_of": read_crc}, {"check_crc": True}):
        with pytest.raises(IncompleteCheckpointError) as info:
            discovery.resolve_load_tag(three_saves, **checks)
        text = str(info.value)
        assert "crc32" in text and victim.name in text, text
        assert "the newest complete checkpoint is 'global_step1'" in text, text
        assert "fallback_to_complete=True" in text, text
        with caplog.at_level(logging.WARNING):
            assert discovery.resolve_load_tag(three_saves, fallback_to_complete=True, **checks) \
                == "global_step1"
        assert "falling back to the newest complete checkpoint 'global_step1'" in caplog.text
    assert discovery.newest_intact_checkpoint(three_saves, crc_of=read_crc) == "global_step1"
    assert discovery.newest_intact_checkpoint(three_saves, exclude=["global_step1"], crc_of=read_crc) is None


def test_an_exception_of_crc_of_is_a_problem_of_that_file(three_saves: Path) -> None:
    def crc_of(path: Path) -> int:
        raise CorruptCheckpointError(f"{path}: corrupt index")

    with pytest.raises(IncompleteCheckpointError, match="corrupt index.*no complete"):
        discovery.resolve_load_tag(three_saves, crc_of=crc_of)


# ---------------------------------------------------------------------------------------------
# torch.distributed in two real processes (slow: each imports torch).


def _gloo_worker(rank: int, port: int, save_dir: str, absent: bool, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        collective = collectives.TorchDistributedCollective()
        plan = cm.prepare_tag_dir(save_dir, "t", rank=rank)
        records = [write_shard(plan, n, shard_bytes("t", 1, rank, i), rank=rank)
                   for i, n in enumerate(names_of(rank))]
        if absent and rank == 1:
            time.sleep(4)
            queue.put((rank, "absent"))
            return
        # The per-step poll of an async save: one all-reduce, the same answer on every rank.
        polls = [] if absent else [collective.all_true(True), collective.all_true(rank == 0)]
        if polls not in ([], [True, False]):
            raise AssertionError(f"all_true gave {polls}")
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        keys_before = store.num_keys()
        if not absent:
            collective.all_true(True)  # both ranks have counted before either records an arrival
        result = cm.commit_checkpoint(plan.tag_dir, records, collective=collective,
                                      layout=LAYOUT, timeout_s=2, plan=plan)
        collective.barrier(step="after")
        collective.all_true(True)  # every rank has passed the barrier and cleaned up after it
        # A rank keeps only its arrival key of the last step: the store does not grow per step.
        queue.put((rank, (result.files, store.num_keys() - keys_before)))
    except CommitError as exc:
        queue.put((rank, f"CommitError: {exc}"))
    except BaseException as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if not absent:
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("absent", [False, True])
def test_torch_distributed_collective_gloo(tmp_path: Path, absent: bool) -> None:
    import multiprocessing
    import socket

    pytest.importorskip("torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, str(tmp_path), absent, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    if not absent:
        assert results == {0: (3, 2), 1: (3, 2)}
        check_whole(tmp_path, "t")
    else:
        assert results[1] == "absent"
        assert results[0].startswith("CommitError: commit of checkpoint 't': collective step "
                                     "'report': rank(s) [1] did not arrive within 2 s"), results
        assert not (tmp_path / "t" / mf.MANIFEST_NAME).exists()


def test_the_arrival_store_is_the_process_groups_own(tmp_path: Path, monkeypatch: Any) -> None:
    """A job initialized with a ``file://`` init_method (DeepSpeed's own test harness) has
    MASTER_PORT set and no server behind it: the store the arrivals go to is the process group's
    own, at once, not a connection to MASTER_ADDR:MASTER_PORT that waits out its timeout."""
    import socket

    dist = pytest.importorskip("torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        unused_port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(unused_port))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        started = time.monotonic()
        store = collectives._job_store(dist)
        assert time.monotonic() - started < 5
        assert store is not None
        store.set("nvckpt-arrival/1/step/0", "1")
        assert dist.distributed_c10d._get_default_store().check(["nvckpt-arrival/1/step/0"])
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Crash consistency.

#: The scenario the crash suite kills at every step: (tag, generation, failing rank).
SCENARIO = [
    ("global_step1", 1, None),
    ("global_step2", 1, None),
    ("global_step2", 2, None),  # a re-save of the tag `latest` names (resumed at that step)
    ("global_step3", 1, 1),  # rank 1 cannot write: every rank raises CommitError
    ("global_step3", 2, None),  # the restarted job saves it again; retention drops global_step1
]
KEEP_LAST = 2
CRASH_EXIT = 86
#: Runs per kill point: rank threads race (which rank writes the tag marker, say), so a run may
#: not reach the event the counting run logged; another run usually does. A point none of the
#: runs reaches counts as unreached.
KILL_ATTEMPTS = 4
_TEMP_RE = re.compile(r"\.[A-Za-z0-9_]{6,16}\.nvckpt-partial")
_TOKEN_RE = re.compile(r"(nvckpt-stage-r[0-9]+-)[0-9a-f]{12}")


def _short(path: Any, base: str) -> str:
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
    text = text.replace(base, "")
    return _TOKEN_RE.sub(r"\1<token>", _TEMP_RE.sub(".<tmp>.nvckpt-partial", text))


class CrashInjector:
    """Counts the file-system operations of each rank; kills the process at the target one.

    Each operation is an event, identified by its rank, its description (temp-file names and
    staging tokens masked) and how often that rank did it before, and logged before it happens;
    the target event does not happen (a write happens half). Rank threads run concurrently, so
    a race may change a rank's events (two ranks may both write the tag marker); an event the
    target run never reaches is run again (KILL_ATTEMPTS), then counted, and must stay rare. In the counting run it also
    audits durability: when a manifest or `latest` is published, everything it names must be
    fsynced, file and entry.
    """

    def __init__(self, log_path: Path, base: str, target: tuple[str, str, int] | None) -> None:
        self.log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.base = base
        self.target = target
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.local = threading.local()
        self.dirty: set[str] = set()  # files written since their last fsync
        self.unsynced: dict[str, set[str]] = collections.defaultdict(set)  # dir -> new entries

    def _write(self, item: list) -> None:
        os.write(self.log, (json.dumps(item) + "\n").encode())

    def enter_rank(self, rank: int) -> None:
        self.local.label = f"rank{rank}"

    def milestone(self, name: str, index: int) -> None:
        self._write(["milestone", name, index])

    def point(self, name: str, torn: Callable[[], Any] | None = None) -> None:
        label = getattr(self.local, "label", "main")
        name = _short(name, self.base)
        with self.lock:
            occurrence = self.counts[label, name]
            self.counts[label, name] += 1
            self._write(["event", label, name, occurrence])
            if (label, name, occurrence) == self.target:
                if torn is not None:
                    torn()
                os._exit(CRASH_EXIT)

    def violation(self, text: str) -> None:
        self._write(["violation", _short(text, self.base)])

    # The durability audit (only meaningful because the scenario uses durable=True).

    def on_publish(self, src: str, dst: str) -> None:
        name, folder = os.path.basename(dst), os.path.dirname(dst)
        if name == mf.MANIFEST_NAME:
            manifest = mf.parse_manifest(Path(src).read_bytes())
            if os.path.basename(folder) in self.unsynced[os.path.dirname(folder)]:
                self.violation(f"{folder}: its entry is not fsynced when its manifest is written")
            for record in manifest.files:
                staged = mff.staged_path(folder, manifest, record)
                path = os.fspath(staged if staged is not None else Path(folder) / record.path)
                if path in self.dirty:
                    self.violation(f"{path}: not fsynced when the manifest naming it is written")
                if os.path.basename(path) in self.unsynced[os.path.dirname(path)]:
                    self.violation(f"{path}: its rename is not fsynced before the manifest")
        elif name == discovery.LATEST_NAME and src.endswith(fileio.PARTIAL_SUFFIX):
            tag_dir = os.path.join(folder, Path(src).read_text())
            if mf.MANIFEST_NAME in self.unsynced[tag_dir] or (
                os.path.join(tag_dir, mf.MANIFEST_NAME) in self.dirty
            ):
                self.violation(f"latest -> {tag_dir} published before its manifest is durable")

    def on_replace(self, src: str, dst: str) -> None:
        if src in self.dirty:
            self.dirty.discard(src)
            self.dirty.add(dst)
        self.unsynced[os.path.dirname(dst)].add(os.path.basename(dst))

    def on_fsync(self, path: str, is_dir: bool) -> None:
        if is_dir:
            self.unsynced.pop(path, None)
        else:
            self.dirty.discard(path)


class _TornFile:
    """A file object whose writes are events; the target write lands half, then the crash."""

    def __init__(self, f: Any, injector: CrashInjector, path: str) -> None:
        self._f, self._injector, self._path = f, injector, path

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")

        def torn() -> None:
            self._f.write(view[: len(view) // 2])
            self._f.flush()

        self._injector.point(f"write {self._path} ({len(view)} B)", torn=torn)
        with self._injector.lock:
            self._injector.dirty.add(self._path)
        return self._f.write(data)

    def __enter__(self) -> _TornFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd{fd}"


def install_injector(injector: CrashInjector) -> None:
    """Route the file-system calls of storage, manifest, commit and shutil through `injector`.

    Only ever called in the forked child, so the test process keeps the real functions.
    """
    real = {name: getattr(os, name) for name in
            ("replace", "rename", "unlink", "remove", "rmdir", "mkdir", "fsync", "fdopen")}

    def path_op(name: str) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            paths = [os.fspath(a) for a in args[:2] if isinstance(a, (str, os.PathLike))]
            injector.point(f"{name} {' -> '.join(paths)}")
            # The operation and its bookkeeping under one lock: otherwise another rank's fsync
            # could land between them and the audit would see a stale state.
            with injector.lock:
                renaming = name in ("replace", "rename") and "dir_fd" not in kwargs
                if renaming:
                    src, dst = (os.path.abspath(p) for p in paths)
                    injector.on_publish(src, dst)  # the state a reader will see, just before
                result = real[name](*args, **kwargs)
                if renaming:
                    injector.on_replace(src, dst)
                elif name == "mkdir" and paths:
                    path = os.path.abspath(paths[0])
                    injector.unsynced[os.path.dirname(path)].add(os.path.basename(path))
            return result

        return op

    for name in ("replace", "rename", "unlink", "remove", "rmdir", "mkdir"):
        setattr(os, name, path_op(name))

    def fsync(fd: int) -> None:
        # No real fsync: a killed process loses nothing from the page cache, and the audit
        # checks the ordering instead.
        path = _fd_path(fd)
        injector.point(f"fsync {path}")
        with injector.lock:
            injector.on_fsync(path, os.path.isdir(path))

    def fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        f = real["fdopen"](fd, *args, **kwargs)
        return _TornFile(f, injector, _fd_path(fd)) if "w" in (args[0] if args else "") else f

    os.fsync = fsync
    os.fdopen = fdopen


def run_scenario(save_dir: Path) -> None:
    for index, (tag, gen, fail_rank) in enumerate(SCENARIO):
        HOOKS.milestone("start", index)
        results = ds_save(save_dir, tag, gen, index=index, keep_last=KEEP_LAST,
                          fail_rank=fail_rank)
        errors = [r for r in results if isinstance(r, BaseException)]
        if fail_rank is None and errors:
            raise errors[0]
        if fail_rank is not None and len(errors) != len(results):
            raise AssertionError(f"save {index} should have failed on every rank: {results}")
        HOOKS.milestone("done", index)


def run_child(save_dir: Path, log_path: Path, target: tuple[str, str, int] | None) -> int:
    """Fork; the child runs the scenario under the injector. The child's exit code."""
    gc.freeze()  # so the child's collector does not touch (and copy) every page of pytest's heap
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        gc.disable()
        code = 1
        try:
            global HOOKS
            HOOKS = CrashInjector(log_path, str(save_dir.parent) + os.sep, target)
            install_injector(HOOKS)
            run_scenario(save_dir)
            code = 0
        except BaseException:
            with open(log_path.with_suffix(".err"), "w") as f:
                traceback.print_exc(file=f)
        finally:
            os._exit(code)
    gc.unfreeze()
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the crash child for {target} hung")
        time.sleep(0.002)


def read_log(log_path: Path) -> tuple[list[tuple[str, str, int]], dict[str, list[int]], list]:
    events, milestones, violations = [], collections.defaultdict(list), []
    for line in log_path.read_text().splitlines():
        item = json.loads(line)
        if item[0] == "event":
            events.append((item[1], item[2], item[3]))
        elif item[0] == "milestone":
            milestones[item[1]].append(item[2])
        else:
            violations.append(item[1])
    return events, milestones, violations


def index_of(tag: str, gen: int) -> int:
    return next(i for i, (t, g, fail) in enumerate(SCENARIO) if (t, g) == (tag, gen))


def check_after_crash(save_dir: Path, milestones: dict[str, list[int]], where: str) -> str:
    """The invariants after a kill; returns the tag a restarted job loads (or 'none')."""
    for tag in discovery.find_complete_checkpoints(save_dir):  # complete means whole, always
        check_whole(save_dir, tag, allow_pending=True)
    last_latest = max(milestones.get("latest", [-1]))
    started = max(milestones.get("start", [0]))
    try:
        tag = discovery.resolve_load_tag(save_dir, fallback_to_complete=True)
    except IncompleteCheckpointError:
        assert not milestones.get("committed"), f"{where}: a committed checkpoint was lost"
        assert discovery.find_complete_checkpoints(save_dir) == [], where
        return "none"
    gen = check_whole(save_dir, tag)  # renames done: readable at the final names
    loaded = index_of(tag, gen)
    assert loaded <= started, f"{where}: loaded save {loaded}, only {started} started"
    assert loaded >= last_latest, (
        f"{where}: loaded save {loaded} ({tag}), older than save {last_latest} whose latest was "
        "written"
    )
    return f"{tag}@{gen}"


def check_recovery(save_dir: Path, where: str) -> None:
    """A restarted job saves, loads its save, and retention leaves only whole checkpoints."""
    complete_before = len(discovery.find_complete_checkpoints(save_dir))
    results = ds_save(save_dir, "global_step9", 1, keep_last=KEEP_LAST, durable=False)
    assert all(isinstance(r, cm.CommitResult) for r in results), (where, results)
    assert discovery.resolve_load_tag(save_dir) == "global_step9", where
    report = retention.apply_retention(save_dir, KEEP_LAST)
    assert report.left_alone == (), (where, report)
    for entry in sorted(save_dir.iterdir()):
        if entry.name == discovery.LATEST_NAME:
            continue
        check_whole(save_dir, entry.name)
        debris = [p for p in entry.rglob("*") if mf.RESERVED_MARK in p.name]
        assert debris == [], (where, debris)
    assert len(discovery.find_complete_checkpoints(save_dir)) == min(KEEP_LAST, complete_before + 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the crash suite forks")
def test_crash_at_every_file_system_operation(tmp_path: Path) -> None:
    count_dir = tmp_path / "count"
    count_dir.mkdir()
    log = count_dir / "log.jsonl"
    code = run_child(count_dir / "ckpt", log, None)
    assert code == 0, (log.with_suffix(".err").read_text() if code else "")
    events, milestones, violations = read_log(log)
    assert violations == []  # durability audit of the uncrashed run
    assert milestones["done"] == list(range(len(SCENARIO)))
    assert discovery.resolve_load_tag(count_dir / "ckpt") == "global_step3"
    assert discovery.find_complete_checkpoints(count_dir / "ckpt") == ["global_step3", "global_step2"]

    outcomes: dict[str, int] = collections.Counter()
    kinds, unreached = set(), []
    for n, (label, name, occurrence) in enumerate(events):
        where = f"kill #{n}: {label}, {name} (#{occurrence})"
        for attempt in range(KILL_ATTEMPTS):
            case = tmp_path / f"k{n}-{attempt}"
            case.mkdir()
            code = run_child(case / "ckpt", case / "log.jsonl", (label, name, occurrence))
            err = case / "log.err"
            assert code in (0, CRASH_EXIT), (where, code, err.exists() and err.read_text())
            if code == CRASH_EXIT:
                break
            shutil.rmtree(case)  # a race went the other way this time: run it again
        else:
            unreached.append(where)
            continue
        _, milestones, _ = read_log(case / "log.jsonl")
        outcomes[check_after_crash(case / "ckpt", milestones, where)] += 1
        check_recovery(case / "ckpt", where)
        kinds.add(name.split(" ")[0])
    # Enough distinct points, spread over the whole sequence.
    assert len(events) - len(unreached) >= 50, (len(events), unreached)
    assert len(unreached) <= 10, unreached
    # every rename, of a file or a folder, is the storage's `rename`: os.replace
    assert {"write", "fsync", "replace", "unlink", "rmdir", "mkdir",
            "ds-latest:truncate", "ds-latest:write"} <= kinds, kinds
    assert set(outcomes) == {"none", "global_step1@1", "global_step2@1", "global_step2@2",
                             "global_step3@2"}, outcomes
    logging.getLogger(__name__).info(
        "crash suite: %d kill points (%d not reached), outcomes %s",
        len(events) - len(unreached), len(unreached), dict(outcomes),
    )


#: Storage operations that change what is stored: the crash points of the storage-level suite.
WRITING_OPS = {"open_sink", "append", "finish", "publish", "rename", "delete", "delete_prefix",
               "ensure_prefix", "sync_prefix"}


class _Milestones:
    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = collections.defaultdict(list)

    def point(self, name: str, torn: Callable[[], Any] | None = None) -> None:
        pass

    def milestone(self, name: str, index: int) -> None:
        self.seen[name].append(index)

    def enter_rank(self, rank: int) -> None:
        pass


def run_scenario_faulted(save_dir: Path, plan: FaultPlan, hooks: _Milestones) -> None:
    """`run_scenario` on one fake rank, every storage of the process wrapped by `plan`,
    milestones into `hooks`; raises `SimulatedCrash` where the plan crashes it."""
    global HOOKS
    previous_hooks, HOOKS = HOOKS, hooks
    previous = wrap_storages(plan.wrap)
    try:
        for index, (tag, gen, fail_rank) in enumerate(SCENARIO):
            HOOKS.milestone("start", index)
            results = ds_save(save_dir, tag, gen, index=index, world_size=1, keep_last=KEEP_LAST,
                              fail_rank=None if fail_rank is None else 0, durable=False)
            crashed = [r for r in results if isinstance(r, SimulatedCrash)]
            if crashed:
                raise crashed[0]
            HOOKS.milestone("done", index)
    finally:
        wrap_storages(previous)
        HOOKS = previous_hooks


def test_crash_at_every_storage_operation(tmp_path: Path) -> None:
    """The crash suite's scenario on one rank, crashed through `FaultPlan` (no process-wide
    patching) at each storage operation that changes what is stored, before and after it
    takes effect: every crash leaves a loadable checkpoint no older than the last `latest`
    written (or none before the first commit), and a restarted job saves, loads and cleans up."""
    counting, hooks = FaultPlan(), _Milestones()
    run_scenario_faulted(tmp_path / "count", counting, hooks)
    assert hooks.seen["done"] == list(range(len(SCENARIO)))
    points, seen = [], collections.Counter()
    for op, key in counting.calls:
        if op in WRITING_OPS:
            key = _TOKEN_RE.sub(r"\g<1>*", key)  # a re-save's staged names differ from run to run
            seen[(op, key)] += 1
            points.append((op, key, seen[(op, key)]))
    assert {op for op, _, _ in points} >= {"append", "finish", "publish", "rename", "delete_prefix"}
    outcomes: collections.Counter[str] = collections.Counter()
    for n, (op, key, nth) in enumerate(points):
        # After an append (or a sink's opening) is just before the next: crashed before only.
        for after in (False,) if op in ("append", "open_sink") else (False, True):
            where = f"crash #{n} {'after' if after else 'at'} {op} {key!r} (#{nth})"
            case = tmp_path / f"c{n}{'a' if after else 'b'}"
            plan, hooks = FaultPlan(Fault(op, nth=nth, key=key, crash=True, after=after)), _Milestones()
            with pytest.raises(SimulatedCrash):
                run_scenario_faulted(case / "ckpt", plan, hooks)
            outcomes[check_after_crash(case / "ckpt", hooks.seen, where)] += 1
            check_recovery(case / "ckpt", where)
    assert {"none", "global_step1@1", "global_step2@2", "global_step3@2"} <= set(outcomes), outcomes
