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
from nvcomp_ckpt_engine import cli, manifest

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
            clone[key] = _replaced(obj[key], rest, value, delete)
        return clone
    items = list(obj)
    items[key] = _replaced(obj[key], rest, value, delete)
    return items if isinstance(obj, list) else tuple(items) if type(obj) is tuple else type(obj)(items)


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


def _forge(folder: Path, relative: str, mutations: list[tuple[int, Any, bool]]) -> None:
    """Rewrite `relative` in tag folder `folder` with `mutations` applied (place index, value,
    delete), through the library's writer; its manifest record resealed to match."""
    path = folder / relative
    obj = nce.load(path, trusted=True)
    for index, value, delete in mutations:
        places = _places(obj)
        if places:
            obj = _replaced(obj, places[index % len(places)], value, delete)
    try:
        info = nce.save(obj, path)
    except (TypeError, ValueError):  # the writer refuses it: nothing to forge
        assume(False)
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
    assert any(name in lines[0] for name in (str(folder), *FILES)), lines[0]
    assert not out.exists(), f"{command} left {sorted(out.rglob('*'))}"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@LAYOUTS
@given(relative=st.sampled_from(FILES),
       mutations=st.lists(st.tuples(st.integers(0, 10_000), HOSTILE_VALUES, st.booleans()),
                          min_size=1, max_size=2))
def test_hostile_layouts_are_converted_or_refused_in_one_line(source, tmp_path_factory,
                                                              relative, mutations):
    work = tmp_path_factory.mktemp("forged")
    save_dir = work / "checkpoints"
    shutil.copytree(source, save_dir)
    _forge(save_dir / TAG, relative, mutations)
    for command in ("to-universal", "decompress"):
        out = work / f"out-{command}"
        status, err = _run(command, "-q", str(save_dir), str(out))
        assert_one_line_naming_a_file(status, err, command, save_dir / TAG, out)
