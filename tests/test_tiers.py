"""The node-local tier without a framework: replica placement, the choice of source per file,
the local manifest and inventory, retention per tier, transfers, the drain.

Fake ranks are threads of this process: they agree through `StoreCollective` over a
`MemoryStore` and send file bytes through `QueueChannel`; two simulated nodes of two ranks each
keep their local tiers in ``tmp/node0`` and ``tmp/node1``.
"""

from __future__ import annotations

import collections
import contextvars
import errno
import functools
import itertools
import logging
import queue
import random
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import join_ranks

from nvcomp_ckpt_engine import collectives, discovery, manifest_files
from nvcomp_ckpt_engine.errors import CheckpointError, CommitError, IncompleteCheckpointError
from nvcomp_ckpt_engine.manifest import ShardRecord, build_manifest, read_manifest, write_manifest
from nvcomp_ckpt_engine.storage import faults, locations, wrap_storages
from nvcomp_ckpt_engine.tiers import drain, local, sources, transfer
from nvcomp_ckpt_engine.tiers.placement import NodeLayout
from nvcomp_ckpt_engine.tiers.tiered import LocalTier, LocalTierOptions

WORLD, PER_NODE = 4, 2
TIMEOUT = 10.0


# ------------------------------------------------------------------------------- placement

def test_replicas_go_to_the_same_local_rank_on_the_next_nodes() -> None:
    layout = NodeLayout.of([2] * 8)  # 4 nodes of 2 ranks
    assert [layout.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.replica_ranks(1, 1) == [3]
    assert layout.replica_ranks(7, 2) == [1, 3]  # node 3 -> nodes 0 and 1, local rank 1
    assert layout.holders(4, 3) == [2, 3, 0, 1]
    for rank in range(8):
        for replicas in (1, 2, 3):
            assert layout.node_of(rank) not in [layout.node_of(r) for r in layout.replica_ranks(rank, replicas)]


def test_replicas_are_capped_at_the_other_nodes() -> None:
    """A job relaunched on fewer nodes keeps its config: a copy on every other node there is."""
    layout = NodeLayout.of([2] * 8)  # 4 nodes of 2 ranks
    assert layout.replica_nodes(0, 2) == [1, 2]
    assert layout.replica_nodes(1, 5) == [2, 3, 0]
    assert layout.replica_nodes(1, 0) == []
    two = NodeLayout.of([2] * 4)
    assert two.replica_ranks(1, 1) == [3] and two.replica_ranks(1, 3) == [3]
    assert two.holders(3, 2) == [1, 0]
    one = NodeLayout.of([2, 2])
    assert one.replica_ranks(0, 1) == [] and one.holders(1, 2) == [0]


def test_nodes_of_unequal_size_are_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 has 1"):
        NodeLayout.of([2, 2, 1])


# ---------------------------------------------------------------------------- source choice

def _manifest(tag: str, step: int, paths: dict[str, int]) -> Any:
    records = [ShardRecord(path=p, rank=r, raw_bytes=10, file_bytes=10, crc32=r, codecs=("none",))
               for p, r in paths.items()]
    return build_manifest(tag=tag, world_size=WORLD, files=records, layout={}, step=step,
                          created_unix_ns=step)


FILES = {f"r{r}.pt": r for r in range(WORLD)}


def _copy(manifest: Any, intact: set[str], damaged: dict[str, str] | None = None) -> local.NodeCopy:
    return local.NodeCopy(tag=manifest.tag, manifest=manifest, intact=frozenset(intact),
                          damaged=damaged or {})


def test_every_node_gets_every_file_from_the_nearest_holder() -> None:
    m = _manifest("s2", 2, FILES)
    node0 = {"s2": _copy(m, set(FILES))}
    plan, passed = sources.choose([node0, {}], {}, tag=None)
    assert passed == {} and plan.tag == "s2"
    assert {(f.path, f.node, f.source) for f in plan.fetches} == {(p, 1, 0) for p in FILES}
    assert plan.persistent_bytes() == 0


def test_a_file_no_node_holds_comes_from_the_persistent_tier() -> None:
    m = _manifest("s2", 2, FILES)
    some = set(FILES) - {"r3.pt"}
    plan, _ = sources.choose([{"s2": _copy(m, some)}, {"s2": _copy(m, some)}], {"s2": m})
    assert [(f.path, f.node, f.source) for f in plan.fetches] == [
        ("r3.pt", 0, sources.PERSISTENT), ("r3.pt", 1, sources.PERSISTENT)]
    assert plan.persistent_bytes() == 20


def test_a_tag_lost_in_every_tier_is_passed_over_naming_what_was_lost() -> None:
    old, new = _manifest("s1", 1, FILES), _manifest("s2", 2, FILES)
    some = set(FILES) - {"r2.pt"}
    node = {"s1": _copy(old, set(FILES)), "s2": _copy(new, some)}
    plan, passed = sources.choose([node, dict(node)], {})
    assert plan.tag == "s1"
    assert "r2.pt (rank 2)" in passed["s2"] and "1 of its 4 files" in passed["s2"]
    plan, passed = sources.choose([node, dict(node)], {}, tag="s2")
    assert plan is None and "s2" in passed


def test_a_copy_of_another_save_of_the_tag_does_not_count() -> None:
    first = _manifest("s2", 2, FILES)
    second = _manifest("s2", 3, {**FILES, "r4.pt": 3})  # a re-save, with other files
    plan, _ = sources.choose([{"s2": _copy(second, {*FILES, "r4.pt"})}, {"s2": _copy(first, set(FILES))}], {})
    assert plan.manifest == second and {f.node for f in plan.fetches} == {1}


# ----------------------------------------------------------------------- fake ranks and nodes

class QueueChannel:
    """Point-to-point messages between threads, one queue per (sender, receiver)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    def _queue(self, sender: int, receiver: int) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((sender, receiver), queue.Queue())

    def of(self, rank: int) -> Any:
        channel = self

        class _Rank:
            def send(self, buffer: memoryview, to: int, timeout_s: float) -> None:
                channel._queue(rank, to).put(bytes(buffer))

            def recv(self, buffer: memoryview, source: int, timeout_s: float) -> None:
                try:
                    data = channel._queue(source, rank).get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"receiving from rank {source}: nothing in {timeout_s} s") from None
                assert len(data) == len(buffer)
                buffer[:] = data

        return _Rank()


def run_ranks(fn: Callable[[int, LocalTier], Any], root: Path, *, replicas: int = 1,
              persist_every: int = 1, keep_last: int = 2, timeout: float = TIMEOUT,
              world: int = WORLD) -> list[Any]:
    """fn(rank, tier) on `world` threads (nodes of 2 ranks); each result or exception, by rank."""
    store, channel = collectives.MemoryStore(timeout_s=timeout), QueueChannel()
    results: list[Any] = [None] * world
    options = LocalTierOptions(path=str(root / "node{node}"), replicas=replicas,
                               keep_last=keep_last, persist_every=persist_every)

    def body(rank: int) -> None:
        collective = collectives.StoreCollective(store, rank=rank, world_size=world, timeout_s=timeout)
        tier = LocalTier(options, collective, local_world_size=PER_NODE, channel=channel.of(rank),
                         timeout_s=timeout, chunk_bytes=1000)
        try:
            results[rank] = fn(rank, tier)
        except BaseException as exc:
            results[rank] = exc
        finally:
            tier.close()

    join_ranks(body, world, timeout)
    return results


@functools.cache
def data_of(rank: int, step: int) -> bytes:
    """The bytes of rank `rank`'s shard at `step`: a real shard, so `verify` can read it."""
    import torch

    from nvcomp_ckpt_engine import api

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "shard.pt"
        api.save({"w": torch.arange(600 + 25 * rank, dtype=torch.float32) * step}, path,
                 algorithm="zstd")
        return path.read_bytes()


def save(tier: LocalTier, rank: int, save_dir: Path | str, step: int, *, drain_now: bool = True) -> Any:
    """One save as the engine does it: the rank's file into the local tier, replicas and the
    local commit, the drain started, and (`drain_now`) committed."""
    tag = f"global_step{step}"
    plan = tier.prepare(tag)
    name = f"rank{rank}.pt"
    data = data_of(rank, step)
    with locations.open_sink(plan.tag_dir / (name + (plan.staging_suffix or ""))) as sink:
        sink.append(data)
        sink.finish()
    record = ShardRecord(path=name, rank=rank, raw_bytes=len(data), file_bytes=len(data),
                         crc32=zlib.crc32(data), codecs=("none",))
    result = tier.commit(tag, plan, [record], error=None, layout={}, step=step, versions={})
    tier.after_commit(result, str(save_dir))
    if drain_now:
        tier.finish_drain()
    return result


def ok(results: list[Any]) -> list[Any]:
    for rank, result in enumerate(results):
        if isinstance(result, BaseException):
            raise AssertionError(f"rank {rank} failed: {result!r}") from result
    return results


def saved(tmp_path: Path, *steps: int, persist_every: int = 1) -> Path:
    save_dir = tmp_path / "persistent"
    for step in steps:
        ok(run_ranks(lambda rank, tier: save(tier, rank, save_dir, step), tmp_path,
                     persist_every=persist_every))
    return save_dir


def test_a_save_holds_every_file_and_its_replica_committed_on_every_node(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1)
    for node in (0, 1):
        tag_dir = tmp_path / f"node{node}" / "global_step1"
        found = read_manifest(tag_dir)
        assert sorted(r.path for r in found.files) == [f"rank{r}.pt" for r in range(WORLD)]
        for rank in range(WORLD):  # 2 nodes, 1 replica: each node holds all
            assert (tag_dir / f"rank{rank}.pt").read_bytes() == data_of(rank, 1)
        assert sorted(local.read_local_manifest(tag_dir).held) == [f"rank{r}.pt" for r in range(WORLD)]
    assert discovery.find_complete_checkpoints(save_dir) == ["global_step1"]
    assert discovery.read_latest(save_dir) is None  # `latest` is the engine's to move


def test_replicas_sent_in_the_background_are_committed_by_the_local_commit(tmp_path: Path) -> None:
    store, channel = collectives.MemoryStore(timeout_s=TIMEOUT), QueueChannel()

    def body(rank: int, tier: LocalTier) -> Any:
        plan = tier.prepare("global_step5")
        data = data_of(rank, 5)
        with locations.open_sink(plan.tag_dir / f"rank{rank}.pt") as sink:
            sink.append(data)
            sink.finish()
        record = ShardRecord(path=f"rank{rank}.pt", rank=rank, raw_bytes=len(data),
                             file_bytes=len(data), crc32=zlib.crc32(data), codecs=("none",))
        background = collectives.StoreCollective(store, rank=rank, world_size=WORLD, prefix="bg",
                                                 timeout_s=TIMEOUT)
        future = tier.replicate_in_background("global_step5", plan, lambda: ([record], None),
                                              background, channel.of(rank))
        replicated = future.result()
        assert replicated.error is None and len(replicated.received) == 1
        return tier.commit("global_step5", plan, [record], error=None, layout={}, step=5,
                           versions={}, replicated=replicated)

    ok(run_ranks(body, tmp_path))
    for node in (0, 1):
        tag_dir = tmp_path / f"node{node}" / "global_step5"
        assert read_manifest(tag_dir).tag == "global_step5"
        assert all((tag_dir / f"rank{r}.pt").read_bytes() == data_of(r, 5) for r in range(WORLD))


def _forbid_persistent_reads(save_dir: Path) -> faults.FaultPlan:
    plan = faults.FaultPlan(faults.Fault(op="read_into", key="*.pt", nth=1,
                                         error=OSError("read from the persistent tier")))
    wrap_storages(lambda s: plan.wrap(s) if s.describe().startswith(str(save_dir)) else s)
    return plan


def test_a_lost_node_resumes_from_the_replicas_reading_nothing_persistent(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1, 2)
    import shutil

    shutil.rmtree(tmp_path / "node1")
    plan = _forbid_persistent_reads(save_dir)
    try:
        results = ok(run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path))
    finally:
        wrap_storages(None)
    assert not any(fault.fired for fault in plan.faults), plan.calls
    assert {(r.tag, r.persistent_bytes) for r in results} == {("global_step2", 0)}
    for rank in range(WORLD):
        assert (tmp_path / "node1" / "global_step2" / f"rank{rank}.pt").read_bytes() == data_of(rank, 2)
    assert read_manifest(tmp_path / "node1" / "global_step2").tag == "global_step2"


def test_a_restore_reads_the_bytes_of_the_chosen_tag_only(tmp_path: Path) -> None:
    """The older tag each node keeps is checked by its sizes; only the chosen one's CRCs are read."""
    save_dir = saved(tmp_path, 1, 2)
    plan = faults.FaultPlan(faults.Fault(op="read_into", key="*", error=OSError("read the older tag")))
    older = [str(tmp_path / f"node{node}" / "global_step1") for node in (0, 1)]
    wrap_storages(lambda s: plan.wrap(s) if s.describe().startswith(tuple(older)) else s)
    try:
        results = ok(run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path))
    finally:
        wrap_storages(None)
    assert {r.tag for r in results} == {"global_step2"}
    assert not any(fault.fired for fault in plan.faults)


def test_a_file_lost_with_its_replica_comes_from_the_persistent_copy(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1)
    for node in (0, 1):
        (tmp_path / f"node{node}" / "global_step1" / "rank3.pt").unlink()
    _forbid_persistent_reads(save_dir)  # the guard the other tests rely on does catch such reads
    try:
        refused = run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path)
    finally:
        wrap_storages(None)
    assert all(isinstance(r, IncompleteCheckpointError) for r in refused), refused
    assert "read from the persistent tier" in str(refused[0])
    for node in (0, 1):  # (the fault fires once: the other node's copy went through)
        (tmp_path / f"node{node}" / "global_step1" / "rank3.pt").unlink(missing_ok=True)
    results = ok(run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path))
    assert results[0].persistent_bytes == len(data_of(3, 1)) * 2
    for node in (0, 1):
        assert (tmp_path / f"node{node}" / "global_step1" / "rank3.pt").read_bytes() == data_of(3, 1)


def test_lost_in_every_tier_falls_back_to_the_newest_complete_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_dir = saved(tmp_path, 1)
    saved(tmp_path, 2, persist_every=2)  # the run's first save: drained, then deleted below
    import shutil

    shutil.rmtree(save_dir / "global_step2")
    for node in (0, 1):
        (tmp_path / f"node{node}" / "global_step2" / "rank2.pt").unlink()
    with caplog.at_level(logging.WARNING):
        results = ok(run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path))
    assert {r.tag for r in results} == {"global_step1"}
    assert "global_step2: 1 of its 4 files are on no node" in caplog.text
    assert "rank2.pt (rank 2)" in caplog.text
    named = run_ranks(lambda rank, tier: tier.restore(str(save_dir), "global_step2"), tmp_path)
    assert all(isinstance(r, IncompleteCheckpointError) and "rank2.pt (rank 2)" in str(r) for r in named)


@pytest.mark.parametrize("node0_kept", [True, False])
def test_a_resume_on_fewer_nodes_restores_every_file(tmp_path: Path, node0_kept: bool) -> None:
    """Saved on 2 nodes, resumed on 1 (2 ranks, no replicas): node 0 holds the whole tag, from
    its own copies or, with its folder gone too, from the persistent copy."""
    save_dir = saved(tmp_path, 1)
    import shutil

    shutil.rmtree(tmp_path / "node1")
    if not node0_kept:
        shutil.rmtree(tmp_path / "node0")
    results = ok(run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path,
                           replicas=0, world=2))
    every = sum(len(data_of(r, 1)) for r in range(WORLD))
    assert {(r.tag, r.persistent_bytes) for r in results} == {("global_step1", 0 if node0_kept else every)}
    assert all((tmp_path / "node0" / "global_step1" / f"rank{r}.pt").read_bytes() == data_of(r, 1)
               for r in range(WORLD))
    assert read_manifest(tmp_path / "node0" / "global_step1").world_size == WORLD


def test_a_damaged_local_copy_is_replaced_from_its_replica(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1)
    victim = tmp_path / "node0" / "global_step1" / "rank0.pt"
    damaged = bytearray(victim.read_bytes())
    damaged[100] ^= 0x40
    victim.write_bytes(bytes(damaged))
    assert local.inventory(tmp_path / "node0")["global_step1"].damaged.keys() == {"rank0.pt"}
    plan = _forbid_persistent_reads(save_dir)
    try:
        ok(run_ranks(lambda rank, tier: tier.restore(str(save_dir), None), tmp_path))
    finally:
        wrap_storages(None)
    assert not any(fault.fired for fault in plan.faults)
    assert victim.read_bytes() == data_of(0, 1)


# ------------------------------------------------------- the restore's CRC check, split by rank

#: The rank a test's thread acts as, for `_count_crc_reads` (the check's threads run in a copy
#: of their rank's context).
READER: contextvars.ContextVar[int | None] = contextvars.ContextVar("reader", default=None)


def _count_crc_reads(monkeypatch: pytest.MonkeyPatch) -> dict[int | None, list[tuple[str, int]]]:
    """Every file whose CRC-32 is read from now on, as (``nodeN/tag/name``, bytes), by the
    rank (`READER`) that read it."""
    reads: dict[int | None, list[tuple[str, int]]] = collections.defaultdict(list)
    lock, measure = threading.Lock(), manifest_files._measure

    def counted(storage: Any, key: str, check_crc: bool, *pool: Any) -> tuple[int, int | None]:
        size, crc = measure(storage, key, check_crc, *pool)
        if check_crc:
            with lock:
                reads[READER.get()].append(("/".join(Path(storage.describe(key)).parts[-3:]), size))
        return size, crc

    monkeypatch.setattr(manifest_files, "_measure", counted)
    return reads


def _restore_as(rank: int, tier: LocalTier, save_dir: Path) -> Any:
    READER.set(rank)
    return tier.restore(str(save_dir), None)


def test_a_damaged_file_checked_by_a_non_leader_rank_is_replaced_from_its_replica(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_dir = saved(tmp_path, 1)
    reads = _count_crc_reads(monkeypatch)
    ok(run_ranks(lambda rank, tier: _restore_as(rank, tier, save_dir), tmp_path))
    assert reads[1], "node 0's second rank checked none of its files"
    name = reads[1][0][0]
    victim = tmp_path / name
    damaged = bytearray(victim.read_bytes())
    damaged[100] ^= 0x40
    victim.write_bytes(bytes(damaged))
    reads.clear()
    plan = _forbid_persistent_reads(save_dir)
    try:
        ok(run_ranks(lambda rank, tier: _restore_as(rank, tier, save_dir), tmp_path))
    finally:
        wrap_storages(None)
    assert not any(fault.fired for fault in plan.faults)
    assert name in [path for path, _ in reads[1]]
    assert victim.read_bytes() == data_of(int(victim.stem.removeprefix("rank")), 1)


def test_each_rank_reads_only_its_share_of_its_nodes_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_dir = saved(tmp_path, 1)
    reads = _count_crc_reads(monkeypatch)
    ok(run_ranks(lambda rank, tier: _restore_as(rank, tier, save_dir), tmp_path))
    assert set(reads) <= set(range(WORLD)), "a CRC read outside the ranks' checks"
    sizes = {r: len(data_of(r, 1)) for r in range(WORLD)}
    for node in (0, 1):
        ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
        held = sorted(f"node{node}/global_step1/rank{r}.pt" for r in range(WORLD))
        assert sorted(path for rank in ranks for path, _ in reads[rank]) == held  # each once
        for rank in ranks:
            read = sum(size for _, size in reads[rank])
            assert 0 < read <= sum(sizes.values()) / PER_NODE + max(sizes.values()), (rank, reads[rank])


def test_every_rank_reaches_the_same_verdict_on_the_local_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_dir = saved(tmp_path, 1)
    victim = tmp_path / "node0" / "global_step1" / "rank1.pt"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    (tmp_path / "node1" / "global_step1" / "rank2.pt").unlink()
    verdicts: dict[int, Any] = {}
    choose = sources.choose

    def recorded(copies: Any, persistent: Any, **kwargs: Any) -> Any:
        verdicts[READER.get()] = [{t: (sorted(c.intact), c.damaged) for t, c in inventory.items()}
                                  for inventory in copies]
        return choose(copies, persistent, **kwargs)

    monkeypatch.setattr(sources, "choose", recorded)
    results = ok(run_ranks(lambda rank, tier: _restore_as(rank, tier, save_dir), tmp_path))
    assert len({(r.tag, r.persistent_bytes, r.peer_bytes) for r in results}) == 1
    assert all(verdicts[rank] == verdicts[0] for rank in range(WORLD))
    node0, node1 = (verdicts[0][node]["global_step1"] for node in (0, 1))
    assert "rank1.pt" not in node0[0] and node0[1]["rank1.pt"].startswith("crc")
    assert "rank2.pt" not in node1[0] and "rank2.pt" not in node1[1]
    assert victim.read_bytes() == data_of(1, 1)
    assert (tmp_path / "node1" / "global_step1" / "rank2.pt").read_bytes() == data_of(2, 1)


def test_a_check_that_fails_on_one_rank_fails_the_restore_on_every_rank_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_dir = saved(tmp_path, 1)
    measure = manifest_files._measure

    def broken(storage: Any, key: str, check_crc: bool, *pool: Any) -> tuple[int, int | None]:
        if check_crc and READER.get() == 3:
            raise RuntimeError("the disk controller went away")
        return measure(storage, key, check_crc, *pool)

    monkeypatch.setattr(manifest_files, "_measure", broken)
    results = run_ranks(lambda rank, tier: _restore_as(rank, tier, save_dir), tmp_path)
    for result in results:
        assert isinstance(result, IncompleteCheckpointError), results
        assert "rank 3: CheckpointError: " in str(result)
        assert "node1/global_step1/rank" in str(result) and "the disk controller went away" in str(result)


def test_the_check_splits_a_copy_by_bytes_and_merges_what_each_share_found(tmp_path: Path) -> None:
    sizes = {"a.pt": 50, "b.pt": 40, "c.pt": 30, "d.pt": 20, "e.pt": 10}
    records = [ShardRecord(path=p, rank=0, raw_bytes=n, file_bytes=n,
                           crc32=zlib.crc32(p.encode()[:1] * n), codecs=("none",)) for p, n in sizes.items()]
    manifest = build_manifest(tag="s1", world_size=1, files=records, layout={}, created_unix_ns=1)
    copy = _copy(manifest, set(sizes) - {"e.pt"}, {"e.pt": "size: ..."})
    shares = local.check_shares(copy, 3)
    assert shares == [("a.pt",), ("b.pt",), ("c.pt", "d.pt")]
    assert local.check_shares(copy, 1) == [("a.pt", "b.pt", "c.pt", "d.pt")]
    tag_dir = tmp_path / "s1"
    tag_dir.mkdir()
    for path, n in sizes.items():
        (tag_dir / path).write_bytes(path.encode()[:1] * n)
    (tag_dir / "c.pt").write_bytes(b"x" * 30)
    (tag_dir / "d.pt").unlink()
    found = [local.check_share(tmp_path, copy, share, threads=4) for share in shares]
    assert found[2].intact == frozenset() and set(found[2].damaged) == {"c.pt"}
    merged = local.merge_checks(copy, [local.CheckedShare.from_json(f.to_json()) for f in found])
    assert merged.intact == {"a.pt", "b.pt"} and set(merged.damaged) == {"c.pt", "e.pt"}


def test_a_ranks_spare_check_threads_read_segments_of_its_large_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A share of one large file and a small one on 3 threads: the large file is read in
    segments, two at once at least (a file a thread would never meet its own barrier), every
    range on the share's pool of segments; a byte damaged in a middle segment is found."""
    block, segment = 4096, 4 * 4096
    monkeypatch.setattr(manifest_files, "_CRC_BLOCK", block)
    monkeypatch.setattr(manifest_files, "_CRC_SEGMENT", segment)
    both_waiting, calls, ranges = threading.Barrier(2, timeout=10), itertools.count(), []
    crc_of_range = manifest_files._crc_of_range

    def concurrent(reader: Any, start: int, length: int, buffer: memoryview) -> int:
        if length == segment and next(calls) < 2:
            both_waiting.wait()
        ranges.append((threading.current_thread().name, start, length))
        return crc_of_range(reader, start, length, buffer)

    monkeypatch.setattr(manifest_files, "_crc_of_range", concurrent)
    data = {"big.pt": random.Random(1).randbytes(3 * segment + 5), "small.pt": b"small"}
    records = [ShardRecord(path=p, rank=0, raw_bytes=len(b), file_bytes=len(b), crc32=zlib.crc32(b),
                           codecs=("none",)) for p, b in data.items()]
    manifest = build_manifest(tag="s1", world_size=1, files=records, layout={}, created_unix_ns=1)
    copy = _copy(manifest, set(data))
    (tmp_path / "s1").mkdir()
    for path, content in data.items():
        (tmp_path / "s1" / path).write_bytes(content)
    found = local.check_share(tmp_path, copy, ["big.pt", "small.pt"], threads=3)
    assert found.intact == {"big.pt", "small.pt"} and found.damaged == {}
    assert sorted((start, length) for _, start, length in ranges) == [
        (0, 5), (0, segment), (segment, segment), (2 * segment, segment), (3 * segment, 5)]
    assert all(name.startswith("nvckpt-crc-segment_") for name, _, _ in ranges), ranges
    damaged = bytearray(data["big.pt"])
    damaged[segment + 123] ^= 0x80
    (tmp_path / "s1" / "big.pt").write_bytes(bytes(damaged))
    found = local.check_share(tmp_path, copy, ["big.pt", "small.pt"], threads=3)
    assert found.intact == {"small.pt"} and list(found.damaged) == ["big.pt"]
    assert found.damaged["big.pt"].startswith(f"crc: {tmp_path / 's1' / 'big.pt'}: crc32 0x")


def test_no_checkpoint_of_ours_in_any_tier_is_left_to_the_callers_resolution(tmp_path: Path) -> None:
    """None: the engine then resolves in save_dir as without the tier (a plain DeepSpeed
    checkpoint there is loaded, not skipped for a fresh start)."""
    plain = tmp_path / "plain" / "global_step7"
    plain.mkdir(parents=True)
    (plain / "mp_rank_00_model_states.pt").write_bytes(b"a torch file")
    for tag in (None, "global_step7"):
        assert ok(run_ranks(lambda rank, tier: tier.restore(str(tmp_path / "plain"), tag),
                            tmp_path)) == [None] * WORLD


# ----------------------------------------------------------------------------- failures

def test_a_full_local_disk_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    plan = faults.FaultPlan(faults.Fault(op="append", key="*rank0.pt", error=full))
    wrap_storages(lambda s: plan.wrap(s) if s.describe().startswith(str(tmp_path / "node1")) else s)
    try:
        results = run_ranks(lambda rank, tier: save(tier, rank, tmp_path / "persistent", 1), tmp_path)
    finally:
        wrap_storages(None)
    assert all(isinstance(r, CommitError) for r in results), results
    assert all("No space left on device" in str(r) and "rank0.pt" in str(r) for r in results)
    for node in (0, 1):
        assert not (tmp_path / f"node{node}" / "global_step1" / "nvcomp_manifest.json").exists()
    assert not (tmp_path / "persistent" / "global_step1").exists()


def test_a_peer_that_never_sends_is_an_error_naming_it_not_a_hang(tmp_path: Path) -> None:
    channel = QueueChannel()
    one = transfer.Transfer(path="a.pt", size=10, crc32=0, sender=1, receiver=0)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="a.pt from rank 1 to rank 0: receiving from rank 1"):
        transfer.run_transfers([one], rank=0, channel=channel.of(0), source=lambda p: tmp_path / p,
                               target=lambda p: tmp_path / p, timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_a_copy_that_arrives_damaged_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    (tmp_path / "src" / "a.pt").write_bytes(b"x" * 2500)
    channel = QueueChannel()
    wrong = transfer.Transfer(path="a.pt", size=2500, crc32=zlib.crc32(b"y" * 2500), sender=1, receiver=0)
    kwargs = dict(channel=None, source=lambda p: tmp_path / "src" / p,
                  target=lambda p: tmp_path / "dst" / p, timeout_s=5, chunk_bytes=1000)
    sender = threading.Thread(target=lambda: transfer.run_transfers(
        [wrong], rank=1, **{**kwargs, "channel": channel.of(1)}))
    sender.start()
    report = transfer.run_transfers([wrong], rank=0, **{**kwargs, "channel": channel.of(0)})
    sender.join()
    assert "arrived with CRC-32" in report.errors["a.pt"]
    assert not (tmp_path / "dst" / "a.pt").exists()


def test_a_drain_that_fails_midway_leaves_no_complete_persistent_checkpoint(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1)
    plan = faults.FaultPlan(faults.Fault(op="append", key="*rank3.pt",
                                         error=OSError(errno.EIO, "Input/output error")))
    wrap_storages(lambda s: plan.wrap(s) if s.describe().startswith(str(save_dir)) else s)
    try:
        results = run_ranks(lambda rank, tier: save(tier, rank, save_dir, 2), tmp_path)
    finally:
        wrap_storages(None)
    assert all(isinstance(r, CommitError) and "rank 3" in str(r) for r in results), results
    assert discovery.find_complete_checkpoints(save_dir) == ["global_step1"]
    for node in (0, 1):  # the local copy is committed all the same
        assert read_manifest(tmp_path / f"node{node}" / "global_step2").tag == "global_step2"


def test_a_drain_killed_mid_copy_leaves_an_incomplete_tag_and_latest_unmoved(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1)
    discovery.write_latest(save_dir, "global_step1")
    plan = faults.FaultPlan(faults.Fault(op="append", key="*.pt", nth=2, crash=True, tear=True))
    wrap_storages(lambda s: plan.wrap(s) if s.describe().startswith(str(save_dir)) else s)
    try:  # the crash kills the "process": every later storage call under save_dir dies too
        results = run_ranks(lambda rank, tier: save(tier, rank, save_dir, 2), tmp_path, timeout=3)
    finally:
        wrap_storages(None)
    assert all(isinstance(r, (faults.SimulatedCrash, CommitError)) for r in results), results
    assert discovery.find_complete_checkpoints(save_dir) == ["global_step1"]
    assert discovery.read_latest(save_dir) == "global_step1"
    for node in (0, 1):
        assert read_manifest(tmp_path / f"node{node}" / "global_step2").tag == "global_step2"


def test_a_drain_killed_before_its_commit_leaves_an_incomplete_tag(tmp_path: Path) -> None:
    save_dir = saved(tmp_path, 1, persist_every=1)
    ok(run_ranks(lambda rank, tier: save(tier, rank, save_dir, 2, drain_now=False), tmp_path))
    # The copies finished (the pool was shut down) but no rank committed: a killed job.
    state = discovery.tag_state("global_step2", save_dir / "global_step2", local_only=False,
                                check_crc=False)
    assert not state.complete
    assert discovery.find_complete_checkpoints(save_dir) == ["global_step1"]



def test_a_save_folder_on_an_object_store_is_drained_committed_and_restored_from(
        tmp_path: Path, s3_server: Any, s3_storage: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save_dir`` an ``s3://`` URL (the S3 API server of conftest): the drain copies and
    commits through the storage layer, ``latest`` moves only after that commit (as the engine's
    `_finish_drain` does), and a resume with every local folder gone restores from the store."""
    import shutil

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)  # how `open_storage` finds the server
    save_url = s3_storage.url

    def drained(rank: int, tier: LocalTier, step: int) -> Any:
        save(tier, rank, save_url, step, drain_now=False)
        if rank == 0:  # the persistent copy is not committed yet: the store's state now
            pending[step] = (discovery.find_complete_checkpoints(save_url),
                             discovery.read_latest(save_url))
        tier.collective.barrier(step="looked", timeout_s=TIMEOUT)
        done = tier.finish_drain()
        if rank == 0 and done is not None and done[2]:
            discovery.write_latest(save_url, done[0].tag)
        return done

    pending: dict[int, Any] = {}
    for step in (1, 2):
        results = ok(run_ranks(lambda rank, tier: drained(rank, tier, step), tmp_path))
        assert {(r[0].tag, r[1]) for r in results} == {(f"global_step{step}", save_url)}
    assert pending == {1: ([], None), 2: (["global_step1"], "global_step1")}
    assert discovery.find_complete_checkpoints(save_url) == ["global_step2", "global_step1"]
    assert discovery.read_latest(save_url) == "global_step2"

    for node in (0, 1):
        shutil.rmtree(tmp_path / f"node{node}")
    results = ok(run_ranks(lambda rank, tier: tier.restore(save_url, None), tmp_path))
    every = sum(len(data_of(r, 2)) for r in range(WORLD))
    assert {(r.tag, r.persistent_bytes) for r in results} == {("global_step2", 2 * every)}
    for node in (0, 1):
        tag_dir = tmp_path / f"node{node}" / "global_step2"
        assert all((tag_dir / f"rank{r}.pt").read_bytes() == data_of(r, 2) for r in range(WORLD))
        assert read_manifest(tag_dir).tag == "global_step2"

def test_drain_copies_only_the_ranks_own_files(tmp_path: Path) -> None:
    saved(tmp_path, 1, persist_every=5)
    found = read_manifest(tmp_path / "node1" / "global_step1")
    plan = drain.copy_to_persistent(tmp_path / "node1" / "global_step1", str(tmp_path / "p"),
                                    "global_step1", 2, [r for r in found.files if r.rank == 2])
    assert sorted(p.name for p in plan.tag_dir.iterdir() if p.suffix == ".pt") == ["rank2.pt"]


# ------------------------------------------------------------------- local manifest, retention

def test_the_local_manifest_round_trips_and_refuses_damage(tmp_path: Path) -> None:
    record = local.LocalManifest(tag="s1", node=1, held=("a.pt", "b/c.pt"))
    local.write_local_manifest(tmp_path, record)
    assert local.read_local_manifest(tmp_path) == record
    (tmp_path / local.LOCAL_MANIFEST_NAME).write_text('{"format": "nvcomp_ckpt_engine.local", '
                                                       '"version": 1, "tag": "s1", "node": -1, "held": []}')
    with pytest.raises(CheckpointError, match="node must be an index"):
        local.read_local_manifest(tmp_path)


def test_local_retention_keeps_the_newest_and_the_protected(tmp_path: Path) -> None:
    saved(tmp_path, 1, 2, 3, 4, persist_every=10)  # keep_last=2 on each node
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["global_step3", "global_step4"]
    debris = tmp_path / "node0" / "global_step9"
    debris.mkdir()
    (debris / ".nvcomp_ckpt_engine_tag").write_text("{}")
    (tmp_path / "node0" / "global_step0").mkdir()
    write_manifest(tmp_path / "node0" / "global_step0", _manifest("global_step0", 0, FILES))
    deleted = local.apply_local_retention(tmp_path / "node0", 1, protect={"global_step3"})
    assert sorted(deleted) == ["global_step0", "global_step9"]
    assert sorted(p.name for p in (tmp_path / "node0").iterdir()) == ["global_step3", "global_step4"]


def test_inspect_and_verify_show_each_nodes_copy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from nvcomp_ckpt_engine.cli import main as nvcomp_ckpt_cli

    save_dir = saved(tmp_path, 1)
    tier = str(tmp_path / "node{node}")
    args = [str(save_dir), "--tag", "global_step1", "--local-tier", tier]
    assert nvcomp_ckpt_cli(["verify", "-q", *args]) == 0
    assert "node 1 (" in capsys.readouterr().out
    victim = tmp_path / "node0" / "global_step1" / "rank1.pt"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    (tmp_path / "node1" / "global_step1" / "rank2.pt").unlink()
    assert nvcomp_ckpt_cli(["verify", "-q", *args]) == 1
    out = capsys.readouterr().out
    assert "node0/global_step1 (node 0): rank1.pt: damaged: crc" in out
    assert "node1/global_step1 (node 1): rank2.pt: missing" in out
    assert nvcomp_ckpt_cli(["inspect", "--files-only", *args]) == 1
    out = capsys.readouterr().out
    assert "node 0" in out and "3 of 4 files intact" in out and "rank2.pt missing" in out
