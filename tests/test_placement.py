"""Where a rank's own ZeRO shard is decoded (`deepspeed.placement`): the decision on its own.

The decode onto the GPU itself runs in tests/test_deepspeed_gpu.py (bit-exact resume with the
shard decoded onto the GPU and with it in host memory).
"""

from __future__ import annotations

import logging

import pytest
import torch

from nvcomp_ckpt_engine.deepspeed import placement
from nvcomp_ckpt_engine.errors import CheckpointError

GIB = 1 << 30
GPU = torch.device("cuda", 1)
SHARD = [("cuda:0", 6 * GIB), ("cuda:0", 2 * GIB), ("cpu", 8)]  # two GPU storages, a CPU step


def _plan(storages: list[tuple[str, int]], mode: bool | str, available: int) -> dict[str, str] | None:
    return placement.shard_map_location(storages, mode=mode, device=GPU, available_bytes=available,
                                        path="ckpt/zero_pp_rank_1_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize("mode", ["auto", True])
def test_gpu_saved_storages_go_to_this_ranks_gpu_and_host_ones_stay(mode: bool | str) -> None:
    """Saved on cuda:0 by another process: onto this rank's current GPU; the CPU step stays."""
    assert _plan(SHARD, mode, 8 * GIB + placement.HEADROOM_BYTES) == {"cuda:0": "cuda:1", "cpu": "cpu"}


def test_off_or_nothing_saved_on_a_gpu_means_deepspeeds_placement() -> None:
    assert _plan(SHARD, False, 100 * GIB) is None
    assert _plan([("cpu", 8 * GIB)], True, 100 * GIB) is None  # ZeRO-Offload state stays in host memory


def test_auto_falls_back_to_host_memory_when_it_does_not_fit(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=placement.__name__):
        assert _plan(SHARD, "auto", 8 * GIB + placement.HEADROOM_BYTES - 1) is None
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in caplog.text
    assert "host memory" in caplog.text


def test_forced_placement_that_does_not_fit_names_the_file_and_the_option() -> None:
    with pytest.raises(CheckpointError) as info:
        _plan(SHARD, True, 4 * GIB)
    message = str(info.value)
    for word in ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "8.59 GB", "cuda:1", '"load_to_gpu"', '"auto"'):
        assert word in message
