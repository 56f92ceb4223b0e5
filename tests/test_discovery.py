"""`discovery.is_engine_tag` and `is_engine_file`: the one rule for "a tag folder of ours"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nvcomp_ckpt_engine import api, commit, discovery, manifest, retention


def _folder(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "tag"
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"x")
    return folder


@pytest.mark.parametrize("names", [
    (manifest.MANIFEST_NAME,),
    (manifest.TAG_MARKER_NAME,),
    ("mp_rank_00_model_states.pt.nvckpt-stage-r0-0123456789ab", "mp_rank_00_model_states.pt"),
], ids=["manifest", "marker", "staged"])
def test_our_names_make_a_tag_folder(tmp_path: Path, names: tuple[str, ...]) -> None:
    assert discovery.is_engine_tag(_folder(tmp_path, *names))


def test_a_shard_file_makes_a_tag_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    api.save({"w": torch.ones(3)}, folder / "model.pt", algorithm="zstd")
    assert discovery.is_engine_tag(folder)


def test_a_committed_tag_is_ours_and_its_save_directory_is_not(tmp_path: Path) -> None:
    plan = commit.prepare_tag_dir(tmp_path / "ckpt", "global_step1", rank=0)
    discovery.write_latest(plan.save_dir, plan.tag)
    (plan.save_dir / f".latest{'.nvckpt-partial'}").write_bytes(b"global_step")  # torn write
    (plan.save_dir / f".global_step0{retention.TRASH_SUFFIX}").mkdir()  # a deletion under way
    assert discovery.is_engine_tag(plan.tag_dir)
    assert not discovery.is_engine_tag(plan.save_dir)
    assert not discovery.is_engine_tag(tmp_path / "missing")


def test_plain_deepspeed_files_are_not_ours(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    torch.save({"w": torch.ones(3)}, folder / "mp_rank_00_model_states.pt")
    assert not discovery.is_engine_tag(folder)


@pytest.mark.parametrize("name, ours", [
    (manifest.MANIFEST_NAME, True),
    (manifest.TAG_MARKER_NAME, True),
    (".model.pt.nvckpt-partial", True),
    ("model.pt.nvckpt-stage-r3-0123456789ab", True),
    ("model.pt", False),
    ("latest", False),
])
def test_engine_files_are_told_by_name(name: str, ours: bool) -> None:
    assert discovery.is_engine_file(Path("some") / name) is ours


def test_by_names_alone_no_file_is_read(tmp_path: Path) -> None:
    """The walk up a path's ancestors: a folder with a shard file is no tag by its names."""
    folder = _folder(tmp_path)
    api.save({"w": torch.ones(3)}, folder / "model.pt", algorithm="zstd")
    assert not discovery.is_engine_tag(folder, read_files=False)
    (folder / manifest.TAG_MARKER_NAME).write_bytes(b"")
    assert discovery.is_engine_tag(folder, read_files=False)


@pytest.mark.parametrize("names, deletable", [
    ((manifest.TAG_MARKER_NAME, "mp_rank_00_model_states.pt"), True),
    ((".nvcomp_ckpt_engine_tag.0123abcd.nvckpt-partial",), True),
    ((), True),
    (("notes.txt",), False),
    (("model.pt.nvckpt-stage-r0-0123456789ab", "notes.txt"), False),
    ((manifest.MANIFEST_NAME, manifest.TAG_MARKER_NAME), False),
], ids=["marker", "torn-marker", "empty", "foreign", "staged-and-foreign", "unreadable-manifest"])
def test_only_a_provable_failed_save_may_be_deleted(
        tmp_path: Path, names: tuple[str, ...], deletable: bool) -> None:
    assert (discovery.why_not_failed_save(_folder(tmp_path, *names)) is None) is deletable


def test_a_shard_without_the_marker_is_ours_but_not_deletable(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    api.save({"w": torch.ones(3)}, folder / "model.pt", algorithm="zstd")
    assert discovery.is_engine_tag(folder)
    assert "did not create it" in discovery.why_not_failed_save(folder)


def test_a_sparse_latest_is_refused_by_its_size_unread(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`latest` made sparse at 1 GiB is not a tag: said from its size, without a read."""
    import os

    (tmp_path / "global_step1").mkdir()
    (tmp_path / "latest").write_text("global_step1")
    assert discovery.inspect_latest(tmp_path).tag == "global_step1"
    os.truncate(tmp_path / "latest", 1 << 30)
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    pointer = discovery.inspect_latest(tmp_path)
    assert pointer.tag is None and "is longer than 4096 bytes" in pointer.reason
    assert reads == []
