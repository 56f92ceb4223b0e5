"""Storages derived from other files of a checkpoint (shard format 2), in one process.

A file may leave spans of a storage to elements of a tensor of another file beside it, cast
(the DeepSpeed ZeRO-1/2 module, rebuilt from the fp32 master partitions). These tests write such
files by hand with `save(..., derive=...)` and check that every reader rebuilds them bit-exact,
that everything a hostile or incomplete folder can do is a clear error, and that the save-time
check refuses what a cast would not reproduce.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli, container, derived, manifest
from nvcomp_ckpt_engine.container import DerivedRange

from conftest import assert_same_tensor

KEY = "optimizer_state_dict/single_partition_of_fp32_groups/0"


def _optimizer_file(folder: Path, name: str, master: torch.Tensor) -> Path:
    path = folder / name
    nce.save({"optimizer_state_dict": {"single_partition_of_fp32_groups": [master]}}, path, algorithm="zstd")
    return path


def _from_partitions(flat: torch.Tensor, names: list[str], size: int):
    """A `derive` callback for views of `flat` whose partition k of `size` elements is the
    source tensor of file names[k]."""

    def derive(t: torch.Tensor) -> list[derived.Piece]:
        if t.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            return []
        lo = t.storage_offset() - flat.storage_offset()
        pieces = []
        for k in range(lo // size, (lo + t.numel() - 1) // size + 1):
            a, b = max(lo, k * size), min(lo + t.numel(), (k + 1) * size)
            pieces.append(derived.Piece(a - lo, b - a, names[k], KEY, a - k * size))
        return pieces

    return derive


@pytest.fixture(params=[torch.bfloat16, torch.float16, torch.float32], ids=str)
def module_folder(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict, torch.dtype]:
    """Two "optimizer shards" holding halves of an fp32 master, and a "module" file whose
    parameters (views of one flat buffer, as ZeRO's) are the master cast."""
    dtype = request.param
    master = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    names = [f"zero_pp_rank_{k}_optim_states.pt" for k in range(2)]
    for k, name in enumerate(names):
        _optimizer_file(tmp_path, name, master[500 * k : 500 * (k + 1)].clone())
    flat = master.to(dtype)
    module = {"w": flat[:600].view(20, 30), "b": flat[600:990], "tied": flat[:600].view(20, 30),
              "buffer": torch.arange(7)}
    state = {"module": module, "step": 3}
    nce.save(state, tmp_path / "model_states.pt", derive=_from_partitions(flat, names, 500), algorithm="zstd")
    return tmp_path, state, dtype


def test_derived_module_is_rebuilt_bit_exact_and_keeps_sharing(module_folder) -> None:
    folder, state, dtype = module_folder
    index = container.read_index(folder / "model_states.pt")
    assert index.format_version == 4
    (flat_storage,) = [s for s in index.storages if s.derived]
    assert flat_storage.stored_nbytes == 0 and [r.count for r in flat_storage.derived] == [500, 490]
    loaded = nce.load(folder / "model_states.pt")
    for key, tensor in state["module"].items():
        assert_same_tensor(tensor, loaded["module"][key], key)
    assert loaded["module"]["w"].data_ptr() == loaded["module"]["tied"].data_ptr()
    assert loaded["module"]["w"].untyped_storage().data_ptr() == loaded["module"]["b"].untyped_storage().data_ptr()


def test_a_span_partly_derived_stores_the_rest(tmp_path: Path) -> None:
    master = torch.randn(64)
    _optimizer_file(tmp_path, "opt.pt", master)
    flat = master.to(torch.bfloat16)
    flat[10:20] += 1  # these no longer equal the master: the caller gives no piece for them

    def derive(t: torch.Tensor) -> list[derived.Piece]:
        lo = t.storage_offset()
        return [] if 10 <= lo < 20 else [derived.Piece(0, t.numel(), "opt.pt", KEY, lo)]

    state = {"a": flat[:10], "b": flat[10:20], "c": flat[20:64]}
    nce.save(state, tmp_path / "m.pt", derive=derive, algorithm="deflate")
    (entry,) = container.read_index(tmp_path / "m.pt").storages
    assert entry.stored_pieces() == [(20, 40)] and entry.stored_nbytes == 20
    loaded = nce.load(tmp_path / "m.pt")
    for key in state:
        assert_same_tensor(state[key], loaded[key], key)


def test_files_without_derived_storages_stay_version_1(tmp_path: Path) -> None:
    nce.save({"w": torch.randn(10)}, tmp_path / "plain.pt", derive=lambda t: [])
    assert container.read_index(tmp_path / "plain.pt").format_version == 1


def test_sources_may_live_under_other_names(module_folder, tmp_path_factory) -> None:
    folder, state, _ = module_folder
    elsewhere = tmp_path_factory.mktemp("staged")
    moved = {}
    for k in range(2):
        name = f"zero_pp_rank_{k}_optim_states.pt"
        moved[name] = elsewhere / f"{name}.staged"
        (folder / name).rename(moved[name])
    with pytest.raises(nce.IncompleteCheckpointError, match="zero_pp_rank_0_optim_states.pt.*decompress"):
        nce.load(folder / "model_states.pt")
    loaded = nce.load(folder / "model_states.pt", sources=moved)
    assert_same_tensor(state["module"]["b"], loaded["module"]["b"])


def test_a_source_without_the_tensor_is_corruption(module_folder) -> None:
    folder, _, _ = module_folder
    nce.save({"other": torch.randn(500)}, folder / "zero_pp_rank_1_optim_states.pt")
    with pytest.raises(nce.CorruptCheckpointError, match=f"{KEY}.*zero_pp_rank_1_optim_states.pt"):
        nce.load(folder / "model_states.pt")


def test_a_source_too_short_is_corruption(module_folder) -> None:
    folder, _, _ = module_folder
    _optimizer_file(folder, "zero_pp_rank_1_optim_states.pt", torch.randn(100))
    with pytest.raises(nce.CorruptCheckpointError, match=r"elements \[0, 490\).*100 elements"):
        nce.load(folder / "model_states.pt")


def _reseal_index(path: Path, edit) -> None:
    """Apply `edit` to a shard's JSON index and rewrite the trailer so only the edit differs."""
    data = path.read_bytes()
    offset, length, _, version, end = struct.unpack("<QQII8s", data[-32:])
    index = json.loads(data[offset : offset + length])
    edit(index)
    body = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
    path.write_bytes(data[:offset] + body + struct.pack("<QQII8s", offset, len(body), zlib.crc32(body), version, end))


def _derived_storage(index: dict) -> dict:
    return next(s for s in index["storages"] if "derived" in s)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s["derived"][0].update(file="../zero_pp_rank_0_optim_states.pt"), "not a plain file name"),
    (lambda s: s["derived"][0].update(file="/etc/passwd"), "not a plain file name"),
    (lambda s: s["derived"][1].update(at=2), "overlap"),
    (lambda s: s["derived"][1].update(count=10**9), "overlap the previous range or leave"),
    (lambda s: s["derived"][0].update(count=0), "count"),
    (lambda s: s["derived"][0].update(extra=1), "keys"),
    (lambda s: s.update(derived=[]), "non-empty"),
    (lambda s: s["derived"].pop(), "chunks decode to"),
])
def test_hostile_derived_ranges_are_refused(module_folder, edit, message) -> None:
    folder, _, _ = module_folder
    path = folder / "model_states.pt"
    _reseal_index(path, lambda index: edit(_derived_storage(index)))
    with pytest.raises(nce.CorruptCheckpointError, match=message):
        nce.load(path)


def test_a_derived_range_larger_than_its_source_is_refused_before_allocating(
    module_folder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage whose last derived range asks for 2^36 more elements than its source holds
    (a small file declaring a 128+ GiB storage) is refused from the indexes alone: the
    reader never gets to allocate it."""
    from nvcomp_ckpt_engine import pipeline

    folder, _, dtype = module_folder
    path = folder / "model_states.pt"
    extra = 1 << 36

    def enlarge(index: dict) -> None:
        storage = _derived_storage(index)
        storage["derived"][-1]["count"] += extra
        storage["nbytes"] += extra * dtype.itemsize

    _reseal_index(path, enlarge)
    monkeypatch.setattr(pipeline, "read_shard", lambda *a, **k: pytest.fail("the storage was read"))
    with pytest.raises(nce.CorruptCheckpointError, match=r"elements \[0, \d+\).*500 elements"):
        nce.load(path)


def test_derived_ranges_in_a_version_1_file_are_refused(module_folder) -> None:
    folder, _, _ = module_folder
    path = folder / "model_states.pt"
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, container.MAGIC_OFFSET + 8, 1)
    struct.pack_into("<I", data, len(data) - 12, 1)
    path.write_bytes(bytes(data))
    _reseal_index(path, lambda index: index.update(format_version=1))
    with pytest.raises(nce.CorruptCheckpointError, match="keys"):
        nce.load(path)


def test_same_after_cast_is_exact_and_refuses_nan() -> None:
    source = torch.randn(1000)
    target = source.to(torch.bfloat16)
    assert derived.same_after_cast(target, source)
    nudged = target.clone()
    nudged.view(torch.int16)[123] += 1  # one unit in the last place
    assert not derived.same_after_cast(nudged, source)
    with_nan = source.clone()
    with_nan[5] = float("nan")
    assert not derived.same_after_cast(with_nan.to(torch.bfloat16), with_nan)  # the cast's NaN bits vary
    assert derived.same_after_cast(with_nan.clone(), with_nan)  # no cast: the bits are the bits
    with pytest.raises(ValueError, match="1-D"):
        derived.same_after_cast(target.view(10, 100), source)


def test_overlapping_ranges_leave_the_span_stored() -> None:
    a = DerivedRange(0, 4, "bfloat16", "f", "k", 0)
    assert derived.merge_ranges([a, a]) == [a]
    assert derived.merge_ranges([a, DerivedRange(8, 2, "bfloat16", "f", "k", 4)]) == [
        DerivedRange(0, 6, "bfloat16", "f", "k", 0)]
    assert derived.merge_ranges([a, DerivedRange(6, 4, "bfloat16", "f", "k", 9)]) is None


def _tag_with_manifest(folder: Path) -> None:
    records = [
        manifest.ShardRecord(path=p.name, rank=0, raw_bytes=container.read_index(p).raw_bytes,
                             file_bytes=p.stat().st_size, crc32=container.read_index(p).crc32, codecs=("zstd",))
        for p in sorted(folder.iterdir()) if nce.is_shard_file(p)
    ]
    manifest.write_manifest(folder, manifest.build_manifest(
        tag=folder.name, world_size=1, files=records, layout={"framework": "torch"}, versions={},
        step=None, created_unix_ns=0))


def test_cli_verify_decompress_and_inspect_rebuild_and_check_sources(module_folder, tmp_path_factory, capsys) -> None:
    folder, state, _ = module_folder
    _tag_with_manifest(folder)
    assert cli.main(["verify", "-q", str(folder)]) == 0
    out = tmp_path_factory.mktemp("plain") / "out"
    assert cli.main(["decompress", "-q", str(folder), str(out)]) == 0
    plain = torch.load(out / folder.name / "model_states.pt", weights_only=True)
    for key, tensor in state["module"].items():
        assert_same_tensor(tensor, plain["module"][key], key)
    capsys.readouterr()
    assert cli.main(["inspect", "--json", str(folder)]) == 0
    doc = json.loads(capsys.readouterr().out)
    (module,) = [f for f in doc["files"] if f["path"] == "model_states.pt"]
    assert module["derived_from"] == ["zero_pp_rank_0_optim_states.pt", "zero_pp_rank_1_optim_states.pt"]
    assert module["derived_bytes"] == 990 * state["module"]["b"].element_size()
    _optimizer_file(folder, "zero_pp_rank_0_optim_states.pt", torch.randn(10))
    assert cli.main(["verify", "-q", str(folder)]) == 1
    assert "elements [0, 500)" in capsys.readouterr().out
