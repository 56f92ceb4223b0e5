"""Hostile and damaged checkpoint folders met by the DeepSpeed engine's load side, in one process.

The engine is driven by hand the way DeepSpeed drives it (`create`, `save`, `commit`, then
`load` for each file `load_checkpoint` asks for), and once through DeepSpeed's own file
discovery (`DeepSpeedEngine._get_all_ckpt_names`, a glob, and `SDLoaderFactory`, which loads the
first file the glob returns). docs/ATTACKS.md lists the abuses; docs/RELIABILITY.md the counts.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import struct
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from nvcomp_ckpt_engine import commit, container, discovery, manifest
from nvcomp_ckpt_engine.config import NvcompConfig
from nvcomp_ckpt_engine.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeObjectError,
)

from conftest import assert_same_tensor

MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@pytest.fixture()
def make_engine(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Our engine for one rank without a DeepSpeed training engine around it."""
    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.deepspeed.engine import NvcompCheckpointEngine

    monkeypatch.setattr(_compat, "called_from_save_checkpoint", lambda: True)
    monkeypatch.setattr(_compat, "local_rank", lambda: 0)
    monkeypatch.setattr(_compat, "parallel_layout", lambda stage: manifest.layout_record(
        "deepspeed", dp=1, tp=1, pp=1, zero_stage=stage))
    return lambda **options: NvcompCheckpointEngine(
        options=NvcompConfig(enabled=True, algorithm="zstd", chunk_mb=1 / 1024, **options),
        zero_stage=1)


def state_of(name: str, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 100 + len(name))
    if name == MODEL:
        return {"module": {"w": torch.randn(64, generator=g)}, "global_steps": step}
    return {"optimizer_state_dict": {"exp_avg": torch.randn(300, generator=g)}, "step": step}


def save_tag(make_engine: Callable[..., Any], save_dir: Path, step: int) -> Path:
    """One committed checkpoint, written as DeepSpeed's save_checkpoint writes it."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    engine = make_engine()
    tag = f"global_step{step}"
    info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True)
    engine.create(info)
    for name in (MODEL, OPTIM):
        engine.save(state_of(name, step), str(save_dir / tag / name))
    engine.commit(info)
    return save_dir / tag


class RunsCode:
    """Unpickling this runs a shell command: what a planted torch file would do."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def plant(path: Path, sentinel: Path) -> None:
    """A torch.save file that runs code when torch.load(weights_only=False) reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.ones(2)}, "hook": RunsCode(sentinel)}, path)


# ----------------------------------------------------------- code from files in our tag folders


@pytest.mark.parametrize("name", [MODEL, OPTIM])
def test_a_listed_file_replaced_by_a_symlink_out_is_refused_unread(
        make_engine: Callable[..., Any], tmp_path: Path, name: str) -> None:
    """load_checkpoint(dir, tag=...) asks for the file by its name in the tag folder; the link
    leads to a torch file outside, which must not be unpickled."""
    tag_dir = save_tag(make_engine, tmp_path / "ckpt", 1)
    sentinel = tmp_path / "ran"
    plant(tmp_path / "outside" / name, sentinel)
    (tag_dir / name).unlink()
    (tag_dir / name).symlink_to(tmp_path / "outside" / name)
    with pytest.raises(CheckpointError) as info:
        make_engine().load(str(tag_dir / name), map_location="cpu")
    assert "outside the tag folder" in str(info.value), info.value
    assert not sentinel.exists()


def test_a_listed_file_swapped_for_a_symlink_after_the_first_check_is_refused(
        make_engine: Callable[..., Any], tmp_path: Path) -> None:
    """Another rank's file is checked once; the real path is checked at every load."""
    tag_dir = save_tag(make_engine, tmp_path / "ckpt", 1)
    loader = make_engine()
    loader.load(str(tag_dir / MODEL), map_location="cpu")
    sentinel = tmp_path / "ran"
    plant(tmp_path / "outside" / MODEL, sentinel)
    (tag_dir / MODEL).unlink()
    (tag_dir / MODEL).symlink_to(tmp_path / "outside" / MODEL)
    with pytest.raises(CorruptCheckpointError, match="outside the tag folder"):
        loader.load(str(tag_dir / MODEL), map_location="cpu")
    assert not sentinel.exists()


@pytest.mark.parametrize("planted", [
    "mp_rank_0-_model_states.pt",  # sorts before mp_rank_00: DeepSpeed's glob loads it first
    "mp_rank_01_model_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "sub/mp_rank_00_model_states.pt",  # in a folder inside the tag folder
])
def test_a_plain_file_planted_in_a_committed_tag_is_refused_unread(
        make_engine: Callable[..., Any], tmp_path: Path, planted: str) -> None:
    tag_dir = save_tag(make_engine, tmp_path / "ckpt", 1)
    sentinel = tmp_path / "ran"
    plant(tag_dir / planted, sentinel)
    with pytest.raises(IncompleteCheckpointError, match="not listed in the manifest"):
        make_engine().load(str(tag_dir / planted), map_location="cpu")
    assert not sentinel.exists()


def test_deepspeeds_own_file_discovery_meets_the_planted_file_first_and_is_refused(
        make_engine: Callable[..., Any], tmp_path: Path) -> None:
    """`load_checkpoint(dir, tag)`'s path: DeepSpeed globs mp_rank_*_model_states.pt, sorts the
    names and `SDLoaderFactory` loads the first one through the checkpoint engine."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory

    save_dir = tmp_path / "ckpt"
    tag_dir = save_tag(make_engine, save_dir, 1)
    sentinel = tmp_path / "ran"
    plant(tag_dir / "mp_rank_0-_model_states.pt", sentinel)
    deepspeed_engine = types.SimpleNamespace(  # what the methods read of a DeepSpeedEngine
        checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: False,
        load_universal_checkpoint=lambda: False)
    deepspeed_engine._get_ckpt_name = functools.partial(DeepSpeedEngine._get_ckpt_name,
                                                        deepspeed_engine)
    names = DeepSpeedEngine._get_all_ckpt_names(deepspeed_engine, str(save_dir), "global_step1")
    assert [Path(n).name for n in names] == ["mp_rank_0-_model_states.pt", MODEL]
    with pytest.raises(IncompleteCheckpointError, match="mp_rank_0-_model_states.pt"):
        SDLoaderFactory.get_sd_loader(names, checkpoint_engine=make_engine())
    assert not sentinel.exists()
    (tag_dir / "mp_rank_0-_model_states.pt").unlink()
    names = DeepSpeedEngine._get_all_ckpt_names(deepspeed_engine, str(save_dir), "global_step1")
    _, loaded, _ = SDLoaderFactory.get_sd_loader(names, checkpoint_engine=make_engine()).load(1, 0)
    assert_same_tensor(loaded["module"]["w"], state_of(MODEL, 1)["module"]["w"])


def test_a_folder_of_an_unfinished_save_of_ours_loads_nothing(
        make_engine: Callable[..., Any], tmp_path: Path) -> None:
    """Our tag marker and no manifest: a plain file there is not DeepSpeed's either."""
    save_dir = tmp_path / "ckpt"
    save_tag(make_engine, save_dir, 1)
    commit.prepare_tag_dir(save_dir, "global_step2", rank=0)
    sentinel = tmp_path / "ran"
    plant(save_dir / "global_step2" / MODEL, sentinel)
    with pytest.raises(IncompleteCheckpointError, match="global_step1"):
        make_engine().load(str(save_dir / "global_step2" / MODEL), map_location="cpu")
    assert not sentinel.exists()


def test_listed_files_load_at_their_real_path_and_plain_folders_through_the_allowlist(
        make_engine: Callable[..., Any], tmp_path: Path) -> None:
    """A link inside the folder is followed; a plain torch file in a folder the engine did not
    make loads through the allowlist."""
    tag_dir = save_tag(make_engine, tmp_path / "ckpt", 1)
    (tag_dir / MODEL).rename(tag_dir / "moved.bin")
    (tag_dir / MODEL).symlink_to("moved.bin")
    loaded = make_engine().load(str(tag_dir / MODEL), map_location="cpu")
    assert_same_tensor(loaded["module"]["w"], state_of(MODEL, 1)["module"]["w"])
    plain = tmp_path / "plain" / "global_step1" / MODEL
    plain.parent.mkdir(parents=True)
    torch.save({"module": {"w": torch.arange(3.0)}}, plain)
    assert torch.equal(make_engine().load(str(plain))["module"]["w"], torch.arange(3.0))


def test_a_plain_checkpoint_naming_code_is_refused_unless_trusted(
        make_engine: Callable[..., Any], tmp_path: Path) -> None:
    """A checkpoint saved before the engine was on is read through the allowlist, which
    DeepSpeed's own objects pass: a file naming `os.system` is refused, naming the file and the
    global; ``"trust_plain_checkpoints": true`` reads it as DeepSpeed's engine does."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    folder = tmp_path / "plain" / "global_step1"
    sentinel = tmp_path / "ran"
    plant(folder / MODEL, sentinel)
    torch.save({"optimizer_state_dict": {"loss_scaler": LossScaler(4.0),
                                         "zero_stage": ZeroStageEnum.gradients}}, folder / OPTIM)
    loaded = make_engine().load(str(folder / OPTIM), map_location="cpu")["optimizer_state_dict"]
    assert loaded["loss_scaler"].cur_scale == 4.0 and loaded["zero_stage"] is ZeroStageEnum.gradients
    with pytest.raises(UnsafeObjectError, match=rf"{folder / MODEL}: it names 'posix.system'"):
        make_engine().load(str(folder / MODEL), map_location="cpu")
    assert not sentinel.exists()
    make_engine(trust_plain_checkpoints=True).load(str(folder / MODEL), map_location="cpu")
    assert sentinel.exists()  # the payload was live: trusting the folder ran it


# ------------------------------------------------------ a damaged newest checkpoint at resume


def flip_index_byte(path: Path) -> None:
    """Damage the shard's JSON index (its own CRC then fails: seen by reading the index)."""
    data = bytearray(path.read_bytes())
    offset, length = struct.unpack_from("<QQ", data, len(data) - container.TRAILER_SIZE)
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))


def flip_payload_byte(path: Path) -> None:
    """Damage a chunk: the index and its CRC stay intact; only reading the chunk finds it."""
    blob = container.read_index(path).storages[0].chunks[0]
    data = bytearray(path.read_bytes())
    data[blob.offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture()
def two_saves(make_engine: Callable[..., Any], tmp_path: Path) -> Path:
    save_dir = tmp_path / "ckpt"
    for step in (1, 2):
        save_tag(make_engine, save_dir, step)
    discovery.write_latest(save_dir, "global_step2")
    return save_dir


@pytest.mark.parametrize("victim", [MODEL, OPTIM])
def test_a_damaged_index_in_the_newest_checkpoint_falls_back_with_the_option(
        make_engine: Callable[..., Any], two_saves: Path, victim: str,
        caplog: pytest.LogCaptureFixture) -> None:
    flip_index_byte(two_saves / "global_step2" / victim)
    with caplog.at_level(logging.WARNING):
        assert make_engine(fallback_to_complete=True).resolve_tag(str(two_saves)) == "global_step1"
    assert "falling back to the newest complete checkpoint 'global_step1'" in caplog.text
    with pytest.raises(IncompleteCheckpointError) as info:
        make_engine().resolve_tag(str(two_saves))
    text = str(info.value)
    assert "'global_step1'" in text and "fallback_to_complete" in text and victim in text, text


def test_a_damaged_chunk_is_found_before_resuming_when_asked(
        make_engine: Callable[..., Any], two_saves: Path) -> None:
    flip_payload_byte(two_saves / "global_step2" / OPTIM)
    assert make_engine(fallback_to_complete="verify").resolve_tag(str(two_saves)) == "global_step1"
    # Without the full check the index looks intact: the load finds the chunk, and says where
    # to resume from instead.
    assert make_engine(fallback_to_complete=True).resolve_tag(str(two_saves)) == "global_step2"
    with pytest.raises(CorruptCheckpointError) as info:
        make_engine().load(str(two_saves / "global_step2" / OPTIM), map_location="cpu")
    text = str(info.value)
    assert "checksum mismatch" in text and "'global_step1'" in text, text
    assert '"fallback_to_complete": true' in text and '"fallback_to_complete": "verify"' in text, text


def load_tag(engine: Any, save_dir: Path) -> Callable[[str | None], Any]:
    """What DeepSpeed's load_checkpoint does with the engine for a tag: load its files."""
    def load(tag: str | None) -> Any:
        return tag, [engine.load(str(save_dir / str(tag) / name), map_location="cpu")
                     for name in (MODEL, OPTIM)]

    return load


def test_a_damaged_chunk_met_during_the_load_falls_back_with_true(
        make_engine: Callable[..., Any], two_saves: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`"fallback_to_complete": true`: the index is intact, the chunk is found by the load itself,
    and the load is run again from the newest intact checkpoint, with a warning naming the file."""
    flip_payload_byte(two_saves / "global_step2" / OPTIM)
    engine = make_engine(fallback_to_complete=True)
    with caplog.at_level(logging.WARNING):
        tag, states = engine.run_load(load_tag(engine, two_saves), str(two_saves), None,
                                      universal=False)
    assert tag == "global_step1"
    assert_same_tensor(states[1]["optimizer_state_dict"]["exp_avg"],
                       state_of(OPTIM, 1)["optimizer_state_dict"]["exp_avg"])
    assert "falling back to the newest intact checkpoint 'global_step1'" in caplog.text
    assert f"failed on rank 0: CorruptCheckpointError: {two_saves / 'global_step2' / OPTIM}" in caplog.text
    # Without the option, or for a tag asked for by name: the error, naming rank and file.
    for options, tag in (({}, None), ({"fallback_to_complete": True}, "global_step2")):
        engine = make_engine(**options)
        with pytest.raises(CorruptCheckpointError, match=f"failed on rank 0.*{OPTIM}.*checksum"):
            engine.run_load(load_tag(engine, two_saves), str(two_saves), tag, universal=False)


def test_a_damaged_own_file_is_found_when_the_tag_is_opened(
        make_engine: Callable[..., Any], two_saves: Path) -> None:
    """Before DeepSpeed's first load, in the step every rank agrees on: a failure found later,
    inside one rank's load of the module, would leave the others in the module's rebuild."""
    flip_index_byte(two_saves / "global_step2" / OPTIM)
    with pytest.raises(CorruptCheckpointError, match=OPTIM):
        make_engine().open_tag(str(two_saves), "global_step2")


def test_no_intact_checkpoint_to_fall_back_to_is_said(
        make_engine: Callable[..., Any], two_saves: Path) -> None:
    for tag in ("global_step1", "global_step2"):
        flip_index_byte(two_saves / tag / MODEL)
    with pytest.raises(IncompleteCheckpointError, match="no complete checkpoint to fall back to"):
        make_engine(fallback_to_complete=True).resolve_tag(str(two_saves))
    shutil.rmtree(two_saves / "global_step1")
    with pytest.raises(CorruptCheckpointError, match="holds no other intact checkpoint"):
        make_engine().load(str(two_saves / "global_step2" / MODEL), map_location="cpu")


def test_fallback_to_complete_takes_true_false_or_verify() -> None:
    with pytest.raises(ValueError, match="'fallback_to_complete' = 'yes'"):
        NvcompConfig(fallback_to_complete="yes")
    assert NvcompConfig.from_mapping({"fallback_to_complete": "verify"}).fallback_to_complete == "verify"
