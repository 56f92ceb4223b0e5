"""Tags on an object store: commit, discovery, retention and re-saves with an ``s3://`` save
folder, against the real S3 API server of `conftest.s3_server`.

The store has no rename, so a commit is the manifest put last (``If-None-Match: *``), `latest` an
object, retention a `delete_prefix`, and a re-save writes under the final keys after its leader
deleted the old manifest (see `commit`'s module docstring). Fake ranks are threads, as in
`test_commit.py`, whose helpers these tests reuse.
"""

from __future__ import annotations

import time

import pytest

from nvcomp_ckpt_engine import commit as cm
from nvcomp_ckpt_engine import discovery, manifest, retention
from nvcomp_ckpt_engine.errors import CommitError, CorruptCheckpointError, IncompleteCheckpointError
from nvcomp_ckpt_engine.storage import locations
from test_commit import LAYOUT, names_of, run_ranks, shard_bytes, write_shard


@pytest.fixture
def save_url(s3_server, s3_storage, monkeypatch) -> str:
    """The test's own prefix as a save folder URL; `open_storage` finds the server through the
    environment, as a job's would."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    return s3_storage.url


def store_save(save_url: str, tag: str, gen: int, *, commit: bool = True, world_size: int = 2) -> list:
    """The engine's calls of one save on fake ranks: prepare, write, commit, `latest`."""

    def rank_main(rank: int, collective) -> cm.CommitResult | None:
        plan = cm.prepare_tag_dir(save_url, tag, rank=rank)
        records = [write_shard(plan, name, shard_bytes(tag, gen, rank, idx), rank=rank)
                   for idx, name in enumerate(names_of(rank))]
        if not commit:
            return None
        result = cm.commit_checkpoint(plan.tag_dir, records, collective=collective, layout=LAYOUT,
                                      timeout_s=10.0, plan=plan, step=gen)
        if rank == 0:
            discovery.write_latest(save_url, tag)
        return result

    results = run_ranks(world_size, rank_main)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_url_locations_join_and_split_without_leaving_the_url():
    from pathlib import Path

    where = locations.location("s3://bucket/run/")
    assert isinstance(locations.location("/ckpt/run"), Path)
    tag = where / "global_step1"
    assert str(tag / "a/b.pt") == "s3://bucket/run/global_step1/a/b.pt"
    assert (tag.name, str(tag.parent), tag.parent.parent.parent.name) == ("global_step1", "s3://bucket/run", "")
    assert locations.is_inside(tag / "x", where) and not locations.is_inside("s3://bucket/runner", where)
    assert locations.relative_to(tag / "a/b.pt", tag) == "a/b.pt"
    for escape in ("..", "../other", "/etc", "s3://other/x", "a//b"):
        with pytest.raises(ValueError):
            where / escape


def test_tags_on_the_store_are_committed_found_and_retained(save_url, s3_storage):
    for gen, tag in enumerate(["global_step1", "global_step2", "global_step3"], start=1):
        (result, _) = store_save(save_url, tag, gen)
        assert result.files == 3 and not result.staged
    assert s3_storage.read_small(discovery.LATEST_NAME, 100) == b"global_step3"
    assert discovery.find_complete_checkpoints(save_url) == ["global_step3", "global_step2", "global_step1"]
    state = discovery.resolve_load_state(save_url, check_crc=True)
    assert state.tag == "global_step3" and str(state.path) == f"{save_url}/global_step3"
    assert manifest.manifest_path(state.path) == locations.location(f"{save_url}/global_step3/{manifest.MANIFEST_NAME}")

    report = retention.apply_retention(save_url, 2, protect={"global_step3"})
    assert report.deleted == ("global_step1",)
    assert not list(s3_storage.list("global_step1"))  # every object gone, not only the manifest
    assert discovery.find_complete_checkpoints(save_url) == ["global_step3", "global_step2"]


def test_a_second_commit_of_one_tag_on_the_store_is_refused(save_url):
    store_save(save_url, "global_step1", 1, world_size=1)
    tag_url = f"{save_url}/global_step1"
    first = manifest.read_manifest(tag_url)

    def resave(rank: int, collective) -> cm.CommitResult:
        plan = cm.prepare_tag_dir(save_url, "global_step1", rank=rank)  # deletes the manifest
        records = [write_shard(plan, names_of(0)[0], b"new bytes", rank=rank)]
        manifest.write_manifest(tag_url, first, if_absent=True)  # another writer commits first
        return cm.commit_checkpoint(plan.tag_dir, records, collective=collective, layout=LAYOUT,
                                    timeout_s=10.0, plan=plan)

    (outcome,) = run_ranks(1, resave)
    assert isinstance(outcome, CommitError) and "PreconditionFailed" in str(outcome), outcome
    assert manifest.read_manifest(tag_url) == first  # the first commit stands


def test_a_resave_on_the_store_writes_in_place_and_commits_last(save_url, s3_storage):
    store_save(save_url, "global_step1", 1)
    store_save(save_url, "global_step1", 2, commit=False)  # killed before its commit
    assert not s3_storage.exists(f"global_step1/{manifest.MANIFEST_NAME}")
    with pytest.raises(IncompleteCheckpointError, match=f"{save_url}/global_step1"):
        discovery.resolve_load_tag(save_url)
    store_save(save_url, "global_step1", 3)  # the next save of the tag commits it
    state = discovery.resolve_load_state(save_url, check_crc=True)
    assert state.manifest.step == 3 and not state.manifest.pending
    assert not [o.key for o in s3_storage.list("global_step1") if ".nvckpt-stage" in o.key]


def test_retention_deletes_a_crashed_resave_on_the_store(save_url, s3_storage):
    store_save(save_url, "global_step1", 1)
    store_save(save_url, "global_step2", 2)
    store_save(save_url, "global_step1", 3, commit=False)  # a re-save killed before its commit
    time.sleep(1.1)  # the store's times are whole seconds: the next commit is of a later one
    store_save(save_url, "global_step3", 4)
    report = retention.apply_retention(save_url, 5, protect={"global_step3"})
    assert report.deleted == ("global_step1",)
    assert not list(s3_storage.list("global_step1"))


def test_a_save_in_flight_on_the_store_is_not_retained_away(save_url, s3_storage):
    store_save(save_url, "global_step1", 1)
    store_save(save_url, "global_step2", 2, commit=False)  # newer than every commit: in flight
    report = retention.apply_retention(save_url, 1)
    assert report.deleted == ()
    assert s3_storage.exists(f"global_step2/{cm.TAG_MARKER_NAME}")


def test_an_object_changed_after_the_commit_is_corrupt_naming_its_url(save_url, s3_storage):
    store_save(save_url, "global_step1", 1, world_size=1)
    key = "global_step1/" + names_of(0)[0]
    data = bytearray(s3_storage.read_small(key, 1 << 20))
    data[0] ^= 1
    s3_storage.publish(key, bytes(data))  # same size, other bytes
    with pytest.raises(IncompleteCheckpointError, match=f"{save_url}/{key}"):
        discovery.resolve_load_tag(save_url, check_crc=True)
    with pytest.raises(CorruptCheckpointError, match=f"{save_url}/{key}"):
        manifest_files_verify(f"{save_url}/global_step1")


def manifest_files_verify(tag_url: str) -> None:
    from nvcomp_ckpt_engine import manifest_files

    manifest_files.verify_files(tag_url, manifest.read_manifest(tag_url), check_crc=True)


# -- nvcomp-ckpt inspect / verify of a tag on the store -------------------------------------------

def _engine_tag_on_the_store(save_url: str, tag: str = "global_step1") -> str:
    """Two shards written by `nce.save` to the store and committed as one rank's tag (a manifest
    with each one's size and index CRC), with `latest` naming it; the tag's URL."""
    import torch

    import nvcomp_ckpt_engine as nce
    from nvcomp_ckpt_engine import container

    tag_url = f"{save_url}/{tag}"
    records = []
    for name, state in [("model.pt", {"w": torch.randn(64, 65)}), ("optim.pt", {"m": torch.randn(999)})]:
        nce.save(state, f"{tag_url}/{name}")
        index = container.read_index(f"{tag_url}/{name}")
        records.append(manifest.ShardRecord(
            path=name, rank=0, raw_bytes=index.raw_bytes, file_bytes=locations.stat(f"{tag_url}/{name}").size,
            crc32=index.crc32, codecs=("zstd",)))
    manifest.write_manifest(tag_url, manifest.build_manifest(
        tag=tag, world_size=1, files=records, layout={"framework": "torch"}, versions={}, step=1,
        created_unix_ns=1))
    discovery.write_latest(save_url, tag)
    return tag_url


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from nvcomp_ckpt_engine import cli

    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out + err


def test_inspect_and_verify_a_tag_on_the_store(save_url, capsys):
    import json

    tag_url = _engine_tag_on_the_store(save_url)
    for where in (tag_url, save_url):
        status, out = _cli(capsys, "inspect", "--json", where)
        doc = json.loads(out)
        assert status == 0 and doc["path"] == tag_url and doc["tag"] == "global_step1"
        assert doc["manifest"]["files"] == 2 and [f["path"] for f in doc["files"]] == ["model.pt", "optim.pt"]
        assert doc["totals"]["tensors"] == 2
        status, out = _cli(capsys, "verify", "-q", where)
        assert status == 0 and out.strip().endswith(f"{tag_url}: OK"), out
    status, out = _cli(capsys, "verify", "-q", f"{save_url}/global_step9")
    assert status == 2 and f"{save_url}/global_step9 does not exist" in out


@pytest.mark.parametrize("change", ["content", "size"])
def test_verify_names_an_object_changed_on_the_store_after_the_commit(save_url, s3_storage, capsys, change):
    tag_url = _engine_tag_on_the_store(save_url)
    key = "global_step1/optim.pt"
    data = bytearray(s3_storage.read_small(key, 1 << 20))
    if change == "content":
        data[len(data) // 2] ^= 0x40  # in the payload: the same size, another CRC
    else:
        data += b"\0" * 8
    s3_storage.publish(key, bytes(data))
    status, out = _cli(capsys, "verify", "-q", save_url)
    assert status == 1 and f"FAULT: {tag_url}/optim.pt" in out, out
    assert "model.pt" not in out.replace(f"{tag_url}: ", "")
    with pytest.raises(CorruptCheckpointError, match=f"{tag_url}/optim.pt"):
        manifest_files_verify(tag_url)


def test_a_tag_on_the_store_is_opened_and_loaded_through_its_manifest(save_url):
    import torch

    import nvcomp_ckpt_engine as nce
    from nvcomp_ckpt_engine import opened

    tag_url = _engine_tag_on_the_store(save_url)
    checkpoint = opened.open_checkpoint(save_url, check_indexes=True)
    assert str(checkpoint.tag_dir) == tag_url and checkpoint.paths == ["model.pt", "optim.pt"]
    assert str(checkpoint.checked("optim.pt")) == f"{tag_url}/optim.pt"
    back = checkpoint.load("optim.pt")
    assert torch.equal(back["m"].view(torch.int32), nce.load(f"{tag_url}/optim.pt")["m"].view(torch.int32))


# -- torch.distributed.checkpoint with an s3:// checkpoint_id -------------------------------------

def test_dcp_save_and_load_on_the_store_bit_exact(save_url, s3_storage):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from nvcomp_ckpt_engine import dcp as ndcp
    from test_dcp import assert_same_state, full_blank, reference_state

    ckpt = f"{save_url}/dcp"
    ref = reference_state()
    dcp.save(ref, checkpoint_id=ckpt, storage_writer=ndcp.NvcompFileSystemWriter(ckpt), no_dist=True)
    assert sorted(o.key for o in s3_storage.list("dcp")) == [
        "dcp/.metadata", "dcp/__0_0.nvcomp.distcp", "dcp/nvcomp_manifest.json"]
    found = manifest.read_manifest(ckpt)
    assert [r.path for r in found.files] == [".metadata", "__0_0.nvcomp.distcp"]
    assert ndcp.is_dcp_checkpoint(ckpt) and not ndcp.is_dcp_checkpoint(save_url)
    loaded = full_blank(ref)
    dcp.load(loaded, checkpoint_id=ckpt, storage_reader=ndcp.NvcompFileSystemReader(ckpt), no_dist=True)
    assert_same_state(loaded, ref)

    data = bytearray(s3_storage.read_small("dcp/__0_0.nvcomp.distcp", 1 << 20))
    data[len(data) // 2] ^= 0x10  # replaced after the commit: same size, other bytes
    s3_storage.publish("dcp/__0_0.nvcomp.distcp", bytes(data))
    with pytest.raises(CheckpointException) as caught:
        dcp.load(full_blank(ref), storage_reader=ndcp.NvcompFileSystemReader(ckpt), no_dist=True)
    failure = caught.value.failures[0]
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, CorruptCheckpointError) and f"{ckpt}/__0_0.nvcomp.distcp" in str(failure)


def test_no_rank_writes_a_resave_before_its_leader_deleted_the_old_manifest(save_url, s3_storage):
    """The leader's delete of the old manifest is slow to land; every rank leaves
    `prepare_tag_dir` only after it has (its barrier), so none replaces a shard under it."""
    from nvcomp_ckpt_engine.storage import faults, wrap_storages

    store_save(save_url, "global_step1", 1)
    key = f"global_step1/{manifest.MANIFEST_NAME}"
    plan = faults.FaultPlan(faults.Fault("delete", key=f"*{key}", action=lambda: time.sleep(1.0)))

    def prepare(rank: int, collective) -> bool:
        cm.prepare_tag_dir(save_url, "global_step1", rank=rank, collective=collective, timeout_s=10.0)
        return s3_storage.exists(key)  # what this rank would write under

    previous = wrap_storages(plan.wrap)
    try:
        seen = run_ranks(2, prepare)
    finally:
        wrap_storages(previous)
    assert seen == [False, False], seen
