"""Checked-in files of every released format version still load, and the format is unchanged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import container
from nvcomp_ckpt_engine.errors import UnsupportedCheckpointError
from nvcomp_ckpt_engine.lazy import LazyShard

from test_roundtrip import assert_tree_equal

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from make_golden import (  # noqa: E402
    ALGORITHMS, V2_FOLDER, V2_MODULE, V2_SOURCE, V3_FILE, V4_FOLDER, golden_state, golden_v2_derive,
    golden_v2_states, golden_v3_state,
)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_version_1_golden_files_load_bit_exact(algorithm):
    path = GOLDEN / f"v1_{algorithm}.nvckpt"
    assert_tree_equal(golden_state(), nce.load(path))
    container.verify_file(path)


def _index_without_writer(path: Path) -> dict:
    data = path.read_bytes()
    start = int.from_bytes(data[-32:-24], "little")
    length = int.from_bytes(data[-24:-16], "little")
    body = json.loads(data[start : start + length])
    body.pop("writer")
    return body


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_writer_output_matches_the_golden_bytes(tmp_path, algorithm):
    """A change to the bytes written (not only to what is read) must be deliberate."""
    golden = GOLDEN / f"v1_{algorithm}.nvckpt"
    fresh = tmp_path / "fresh.nvckpt"
    nce.save(golden_state(), fresh, algorithm=algorithm, chunk_mb=1 / 256)
    assert fresh.read_bytes()[: container.HEADER_SIZE] == golden.read_bytes()[: container.HEADER_SIZE]
    assert _index_without_writer(fresh) == _index_without_writer(golden)


def test_version_2_golden_files_rebuild_the_derived_module_bit_exact():
    source, module = golden_v2_states()
    index = container.read_index(V2_FOLDER / V2_MODULE)
    assert index.format_version == 2 and index.derived_files == (V2_SOURCE,)
    assert_tree_equal(module, nce.load(V2_FOLDER / V2_MODULE))
    assert_tree_equal(source, nce.load(V2_FOLDER / V2_SOURCE))


def test_version_4_golden_files_rebuild_the_derived_module_and_record_its_digests():
    source, module = golden_v2_states()
    index = container.read_index(V4_FOLDER / V2_MODULE)
    ranges = [r for s in index.storages for r in s.derived]
    assert index.format_version == 4 and ranges and all(r.digest is not None for r in ranges)
    assert_tree_equal(module, nce.load(V4_FOLDER / V2_MODULE))
    assert_tree_equal(source, nce.load(V4_FOLDER / V2_SOURCE))


def test_writer_output_matches_the_version_4_golden_bytes(tmp_path):
    """The writer now records each derived range's digest: a derived file is version 4."""
    source, module = golden_v2_states()
    fresh = tmp_path / V2_MODULE
    nce.save(module, fresh, algorithm="zstd", derive=golden_v2_derive)
    golden = V4_FOLDER / V2_MODULE
    assert fresh.read_bytes()[: container.HEADER_SIZE] == golden.read_bytes()[: container.HEADER_SIZE]
    assert _index_without_writer(fresh) == _index_without_writer(golden)


def test_a_version_3_reader_asks_for_an_upgrade_for_the_version_4_golden_module(monkeypatch):
    monkeypatch.setattr(container, "SUPPORTED_FORMAT_VERSIONS", (1, 2, 3))
    with pytest.raises(UnsupportedCheckpointError,
                       match=r"model_states.nvckpt: shard format version 4.*\(1, 2, 3\).*upgrade"):
        nce.load(V4_FOLDER / V2_MODULE)


def _attributes(state: dict) -> list[dict]:
    return [vars(state["fp32_flat_groups"][0]), vars(state["module"]["weight"]),
            vars(state["module"]["tied"]), vars(state["step"])]


def test_version_3_golden_file_loads_its_tensor_attributes_bit_exact():
    expected = golden_v3_state()
    assert container.read_index(V3_FILE).format_version == 3
    loaded = nce.load(V3_FILE)
    assert_tree_equal(expected, loaded)
    assert _attributes(loaded) == _attributes(expected)
    assert loaded["module"]["weight"] is loaded["module"]["tied"]
    with LazyShard(V3_FILE) as shard:
        assert vars(shard.read_tensor(shard.obj["fp32_flat_groups"][0])) == {"ds_id": 7}


def test_writer_output_matches_the_version_3_golden_bytes(tmp_path):
    fresh = tmp_path / V3_FILE.name
    nce.save(golden_v3_state(), fresh, algorithm="zstd")
    assert fresh.read_bytes()[: container.HEADER_SIZE] == V3_FILE.read_bytes()[: container.HEADER_SIZE]
    assert _index_without_writer(fresh) == _index_without_writer(V3_FILE)


def test_a_version_2_reader_asks_for_an_upgrade_for_the_version_3_golden_file(monkeypatch):
    """What a reader of the release before version 3 says: the file is newer, not damaged."""
    monkeypatch.setattr(container, "SUPPORTED_FORMAT_VERSIONS", (1, 2))
    with pytest.raises(UnsupportedCheckpointError,
                       match=r"v3_attributes.nvckpt: shard format version 3.*\(1, 2\).*upgrade"):
        nce.load(V3_FILE)


def test_a_stored_copy_of_the_version_2_module_keeps_its_version_and_derived_ranges(tmp_path):
    """`LazyShard.copy` writes the version its storages need (2: derived ranges, copied as
    they are), so the copy beside its source loads as the original."""
    import shutil

    _, module = golden_v2_states()
    shutil.copy(V2_FOLDER / V2_SOURCE, tmp_path / V2_SOURCE)
    with LazyShard(V2_FOLDER / V2_MODULE) as shard:
        shard.copy(shard.obj, tmp_path / V2_MODULE)
    assert container.read_index(tmp_path / V2_MODULE).format_version == 2
    assert_tree_equal(module, nce.load(tmp_path / V2_MODULE))


def test_a_stored_copy_of_the_version_4_module_keeps_its_digests(tmp_path):
    import shutil

    _, module = golden_v2_states()
    shutil.copy(V4_FOLDER / V2_SOURCE, tmp_path / V2_SOURCE)
    with LazyShard(V4_FOLDER / V2_MODULE) as shard:
        shard.copy(shard.obj, tmp_path / V2_MODULE)
    copied = container.read_index(tmp_path / V2_MODULE)
    assert copied.format_version == 4
    assert [s.derived for s in copied.storages] == [s.derived for s in container.read_index(V4_FOLDER / V2_MODULE).storages]
    assert_tree_equal(module, nce.load(tmp_path / V2_MODULE))
