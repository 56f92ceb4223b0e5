"""Opening a checkpoint: one read of its manifest and one of each shard's index per load.

The reads are counted by wrapping `manifest.read_manifest` and `container.read_index`. The
checkpoint is the golden ZeRO-1/2 tag (a module derived from the optimizer shard beside it),
with a manifest and `latest`: the load reads every file, the module rebuilt from its source.
"""

from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

import pytest

from conftest import commit_single_rank_tag
from nvcomp_ckpt_engine import container, discovery, manifest, opened
from nvcomp_ckpt_engine.errors import CorruptCheckpointError, IncompleteCheckpointError
from nvcomp_ckpt_engine.tagreader import TagReader

GOLDEN = Path(__file__).parent / "golden" / "v2_derived"
TAG = "global_step1"


@pytest.fixture
def tag_dir(tmp_path: Path) -> Path:
    """The golden derived tag in a save directory, committed (manifest) and named by latest."""
    folder = tmp_path / "ckpt" / TAG
    folder.mkdir(parents=True)
    for source in sorted(GOLDEN.iterdir()):
        shutil.copy(source, folder / source.name)
    commit_single_rank_tag(folder, TAG)
    return folder


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """How often each manifest and each index is read, by (kind, real path)."""
    counts: collections.Counter = collections.Counter()
    read_manifest, read_index = manifest.read_manifest, container.read_index

    def counted_manifest(folder: str | os.PathLike) -> manifest.Manifest:
        counts["manifest", os.path.realpath(folder)] += 1
        return read_manifest(folder)

    def counted_index(path: str | os.PathLike) -> container.ShardIndex:
        counts["index", os.path.realpath(path)] += 1
        return read_index(path)

    monkeypatch.setattr(manifest, "read_manifest", counted_manifest)
    monkeypatch.setattr(discovery, "read_manifest", counted_manifest)
    monkeypatch.setattr(container, "read_index", counted_index)
    return counts


def _expected(tag_dir: Path) -> collections.Counter:
    real = os.path.realpath(tag_dir)
    files = [f for f in os.listdir(real) if f.endswith(".nvckpt")]
    return collections.Counter({("manifest", real): 1,
                                **{("index", os.path.join(real, f)): 1 for f in files}})


@pytest.mark.parametrize("check_indexes", [False, True], ids=["sizes", "index-crcs"])
def test_a_load_through_latest_reads_the_manifest_and_each_index_once(
    tag_dir: Path, reads: collections.Counter, check_indexes: bool
) -> None:
    checkpoint = opened.open_checkpoint(tag_dir.parent, check_indexes=check_indexes)
    assert checkpoint.tag_dir.name == TAG
    loaded = {relative: checkpoint.load(relative) for relative in checkpoint.paths}
    assert set(loaded) == {"model_states.nvckpt", "optim_states.nvckpt"}
    assert reads == _expected(tag_dir)


def test_tagreader_reads_the_manifest_and_each_index_once(
    tag_dir: Path, reads: collections.Counter
) -> None:
    reader = TagReader(tag_dir)
    whole = {relative: reader.load(relative) for relative in reader.paths}
    for relative in reader.paths:  # again, and in parts: still no second read
        lazy = reader.open_lazy(relative)
        lazy.close()
        reader.load(relative)
    assert reads == _expected(tag_dir)
    assert whole["model_states.nvckpt"]["module"]  # rebuilt from its source


def test_a_link_out_of_the_tag_folder_is_refused_unread(
    tag_dir: Path, tmp_path: Path, reads: collections.Counter
) -> None:
    outside = tmp_path / "elsewhere.nvckpt"
    os.replace(tag_dir / "optim_states.nvckpt", outside)
    os.symlink(outside, tag_dir / "optim_states.nvckpt")
    with pytest.raises(CorruptCheckpointError, match="outside the tag folder"):
        opened.open_tag_dir(tag_dir)
    with pytest.raises(IncompleteCheckpointError, match="outside the tag folder"):
        opened.open_checkpoint(tag_dir.parent)
    assert ("index", str(outside)) not in reads


def test_resuming_without_latest_reads_the_manifest_once(
    tag_dir: Path, reads: collections.Counter
) -> None:
    """Whether there is anything to resume and which checkpoint it is: one reading."""
    (tag_dir.parent / discovery.LATEST_NAME).unlink()
    checkpoint = opened.open_checkpoint(tag_dir.parent, fresh_start_ok=True, fallback_to_complete=True,
                                        check_indexes=True)
    assert checkpoint is not None and checkpoint.tag_dir.name == TAG
    for relative in checkpoint.paths:
        checkpoint.load(relative)
    assert reads == _expected(tag_dir)


def test_resuming_from_nothing_opens_nothing(tmp_path: Path) -> None:
    assert opened.open_checkpoint(tmp_path, fresh_start_ok=True) is None
    (tmp_path / "global_step1").mkdir()  # a folder, no checkpoint in it
    assert opened.open_checkpoint(tmp_path, fresh_start_ok=True, fallback_to_complete=True) is None
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint"):
        opened.open_checkpoint(tmp_path)  # a load that must find one


def test_resuming_without_latest_and_without_fallback_names_the_option(tag_dir: Path) -> None:
    (tag_dir.parent / discovery.LATEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match="fallback_to_complete=True"):
        opened.open_checkpoint(tag_dir.parent, fresh_start_ok=True)
