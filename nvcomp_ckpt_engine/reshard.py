"""A ZeRO-1/2 partition at a new data-parallel size, planned as reads of the saved partitions.

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
            params, offset = [], 0
            for raw_param in raw["params"]:
                param = ZeroParam(raw_param["name"], tuple(raw_param["shape"]), raw_param["dtype"],
                                  raw_param["offset"])
                if param.offset != offset:
                    raise CorruptCheckpointError(
                        f"{source}: param group {g}: {param.name!r} starts at element "
                        f"{param.offset} of the flat buffer, but the parameters before it end at "
                        f"{offset}")
                offset += param.numel
                params.append(param)
            group = ZeroGroup(tuple(params), raw["alignment"], raw["partition_numel"])
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
        return [{"alignment": g.alignment, "partition_numel": g.partition_numel,
                 "params": [{"dtype": p.dtype, "name": p.name, "offset": p.offset,
                             "shape": list(p.shape)} for p in g.params]}
                for g in self.groups]


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


__all__ = ["Read", "ZeroGroup", "ZeroLayout", "ZeroParam", "partition_numel", "plan", "saved_numel"]
