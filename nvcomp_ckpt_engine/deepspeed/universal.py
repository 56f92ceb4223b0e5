"""DeepSpeed's universal checkpoint, written straight from a compressed checkpoint.

A universal checkpoint is what ``deepspeed.checkpoint.ds_to_universal`` writes and what
``"checkpoint": {"load_universal": true}`` loads at any data-parallel size: one folder per
parameter under ``TAG/zero/`` holding its whole fp32 master weights and optimizer moments, the
optimizer's global state in ``zero/optimizer_state.pt``, the model-states files, and
``latest_universal`` beside the tag folder. `convert` writes exactly that -- the same files at
the same paths holding the same objects, tensor for tensor, as DeepSpeed 0.19's converter run
on a plain copy of the checkpoint -- but each file is one of our compressed shards, the tag gets
a manifest (written last, so the result is a complete, verifiable checkpoint of ours), and
nothing else is written: no decompressed copy, no temporary fragment files.

Memory stays bounded: the optimizer shards are never loaded whole. Each parameter's slices are
read from the ranks' flat partitions (`LazyShard.read`, which decodes only the chunks holding
them), put together, written, and dropped. Peak host memory is the larger of

- the biggest model-states file, loaded whole (with ZeRO-1/2, rank 0's file: the 16-bit
  weights, 2 bytes per parameter; with ZeRO-3 each rank's small file), and
- `workers` times twice the biggest parameter in fp32 (its assembled state and the slice being
  read) and about four chunks (the chunk being decoded, its compressed bytes and byte planes),

whatever the size of the optimizer state (`nvcomp-ckpt to-universal` also makes glibc return
freed buffers, see `cli.to_universal._map_large_buffers`). Where nvCOMP codes the files, a parameter also
passes through pinned memory: about twice its compressed size while it is read, and at most
4 x `GPU_BATCH_MB` per worker while it is written. With ZeRO-3, ``zero/optimizer_state.pt``
holds rank 0's whole optimizer state (DeepSpeed's converter copies it there); its stored bytes
are copied chunk by chunk, without decoding (`LazyShard.copy`).

What ds_to_universal needs but a DeepSpeed checkpoint of a model without Megatron's metadata
lacks -- ``universal_checkpoint_info`` -- is supplied as its ``--inject_missing_state`` does.
Supported: ZeRO stages 1, 2 (also DeepSpeed's BF16_Optimizer) and 3, any data-parallel size,
without tensor or pipeline parallelism, MoE, or tensor-parallel merge metadata; anything else is
refused with `UnsupportedCheckpointError` naming DeepSpeed's own route.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import logging
import math
import re
import reprlib
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.checkpoint import constants as ds

from .. import api, commit, discovery, manifest, pipeline
from .._version import __version__
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..lazy import LazyShard, TensorRef
from ..options import DEFAULT_CHUNK_MB
from ..storage import open_storage
from ..tagreader import TagReader
from . import _compat

logger = logging.getLogger(__name__)

#: The pointer file DeepSpeed's universal load reads instead of ``latest``.
LATEST_UNIVERSAL = discovery.LATEST_UNIVERSAL_NAME
#: The folder of per-parameter files inside the tag folder.
ZERO_DIR = "zero"
#: Raw MiB per nvCOMP call when a file is compressed on the GPU: a quarter of a save's default,
#: since `workers` files are written at once (each holds up to 4 batches of pinned memory).
GPU_BATCH_MB = 64
#: The optimizer states DeepSpeed's converter writes per parameter (Adam's, and the master).
STATES = ("fp32", "exp_avg", "exp_avg_sq")
#: universal_checkpoint_info keys that only say which version wrote it (anything else is
#: tensor-parallel merge metadata, which this converter does not apply).
_PLAIN_INFO_KEYS = {ds.UNIVERSAL_CHECKPOINT_VERSION_KEY}
#: The most elements a parameter's shape may say (the format's own bound, `container`'s).
_MAX_NUMEL = (1 << 63) - 1

_OPTIM = re.compile(r"(?P<prefix>(?:bf16_|fp16_)?)zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt")
_MODEL = re.compile(r"mp_rank_(?P<mp>\d+)_model_states\.pt")
#: DeepSpeed's order of preference among optimizer-file prefixes (reshape_utils.get_zero_files).
_PREFIXES = ("", "fp16_", "bf16_")


@dataclasses.dataclass(frozen=True)
class Converted:
    """What `convert` wrote: the tag folder, its manifest, and the source's layout."""

    tag_dir: Path
    manifest: manifest.Manifest
    zero_stage: int
    dp_size: int
    parameters: int


@dataclasses.dataclass(frozen=True)
class _Fragment:
    """One rank's slice of a parameter: elements [start, start + numel) of its flat partitions."""

    rank: int
    group: int
    start: int
    numel: int


class _Output:
    """The universal tag folder being written: every file a shard of ours, every record kept
    for the manifest."""

    def __init__(self, out_dir: Path, tag: str, options: dict[str, Any]) -> None:
        self.tag_dir = commit.prepare_tag_dir(out_dir, tag, rank=0).tag_dir
        self.options = options
        self.records: list[manifest.ShardRecord] = []
        self._lock = threading.Lock()

    def _target(self, relative: str) -> Path:
        path = self.tag_dir / manifest.validate_relative_path(relative)
        folder = Path(relative).parent.as_posix()
        if folder != ".":
            open_storage(self.tag_dir).ensure_prefix(folder)
        return path

    def _record(self, relative: str, info: api.ShardInfo) -> None:
        record = manifest.ShardRecord(path=relative, rank=0, raw_bytes=info.raw_bytes,
                                      file_bytes=info.file_bytes, crc32=info.crc32,
                                      codecs=info.codecs, io=info.io)
        with self._lock:
            self.records.append(record)

    def save(self, obj: Any, relative: str) -> None:
        self._record(relative, api.save(obj, self._target(relative), **self.options))

    def copy(self, shard: LazyShard, obj: Any, relative: str) -> None:
        self._record(relative, shard.copy(obj, self._target(relative)))


def convert(
    tag_dir: str | Path,
    out_dir: str | Path,
    *,
    trusted: bool = False,
    workers: int = 4,
    algorithm: str = "auto",
    portable: bool = False,
    chunk_mb: float = DEFAULT_CHUNK_MB,
    progress: Callable[[Iterable[Any], int], Iterable[Any]] | None = None,
) -> Converted:
    """Write the universal checkpoint of the complete checkpoint in `tag_dir` to
    ``out_dir/<tag>/``, then its manifest, then ``out_dir/latest_universal``.

    `workers` parameters are converted at once (each holds up to twice its fp32 size in memory);
    `algorithm`, `portable` and `chunk_mb` are `nvcomp_ckpt_engine.save`'s. `progress`, if
    given, wraps the iteration over parameters (e.g. a progress bar: ``(items, total)``).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    _compat.check_version()  # the layout written is DeepSpeed 0.19's
    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    try:
        return _convert(tag_dir, out_dir, trusted=trusted, workers=workers, algorithm=algorithm,
                        portable=portable, chunk_mb=chunk_mb, progress=progress)
    except _UNANTICIPATED as exc:  # a layout no check below foresaw: still the checkpoint's fault
        raise CorruptCheckpointError(
            f"{tag_dir}: not a layout DeepSpeed writes ({type(exc).__name__}: {exc})") from exc


#: What reading a layout no check foresaw may raise (a value of another type, a missing key, an
#: arithmetic on nonsense, torch refusing a tensor, a nest too deep to walk): `convert` says it
#: is the checkpoint's fault, naming its folder, rather than let a traceback out.
_UNANTICIPATED = (AttributeError, KeyError, IndexError, TypeError, ValueError, ZeroDivisionError,
                  OverflowError, RecursionError, RuntimeError)


def _convert(tag_dir: Path, out_dir: Path, *, trusted: bool, workers: int, algorithm: str,
             portable: bool, chunk_mb: float,
             progress: Callable[[Iterable[Any], int], Iterable[Any]] | None) -> Converted:
    reader = TagReader(tag_dir, trusted=trusted)
    optim_files, stage = _optimizer_files(reader)
    # The parameters in flight share the cores (and the GPU's staging memory) between them.
    output = _Output(out_dir, tag_dir.name, {
        "algorithm": algorithm, "portable": portable, "chunk_mb": chunk_mb,
        "workers": max(1, pipeline.default_workers() // workers), "gpu_batch_mb": GPU_BATCH_MB})
    with cf.ThreadPoolExecutor(pipeline.default_workers(), thread_name_prefix="nvckpt-decode") as pool:
        shards = [reader.open_lazy(relative, pool=pool) for relative in optim_files]
        try:
            convert_stage = _convert_zero12 if stage <= 2 else _convert_zero3
            parameters = convert_stage(reader, shards, output, workers=workers, progress=progress)
        finally:
            for shard in shards:
                shard.close()
    found = manifest.build_manifest(
        tag=tag_dir.name, world_size=1, files=output.records, step=reader.manifest.step,
        layout=manifest.layout_record(
            "deepspeed", kind=manifest.UNIVERSAL_LAYOUT_KIND, zero_stage=stage,
            source_dp=len(optim_files), source_tp=1, source_pp=1),
        versions={"nvcomp_ckpt_engine": __version__, "deepspeed": deepspeed.__version__,
                  "torch": torch.__version__},
        created_unix_ns=time.time_ns(),
    )
    # Written last: the folder is a complete checkpoint from here on, and only then named.
    manifest.write_manifest(output.tag_dir, found)
    discovery.write_latest(out_dir, tag_dir.name, name=LATEST_UNIVERSAL)
    return Converted(output.tag_dir, found, stage, len(optim_files), parameters)


def is_universal(found: manifest.Manifest) -> bool:
    """True for the manifest of a universal checkpoint that `convert` wrote (its layout's
    `kind` tells it apart from the checkpoint it was made from)."""
    return found.layout.get("kind") == manifest.UNIVERSAL_LAYOUT_KIND


# ------------------------------------------------------------------------------ the source


def _refuse(what: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"{what}; nvcomp-ckpt to-universal converts data-parallel ZeRO checkpoints only. Use "
        "DeepSpeed's own route: `nvcomp-ckpt decompress CKPT OUT`, then `python -m "
        "deepspeed.checkpoint.ds_to_universal --input_folder OUT/TAG --output_folder "
        "UNIVERSAL/TAG --inject_missing_state`"
    )


def _optimizer_files(reader: TagReader) -> tuple[list[str], int]:
    """The optimizer files in data-parallel rank order, and the ZeRO stage they were saved at.

    Refuses what the conversion does not cover (tensor or pipeline parallelism, MoE, files it
    does not know) before anything is written.
    """
    by_prefix: dict[str, dict[int, str]] = {}
    unknown = []
    for relative in reader.paths:
        known = _OPTIM.fullmatch(relative) or _MODEL.fullmatch(relative) or _ZERO3_MODEL.fullmatch(relative)
        if known is None:
            unknown.append(relative)
            continue
        if int(known["mp"]) != 0:
            raise _refuse(f"{reader.tag_dir} holds {relative}: tensor parallelism")
        if known.re is _OPTIM:
            by_prefix.setdefault(known["prefix"], {})[int(known["dp"])] = relative
    if unknown:
        what = ("pipeline-parallel or MoE layer files" if any(n.startswith(("layer_", "expp_"))
                                                              for n in unknown) else "files")
        raise _refuse(f"{reader.tag_dir} holds {what} this conversion does not know: "
                      f"{', '.join(sorted(unknown)[:5])}")
    prefix = next((p for p in _PREFIXES if p in by_prefix), None)
    if prefix is None:
        raise _refuse(f"{reader.tag_dir} holds no ZeRO optimizer files, so no partitions to "
                      "put together")
    ranks = by_prefix[prefix]
    if max(ranks) + 1 != len(ranks):  # the first few absent ranks (file names may say any rank)
        missing = list(itertools.islice((r for r in range(max(ranks)) if r not in ranks), 8))
        raise CorruptCheckpointError(f"{reader.tag_dir}: the optimizer files of data-parallel "
                                     f"rank(s) {missing} are missing")
    files = [ranks[rank] for rank in range(len(ranks))]
    with reader.open_lazy(files[0]) as first:
        stage = _optimizer_state(first, first.path).get(ds.ZERO_STAGE, 1)
        if not _is_int(stage) or stage not in (1, 2, 3):
            raise CorruptCheckpointError(f"{first.path}: {ds.ZERO_STAGE!r} is "
                                         f"{reprlib.repr(stage)}, not a ZeRO stage (1, 2 or 3)")
    return files, int(stage)


def _optimizer_state(shard: LazyShard, relative: str) -> dict[str, Any]:
    state = shard.obj.get(ds.OPTIMIZER_STATE_DICT) if isinstance(shard.obj, dict) else None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{relative}: no {ds.OPTIMIZER_STATE_DICT!r} in this "
                                     "DeepSpeed optimizer file")
    return state


def _check_info(model_states: dict[str, Any], relative: str) -> None:
    """Refuse tensor-parallel merge metadata; a missing info is what --inject_missing_state adds."""
    info = _dict_entry(model_states, ds.UNIVERSAL_CHECKPOINT_INFO, relative)
    merge_rules = sorted(str(key) for key, value in info.items()
                         if key not in _PLAIN_INFO_KEYS and not _empty(value))
    if merge_rules:
        raise _refuse(f"{relative} carries tensor-parallel merge metadata in "
                      f"{ds.UNIVERSAL_CHECKPOINT_INFO} ({', '.join(merge_rules)})")
    dims = _dict_entry(model_states, ds.CHECKPOINT_PARALLEL_DIMS, relative)
    for key in (ds.CHECKPOINT_TP_DEGREE, ds.CHECKPOINT_PP_DEGREE):
        degree = dims.get(key, 1)
        if not _is_int(degree):
            raise CorruptCheckpointError(f"{relative}: {key} is {reprlib.repr(degree)}, not a "
                                         "number")
        if degree != 1:
            raise _refuse(f"{relative} was saved with {key} {degree}")
    if not (_empty(model_states.get(ds.AUTOEP_LAYERS_KEY))
            and _empty(model_states.get(ds.AUTOEP_LAYERS_KEY_LEGACY))):
        raise _refuse(f"{relative} holds AutoEP (MoE) layers")


def _param_shapes(model_states: dict[str, Any], relative: str) -> list[dict[str, tuple[int, ...]]]:
    """Each param group's parameters and shapes, checked: names that are folder names, each
    once, and shapes of elements that can exist."""
    groups = model_states.get(ds.PARAM_SHAPES)
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        raise CorruptCheckpointError(f"{relative}: {ds.PARAM_SHAPES!r} is not a list of "
                                     "dicts (name -> shape)")
    checked: list[dict[str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            _check_name(name, relative)
            if name in seen:
                raise CorruptCheckpointError(f"{relative}: parameter {name!r} is in "
                                             f"{ds.PARAM_SHAPES!r} twice")
            seen.add(name)
            if (not isinstance(shape, (tuple, list))
                    or not all(_is_int(n) and n >= 0 for n in shape)
                    or math.prod(shape) > _MAX_NUMEL):
                raise CorruptCheckpointError(f"{relative}: the shape of parameter {name!r} is "
                                             f"{reprlib.repr(shape)}, not a tensor's shape")
            shapes[name] = tuple(int(n) for n in shape)
        checked.append(shapes)
    return checked


def _check_name(name: Any, relative: str) -> None:
    """A parameter's name names its folder of the universal checkpoint: one plain folder name."""
    try:
        if not isinstance(name, str) or "/" in name:
            raise ValueError("not a folder name")
        manifest.validate_relative_path(f"{ZERO_DIR}/{name}/fp32.pt")
    except (TypeError, ValueError):
        raise CorruptCheckpointError(f"{relative}: parameter name {reprlib.repr(name)} cannot "
                                     "name a folder of the universal checkpoint") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _empty(value: Any) -> bool:
    """What DeepSpeed writes for "none" (absent, None, an empty list or dict); a tensor or any
    other value is not."""
    return value is None or value is False or (isinstance(value, (list, tuple, dict)) and not value)


def _dict_entry(obj: dict[str, Any], key: str, relative: str) -> dict[Any, Any]:
    """`obj[key]`: a dict, or {} where DeepSpeed wrote none."""
    value = obj.get(key)
    if _empty(value):
        return {}
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{relative}: {key!r} is a {type(value).__name__}, not a dict")
    return value


def _dp_check(model_states: dict[str, Any], relative: str, dp: int) -> None:
    saved = model_states.get("dp_world_size")
    if isinstance(saved, int) and saved != dp:
        raise CorruptCheckpointError(f"{relative} says data-parallel size {saved}, but the "
                                     f"checkpoint holds the optimizer files of {dp} ranks")


# ------------------------------------------------------------------------------ ZeRO-1 and 2


def _convert_zero12(reader: TagReader, shards: list[LazyShard], output: _Output, *, workers: int,
                    progress: Any) -> int:
    """ds_to_universal's stage <= 2 branch: fragments per rank from `param_slice_mappings`."""
    fragments = _fragments_zero12(shards)
    model_file = "mp_rank_00_model_states.pt"
    if model_file not in reader.paths:
        raise CorruptCheckpointError(f"{reader.tag_dir}: the manifest lists no {model_file}")
    model_states = reader.load(model_file)
    if not isinstance(model_states, dict):
        raise CorruptCheckpointError(f"{model_file}: not a DeepSpeed model-states dict")
    _check_info(model_states, model_file)
    _dp_check(model_states, model_file, len(shards))
    shapes: dict[str, tuple[int, ...]] = {}
    for group in _param_shapes(model_states, model_file):
        shapes.update(group)
    output.save(model_states, model_file)
    merged = {name for name in shapes if fragments.get(name)}
    # ZeRO holds no optimizer state for what trains nothing (frozen parameters, buffers):
    # DeepSpeed's converter gives them an fp32.pt from the module's weights.
    module = _dict_entry(model_states, "module", model_file)
    fallback = {name: tensor for name, tensor in module.items() if name not in merged}
    for name, tensor in fallback.items():
        _check_name(name, model_file)
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{model_file}: module entry {name!r} is a "
                                         f"{type(tensor).__name__}, not a tensor")
    del model_states, module
    for name, tensor in fallback.items():
        output.save({ds.PARAM: tensor.float()}, f"{ZERO_DIR}/{name}/fp32.pt")
    del fallback

    source = str(reader.tag_dir / model_file)
    _run(lambda name: _write_parameter_zero12(shards, output, name, shapes[name], fragments[name],
                                              source),
         [name for name in shapes if name in merged], workers, progress)
    _write_optimizer_state_zero12(shards[0], output, len(shards))
    return len(merged)


def _fragments_zero12(shards: list[LazyShard]) -> dict[str, list[_Fragment]]:
    """Every parameter's fragments, in data-parallel rank order, from each rank's
    `param_slice_mappings` (checked against the partitions it holds: `_check_partitions`)."""
    fragments: dict[str, list[_Fragment]] = {}
    for rank, shard in enumerate(shards):
        mappings = _check_partitions(shard)
        for group, mapping in enumerate(mappings):
            for name, address in mapping.items():
                start, numel = getattr(address, "start", None), getattr(address, "numel", None)
                if not (isinstance(name, str) and _is_int(start) and _is_int(numel)
                        and start >= 0 and numel >= 0):
                    raise CorruptCheckpointError(
                        f"{shard.path}: {ds.PARAM_SLICE_MAPPINGS!r} of param group {group} maps "
                        f"{reprlib.repr(name)} to {reprlib.repr(address)}, not a fragment address")
                fragments.setdefault(name, []).append(_Fragment(rank, group, start, numel))
    return fragments


def _check_partitions(shard: LazyShard) -> list[dict[Any, Any]]:
    """A ZeRO-1/2 optimizer file's `param_slice_mappings`, once its structure is what the
    conversion reads: per param group a mapping, an fp32 partition and an optimizer state, and
    the param groups."""
    state = _optimizer_state(shard, shard.path)
    mappings = state.get(ds.PARAM_SLICE_MAPPINGS)
    base = state.get(ds.BASE_OPTIMIZER_STATE)
    groups = base.get("state") if isinstance(base, dict) else None
    if not isinstance(mappings, list) or not isinstance(groups, dict):
        raise UnsupportedCheckpointError(
            f"{shard.path}: no {ds.PARAM_SLICE_MAPPINGS!r} or per-group optimizer 'state' "
            "(a checkpoint saved with zero_optimization.elastic_checkpoint, or by a "
            "DeepSpeed older than 0.10); DeepSpeed's universal conversion needs both")
    partitions = state.get(ds.SINGLE_PARTITION_OF_FP32_GROUPS)
    if not isinstance(partitions, list) or len(partitions) != len(mappings):
        raise CorruptCheckpointError(
            f"{shard.path}: {ds.SINGLE_PARTITION_OF_FP32_GROUPS!r} is not a list of one "
            f"partition per param group of {ds.PARAM_SLICE_MAPPINGS!r} ({len(mappings)})")
    for group, mapping in enumerate(mappings):
        if not isinstance(mapping, dict) or not isinstance(groups.get(group), dict):
            raise CorruptCheckpointError(
                f"{shard.path}: param group {group} has no mapping of parameters to fragments "
                "or no optimizer state")
    if not isinstance(base.get(ds.PARAM_GROUPS), list):
        raise CorruptCheckpointError(f"{shard.path}: the optimizer state has no list of "
                                     f"{ds.PARAM_GROUPS!r}")
    return mappings


#: Where a ZeRO optimizer file keeps its flat fp32 partitions and the optimizer state holding
#: the moments, per stage family: ZeRO-1/2 (and BF16_Optimizer), and ZeRO-3.
_ZERO12_KEYS = (ds.SINGLE_PARTITION_OF_FP32_GROUPS, ds.BASE_OPTIMIZER_STATE)
_ZERO3_KEYS = (ds.FP32_FLAT_GROUPS, ds.OPTIMIZER_STATE_DICT)


def _source_tensor(shard: LazyShard, group: int, state_name: str, keys: tuple[str, str]) -> TensorRef:
    """The flat tensor of param group `group` holding `state_name` in `shard`'s optimizer file."""
    fp32_key, optimizer_key = keys
    state = _optimizer_state(shard, shard.path)
    try:
        if state_name == "fp32":
            ref = state[fp32_key][group]
        else:
            ref = state[optimizer_key]["state"][group][state_name]
    except (KeyError, IndexError, TypeError):
        raise UnsupportedCheckpointError(
            f"{shard.path}: param group {group} holds no {state_name!r} state; DeepSpeed's "
            f"universal checkpoints carry {', '.join(STATES)} (Adam-style optimizers)") from None
    if not isinstance(ref, TensorRef):
        raise CorruptCheckpointError(f"{shard.path}: {state_name!r} of param group {group} is a "
                                     f"{type(ref).__name__}, not a tensor")
    return ref


def _write_states(shards: list[LazyShard], output: _Output, name: str,
                  fragments: list[_Fragment], keys: tuple[str, str],
                  shape: tuple[int, ...] | None = None, source: str = "") -> None:
    """The parameter's fp32, exp_avg and exp_avg_sq files: its fragments gathered from every
    rank; with `shape` (ZeRO-1/2) as ``{"cat_dim": 0, "param": tensor of that shape}``, without
    (ZeRO-3) as the flat tensor itself, as DeepSpeed's converter writes each. `source`: the
    file that gave the shape."""
    for state_name in STATES:
        refs = [(f, _source_tensor(shards[f.rank], f.group, state_name, keys)) for f in fragments]
        flat = _gather(shards, refs, name)
        obj = flat if shape is None else {ds.CAT_DIM: 0,
                                          ds.PARAM: _shaped(flat, shape, name, source)}
        output.save(obj, f"{ZERO_DIR}/{name}/{state_name}.pt")


def _gather(shards: list[LazyShard], refs: list[tuple[_Fragment, TensorRef]], name: str) -> torch.Tensor:
    """The parameter's flat state: its fragments read from each rank, in rank order."""
    pieces = []
    for fragment, ref in refs:
        if fragment.start < 0 or fragment.start + fragment.numel > ref.numel:
            raise CorruptCheckpointError(
                f"{shards[fragment.rank].path}: the fragment of {name!r} at [{fragment.start}, "
                f"{fragment.start + fragment.numel}) lies outside its partition of {ref.numel}")
        pieces.append(shards[fragment.rank].read(ref, fragment.start, fragment.numel))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _shaped(flat: torch.Tensor, shape: tuple[int, ...], name: str, source: str) -> torch.Tensor:
    if flat.numel() != math.prod(shape):
        raise CorruptCheckpointError(f"{source}: parameter {name!r} has shape {shape}, "
                                     f"{math.prod(shape)} elements; the optimizer files hold "
                                     f"{flat.numel()} of it")
    return flat.view(shape)


def _write_parameter_zero12(shards: list[LazyShard], output: _Output, name: str,
                            shape: tuple[int, ...], fragments: list[_Fragment], source: str) -> None:
    steps = []
    for fragment in fragments:
        shard = shards[fragment.rank]
        group_state = _optimizer_state(shard, shard.path)[ds.BASE_OPTIMIZER_STATE]["state"][fragment.group]
        if "step" in group_state:
            step = shard.materialize(group_state["step"])
            if not isinstance(step, (torch.Tensor, int, float)) or isinstance(step, bool):
                raise CorruptCheckpointError(f"{shard.path}: the optimizer step of param group "
                                             f"{fragment.group} is a {type(step).__name__}")
            steps.append(step)
    if steps:
        if not all(_same_value(step, steps[0]) for step in steps):
            holders = ", ".join(shards[f.rank].path for f in fragments)
            raise CorruptCheckpointError(f"{holders}: the ranks holding parameter {name!r} "
                                         f"disagree on the optimizer step ({reprlib.repr(steps)})")
        output.save(steps[0], f"{ZERO_DIR}/{name}/step.pt")
    _write_states(shards, output, name, fragments, _ZERO12_KEYS, shape, source)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def _write_optimizer_state_zero12(first: LazyShard, output: _Output, dp: int) -> None:
    """Rank 0's optimizer globals, as `DeepSpeedCheckpoint.get_zero_checkpoint_state` gives
    them (partition counts set to the data-parallel size, group paddings cleared), without
    the partitioned tensors, plus the param groups."""
    state = _optimizer_state(first, first.path)
    sharded = (ds.BASE_OPTIMIZER_STATE, ds.PARAM_SLICE_MAPPINGS, ds.SINGLE_PARTITION_OF_FP32_GROUPS)
    globals_: dict[str, Any] = {}
    for key, value in state.items():
        if key in sharded:
            continue
        if key in (ds.PARTITION_COUNT, ds.GROUP_PADDINGS) and not _empty(value):
            if not isinstance(value, (list, tuple)):
                raise CorruptCheckpointError(f"{first.path}: {key!r} is not a list per param group")
            value = [dp if key == ds.PARTITION_COUNT else 0] * len(value)
        globals_[key] = value
    globals_[ds.PARAM_GROUPS] = state[ds.BASE_OPTIMIZER_STATE][ds.PARAM_GROUPS]
    output.save(first.materialize(globals_), f"{ZERO_DIR}/optimizer_state.pt")


# ------------------------------------------------------------------------------------ ZeRO-3


def _convert_zero3(reader: TagReader, shards: list[LazyShard], output: _Output, *, workers: int,
                   progress: Any) -> int:
    """ds_to_universal's stage-3 branch: each rank holds a 1/dp slice of every parameter."""
    dp = len(shards)
    model_files = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(dp)]
    missing = [name for name in model_files if name not in reader.paths]
    if missing:
        raise CorruptCheckpointError(f"{reader.tag_dir}: model-states files missing: {missing}")
    groups: list[dict[str, Any]] = []
    for rank, model_file in enumerate(model_files):
        model_states = reader.load(model_file)
        if not isinstance(model_states, dict):
            raise CorruptCheckpointError(f"{model_file}: not a DeepSpeed model-states dict")
        _check_info(model_states, model_file)
        _dp_check(model_states, model_file, dp)
        if rank == 0:
            groups = _param_shapes(model_states, model_file)
        output.save(model_states, model_file)
        del model_states
    fragments = _fragments_zero3(shards, groups)
    names = [name for group in groups for name in group]

    _run(lambda name: _write_states(shards, output, name, fragments[name], _ZERO3_KEYS),
         names, workers, progress)
    first = _optimizer_state(shards[0], shards[0].path)
    inner = first.get(ds.OPTIMIZER_STATE_DICT)
    if not isinstance(inner, dict) or ds.PARAM_GROUPS not in inner:
        raise CorruptCheckpointError(f"{shards[0].path}: no inner optimizer state dict")
    output.copy(shards[0], {**first, ds.PARAM_GROUPS: inner[ds.PARAM_GROUPS]},
                f"{ZERO_DIR}/optimizer_state.pt")
    return len(names)


def _fragments_zero3(shards: list[LazyShard], groups: list[dict[str, Any]]
                     ) -> dict[str, list[_Fragment]]:
    """Each parameter's slice on every rank, in rank order: ZeRO-3 pads a parameter to a
    multiple of the partition count and gives each rank one equal part of it."""
    fragments: dict[str, list[_Fragment]] = {}
    for rank, shard in enumerate(shards):
        partition_groups = _optimizer_state(shard, shard.path).get("ds_zero_partition_groups")
        partition_groups = [] if _empty(partition_groups) else partition_groups
        if not isinstance(partition_groups, list):
            raise CorruptCheckpointError(f"{shard.path}: 'ds_zero_partition_groups' is a "
                                         f"{type(partition_groups).__name__}, not a list")
        for group, shapes in enumerate(groups):
            meta = partition_groups[group] if group < len(partition_groups) else {}
            count = meta.get("partition_count", len(shards)) if isinstance(meta, dict) else None
            part = meta.get("partition_rank", rank) if isinstance(meta, dict) else None
            if not (_is_int(count) and _is_int(part) and 0 <= part < count):
                raise CorruptCheckpointError(
                    f"{shard.path}: param group {group}'s partition is {reprlib.repr(meta)}, not "
                    "a rank among a partition count")
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                per_rank = -(-numel // count)  # exact, for any size
                length = max(0, min(per_rank, numel - part * per_rank))
                fragments.setdefault(name, []).append(_Fragment(rank, group, offset, length))
                offset += per_rank
    return fragments


# ----------------------------------------------------------------------------------- helpers


def _run(work: Callable[[str], None], names: list[str], workers: int, progress: Any) -> None:
    """`work(name)` for every name, `workers` at a time; the first failure is raised."""
    with cf.ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-universal") as pool:
        futures = [pool.submit(work, name) for name in names]
        done = cf.as_completed(futures)
        try:
            for future in (progress(done, len(futures)) if progress else done):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
