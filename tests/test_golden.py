"""Checked-in files of every released format version still load, and the format is unchanged."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import container

from test_roundtrip import assert_tree_equal

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from make_golden import (  # noqa: E402
    ALGORITHMS, V2_FOLDER, V2_MODULE, V2_SOURCE, golden_state, golden_v2_derive, golden_v2_states,
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


def test_writer_output_matches_the_version_2_golden_bytes(tmp_path):
    source, module = golden_v2_states()
    fresh = tmp_path / V2_MODULE
    nce.save(module, fresh, algorithm="zstd", derive=golden_v2_derive)
    golden = V2_FOLDER / V2_MODULE
    assert fresh.read_bytes()[: container.HEADER_SIZE] == golden.read_bytes()[: container.HEADER_SIZE]
    assert _index_without_writer(fresh) == _index_without_writer(golden)
