"""The node-local tier around DCP saves and loads (`dcp.tiered.DcpLocalTier`): in one process
(one rank, one node, no replicas), and two ranks as two simulated nodes replicating each other."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from test_dcp import (
    CHUNK_MB, assert_same_state, blank_like, distributed_state, full_blank, reference_state, run_ranks,
)
from nvcomp_ckpt_engine import dcp as ndcp
from nvcomp_ckpt_engine import manifest
from nvcomp_ckpt_engine.errors import CommitError
from nvcomp_ckpt_engine.dcp.tiered import DcpLocalTier
from nvcomp_ckpt_engine.storage import locations


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
    """Each rank a node of its own (LOCAL_WORLD_SIZE 1), each file replicated on the other: node
    1's folder lost and the persistent rank files moved away, the load restores node 1 from node
    0's copies and replicas."""
    from torch.distributed.device_mesh import init_device_mesh

    base, persistent = Path(tmp), Path(tmp) / "ckpt" / "step_1"
    tier = _tier(base, replicas=1)
    state = distributed_state(init_device_mesh("cpu", (world,)), reference_state())
    tier.save(state, persistent, chunk_mb=CHUNK_MB)
    tier.close()
    dist.barrier()
    if rank == 0:
        assert manifest.read_manifest(persistent).world_size == 2
        for name in ("__0_0.nvcomp.distcp", "__1_0.nvcomp.distcp"):
            (persistent / name).rename(base / name)
    else:
        shutil.rmtree(base / "local" / "1")
    dist.barrier()
    loaded = blank_like(state)
    restored = _tier(base, replicas=1).load(loaded, persistent)
    assert restored is not None and restored.persistent_bytes == 0 and restored.peer_bytes > 0
    assert_same_state(loaded, state, f"rank {rank}")


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
