"""A ZeRO-1/2/3 checkpoint loaded at another data-parallel size, by a plain ``load_checkpoint``.

Save: the record a reshard needs goes into the manifest's layout (``zero_partitions``, see
`nvcomp_ckpt_engine.reshard`): per param group the parameters in flat order with their names,
shapes, dtypes and offsets, the alignment and each rank's partition size, taken from the live
optimizer (`_compat.zero12_flat_groups`: DeepSpeed's ZeRO optimizer and its BF16_Optimizer). An
optimizer whose partitions are not plain cuts of its flat buffers (round-robin gradients,
per-parameter alignment, DeepSpeed's elastic format, MoE groups) records nothing, and its
checkpoints load at their own size only. A ZeRO-3 save records the same for its optimizer
sub-groups (`_compat.zero3_sub_groups`, `reshard.Zero3Layout`: each parameter cut evenly over
the data-parallel group), unless MiCS, hierarchical or expert partitioning or NVMe-offloaded
optimizer states make other cuts.

Load: DeepSpeed's own ZeRO load runs unchanged; it is shown the files a save at the new size
would have held. The model-states file says the new data-parallel size (so DeepSpeed does not
refuse it), and this rank's optimizer file is built here (`ReshardLoad.optimizer_file`): its
new partition of the fp32 master weights and of every per-element optimizer state (Adam's
moments), read as element ranges of the saved ranks' partitions (`LazyShard.read`: only the
chunks holding them are decoded, so a rank holds its new partition and a few chunks, never an
old shard), the step and the optimizer's other state as saved, the partition count and padding
of the new size (``param_slice_mappings``, which only conversions read, is left out). DeepSpeed then loads them as it
loads its own files, rebuilds the 16-bit weights from the module file (itself derived from the
same fp32 master), and restores the loss scaler, the lr scheduler and the client state from the
model-states file as always. Per-rank client state is what rank 0 saved: the model-states file
is rank 0's, at every size.

ZeRO-3 alike: this rank's ``fp32_flat_groups`` and the moments of each sub-group are planned
parameter by parameter (`reshard.plan_zero3`), DeepSpeed's ZeRO-3 ``load_state_dict`` rebuilds
the 16-bit partitions from them, and every rank reads data-parallel rank 0's model-states file
(`_compat.model_states_of_rank_0`, as DeepSpeed's universal load does: a rank past the saved
size has none of its own).

Every rank builds its file, then the ranks exchange their outcomes: one rank's failure (a
damaged or missing source shard) is raised on every rank, naming the rank and the file.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
from collections.abc import Mapping
from typing import Any

import torch
from deepspeed.checkpoint import constants as ds

from .. import collectives, manifest, opened, pipeline, reshard
from ..errors import (
    CheckpointError, CorruptCheckpointError, DataParallelSizeError, IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from ..lazy import LazyShard, TensorRef
from . import _compat

_OPTIM = re.compile(r"(?P<prefix>(?:bf16_|fp16_)?)zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt")
#: The optimizer-file keys whose tensors are per rank; everything else is the same on every rank.
_PARTITIONED = (ds.SINGLE_PARTITION_OF_FP32_GROUPS, ds.BASE_OPTIMIZER_STATE, ds.PARAM_SLICE_MAPPINGS,
                ds.GROUP_PADDINGS, ds.PARTITION_COUNT)
_RAISED = {cls.__name__: cls for cls in (CorruptCheckpointError, IncompleteCheckpointError,
                                          UnsupportedCheckpointError, DataParallelSizeError)}


def save_layout(zero_stage: int) -> dict[str, Any]:
    """The layout a save records: `_compat.parallel_layout`, with ``zero_partitions`` where the
    saving engine's ZeRO-1/2/3 optimizer allows a reshard."""
    layout = _compat.parallel_layout(zero_stage)
    engine = _compat.saving_engine()
    if engine is None:
        return layout
    if zero_stage == 3:
        sub_groups = _compat.zero3_sub_groups(engine)
        if sub_groups is None:
            return layout
        record = reshard.Zero3Layout.of(
            [[(name, shape, str(dtype).removeprefix("torch.")) for name, shape, dtype in sub_group]
             for sub_group in sub_groups], layout["dp"]).to_record()
        return {**layout, "zero_partitions": record}
    groups = _compat.zero12_flat_groups(engine) if zero_stage in (1, 2) else None
    if groups is None or any(offset is None for g in groups for *_, offset in g.params):
        return layout
    record = [{"alignment": g.alignment, "partition_numel": g.partition_size,
               "params": [{"dtype": str(dtype).removeprefix("torch."), "name": name, "offset": offset,
                           "shape": list(shape)} for name, shape, dtype, offset in g.params]}
              for g in groups]
    try:  # the record must describe plain cuts of the buffers; anything else records nothing
        reshard.ZeroLayout.from_record(record, layout["dp"], source="the live optimizer")
    except CorruptCheckpointError:
        return layout
    return {**layout, "zero_partitions": record}


class ReshardLoad:
    """One rank's load of a ZeRO-1/2 checkpoint saved at another data-parallel size.

    Made by `for_load` when the engine opens the tag; `model_states` and `optimizer_file`
    adapt what DeepSpeed's load reads.
    """

    def __init__(self, checkpoint: opened.OpenedCheckpoint,
                 layout: reshard.ZeroLayout | reshard.Zero3Layout, new_dp: int,
                 files: dict[int, str], *, safe_classes: Any) -> None:
        self.checkpoint, self.layout, self.new_dp = checkpoint, layout, new_dp
        self.files, self.safe_classes = files, safe_classes
        self.stage3 = isinstance(layout, reshard.Zero3Layout)

    @classmethod
    def for_load(cls, checkpoint: opened.OpenedCheckpoint, current: Mapping[str, Any],
                 keys: tuple[str, ...], *, safe_classes: Any = ()) -> ReshardLoad | None:
        """A reshard when optimizer state is loaded (`keys` holds ``dp``) at another
        data-parallel size than saved, the same tensor- and pipeline-parallel sizes and ZeRO
        stage (1, 2 or 3), from a checkpoint whose manifest has the record; else None (the
        layout check then refuses what differs, as for any checkpoint)."""
        saved = checkpoint.manifest.layout
        if ("dp" not in keys or saved.get("dp") == current.get("dp") or "zero_partitions" not in saved
                or any(saved.get(k) != current.get(k) for k in ("tp", "pp", "zero_stage"))
                or current.get("zero_stage") not in (1, 2, 3)):
            return None
        source = str(checkpoint.tag_dir / manifest.MANIFEST_NAME)
        parse = reshard.Zero3Layout if current["zero_stage"] == 3 else reshard.ZeroLayout
        layout = parse.from_record(saved["zero_partitions"], saved["dp"], source=source)
        return cls(checkpoint, layout, current["dp"], _optimizer_files(checkpoint, layout.dp),
                   safe_classes=safe_classes)

    def model_states(self, obj: Any) -> Any:
        """The model-states file as a save at the new size holds it: its data-parallel size."""
        if isinstance(obj, dict) and "dp_world_size" in obj:
            obj["dp_world_size"] = self.new_dp
        return obj

    def is_optimizer_file(self, relative: str) -> bool:
        return _OPTIM.fullmatch(relative) is not None

    def optimizer_file(self, relative: str, collective: collectives.Collective, timeout_s: float) -> Any:
        """This rank's optimizer file at the new size, built from the saved ranks' shards, once
        every rank has built its own (a failure on any rank raises on all)."""
        error: BaseException | None = None
        try:
            built = self._build(relative)
        except Exception as exc:  # raised below, on every rank
            error, built = exc, None
        outcomes = collective.all_gather_object(
            None if error is None else {"type": type(error).__name__, "message": str(error)},
            step="reshard-load", timeout_s=timeout_s)
        if error is not None:
            raise error
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
        if failed:
            rank, outcome = failed[0]
            raise _RAISED.get(outcome["type"], CheckpointError)(
                f"loading {self.checkpoint.tag_dir} at data-parallel size {self.new_dp} failed on "
                f"rank {rank}: {outcome['message']}")
        return built

    def _build(self, relative: str) -> dict[str, Any]:
        engine = _compat.loading_engine()
        if engine is None or _compat.elastic_zero_load(engine):
            raise DataParallelSizeError(
                f"{self.checkpoint.tag_dir}: a load at another data-parallel size is resharded "
                "inside DeepSpeed's load_checkpoint with zero_optimization.elastic_checkpoint off "
                "(an elastic load reads every saved rank's file): turn it off for this load, or "
                "load at the saved size")
        dp_rank = _compat.data_parallel_rank(engine)
        asked = _OPTIM.fullmatch(relative)
        if asked is None or int(asked["dp"]) != dp_rank:
            raise UnsupportedCheckpointError(f"{self.checkpoint.tag_dir}: DeepSpeed asked for "
                                             f"{relative} on data-parallel rank {dp_rank}")
        self._check_live(engine)
        with cf.ThreadPoolExecutor(pipeline.default_workers(), thread_name_prefix="nvckpt-reshard") as pool:
            shards: dict[int, LazyShard] = {}

            def shard(rank: int) -> LazyShard:
                if rank not in shards:
                    shards[rank] = self.checkpoint.open_lazy(self.files[rank], pool=pool,
                                                             safe_classes=self.safe_classes)
                return shards[rank]

            try:
                return self._file(shard, dp_rank)
            finally:
                for opened_shard in shards.values():
                    opened_shard.close()

    def _check_live(self, engine: Any) -> None:
        """The optimizer DeepSpeed built at the new size has the saved parameters in the saved
        order and the partitions the planner computes: else the plan would fill the wrong
        elements, so the load is refused, naming what differs."""
        where = f"{self.checkpoint.tag_dir} (saved at data-parallel size {self.layout.dp})"
        if self.stage3:
            self._check_live_zero3(engine, where)
            return
        live = _compat.zero12_flat_groups(engine)
        if live is None or len(live) != len(self.layout.groups):
            raise DataParallelSizeError(
                f"{where}: this job's ZeRO optimizer is not partitioned as plain cuts of "
                f"{len(self.layout.groups)} flat param group(s) (round-robin gradients, parameter "
                "alignment or another optimizer), so it cannot take a reshard; load at the saved "
                "size or through `nvcomp-ckpt to-universal`")
        for g, (saved, now) in enumerate(zip(self.layout.groups, live)):
            names = [(p.name, p.shape, p.offset) for p in saved.params]
            if [(name, shape, offset) for name, shape, _, offset in now.params] != names:
                raise DataParallelSizeError(
                    f"{where}: param group {g} of this job holds other parameters, shapes or order "
                    "than the saved one")
            size = reshard.partition_numel(saved.numel, self.new_dp, saved.alignment)
            if now.partition_size != size or now.alignment != saved.alignment:
                raise DataParallelSizeError(
                    f"{where}: param group {g}'s partitions hold {now.partition_size} elements at "
                    f"data-parallel size {self.new_dp}, the plan made {size}")

    def _check_live_zero3(self, engine: Any, where: str) -> None:
        """As `_check_live`, for ZeRO-3: the same sub-groups of the same parameters."""
        live = _compat.zero3_sub_groups(engine)
        saved = [[(p.name, p.shape) for p in g.params] for g in self.layout.groups]
        if live is None:
            raise DataParallelSizeError(
                f"{where}: this job's ZeRO-3 optimizer does not cut every parameter evenly over the "
                "data-parallel group with its fp32 partitions in memory (MiCS, hierarchical or "
                "expert partitioning, NVMe offload), so it cannot take a reshard; load at the "
                "saved size or through `nvcomp-ckpt to-universal`")
        now = [[(name, shape) for name, shape, _ in sub_group] for sub_group in live]
        if now != saved:
            raise DataParallelSizeError(
                f"{where}: this job's ZeRO-3 optimizer groups its parameters into other "
                f"sub-groups ({len(now)}, of {[len(g) for g in now]} parameters) than the saved "
                f"one ({len(saved)}, of {[len(g) for g in saved]}), or holds other parameters or "
                "shapes (stage3_sub_group_size cuts sub-groups by partition size); load at the "
                "saved size or through `nvcomp-ckpt to-universal`")

    def _file(self, shard: Any, dp_rank: int) -> dict[str, Any]:
        if self.stage3:
            return self._file_zero3(shard, dp_rank)
        first = shard(0)
        top = _optimizer_state(first)
        base = top.get(ds.BASE_OPTIMIZER_STATE)
        if not isinstance(base, dict) or not isinstance(base.get("state"), dict):
            raise DataParallelSizeError(
                f"{first.path}: its {ds.BASE_OPTIMIZER_STATE!r} is not a torch optimizer state "
                "dict (DeepSpeed's elastic format); load it at its own size")
        fp32, states, paddings = [], {}, []
        for g, group in enumerate(self.layout.groups):
            size, reads = reshard.plan(group, self.new_dp, dp_rank)
            fp32.append(self._gather(shard, group, g, reads, size, None))
            states[g] = self._states(shard, group, g, reads, size)
            paddings.append(self.new_dp * size - group.numel if dp_rank == self.new_dp - 1 else 0)
        optimizer = {key: first.materialize(value) for key, value in top.items()
                     if key not in _PARTITIONED}
        optimizer.update({
            ds.BASE_OPTIMIZER_STATE: {"state": states,
                                      "param_groups": first.materialize(base.get("param_groups"))},
            ds.SINGLE_PARTITION_OF_FP32_GROUPS: fp32,
            ds.GROUP_PADDINGS: paddings,
            ds.PARTITION_COUNT: [self.new_dp] * len(fp32),
        })
        return _with_optimizer(first, optimizer)

    def _file_zero3(self, shard: Any, dp_rank: int) -> dict[str, Any]:
        """This rank's ZeRO-3 optimizer file at the new size: per sub-group its partition of the
        fp32 master (``fp32_flat_groups``) and of each per-element state, the rest as saved."""
        first = shard(0)
        top = _optimizer_state(first)
        base = top.get(ds.OPTIMIZER_STATE_DICT)
        if not isinstance(base, dict) or not isinstance(base.get("state"), dict):
            raise CorruptCheckpointError(
                f"{first.path}: its ZeRO-3 {ds.OPTIMIZER_STATE_DICT!r} is not a torch optimizer "
                "state dict")
        fp32, states = [], {}
        for g, group in enumerate(self.layout.groups):
            size, reads = reshard.plan_zero3(group, self.layout.dp, self.new_dp, dp_rank)
            fp32.append(self._gather(shard, group, g, reads, size, None))
            states[g] = self._states(shard, group, g, reads, size)
        optimizer = {key: first.materialize(value) for key, value in top.items()
                     if key not in (ds.OPTIMIZER_STATE_DICT, ds.FP32_FLAT_GROUPS, ds.PARTITION_COUNT)}
        optimizer.update({
            ds.OPTIMIZER_STATE_DICT: {"state": states,
                                      "param_groups": first.materialize(base.get("param_groups"))},
            ds.FP32_FLAT_GROUPS: fp32,
            ds.PARTITION_COUNT: self.new_dp,
        })
        return _with_optimizer(first, optimizer)

    def _states(self, shard: Any, group: reshard.ZeroGroup, g: int, reads: list[reshard.Read],
                size: int) -> dict[str, Any]:
        """Group `g`'s optimizer state at the new size: each per-element state (a tensor of the
        saved partition's length) gathered from the reads, every other value as saved."""
        first, states = shard(0), {}
        for key, value in _group_state(first, g, stage3=self.stage3).items():
            if isinstance(value, TensorRef) and value.shape == (group.partition_numel,):
                states[key] = self._gather(shard, group, g, reads, size, key)
            else:
                states[key] = self._same_everywhere(shard, g, key, reads, first.materialize(value))
        return states

    def _gather(self, shard: Any, group: reshard.ZeroGroup, g: int, reads: list[reshard.Read],
                size: int, key: str | None) -> torch.Tensor:
        """The new partition of the fp32 master (`key` None) or of optimizer state `key`."""
        out: torch.Tensor | None = None
        for read in reads:
            source = shard(read.source_rank)
            ref = (_fp32_partition(source, g, stage3=self.stage3) if key is None
                   else _group_state(source, g, stage3=self.stage3).get(key))
            # DeepSpeed's ZeRO-1/2 optimizer saves the fp32 partition without the buffer's
            # padding, BF16_Optimizer and ZeRO-3 with it; optimizer states always hold the whole
            # partition.
            holds = {group.partition_numel}
            if key is None and not self.stage3:
                holds.add(reshard.saved_numel(group, read.source_rank))
            what = "fp32 partition" if key is None else f"{key!r}"
            if not isinstance(ref, TensorRef) or ref.numel not in holds:
                raise CorruptCheckpointError(
                    f"{source.path}: the {what} of param group {g} should be a tensor of "
                    f"{' or '.join(map(str, sorted(holds)))} elements (the manifest's "
                    "zero_partitions), got "
                    f"{ref.numel if isinstance(ref, TensorRef) else type(ref).__name__}")
            if out is None:
                out = torch.zeros(size, dtype=ref.dtype)
            elif ref.dtype != out.dtype:
                raise CorruptCheckpointError(f"{source.path}: the {what} of param group {g} is "
                                             f"{ref.dtype}, another rank's is {out.dtype}")
            out[read.dest : read.dest + read.numel] = source.read(ref, read.start, read.numel)
        return out if out is not None else torch.zeros(size, dtype=torch.float32)

    def _same_everywhere(self, shard: Any, g: int, key: str, reads: list[reshard.Read], value: Any) -> Any:
        """Optimizer state `key` of group `g` (the step) as rank 0 saved it, checked against the
        ranks this partition is read from."""
        for rank in sorted({r.source_rank for r in reads} - {0}):
            source = shard(rank)
            other = source.materialize(_group_state(source, g, stage3=self.stage3).get(key))
            same = (torch.equal(value, other) if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor)
                    and value.shape == other.shape else type(value) is type(other) and value == other)
            if not same:
                raise CorruptCheckpointError(f"{source.path}: {key!r} of param group {g} is {other!r}, "
                                             f"rank 0 saved {value!r}")
        return value


def _optimizer_files(checkpoint: opened.OpenedCheckpoint, dp: int) -> dict[int, str]:
    """The saved optimizer file of each data-parallel rank, by the manifest."""
    files: dict[int, str] = {}
    for relative in checkpoint.paths:
        found = _OPTIM.fullmatch(relative)
        if found is not None and int(found["mp"]) == 0:
            files[int(found["dp"])] = relative
    missing = sorted(set(range(dp)) - set(files))
    if missing or len(files) != dp:
        raise IncompleteCheckpointError(
            f"{checkpoint.tag_dir}: saved at data-parallel size {dp}, its manifest lists the "
            f"optimizer files of ranks {sorted(files)}" + (f" (missing {missing})" if missing else ""))
    return files


def _optimizer_state(shard: LazyShard) -> dict[str, Any]:
    state = shard.obj.get(ds.OPTIMIZER_STATE_DICT) if isinstance(shard.obj, dict) else None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{shard.path}: no {ds.OPTIMIZER_STATE_DICT!r} in this "
                                     "DeepSpeed optimizer file")
    return state


def _fp32_partition(shard: LazyShard, g: int, *, stage3: bool = False) -> Any:
    key = ds.FP32_FLAT_GROUPS if stage3 else ds.SINGLE_PARTITION_OF_FP32_GROUPS
    groups = _optimizer_state(shard).get(key)
    if not isinstance(groups, (list, tuple)) or g >= len(groups):
        raise CorruptCheckpointError(f"{shard.path}: no fp32 partition of param group {g}")
    return groups[g]


def _group_state(shard: LazyShard, g: int, *, stage3: bool = False) -> dict[str, Any]:
    base = _optimizer_state(shard).get(ds.OPTIMIZER_STATE_DICT if stage3 else ds.BASE_OPTIMIZER_STATE)
    state = base.get("state") if isinstance(base, dict) else None
    found = state.get(g) if isinstance(state, dict) else None
    if not isinstance(found, dict):
        raise CorruptCheckpointError(f"{shard.path}: no optimizer state of param group {g}")
    return found


def _with_optimizer(first: Any, optimizer: dict[str, Any]) -> dict[str, Any]:
    """The saved file's outer dict as saved, with `optimizer` as its optimizer state."""
    outer = {key: first.materialize(value) for key, value in first.obj.items()
             if key != ds.OPTIMIZER_STATE_DICT}
    return {**outer, ds.OPTIMIZER_STATE_DICT: optimizer}


__all__ = ["ReshardLoad", "save_layout"]

