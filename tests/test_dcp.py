"""torch.distributed.checkpoint through NvcompFileSystemWriter / NvcompFileSystemReader.

Two ranks (gloo, torch.multiprocessing) save DTensor state, FSDP2 model + optimizer state and
bytes items, synchronously and with `dcp.async_save`, and load them back bit-exact. The
checkpoint written by the first group is then read in this process: resharded onto one rank,
partly, decompressed for stock DCP, damaged in several ways, and inspected.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from conftest import raw_bytes
from worker_exit import exit_worker_now
from nvcomp_ckpt_engine import container, manifest, pipeline
from nvcomp_ckpt_engine import dcp as ndcp
from nvcomp_ckpt_engine.dcp import reader as dcp_reader
from nvcomp_ckpt_engine.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeObjectError,
    UnsupportedCheckpointError,
)

WORLD = 2
#: Small chunks, so every tensor of any size spans several of them.
CHUNK_MB = 1 / 256


# ------------------------------------------------------------------------- the harness


def _entry(rank: int, world: int, store: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


def run_ranks(tmp: Path, fn, *args, world: int = WORLD) -> None:
    """Run ``fn(rank, world, *args)`` in `world` processes joined by a gloo group."""
    mp.spawn(_entry, args=(world, str(tmp / f"store-{fn.__name__}"), fn, args), nprocs=world)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def assert_same_state(got, want, where: str = "") -> None:
    """Nested dicts/lists equal, tensors (DTensor: their local shards) bit for bit."""
    from torch.distributed.tensor import DTensor

    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, DTensor):
        assert isinstance(got, DTensor), where
        assert same_bits(got.to_local(), want.to_local()), where
    elif isinstance(want, torch.Tensor):
        assert same_bits(got, want), where
    else:
        assert got == want, where


# ------------------------------------------------------------ DTensor state on two ranks


def reference_state() -> dict:
    """Full (unsharded) tensors and plain values, the same in every process."""
    g = torch.Generator().manual_seed(0)
    nan_payloads = torch.tensor([0x7FC00001, 0x7F800001, -0x80000000, 0x7F800000, 1],
                                dtype=torch.int32).view(torch.float32)
    return {
        "model": {
            "w": torch.randn(9, 6, generator=g),  # 9 rows: uneven shards (5 + 4)
            "e": torch.randn(4, 7, generator=g).bfloat16(),
            "i": torch.randint(-1000, 1000, (5,), generator=g),
        },
        "special": nan_payloads,  # NaN payloads, -0.0, inf, a denormal: bits, not values
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "extra": {"step": 7, "name": "run-1", "lrs": [0.1, 0.01]},  # bytes items
    }


def distributed_state(mesh, ref: dict) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    m = ref["model"]
    return {
        "model": {
            "w": distribute_tensor(m["w"], mesh, [Shard(0)]),
            "e": distribute_tensor(m["e"], mesh, [Shard(1)]),
            "i": distribute_tensor(m["i"], mesh, [Replicate()]),
        },
        **{k: v for k, v in ref.items() if k != "model"},
    }


def blank_like(state):
    """The same structure with zeroed tensors (same placements) and placeholder values."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: blank_like(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        blank = state.detach().clone()
        blank.to_local().zero_()
        return blank
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None


def dtensor_worker(rank: int, world: int, ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state = distributed_state(mesh, reference_state())
    dcp.save(state, storage_writer=ndcp.NvcompFileSystemWriter(ckpt, chunk_mb=CHUNK_MB))
    loaded = blank_like(state)
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(ckpt))
    assert_same_state(loaded, state, f"rank {rank}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A checkpoint of `reference_state` saved by two ranks (and read back by them)."""
    tmp = tmp_path_factory.mktemp("dtensor")
    run_ranks(tmp, dtensor_worker, str(tmp / "ckpt"))
    return tmp / "ckpt"


@pytest.mark.slow
def test_dtensor_state_round_trips_bit_exact_on_two_ranks(ckpt):
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".metadata", "__0_0.nvcomp.distcp", "__1_0.nvcomp.distcp",
                     "nvcomp_manifest.json"]
    assert all(container.is_shard_file(ckpt / n) for n in names[1:3])
    found = manifest.read_manifest(ckpt)
    assert found.world_size == 2 and dict(found.layout) == {"framework": "dcp"}
    assert [(r.path, r.rank) for r in found.files] == [
        (".metadata", 0), ("__0_0.nvcomp.distcp", 0), ("__1_0.nvcomp.distcp", 1)]


@pytest.fixture(scope="module")
def store_ckpt(s3_server, tmp_path_factory) -> str:
    """The `ckpt` job with the checkpoint on the S3 test server: two ranks save
    `reference_state` to an ``s3://`` checkpoint_id and read it back."""
    import uuid

    from s3_server import BUCKET

    url = f"s3://{BUCKET}/dcp-{uuid.uuid4().hex[:8]}/ckpt"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", s3_server.url)  # the ranks' storages find the server so
        run_ranks(tmp_path_factory.mktemp("dtensor-store"), dtensor_worker, url)
        yield url


@pytest.mark.slow
def test_two_ranks_save_to_an_object_store_and_it_loads_on_one(store_ckpt):
    from nvcomp_ckpt_engine.storage import open_storage

    names = sorted(entry.key for entry in open_storage(store_ckpt).list())
    assert names == [".metadata", "__0_0.nvcomp.distcp", "__1_0.nvcomp.distcp",
                     "nvcomp_manifest.json"]
    found = manifest.read_manifest(store_ckpt)
    assert [(r.path, r.rank) for r in found.files] == [
        (".metadata", 0), ("__0_0.nvcomp.distcp", 0), ("__1_0.nvcomp.distcp", 1)]
    ndcp.verify_dcp(store_ckpt)
    loaded = full_blank(reference_state())
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(store_ckpt), no_dist=True)
    assert_same_state(loaded, reference_state())


def full_blank(ref):
    if isinstance(ref, dict):
        return {k: full_blank(v) for k, v in ref.items()}
    return torch.zeros_like(ref) if isinstance(ref, torch.Tensor) else None


@pytest.mark.slow
def test_two_rank_checkpoint_loads_on_one_rank(ckpt):
    loaded = full_blank(reference_state())
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(ckpt), no_dist=True)
    assert_same_state(loaded, reference_state())


@pytest.mark.slow
def test_loading_one_item_decodes_only_its_span(ckpt):
    calls = []
    real = dcp_reader.decode_span

    def counting(f, index, i, *args, **kwargs):
        calls.append((Path(index.path).name, i))
        return real(f, index, i, *args, **kwargs)

    want = {"model": {"e": torch.zeros(4, 7, dtype=torch.bfloat16)}}
    with mock.patch.object(dcp_reader, "decode_span", counting):
        dcp.load(want, storage_reader=ndcp.NvcompFileSystemReader(ckpt), no_dist=True)
    assert same_bits(want["model"]["e"], reference_state()["model"]["e"])
    assert len(calls) == 2 and {name for name, _ in calls} == {"__0_0.nvcomp.distcp",
                                                                "__1_0.nvcomp.distcp"}


@pytest.mark.slow
def test_decompressed_copy_is_read_by_stock_dcp(ckpt, tmp_path):
    out = tmp_path / "plain"
    ndcp.decompress_dcp(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not ndcp.is_dcp_checkpoint(out)
    loaded = full_blank(reference_state())
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(out), no_dist=True)
    assert_same_state(loaded, reference_state())


@pytest.mark.slow
def test_decompress_refuses_a_non_empty_destination(ckpt, tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        ndcp.decompress_dcp(ckpt, tmp_path)


@pytest.mark.slow
def test_stock_reader_on_a_compressed_checkpoint_names_the_way_out(ckpt):
    with pytest.raises(CheckpointException) as info:
        dcp.load(full_blank(reference_state()), storage_reader=dcp.FileSystemReader(ckpt),
                 no_dist=True)
    assert "NvcompFileSystemReader" in str(info.value) and "nvcomp-ckpt decompress" in str(info.value)


def test_our_reader_reads_a_stock_checkpoint(tmp_path):
    ref = reference_state()
    dcp.save(ref, storage_writer=dcp.FileSystemWriter(tmp_path / "stock"), no_dist=True)
    loaded = full_blank(ref)
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "stock"), no_dist=True)
    assert_same_state(loaded, ref)


def test_single_process_save_and_load(tmp_path):
    ref = reference_state()
    dcp.save(ref, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c", algorithm="deflate"),
             no_dist=True)
    loaded = full_blank(ref)
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    assert_same_state(loaded, ref)
    codecs = {c for row in ndcp.inspect_dcp(tmp_path / "c") for c in row["codecs"]}
    assert codecs <= {"deflate", "none"}


def _varied_state() -> dict:
    """Tensors of several dtypes and shapes, a 0-dim one, an empty one and a bytes item; the
    float ones span several chunks."""
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randn(33, 17, generator=gen), "h": torch.randn(300, generator=gen).half(),
            "bf": torch.randn(8, 9, generator=gen).bfloat16(), "i": torch.arange(50),
            "flags": torch.rand(40, generator=gen) > 0.5, "step": torch.tensor(7.0),
            "none": torch.empty(0, 3), "cfg": {"lr": 0.1}}


def _blank(state: dict) -> dict:
    return {k: (torch.full_like(v, 1) if isinstance(v, torch.Tensor)
                else _blank(v) if isinstance(v, dict) else None) for k, v in state.items()}


def test_a_load_at_the_saved_layout_decodes_into_the_planner_tensors(tmp_path):
    """Every tensor item wanted whole decodes straight into the tensor DCP fills, one pipeline
    per rank file: no span is decoded apart and copied (`RankFile.tensor` is not called)."""
    ref = _varied_state()
    dcp.save(ref, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c", chunk_mb=CHUNK_MB),
             no_dist=True)
    loaded = _blank(ref)
    pointers = {k: v.data_ptr() for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    decoded = []
    real = pipeline.read_storages_into

    def counting(fd, index, wanted, **kwargs):
        decoded.append(len(wanted))
        return real(fd, index, wanted, **kwargs)

    with mock.patch.object(dcp_reader.RankFile, "tensor", side_effect=AssertionError("a span")), \
            mock.patch.object(pipeline, "read_storages_into", counting):
        dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    assert decoded == [6]  # all but the empty tensor, in one call
    assert {k: v.data_ptr() for k, v in loaded.items() if isinstance(v, torch.Tensor)} == pointers
    assert_same_state(loaded, ref)


def test_strided_destinations_and_boxes_load_through_spans_beside_direct_items(tmp_path):
    """A destination laid out otherwise than stored (transposed) and a box of an item (the
    planner's view of a larger tensor) take the span path, in the same file as items decoded
    straight into their destinations; all bit-exact."""
    ref = _varied_state()
    dcp.save(ref, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c", chunk_mb=CHUNK_MB),
             no_dist=True)
    loaded = _blank(ref)
    loaded["w"] = torch.zeros(17, 33).t()
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    assert not loaded["w"].is_contiguous()
    assert_same_state(loaded, ref)
    reader = ndcp.NvcompFileSystemReader(tmp_path / "c")
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    path, index = dcp_reader.checked_rank_file(reader._checkpoint, reader.path,
                                               "__0_0.nvcomp.distcp")
    with dcp_reader.RankFile(path, index=index) as rank_file:
        key = next(k for k in rank_file.kinds if k.startswith("w"))
        target = torch.empty(33, 17)
        assert rank_file.destination_bytes(key, target, [0, 0], [33, 17]) is not None
        assert rank_file.destination_bytes(key, target[:10], [0, 0], [10, 17]) is None
        assert rank_file.destination_bytes(key, target.t().contiguous().t(), [0, 0],
                                           [33, 17]) is None
        assert rank_file.destination_bytes(key, target.double(), [0, 0], [33, 17]) is None


# ------------------------------------------------------------------------ inspection


@pytest.mark.slow
def test_inspect_lists_every_item_with_its_fqn_and_kind(ckpt):
    rows = ndcp.inspect_dcp(ckpt)
    assert [r["path"] for r in rows] == ["__0_0.nvcomp.distcp", "__1_0.nvcomp.distcp"]
    items = {(t["fqn"], tuple(t["offsets"]), t["kind"]) for r in rows for t in r["tensors"]}
    assert ("model.w", (5, 0), "tensor") in items  # rank 1's shard of the uneven split
    assert ("extra.name", (), "bytes") in items
    assert all(r["raw_bytes"] > 0 and r["file_bytes"] > 0 for r in rows)


@pytest.mark.slow
def test_is_dcp_checkpoint(ckpt, tmp_path):
    assert ndcp.is_dcp_checkpoint(ckpt)
    assert not ndcp.is_dcp_checkpoint(tmp_path)
    assert not ndcp.is_dcp_checkpoint(ckpt / ".metadata")


@pytest.mark.slow
def test_verify_accepts_an_intact_checkpoint(ckpt):
    ndcp.verify_dcp(ckpt)


# ------------------------------------------------------------------------ corruption


@pytest.fixture
def damaged(ckpt, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy


def _chunk_of(path: Path, fqn: str):
    index = container.read_index(path)
    entry = next(t for t in index.tensors if t.key.split("@")[0] == fqn)
    return entry.key, index.storages[entry.storage].chunks[0]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _load_failure(directory: Path) -> BaseException:
    with pytest.raises(CheckpointException) as info:
        dcp.load(full_blank(reference_state()), storage_reader=ndcp.NvcompFileSystemReader(directory),
                 no_dist=True)
    (error, _), = info.value.failures.values()
    return error


@pytest.mark.slow
def test_a_flipped_payload_byte_names_file_and_item(damaged):
    file = damaged / "__1_0.nvcomp.distcp"
    key, blob = _chunk_of(file, "model.w")
    _flip(file, blob.offset + blob.length // 2)
    error = _load_failure(damaged)
    assert isinstance(error, CorruptCheckpointError)
    assert "__1_0.nvcomp.distcp" in str(error) and key in str(error) and "checksum" in str(error)
    with pytest.raises(CorruptCheckpointError, match=f"__1_0.nvcomp.distcp.*{key}"):
        ndcp.verify_dcp(damaged)


def load_outcome_worker(rank: int, world: int, ckpt: str, out: str) -> None:
    """A 2-rank load of `reference_state`; each rank records what `dcp.load` raised."""
    from torch.distributed.device_mesh import init_device_mesh

    state = blank_like(distributed_state(init_device_mesh("cpu", (world,)), reference_state()))
    outcome = {"returned": True}
    try:
        dcp.load(state, storage_reader=ndcp.NvcompFileSystemReader(ckpt))
    except CheckpointException as exc:  # DCP's: a BaseException
        outcome = {"returned": False, "failures": {
            rank: [type(error).__name__, str(error)] for rank, (error, _) in exc.failures.items()}}
    Path(out, f"outcome_rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
def test_a_damaged_file_of_rank_1_fails_the_dcp_load_on_every_rank(damaged, tmp_path):
    """Only rank 1 reads the damaged file; both ranks raise, naming rank 1 and the file."""
    file = damaged / "__1_0.nvcomp.distcp"
    _, blob = _chunk_of(file, "model.w")
    _flip(file, blob.offset + blob.length // 2)
    run_ranks(tmp_path, load_outcome_worker, str(damaged), str(tmp_path))
    for rank in range(WORLD):
        outcome = json.loads((tmp_path / f"outcome_rank{rank}.json").read_text())
        assert not outcome["returned"], f"rank {rank} returned from dcp.load"
        (kind, message), = outcome["failures"].values()
        assert list(outcome["failures"]) == ["1"] and kind == "CorruptCheckpointError", outcome
        assert "__1_0.nvcomp.distcp" in message, message


@pytest.mark.slow
def test_a_truncated_rank_file_is_detected(damaged):
    file = damaged / "__0_0.nvcomp.distcp"
    file.write_bytes(file.read_bytes()[:-100])
    assert isinstance(_load_failure(damaged), CorruptCheckpointError)
    with pytest.raises(CorruptCheckpointError, match="__0_0.nvcomp.distcp"):
        ndcp.verify_dcp(damaged)


@pytest.mark.slow
def test_swapped_rank_files_disagree_with_the_metadata(damaged):
    a, b = damaged / "__0_0.nvcomp.distcp", damaged / "__1_0.nvcomp.distcp"
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(a_bytes)
    assert isinstance(_load_failure(damaged), CorruptCheckpointError)
    # found by the manifest (sizes), before the items are compared with .metadata
    with pytest.raises(CorruptCheckpointError, match="__0_0.nvcomp.distcp.*the manifest says"):
        ndcp.verify_dcp(damaged)


@pytest.mark.slow
def test_a_missing_rank_file_or_metadata_is_an_incomplete_checkpoint(damaged):
    (damaged / "__1_0.nvcomp.distcp").unlink()
    with pytest.raises(IncompleteCheckpointError, match="__1_0.nvcomp.distcp"):
        ndcp.verify_dcp(damaged)
    (damaged / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match=".metadata"):
        ndcp.verify_dcp(damaged)


@pytest.mark.slow
def test_metadata_naming_other_classes_is_refused_unread(damaged):
    """With a matching manifest (as a forger would write it): the allowlist refuses."""
    (damaged / ".metadata").write_bytes(pickle.dumps(print))
    reseal(damaged)
    with pytest.raises(UnsafeObjectError, match="builtins.print"):
        ndcp.verify_dcp(damaged)
    (damaged / ".metadata").write_bytes(b"not a pickle")
    reseal(damaged)
    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        ndcp.verify_dcp(damaged)


def test_the_location_record_answers_the_stock_reader_with_the_way_out():
    location = ndcp.ItemLocation("__0_0.nvcomp.distcp", "w")
    with pytest.raises(UnsupportedCheckpointError, match="NvcompFileSystemReader"):
        location.offset  # noqa: B018 - what DCP's stock reader asks for
    assert pickle.loads(pickle.dumps(location)) == location
    # DCP pickles it into .metadata under this name: part of the file format
    assert b"cnvcomp_ckpt_engine.dcp\nItemLocation\n" in pickle.dumps(location, protocol=2)
    assert not hasattr(location, "no_such_field")


@pytest.mark.parametrize("kwargs, message", [
    ({"algorithm": "brotli"}, "unknown algorithm"),
    ({"algorithm": "ans", "portable": True}, "portable"),
    ({"chunk_mb": 0}, "chunk_mb"),
    ({"workers": 0}, "workers"),
])
def test_bad_options_are_refused_with_the_remedy(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ndcp.NvcompFileSystemWriter(tmp_path, **kwargs)


# ------------------------------------------------- FSDP2 model + optimizer, async save


def _fsdp_model(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 16)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(state):
    """A deep copy that later training steps cannot change."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    if isinstance(state, (DTensor, torch.Tensor)):
        return state.detach().clone()
    return state


def _load_fresh(path: str):
    """A freshly initialised model/optimizer loaded from `path`; returns its state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _fsdp_model(seed=123)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=ndcp.NvcompFileSystemReader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def fsdp_worker(rank: int, world: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _fsdp_model(seed=0)
    _train_step(model, optimizer, seed=1)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    expected = _snapshot(state)

    dcp.save(state, storage_writer=ndcp.NvcompFileSystemWriter(f"{out}/sync", chunk_mb=CHUNK_MB))

    # A dedicated gloo group for the background save: collectives on the default group from
    # this thread while the save uses it can hang (facts/cpu-integrations.md).
    background = dist.new_group(backend="gloo")
    response = dcp.async_save(
        state, storage_writer=ndcp.NvcompFileSystemWriter(f"{out}/async", chunk_mb=CHUNK_MB),
        process_group=background)
    _train_step(model, optimizer, seed=2)  # training goes on while the save is written
    future = getattr(response, "upload_completion", response)
    future.result()
    dist.barrier()

    for name in ("sync", "async"):
        assert_same_state(_load_fresh(f"{out}/{name}"), expected, f"{name} rank {rank}")


@pytest.mark.slow
def test_fsdp2_model_and_optimizer_sync_and_async(tmp_path):
    run_ranks(tmp_path, fsdp_worker, str(tmp_path))
    for name in ("sync", "async"):
        ndcp.verify_dcp(tmp_path / name)


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_cuda_tensors_are_compressed_on_their_gpu_and_load_back(tmp_path):
    ref = reference_state()
    on_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in ref.items()}
    on_gpu["model"] = {k: v.cuda() for k, v in ref["model"].items()}
    dcp.save(on_gpu, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c"), no_dist=True)
    for device in ("cuda", "cpu"):
        loaded = full_blank(ref)
        loaded["model"] = {k: v.to(device) for k, v in loaded["model"].items()}
        dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
        assert loaded["model"]["w"].device.type == device
        assert_same_state({k: v.cpu() for k, v in loaded["model"].items()}, ref["model"])
    ndcp.verify_dcp(tmp_path / "c")
    portable = tmp_path / "portable"
    dcp.save(on_gpu, storage_writer=ndcp.NvcompFileSystemWriter(portable, portable=True),
             no_dist=True)
    assert {c for r in ndcp.inspect_dcp(portable) for c in r["codecs"]} <= {"zstd", "deflate", "none"}


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_gpu_coded_load_decodes_into_the_planner_tensors_on_the_gpu_or_in_host_memory(
        tmp_path, device):
    """nvCOMP-coded items wanted whole decode straight into the planner's tensors, on the GPU
    (the batches decoded there) or in host memory (through the pinned buffers), one pipeline
    per file, no span decoded apart; a strided destination beside them takes the span path."""
    ref = _varied_state()
    on_gpu = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in ref.items()}
    dcp.save(on_gpu, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c", chunk_mb=CHUNK_MB),
             no_dist=True)
    loaded = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in _blank(ref).items()}
    with mock.patch.object(dcp_reader.RankFile, "tensor", side_effect=AssertionError("a span")):
        dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    assert_same_state({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in loaded.items()},
                      ref)
    strided = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in _blank(ref).items()}
    strided["w"] = torch.zeros(17, 33, device=device).t()
    dcp.load(strided, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    assert_same_state({k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in strided.items()},
                      ref)


def test_bytes_items_survive_exactly(tmp_path):
    blob = io.BytesIO(os.urandom(3000))
    state = {"blob": blob.getvalue(), "nested": {"t": (1, "two", 3.0)}}
    dcp.save(state, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c"), no_dist=True)
    loaded = {"blob": None, "nested": {"t": None}}
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    assert loaded == state


def test_overwriting_removes_the_old_metadata_before_writing(tmp_path):
    path = tmp_path / "c"
    dcp.save({"w": torch.ones(4)}, storage_writer=ndcp.NvcompFileSystemWriter(path), no_dist=True)
    with mock.patch.object(pipeline, "write_prepared", side_effect=OSError("disk full")):
        with pytest.raises(CheckpointException, match="disk full"):
            dcp.save({"w": torch.zeros(4)}, storage_writer=ndcp.NvcompFileSystemWriter(path),
                     no_dist=True)
    assert not (path / ".metadata").exists()  # not the old metadata over a half-written save
    dcp.save({"w": torch.zeros(4)}, storage_writer=ndcp.NvcompFileSystemWriter(path), no_dist=True)
    loaded = {"w": torch.ones(4)}
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(path), no_dist=True)
    assert same_bits(loaded["w"], torch.zeros(4))


# ------------------------------------------------------------------ the manifest, .metadata
#
# One process writes a small checkpoint; its `.metadata` or manifest is then damaged bit by bit,
# `.metadata` replaced by hostile pickles (with a manifest a forger would write to match), or its
# rank files swapped or turned into links out of the folder.


def reseal(path: Path) -> None:
    """Rewrite the manifest of a DCP folder to match the files now in it (what a forger would
    do): every rank file and `.metadata`, with their sizes and CRCs."""
    old = manifest.read_manifest(path)
    names = sorted(p.name for p in path.iterdir() if p.name.endswith(ndcp.SHARD_SUFFIX))
    records = [manifest.ShardRecord(path=name, rank=0, raw_bytes=0,
                                    file_bytes=len((path / name).read_bytes()),
                                    crc32=zlib.crc32((path / name).read_bytes()))
               for name in [".metadata", *names]]
    manifest.write_manifest(path, manifest.build_manifest(
        tag=old.tag, world_size=1, files=records, layout=old.layout, versions=old.versions,
        created_unix_ns=old.created_unix_ns))


@pytest.fixture
def small_dcp(tmp_path) -> Path:
    path = tmp_path / "dcp"
    state = {"w": torch.randn(64), "b": torch.arange(10), "step": 3, "cfg": {"lr": 0.1}}
    dcp.save(state, storage_writer=ndcp.NvcompFileSystemWriter(path, chunk_mb=CHUNK_MB),
             no_dist=True)
    return path


def _cli_verify(path: Path, capsys) -> tuple[int, list[str], str]:
    from nvcomp_ckpt_engine import cli

    status = cli.main(["verify", "-q", str(path)])
    out, err = capsys.readouterr()
    return status, [line for line in out.splitlines() if line.startswith("FAULT: ")], out + err


def test_the_writer_commits_a_manifest_of_every_file(small_dcp):
    """Sizes and CRCs of every file as they are on disk, from the writers' own reports."""
    ndcp.verify_dcp(small_dcp)
    found = manifest.read_manifest(small_dcp)
    assert [r.path for r in found.files] == [".metadata", "__0_0.nvcomp.distcp"]
    for record in found.files:
        data = (small_dcp / record.path).read_bytes()
        assert (record.file_bytes, record.crc32) == (len(data), zlib.crc32(data)), record.path
    assert found.files[1].raw_bytes > 0 and found.files[1].codecs
    assert [r.io for r in found.files] == [None, "host"]  # how the rank file was written (CPU)
    assert sorted(p.name for p in small_dcp.iterdir()) == [
        ".metadata", "__0_0.nvcomp.distcp", "nvcomp_manifest.json"]  # no other commit file
    ndcp.NvcompFileSystemReader(small_dcp).read_metadata()


@pytest.mark.parametrize("name", [".metadata", "nvcomp_manifest.json"])
def test_every_single_bit_flip_of_the_metadata_or_the_manifest_is_found(small_dcp, capsys, name):
    """Found by `verify` (one FAULT line) and by the reader before DCP unpickles anything."""
    target = small_dcp / name
    original = target.read_bytes()
    for bit in range(len(original) * 8):
        damaged = bytearray(original)
        damaged[bit // 8] ^= 1 << (bit % 8)
        target.write_bytes(bytes(damaged))
        faults = ndcp.dcp_faults(small_dcp)
        assert len(faults) == 1 and isinstance(faults[0], CorruptCheckpointError), (bit, faults)
        with pytest.raises(CorruptCheckpointError):
            ndcp.NvcompFileSystemReader(small_dcp).read_metadata()
        if bit % 997 == 0:  # the command too, on a sample (it prints; the rest is the same code)
            status, lines, output = _cli_verify(small_dcp, capsys)
            assert status == 1 and len(lines) == 1 and "Traceback" not in output, output
    target.write_bytes(original)
    assert ndcp.dcp_faults(small_dcp) == []


def test_a_missing_manifest_means_the_save_did_not_finish(small_dcp):
    (small_dcp / "nvcomp_manifest.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no nvcomp_manifest.json"):
        ndcp.verify_dcp(small_dcp)
    with pytest.raises(IncompleteCheckpointError, match="no nvcomp_manifest.json"):
        ndcp.NvcompFileSystemReader(small_dcp).read_metadata()


def test_a_dcp_checkpoint_is_opened_as_a_tag_folder_each_index_read_once(small_dcp, tmp_path,
                                                                          monkeypatch):
    """The load, verify and decompress open the folder through `opened` (the manifest read
    once, the rank file's index read once and checked against its record) and read it so."""
    real, reads = container.read_index, []
    monkeypatch.setattr(container, "read_index",
                        lambda path: reads.append(Path(path).name) or real(path))
    monkeypatch.setattr(manifest, "read_manifest", mock.Mock(wraps=manifest.read_manifest))
    loaded = {"w": torch.zeros(64), "b": torch.zeros(10, dtype=torch.int64), "step": None,
              "cfg": {"lr": None}}
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(small_dcp), no_dist=True)
    ndcp.verify_dcp(small_dcp)
    ndcp.decompress_dcp(small_dcp, tmp_path / "out")
    assert reads == ["__0_0.nvcomp.distcp"] * 3
    assert manifest.read_manifest.call_count == 3


def test_a_metadata_linked_out_of_the_folder_is_refused_unread(small_dcp, tmp_path):
    """`.metadata` is a listed file like any other: a link to a copy outside the folder (the
    same bytes, so its record matches) is refused before anything reads it."""
    outside = tmp_path / "elsewhere"
    shutil.copy(small_dcp / ".metadata", outside)
    (small_dcp / ".metadata").unlink()
    (small_dcp / ".metadata").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="outside the tag folder"):
        ndcp.verify_dcp(small_dcp)
    with pytest.raises(CorruptCheckpointError, match="outside the tag folder"):
        ndcp.read_metadata(small_dcp)


def test_a_rank_file_the_manifest_did_not_commit_is_refused(small_dcp, tmp_path):
    """A rank file whose CRC (as its index gives it) is not the manifest's is refused by the
    load before its items are read, by verify and by decompress; one of another size by the
    manifest check itself."""
    name = "__0_0.nvcomp.distcp"
    found = manifest.read_manifest(small_dcp)
    records = tuple(dataclasses_replace(r, crc32=r.crc32 ^ 1) if r.path == name else r
                    for r in found.files)
    manifest.write_manifest(small_dcp, dataclasses_replace(found, files=records))
    loaded = {"w": torch.zeros(64), "b": torch.zeros(10, dtype=torch.int64), "step": None,
              "cfg": {"lr": None}}
    with pytest.raises(CheckpointException, match="not the one this checkpoint committed"):
        dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(small_dcp), no_dist=True)
    with pytest.raises(CorruptCheckpointError, match="not the one this checkpoint committed"):
        ndcp.verify_dcp(small_dcp)
    with pytest.raises(CorruptCheckpointError, match="not the one this checkpoint committed"):
        ndcp.decompress_dcp(small_dcp, tmp_path / "out")
    file = small_dcp / name
    file.write_bytes(file.read_bytes() + b"\0")
    with pytest.raises(CheckpointException, match="bytes, the manifest says") as info:
        dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(small_dcp), no_dist=True)
    (error, _), = info.value.failures.values()
    assert isinstance(error, CorruptCheckpointError)


def _write_legacy_checksum(path: Path) -> None:
    """What nvcomp_ckpt_engine 0.1 wrote instead of the manifest (byte for byte its format)."""
    import hashlib

    data = (path / ".metadata").read_bytes()
    record = {"format": "nvcomp_ckpt_engine.dcp_metadata", "version": 1, "file": ".metadata",
              "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / ".metadata.nvcomp.json").write_text(json.dumps(record, sort_keys=True) + "\n")


def test_a_folder_saved_before_the_manifest_is_still_read(small_dcp, tmp_path):
    """A checksum file beside `.metadata` and no manifest: read, verified and decompressed,
    `.metadata` checked against the checksum file; any flipped bit of either is found."""
    (small_dcp / "nvcomp_manifest.json").unlink()
    _write_legacy_checksum(small_dcp)
    assert ndcp.dcp_faults(small_dcp) == []
    loaded = {"w": torch.zeros(64), "b": torch.zeros(10, dtype=torch.int64), "step": None,
              "cfg": {"lr": None}}
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(small_dcp), no_dist=True)
    assert loaded["step"] == 3 and torch.equal(loaded["b"], torch.arange(10))
    ndcp.decompress_dcp(small_dcp, tmp_path / "plain")
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [".metadata", "__0_0.distcp"]
    for name in (".metadata", ".metadata.nvcomp.json"):
        original = (small_dcp / name).read_bytes()
        for bit in range(0, len(original) * 8, 7):
            damaged = bytearray(original)
            damaged[bit // 8] ^= 1 << (bit % 8)
            (small_dcp / name).write_bytes(bytes(damaged))
            faults = ndcp.dcp_faults(small_dcp)
            assert len(faults) == 1 and isinstance(faults[0], CorruptCheckpointError), (name, bit)
            with pytest.raises(CorruptCheckpointError):
                ndcp.NvcompFileSystemReader(small_dcp).read_metadata()
        (small_dcp / name).write_bytes(original)
    (small_dcp / ".metadata.nvcomp.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no nvcomp_manifest.json and no"):
        ndcp.verify_dcp(small_dcp)


@pytest.mark.parametrize("damage", ["nested", "folder"])
def test_a_hostile_older_checksum_file_is_a_corrupt_checkpoint(small_dcp, damage):
    """JSON nested past Python's recursion limit, or a folder in the checksum file's place: a
    `CorruptCheckpointError` naming it, never a RecursionError or IsADirectoryError."""
    (small_dcp / "nvcomp_manifest.json").unlink()
    sidecar = small_dcp / ".metadata.nvcomp.json"
    if damage == "nested":
        sidecar.write_text("[" * 100_000 + "]" * 100_000)
    else:
        sidecar.mkdir()
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata\.nvcomp\.json"):
        ndcp.verify_dcp(small_dcp)
    faults = ndcp.dcp_faults(small_dcp)
    assert len(faults) == 1 and isinstance(faults[0], CorruptCheckpointError)


def _readers_of_the_metadata(folder: Path) -> list:
    """Every path that reads a DCP folder's `.metadata`: the tools, and `dcp.load`'s reader."""
    return [lambda: ndcp.read_metadata(folder), lambda: ndcp.verify_dcp(folder),
            lambda: ndcp.NvcompFileSystemReader(folder).read_metadata()]


@pytest.mark.parametrize("record", ["manifest", "older checksum file", "none"])
def test_a_sparse_metadata_far_larger_than_its_record_is_refused_unread(small_dcp, tmp_path,
                                                                         record, monkeypatch):
    """`.metadata` made sparse, 64 MiB for a record of about 1 KB (a folder's manifest, an older
    version's checksum file; or, in a folder DCP's own writer saved, with no record, past the
    size read without one): refused by its size from fstat before a byte is read. The readers
    read the whole file first (256 MiB of memory for a 256 MiB hole; MemoryError at 16 GiB)."""
    import tracemalloc

    folder = small_dcp
    if record == "older checksum file":
        (folder / "nvcomp_manifest.json").unlink()
        _write_legacy_checksum(folder)
    elif record == "none":
        folder = tmp_path / "stock"
        dcp.save({"w": torch.randn(8)}, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
        monkeypatch.setattr(ndcp.integrity, "MAX_UNRECORDED_METADATA_BYTES", 1 << 20,
                            raising=False)
    os.truncate(folder / ".metadata", 64 << 20)
    for read in _readers_of_the_metadata(folder):
        tracemalloc.start()
        try:
            with pytest.raises(CorruptCheckpointError, match=r"\.metadata: 67108864 bytes, more "
                               r"than the .*refused unread"):
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"{peak} bytes allocated to refuse it"
    assert len(ndcp.dcp_faults(folder)) == 1


def test_a_save_without_collectives_is_refused(tmp_path):
    with pytest.raises(UnsupportedCheckpointError, match="collectives"):
        dcp.save({"w": torch.ones(2)}, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c"),
                 no_dist=True, use_collectives=False)


def _hostile_metadata(small_dcp: Path) -> dict[str, bytes]:
    """Pickles a damaged or hostile `.metadata` might hold, each passing the allowlist."""
    good = ndcp.read_metadata(small_dcp)
    records = dict(good.storage_data)
    index = next(iter(records))
    return {
        "not a pickle": b"not a pickle",
        "truncated": (small_dcp / ".metadata").read_bytes()[:-9],
        "a list": pickle.dumps([1, 2]),
        "items not a dict": pickle.dumps(type(good)(state_dict_metadata=5, storage_data={})),
        "record path not a string": pickle.dumps(type(good)(
            state_dict_metadata=good.state_dict_metadata,
            storage_data={**records, index: ndcp.ItemLocation(7, "w")})),
        "record key not a string": pickle.dumps(type(good)(
            state_dict_metadata=good.state_dict_metadata,
            storage_data={**records, index: ndcp.ItemLocation(records[index].relative_path, None)})),
        "chunk offsets not integers": pickle.dumps(type(good)(
            state_dict_metadata={**good.state_dict_metadata, "w": dataclasses_replace(
                good.state_dict_metadata["w"], chunks=[ChunkStorageMetadata(
                    offsets=("x",), sizes=torch.Size([64]))])},
            storage_data=records)),
        "overflowing timedelta": b"\x80\x02cdatetime\ntimedelta\nL10000000000L\n\x85R.",
        "record outside the folder": pickle.dumps(type(good)(
            state_dict_metadata=good.state_dict_metadata,
            storage_data={k: ndcp.ItemLocation("../elsewhere.distcp", v.key) if k == index else v
                          for k, v in records.items()})),
    }


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_a_bad_pickle_with_a_matching_manifest_is_one_fault_line(small_dcp, capsys):
    for name, data in _hostile_metadata(small_dcp).items():
        (small_dcp / ".metadata").write_bytes(data)
        reseal(small_dcp)
        faults = ndcp.dcp_faults(small_dcp)
        assert len(faults) == 1 and isinstance(faults[0], CorruptCheckpointError), (name, faults)
        assert ".metadata" in str(faults[0]), (name, faults)
        status, lines, output = _cli_verify(small_dcp, capsys)
        assert status == 1 and len(lines) == 1 and "Traceback" not in output, (name, output)


def test_rank_files_are_checked_one_by_one(small_dcp, capsys):
    """Two rank files, both damaged: two FAULT lines; a link out of the folder is not read."""
    path = small_dcp.parent / "two"
    dcp.save({"a": torch.randn(32), "b": torch.randn(32)}, no_dist=True,
             storage_writer=ndcp.NvcompFileSystemWriter(path, chunk_mb=CHUNK_MB))
    (shard,) = [p for p in path.iterdir() if p.name.endswith(ndcp.SHARD_SUFFIX)]
    metadata = pickle.loads((path / ".metadata").read_bytes())
    second = shard.with_name("__1_0" + ndcp.SHARD_SUFFIX)
    shutil.copy(shard, second)
    metadata.storage_data = {k: ndcp.ItemLocation(second.name if k.fqn == "b" else v.relative_path,
                                                  v.key) for k, v in metadata.storage_data.items()}
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path)
    assert ndcp.dcp_faults(path) == []
    for file in (shard, second):
        file.write_bytes(file.read_bytes()[:-50])
    status, lines, _ = _cli_verify(path, capsys)
    assert status == 1 and [shard.name in lines[0], second.name in lines[1]] == [True, True]
    outside = small_dcp.parent / "outside"
    outside.mkdir()
    second.rename(outside / second.name)
    second.symlink_to(outside / second.name)
    faults = ndcp.dcp_faults(path)
    assert len(faults) == 1 and "outside the checkpoint directory" in str(faults[0]), faults
    with pytest.raises(CorruptCheckpointError, match="outside the checkpoint directory"):
        ndcp.decompress_dcp(path, small_dcp.parent / "out")


def test_decompress_copies_no_file_a_link_names_outside(small_dcp, tmp_path):
    (tmp_path / "secret.txt").write_text("private")
    (small_dcp / "notes.txt").symlink_to(tmp_path / "secret.txt")
    ndcp.decompress_dcp(small_dcp, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [".metadata", "__0_0.distcp"], names


# ------------------------------------ `.metadata` forged with a matching manifest runs no code


class _RunsOnUnpickling:
    """Pickles as a call of `func(*args)`: what a forger puts in `.metadata`."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _forged_metadata(small_dcp: Path, marker: Path) -> dict[str, bytes]:
    """`.metadata` pickles that create `marker` if unpickled by plain pickle: a bare call of
    `os.system` and of `open`, and a real Metadata carrying such a call in a field."""
    good = ndcp.read_metadata(small_dcp)
    inside = dataclasses_replace(good, planner_data=_RunsOnUnpickling(os.system, f"touch {marker}"))
    return {
        "os.system": pickle.dumps(_RunsOnUnpickling(os.system, f"touch {marker}")),
        "builtins.open": pickle.dumps(_RunsOnUnpickling(open, str(marker), "w")),
        "inside a real Metadata": pickle.dumps(inside),
    }


def _metadata_load_failure(small_dcp: Path) -> str:
    """What `dcp.load` through our reader says: DCP catches `read_metadata`'s error and raises
    its own `CheckpointException`, with the error's text in the rank's failure."""
    state = {"w": torch.zeros(64), "b": torch.zeros(10, dtype=torch.int64), "step": None,
             "cfg": {"lr": None}}
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=ndcp.NvcompFileSystemReader(small_dcp), no_dist=True)
    return str(info.value.failures[0][0])


@pytest.mark.parametrize("checksum", ["manifest", "older checksum file"])
def test_a_forged_metadata_with_a_matching_checksum_runs_no_code(small_dcp, tmp_path, checksum):
    """The reader unpickles the bytes it checked through the allowlist, never by plain pickle
    (DCP's own read): a forger who recomputes the checksum still cannot run code."""
    marker = tmp_path / "ran"
    forged = _forged_metadata(small_dcp, marker)
    if checksum == "older checksum file":
        (small_dcp / "nvcomp_manifest.json").unlink()
    for name, data in forged.items():
        (small_dcp / ".metadata").write_bytes(data)
        reseal(small_dcp) if checksum == "manifest" else _write_legacy_checksum(small_dcp)
        with pytest.raises(UnsafeObjectError) as info:
            ndcp.NvcompFileSystemReader(small_dcp).read_metadata()
        assert str(small_dcp / ".metadata") in str(info.value), name
        failure = _metadata_load_failure(small_dcp)
        assert f"{small_dcp / '.metadata'}: the file's skeleton names" in failure, (name, failure)
        assert not marker.exists(), name


def test_the_reader_returns_the_metadata_dcp_would(small_dcp):
    """The allowlisted read gives what DCP's own read gives, with its load id set."""
    reader = ndcp.NvcompFileSystemReader(small_dcp)
    reader.reset()
    ours = reader.read_metadata()
    stock = torch.distributed.checkpoint.FileSystemReader(small_dcp)
    stock.load_id = reader.load_id
    assert ours == stock.read_metadata()
    assert ours.storage_meta.load_id == reader.load_id


# ------------------------------------------------- bytes items: no code from a value's pickle


def _planted_bytes_item(path: Path, marker: Path, writer) -> None:
    """A DCP checkpoint whose bytes item ``cfg/hook`` is a pickle that creates `marker` when
    DCP's planner unpickles it (``torch.load(weights_only=False)``): saved through the writer
    itself, so its manifest, CRCs and metadata are all as a real save leaves them."""
    state = {"w": torch.randn(8), "step": 3,
             "cfg": {"lr": 0.1, "hook": _RunsOnUnpickling(os.system, f"touch {marker}")}}
    dcp.save(state, storage_writer=writer(path), no_dist=True)


def _load_state() -> dict:
    return {"w": torch.zeros(8), "step": None, "cfg": {"lr": None, "hook": None}}


@pytest.mark.parametrize("writer", ["ours", "stock"])
def test_a_bytes_item_naming_a_code_running_global_runs_no_code(tmp_path, writer):
    """DCP's planner unpickles bytes items without restriction; the reader hands it only what
    the allowlist read from them, so a planted `os.system` is refused, naming the file and the
    item, in our files and in DCP's own (a folder saved before compression was turned on)."""
    marker = tmp_path / "ran"
    make = ((lambda p: ndcp.NvcompFileSystemWriter(p, chunk_mb=CHUNK_MB)) if writer == "ours"
            else dcp.FileSystemWriter)
    _planted_bytes_item(tmp_path / "ckpt", marker, make)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_load_state(), storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "ckpt"),
                 no_dist=True)
    failure = info.value.failures[0][0]
    assert isinstance(failure, UnsafeObjectError), failure
    assert "posix.system" in str(failure) and "'cfg.hook'" in str(failure), str(failure)
    assert str(tmp_path / "ckpt") in str(failure), str(failure)
    assert not marker.exists()


def test_verify_and_decompress_refuse_a_planted_bytes_item(tmp_path, capsys):
    """`verify` reads each bytes item through the allowlist (it said OK before), and
    `decompress` will not hand such an item to stock DCP, which would unpickle it freely;
    ``--trusted`` lets `decompress` copy it as it is."""
    marker, path = tmp_path / "ran", tmp_path / "ckpt"
    _planted_bytes_item(path, marker, lambda p: ndcp.NvcompFileSystemWriter(p, chunk_mb=CHUNK_MB))
    status, faults, _ = _cli_verify(path, capsys)
    assert status == 1 and len(faults) == 1, faults
    assert "__0_0.nvcomp.distcp: item 'cfg.hook'" in faults[0] and "posix.system" in faults[0]
    with pytest.raises(UnsafeObjectError, match=r"__0_0\.nvcomp\.distcp: item 'cfg\.hook'"):
        ndcp.decompress_dcp(path, tmp_path / "plain")
    ndcp.decompress_dcp(path, tmp_path / "trusted", trusted=True)
    assert not marker.exists()


def test_bytes_items_load_as_saved_through_the_allowlist(tmp_path):
    """What the allowlist reads and saves again is what was saved: plain values, numpy arrays,
    bytes, and a tensor inside a value (storage sharing kept)."""
    import numpy as np

    shared = torch.arange(12.0)
    value = {"step": 7, "name": "run", "raw": b"\x00\xff", "rng": np.arange(5, dtype=np.uint32),
             "pair": (shared[:4], shared.view(3, 4).t()), "none": None}
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.randn(4), "value": value},
             storage_writer=ndcp.NvcompFileSystemWriter(path, chunk_mb=CHUNK_MB), no_dist=True)
    ndcp.verify_dcp(path)
    state = {"w": torch.zeros(4), "value": dict.fromkeys(value)}
    dcp.load(state, storage_reader=ndcp.NvcompFileSystemReader(path), no_dist=True)
    got = state["value"]
    assert {k: got[k] for k in ("step", "name", "raw", "none")} == {
        "step": 7, "name": "run", "raw": b"\x00\xff", "none": None}
    assert got["rng"].dtype == np.uint32 and got["rng"].tolist() == list(range(5))
    assert torch.equal(got["pair"][0], shared[:4]) and torch.equal(got["pair"][1], shared.view(3, 4).t())
    assert got["pair"][0].untyped_storage().data_ptr() == got["pair"][1].untyped_storage().data_ptr()
