"""Everything the adapter knows about DeepSpeed's internals, in one place.

DeepSpeed offers no public way to learn a few things the engine needs: the raw ds_config dict
(`DeepSpeedConfig._param_dict`), the parallel layout (`deepspeed.utils.groups`' underscore
helpers, which DeepSpeed's engine itself uses), and which method is calling the checkpoint
engine (`save_checkpoint`, or the `save_16bit_model` export that goes through the same engine;
`_get_all_zero_checkpoint_state_dicts`, the load of ZeRO optimizer shards).
This module reads them for DeepSpeed 0.19.x, the series the adapter is tested with; another
version gets one warning and the same code, which then fails loudly where an internal moved.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import glob
import inspect
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils import groups

from .. import manifest
from ..errors import DataParallelSizeError, UnsupportedCheckpointError
from ..storage import locations, open_storage

logger = logging.getLogger(__name__)

#: The DeepSpeed series whose internals this module was written against.
SUPPORTED_SERIES = "0.19."

#: How many frames above the engine method to look for the DeepSpeed method that called it
#: (DeepSpeed calls `create` and `load` directly or through a few of its own functions, and
#: `agreed_load_steps` adds a frame).
_STACK_DEPTH = 24


@functools.cache
def check_version() -> None:
    """Warn once if the installed DeepSpeed is not the series this adapter was tested with."""
    if not deepspeed.__version__.startswith(SUPPORTED_SERIES):
        logger.warning(
            "nvcomp_ckpt_engine's DeepSpeed adapter is tested with DeepSpeed %sx; this is %s. "
            "If checkpointing fails, pin deepspeed>=0.19,<0.20.",
            SUPPORTED_SERIES, deepspeed.__version__,
        )


def raw_config(config_params: Any) -> Mapping[str, Any] | None:
    """The ds_config dict a `DeepSpeedConfig` was built from, or None if it is not readable."""
    raw = getattr(config_params, "_param_dict", None)
    return raw if isinstance(raw, Mapping) else None


def engine_config(engine: DeepSpeedEngine) -> Any:
    """The `DeepSpeedConfig` of an initialized engine."""
    return engine._config


def competing_engine(config_params: Any) -> str | None:
    """The ds_config setting that asks for another checkpoint engine, if any."""
    from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_WRITER

    checkpoint_config = getattr(config_params, "checkpoint_config", None) or {}
    if checkpoint_config.get(CHECKPOINT_WRITER) is not None:
        return '"checkpoint": {"writer": ...} (DeepSpeed\'s FastCheckpointEngine)'
    datastates = getattr(config_params, "datastates_config", None)
    if datastates is not None and getattr(datastates, "enabled", False):
        return '"datastates_ckpt" (the DataStates engine)'
    return None


def zipfile_serialization(config_params: Any) -> bool:
    """Whether DeepSpeed's engine would write torch's zip format (``checkpoint_serialization``)."""
    from deepspeed.runtime.model_checkpointing import CHECKPOINT_SERIALIZATION

    checkpoint_config = getattr(config_params, "checkpoint_config", None)
    return bool(checkpoint_config[CHECKPOINT_SERIALIZATION]) if checkpoint_config else False


def load_universal(config_params: Any) -> bool:
    """``"checkpoint": {"load_universal": true}``: loads read a universal checkpoint."""
    return bool(getattr(config_params, "load_universal_checkpoint", False))


def node_local_storage(config_params: Any) -> bool:
    """``checkpoint.use_node_local_storage``: each node saves its ranks' files on its own disk."""
    return bool(getattr(config_params, "use_node_local_storage", False))


def local_rank() -> int:
    """This process's rank on its node (DeepSpeed's view: the launcher's LOCAL_RANK)."""
    from deepspeed import comm

    return comm.get_local_rank()


def local_world_size() -> int:
    """Ranks on this node (they share its host memory), as the launcher says; 1 if unknown.

    torchrun and DeepSpeed's launchers set LOCAL_WORLD_SIZE; Open MPI sets its own variable.
    """
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def versions() -> dict[str, str]:
    """Versions recorded in the manifest, for whoever debugs a load years later."""
    import torch

    return {"deepspeed": deepspeed.__version__, "torch": torch.__version__}


def parallel_layout(zero_stage: int | None) -> dict[str, Any]:
    """The parallel layout a checkpoint is tied to, as DeepSpeed's engine computes it: what a
    save records and a load compares (`manifest.layout_record`, the one builder of it).

    ``dp`` is the sequence-data-parallel size, the one DeepSpeed compares with a checkpoint's
    ``dp_world_size`` before it loads ZeRO shards; ``tp`` the model-parallel size; ``pp`` the
    pipeline stages.
    """
    mpu = getattr(groups, "mpu", None)
    pp = mpu.get_pipe_parallel_world_size() if hasattr(mpu, "get_pipe_parallel_world_size") else 1
    return manifest.layout_record(
        "deepspeed",
        dp=groups._get_sequence_data_parallel_world_size(),
        tp=groups._get_model_parallel_world_size(),
        pp=pp,
        zero_stage=zero_stage if zero_stage is not None else 0,
    )


def _caller_frame(code: CodeType) -> FrameType | None:
    """The nearest frame (within `_STACK_DEPTH` of the caller) running `code`."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def patch_load_checkpoint() -> None:
    """Let an engine that has `run_load` run ``load_checkpoint``: choose its tag, agree on its
    outcome on every rank, fall back.

    DeepSpeed reads ``latest`` itself before the checkpoint engine sees any path, so choosing
    another tag (``fallback_to_complete``, an unusable ``latest``) needs this wrapper around
    `DeepSpeedEngine.load_checkpoint`; and DeepSpeed calls no hook of the checkpoint engine once
    its loads are done, so one verdict on every rank needs it too. For an engine with
    ``run_load(load, load_dir, tag, universal=...)`` the wrapper hands it `load`, DeepSpeed's
    method for a given tag followed by the engine's ``after_load(deepspeed_engine)`` if it has
    one (and, where its ``resizes_zero3(load_dir, tag)`` says so, reading data-parallel rank 0's
    model-states file on every rank, `model_states_of_rank_0`); a `DataParallelSizeError` it
    raises comes out as `ZeroDataParallelSizeError`, DeepSpeed's type for that refusal too. Any
    other engine gets DeepSpeed's method unchanged. Idempotent.
    """
    original = DeepSpeedEngine.load_checkpoint
    if getattr(original, "__wrapped__", None) is not None:
        return

    @functools.wraps(original)
    def load_checkpoint(self: DeepSpeedEngine, load_dir: str, tag: str | None = None, *args: Any,
                        **kwargs: Any) -> Any:
        run_load = getattr(getattr(self, "checkpoint_engine", None), "run_load", None)
        if run_load is None:
            return original(self, load_dir, tag, *args, **kwargs)
        after_load = getattr(self.checkpoint_engine, "after_load", None)
        resizes_zero3 = getattr(self.checkpoint_engine, "resizes_zero3", None)

        def load(chosen: str | None, where: str | None = None) -> Any:
            folder = load_dir if where is None else where  # `where`: the node-local tier's copy
            rank_0 = resizes_zero3 is not None and chosen is not None and resizes_zero3(folder, chosen)
            on_store = locations.is_url(folder)
            with (reads_from_store(self) if on_store else contextlib.nullcontext()), \
                    (model_states_of_rank_0(self) if rank_0 else contextlib.nullcontext()):
                loaded = original(self, folder, chosen, *args, **kwargs)
            if after_load is not None:  # inside the load's agreed end: its failure is agreed too
                after_load(self)
            return loaded

        universal = self.load_universal_checkpoint()
        if universal and locations.is_url(load_dir):
            raise UnsupportedCheckpointError(
                f"{load_dir}: a universal checkpoint is read by DeepSpeed's own loader, which "
                "reads local files only; copy it to a local folder, or load the checkpoint it was "
                "converted from (this engine loads ZeRO-1/2/3 checkpoints at any data-parallel "
                "size)")
        try:
            return run_load(load, load_dir, tag, universal=universal)
        except DataParallelSizeError as exc:
            raise ZeroDataParallelSizeError.of(exc) from exc

    DeepSpeedEngine.load_checkpoint = load_checkpoint


def patch_save_checkpoint() -> None:
    """Keep DeepSpeed's ``save_checkpoint`` from writing where it cannot, for an engine that
    moves ``latest`` itself.

    DeepSpeed itself writes two kinds of files into ``save_dir`` with `open`:

    - ``latest``, right after the checkpoint engine's commit (and at the decoupled commit of an
      async save). With the node-local tier (``keeps_latest()`` true) the commit is local, and
      ``save_dir`` holds the tag only once the drain has committed its persistent copy:
      DeepSpeed's ``latest`` would name a tag ``save_dir`` does not hold yet; the engine is told
      what the caller asked (``want_latest(save_latest)``) and moves it after the drain. For an
      object-store URL (``s3://bucket/prefix``, an engine with ``latest_on_store``), which `open`
      would take for the local path ``s3:/bucket/...``, the engine is told the same in a context
      manager around the call (``latest_on_store(save_latest)``) and publishes ``latest``
      through the storage after its commit. Either way DeepSpeed runs with ``save_latest=False``.
    - the recovery scripts (``zero_to_fp32.py``, ``zero_to_torch.py``), which rank 0 copies into
      the save folder with their executable bit: not copied to a store, which holds no mode
      (``nvcomp-ckpt zero-to-fp32 URL OUT`` does their job).

    ``destroy()`` also calls a tier engine's ``cleanup()`` (which commits the drain in
    progress), as DeepSpeed does for decoupled engines alone. A path, or another engine, gets
    DeepSpeed's methods unchanged. Idempotent.
    """
    original = DeepSpeedEngine.save_checkpoint
    if getattr(original, "__wrapped__", None) is None:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def save_checkpoint(self: DeepSpeedEngine, save_dir: str, *args: Any, **kwargs: Any) -> Any:
            engine = getattr(self, "checkpoint_engine", None)
            keeps = getattr(engine, "keeps_latest", None)
            tier_keeps = keeps is not None and keeps()
            latest_on_store = getattr(engine, "latest_on_store", None)
            on_store = latest_on_store is not None and locations.is_url(save_dir)
            if not (tier_keeps or on_store):
                return original(self, save_dir, *args, **kwargs)
            bound = signature.bind(self, save_dir, *args, **kwargs)
            bound.apply_defaults()
            wanted, bound.arguments["save_latest"] = bool(bound.arguments["save_latest"]), False
            if tier_keeps:
                engine.want_latest(wanted)
                return original(*bound.args, **bound.kwargs)
            with latest_on_store(wanted):
                return original(*bound.args, **bound.kwargs)

        DeepSpeedEngine.save_checkpoint = save_checkpoint
    original_destroy = DeepSpeedEngine.destroy
    if getattr(original_destroy, "__wrapped__", None) is None:

        @functools.wraps(original_destroy)
        def destroy(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> Any:
            # DeepSpeed's destroy() calls cleanup() of decoupled engines only; the drain of a
            # synchronous engine's last checkpoint is committed there too.
            engine = getattr(self, "checkpoint_engine", None)
            keeps = getattr(engine, "keeps_latest", None)
            if keeps is not None and keeps() and not engine.is_decoupled():
                engine.cleanup()
            return original_destroy(self, *args, **kwargs)

        DeepSpeedEngine.destroy = destroy
    copy_scripts = DeepSpeedEngine._copy_recovery_script
    if getattr(copy_scripts, "__wrapped__", None) is None:

        @functools.wraps(copy_scripts)
        def copy_recovery_script(self: DeepSpeedEngine, save_path: str) -> Any:
            if locations.is_url(save_path):
                logger.debug("%s: DeepSpeed's recovery scripts are not copied to an object store", save_path)
                return None
            return copy_scripts(self, save_path)

        DeepSpeedEngine._copy_recovery_script = copy_recovery_script


def find_files(pattern: str) -> list[str]:
    """DeepSpeed's glob of its own file names (``TAG/mp_rank_*_model_states.pt``), sorted:
    `glob.glob` for a path; for a URL, the storage's listing of the pattern's folder, its
    objects matched by name (DeepSpeed's patterns hold wildcards in the file name only)."""
    if not locations.is_url(pattern):
        return sorted(glob.glob(pattern))
    folder, _, name = pattern.rpartition("/")
    return sorted(f"{folder}/{entry.key}" for entry in open_storage(folder).list("")
                  if not entry.is_prefix and fnmatch.fnmatchcase(entry.key, name))


class _StorePath:
    """`os.path` for DeepSpeed's state-dict loader during a load from a URL: `exists` of a URL
    asks its storage; everything else is `os.path`."""

    @staticmethod
    def exists(where: Any) -> bool:
        if not locations.is_url(where):
            return os.path.exists(where)
        try:
            locations.stat(where)
        except FileNotFoundError:
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(os.path, name)


class _StoreOs:
    """`os` with `_StorePath` as its `path`."""

    path = _StorePath()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


@contextlib.contextmanager
def reads_from_store(engine: DeepSpeedEngine) -> Iterator[None]:
    """Within the block, `engine`'s ``load_checkpoint`` finds its files on an object store: its
    glob of the model-states files lists the storage (`find_files`), and the state-dict loader's
    check that the file it loads exists (``os.path.exists``) asks the storage. The files
    themselves are read by the checkpoint engine, through the storage."""
    from deepspeed.runtime import state_dict_factory

    real_names, real_os = engine._get_all_ckpt_names, state_dict_factory.os

    def all_ckpt_names(checkpoints_path: str, tag: str) -> list[str]:
        return find_files(engine._get_ckpt_name(
            checkpoints_path, tag, mp_placeholder="*",
            pp_placeholder="0" if engine.load_universal_checkpoint() else None))

    engine._get_all_ckpt_names = all_ckpt_names
    state_dict_factory.os = _StoreOs()
    try:
        yield
    finally:
        engine._get_all_ckpt_names = real_names
        state_dict_factory.os = real_os


class ZeroDataParallelSizeError(DataParallelSizeError, ZeRORuntimeException):
    """The engine's refusal of optimizer state at another data-parallel size, as
    ``load_checkpoint`` raises it: also DeepSpeed's own error for that refusal, so a script
    that catches DeepSpeed's `ZeRORuntimeException` catches the engine's."""

    @classmethod
    def of(cls, error: DataParallelSizeError) -> ZeroDataParallelSizeError:
        raised = cls(str(error))
        if hasattr(error, "fault"):  # the verdict every rank agreed on
            raised.fault = error.fault  # type: ignore[attr-defined]
        return raised


def _file_reading_steps() -> list[tuple[Any, str, str]]:
    """(owner, method, step name) of each step of DeepSpeed 0.19's ``load_checkpoint`` that
    reads checkpoint files through the checkpoint engine, each followed by collectives on some
    path (ZeRO's all-gathers of the weights, the next step's own): the model states (and a
    non-ZeRO optimizer, MoE experts), the ZeRO shards, and a universal checkpoint's files (one
    loader for ZeRO-1/2 and BF16_Optimizer, one for ZeRO-3)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    return [
        (DeepSpeedEngine, "_load_checkpoint", "load-model-states"),
        (DeepSpeedEngine, "_get_all_zero_checkpoints", "load-zero-shards"),
        (ZeROOptimizer, "load_hp_checkpoint_state_from_checkpoint_dir", "load-universal"),
        (Stage3, "load_hp_checkpoint_state_from_checkpoint_dir_stage3", "load-universal"),
    ]


@contextlib.contextmanager
def agreed_load_steps(agree: Callable[[str, BaseException | None], None]) -> Iterator[None]:
    """Within the block, each file-reading step of ``load_checkpoint`` (`_file_reading_steps`)
    ends, on every rank, in ``agree(step, error)``: `error` is what the step raised on this rank
    (None: it returned), and `agree` raises on every rank if it failed on any. A rank whose
    step failed so takes part in the agreement instead of leaving the others waiting in
    DeepSpeed's next collective, or returning without it.

    The methods are replaced for the block (on their classes: DeepSpeed calls them by name),
    as `route_universal_loads` replaces `torch.load`.
    """
    originals = []
    for owner, name, step in _file_reading_steps():
        function = owner.__dict__.get(name)
        if function is None:
            continue
        originals.append((owner, name, function))
        setattr(owner, name, _agreed(function, step, agree))
    try:
        yield
    finally:
        for owner, name, function in reversed(originals):
            setattr(owner, name, function)


def _agreed(function: Callable[..., Any], step: str,
            agree: Callable[[str, BaseException | None], None]) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = function(*args, **kwargs)
        except Exception as exc:
            agree(step, exc)  # raises on every rank, this one included
            raise
        agree(step, None)
        return result

    return run


def _running_engine(code: CodeType) -> DeepSpeedEngine | None:
    """The `DeepSpeedEngine` whose method with `code` is on the call stack (None: none is)."""
    frame = _caller_frame(code)
    engine = None if frame is None else frame.f_locals.get("self")
    return engine if isinstance(engine, DeepSpeedEngine) else None


def initializing_engine() -> DeepSpeedEngine | None:
    """The engine whose ``__init__`` (its `_configure_checkpointing`) is building the checkpoint
    engine, if one is: its optimizer exists by then."""
    return _running_engine(DeepSpeedEngine._configure_checkpointing.__code__)


def saving_engine() -> DeepSpeedEngine | None:
    """The engine whose `save_checkpoint` is calling us, if one is."""
    return _running_engine(_save_checkpoint_code())


def loading_engine() -> DeepSpeedEngine | None:
    """The engine whose `load_checkpoint` is calling us, if one is: then every rank runs the same
    loads in the same order, which collectives inside a load need."""
    return _running_engine(_load_checkpoint_code())


@dataclass(frozen=True)
class ZeroGroup:
    """One ZeRO-1/2 parameter group, as the derived module needs it (`deepspeed.module`).

    `flat` is the 16-bit (or fp32) buffer the module's parameters `params` view, in order;
    `partition` this rank's fp32 master partition of it (elements ``[partition_id * size,
    (partition_id + 1) * size)`` of `flat`, size = ``flat.numel() // partition_count``), which
    the rank's ZeRO shard holds at `key`.
    """

    flat: Any
    params: tuple[Any, ...]
    partition: Any
    partition_id: int
    partition_count: int
    key: str

    @property
    def partition_size(self) -> int:
        return self.flat.numel() // self.partition_count


def zero_groups(engine: DeepSpeedEngine) -> list[ZeroGroup] | None:
    """The parameter groups of a ZeRO-1/2 optimizer (DeepSpeed's `DeepSpeedZeroOptimizer` or
    `BF16_Optimizer`), or None for any other optimizer or stage."""
    import deepspeed.comm as dist
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, SINGLE_PARTITION_OF_FP32_GROUPS

    if engine.zero_optimization_stage() not in (1, 2):
        return None
    opt = engine.optimizer
    if hasattr(opt, "bit16_groups_flat") and hasattr(opt, "single_partition_of_fp32_groups"):
        flats, params, parts = opt.bit16_groups_flat, opt.round_robin_bit16_groups, opt.single_partition_of_fp32_groups
    elif hasattr(opt, "bf16_groups_flat") and hasattr(opt, "fp32_groups_flat_partition"):
        flats, params, parts = opt.bf16_groups_flat, opt.bf16_groups, opt.fp32_groups_flat_partition
    else:
        return None
    groups = getattr(opt, "real_dp_process_group", None)
    if groups is None or not len(flats) == len(params) == len(parts) == len(groups):
        return None
    return [
        ZeroGroup(flat, tuple(ps), part, dist.get_rank(group=pg), dist.get_world_size(group=pg),
                  f"{OPTIMIZER_STATE_DICT}/{SINGLE_PARTITION_OF_FP32_GROUPS}/{g}")
        for g, (flat, ps, part, pg) in enumerate(zip(flats, params, parts, groups))
    ]


@dataclass(frozen=True)
class FlatGroup:
    """One param group of DeepSpeed's ZeRO-1/2 optimizer as a reshard sees it: its parameters
    in flat order as (name, shape, dtype, element offset in the flat buffer), the alignment
    its padded size is a multiple of (times the partition count) and each rank's partition
    size."""

    params: tuple[tuple[str, tuple[int, ...], torch.dtype, int | None], ...]
    alignment: int
    partition_size: int


def zero12_flat_groups(engine: DeepSpeedEngine) -> list[FlatGroup] | None:
    """The flat groups of a ZeRO-1/2 optimizer (`DeepSpeedZeroOptimizer`, `BF16_Optimizer`)
    whose partitions are plain cuts of the buffer at the data-parallel size (no round-robin
    order, no per-parameter alignment padding, not DeepSpeed's elastic format, one partition per
    data-parallel rank); None for any other optimizer or layout. An offset is None where a
    parameter is not a contiguous view of its flat buffer."""
    opt = engine.optimizer
    zero = zero_groups(engine)
    if zero is None:
        return None
    if hasattr(opt, "bit16_groups_flat") and (
            opt.round_robin_gradients or opt.elastic_checkpoint
            or any(any(padding) for padding in opt.round_robin_bit16_padding)):
        return None
    dp = groups._get_sequence_data_parallel_world_size()
    names = {id(param): name for name, param in engine.module.named_parameters()}
    found = []
    for group in zero:
        if group.partition_count != dp or any(id(p) not in names for p in group.params):
            return None
        params = []
        for param in group.params:
            same = (param.untyped_storage().data_ptr() == group.flat.untyped_storage().data_ptr()
                    and param.dtype == group.flat.dtype and param.is_contiguous())
            offset = param.storage_offset() - group.flat.storage_offset() if same else None
            params.append((names[id(param)], tuple(param.shape), param.dtype, offset))
        found.append(FlatGroup(tuple(params), int(opt.nccl_start_alignment_factor), group.partition_size))
    return found


def zero3_sub_groups(engine: DeepSpeedEngine) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]] | None:
    """The sub-groups of a ZeRO-3 optimizer (`DeepSpeedZeroOptimizer_Stage3`), each its
    parameters ``(name, shape, dtype)`` in the order of its flat partitions, when every
    parameter is cut into equal parts over the whole data-parallel group (each rank's part
    ``ceil(numel / dp)`` elements) and the fp32 partitions are in memory; None for any other
    optimizer or layout (MiCS, hierarchical or expert partitioning, NVMe-offloaded states)."""
    opt = engine.optimizer
    if not all(hasattr(opt, name) for name in ("fp16_groups", "fp32_partitioned_groups_flat",
                                               "partition_count")):
        return None
    dp = groups._get_sequence_data_parallel_world_size()
    if (opt.partition_count != dp or getattr(opt, "swap_optimizer", False)
            or opt._zero3_partition_group_metadata() is not None
            or len(opt.fp16_groups) != len(opt.fp32_partitioned_groups_flat)):
        return None
    names = {id(param): name for name, param in engine.module.named_parameters()}
    found = []
    for sub_group, flat in zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat):
        params = []
        for param in sub_group:
            numel = int(param.ds_numel)
            if id(param) not in names or int(param.partition_numel()) != -(-numel // dp):
                return None
            params.append((names[id(param)], tuple(param.ds_shape), param.dtype))
        if flat.numel() != sum(-(-math.prod(shape) // dp) for _, shape, _ in params):
            return None
        found.append(params)
    return found


@contextlib.contextmanager
def model_states_of_rank_0(engine: DeepSpeedEngine) -> Iterator[None]:
    """Within the block, a ZeRO-3 engine's load reads data-parallel rank 0's model-states file
    on every rank, as DeepSpeed's universal load does (a rank past the saved size has none)."""
    real = engine._get_all_ckpt_names

    def rank_0(checkpoints_path: str, tag: str) -> list[str]:
        return find_files(engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*",
                                                pp_placeholder="0"))

    engine._get_all_ckpt_names = rank_0
    try:
        yield
    finally:
        engine._get_all_ckpt_names = real


def link_optimizer_states(engine: DeepSpeedEngine) -> None:
    """Point each parameter's optimizer-state fragments at the loaded flat states now, as the
    ZeRO-1/2 optimizer does at its first step and its universal load does at once (so that
    `safe_get_full_optimizer_state` reads them before a step)."""
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        engine.optimizer._hp_optimizer_states_linked = False  # the states were replaced
        link()


def elastic_zero_load(engine: DeepSpeedEngine) -> bool:
    """Whether the engine loads ZeRO checkpoints as DeepSpeed's elastic format (every rank's
    optimizer file read by every rank)."""
    return bool(engine.zero_elastic_checkpoint())


def checkpoint_file_names(engine: DeepSpeedEngine, save_dir: str, tag: str) -> tuple[str, str]:
    """The names of this rank's model-states file and ZeRO shard in a tag folder."""
    return (os.path.basename(engine._get_ckpt_name(save_dir, tag)),
            os.path.basename(engine._get_zero_ckpt_name(save_dir, tag)))


def writes_zero_shard(engine: DeepSpeedEngine) -> bool:
    """Whether this rank writes a ZeRO shard in `save_checkpoint`."""
    return bool(engine.save_zero_checkpoint)


def data_parallel_group(engine: DeepSpeedEngine) -> Any:
    """The process group ZeRO partitions the optimizer state over (None: not a ZeRO engine)."""
    return getattr(engine.optimizer, "dp_process_group", None)


def data_parallel_rank(engine: DeepSpeedEngine) -> int:
    """This rank's place in the group ZeRO partitions the optimizer state over."""
    import deepspeed.comm as dist

    return dist.get_rank(group=data_parallel_group(engine))


def _save_checkpoint_code() -> CodeType:
    """The code of DeepSpeed's own `save_checkpoint`, under our wrapper if it is installed."""
    method = DeepSpeedEngine.save_checkpoint
    return getattr(method, "__wrapped__", method).__code__


def _load_checkpoint_code() -> CodeType:
    """The code of DeepSpeed's own `load_checkpoint`, under our wrapper if it is installed."""
    method = DeepSpeedEngine.load_checkpoint
    return getattr(method, "__wrapped__", method).__code__


def called_from_save_checkpoint() -> bool:
    """True inside `DeepSpeedEngine.save_checkpoint` (also when a subclass calls it via super).

    The same `create`/`save`/`commit` calls also come from `save_16bit_model`, whose file is a
    model export for other tools (HF `from_pretrained`, inference) and must stay a torch file.
    Every rank runs the same method, so every rank takes the same decision.
    """
    return _caller_frame(_save_checkpoint_code()) is not None


def loading_zero_shards() -> bool:
    """True inside `DeepSpeedEngine._get_all_zero_checkpoint_state_dicts`, which loads ZeRO
    optimizer shards (with ``map_location="cpu"``) only to hand them to the ZeRO optimizer's
    ``load_state_dict``."""
    return _caller_frame(DeepSpeedEngine._get_all_zero_checkpoint_state_dicts.__code__) is not None


def optimizer_state_requested() -> bool:
    """False when the current `DeepSpeedEngine.load_checkpoint` call loads module weights only.

    Only then may the data-parallel size differ from the checkpoint's: DeepSpeed re-partitions
    weights but not ZeRO optimizer shards. Outside `load_checkpoint` the answer is True.
    """
    frame = _caller_frame(_load_checkpoint_code())
    if frame is None:
        return True
    args = frame.f_locals
    return bool(args.get("load_optimizer_states", True)) and not args.get("load_module_only", False)


def _universal_loaders() -> frozenset[CodeType]:
    """The functions of DeepSpeed 0.19's universal-checkpoint load that call `torch.load`
    directly instead of through the checkpoint engine: the optimizer's global state
    (``zero/optimizer_state.pt``) and each parameter's files (``zero/PARAM/*.pt``), for
    ZeRO-1/2 and BF16_Optimizer (via `ZeROOptimizer`) and for ZeRO-3."""
    from deepspeed.checkpoint import universal_checkpoint
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    # Unwrapped: `agreed_load_steps` may have wrapped the two optimizer methods for a load.
    return frozenset(getattr(function, "__wrapped__", function).__code__ for function in (
        universal_checkpoint.load_hp_checkpoint_state,
        ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir,
        Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3,
        Stage3.load_hp_checkpoint_state,
    ))


@contextlib.contextmanager
def route_universal_loads(load: Callable[[str, Any], Any]) -> Iterator[None]:
    """Within the block, DeepSpeed's universal loader reads our shards through `load`.

    `torch.load` is replaced for the block (process-wide, as it must be: DeepSpeed calls it by
    that name). Every call from one of `_universal_loaders` for a path goes to `load(path,
    map_location)` -- the checkpoint engine's, with its allowlist and checks, never
    ``weights_only=False`` for a folder of ours: DeepSpeed reads every ``*.pt`` it finds in a
    parameter's folder, so a file planted there, or a listed one replaced, must meet the
    engine's refusal, not torch's unpickler. Every other call goes to torch's own function
    unchanged (a shard of ours read from anywhere else still meets its torch.load guard).
    """
    loaders = _universal_loaders()
    real = torch.load

    @functools.wraps(real)
    def routed(f: Any, *args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code in loaders and isinstance(f, (str, os.PathLike)):
            map_location = kwargs.get("map_location", args[0] if args else None)
            return load(os.fspath(f), map_location)
        return real(f, *args, **kwargs)

    torch.load = routed
    try:
        yield
    finally:
        torch.load = real
