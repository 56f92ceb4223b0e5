"""Which module parameters a rank vouches for before the module is saved as derived
(`derived_module._check_own_partition`), without DeepSpeed running: a ZeRO-1/2 group is a flat
buffer the parameters view and this rank's fp32 master partition of it.

The whole partition is compared in one pass first; a difference anywhere sends the group to a
comparison per parameter, so a parameter is reported exactly when its own elements inside this
rank's partition differ, whichever of the two paths found it.
"""

from __future__ import annotations

import pytest
import torch

from nvcomp_ckpt_engine.deepspeed import _compat, derived_module

#: Parameter sizes of the group: the partitions of two ranks (16 elements each) split the
#: second parameter.
SIZES = (6, 12, 8, 6)


def _group(dtype: torch.dtype, partition_id: int) -> _compat.ZeroGroup:
    """A group of `SIZES` parameters viewing one flat `dtype` buffer, two partitions, this rank's
    fp32 master partition equal to its part of the buffer after the cast."""
    master = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(0))
    flat = master.to(dtype)
    params = tuple(flat.split(SIZES))
    size = flat.numel() // 2
    partition = master[partition_id * size : (partition_id + 1) * size].clone()
    return _compat.ZeroGroup(flat=flat, params=params, partition=partition,
                             partition_id=partition_id, partition_count=2, key="fp32_groups.0")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("partition_id", [0, 1])
def test_an_equal_partition_vouches_for_every_parameter(dtype: torch.dtype, partition_id: int) -> None:
    assert derived_module._check_own_partition([_group(dtype, partition_id)]) == [[]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("element, partition_id, expected", [
    (2, 0, [0]),    # inside parameter 0, in this rank's partition
    (14, 0, [1]),   # parameter 1's part in partition 0
    (17, 1, [1]),   # parameter 1's part in partition 1
    (20, 1, [2]),
    (20, 0, []),    # in partition 1: not this rank's to vouch for
    (30, 1, [3]),
])
def test_a_parameter_differing_in_this_ranks_partition_is_the_one_reported(
        dtype: torch.dtype, element: int, partition_id: int, expected: list[int]) -> None:
    group = _group(dtype, partition_id)
    group.flat[element] = group.flat[element] + 1  # through the views: the module changed
    assert derived_module._check_own_partition([group]) == [expected]


def test_a_parameter_that_is_no_view_of_the_buffer_is_reported_on_either_path() -> None:
    group = _group(torch.bfloat16, 0)
    copied = _compat.ZeroGroup(flat=group.flat, params=(group.params[0].clone(), *group.params[1:]),
                               partition=group.partition, partition_id=0, partition_count=2,
                               key=group.key)
    assert derived_module._check_own_partition([copied]) == [[0]]
    copied.flat[14] += 1
    assert derived_module._check_own_partition([copied]) == [[0, 1]]


def test_a_nan_in_the_partition_is_never_vouched_for_through_a_cast() -> None:
    group = _group(torch.bfloat16, 0)
    group.partition[3] = float("nan")
    group.flat[3] = group.partition[3].to(torch.bfloat16)
    assert derived_module._check_own_partition([group]) == [[0]]


def test_a_partition_of_the_wrong_size_vouches_for_nothing() -> None:
    group = _group(torch.bfloat16, 0)
    short = _compat.ZeroGroup(flat=group.flat, params=group.params, partition=group.partition[:-1],
                              partition_id=0, partition_count=2, key=group.key)
    assert derived_module._check_own_partition([short]) == [[0, 1, 2, 3]]


def test_an_equal_partition_is_compared_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save's stall pays one comparison per group, not one per parameter, when the group
    is equal; a group that differs is then compared per parameter as well."""
    compared: list[int] = []
    same_after_cast = derived_module.derived.same_after_cast
    monkeypatch.setattr(derived_module.derived, "same_after_cast",
                        lambda target, source: (compared.append(target.numel()),
                                                same_after_cast(target, source))[1])
    equal, differing = _group(torch.bfloat16, 0), _group(torch.bfloat16, 1)
    differing.flat[20] += 1
    assert derived_module._check_own_partition([equal, differing]) == [[], [2]]
    assert compared[:2] == [16, 16], "each group's whole partition first"
    assert compared[2:] == [2, 8, 6], "then, for the differing group only, its parameters' parts"
