"""The node-local tier around DCP saves and loads (`dcp.tiered.DcpLocalTier`): in one process
(one rank, one node, no replicas), and two ranks as two simulated nodes replicating each other;
`dcp.save` and `dcp.async_save` alike."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from test_dcp import (
    CHUNK_MB, _snapshot, assert_same_state, blank_like, distributed_state, full_blank,
    reference_state, run_ranks,
)
from nvcomp_ckpt_engine import dcp as ndcp
from nvcomp_ckpt_engine import manifest
from nvcomp_ckpt_engine.errors import CommitError
from nvcomp_ckpt_engine.dcp.tiered import DcpLocalTier
from nvcomp_ckpt_engine.storage import faults, locations, wrap_storages
from nvcomp_ckpt_engine.tiers import local


def _tier(tmp_path, **keys) -> DcpLocalTier:
    return DcpLocalTier({"path": str(tmp_path / "local" / "{node}"), "replicas": 0, **keys},
                        local_world_size=1, timeout_s=30.0)


def test_a_save_lands_locally_drains_and_loads_from_either_tier(tmp_path, monkeypatch):
    ref = reference_state()
    persistent = tmp_path / "ckpt" / "step_1"
    tier = _tier(tmp_path)
    result = tier.save(ref, persistent, algorithm="zstd")
    local_copy = tmp_path / "local" / "0" / "step_1"
    assert {r.path for r in result.manifest.files} == {".metadata", "__0_0.nvcomp.distcp"}
    assert manifest.read_manifest(local_copy).tag == "step_1"
    tier.close()  # the drain's commit: the persistent copy's manifest
    drained = manifest.read_manifest(persistent)
    assert drained.layout["framework"] == "dcp"
    ndcp.verify_dcp(persistent)  # a DCP checkpoint as any other
    for record in drained.files:
        assert (persistent / record.path).read_bytes() == (local_copy / record.path).read_bytes()

    # With the local copy there, the load reads nothing from the persistent tier.
    read_from: list[str] = []
    real_copy = locations.copy

    def spy(src, dst, *args, **kwargs):
        read_from.append(str(src))
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(locations, "copy", spy)
    (persistent / "__0_0.nvcomp.distcp").rename(tmp_path / "moved")
    loaded = full_blank(ref)
    restored = _tier(tmp_path).load(loaded, persistent)
    assert restored is not None and restored.persistent_bytes == 0 and read_from == []
    assert_same_state(loaded, ref)

    # Without it, the persistent copy restores it.
    (tmp_path / "moved").rename(persistent / "__0_0.nvcomp.distcp")
    shutil.rmtree(tmp_path / "local")
    loaded = full_blank(ref)
    restored = _tier(tmp_path).load(loaded, persistent)
    assert restored is not None and restored.persistent_bytes == drained.file_bytes
    assert sorted(read_from) == sorted(str(persistent / r.path) for r in drained.files)
    assert_same_state(loaded, ref)


def test_a_bad_key_is_named(tmp_path):
    with pytest.raises(ValueError, match="local_tier.replicas"):
        _tier(tmp_path, replicas=-1)


def two_nodes_worker(rank: int, world: int, tmp: str) -> None:
    """Each rank a node of its own (LOCAL_WORLD_SIZE 1), each file replicated on the other, one
    save with `dcp.save` and one with `dcp.async_save`: node 1's folder lost and the persistent
    rank files moved away, the load restores node 1 from node 0's copies and replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    base = Path(tmp)
    tier = _tier(base, replicas=1)
    state = distributed_state(init_device_mesh("cpu", (world,)), reference_state())
    tier.save(state, base / "ckpt" / "step_1", chunk_mb=CHUNK_MB)
    # step_2 through dcp.async_save: staged before it returns, so the change after it is not
    # saved; committed (replicas included) in the background, while this thread runs
    # collectives on the default group.
    expected = _snapshot(state)
    future = tier.async_save(state, base / "ckpt" / "step_2", chunk_mb=CHUNK_MB)
    state["model"]["w"].to_local().add_(1.0)
    dist.barrier()
    assert future.result().manifest.world_size == 2
    tier.close()
    dist.barrier()
    for step in ("step_1", "step_2"):
        persistent = base / "ckpt" / step
        if rank == 0:
            assert manifest.read_manifest(persistent).world_size == 2
            for name in ("__0_0.nvcomp.distcp", "__1_0.nvcomp.distcp"):
                (persistent / name).rename(base / f"{step}{name}")
        elif step == "step_1":
            shutil.rmtree(base / "local" / "1")
        dist.barrier()
        loaded = blank_like(state)
        restored = _tier(base, replicas=1).load(loaded, persistent)
        assert restored is not None and restored.persistent_bytes == 0 and restored.peer_bytes > 0
        assert_same_state(loaded, expected, f"{step} rank {rank}")


@pytest.mark.slow
def test_two_nodes_resume_from_the_replicas_without_the_persistent_files(tmp_path):
    run_ranks(tmp_path, two_nodes_worker, str(tmp_path))


def test_a_stock_dcp_checkpoint_is_read_where_it_is(tmp_path):
    import torch.distributed.checkpoint as dcp

    ref = reference_state()
    stock = tmp_path / "ckpt" / "stock"
    dcp.save(ref, storage_writer=dcp.FileSystemWriter(stock), no_dist=True)
    loaded = full_blank(ref)
    assert _tier(tmp_path).load(loaded, stock) is None
    assert_same_state(loaded, ref)
    assert not (tmp_path / "local" / "0" / "stock").exists()


def test_a_local_folder_that_cannot_be_made_fails_the_save_before_dcp_starts(tmp_path):
    (tmp_path / "local").write_bytes(b"a file where the local tier's folder should be")
    with pytest.raises(CommitError, match="rank 0: .*node-local tier|node-local tier.*rank 0"):
        _tier(tmp_path).save(reference_state(), tmp_path / "ckpt" / "step_1")
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------------------- async saves


def _committed_anywhere(tmp_path: Path, tag: str) -> list[str]:
    """The manifests of `tag` in the local tier and the persistent one."""
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob(f"{tag}/*")
                  if p.name in (manifest.MANIFEST_NAME, local.LOCAL_MANIFEST_NAME))


def test_an_async_save_is_staged_committed_in_the_background_and_loads_bit_exact(tmp_path):
    ref = reference_state()
    state = _snapshot(ref)
    persistent = tmp_path / "ckpt" / "step_1"
    tier = _tier(tmp_path)
    future = tier.async_save(state, persistent, algorithm="zstd")
    state["model"]["w"].add_(1.0)  # after async_save returns: not in the checkpoint
    result = future.result()
    assert {r.path for r in result.manifest.files} == {".metadata", "__0_0.nvcomp.distcp"}
    local_copy = tmp_path / "local" / "0" / "step_1"
    assert manifest.read_manifest(local_copy).tag == "step_1"
    assert not (persistent / manifest.MANIFEST_NAME).exists()  # the drain commits at close
    tier.close()
    ndcp.verify_dcp(persistent)
    for record in manifest.read_manifest(persistent).files:
        assert (persistent / record.path).read_bytes() == (local_copy / record.path).read_bytes()

    (persistent / "__0_0.nvcomp.distcp").unlink()  # the load reads the local copy
    loaded = full_blank(ref)
    restored = _tier(tmp_path).load(loaded, persistent)
    assert restored is not None and restored.persistent_bytes == 0
    assert_same_state(loaded, ref)


def _fail_writes_of(name: str) -> faults.FaultPlan:
    """Every storage of this process, with the write of rank file `name` failing as a full disk."""
    plan = faults.FaultPlan(faults.Fault("finish", key=f"*{name}*", error=OSError(
        28, "No space left on device")))  # as os.write says it: no file named
    wrap_storages(plan.wrap)
    return plan


def test_a_failed_background_write_fails_the_future_and_commits_nothing(tmp_path):
    tier = _tier(tmp_path)
    plan = _fail_writes_of("__0_0.nvcomp.distcp")
    try:
        future = tier.async_save(reference_state(), tmp_path / "ckpt" / "step_1")
        with pytest.raises(CommitError, match=r"rank 0: OSError: .*No space left.*__0_0\.nvcomp\.distcp"):
            future.result()
    finally:
        wrap_storages(None)
    assert any(fault.fired for fault in plan.faults)
    tier.close()  # reported by the future: not raised again; no drain was started
    assert _committed_anywhere(tmp_path, "step_1") == []
    assert not (tmp_path / "ckpt" / "step_1").exists()


def test_a_background_failure_nobody_took_is_raised_by_the_next_call(tmp_path):
    tier = _tier(tmp_path)
    _fail_writes_of("__0_0.nvcomp.distcp")
    try:
        tier.async_save(reference_state(), tmp_path / "ckpt" / "step_1")
        with pytest.raises(CommitError, match=r"'step_1'.*rank 0: .*__0_0\.nvcomp\.distcp"):
            tier.async_save(reference_state(), tmp_path / "ckpt" / "step_2")
    finally:
        wrap_storages(None)
    assert not (tmp_path / "local" / "0" / "step_2").exists()  # step_2 never started
    future = tier.async_save(reference_state(), tmp_path / "ckpt" / "step_2")
    tier.close()  # the job goes on: the next save commits and drains
    assert future.result().tag == "step_2"
    assert _committed_anywhere(tmp_path, "step_1") == []
    ndcp.verify_dcp(tmp_path / "ckpt" / "step_2")


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_failed_tier_commit_leaves_no_manifest_of_dcp_in_the_local_copy(tmp_path, monkeypatch, how):
    """DCP's finish ran, the tier's commit did not: the local copy must not look complete."""
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device", local.LOCAL_MANIFEST_NAME)

    monkeypatch.setattr(local, "write_local_manifest", full_disk)
    tier = _tier(tmp_path)
    with pytest.raises(CommitError, match=f"rank 0: .*{local.LOCAL_MANIFEST_NAME}"):
        outcome = getattr(tier, how)(reference_state(), tmp_path / "ckpt" / "step_1")
        if how == "async_save":
            outcome.result()
    tier.close()
    assert (tmp_path / "local" / "0" / "step_1" / ".metadata").exists()  # DCP had finished
    assert _committed_anywhere(tmp_path, "step_1") == []
