"""A ZeRO-1, 2 or 3 partition at a new data-parallel size, planned as reads of the saved partitions.

ZeRO-1/2 keeps each param group's parameters as one flat buffer: the parameters one after the
other (at the offsets the save recorded), padded at the end to a multiple of ``alignment x dp``
elements, and cut into ``dp`` equal partitions, rank k holding elements ``[k P, (k + 1) P)``.
Each rank's optimizer file holds its partition of the fp32 master weights without the padding
at its end, and the Adam moments of the whole partition. A rank of a job at another
data-parallel size needs its new partition: the same flat buffer cut at other places. `plan`
lists, for one group and one new rank, which elements of which saved rank's partition land
where in the new one; the elements of the new partition past the parameters (its padding) come
from nowhere and are zero.

What the planner needs is what the save recorded in the manifest (``layout.zero_partitions``,
`ZeroLayout`): per group the alignment, the saved partition size and the parameters in flat
order with their shapes, dtypes and offsets. No framework, no torch: the DeepSpeed adapter
(`deepspeed.reshard`) turns the reads into ranged reads of the shards (`lazy.LazyShard.read`).

ZeRO-3 cuts each parameter, not a group's buffer: a parameter of ``n`` elements is padded to a
multiple of ``dp`` and rank k holds its elements ``[k p, (k + 1) p)``, ``p = ceil(n / dp)``
(`zero3_partition_numel`). Each rank's fp32 partition of a sub-group (the unit DeepSpeed's
ZeRO-3 optimizer steps) is its partitions of the sub-group's parameters one after the other;
the Adam moments are laid out the same. The same record serves (`Zero3Layout`): per sub-group
its parameters in order, each with the offset of its partition in every rank's sub-group
partition, the sub-group's partition size, and an alignment of 1. `plan_zero3` lists the reads
of one new rank's sub-group partition, parameter by parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CorruptCheckpointError


@dataclass(frozen=True)
class ZeroParam:
    """One parameter of a param group: `offset` is where it starts in the group's flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ZeroGroup:
    """One param group's flat buffer: its parameters in order, the alignment its padded size is
    a multiple of (times the data-parallel size), and each rank's partition size at the save."""

    params: tuple[ZeroParam, ...]
    alignment: int
    partition_numel: int

    @property
    def numel(self) -> int:
        """Elements of the parameters, without the padding."""
        return sum(p.numel for p in self.params)


def partition_numel(numel: int, dp: int, alignment: int) -> int:
    """Each rank's partition of a flat buffer of `numel` elements at data-parallel size `dp`:
    the buffer padded to a multiple of ``alignment * dp`` (DeepSpeed's `align_dense_tensors`
    with ``nccl_start_alignment_factor * dp``), divided by `dp`."""
    if dp < 1 or alignment < 1 or numel < 0:
        raise ValueError(f"no partitions of {numel} elements at dp {dp}, alignment {alignment}")
    return math.ceil(numel / (alignment * dp)) * alignment


def saved_numel(group: ZeroGroup, rank: int) -> int:
    """Elements of saved rank `rank`'s partition that hold parameters (what its file's fp32
    partition holds: the padding at the end of the buffer is not saved)."""
    return max(0, min(group.partition_numel, group.numel - rank * group.partition_numel))


def _back_to_back(raw: Mapping[str, Any], extent: Callable[[ZeroParam], int], *, source: str,
                  where: str) -> tuple[tuple[ZeroParam, ...], int]:
    """A recorded group's parameters, each checked to start where the one before it ends
    (`extent`: the elements a parameter takes), and where the last one ends. `where` is the
    message, with ``{name}``, ``{offset}`` and ``{end}`` to fill, for one that does not."""
    params, end = [], 0
    for raw_param in raw["params"]:
        param = ZeroParam(raw_param["name"], tuple(raw_param["shape"]), raw_param["dtype"],
                          raw_param["offset"])
        if param.offset != end:
            raise CorruptCheckpointError(
                f"{source}: " + where.format(name=repr(param.name), offset=param.offset, end=end))
        end += extent(param)
        params.append(param)
    return tuple(params), end


@dataclass(frozen=True)
class ZeroLayout:
    """The ``zero_partitions`` record of a save at data-parallel size `dp`, checked."""

    dp: int
    groups: tuple[ZeroGroup, ...]

    @classmethod
    def from_record(cls, record: Sequence[Mapping[str, Any]], dp: int, *, source: str) -> ZeroLayout:
        """Parse a manifest's record (its shape checked by `manifest`); CorruptCheckpointError
        naming `source` when its numbers do not fit together."""
        groups = []
        for g, raw in enumerate(record):
            params, _ = _back_to_back(raw, lambda p: p.numel, source=source,
                                      where=f"param group {g}: {{name}} starts at element "
                                            "{offset} of the flat buffer, but the parameters "
                                            "before it end at {end}")
            group = ZeroGroup(params, raw["alignment"], raw["partition_numel"])
            expected = partition_numel(group.numel, dp, group.alignment)
            if group.partition_numel != expected:
                raise CorruptCheckpointError(
                    f"{source}: param group {g} records partitions of {group.partition_numel} "
                    f"elements; {group.numel} elements at data-parallel size {dp} with alignment "
                    f"{group.alignment} make partitions of {expected}")
            groups.append(group)
        return cls(dp, tuple(groups))

    def to_record(self) -> list[dict[str, Any]]:
        """The manifest's ``zero_partitions`` (`manifest.layout_record`)."""
        return _to_record(self.groups)


def _to_record(groups: Sequence[ZeroGroup]) -> list[dict[str, Any]]:
    return [{"alignment": g.alignment, "partition_numel": g.partition_numel,
             "params": [{"dtype": p.dtype, "name": p.name, "offset": p.offset,
                         "shape": list(p.shape)} for p in g.params]}
            for g in groups]


@dataclass(frozen=True)
class Read:
    """Elements ``[start, start + numel)`` of saved rank `source_rank`'s partition, which go to
    elements ``[dest, dest + numel)`` of the new one."""

    source_rank: int
    start: int
    numel: int
    dest: int


def plan(group: ZeroGroup, new_dp: int, new_rank: int) -> tuple[int, list[Read]]:
    """New rank `new_rank`'s partition of `group` at data-parallel size `new_dp`: its size, and
    the reads that fill it, in order. Elements of it not covered by a read are padding."""
    if not 0 <= new_rank < new_dp:
        raise ValueError(f"rank {new_rank} is not a rank of data-parallel size {new_dp}")
    size = partition_numel(group.numel, new_dp, group.alignment)
    old = group.partition_numel
    position, end = new_rank * size, min((new_rank + 1) * size, group.numel)
    reads = []
    while position < end:
        rank = position // old
        stop = min(end, (rank + 1) * old)
        reads.append(Read(rank, position - rank * old, stop - position, position - new_rank * size))
        position = stop
    return size, reads


def zero3_partition_numel(numel: int, dp: int) -> int:
    """Each rank's partition of one ZeRO-3 parameter of `numel` elements at data-parallel size
    `dp`: the parameter padded to a multiple of `dp` (DeepSpeed's ``_padding_size``), divided."""
    if dp < 1 or numel < 0:
        raise ValueError(f"no ZeRO-3 partitions of {numel} elements at dp {dp}")
    return math.ceil(numel / dp)


@dataclass(frozen=True)
class Zero3Layout:
    """The ``zero_partitions`` record of a ZeRO-3 save at data-parallel size `dp`, checked: one
    `ZeroGroup` per optimizer sub-group, each parameter's `offset` the start of its partition in
    every rank's sub-group partition, `partition_numel` the size of that, alignment 1."""

    dp: int
    groups: tuple[ZeroGroup, ...]

    @classmethod
    def from_record(cls, record: Sequence[Mapping[str, Any]], dp: int, *, source: str) -> Zero3Layout:
        """Parse a ZeRO-3 manifest's record; CorruptCheckpointError naming `source` when its
        numbers are not those of ZeRO-3 partitions at `dp`."""
        groups = []
        for g, raw in enumerate(record):
            params, offset = _back_to_back(
                raw, lambda p: zero3_partition_numel(p.numel, dp), source=source,
                where=f"ZeRO-3 sub-group {g}: the partition of {{name}} starts at element "
                      "{offset}, but the partitions before it end at {end}")
            if raw["alignment"] != 1 or raw["partition_numel"] != offset:
                raise CorruptCheckpointError(
                    f"{source}: ZeRO-3 sub-group {g} records partitions of "
                    f"{raw['partition_numel']} elements with alignment {raw['alignment']}; its "
                    f"parameters at data-parallel size {dp} make {offset} with alignment 1")
            groups.append(ZeroGroup(params, 1, offset))
        return cls(dp, tuple(groups))

    @classmethod
    def of(cls, params: Sequence[Sequence[tuple[str, tuple[int, ...], str]]], dp: int) -> Zero3Layout:
        """The layout of sub-groups of parameters ``(name, shape, dtype)`` at `dp`."""
        groups = []
        for sub_group in params:
            offset, found = 0, []
            for name, shape, dtype in sub_group:
                found.append(ZeroParam(name, tuple(shape), dtype, offset))
                offset += zero3_partition_numel(found[-1].numel, dp)
            groups.append(ZeroGroup(tuple(found), 1, offset))
        return cls(dp, tuple(groups))

    def to_record(self) -> list[dict[str, Any]]:
        """The manifest's ``zero_partitions`` for a ZeRO-3 save."""
        return _to_record(self.groups)


def plan_zero3(group: ZeroGroup, old_dp: int, new_dp: int, new_rank: int) -> tuple[int, list[Read]]:
    """New rank `new_rank`'s partition of ZeRO-3 sub-group `group` (saved at `old_dp`) at
    data-parallel size `new_dp`: its size, and the reads that fill it, in order. Elements of it
    not covered by a read are the parameters' padding."""
    if not 0 <= new_rank < new_dp:
        raise ValueError(f"rank {new_rank} is not a rank of data-parallel size {new_dp}")
    reads, dest = [], 0
    for param in group.params:
        old, new = zero3_partition_numel(param.numel, old_dp), zero3_partition_numel(param.numel, new_dp)
        position, end = new_rank * new, min((new_rank + 1) * new, param.numel)
        while position < end:
            rank = position // old
            stop = min(end, (rank + 1) * old)
            reads.append(Read(rank, param.offset + position - rank * old, stop - position,
                              dest + position - new_rank * new))
            position = stop
        dest += new
    return dest, reads


__all__ = ["Read", "Zero3Layout", "ZeroGroup", "ZeroLayout", "ZeroParam", "partition_numel", "plan",
           "plan_zero3", "saved_numel", "zero3_partition_numel"]
