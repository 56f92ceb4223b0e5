"""DeepSpeed save → resume on a GPU with nvCOMP: ZeRO 1, 2, 3 × bf16, fp16, async, portable, and
the ZeRO shard decoded onto the GPU (``load_to_gpu``, the default) or into host memory.

One process per GPU over NCCL (here: one GPU). Each case trains, saves through the engine,
resumes in a fresh process with another seed, and must match the uninterrupted run bit for bit
(parameters, full optimizer state, next losses). Skipped without CUDA (see conftest); a case
whose dtype this GPU's DeepSpeed accelerator does not support is skipped with the reason.
"""

from __future__ import annotations

import json

import pytest
import torch

import ds_train
from nvcomp_ckpt_engine import manifest
from nvcomp_ckpt_engine.config import NvcompConfig
from test_deepspeed_engine import Launcher, _assert_same

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # torchrun jobs, one rank per GPU


def _unsupported_reason(name: str) -> str | None:
    """Why the GPU's DeepSpeed accelerator cannot train case `name`'s dtype; None if it can."""
    from deepspeed.accelerator import get_accelerator

    dtype = ds_train.GPU_CASES[name].dtype
    accelerator = get_accelerator()
    supported = {"fp32": True, "fp16": accelerator.is_fp16_supported(),
                 "bf16": accelerator.is_bf16_supported()}[dtype]
    return None if supported else f"{accelerator.device_name()} does not support {dtype}"


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    launcher = Launcher(tmp_path_factory.mktemp("ds_gpu_runs"))
    launcher.env.pop("DS_ACCELERATOR")
    launcher.env["DS_TRAIN_BACKEND"] = "nccl"
    nproc = torch.cuda.device_count()
    cases = [name for name in ds_train.GPU_CASES if _unsupported_reason(name) is None]
    launcher.run(nproc, *(f"save:{name}" for name in cases))
    launcher.run(nproc, *(f"resume:{name}" for name in cases))
    launcher.nproc = nproc
    return launcher


def _case_dir(gpu_runs: Launcher, name: str):
    """The case's results; skips an unsupported dtype, fails on a job that raised."""
    reason = _unsupported_reason(name)
    if reason is not None:
        pytest.skip(reason)
    failures = sorted((gpu_runs.out / name).glob("failed_*_rank*.txt"))
    assert not failures, "\n".join(f.read_text() for f in failures)
    return gpu_runs.out / name


@pytest.mark.parametrize("name", list(ds_train.GPU_CASES))
def test_gpu_resume_is_bit_exact_and_compressed_with_nvcomp(gpu_runs: Launcher, name: str) -> None:
    case_dir = _case_dir(gpu_runs, name)
    for rank in range(gpu_runs.nproc):
        reference = torch.load(case_dir / f"save_rank{rank}.pt", weights_only=False)
        resumed = torch.load(case_dir / f"resume_rank{rank}.pt", weights_only=False)
        assert _assert_same(reference, resumed, f"{name} rank {rank}") >= 8
    found = manifest.read_manifest(case_dir / "ckpt" / "global_step3")
    codecs = {c for record in found.files for c in record.codecs}
    expected = "zstd" if ds_train.GPU_CASES[name].nvcomp.get("portable") else "ans"
    assert expected in codecs, codecs


@pytest.mark.parametrize("name", list(ds_train.GPU_CASES))
def test_gpu_own_zero_shard_is_decoded_onto_the_gpu_unless_turned_off(gpu_runs: Launcher, name: str) -> None:
    """With ``load_to_gpu`` on ("auto": these shards fit), each rank's ZeRO shard is decoded onto
    its GPU — and the resume above is bit-exact either way."""
    case_dir = _case_dir(gpu_runs, name)
    expected_on_gpu = ds_train.GPU_CASES[name].nvcomp.get("load_to_gpu", "auto") is not False
    for rank in range(gpu_runs.nproc):
        messages = json.loads((case_dir / f"placement_rank{rank}.json").read_text())
        onto_gpu = [m for m in messages
                    if "optim_states.pt" in m and f"onto cuda:{rank}" in m and "host memory" not in m]
        assert bool(onto_gpu) == expected_on_gpu, messages


@pytest.mark.parametrize("name", ["gpu-async-z2-bf16", "gpu-async-nosnapshot-z1-bf16"])
def test_gpu_async_saves_copy_the_state_on_the_gpu_where_the_budget_holds_it(
        gpu_runs: Launcher, name: str) -> None:
    """With ``async_gpu_snapshot`` turned on and the automatic GPU budget, which caches the
    raw ZeRO state ahead, the optimizer shards' state is copied on the GPU and encoded beside
    the next steps (the commit record's ``gpu_snapshot_bytes``); turned off, nothing is copied.
    Both resumes are bit-exact (`test_gpu_resume_is_bit_exact_and_compressed_with_nvcomp`)."""
    case_dir = _case_dir(gpu_runs, name)
    records = [json.loads(line) for line in (case_dir / "commits.jsonl").read_text().splitlines()]
    assert records and all(r["async"] for r in records)
    copied = [r["gpu_snapshot_bytes"] for r in records]
    if ds_train.GPU_CASES[name].nvcomp.get("async_gpu_snapshot", NvcompConfig.async_gpu_snapshot):
        assert any(copied), copied
    else:
        assert not any(copied), copied
