"""Hostile DeepSpeed layouts through `nvcomp-ckpt to-universal` and `decompress`, in one process.

A small valid ZeRO-2 checkpoint of ours (tests/test_universal.py's, at 2 ranks) has one value of
its files' objects replaced -- a key of the optimizer state or the model states, a fragment
address's field, a param group, a shape -- by a value of another type or range, or deleted; the
file is written again through the library's own writer and its manifest record resealed, so the
checkpoint is complete and intact and the forgery reaches the code that reads the layout. Every
command then either converts it, or exits with status 1 and one line naming a file of the
checkpoint, leaving no output folder behind: never a traceback, never a partial output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli, manifest, pipeline

from test_universal import MODEL, TAG, compressed, optim_name, zero2_checkpoint

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
#: Each example converts a checkpoint twice (about half a second); CI runs a fixed sequence.
LAYOUTS = settings(max_examples=40 if not LONG else 2000, deadline=None, derandomize=not LONG,
                   database=settings.default.database if LONG else None,
                   suppress_health_check=[HealthCheck.too_slow,
                                          HealthCheck.function_scoped_fixture])
SHAPES = {"embed.weight": (7, 4), "block.weight": (4, 4), "block.bias": (4,)}
FILES = (MODEL, optim_name(0), optim_name(1))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save directory of a compressed ZeRO-2 checkpoint saved at 2 ranks."""
    plain = tmp_path_factory.mktemp("plain") / "checkpoints"
    zero2_checkpoint(plain, dp=2, shapes=SHAPES, extra_module={"mask": torch.ones(3)})
    return compressed(plain, tmp_path_factory.mktemp("engine") / "checkpoints")


# ------------------------------------------------------------------------------ the forgery


def _places(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every place in `obj` a value can be replaced or deleted: dict keys, list items,
    attributes of DeepSpeed's objects (their fields), not the insides of tensors."""
    places = [path] if path else []
    if isinstance(obj, dict):
        for key, value in obj.items():
            places += _places(value, path + (("item", key),))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            places += _places(value, path + (("item", i),))
    elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("deepspeed"):
        for name, value in vars(obj).items():
            places += _places(value, path + (("attr", name),))
    return places


def _replaced(obj: Any, path: tuple, value: Any, delete: bool) -> Any:
    """`obj` with the value at `path` replaced by `value` (or deleted, where that means
    something: a dict key); containers along the path are copied, tuples rebuilt."""
    if not path:
        return value
    (kind, key), rest = path[0], path[1:]
    if kind == "attr":
        clone = dataclasses.replace(obj) if dataclasses.is_dataclass(obj) else obj
        object.__setattr__(clone, key, _replaced(getattr(obj, key), rest, value, delete))
        return clone
    if isinstance(obj, dict):
        clone = obj.copy()
        if delete and not rest:
            del clone[key]
        else:
            clone[key] = _replaced(obj.get(key), rest, value, delete)
        return clone
    items = list(obj)
    items[key] = _replaced(obj[key], rest, value, delete)
    if isinstance(obj, list):
        return items
    try:
        return type(obj)(items)  # a torch.Size stays one where it can
    except TypeError:
        return tuple(items)


def _nested(depth: int) -> list:
    nested: list = [0]
    for _ in range(depth - 1):
        nested = [nested]
    return nested


#: What a damaged or hostile file may hold instead of the value DeepSpeed wrote.
HOSTILE_VALUES = st.sampled_from([
    None, True, 0, 1, -1, 3, 2**62, -(2**62), 2**80, 1.5, float("nan"), float("inf"), "x", b"x",
    [], {}, (), [0], [[]], [{}], {"x": 0}, {0: {}}, OrderedDict(x=-5), (0, -1), [2**62],
    torch.Size([2**40, 2**40]), torch.Size([0]), torch.Size([-3]),
    "zero_pp_rank_0", _nested(150),
]) | st.builds(torch.zeros, st.integers(0, 5)) | st.builds(
    lambda n: torch.zeros(n, dtype=torch.int64), st.integers(0, 3))


def _forge(folder: Path, relative: str, mutations: list[tuple[int | tuple, Any, bool]]) -> None:
    """Rewrite `relative` in tag folder `folder` with `mutations` applied (a place, or its
    index among `_places`; the value; delete), through the library's writer; its manifest
    record resealed to match."""
    path = folder / relative
    obj = nce.load(path, trusted=True)
    for place, value, delete in mutations:
        places = _places(obj)
        if isinstance(place, tuple):
            obj = _replaced(obj, tuple(("item", key) if isinstance(key, (str, int)) else key
                                       for key in place), value, delete)
        elif places:
            obj = _replaced(obj, places[place % len(places)], value, delete)
    try:
        info = nce.save(obj, path)
    except (TypeError, ValueError):  # the writer refuses it: nothing to forge
        assume(False)
    _reseal(folder, relative, info)


def _reseal(folder: Path, relative: str, info: Any) -> None:
    """The manifest's record of `relative` made to match the file now there."""
    found = manifest.read_manifest(folder)
    files = [dataclasses.replace(r, raw_bytes=info.raw_bytes, file_bytes=info.file_bytes,
                                 crc32=info.crc32) if r.path == relative else r
             for r in found.files]
    manifest.write_manifest(folder, dataclasses.replace(found, files=tuple(files)),
                            durable=False)


def _run(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(list(args))
    return status, err.getvalue()


def assert_one_line_naming_a_file(status: int, err: str, command: str, folder: Path,
                                  out: Path) -> None:
    """Status 1, one error line naming the checkpoint's folder or one of its files, and no
    output left; or success."""
    if status == 0:
        return
    lines = [line for line in err.splitlines() if line.startswith(f"nvcomp-ckpt {command}:")]
    assert status == 1 and len(lines) == 1, err
    assert any(name in lines[0] for name in (str(folder), *FILES, *ZERO3_FILES)), lines[0]
    assert "not a layout DeepSpeed writes" not in lines[0], f"a check is missing: {lines[0]}"
    assert "Traceback" not in err, err
    assert not out.exists(), f"{command} left {sorted(out.rglob('*'))}"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.fixture(scope="module")
def source3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save directory of a compressed ZeRO-3 checkpoint saved at 2 ranks."""
    return _zero3_checkpoint(tmp_path_factory.mktemp("zero3") / "checkpoints",
                             [{"partition_count": 2, "partition_rank": 0}])


ZERO3_FILES = tuple(f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
                    for rank in range(2) for kind in ("optim", "model"))


@LAYOUTS
@given(relative=st.sampled_from(FILES + ZERO3_FILES),
       mutations=st.lists(st.tuples(st.integers(0, 10_000), HOSTILE_VALUES, st.booleans()),
                          min_size=1, max_size=2))
def test_hostile_layouts_are_converted_or_refused_in_one_line(source, source3, tmp_path_factory,
                                                              relative, mutations):
    work = tmp_path_factory.mktemp("forged")
    save_dir = work / "checkpoints"
    shutil.copytree(source3 if relative in ZERO3_FILES else source, save_dir)
    _forge(save_dir / TAG, relative, mutations)
    for command in ("to-universal", "decompress", "zero-to-fp32"):
        out = work / f"out-{command}"
        quiet = () if command == "zero-to-fp32" else ("-q",)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's converter talks
            status, err = _run(command, *quiet, str(save_dir), str(out))
        assert_one_line_naming_a_file(status, err, command,
                                      save_dir if command == "zero-to-fp32" else save_dir / TAG, out)


# ------------------------------------------------------------------ the cases that escaped


OPTIM = "optimizer_state_dict"
FRAGMENT = (OPTIM, "param_slice_mappings", 0, "block.bias")


@pytest.mark.parametrize("relative, place, value, words", [
    (optim_name(0), (OPTIM, "zero_stage"), None, "'zero_stage' is None, not a ZeRO stage"),
    (optim_name(0), (OPTIM, "zero_stage"), "x", "'zero_stage' is 'x', not a ZeRO stage"),
    (optim_name(1), FRAGMENT, 3, "maps 'block.bias' to 3, not a fragment address"),
    (optim_name(1), FRAGMENT + (("attr", "start"),), None, "not a fragment address"),
    (optim_name(1), (OPTIM, "base_optimizer_state", "state"), {},
     "param group 0 has no mapping of parameters to fragments or no optimizer state"),
    (optim_name(0), (OPTIM, "single_partition_of_fp32_groups"), [],
     "not a list of one partition per param group"),
    (MODEL, ("universal_checkpoint_info",), True, "'universal_checkpoint_info' is a bool"),
    (MODEL, ("checkpoint_parallel_dimensions",), [1], "is a list, not a dict"),
    (MODEL, ("module", "mask"), None, "module entry 'mask' is a NoneType, not a tensor"),
    (MODEL, ("param_shapes", 0, "block.bias"), torch.Size([]),
     "parameter 'block.bias' has shape (), 1 elements; the optimizer files hold 4"),
    (MODEL, ("param_shapes", 0, "block.bias"), torch.zeros(3), "not a tensor's shape"),
    (MODEL, ("param_shapes", 0, "block.bias"), (2**62, 2**62), "not a tensor's shape"),
], ids=["stage-none", "stage-text", "address-int", "address-start-none", "no-group-state",
        "no-partitions", "info-bool", "dims-list", "module-none", "shape-scalar",
        "shape-tensor", "shape-huge"])
def test_a_hostile_layout_is_one_line_naming_its_file(source, tmp_path, relative, place, value,
                                                      words):
    """Each once escaped `to-universal` as AttributeError, TypeError, KeyError, ValueError,
    or an error naming no file."""
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(source, save_dir)
    _forge(save_dir / TAG, relative, [(place, value, False)])
    out = tmp_path / "out"
    status, err = _run("to-universal", "-q", str(save_dir), str(out))
    assert status == 1 and words in err, err
    assert_one_line_naming_a_file(status, err, "to-universal", save_dir / TAG, out)
    assert relative in err


def test_a_parameter_name_leaving_its_folder_is_refused_naming_the_file(source, tmp_path):
    """A parameter named ``../x`` would name a folder outside ``zero/``: refused by the file
    that names it (the path check said so naming no file)."""
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(source, save_dir)
    _forge(save_dir / TAG, MODEL, [(("param_shapes", 0), {"../x": torch.Size([4])}, False)])
    status, err = _run("to-universal", "-q", str(save_dir), str(tmp_path / "out"))
    assert status == 1 and f"{MODEL}: parameter name '../x' cannot name a folder" in err, err
    assert not (tmp_path / "out").exists()


def _zero3_checkpoint(save_dir: Path, partition_groups: list) -> Path:
    """A plain ZeRO-3 checkpoint of one parameter at 2 ranks, with `partition_groups` as its
    optimizer files' ``ds_zero_partition_groups``, compressed."""
    plain = save_dir.parent / "plain"
    tag_dir = plain / TAG
    tag_dir.mkdir(parents=True)
    for rank in range(2):
        half = torch.randn(2)
        torch.save({OPTIM: {
            "zero_stage": 3, "fp32_flat_groups": [half], "ds_zero_partition_groups": partition_groups,
            "optimizer_state_dict": {"state": {0: {"exp_avg": half.clone(), "exp_avg_sq": half.abs(),
                                                   "step": 1}},
                                     "param_groups": [{"lr": 0.1, "params": [0]}]}}},
                   tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"module": {}, "param_shapes": [OrderedDict(w=torch.Size([4]))],
                    "dp_world_size": 2}, tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    (plain / "latest").write_text(TAG)
    return compressed(plain, save_dir)


@pytest.mark.parametrize("partition_groups, words", [
    ([{"partition_count": 0, "partition_rank": 0}], "not a rank among a partition count"),
    ([{"partition_count": 2, "partition_rank": 5}], "not a rank among a partition count"),
    ([None], "not a rank among a partition count"),
    ({"x": 1}, "'ds_zero_partition_groups' is a dict, not a list"),
], ids=["count-zero", "rank-outside", "group-none", "dict"])
def test_a_hostile_zero3_partition_is_one_line_naming_its_file(tmp_path, partition_groups, words):
    """A partition count of 0 escaped as ZeroDivisionError, the others as AttributeError or
    a conversion reading another rank's slice."""
    save_dir = _zero3_checkpoint(tmp_path / "checkpoints", partition_groups)
    out = tmp_path / "out"
    status, err = _run("to-universal", "-q", str(save_dir), str(out))
    assert status == 1 and words in err and "zero_pp_rank_0_mp_rank_00_optim_states.pt" in err, err
    assert_one_line_naming_a_file(status, err, "to-universal", save_dir / TAG, out)


def test_a_valid_zero3_checkpoint_converts(tmp_path):
    """The same checkpoint with DeepSpeed's own partition records converts."""
    save_dir = _zero3_checkpoint(tmp_path / "checkpoints",
                                 [{"partition_count": 2, "partition_rank": r} for r in (0,)])
    status, err = _run("to-universal", "-q", str(save_dir), str(tmp_path / "out"))
    assert status == 0, err
    assert (tmp_path / "out" / TAG / "zero" / "w" / "fp32.pt").is_file()


def test_decompress_of_a_deeply_nested_skeleton_is_one_line_naming_the_file(source, tmp_path):
    """A model-states file whose skeleton nests lists 5,000 deep: loadable by pickle, but the
    re-save died with RecursionError. Refused by the nesting bound, naming the file."""
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(source, save_dir)
    skeleton = b"\x80\x02]K\x01a" + b"q\x000]h\x00a" * 4999 + b"."
    prepared = pipeline.prepare_shard(skeleton, [], [], algorithm="zstd", portable=False,
                                      chunk_bytes=1 << 20, writer_info={})
    info = pipeline.write_prepared(prepared, save_dir / TAG / MODEL, durable=False)
    _reseal(save_dir / TAG, MODEL, info)
    out = tmp_path / "out"
    for command in ("decompress", "to-universal"):
        status, err = _run(command, "-q", str(save_dir), str(out))
        assert status == 1 and f"{MODEL}: the skeleton nests" in err, err
        assert_one_line_naming_a_file(status, err, command, save_dir / TAG, out)


@pytest.mark.parametrize("relative, place, delete", [
    (MODEL, ("module",), True),
    (optim_name(0), (OPTIM, "partition_count"), True),
    (MODEL, ("param_shapes", 0), False),
], ids=["no-module", "no-partition-count", "shapes-none"])
def test_zero_to_fp32_on_a_hostile_layout_is_one_line_naming_the_checkpoint(source, tmp_path,
                                                                             relative, place,
                                                                             delete):
    """DeepSpeed's own converter trusts the layout: a missing key or a value of another type
    escaped it as KeyError or TypeError. The command says it in one line naming the
    checkpoint, status 1, and writes nothing."""
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(source, save_dir)
    _forge(save_dir / TAG, relative, [(place, None, delete)])
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        status, err = _run("zero-to-fp32", str(save_dir), str(out))
    assert status == 1 and "DeepSpeed's zero_to_fp32 cannot convert this checkpoint" in err
    assert_one_line_naming_a_file(status, err, "zero-to-fp32", save_dir, out)
