"""`nvcomp-ckpt to-universal` and the pieces under it, in one process.

The checkpoints here are built by hand in DeepSpeed 0.19's ZeRO-2 layout (what its
`save_checkpoint` writes: rank-wise flat fp32 partitions, `param_slice_mappings`, the model
states with `param_shapes`), as plain torch files and then compressed with `nvcomp-ckpt
compress`, so that DeepSpeed's own ds_to_universal can read the plain ones: what it writes is
the reference for what `to-universal` writes from the compressed ones. The checkpoints of real
training runs, resumed at other sizes, are tests/test_elastic.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli, container, manifest, state
from nvcomp_ckpt_engine.compat import TorchLoadOfShardError
from nvcomp_ckpt_engine.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeObjectError,
    UnsupportedCheckpointError,
)
from nvcomp_ckpt_engine.lazy import LazyShard, TensorRef
from nvcomp_ckpt_engine.tagreader import TagReader

from conftest import assert_same_tensor, raw_bytes
from test_cli import assert_same_object

ROOT = Path(__file__).resolve().parents[1]
TAG = "global_step7"
MODEL = "mp_rank_00_model_states.pt"


def optim_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


# ------------------------------------------------------------------ a DeepSpeed-layout checkpoint


def zero2_checkpoint(save_dir: Path, *, dp: int, shapes: dict[str, tuple[int, ...]],
                     extra_module: dict[str, torch.Tensor] | None = None, seed: int = 0) -> Path:
    """A plain ZeRO-2 checkpoint of `shapes` (one param group) at data-parallel size `dp`, as
    DeepSpeed 0.19 saves it: each rank holds an equal slice (the last one padded) of the flat
    fp32 master weights and Adam moments. `extra_module` holds what has no optimizer state
    (frozen parameters, buffers). Returns the tag folder."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    generator = torch.Generator().manual_seed(seed)
    total = sum(math.prod(shape) for shape in shapes.values())
    per_rank = math.ceil(total / dp)
    padded = per_rank * dp
    flat = {key: torch.randn(padded, generator=generator) for key in ("fp32", "exp_avg", "exp_avg_sq")}
    flat["exp_avg_sq"] = flat["exp_avg_sq"].abs()
    tag_dir = save_dir / TAG
    tag_dir.mkdir(parents=True)
    for rank in range(dp):
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        mapping, offset = OrderedDict(), 0
        for name, shape in shapes.items():
            start, end = max(offset, lo), min(offset + math.prod(shape), hi)
            if start < end:
                mapping[name] = fragment_address(numel=end - start, start=start - lo)
            offset += math.prod(shape)
        padding = max(0, hi - total)
        state = {
            "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": 1.0,
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(7.0), "exp_avg": flat["exp_avg"][lo:hi].clone(),
                              "exp_avg_sq": flat["exp_avg_sq"][lo:hi].clone()}},
                "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "params": [0]}],
            },
            "single_partition_of_fp32_groups": [flat["fp32"][lo:hi - padding].clone()],
            "zero_stage": ZeroStageEnum.gradients, "group_paddings": [padding],
            "param_alignment_paddings": [[0] * len(shapes)], "partition_count": [dp],
            "ds_version": "0.19.8", "param_slice_mappings": [mapping],
        }
        torch.save({"optimizer_state_dict": state, "ds_config": {}, "ds_version": "0.19.8"},
                   tag_dir / optim_name(rank))
    module, offset = OrderedDict(), 0
    for name, shape in shapes.items():
        module[name] = flat["fp32"][offset:offset + math.prod(shape)].view(shape).to(torch.bfloat16)
        offset += math.prod(shape)
    module.update(extra_module or {})
    torch.save({
        "module": module, "buffer_names": [], "optimizer": None,
        "param_shapes": [OrderedDict((name, torch.Size(shape)) for name, shape in shapes.items())],
        "frozen_param_shapes": OrderedDict(), "shared_params": {}, "lr_scheduler": {},
        "skipped_steps": 0, "global_steps": 7, "global_samples": 56, "dp_world_size": dp,
        "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {}, "ds_version": "0.19.8",
    }, tag_dir / MODEL)
    (save_dir / "latest").write_text(TAG)
    return tag_dir


def compressed(plain: Path, out: Path, *extra: str) -> Path:
    assert cli.main(["compress", "-q", "--trusted", *extra, str(plain), str(out)]) == 0
    return out


def ds_to_universal(tag_dir: Path, out_tag: Path) -> None:
    """DeepSpeed's converter, in this process, with few workers, as its command line runs it."""
    from deepspeed.checkpoint import ds_to_universal as converter

    converter.main(argparse.Namespace(
        input_folder=str(tag_dir), output_folder=str(out_tag), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))


def universal_files(folder: Path) -> list[str]:
    """The files of a universal checkpoint, the engine's own bookkeeping left out."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                  and p.name not in (manifest.MANIFEST_NAME, manifest.TAG_MARKER_NAME))


def assert_same_universal(deepspeeds: Path, ours: Path) -> int:
    """Our universal checkpoint holds DeepSpeed's files, each one of our shards holding the same
    object, tensor for tensor; returns how many tensors were compared."""
    assert universal_files(ours) == universal_files(deepspeeds)
    compared = 0
    for relative in universal_files(deepspeeds):
        if not relative.endswith(".pt"):
            assert (ours / relative).read_bytes() == (deepspeeds / relative).read_bytes(), relative
            continue
        assert nce.is_shard_file(ours / relative), relative
        expected = torch.load(deepspeeds / relative, map_location="cpu", weights_only=False)
        assert_same_object(expected, nce.load(ours / relative, map_location="cpu"), relative)
        compared += len(state.flatten(expected).tensors)
    return compared


SHAPES = {"embed.weight": (37, 16), "block.weight": (16, 16), "block.bias": (16,),
          "head.weight": (5, 16)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved at 3 ranks (uneven: 941 elements), with a frozen weight and a buffer."""
    save_dir = tmp_path_factory.mktemp("plain") / "checkpoints"
    zero2_checkpoint(save_dir, dp=3, shapes=SHAPES, extra_module={
        "frozen.weight": torch.full((4, 4), 0.5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
    })
    return save_dir


@pytest.fixture(scope="module")
def engine_ckpt(plain: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compressed(plain, tmp_path_factory.mktemp("engine") / "checkpoints", "--chunk-mb", "0.001")


# ------------------------------------------------------------------------------ LazyShard


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors over many 1 KiB chunks: fp32, bf16, a transposed view, a 0-d step, bools."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 48, generator=g)
    obj = {"flat": torch.randn(5000, generator=g), "half": torch.randn(3001, generator=g).bfloat16(),
           "t": base.t(), "step": torch.tensor(3.0), "mask": torch.rand(999, generator=g) > 0.5,
           "n": 7}
    path = tmp_path / "shard.pt"
    nce.save(obj, path, algorithm="zstd", chunk_mb=1 / 1024)
    return path, obj


@pytest.mark.parametrize("key, ranges", [
    ("flat", [(0, 5000), (0, 1), (255, 2), (256, 256), (1000, 3001), (4999, 1), (17, 0)]),
    ("half", [(0, 3001), (511, 514), (3000, 1)]),
    ("mask", [(0, 999), (500, 300)]),
    ("t", [(0, 64 * 48), (47, 100)]),
])
def test_a_range_read_is_the_loaded_tensor_s_range(shard: Any, key: str, ranges: list) -> None:
    path, obj = shard
    with LazyShard(path) as lazy:
        ref = lazy.obj[key]
        assert isinstance(ref, TensorRef) and ref.shape == tuple(obj[key].shape)
        assert lazy.obj["n"] == 7
        flat = obj[key].reshape(-1)
        for start, numel in ranges:
            got = lazy.read(ref, start, numel)
            assert torch.equal(raw_bytes(got), raw_bytes(flat[start:start + numel])), (start, numel)
        assert_same_tensor(lazy.read_tensor(ref), obj[key].contiguous(), key)
        with pytest.raises(ValueError, match="outside tensor"):
            lazy.read(ref, ref.numel, 1)


def test_a_range_read_decodes_only_its_chunks(shard: Any) -> None:
    """A damaged chunk fails exactly the reads that need it, naming the tensor."""
    path, obj = shard
    index = container.read_index(path)
    entry = next(t for t in index.tensors if t.key == "flat")
    blob = index.storages[entry.storage].chunks[2]  # bytes 2048..3071: elements 512..767
    data = bytearray(path.read_bytes())
    data[blob.offset + blob.length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with LazyShard(path) as lazy:
        ref = lazy.obj["flat"]
        assert torch.equal(lazy.read(ref, 0, 512), obj["flat"][:512])
        assert torch.equal(lazy.read(ref, 768, 100), obj["flat"][768:868])
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in tensor 'flat'.*chunk 2"):
            lazy.read(ref, 500, 20)


def test_a_copy_keeps_the_stored_bytes(shard: Any, tmp_path: Path) -> None:
    path, obj = shard
    with LazyShard(path) as lazy:
        info = lazy.copy({"kept": lazy.obj["half"], "again": lazy.obj["half"], "step": lazy.obj["step"],
                          "note": "copied"}, tmp_path / "copy.pt")
        with pytest.raises(TypeError, match="found a tensor"):
            lazy.copy({"new": torch.zeros(2)}, tmp_path / "bad.pt")
    loaded = nce.load(tmp_path / "copy.pt")
    assert_same_tensor(loaded["kept"], obj["half"], "kept")
    assert loaded["again"] is loaded["kept"] and loaded["note"] == "copied"
    assert_same_tensor(loaded["step"], obj["step"], "step")
    source, copy = container.read_index(path), container.read_index(tmp_path / "copy.pt")
    half = source.storages[next(t.storage for t in source.tensors if t.key == "half")]
    assert copy.storages[0].chunks and [c.crc32 for c in copy.storages[0].chunks] == [
        c.crc32 for c in half.chunks]
    assert (info.file_bytes, info.crc32) == (copy.file_bytes, copy.crc32)
    assert not (tmp_path / "bad.pt").exists()


def test_another_shard_s_ref_is_refused(shard: Any, tmp_path: Path) -> None:
    path, obj = shard
    other = tmp_path / "other.pt"
    nce.save({"flat": torch.zeros(3)}, other)
    with LazyShard(path) as lazy, LazyShard(other) as foreign:
        with pytest.raises(ValueError, match="is not a tensor of"):
            lazy.read(foreign.obj["flat"])


def test_the_skeleton_goes_through_the_allowlist(tmp_path: Path) -> None:
    path = tmp_path / "ns.pt"
    nce.save({"args": argparse.ArgumentParser}, path)  # a class no checkpoint needs
    with pytest.raises(UnsafeObjectError, match="argparse.ArgumentParser"):
        LazyShard(path)


# ------------------------------------------------------------------------------ TagReader


def test_the_tag_reader_refuses_what_every_load_refuses(engine_ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "checkpoints"
    shutil.copytree(engine_ckpt, copy)
    reader = TagReader(copy / TAG)
    assert reader.paths == sorted([MODEL, *(optim_name(r) for r in range(3))])
    assert reader.load(MODEL)["global_steps"] == 7
    # A manifest that records another CRC for one file: the file is not the one it committed.
    found = reader.manifest
    files = [dataclasses.replace(r, crc32=r.crc32 ^ 1) if r.path == optim_name(1) else r
             for r in found.files]
    manifest.write_manifest(copy / TAG, dataclasses.replace(found, files=tuple(files)))
    reader = TagReader(copy / TAG)
    with pytest.raises(CorruptCheckpointError, match=f"{optim_name(1)}: CRC-32 .* differs from the manifest"):
        reader.load(optim_name(1))
    with pytest.raises(CorruptCheckpointError, match="differs from the manifest"):
        reader.open_lazy(optim_name(1))
    with pytest.raises(ValueError, match="lists no file 'nope.pt'"):
        reader.load("nope.pt")
    (copy / TAG / manifest.MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError):
        TagReader(copy / TAG)


# ------------------------------------------------------------------------------ to-universal


def test_to_universal_writes_deepspeeds_universal_checkpoint(plain: Path, engine_ckpt: Path,
                                                             tmp_path: Path, capsys: Any) -> None:
    """Uneven fragments across 3 ranks, a frozen weight and a buffer (fp32.pt from the module),
    small chunks: the same files and objects as ds_to_universal's, and a verifiable checkpoint."""
    ds_to_universal(plain / TAG, tmp_path / "deepspeed" / TAG)
    out = tmp_path / "ours"
    assert cli.main(["to-universal", "-q", "--workers", "2", "--chunk-mb", "0.001",
                     str(engine_ckpt), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"ZeRO-2, saved at data-parallel size 3; {len(SHAPES)} parameters" in printed
    assert f"engine.load_checkpoint({str(out)!r})" in printed
    assert assert_same_universal(tmp_path / "deepspeed", out) >= 3 * len(SHAPES) + 6
    found = manifest.read_manifest(out / TAG)
    assert sorted(r.path for r in found.files) == universal_files(out / TAG)
    assert dict(found.layout) == {"framework": "deepspeed", "kind": "deepspeed-universal",
                                  "source_dp": 3, "source_pp": 1, "source_tp": 1, "zero_stage": 2}
    assert cli.main(["verify", "-q", str(out / TAG)]) == 0
    fallback = nce.load(out / TAG / "zero" / "frozen.weight" / "fp32.pt")
    assert list(fallback) == ["param"] and fallback["param"].dtype == torch.float32


def test_to_universal_converts_a_tag_folder_and_another_tag(engine_ckpt: Path, tmp_path: Path) -> None:
    assert cli.main(["to-universal", "-q", str(engine_ckpt / TAG), str(tmp_path / "a")]) == 0
    assert cli.main(["to-universal", "-q", "--tag", TAG, str(engine_ckpt), str(tmp_path / "b")]) == 0
    assert universal_files(tmp_path / "a") == universal_files(tmp_path / "b")
    assert (tmp_path / "a" / "latest_universal").read_text() == TAG


@pytest.mark.parametrize("where, words", [
    ("inside", "refusing to write"),
    ("nonempty", "exists and is not an empty directory"),
    ("file", "is a file"),
])
def test_to_universal_refuses_a_bad_request(engine_ckpt: Path, tmp_path: Path, capsys: Any,
                                            where: str, words: str) -> None:
    source, out = str(engine_ckpt), str(tmp_path / "out")
    if where == "inside":
        out = str(engine_ckpt / "universal")
    elif where == "nonempty":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "x").write_text("x")
    else:
        source = str(engine_ckpt / TAG / MODEL)
    assert cli.main(["to-universal", "-q", source, out]) == 2
    assert words in capsys.readouterr().err
    assert not (engine_ckpt / "universal").exists()


def _rename(plain: Path, tmp_path: Path, old: str, new: str) -> Path:
    copy = tmp_path / "plain"
    shutil.copytree(plain, copy)
    os.replace(copy / TAG / old, copy / TAG / new)
    return compressed(copy, tmp_path / "engine")


@pytest.mark.parametrize("old, new, words", [
    (MODEL, "mp_rank_01_model_states.pt", "tensor parallelism"),
    (optim_name(2), "layer_01-model_00-model_states.pt", "pipeline-parallel or MoE layer files"),
])
def test_to_universal_refuses_what_it_does_not_convert(plain: Path, tmp_path: Path, capsys: Any,
                                                       old: str, new: str, words: str) -> None:
    engine = _rename(plain, tmp_path, old, new)
    assert cli.main(["to-universal", "-q", str(engine), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert words in err and "ds_to_universal --input_folder" in err and new in err
    assert not list((tmp_path / "out").rglob("*.pt"))


def test_to_universal_names_a_missing_rank(plain: Path, tmp_path: Path, capsys: Any) -> None:
    copy = tmp_path / "plain"
    shutil.copytree(plain, copy)
    (copy / TAG / optim_name(1)).unlink()
    engine = compressed(copy, tmp_path / "engine")
    assert cli.main(["to-universal", "-q", str(engine), str(tmp_path / "out")]) == 1
    assert "data-parallel rank(s) [1] are missing" in capsys.readouterr().err


def test_to_universal_needs_a_complete_checkpoint(engine_ckpt: Path, tmp_path: Path,
                                                  capsys: Any) -> None:
    copy = tmp_path / "checkpoints"
    shutil.copytree(engine_ckpt, copy)
    (copy / TAG / manifest.MANIFEST_NAME).unlink()
    assert cli.main(["to-universal", "-q", str(copy), str(tmp_path / "out")]) == 1
    assert manifest.MANIFEST_NAME in capsys.readouterr().err
    assert not (tmp_path / "out" / "latest_universal").exists()


def test_tensor_parallel_merge_metadata_is_refused(tmp_path: Path, capsys: Any) -> None:
    plain = tmp_path / "plain"
    zero2_checkpoint(plain, dp=1, shapes={"w": (4, 4)})
    states = torch.load(plain / TAG / MODEL, weights_only=False)
    states["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4,
                                           "vocabulary_parameter_patterns": ["w"]}
    torch.save(states, plain / TAG / MODEL)
    engine = compressed(plain, tmp_path / "engine")
    assert cli.main(["to-universal", "-q", str(engine), str(tmp_path / "out")]) == 1
    assert "vocabulary_parameter_patterns" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def universal(engine_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("universal") / "universal"
    assert cli.main(["to-universal", "-q", str(engine_ckpt), str(out)]) == 0
    return out


def checkpoint_engine(*, load_universal: bool) -> Any:
    """Our DeepSpeed checkpoint engine, one rank, driven by hand; ds_config's checkpoint
    section says `load_universal`."""
    from nvcomp_ckpt_engine.config import NvcompConfig
    from nvcomp_ckpt_engine.deepspeed.engine import NvcompCheckpointEngine

    config = types.SimpleNamespace(load_universal_checkpoint=load_universal, checkpoint_config=None,
                                   use_node_local_storage=False)
    return NvcompCheckpointEngine(config, options=NvcompConfig(enabled=True), zero_stage=2)


def test_the_engine_reads_universal_files_with_its_checks(universal: Path, tmp_path: Path) -> None:
    param = universal / TAG / "zero" / "block.weight" / "exp_avg.pt"
    got = checkpoint_engine(load_universal=True).load(str(param))
    assert_same_object(nce.load(param), got)
    copy = tmp_path / "universal"
    shutil.copytree(universal, copy)
    found = manifest.read_manifest(copy / TAG)
    files = [dataclasses.replace(r, crc32=r.crc32 ^ 1) if r.path.endswith("block.weight/exp_avg.pt")
             else r for r in found.files]
    manifest.write_manifest(copy / TAG, dataclasses.replace(found, files=tuple(files)))
    with pytest.raises(CorruptCheckpointError, match="differs from the manifest"):
        checkpoint_engine(load_universal=True).load(str(copy / TAG / "zero" / "block.weight" / "exp_avg.pt"))


def test_a_universal_checkpoint_needs_load_universal_and_the_reverse(universal: Path,
                                                                     engine_ckpt: Path) -> None:
    with pytest.raises(UnsupportedCheckpointError,
                       match=r'is a universal checkpoint: load it with "checkpoint": '
                             r'\{"load_universal": true\}'):
        checkpoint_engine(load_universal=False).load(str(universal / TAG / MODEL))
    with pytest.raises(UnsupportedCheckpointError) as info:
        checkpoint_engine(load_universal=True).load(str(engine_ckpt / TAG / MODEL))
    assert (f"`nvcomp-ckpt to-universal {engine_ckpt} {engine_ckpt}_universal --tag {TAG}`"
            in str(info.value))


def test_deepspeeds_universal_loader_reads_our_shards_through_the_engine(
        universal: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.load` in DeepSpeed's universal loader goes to the engine; anywhere else it stays
    what it was (here torch's own, which refuses our shards: their torch.load guard)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    monkeypatch.setattr(torch, "load", torch.serialization.load)  # the hook's shim set aside

    from nvcomp_ckpt_engine.deepspeed import _compat

    engine = checkpoint_engine(load_universal=True)
    loaded: dict[str, Any] = {}
    optimizer = types.SimpleNamespace(  # what the method reads of a ZeRO optimizer
        _load_global_state=loaded.update, mpu=None, optimizer=types.SimpleNamespace(param_groups=[]))
    real = torch.load
    with _compat.route_universal_loads(engine.load):
        ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir(optimizer, "bit16_groups",
                                                                   str(universal / TAG))
        with pytest.raises(TorchLoadOfShardError):
            torch.load(universal / TAG / "zero" / "optimizer_state.pt", weights_only=False)
    assert torch.load is real
    assert loaded["partition_count"] == [3] and loaded["group_paddings"] == [0]
    assert loaded["param_groups"][0]["lr"] == 0.01


def test_verify_and_inspect_work_on_the_universal_folder(universal: Path, capsys: Any) -> None:
    """The folder `to-universal` writes has `latest_universal` and no `latest`: its tag is
    the one `latest_universal` names."""
    assert cli.main(["verify", "-q", str(universal)]) == 0
    assert f"{universal / TAG}: OK" in capsys.readouterr().out
    assert cli.main(["inspect", "--json", str(universal)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["tag"] == TAG and document["manifest"]["layout"]["kind"] == "deepspeed-universal"
    assert document["totals"]["files"] == len(universal_files(universal / TAG))


def test_a_universal_folder_with_an_unusable_pointer_says_which(universal: Path, tmp_path: Path,
                                                                capsys: Any) -> None:
    copy = tmp_path / "universal"
    shutil.copytree(universal, copy)
    (copy / "latest_universal").write_text("")
    assert cli.main(["verify", "-q", str(copy)]) == 2
    assert f"{copy / 'latest_universal'} is empty" in capsys.readouterr().err
    (copy / "latest").write_text(TAG)  # `latest` is what a save directory has: it wins
    assert cli.main(["verify", "-q", str(copy)]) == 0


def test_the_engine_refuses_a_compressed_checkpoint_at_another_data_parallel_size(
        engine_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`compress` records the layout as the engine does (one builder), so the engine's layout
    check applies to a checkpoint it converted: saved at 3 ranks, loaded at 2."""
    from nvcomp_ckpt_engine.deepspeed import _compat

    found = manifest.read_manifest(engine_ckpt / TAG)
    assert dict(found.layout) == manifest.layout_record("deepspeed", dp=3, tp=1, pp=1, zero_stage=2)
    assert found.world_size == 3 and found.versions["deepspeed"] == "0.19.8"
    with pytest.raises(UnsupportedCheckpointError, match=r"dp: saved 3, now 2"):
        manifest.check_layout(found, manifest.layout_record("deepspeed", dp=2, tp=1, pp=1,
                                                             zero_stage=2))
    monkeypatch.setattr(_compat.groups, "_get_sequence_data_parallel_world_size", lambda: 2)
    monkeypatch.setattr(_compat.groups, "_get_model_parallel_world_size", lambda: 1)
    with pytest.raises(UnsupportedCheckpointError, match=r"parallel layout \(dp: saved 3, now 2\)"):
        checkpoint_engine(load_universal=False).load(str(engine_ckpt / TAG / optim_name(0)))
    monkeypatch.setattr(_compat.groups, "_get_sequence_data_parallel_world_size", lambda: 3)
    loaded = checkpoint_engine(load_universal=False).load(str(engine_ckpt / TAG / optim_name(0)))
    assert loaded["optimizer_state_dict"]["partition_count"] == [3]


def test_a_refused_elastic_load_names_the_two_steps(tmp_path: Path) -> None:
    from nvcomp_ckpt_engine.deepspeed import remedies

    found = manifest.build_manifest(tag=TAG, world_size=4, files=[], created_unix_ns=1,
                                    layout={"dp": 4, "tp": 1, "pp": 1, "zero_stage": 2})
    with pytest.raises(UnsupportedCheckpointError) as info:
        manifest.check_layout(found, {"dp": 2, "tp": 1, "pp": 1}, source=str(tmp_path / TAG),
                              remedy=remedies.elastic_remedy(str(tmp_path), TAG, found))
    text = str(info.value)
    assert "dp: saved 4, now 2" in text
    assert f"`nvcomp-ckpt to-universal {tmp_path} {tmp_path}_universal --tag {TAG}`" in text
    assert f'"checkpoint": {{"load_universal": true}} in ds_config and call engine.load_checkpoint(' \
           f"{str(tmp_path) + '_universal'!r})" in text
    tensor_parallel = dataclasses.replace(found, layout={**found.layout, "tp": 2})
    assert "nvcomp-ckpt decompress" in remedies.elastic_remedy(str(tmp_path), TAG, tensor_parallel)


# ------------------------------------------------------------------------------ memory


# `nvcomp-ckpt to-universal` in a fresh process, printing its peak resident memory over what it
# held before (VmHWM: getrusage's ru_maxrss would start from the parent's size at fork).
CONVERT_AND_MEASURE = textwrap.dedent(
    """
    import json, sys
    from nvcomp_ckpt_engine import cli
    from nvcomp_ckpt_engine.deepspeed import universal

    def peak_kib():
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])

    before = peak_kib()
    status = cli.main(["to-universal", "-q", *sys.argv[1:]])
    print(json.dumps({"status": status, "peak_kib": peak_kib(), "base_kib": before}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc")
def test_conversion_memory_is_bounded_by_a_few_parameters(tmp_path: Path) -> None:
    """16 parameters of 4 MiB in fp32 saved at one rank: 192 MiB of optimizer state in one file,
    which the conversion never holds. Its peak is the bound docs/DEEPSPEED.md gives: the model
    states (32 MiB of bf16 weights) or, per worker, twice a parameter and four chunks."""
    shapes = {f"layer{i}.weight": (1024, 1024) for i in range(16)}
    plain = tmp_path / "plain"
    zero2_checkpoint(plain, dp=1, shapes=shapes)
    engine = compressed(plain, tmp_path / "engine", "--chunk-mb", "1")
    shutil.rmtree(plain)
    mib, workers = 1 << 20, 2
    optimizer_bytes = 3 * 16 * 4 * mib
    bound = max(16 * 2 * mib, workers * 2 * 4 * mib) + workers * 4 * mib + 32 * mib  # + slack
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CONVERT_AND_MEASURE, "--workers", str(workers),
                           "--chunk-mb", "1", str(engine), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["status"] == 0, done.stderr[-3000:]
    extra = (measured["peak_kib"] - measured["base_kib"]) * 1024
    assert extra < bound, f"peak {extra / mib:.0f} MiB over the {bound / mib:.0f} MiB bound"
    assert extra < optimizer_bytes / 2
    written = universal_files(tmp_path / "out")
    assert len(written) == 1 + 1 + 1 + 16 * 4  # latest_universal, model states, optimizer state
    assert all(nce.is_shard_file(tmp_path / "out" / p) for p in written if p.endswith(".pt"))


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_to_universal_from_gpu_codecs(plain: Path, tmp_path: Path) -> None:
    """Shards written with nvCOMP (ANS): read by range through the GPU, written through it again,
    and the result still DeepSpeed's, tensor for tensor; the engine reads it back."""
    from nvcomp_ckpt_engine.codecs import nvcomp_gpu

    if not nvcomp_gpu.nvcomp_available():
        pytest.skip("needs nvCOMP (nvcomp_ckpt_engine[cu12] or [cu13])")
    engine = compressed(plain, tmp_path / "engine", "--algorithm", "ans", "--chunk-mb", "0.001")
    ds_to_universal(plain / TAG, tmp_path / "deepspeed" / TAG)
    out = tmp_path / "ours"
    assert cli.main(["to-universal", "-q", str(engine), str(out)]) == 0
    assert assert_same_universal(tmp_path / "deepspeed", out) >= 3 * len(SHAPES)
    assert "ans" in container.read_index(out / TAG / "zero" / "embed.weight" / "fp32.pt").codecs
    with LazyShard(engine / TAG / optim_name(1)) as lazy:
        ref = lazy.obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
        whole = nce.load(engine / TAG / optim_name(1), map_location="cpu")
        expected = whole["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
        assert torch.equal(raw_bytes(lazy.read(ref, 100, 200)), raw_bytes(expected[100:300]))
    param = out / TAG / "zero" / "block.weight" / "fp32.pt"
    assert_same_object(nce.load(param, map_location="cpu"),
                       checkpoint_engine(load_universal=True).load(str(param), "cpu"))


def test_a_universal_load_that_would_roll_back_past_latest_is_refused(tmp_path: Path) -> None:
    """A job that saved into its universal folder and relaunches with load_universal still on:
    latest_universal names step 30, latest the newer step 34."""
    from nvcomp_ckpt_engine import discovery

    for tag in ("global_step30", "global_step34"):
        (tmp_path / tag).mkdir()
    discovery.write_latest(tmp_path, "global_step30", name=discovery.LATEST_UNIVERSAL_NAME)
    engine = checkpoint_engine(load_universal=True)
    engine.check_universal_load(str(tmp_path))  # no latest: nothing newer
    discovery.write_latest(tmp_path, "global_step34")
    with pytest.raises(UnsupportedCheckpointError, match=r"latest names 'global_step34', a later "
                       r"step than 'global_step30'.*rolling training back\. Take \"load_universal\" "
                       r"out of ds_config"):
        engine.check_universal_load(str(tmp_path))
    discovery.write_latest(tmp_path, "global_step30")  # latest no newer: the universal load runs
    engine.check_universal_load(str(tmp_path))
    assert discovery.newer_than_universal(tmp_path) is None


def test_a_plain_load_of_a_universal_folder_does_not_start_fresh(tmp_path: Path) -> None:
    """A job pointed at a universal folder (latest_universal, no latest) without load_universal
    would train from its first step: refused, naming the two ways to resume."""
    from nvcomp_ckpt_engine import discovery

    engine = checkpoint_engine(load_universal=False)
    engine.check_fresh_start(str(tmp_path))  # an empty folder: a fresh start is right
    (tmp_path / "global_step30").mkdir()
    discovery.write_latest(tmp_path, "global_step30", name=discovery.LATEST_UNIVERSAL_NAME)
    with pytest.raises(UnsupportedCheckpointError, match=r"holds no checkpoint to resume but a "
                       r"universal one \(latest_universal names 'global_step30'\).*load the "
                       r"checkpoint it was converted from.*\"load_universal\": true"):
        engine.check_fresh_start(str(tmp_path))


# ------------------------------------------------- no code from a file in a universal tag


class _TouchesWhenUnpickled:
    """Creates `marker` when `torch.load(weights_only=False)` reads the file it is saved in."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _deepspeeds_parameter_load(engine: Any, folder: Path) -> None:
    """DeepSpeed's own universal load of one parameter's folder (every ``*.pt`` in it), with
    its torch.load routed as the engine routes it."""
    from deepspeed.checkpoint import universal_checkpoint

    from nvcomp_ckpt_engine.deepspeed import _compat

    param = types.SimpleNamespace(_hp_mapping=types.SimpleNamespace())
    with _compat.route_universal_loads(engine.load):
        universal_checkpoint.load_hp_checkpoint_state(param, str(folder), 0, 1)


def test_a_file_planted_in_a_universal_tag_is_refused_unread(universal: Path, tmp_path: Path) -> None:
    """DeepSpeed reads every ``*.pt`` of a parameter's folder; one the manifest does not list
    reaches the engine's refusal, naming it, not torch's unpickler."""
    copy, marker = tmp_path / "universal", tmp_path / "ran"
    shutil.copytree(universal, copy)
    planted = copy / TAG / "zero" / "planted" / "evil.pt"
    planted.parent.mkdir()
    torch.save({"param": _TouchesWhenUnpickled(marker)}, planted)
    with pytest.raises(IncompleteCheckpointError, match=re.escape(f"{planted} is not listed")):
        _deepspeeds_parameter_load(checkpoint_engine(load_universal=True), planted.parent)
    assert not marker.exists()


@pytest.mark.parametrize("verify", [True, False])
def test_a_listed_file_replaced_by_a_pickle_of_its_size_is_refused_unread(
        universal: Path, tmp_path: Path, verify: bool) -> None:
    """A listed universal file swapped for a pickle of the same size: its CRC is checked before
    anything reads it (plain files too, no longer by size alone); without ``verify`` the
    engine still reads only shards of ours, never a plain pickle."""
    from nvcomp_ckpt_engine.config import NvcompConfig

    copy, marker = tmp_path / "universal", tmp_path / "ran"
    shutil.copytree(universal, copy)
    folder = copy / TAG / "zero" / "block.weight"
    found = manifest.read_manifest(copy / TAG)
    kept = [r for r in found.files if not r.path.startswith("zero/block.weight/") or r.path.endswith("fp32.pt")]
    for other in folder.iterdir():  # DeepSpeed then meets the swapped file first
        if other.name != "fp32.pt":
            other.unlink()
    manifest.write_manifest(copy / TAG, dataclasses.replace(found, files=tuple(kept)))
    target = folder / "fp32.pt"
    size = target.stat().st_size
    payload = pickle.dumps(_TouchesWhenUnpickled(marker), protocol=2)
    target.write_bytes(payload + b"\0" * (size - len(payload)))
    engine = checkpoint_engine(load_universal=True)
    engine.options = NvcompConfig(enabled=True, verify=verify)
    with pytest.raises((CorruptCheckpointError, UnsupportedCheckpointError),
                       match=re.escape(str(target))):
        _deepspeeds_parameter_load(engine, folder)
    assert not marker.exists()
