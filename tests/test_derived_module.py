"""The derived ZeRO-1/2 module end to end: DeepSpeed on the CPU, gloo, 1, 2 and 4 ranks.

Every case (ZeRO-1/2 x fp32/bf16) is saved twice from the same state: by the engine, which
stores the module as derived from the optimizer shards' fp32 partitions, and by DeepSpeed's own
engine, the reference. The tests require the module to be derived, a resume to be bit-exact
(the module rebuilt by the all-gather inside DeepSpeed), a module-only load at the same and at
another data-parallel size to give the reference module, and `nvcomp-ckpt decompress` and
`nvcomp-ckpt zero-to-fp32` to give, tensor for tensor, what they give from the reference, and
`save_16bit_model` to export the module as a plain file. One launch per data-parallel size and
dtype runs that dtype's cases (tests/ds_derived_job.py), when a test of the dtype first needs it;
a dtype that DeepSpeed's CPU accelerator does not support here is skipped (tests/capabilities.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ds_derived_job
from capabilities import unsupported_reason
from conftest import raw_bytes
from nvcomp_ckpt_engine import cli, container, state
from test_launchers import free_port, launch_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(ds_derived_job.__file__).resolve()
CASES = list(ds_derived_job.CASES)
SIZES = (2, 4, 1)
#: Each size also loads, module only, the checkpoints of the size launched before it.
MODULE_ONLY_FROM = {2: 2, 4: 2, 1: 4}
TAG = "global_step3"
MODEL_FILE = "mp_rank_00_model_states.pt"


def _launch(out: Path, nproc: int, jobs: list[str]) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(SCRIPT), str(out), *jobs]
    done = subprocess.run(command, cwd=ROOT, env=launch_env(OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-6000:]}")


class Runs:
    """This module's launches, one dtype at a time (every size in order: each size loads the
    checkpoints of the size launched before it), started when a test of the dtype first needs
    them. A failed launch fails that dtype's tests only."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._launched: dict[str, BaseException | None] = {}

    def case_dir(self, name: str, size: int) -> Path:
        """The folder of case `name` at `size` ranks, launched if need be (or skip, or fail)."""
        dtype = ds_derived_job.CASES[name].dtype
        reason = unsupported_reason(dtype)
        if reason is not None:
            pytest.skip(reason)
        if dtype not in self._launched:
            self._launched[dtype] = self._launch([n for n, c in ds_derived_job.CASES.items() if c.dtype == dtype])
        if self._launched[dtype] is not None:
            pytest.fail(f"the {dtype} launches failed: {self._launched[dtype]}")
        return self.out / f"{name}-dp{size}"

    def _launch(self, names: list[str]) -> BaseException | None:
        try:
            for size in SIZES:
                _launch(self.out, size, [f"{name}@{name}-dp{MODULE_ONLY_FROM[size]}" for name in names])
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return exc
        return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("derived"))


def _tensors(obj: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a loaded file by key path, skipping the ds_config (its engine section
    differs between the two saves)."""
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k != "ds_config"}
    return state.tensor_keys(obj)


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> int:
    assert sorted(a) == sorted(b), where
    for key in a:
        assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), f"{where}: {key}"
        assert torch.equal(raw_bytes(a[key]), raw_bytes(b[key])), f"{where}: {key} differs"
    return len(a)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", CASES)
def test_the_module_is_stored_as_derived(runs: Runs, name: str, size: int) -> None:
    tag_dir = runs.case_dir(name, size) / "ckpt" / TAG
    index = container.read_index(tag_dir / MODEL_FILE)
    module = [t for t in index.tensors if t.key.startswith("module/")]
    assert module, "no module tensors in the model states"
    for t in module:
        entry = index.storages[t.storage]
        assert entry.derived and entry.stored_nbytes == 0, f"{t.key} is stored, not derived"
        assert all(r.digest is not None for r in entry.derived), f"{t.key}: a range without its digest"
    assert sorted(index.derived_files) == sorted(
        p.name for p in tag_dir.glob("*optim_states.pt")), "the module is not spread over every shard"
    assert cli.main(["verify", "-q", str(tag_dir)]) == 0


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", CASES)
def test_resume_is_bit_exact(runs: Runs, name: str, size: int) -> None:
    folder = runs.case_dir(name, size)
    for rank in range(size):
        saved = torch.load(folder / f"save_rank{rank}.pt", weights_only=False)
        resumed = torch.load(folder / f"resume_rank{rank}.pt", weights_only=False)
        compared = _assert_same_tensors(_tensors(saved), _tensors(resumed), f"{name} dp{size} rank {rank}")
        assert compared >= 10 and saved["global_steps"] == resumed["global_steps"]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", CASES)
def test_module_only_load_gives_the_saved_module(runs: Runs, name: str, size: int) -> None:
    folder = runs.case_dir(name, size)
    source = f"{name}-dp{MODULE_ONLY_FROM[size]}"
    reference = torch.load(runs.out / source / "plain" / TAG / MODEL_FILE, weights_only=False)["module"]
    for rank in range(size):
        loaded = torch.load(folder / f"moduleonly_{source}_rank{rank}.pt", weights_only=True)
        _assert_same_tensors(loaded, dict(reference), f"{name} dp{size} rank {rank} from {source}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", CASES)
def test_decompress_gives_a_plain_save_tensor_for_tensor(runs: Runs, name: str, size: int, tmp_path: Path) -> None:
    folder = runs.case_dir(name, size)
    assert cli.main(["decompress", "-q", str(folder / "ckpt"), str(tmp_path / "plain")]) == 0
    plain_files = sorted(p.name for p in (folder / "plain" / TAG).glob("*.pt"))
    assert sorted(p.name for p in (tmp_path / "plain" / TAG).glob("*.pt")) == plain_files
    for file in plain_files:
        ours = torch.load(tmp_path / "plain" / TAG / file, weights_only=False)
        reference = torch.load(folder / "plain" / TAG / file, weights_only=False)
        _assert_same_tensors(_tensors(ours), _tensors(reference), f"{name} dp{size} {file}")


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", CASES)
def test_zero_to_fp32_gives_the_reference_weights(runs: Runs, name: str, size: int, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = runs.case_dir(name, size)
    assert cli.main(["zero-to-fp32", str(folder / "ckpt"), str(tmp_path)]) == 0
    ours = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    reference = get_fp32_state_dict_from_zero_checkpoint(str(folder / "plain"), tag=TAG)
    assert _assert_same_tensors(ours, dict(reference), f"{name} dp{size}") == 4


@pytest.mark.parametrize("name", CASES)
def test_save_16bit_model_exports_the_module_as_a_plain_file(runs: Runs, name: str) -> None:
    folder = runs.case_dir(name, 2)
    export = torch.load(folder / "export" / "pytorch_model.bin", weights_only=True)
    reference = torch.load(folder / "plain" / TAG / MODEL_FILE, weights_only=False)["module"]
    _assert_same_tensors(export, dict(reference), f"{name} export")
