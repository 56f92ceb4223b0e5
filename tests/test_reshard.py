"""The reshard planner (`nvcomp_ckpt_engine.reshard`) and its manifest record, framework-free.

A new rank's ZeRO-1/2 partition at another data-parallel size is planned as reads of the saved
ranks' partitions. Required: every parameter element of every new partition comes from exactly
one saved element, the same element of the flat buffer; no read leaves what a saved rank's file
holds; the partitions have DeepSpeed's sizes; a record whose numbers do not fit is refused.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvcomp_ckpt_engine import manifest, reshard
from nvcomp_ckpt_engine.errors import CorruptCheckpointError, UnsupportedCheckpointError


def _group(numels: list[int], dp: int, alignment: int = 2) -> reshard.ZeroGroup:
    params, offset = [], 0
    for i, numel in enumerate(numels):
        params.append(reshard.ZeroParam(f"layer{i}.weight", (numel,), "bfloat16", offset))
        offset += numel
    return reshard.ZeroGroup(tuple(params), alignment,
                             reshard.partition_numel(offset, dp, alignment))


def _check_resharding(group: reshard.ZeroGroup, old_dp: int, new_dp: int) -> None:
    """Every element of the flat buffer's parameters lands once, at its own place."""
    sources: dict[int, int] = {}  # flat element -> times it was read
    for new_rank in range(new_dp):
        size, reads = reshard.plan(group, new_dp, new_rank)
        assert size == reshard.partition_numel(group.numel, new_dp, group.alignment)
        covered = 0
        for read in reads:
            assert read.numel > 0
            assert 0 <= read.start and read.start + read.numel <= reshard.saved_numel(group, read.source_rank)
            assert read.source_rank < old_dp
            assert read.dest == covered  # in order, no gap before the padding
            covered += read.numel
            old_first = read.source_rank * group.partition_numel + read.start
            assert old_first == new_rank * size + read.dest  # the same element of the buffer
            for element in range(old_first, old_first + read.numel):
                sources[element] = sources.get(element, 0) + 1
        assert covered <= size
        # What no read fills is the padding past the parameters, and only that.
        assert covered == max(0, min(size, group.numel - new_rank * size))
    assert sources == {element: 1 for element in range(group.numel)}


@given(numels=st.lists(st.integers(0, 300), min_size=1, max_size=8),
       old_dp=st.integers(1, 9), new_dp=st.integers(1, 9), alignment=st.sampled_from([1, 2, 4]))
def test_every_new_element_comes_from_exactly_one_saved_element(
        numels: list[int], old_dp: int, new_dp: int, alignment: int) -> None:
    _check_resharding(_group(numels, old_dp, alignment), old_dp, new_dp)


@pytest.mark.parametrize(("old_dp", "new_dp"), [(4, 3), (2, 4), (4, 1), (4, 2), (1, 4)])
def test_the_sizes_the_tests_resume_at(old_dp: int, new_dp: int) -> None:
    _check_resharding(_group([1000, 17, 333, 1], old_dp), old_dp, new_dp)


def test_uneven_sizes_cut_where_deepspeed_cuts() -> None:
    # 1351 elements: at dp 4 padded to 1352 (partitions of 338), at dp 3 to 1356 (452).
    group = _group([1000, 17, 333, 1], 4)
    assert group.partition_numel == 338
    assert [reshard.saved_numel(group, r) for r in range(4)] == [338, 338, 338, 337]
    size, reads = reshard.plan(group, 3, 2)
    assert size == 452
    assert reads == [reshard.Read(source_rank=2, start=228, numel=110, dest=0),
                     reshard.Read(source_rank=3, start=0, numel=337, dest=110)]
    assert reshard.plan(group, 1, 0) == (1352, [reshard.Read(r, 0, n, 338 * r)
                                                for r, n in enumerate([338, 338, 338, 337])])


def _manifest(zero_partitions: list | None) -> manifest.Manifest:
    record = manifest.layout_record("deepspeed", dp=4, tp=1, pp=1, zero_stage=2,
                                    zero_partitions=zero_partitions)
    return manifest.build_manifest(tag="t", world_size=4, files=[], layout=record, created_unix_ns=1)


def test_the_record_round_trips_through_the_manifest() -> None:
    layout = reshard.ZeroLayout(4, (_group([10, 6], 4), _group([3], 4)))
    parsed = manifest.parse_manifest(manifest.serialize_manifest(_manifest(layout.to_record())))
    assert reshard.ZeroLayout.from_record(parsed.layout["zero_partitions"], 4, source="m") == layout


def test_only_a_manifest_with_the_record_is_version_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the record a manifest is what version-1 writers wrote; with it, a version-1
    reader asks for an upgrade instead of calling it damaged, and a version-1 manifest that
    carries it is refused as damaged."""
    plain = manifest.serialize_manifest(_manifest(None))
    assert json.loads(plain)["version"] == 1
    data = manifest.serialize_manifest(_manifest(reshard.ZeroLayout(4, (_group([10], 4),)).to_record()))
    assert json.loads(data)["version"] == 2
    document = json.loads(data)
    document["version"] = 1
    covered = {key: document[key] for key in ("body", "format", "version")}
    document["sha256"] = hashlib.sha256(json.dumps(covered, sort_keys=True, separators=(",", ":"))
                                        .encode()).hexdigest()
    forged = data.replace(b'"version": 2', b'"version": 1').replace(
        json.loads(data)["sha256"].encode(), document["sha256"].encode())
    with pytest.raises(CorruptCheckpointError, match="not in canonical form"):
        manifest.parse_manifest(forged, source="m")
    monkeypatch.setattr(manifest, "READ_VERSIONS", (1,))
    assert manifest.parse_manifest(plain).layout["dp"] == 4
    with pytest.raises(UnsupportedCheckpointError, match="manifest version 2; this installation "
                       "reads version 1. Upgrade"):
        manifest.parse_manifest(data, source="m")


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r[0]["params"][1].update(offset=9), r"'layer1.weight' starts at element 9 of the flat "
                                                    r"buffer, but the parameters before it end at 10"),
    (lambda r: r[0].update(partition_numel=5), r"records partitions of 5 elements; 16 elements at "
                                                r"data-parallel size 4 with alignment 2 make partitions of 4"),
])
def test_a_record_that_does_not_fit_is_refused(change, message) -> None:
    record = reshard.ZeroLayout(4, (_group([10, 6], 4),)).to_record()
    change(record)
    with pytest.raises(CorruptCheckpointError, match=message):
        reshard.ZeroLayout.from_record(record, 4, source="the manifest")


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r[0].pop("alignment"), r"zero_partitions\[0\] has unknown keys \[\] and lacks keys \['alignment'\]"),
    (lambda r: r[0]["params"][0].update(shape=[-1]), r"zero_partitions\[0\]\.params\[0\]\.shape\[0\] must be in"),
    (lambda r: r[0]["params"][0].update(extra=1), r"params\[0\] has unknown keys \['extra'\]"),
])
def test_a_malformed_record_is_refused_by_the_manifest(change, message) -> None:
    record = reshard.ZeroLayout(4, (_group([10, 6], 4),)).to_record()
    change(record)
    with pytest.raises((TypeError, ValueError), match=message):
        manifest.layout_record("deepspeed", dp=4, tp=1, pp=1, zero_partitions=record)


# ------------------------------------------------------------------------------ ZeRO-3


def _zero3_partitions(numels: list[int], dp: int) -> list[list[int | None]]:
    """Each rank's sub-group partition of parameters whose elements are numbered through
    (parameter i's element e is ``(i, e)``), None for padding: what DeepSpeed's ZeRO-3 holds."""
    ranks = []
    for rank in range(dp):
        flat: list = []
        for i, numel in enumerate(numels):
            size = reshard.zero3_partition_numel(numel, dp)
            flat += [(i, e) if e < numel else None for e in range(rank * size, (rank + 1) * size)]
        ranks.append(flat)
    return ranks


@given(numels=st.lists(st.integers(0, 200), min_size=1, max_size=6),
       old_dp=st.integers(1, 9), new_dp=st.integers(1, 9))
def test_a_zero3_partition_is_read_element_for_element_from_the_saved_ones(
        numels: list[int], old_dp: int, new_dp: int) -> None:
    layout = reshard.Zero3Layout.of([[(f"p{i}", (n,), "float32") for i, n in enumerate(numels)]], old_dp)
    (group,) = layout.groups
    saved = _zero3_partitions(numels, old_dp)
    assert all(len(flat) == group.partition_numel for flat in saved)
    for new_rank, expected in enumerate(_zero3_partitions(numels, new_dp)):
        size, reads = reshard.plan_zero3(group, old_dp, new_dp, new_rank)
        assert size == len(expected)
        built: list = [None] * size
        for read in reads:
            assert read.numel > 0 and 0 <= read.source_rank < old_dp
            assert all(built[d] is None for d in range(read.dest, read.dest + read.numel))  # once
            source = saved[read.source_rank][read.start : read.start + read.numel]
            assert None not in source  # never a saved padding element
            built[read.dest : read.dest + read.numel] = source
        assert built == expected  # every element at its place; the padding left unfilled


def test_zero3_partitions_cut_each_parameter_where_deepspeed_cuts() -> None:
    # 10 elements at dp 4: partitions of 3 (2 of padding on the last rank); at dp 3: 4.
    group = reshard.Zero3Layout.of([[("a", (2, 5), "float32"), ("b", (3,), "float32")]], 4).groups[0]
    assert group.partition_numel == 3 + 1
    assert [p.offset for p in group.params] == [0, 3]
    size, reads = reshard.plan_zero3(group, 4, 3, 1)
    assert size == 4 + 1
    assert reads == [reshard.Read(1, 1, 2, 0), reshard.Read(2, 0, 2, 2), reshard.Read(1, 3, 1, 4)]


def test_the_zero3_record_round_trips_and_a_wrong_one_is_refused() -> None:
    layout = reshard.Zero3Layout.of([[("a", (10,), "float32"), ("b", (3,), "bfloat16")], [("c", (7,), "float32")]], 4)
    record = layout.to_record()
    parsed = manifest.parse_manifest(manifest.serialize_manifest(_manifest(record)))
    assert reshard.Zero3Layout.from_record(parsed.layout["zero_partitions"], 4, source="m") == layout
    record[0]["params"][1]["offset"] = 2
    with pytest.raises(CorruptCheckpointError, match="the partition of 'b' starts at element 2, but the "
                                                     "partitions before it end at 3"):
        reshard.Zero3Layout.from_record(record, 4, source="m")
    record[0]["params"][1]["offset"] = 3
    record[1]["partition_numel"] = 7
    with pytest.raises(CorruptCheckpointError, match="sub-group 1 records partitions of 7 elements with "
                                                     "alignment 1; its parameters at data-parallel size 4 make 2"):
        reshard.Zero3Layout.from_record(record, 4, source="m")
