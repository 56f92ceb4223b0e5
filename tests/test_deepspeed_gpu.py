"""DeepSpeed save → resume on a GPU with nvCOMP: ZeRO 1, 2, 3 × bf16, fp16, async and portable.

One process per GPU over NCCL (here: one GPU). Each case trains, saves through the engine,
resumes in a fresh process with another seed, and must match the uninterrupted run bit for bit
(parameters, full optimizer state, next losses). Skipped without CUDA (see conftest).
"""

from __future__ import annotations

import pytest
import torch

import ds_train
from nvcomp_ckpt_engine import manifest
from test_deepspeed_engine import Launcher, _assert_same

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    launcher = Launcher(tmp_path_factory.mktemp("ds_gpu_runs"))
    launcher.env.pop("DS_ACCELERATOR")
    launcher.env["DS_TRAIN_BACKEND"] = "nccl"
    nproc = torch.cuda.device_count()
    launcher.run(nproc, *(f"save:{name}" for name in ds_train.GPU_CASES))
    launcher.run(nproc, *(f"resume:{name}" for name in ds_train.GPU_CASES))
    launcher.nproc = nproc
    return launcher


@pytest.mark.parametrize("name", list(ds_train.GPU_CASES))
def test_gpu_resume_is_bit_exact_and_compressed_with_nvcomp(gpu_runs: Launcher, name: str) -> None:
    for rank in range(gpu_runs.nproc):
        reference = torch.load(gpu_runs.out / name / f"save_rank{rank}.pt", weights_only=False)
        resumed = torch.load(gpu_runs.out / name / f"resume_rank{rank}.pt", weights_only=False)
        assert _assert_same(reference, resumed, f"{name} rank {rank}") >= 8
    found = manifest.read_manifest(gpu_runs.out / name / "ckpt" / "global_step3")
    codecs = {c for record in found.files for c in record.codecs}
    expected = "zstd" if ds_train.GPU_CASES[name].nvcomp.get("portable") else "ans"
    assert expected in codecs, codecs
