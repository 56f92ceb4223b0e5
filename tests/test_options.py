"""One compression-options type: its defaults and its checks are those of every writer.

`save` / `save_async` keywords, the DeepSpeed config (`NvcompConfig`, which extends the type)
and the DCP writer / Megatron strategy (which hold one) all go through
`options.CompressionOptions`, so a value is accepted or refused with the same words everywhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import options
from nvcomp_ckpt_engine.config import SECTION, NvcompConfig
from nvcomp_ckpt_engine.options import CompressionOptions, check_workers

SHARED = ("algorithm", "portable", "chunk_mb", "gpu_batch_mb")

BAD = [
    ({"algorithm": "brotli"}, ["'algorithm' = 'brotli'", "unknown algorithm", "'zstd'"]),
    ({"algorithm": "ans", "portable": True}, ["'algorithm' = 'ans'", '"portable"', "'zstd'"]),
    ({"portable": "yes"}, ["'portable' = 'yes'", "true or false"]),
    ({"chunk_mb": 0}, ["'chunk_mb' = 0", "1/1024 to 1024"]),
    ({"chunk_mb": 4096}, ["'chunk_mb' = 4096", "1/1024 to 1024"]),
    ({"chunk_mb": True}, ["'chunk_mb' = True"]),
    ({"chunk_mb": float("inf")}, ["'chunk_mb' = inf"]),
    ({"gpu_batch_mb": 0.5}, ["'gpu_batch_mb' = 0.5", "1 to 16384"]),
    ({"gpu_batch_mb": "256"}, ["'gpu_batch_mb' = '256'", "1 to 16384"]),
]


def test_defaults_are_those_of_every_writer() -> None:
    default = CompressionOptions()
    assert (default.algorithm, default.portable) == ("auto", False)
    assert (default.chunk_mb, default.gpu_batch_mb) == (options.DEFAULT_CHUNK_MB,
                                                         options.DEFAULT_GPU_BATCH_MB)
    assert default.chunk_bytes == 16 << 20 and default.gpu_batch_bytes == 256 << 20
    config = NvcompConfig()
    assert isinstance(config, CompressionOptions)
    assert all(getattr(config, name) == getattr(default, name) for name in SHARED)
    for writer in (nce.save, nce.save_async):
        params = inspect.signature(writer).parameters
        assert all(params[name].default == getattr(default, name) for name in SHARED)


def test_the_type_is_frozen_and_picklable() -> None:
    opts = CompressionOptions(algorithm="zstd", chunk_mb=1 / 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.chunk_mb = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(opts)) == opts  # Megatron's writer processes get it


@pytest.mark.parametrize("kwargs, words", BAD)
def test_a_bad_value_is_refused_with_the_same_words_by_every_writer(tmp_path, kwargs: dict,
                                                                    words: list[str]) -> None:
    refusals = []
    with pytest.raises(ValueError) as info:
        CompressionOptions(**kwargs)
    refusals.append(str(info.value))
    with pytest.raises(ValueError) as info:
        nce.save({}, tmp_path / "s.pt", **kwargs)
    refusals.append(str(info.value))
    with pytest.raises(ValueError) as info:
        NvcompConfig.from_mapping(kwargs)
    assert str(info.value) == f"{SECTION}: {refusals[0]}"  # the config says where, too
    assert refusals[1] == refusals[0]
    for word in words:
        assert word in refusals[0], refusals[0]
    assert not (tmp_path / "s.pt").exists()


@pytest.mark.parametrize("workers", [0, -1, 1.5, "4"])
def test_workers_must_be_a_positive_integer(tmp_path, workers) -> None:
    with pytest.raises(ValueError, match="'workers'"):
        check_workers(workers)
    with pytest.raises(ValueError, match="'workers'"):
        nce.save({}, tmp_path / "s.pt", workers=workers)
    assert check_workers(None) is None and check_workers(3) == 3


def test_the_dcp_writer_holds_the_one_type(tmp_path) -> None:
    from nvcomp_ckpt_engine.dcp import NvcompFileSystemWriter

    writer = NvcompFileSystemWriter(tmp_path, algorithm="zstd", chunk_mb=1 / 64, workers=2)
    assert writer.options == CompressionOptions(algorithm="zstd", chunk_mb=1 / 64)
    assert writer.workers == 2
    with pytest.raises(ValueError, match="'chunk_mb' = 0"):
        NvcompFileSystemWriter(tmp_path, chunk_mb=0)
