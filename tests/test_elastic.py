"""Resuming on another number of ranks, straight from compressed checkpoints.

Real DeepSpeed runs on the CPU (gloo, tests/ds_elastic.py) save at 4 ranks with ZeRO-1, 2 and 3
(fp32, bf16; fp16 where the CPU has it; DeepSpeed's BF16_Optimizer) and at 2 ranks (ZeRO-2, ZeRO-3 bf16),
each twice at the same step:
with the engine, and with DeepSpeed's default engine. Then the routes run side by side and
resume at 2, 3 and 1 ranks (the 2-rank saves at 4): a plain ``load_checkpoint`` of the engine's
checkpoint, resharded at load (ZeRO-1, 2 and 3); ours to a universal
checkpoint, with exactly the commands docs/DEEPSPEED.md gives (`nvcomp-ckpt to-universal`, then
``"load_universal": true``); and DeepSpeed's own (its plain checkpoint, ``ds_to_universal``,
``"load_universal": true``). Required, bit for bit: the same universal files (every tensor), the
same parameters and optimizer state after the load as DeepSpeed's route and as at the save,
and the same losses over the next steps (also for a ZeRO-2 save without the derived module,
node-local storage, resumed at 3; and, for ZeRO-3, DeepSpeed's ds_to_universal run on the
engine's own checkpoint, loaded with the engine on). A checkpoint a plain load cannot reshard (one saved
before the record, a ZeRO-3 one here) is refused naming the conversion, with an error that is
DeepSpeed's ZeRORuntimeException too; a damaged source shard fails a reshard on every rank. All runs
share five launches (module fixture).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nvcomp_ckpt_engine import cli, manifest, state

import ds_elastic
from capabilities import unsupported_reason
from test_cli import assert_same_object
from test_launchers import free_port, launch_env
from test_universal import assert_same_universal, ds_to_universal

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(ds_elastic.__file__).resolve()
DOC = ROOT / "docs" / "DEEPSPEED.md"
SECTION = "## Resume on another number of GPUs"
TAG = "global_step3"
LAUNCH_TIMEOUT_S = 600
#: Cases saved at 4 ranks and where each resumes; the 2-rank save resumes at 4.
SAVED_AT = {name: (2 if name.endswith("-dp2") else 4) for name in ds_elastic.CASES}
RESUMED_AT = {name: ((4,) if SAVED_AT[name] == 2 else (2, 3, 1)) for name in ds_elastic.CASES}
#: The case without the derived module resumes at the uneven size only (CI time).
RESUMED_AT["z2-fp32-whole-module"] = (3,)
ROUTES = ("ours", "deepspeed")
#: The cases a plain load_checkpoint reshards: all (ZeRO-1, 2 and 3).
PLAIN = set(ds_elastic.CASES)
#: The copy of z3-fp32's checkpoints whose manifest lacks the reshard record, as one written
#: before the record was: a plain load at another size refuses it.
WITHOUT_RECORD = "checkpoints_without_record"


#: The case whose own checkpoint also goes through DeepSpeed's ds_to_universal (with the
#: import hook reading our shards), loaded with the engine on: route "dsconv".
CONVERTED_BY_DEEPSPEED = "z3-fp32"


def routes(name: str) -> tuple[str, ...]:
    found = (*ROUTES, "plain") if name in PLAIN else ROUTES
    return (*found, "dsconv") if name == CONVERTED_BY_DEEPSPEED else found


# ------------------------------------------------------------------------------ the docs


def documented_steps() -> tuple[list[str], dict[str, Any], str]:
    """The conversion command, the ds_config keys and the load directory that the section
    "Resume on another number of GPUs" of docs/DEEPSPEED.md tells a user to use."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    section = section[: section.find("\n## ", len(SECTION))]
    blocks = dict(re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S))
    lines = [line.strip() for line in blocks["bash"].splitlines()]
    (command,) = [line for line in lines if line.startswith("nvcomp-ckpt ")]
    keys = json.loads("{" + blocks["json"] + "}")
    (load_dir,) = re.findall(r'load_checkpoint\("([^"]+)"\)', blocks["python"])
    return shlex.split(command), keys, load_dir


def test_the_docs_give_one_command_one_setting_and_one_load() -> None:
    argv, keys, load_dir = documented_steps()
    assert argv[:2] == ["nvcomp-ckpt", "to-universal"]
    assert keys == {"checkpoint": {"load_universal": True}}
    assert load_dir == argv[3]


# ------------------------------------------------------------------------------ the runs


def _hooked() -> bool:
    import site

    return any((Path(folder) / "nvcomp_ckpt_engine_hook.pth").is_file()
               for folder in [*site.getsitepackages(), site.getusersitepackages()])


class Runs:
    """The launches of tests/ds_elastic.py and the conversions between them."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.env = launch_env(OMP_NUM_THREADS="1")
        self.cases = [name for name, case in ds_elastic.CASES.items()
                      if unsupported_reason(case.dtype) is None]

    def launch(self, nproc: int, *jobs: str) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER),
                   str(self.out), *jobs]
        env = dict(self.env)
        if not _hooked():  # a source checkout: make the package importable, enable explicitly
            command.append("--enable")
            env["PYTHONPATH"] = str(ROOT)
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=LAUNCH_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-6000:]}")

    def convert(self, name: str, command: list[str]) -> None:
        """Both routes for one case: `command` (ours, run in the case's folder as a user would
        run the documented one), and DeepSpeed's ds_to_universal on the plain copy."""
        case_dir = self.out / name
        with _cwd(case_dir):
            assert cli.main(command[1:]) == 0
        _, keys, load_dir = documented_steps()
        (case_dir / "ours.json").write_text(json.dumps({"load_dir": load_dir, "ds_config": keys}))
        ds_to_universal(case_dir / "plain_checkpoints" / TAG, case_dir / "universal_deepspeed" / TAG)
        if name == CONVERTED_BY_DEEPSPEED:
            import _nvcomp_ckpt_engine_hook

            _nvcomp_ckpt_engine_hook.shim_torch_load(torch)  # as the installed hook does
            ds_to_universal(case_dir / "checkpoints" / TAG, case_dir / "universal_of_ours" / TAG)

    def resumes(self, names: list[str], size: int) -> list[str]:
        """The resume jobs of the cases in `names` that resume at `size` ranks."""
        return [f"resume:{name}:{route}" for name in names if size in RESUMED_AT[name]
                for route in routes(name)]


def _copy_without_record(case_dir: Path) -> None:
    """`WITHOUT_RECORD`: the case's checkpoints, their manifest rewritten without the record."""
    copy = case_dir / WITHOUT_RECORD
    shutil.copytree(case_dir / "checkpoints", copy)
    found = manifest.read_manifest(copy / TAG)
    layout = {key: value for key, value in found.layout.items() if key != "zero_partitions"}
    manifest.write_manifest(copy / TAG, dataclasses.replace(found, layout=layout))


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    runs = Runs(tmp_path_factory.mktemp("elastic"))
    documented, _, _ = documented_steps()
    small = [name for name in runs.cases if SAVED_AT[name] == 2]
    large = [name for name in runs.cases if SAVED_AT[name] == 4]
    runs.launch(2, *(f"save:{name}" for name in small))
    for name in small:
        runs.convert(name, documented)
    runs.launch(4, *(f"save:{name}" for name in large), *runs.resumes(small, 4))
    for name in large:
        runs.convert(name, documented)
    _copy_without_record(runs.out / "z3-fp32")
    runs.launch(2, *runs.resumes(large, 2), f"load:z3-fp32:{WITHOUT_RECORD}")
    # The command the refusal names, run as it is, converts the checkpoint.
    refused = json.loads((runs.out / "z3-fp32" / "outcome_dp2.json").read_text())
    (named,) = re.findall(r"`(nvcomp-ckpt to-universal [^`]*)`", refused["message"])
    assert cli.main(shlex.split(named)[1:]) == 0
    assert (runs.out / "z3-fp32" / f"{WITHOUT_RECORD}_universal" / TAG).is_dir()
    runs.launch(3, *runs.resumes(large, 3), "damaged:z2-fp32")
    runs.launch(1, *runs.resumes(large, 1))
    return runs


# ------------------------------------------------------------------------------ the checks


def _case_params() -> list[Any]:
    return [pytest.param(name, marks=pytest.mark.slow) for name in ds_elastic.CASES]


def _skip_unsupported(name: str) -> None:
    reason = unsupported_reason(ds_elastic.CASES[name].dtype)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("name", _case_params())
def test_universal_files_are_deepspeeds_tensor_for_tensor(runs: Runs, name: str) -> None:
    _skip_unsupported(name)
    ours = runs.out / name / documented_steps()[2]
    stage = ds_elastic.CASES[name].stage
    compared = assert_same_universal(runs.out / name / "universal_deepspeed", ours)
    assert compared >= (16 if stage == 3 else 12)
    assert (ours / "latest_universal").read_text() == TAG
    found = manifest.read_manifest(ours / TAG)
    assert found.layout["zero_stage"] == stage and found.layout["source_dp"] == SAVED_AT[name]
    assert cli.main(["verify", "-q", str(ours / TAG)]) == 0


def _keys_sorted(obj: Any) -> Any:
    """`obj` with every dict's keys in sorted order (values as they are)."""
    if isinstance(obj, dict):
        return type(obj)((key, _keys_sorted(obj[key])) for key in sorted(obj, key=str))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_keys_sorted(v) for v in obj)
    return obj


@pytest.mark.parametrize("name", _case_params())
def test_resume_at_another_size_matches_deepspeeds_route(runs: Runs, name: str) -> None:
    _skip_unsupported(name)
    saved = torch.load(runs.out / name / "saved.pt", weights_only=False)
    for size in RESUMED_AT[name]:
        for rank in range(size):
            results = {route: torch.load(runs.out / name / f"resume_{route}_dp{size}_rank{rank}.pt",
                                         weights_only=False) for route in routes(name)}
            where = f"{name} at {size} ranks, rank {rank}"
            assert_same_object(results["deepspeed"], results["ours"], f"{where}, ours")
            for route in ("plain", "dsconv"):  # DeepSpeed's universal load orders keys as listdir does
                if route in results:
                    assert_same_object(_keys_sorted(results["deepspeed"]), _keys_sorted(results[route]),
                                       f"{where}, {route}")
            compared = len(state.flatten(results["ours"]).tensors)
            assert compared >= 20, f"{where}: too few tensors compared"
            assert len(results["ours"]["losses"]) == ds_elastic.STEPS_AFTER
            for route in results:  # every route restores exactly what was saved
                assert_same_object(saved, results[route]["loaded"], f"{where}, {route}")


@pytest.mark.slow
def test_a_load_at_another_size_it_cannot_reshard_names_both_steps(runs: Runs) -> None:
    for name, size in (("z3-fp32", 2),):
        outcome = json.loads((runs.out / name / f"outcome_dp{size}.json").read_text())
        # DeepSpeed's own refusal type too: a script that catches DeepSpeed's catches ours.
        assert outcome["type"] == "ZeroDataParallelSizeError" and outcome["deepspeeds_type"], outcome
        save_dir = runs.out / name / WITHOUT_RECORD
        message = outcome["message"]
        for words in (f"dp: saved {SAVED_AT[name]}, now {size}",
                      f"`nvcomp-ckpt to-universal {save_dir} {save_dir}_universal --tag {TAG}`",
                      '"checkpoint": {"load_universal": true}',
                      f"load_checkpoint('{save_dir}_universal')"):
            assert words in message, (words, message)
        assert "load_universal_checkpoint" not in message


@pytest.mark.slow
def test_a_damaged_source_shard_fails_a_reshard_on_every_rank(runs: Runs) -> None:
    """Resharding 4 -> 3, rank 2 reads the damaged exp_avg of saved rank 3; every rank raises
    the error, naming the file (the others through the ranks' exchange of outcomes)."""
    for rank in range(3):
        outcome = json.loads((runs.out / "z2-fp32" / f"damaged_dp3_rank{rank}.json").read_text())
        assert outcome["type"] == "CorruptCheckpointError", outcome
        assert "zero_pp_rank_3_mp_rank_00_optim_states.pt" in outcome["message"], outcome
        if rank != 2:
            assert "failed on rank 2" in outcome["message"], outcome


@pytest.mark.slow
def test_the_reshard_record_is_in_the_manifest_that_inspect_and_verify_read(
        runs: Runs, capsys: pytest.CaptureFixture[str]) -> None:
    tag_dir = runs.out / "z2-fp32" / "checkpoints" / TAG
    found = manifest.read_manifest(tag_dir)
    assert [len(g["params"]) for g in found.layout["zero_partitions"]] == [4]
    # version 2 brought the record; the engine's manifests are version 3 since each file records
    # how it was written (its "io")
    assert json.loads((tag_dir / manifest.MANIFEST_NAME).read_text())["version"] == manifest.FORMAT_VERSION == 3
    assert cli.main(["verify", "-q", str(tag_dir)]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(tag_dir)]) == 0
    assert '"zero_partitions": "1 param groups, 4 parameters"' in capsys.readouterr().out


@pytest.mark.slow
def test_the_case_without_the_derived_module_stores_the_module_whole(runs: Runs) -> None:
    """What makes "z2-fp32-whole-module" the reshard without the derived module: its saved
    module states hold every module tensor's bytes, derived from no shard."""
    from nvcomp_ckpt_engine import container

    tag_dir = runs.out / "z2-fp32-whole-module" / "checkpoints" / TAG
    index = container.read_index(tag_dir / "mp_rank_00_model_states.pt")
    module = [t for t in index.tensors if t.key.startswith("module/")]
    assert module and not index.derived_files
    assert all(not index.storages[t.storage].derived for t in module)


@pytest.mark.slow
def test_the_bf16_optimizer_case_runs_deepspeeds_bf16_optimizer(runs: Runs) -> None:
    _skip_unsupported("bf16opt-z1")
    for route in ("ours", "plain"):
        resumed = torch.load(runs.out / "bf16opt-z1" / f"resume_{route}_dp2_rank0.pt", weights_only=False)
        assert resumed["optimizer_class"] == "BF16_Optimizer"


@pytest.fixture(scope="module")
def universal_fault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank ZeRO-2 save converted to universal, loaded at 2 ranks with a codec missing on
    rank 1 (tests/ds_elastic.py's fault job); the case's folder."""
    runs = Runs(tmp_path_factory.mktemp("universal_fault"))
    runs.launch(2, "save:z2-fp32")
    runs.convert("z2-fp32", documented_steps()[0])
    runs.launch(2, "fault:z2-fp32")
    return runs.out / "z2-fp32"


@pytest.mark.slow
def test_a_universal_load_failing_on_rank_1_fails_on_every_rank(universal_fault: Path) -> None:
    """Neither rank returns (rank 0 used to go on into ZeRO's all-gather of the weights, which
    rank 1 never reached): both raise UnsupportedCheckpointError naming rank 1 and its file
    under zero/."""
    for rank in (0, 1):
        outcome = json.loads((universal_fault / f"fault_rank{rank}.json").read_text())
        assert outcome["type"] == "UnsupportedCheckpointError", (rank, outcome)
        message = outcome["message"]
        assert "failed on rank 1: UnsupportedCheckpointError: " in message, message
        assert f"{os.sep}zero{os.sep}" in message, message

