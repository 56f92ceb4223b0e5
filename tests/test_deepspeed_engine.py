"""The DeepSpeed integration: config, import hook, factory, and real training runs.

The end-to-end tests train a tiny model with DeepSpeed on its CPU accelerator, 2 ranks under
torchrun with gloo (tests/ds_train.py), save, then resume in fresh processes from another seed,
and require parameters, the full optimizer state and the next losses to be bit-identical to the
run that went on without stopping. Starting the processes costs more than a case, so the cases
are launched in small groups (`GROUPS`), each group the first time a test needs it; a job that
fails records its traceback and the launch goes on, so a failing case fails its own tests only,
and a launch that dies fails only its group's. A case whose dtype DeepSpeed's CPU accelerator
does not support on this CPU is skipped, with the reason (tests/capabilities.py). The first
launch in an environment JIT-builds DeepSpeed's small CPU communication op (~40 s); it is cached
per environment (see `_extensions_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import importlib
import importlib.util
import json
import os
import shutil
import site
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import nvcomp_ckpt_engine
from nvcomp_ckpt_engine import discovery, manifest, manifest_files
from nvcomp_ckpt_engine.config import SECTION, NvcompConfig, json_keys
from nvcomp_ckpt_engine.storage.posix import PosixStorage

import ds_train
import s3_server
from capabilities import unsupported_reason
from conftest import assert_same_tensor, raw_bytes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(ds_train.__file__).resolve()

#: The cases whose checkpoints the local-folder tests read (the store's are read by their own test).
ENGINE_CASES = [name for name, c in ds_train.CASES.items()
                if (c.engine_on_save or c.install) and not c.on_store]
OWN = "deepspeed's own engine"
LAUNCH_TIMEOUT_S = 600


# --------------------------------------------------------------------------------- config


def test_section_keys_are_pinned() -> None:
    assert json_keys() == {
        "enabled", "algorithm", "portable", "chunk_mb", "verify", "trusted_classes", "async",
        "async_host_memory_gb", "async_gpu_memory_gb", "async_gpu_snapshot", "keep_last", "fallback_to_complete", "commit_timeout_s",
        "log_jsonl", "gpu_batch_mb", "async_if_busy", "o_direct", "load_to_gpu", "trust_plain_checkpoints", "io_path",
        "local_tier",
    }


def test_the_local_tier_section_round_trips_with_its_defaults() -> None:
    config = NvcompConfig.from_mapping({"enabled": True, "local_tier": {"path": "/l/{node}"}})
    assert config.to_json()["local_tier"] == {"path": "/l/{node}", "replicas": 1, "keep_last": 2,
                                              "persist_every": 1}
    assert NvcompConfig.from_mapping(config.to_json()) == config


def test_an_async_save_copies_the_state_on_the_gpu_unless_told_not_to() -> None:
    """`async_gpu_snapshot` is on by default (measured on an H100: docs/BENCHMARKS.md); a
    section turns it off by name."""
    assert NvcompConfig.from_mapping({"enabled": True, "async": True}).async_gpu_snapshot is True
    off = NvcompConfig.from_mapping({"enabled": True, "async": True, "async_gpu_snapshot": False})
    assert off.async_gpu_snapshot is False and off.to_json()["async_gpu_snapshot"] is False


def test_config_from_section_and_keywords_agree() -> None:
    section = {"enabled": True, "algorithm": "zstd", "async": True, "keep_last": 2,
               "trusted_classes": ["argparse.Namespace"], "chunk_mb": 0.5}
    from_json = NvcompConfig.from_mapping(section)
    from_kwargs = NvcompConfig(enabled=True, algorithm="zstd", async_save=True, keep_last=2,
                               trusted_classes=["argparse.Namespace"], chunk_mb=0.5)
    assert from_json == from_kwargs
    assert from_json.trusted_classes == ("argparse.Namespace",)
    assert from_json.to_json()["async"] is True
    assert NvcompConfig.from_mapping(from_json.to_json()) == from_json


def test_no_section_means_off() -> None:
    assert NvcompConfig.from_ds_config({"train_batch_size": 8}).enabled is False
    assert NvcompConfig.from_ds_config({SECTION: {}}).enabled is False


@pytest.mark.parametrize(
    "section, words",
    [
        ({"algo": "zstd"}, ["unknown key 'algo'", "algorithm", "keep_last"]),
        ({"enabeld": True}, ["unknown key 'enabeld' (did you mean 'enabled'?)", "'verify'"]),
        ({"async_save": True}, ["unknown key 'async_save'", "'async'"]),
        ({"algorithm": "brotli"}, ["'algorithm' = 'brotli'", "'zstd'", "'ans'", "'none'"]),
        ({"portable": True, "algorithm": "ans"}, ['"portable"', "'ans'", "'zstd'"]),
        ({"enabled": "yes"}, ["'enabled' = 'yes'", "true or false"]),
        ({"verify": 1}, ["'verify' = 1", "true or false"]),
        ({"chunk_mb": 0}, ["'chunk_mb' = 0", "1/1024 to 1024"]),
        ({"chunk_mb": 4096}, ["'chunk_mb' = 4096", "1/1024 to 1024"]),
        ({"trusted_classes": "argparse.Namespace"}, ["'trusted_classes'", "list"]),
        ({"trusted_classes": ["Namespace"]}, ["'Namespace'", "module.QualName"]),
        ({"async": "no"}, ["'async' = 'no'", "true or false"]),
        ({"async_host_memory_gb": -1}, ["'async_host_memory_gb' = -1", "positive"]),
        ({"async_gpu_memory_gb": -1}, ["'async_gpu_memory_gb' = -1", ">= 0", "null"]),
        ({"async_gpu_memory_gb": True}, ["'async_gpu_memory_gb' = True", ">= 0"]),
        ({"async_gpu_snapshot": "auto"}, ["'async_gpu_snapshot' = 'auto'", "true or false"]),
        ({"keep_last": 0}, ["'keep_last' = 0", "integer >= 1", "null"]),
        ({"keep_last": 1.5}, ["'keep_last' = 1.5", "integer >= 1"]),
        ({"commit_timeout_s": float("nan")}, ["'commit_timeout_s' = nan", "positive"]),
        ({"log_jsonl": 3}, ["'log_jsonl' = 3", "path"]),
        ({"load_to_gpu": 1}, ["'load_to_gpu' = 1", '"auto", true or false']),
        ({"load_to_gpu": "always"}, ["'load_to_gpu' = 'always'", '"auto"']),
        ({"local_tier": "/local"}, ["'local_tier' = '/local'", '{"path": ...}']),
        ({"local_tier": {"replicas": 1}}, ["'local_tier.path' = None", "folder path"]),
        ({"local_tier": {"path": "/l/{rank}"}}, ["'local_tier.path' = '/l/{rank}'", '"{node}"']),
        ({"local_tier": {"path": "/l", "replicas": -1}}, ["'local_tier.replicas' = -1", ">= 0"]),
        ({"local_tier": {"path": "/l", "keep_last": 0}}, ["'local_tier.keep_last' = 0", ">= 1"]),
        ({"local_tier": {"path": "/l", "persist_every": 1.5}}, ["'local_tier.persist_every' = 1.5"]),
        ({"local_tier": {"path": "/l", "replica": 1}}, ["unknown key 'local_tier.replica'", "replicas"]),
    ],
)
def test_bad_section_names_key_and_allowed_values(section: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        NvcompConfig.from_mapping(section)
    for word in words:
        assert word in str(info.value)


def test_keyword_changes_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown option"):
        NvcompConfig().replace(algo="zstd")
    with pytest.raises(ValueError, match="'keep_last' = 0"):
        NvcompConfig().replace(keep_last=0)


# ---------------------------------------------------------------------------- import hook


@pytest.fixture()
def hook() -> types.ModuleType:
    """The hook module, importable from an install or, failing that, from the source tree."""
    with contextlib.suppress(ImportError):
        return importlib.import_module("_nvcomp_ckpt_engine_hook")
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("_nvcomp_ckpt_engine_hook")
    finally:
        sys.path.remove(str(ROOT))


def _fake_ds_engine_module() -> types.ModuleType:
    module = types.ModuleType("fake_engine")
    module.calls = []

    def create_checkpoint_engine(config_params, *args):
        module.calls.append((config_params, args))
        return OWN

    module.create_checkpoint_engine = create_checkpoint_engine
    return module


def test_the_torch_load_shim_reads_shards_and_deepspeeds_calls_through_the_engine(
        hook: types.ModuleType, tmp_path: Path) -> None:
    """`shim_torch_load` on a stand-in torch module: a shard is read through the engine
    whoever calls; a plain file goes to torch's own function, except from a DeepSpeed module,
    whose calls meet the engine's checks (none apply to a file outside our folders)."""
    shard, plain = tmp_path / "shard.pt", tmp_path / "plain.pt"
    nvcomp_ckpt_engine.save({"w": torch.arange(4.0)}, shard, algorithm="zstd")
    torch.save({"w": torch.ones(2)}, plain)
    calls: list[Any] = []

    def own_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(f)
        return torch.serialization.load(f, *args, **kwargs)

    fake_torch = types.SimpleNamespace(load=own_load)
    assert hook.shim_torch_load(fake_torch) is True
    assert hook.shim_torch_load(fake_torch) is False  # idempotent
    assert torch.equal(fake_torch.load(shard, weights_only=False)["w"], torch.arange(4.0))
    assert torch.equal(fake_torch.load(plain)["w"], torch.ones(2)) and calls == [plain]
    from_deepspeed = {"__name__": "deepspeed.utils.zero_to_fp32", "load": fake_torch.load}
    assert torch.equal(eval("load(path)", from_deepspeed, {"path": plain})["w"], torch.ones(2))
    assert calls == [plain, plain]


def test_patch_delegates_configs_without_our_section(hook: types.ModuleType) -> None:
    module = _fake_ds_engine_module()
    original = module.create_checkpoint_engine
    assert hook.patch(module) is True
    assert hook.patch(module) is False  # idempotent
    assert module.create_checkpoint_engine.__wrapped__ is original
    config = types.SimpleNamespace(_param_dict={"train_batch_size": 8})
    assert module.create_checkpoint_engine(config, "groups", 2, False, True) == OWN
    assert module.calls == [(config, ("groups", 2, False, True))]


def test_patch_sends_our_section_to_our_factory(hook: types.ModuleType) -> None:
    module = _fake_ds_engine_module()
    hook.patch(module)
    off = types.SimpleNamespace(_param_dict={SECTION: {"enabled": False}})
    assert module.create_checkpoint_engine(off, None, 0, False, True) == OWN
    bad = types.SimpleNamespace(_param_dict={SECTION: {"enabled": True, "algorithm": "x"}})
    with pytest.raises(ValueError, match="'algorithm' = 'x'"):
        module.create_checkpoint_engine(bad, None, 0, False, True)


def test_finder_patches_the_target_module_when_imported(
    hook: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fakeds"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(
        "def create_checkpoint_engine(config_params, *args):\n    return 'original'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hook, "TARGET", "fakeds.engine")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    hook.install()
    engine = importlib.import_module("fakeds.engine")
    try:
        assert engine.create_checkpoint_engine.__wrapped__ is not None
        # The real loader is given back, so inspect/linecache/reload see nothing of the hook.
        assert type(engine.__loader__).__name__ == "SourceFileLoader"
        assert engine.__spec__.loader is engine.__loader__
        assert engine.create_checkpoint_engine(None) == "original"
    finally:
        for name in ("fakeds.engine", "fakeds"):
            sys.modules.pop(name, None)


def _site_packages_with_hook() -> Path | None:
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        if (Path(folder) / "nvcomp_ckpt_engine_hook.pth").is_file():
            return Path(folder)
    return None


needs_install = pytest.mark.skipif(
    _site_packages_with_hook() is None, reason="package not installed (pip install -e .)"
)


def _python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env}, check=True,
    )
    return result.stdout.strip()


@needs_install
def test_site_hook_is_cheap_and_can_be_disabled() -> None:
    probe = (
        "import sys; "
        "print(any(type(f).__name__ == '_Finder' for f in sys.meta_path), "
        "'torch' in sys.modules, 'nvcomp_ckpt_engine' in sys.modules)"
    )
    assert _python(probe) == "True False False"
    assert _python(probe, NVCOMP_CKPT_DEEPSPEED_HOOK="0") == "False False False"


@needs_install
def test_site_hook_patches_deepspeed_on_import() -> None:
    probe = (
        "import deepspeed.runtime.engine as e, sys; "
        "print(e.create_checkpoint_engine.__module__, 'nvcomp_ckpt_engine' in sys.modules)"
    )
    assert _python(probe, DS_ACCELERATOR="cpu").splitlines()[-1] == "_nvcomp_ckpt_engine_hook False"


# -------------------------------------------------------------------------------- factory


def _ds_config(**section: Any) -> Any:
    from deepspeed.runtime.config import DeepSpeedConfig

    raw: dict[str, Any] = {"train_batch_size": 4}
    if section:
        raw[SECTION] = section
    return DeepSpeedConfig(raw)


def test_factory_builds_our_engine_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from nvcomp_ckpt_engine.deepspeed import NvcompCheckpointEngine, create_checkpoint_engine

    def original(*args: Any) -> str:
        return OWN

    args = (None, 0, False, True)
    assert create_checkpoint_engine(_ds_config(), *args, original=original) == OWN
    off = _ds_config(enabled=False, algorithm="zstd")
    assert create_checkpoint_engine(off, *args, original=original) == OWN
    enabled = _ds_config(enabled=True, keep_last=2)
    engine = create_checkpoint_engine(enabled, *args, original=original)
    assert isinstance(engine, NvcompCheckpointEngine)
    assert engine.options.keep_last == 2
    assert engine.preserves_storage_sharing() is False


def test_factory_refuses_two_checkpoint_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    from nvcomp_ckpt_engine.deepspeed import create_checkpoint_engine

    config = DeepSpeedConfig({"train_batch_size": 4, SECTION: {"enabled": True},
                              "checkpoint": {"writer": {"type": "fast"}}})
    with pytest.raises(ValueError, match="FastCheckpointEngine"):
        create_checkpoint_engine(config, None, 0, False, True, original=lambda *a: None)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shipped_configs_are_valid(stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = json.loads((ROOT / "configs" / f"ds_zero{stage}.json").read_text())
    assert DeepSpeedConfig(raw).zero_optimization_stage == stage
    assert NvcompConfig.from_ds_config(raw).enabled is True


@pytest.fixture
def bare_engine(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """A factory of our engine driven by hand (`create`, `save`, `commit`, `load`) in this
    process, one rank, without a DeepSpeed training engine around it."""
    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.deepspeed.engine import NvcompCheckpointEngine

    monkeypatch.setattr(_compat, "called_from_save_checkpoint", lambda: True)
    monkeypatch.setattr(_compat, "local_rank", lambda: 0)
    monkeypatch.setattr(_compat, "parallel_layout", lambda stage: manifest.layout_record(
        "deepspeed", dp=1, tp=1, pp=1, zero_stage=stage))
    return lambda **options: NvcompCheckpointEngine(
        options=NvcompConfig(enabled=True, algorithm="zstd", **options), zero_stage=1)


def test_gds_asked_for_where_it_cannot_be_had_fails_at_start(bare_engine: Callable[..., Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from nvcomp_ckpt_engine.storage import gds

    monkeypatch.setattr(gds, "kvikio_available", lambda: False)
    with pytest.raises(ValueError, match=r"^nvcomp_checkpoint: 'io_path' = \"gds\" cannot be used here: it "
                       r"needs kvikio, .*; set it to \"auto\" or \"pinned\""):
        bare_engine(io_path="gds")
    assert bare_engine(io_path="auto").options.io_path == "auto"


def _commit_info(save_dir: Path, tag: str) -> Any:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    return CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True)


def test_async_writes_start_once_deepspeed_steps_again(tmp_path: Path, bare_engine: Callable[..., Any],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Files an async save captured are written only after `save_checkpoint` has returned (the
    next step's `get_commit_info`), so they do not slow DeepSpeed's own writes in the save."""
    from nvcomp_ckpt_engine import api

    monkeypatch.setattr(api, "START_WAIT_S", 600.0)  # a missing start signal would hang the test
    engine = bare_engine(async_save=True)
    info = _commit_info(tmp_path, "global_step1")
    engine.create(info)
    engine.save({"w": torch.randn(1000)}, str(tmp_path / "global_step1" / "mp_rank_00_model_states.pt"))
    time.sleep(0.2)
    assert not list((tmp_path / "global_step1").glob("*model_states*"))
    deadline = time.monotonic() + 60
    while engine.get_commit_info() is None:
        assert time.monotonic() < deadline, "the background write did not finish"
        time.sleep(0.01)
    engine.commit(info)
    assert engine.committed("global_step1")
    assert (tmp_path / "global_step1" / manifest.MANIFEST_NAME).exists()


def test_a_job_that_ends_right_after_an_async_save_still_writes_and_commits_it(
    tmp_path: Path, bare_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`destroy()` (through `wait`) right after `save_checkpoint`, no step in between: the writes
    start at once rather than after the start signal's longest wait."""
    from nvcomp_ckpt_engine import api

    monkeypatch.setattr(api, "START_WAIT_S", 600.0)
    engine = bare_engine(async_save=True)
    engine.create(_commit_info(tmp_path, "global_step1"))
    engine.save({"w": torch.randn(1000)}, str(tmp_path / "global_step1" / "mp_rank_00_model_states.pt"))
    finisher = threading.Thread(target=engine.cleanup, daemon=True)
    finisher.start()
    finisher.join(60)
    assert not finisher.is_alive(), "cleanup waited for the start signal"
    assert engine.committed("global_step1")


@pytest.mark.parametrize("optimizer_state", [True, False])
def test_first_load_from_a_tag_prefetches_the_ranks_other_files(
    tmp_path: Path, bare_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
    optimizer_state: bool,
) -> None:
    """Loading the model states starts the kernel reading this rank's optimizer shard, which
    DeepSpeed asks for later; a module-only load reads no shard, so it starts nothing."""
    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.deepspeed import engine as engine_module

    tag_dir = tmp_path / "global_step1"
    files = {"mp_rank_00_model_states.pt": {"module": torch.randn(100)},
             "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"state": torch.randn(300)}}
    engine = bare_engine()
    info = _commit_info(tmp_path, "global_step1")
    engine.create(info)
    for name, state in files.items():
        engine.save(state, str(tag_dir / name))
    engine.commit(info)

    asked: list[tuple[list[str], int]] = []
    monkeypatch.setattr(PosixStorage, "prefetch", lambda self, keys, limit: asked.append(
        ([os.path.realpath(self.local_path(k)) for k in keys], limit)))
    monkeypatch.setattr(_compat, "optimizer_state_requested", lambda: optimizer_state)
    loader = bare_engine()
    for name, state in files.items():
        for _ in range(2):  # DeepSpeed reads the model states twice; one prefetch per tag
            loaded = loader.load(str(tag_dir / name), map_location="cpu")
            assert torch.equal(raw_bytes(next(iter(loaded.values()))), raw_bytes(next(iter(state.values()))))
    expected = [([str(tag_dir.resolve() / "zero_pp_rank_0_mp_rank_00_optim_states.pt")],
                 engine_module.PREFETCH_BYTES)]
    assert asked == (expected if optimizer_state else [])


@pytest.mark.parametrize(
    "mode, zero_load, rank, requested, placed",
    [
        ("auto", True, 0, "cpu", True),
        (True, True, 0, torch.device("cpu"), True),
        (False, True, 0, "cpu", False),  # turned off
        ("auto", False, 0, "cpu", False),  # not DeepSpeed's ZeRO shard load (model states, a tool)
        ("auto", True, 1, "cpu", False),  # another rank's shard (an elastic load reads them all)
        ("auto", True, 0, None, False),  # a caller that asked for the saved devices gets them
    ],
)
def test_own_zero_shard_is_decoded_where_placement_says(
    tmp_path: Path, bare_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
    mode: bool | str, zero_load: bool, rank: int, requested: Any, placed: bool,
) -> None:
    """The engine asks `placement` only for this rank's own shard, loaded by DeepSpeed's ZeRO
    load with host memory as the destination, and passes its answer on to the decoder."""
    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.deepspeed import engine as engine_module

    tag_dir = tmp_path / "global_step1"
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = {"exp_avg": torch.randn(300), "step": torch.tensor(3.0)}
    engine = bare_engine()
    info = _commit_info(tmp_path, "global_step1")
    engine.create(info)
    engine.save(state, str(tag_dir / name))
    engine.commit(info)

    asked: list[dict[str, Any]] = []
    mapping = {"cpu": "cpu"}  # what placement would answer; CPU-only here, so a host mapping

    def shard_map_location(storages: list[tuple[str, int]], **kwargs: Any) -> dict[str, str]:
        asked.append({"storages": storages, **kwargs})
        return mapping

    monkeypatch.setattr(engine_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(engine_module.placement, "available_gpu_bytes", lambda device: 123)
    monkeypatch.setattr(engine_module.placement, "shard_map_location", shard_map_location)
    monkeypatch.setattr(_compat, "loading_zero_shards", lambda: zero_load)
    received: list[Any] = []
    real_load = engine_module.api.load_shard
    monkeypatch.setattr(engine_module.api, "load_shard",
                        lambda path, where, **kw: received.append(where) or real_load(path, "cpu", **kw))
    loader = bare_engine(load_to_gpu=mode)
    monkeypatch.setattr(type(loader._collective), "rank", property(lambda self: rank))
    loaded = loader.load(str(tag_dir / name), map_location=requested)
    assert torch.equal(raw_bytes(loaded["exp_avg"]), raw_bytes(state["exp_avg"]))
    if placed:
        assert received == [mapping]
        assert asked == [{"storages": [("cpu", 300 * 4), ("cpu", 4)], "mode": mode,
                          "device": torch.device("cuda", 0), "available_bytes": 123,
                          "path": str(tag_dir.resolve() / name)}]
    else:
        assert received == [requested] and asked == []


def test_deepspeeds_zero_shard_load_is_recognized_through_the_real_call_chain(
    tmp_path: Path, bare_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_compat.loading_zero_shards` finds DeepSpeed's own `_get_all_zero_checkpoint_state_dicts`
    above our `load` (the frame walk that decides the GPU placement, which a CPU run would
    otherwise never reach), and nothing above a plain `load` of the same file."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from nvcomp_ckpt_engine.deepspeed import engine as engine_module

    tag_dir = tmp_path / "global_step1"
    path = str(tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    state = {"optimizer_state_dict": {"exp_avg": torch.randn(300)}}
    engine = bare_engine()
    info = _commit_info(tmp_path, "global_step1")
    engine.create(info)
    engine.save(state, path)
    engine.commit(info)

    consulted: list[str] = []
    monkeypatch.setattr(engine_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(engine_module.placement, "available_gpu_bytes", lambda device: 0)
    monkeypatch.setattr(engine_module.placement, "shard_map_location",
                        lambda storages, **kwargs: consulted.append(kwargs["path"]))
    loader = bare_engine()
    deepspeed_engine = types.SimpleNamespace(  # what the method reads of a DeepSpeedEngine
        checkpoint_engine=loader, zero_elastic_checkpoint=lambda: True, global_rank=0)
    loaded = DeepSpeedEngine._get_all_zero_checkpoint_state_dicts(deepspeed_engine, [path])
    assert torch.equal(raw_bytes(loaded[0]["exp_avg"]), raw_bytes(state["optimizer_state_dict"]["exp_avg"]))
    assert consulted == [str(Path(path).resolve())]
    loader.load(path, map_location="cpu")  # the same file, not from DeepSpeed's ZeRO load
    assert consulted == [str(Path(path).resolve())]


def test_a_universal_load_from_an_object_store_is_refused_saying_why() -> None:
    """DeepSpeed's universal loader reads local files: from a URL the load is refused at once,
    naming the URL, before any rank reads anything."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from nvcomp_ckpt_engine.deepspeed import _compat
    from nvcomp_ckpt_engine.errors import UnsupportedCheckpointError

    _compat.patch_load_checkpoint()
    ran: list[str] = []
    job = types.SimpleNamespace(
        checkpoint_engine=types.SimpleNamespace(run_load=lambda *a, **k: ran.append("load")),
        load_universal_checkpoint=lambda: True)
    with pytest.raises(UnsupportedCheckpointError, match=r"s3://bucket/run: a universal checkpoint"):
        DeepSpeedEngine.load_checkpoint(job, "s3://bucket/run")
    assert not ran


def test_deepspeeds_file_names_are_found_on_a_store_by_listing(s3_server, s3_storage, monkeypatch) -> None:
    from nvcomp_ckpt_engine.deepspeed import _compat

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.url)
    for key in ("t/mp_rank_01_model_states.pt", "t/mp_rank_00_model_states.pt", "t/zero_pp_rank_0_x.pt",
                "t/sub/mp_rank_02_model_states.pt"):
        s3_storage.publish(key, b"x")
    assert _compat.find_files(f"{s3_storage.url}/t/mp_rank_*_model_states.pt") == [
        f"{s3_storage.url}/t/mp_rank_00_model_states.pt", f"{s3_storage.url}/t/mp_rank_01_model_states.pt"]
    assert _compat.find_files(f"{s3_storage.url}/none/mp_rank_*_model_states.pt") == []


def test_public_names_are_pinned() -> None:
    import nvcomp_ckpt_engine.deepspeed as ds

    assert sorted(ds.__all__) == [
        "NvcompCheckpointEngine", "create_checkpoint_engine", "enable", "install"
    ]


# ----------------------------------------------------------------- training runs (2 ranks)


def _extensions_dir() -> str:
    """One DeepSpeed JIT-extension folder per Python environment, kept between test runs.

    Two environments sharing one folder rebuild the op at every switch (45-75 s each).
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return str(Path.home() / ".cache" / "nvcomp_ckpt_engine" / "torch_extensions" / env_id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Starts tests/ds_train.py under torchrun (or the deepspeed launcher) with CPU settings."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.hooked = _site_packages_with_hook() is not None
        self.env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": _extensions_dir(),
        }
        self.env.pop("NVCOMP_CKPT_DEEPSPEED_HOOK", None)
        if not self.hooked:  # a source checkout: make the package importable, enable explicitly
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            )

    def run(self, nproc: int, *jobs: str, launcher: str = "torchrun",
            env: dict[str, str] | None = None) -> None:
        port = str(_free_port())
        if launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                       str(nproc), "--master_addr", "127.0.0.1", "--master_port", port]
        else:
            command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
                       str(nproc), "--master_addr", "127.0.0.1", "--master_port", port]
        command += [str(SCRIPT), str(self.out), *jobs]
        if not self.hooked:
            command.append("--enable")
        try:
            result = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True,
                                    text=True, timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            tail = (_text(exc.stdout) + _text(exc.stderr))[-6000:]
            raise RuntimeError(f"{' '.join(command)} did not finish in {LAUNCH_TIMEOUT_S} s:\n{tail}")
        if result.returncode != 0:
            tail = (result.stdout + result.stderr)[-6000:]
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{tail}")

    def outcomes(self, label: str) -> list[dict[str, Any]]:
        files = sorted((self.out / label).glob("outcome_rank*_ws*.json"))
        assert files, f"no outcome recorded for {label}"
        return [json.loads(f.read_text()) for f in files]


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


#: The cases, in the groups they are launched in: a few cases per launch (starting 2 processes
#: costs more than a case), split so that one dtype, or one launch that dies, takes down little.
GROUPS: dict[str, tuple[str, ...]] = {
    "fp32": ("z0-fp32", "z1-fp32", "z2-fp32", "z3-fp32", "plain-to-engine"),
    "fp32-features": ("moe-z2-fp32", "async-capped-z1-fp32", "refuse-z1-fp32",
                      "retention-z1-fp32"),
    "bf16": ("z0-bf16", "z1-bf16", "z2-bf16", "z3-bf16", "bf16opt-z1", "nodelocal-z1-bf16",
             "install-z2-bf16", "async-z2-bf16"),
    "fp16": ("fp16-z2",),
    "store": ("store-z1-fp32", "store-async-z3-fp32"),
}
#: Jobs under their own label that use another case's checkpoint or config: label -> case.
DERIVED = {
    "nomanifest": "z2-fp32", "corrupt": "z2-fp32", "worldsize": "z2-fp32",
    "moduleonly": "z2-fp32", "savefail": "z2-fp32", "asyncrefuse": "refuse-z1-fp32",
}
#: Broken copies of z2-fp32's checkpoint that the load checks use.
_BROKEN_COPIES = ("nomanifest", "corrupt", "worldsize", "moduleonly")


def _group_of(label: str) -> str:
    case = DERIVED.get(label, label)
    return next(group for group, cases in GROUPS.items() if case in cases)


def _break_copies(out: Path) -> None:
    """Copies of z2-fp32's good checkpoint, broken in the ways the load checks need."""
    for label in _BROKEN_COPIES:
        shutil.copytree(out / "z2-fp32" / "ckpt", out / label / "ckpt")
    (out / "nomanifest" / "ckpt" / "global_step3" / manifest.MANIFEST_NAME).unlink()
    for rank in (0, 1):
        tag_dir = out / "corrupt" / "ckpt" / "global_step3"
        shard = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))


class Runs:
    """The training runs of this module, launched group by group when a test first needs one.

    `case(label)` skips when the label's dtype is not supported here, launches its group once,
    and fails (for that label's tests only) if the group's launch died or the label's own jobs
    raised; it returns the label's folder of results.
    """

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.out = launcher.out
        self._launched: dict[str, BaseException | None] = {}
        #: The S3 test server the ``store`` group saves to (`use_store`).
        self.store_server: Any = None
        self.store_url = f"s3://{s3_server.BUCKET}/ds-runs-{uuid.uuid4().hex[:8]}"

    def use_store(self, server: Any) -> None:
        """Give the ``store`` group its server (the tests that need the group ask for it)."""
        self.store_server = server

    def case(self, label: str) -> Path:
        reason = unsupported_reason(ds_train.CASES[DERIVED.get(label, label)].dtype)
        if reason is not None:
            pytest.skip(reason)
        group = _group_of(label)
        if group not in self._launched:
            self._launched[group] = self._launch(group)
        if self._launched[group] is not None:
            pytest.fail(f"the launch of group {group!r} failed: {self._launched[group]}")
        # A derived job also fails when the save it derives from failed.
        base = DERIVED.get(label, label)
        failures = sorted({*(self.out / base).glob("failed_save_rank*.txt"),
                           *(self.out / label).glob("failed_*_rank*.txt")})
        if failures:
            pytest.fail("\n".join(f.read_text() for f in failures))
        return self.out / label

    def outcomes(self, label: str) -> list[dict[str, Any]]:
        """What the label's load (or save) jobs raised, one record per rank, once it has run."""
        self.case(label)
        return self.launcher.outcomes(label)

    def _store_env(self) -> dict[str, str]:
        """The object-store group's jobs: where they save, and the server's endpoint and keys
        (the AWS variables the `s3_server` fixture set)."""
        if self.store_server is None:
            raise RuntimeError("the store group needs the S3 test server: call use_store first")
        aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        return {**aws, "AWS_ENDPOINT_URL": self.store_server.url, "DS_TRAIN_STORE": self.store_url}

    def _launch(self, group: str) -> BaseException | None:
        cases = GROUPS[group]
        resume_jobs = [f"resume:{name}" for name in cases]
        try:
            if group == "store":
                env = self._store_env()
                self.launcher.run(2, *(f"save:{name}" for name in cases), env=env)
                self.launcher.run(2, *resume_jobs, env=env)
                return None
            self.launcher.run(2, *(f"save:{name}" for name in cases))
            if "z2-fp32" in cases and not list((self.out / "z2-fp32").glob("failed_*")):
                _break_copies(self.out)
                resume_jobs += ["load:z2-fp32=nomanifest", "load:z2-fp32=corrupt",
                                "savefail:z2-fp32=savefail"]
            if "refuse-z1-fp32" in cases:
                resume_jobs.append("asyncrefuse:refuse-z1-fp32=asyncrefuse")
            self.launcher.run(2, *resume_jobs)
            if (self.out / "worldsize").is_dir():
                self.launcher.run(1, "load:z2-fp32=worldsize", "load-module-only:z2-fp32=moduleonly")
        except Exception as exc:  # reported by every test of the group
            return exc
        return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every training run of this module (launched lazily, group by group); tests read results."""
    return Runs(Launcher(tmp_path_factory.mktemp("ds_runs")))


def test_every_case_is_launched_in_exactly_one_group() -> None:
    grouped = [name for cases in GROUPS.values() for name in cases]
    assert sorted(grouped) == sorted(ds_train.CASES)
    assert set(DERIVED.values()) <= set(grouped)


class _FakeLauncher:
    """Stands in for `Launcher`: records each launch's jobs; the launch of any job of a case in
    `dies` raises with its output, and a case in `raises` records a failed save, as a job that
    raised does; every other job leaves its results."""

    def __init__(self, out: Path, *, dies: set[str], raises: set[str]) -> None:
        self.out, self.dies, self.raises = out, dies, raises
        self.launches: list[tuple[str, ...]] = []

    def run(self, nproc: int, *jobs: str) -> None:
        self.launches.append(jobs)
        names = {job.split(":")[1].split("=")[0] for job in jobs}
        if names & self.dies:
            raise RuntimeError(f"the launch failed (1):\noutput of {sorted(names & self.dies)}")
        for name in names:
            (self.out / name).mkdir(exist_ok=True)
            if name in self.raises:
                (self.out / name / "failed_save_rank0.txt").write_text(f"Traceback: {name} raised")


def test_a_failing_group_or_case_fails_only_its_own_tests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch per group, launched when a test first needs it: a group whose launch dies
    fails its own cases with the launch's output, a case whose job raised fails with its
    traceback, and the other groups' results stay available. Running every case in one launch
    again would fail this."""
    monkeypatch.delenv("NVCOMP_TEST_UNSUPPORTED_DTYPES", raising=False)
    monkeypatch.setattr("capabilities._cpu_accelerator_supports", lambda dtype: True)
    fake = _FakeLauncher(tmp_path, dies={"z1-bf16"}, raises={"fp16-z2"})
    runs = Runs(fake)  # type: ignore[arg-type]
    with pytest.raises(pytest.fail.Exception, match=r"(?s)group 'bf16'.*output of \['z1-bf16'\]"):
        runs.case("z3-bf16")
    with pytest.raises(pytest.fail.Exception, match="fp16-z2 raised"):
        runs.case("fp16-z2")
    assert runs.case("moe-z2-fp32") == tmp_path / "moe-z2-fp32"
    assert runs.case("asyncrefuse") == tmp_path / "asyncrefuse"
    with pytest.raises(pytest.fail.Exception, match="group 'bf16'"):
        runs.case("z0-bf16")  # reported again, not launched again
    launched = [{_group_of(job.split(":")[1].split("=")[-1]) for job in jobs} for jobs in fake.launches]
    assert all(len(groups) == 1 for groups in launched), launched
    assert [g for (g,) in launched] == ["bf16", "fp16", "fp16", "fp32-features", "fp32-features"]


@pytest.mark.parametrize("unsupported", ["fp16", "bf16", "fp16,bf16", ""])
def test_only_cases_of_an_unsupported_dtype_are_skipped(
    unsupported: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With dtypes reported unsupported (as on a CPU without fp16 kernels), exactly the cases and
    derived jobs of those dtypes skip, each with the reason; every other case still runs."""
    monkeypatch.setenv("NVCOMP_TEST_UNSUPPORTED_DTYPES", unsupported)
    monkeypatch.setattr("capabilities._cpu_accelerator_supports", lambda dtype: True)
    gone = set(filter(None, unsupported.split(",")))
    for label in [*ds_train.CASES, *DERIVED]:
        reason = unsupported_reason(ds_train.CASES[DERIVED.get(label, label)].dtype)
        assert (reason is not None) == (ds_train.CASES[DERIVED.get(label, label)].dtype in gone)
        if reason is not None:
            assert "unsupported" in reason


def _assert_same(a: Any, b: Any, where: str = "") -> int:
    """Bit-for-bit equality of nested results; returns how many tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(raw_bytes(a), raw_bytes(b)), f"{where}: bits differ"
        return 1
    if isinstance(a, dict):
        assert list(a) == list(b), where
        return sum(_assert_same(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(_assert_same(x, y, f"{where}/{i}") for i, (x, y) in enumerate(zip(a, b)))
    if hasattr(a, "__dict__") and not isinstance(a, type):  # loss scalers have no __eq__
        assert type(a) is type(b), where
        return _assert_same(vars(a), vars(b), where)
    assert a == b, f"{where}: {a!r} != {b!r}"
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ds_train.CASES))
def test_resume_is_bit_exact(runs: Runs, name: str, request: pytest.FixtureRequest) -> None:
    if ds_train.CASES[name].on_store:
        runs.use_store(request.getfixturevalue("s3_server"))
    case_dir = runs.case(name)
    for rank in (0, 1):
        reference = torch.load(case_dir / f"save_rank{rank}.pt", weights_only=False)
        resumed = torch.load(case_dir / f"resume_rank{rank}.pt", weights_only=False)
        compared = _assert_same(reference, resumed, f"{name} rank {rank}")
        assert compared >= 8, "too few tensors compared: the snapshot is missing state"
        assert len(reference["losses"]) == ds_train.STEPS_AFTER
        assert reference["optimizer"], "optimizer state is empty"


@pytest.mark.slow
def test_a_job_on_an_object_store_keeps_everything_there(runs: Runs, request: pytest.FixtureRequest,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """save_dir as s3://bucket/prefix, nothing else changed in the script: the checkpoints,
    ``latest`` and retention are on the store, DeepSpeed's recovery scripts are not copied
    there (a store holds no executable bit), and nothing lands in a local folder ``s3:``."""
    from nvcomp_ckpt_engine.storage import open_storage

    server = request.getfixturevalue("s3_server")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    runs.use_store(server)
    for name in GROUPS["store"]:
        runs.case(name)
    assert not (Path.cwd() / "s3:").exists() and not list(runs.out.rglob("s3:*"))
    for name, tags in (("store-z1-fp32", ["global_step3"]), ("store-async-z3-fp32", ["global_step3"])):
        store = open_storage(f"{runs.store_url}/{name}")
        names = sorted(entry.key for entry in store.list(""))
        assert names == sorted([discovery.LATEST_NAME, *tags]), names  # global_step1 retained away
        assert store.read_small(discovery.LATEST_NAME, 100) == b"global_step3"
        assert discovery.find_complete_checkpoints(f"{runs.store_url}/{name}") == tags
        tag_url = f"{runs.store_url}/{name}/global_step3"
        found = manifest.read_manifest(tag_url)
        assert found.world_size == 2 and found.layout["zero_stage"] == ds_train.CASES[name].stage
        manifest_files.verify_files(tag_url, found, check_crc=True)
    # save_16bit_model to a URL: DeepSpeed's plain torch.save file, on the store.
    export = open_storage(f"{runs.store_url}/store-z1-fp32-export")
    with export.open_reader("pytorch_model.bin") as reader:
        weights = torch.load(io.BytesIO(reader.read(0, reader.size)), weights_only=True)
    assert set(weights) == {"inp.weight", "inp.bias", "out.weight", "out.bias"}


@pytest.mark.slow
def test_bf16_optimizer_case_runs_bf16_optimizer(runs: Runs) -> None:
    result = torch.load(runs.case("bf16opt-z1") / "save_rank0.pt", weights_only=False)
    assert result["optimizer_class"] == "BF16_Optimizer"


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_CASES)
def test_files_are_ours_and_listed(runs: Runs, name: str) -> None:
    save_dir = runs.case(name) / "ckpt"
    tag_dir = save_dir / "global_step3"
    assert (save_dir / "latest").read_text() == "global_step3"
    found = manifest.read_manifest(tag_dir)
    on_disk = sorted(
        p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
        if p.is_file() and p.name not in (manifest.MANIFEST_NAME, manifest.TAG_MARKER_NAME)
    )
    assert sorted(r.path for r in found.files) == on_disk
    assert found.world_size == 2 and found.layout["dp"] == 2
    assert found.layout["zero_stage"] == ds_train.CASES[name].stage
    assert found.node_local_storage == ds_train.CASES[name].node_local
    for relative in on_disk:
        path = tag_dir / relative
        assert nvcomp_ckpt_engine.is_shard_file(path), relative
        assert not zipfile.is_zipfile(path), relative
        with pytest.raises(Exception, match="nvcomp"):  # torch's own load meets the guard
            torch.serialization.load(path, weights_only=False)
    manifest_files.verify_files(tag_dir, found)


@pytest.mark.slow
def test_plain_checkpoint_stays_plain(runs: Runs) -> None:
    tag_dir = runs.case("plain-to-engine") / "ckpt" / "global_step3"
    assert not (tag_dir / manifest.MANIFEST_NAME).exists()
    files = list(tag_dir.glob("*.pt"))
    assert files and not any(nvcomp_ckpt_engine.is_shard_file(f) for f in files)


@pytest.mark.slow
def test_16bit_export_is_a_plain_torch_file(runs: Runs) -> None:
    export = runs.case("z3-bf16") / "export" / "pytorch_model.bin"
    assert not nvcomp_ckpt_engine.is_shard_file(export)
    weights = torch.load(export, weights_only=True)
    assert weights["inp.weight"].dtype == torch.bfloat16
    assert not (export.parent / manifest.MANIFEST_NAME).exists()


@pytest.mark.slow
def test_install_after_initialize_uses_its_options(runs: Runs) -> None:
    found = manifest.read_manifest(runs.case("install-z2-bf16") / "ckpt" / "global_step3")
    assert {codec for r in found.files for codec in r.codecs} == {"deflate"}


@pytest.mark.slow
def test_keep_last_and_commit_log(runs: Runs) -> None:
    case_dir = runs.case("retention-z1-fp32")
    assert not (case_dir / "ckpt" / "global_step1").exists()
    assert discovery.find_complete_checkpoints(case_dir / "ckpt") == ["global_step3"]
    lines = [json.loads(line) for line in (case_dir / "commits.jsonl").read_text().splitlines()]
    # The resume saved global_step3 again: a re-save of a tag that has a manifest.
    assert [line["tag"] for line in lines] == ["global_step1", "global_step3", "global_step3"]
    assert all(line["files"] == 3 and line["file_bytes"] > 0 for line in lines)


@pytest.mark.slow
def test_resave_of_a_tag_replaces_it_whole(runs: Runs) -> None:
    tag_dir = runs.case("retention-z1-fp32") / "ckpt" / "global_step3"
    found = manifest.read_manifest(tag_dir)
    assert found.pending  # written under staged names, then renamed into place
    assert {r.io for r in found.files} <= {"host", "pinned"}  # the engine records the way (auto)
    assert all(r.io for r in found.files)
    assert not [p.name for p in tag_dir.iterdir() if ".nvckpt-" in p.name]
    manifest_files.verify_files(tag_dir, found)


@pytest.mark.slow
def test_recovery_script_reads_our_shards(runs: Runs) -> None:
    case_dir = runs.case("z2-fp32")
    ckpt, output = case_dir / "ckpt", case_dir / "fp32"
    subprocess.run(
        [sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(output)],
        env=runs.launcher.env, capture_output=True, text=True, timeout=300, check=True,
    )
    weights = torch.load(output / "pytorch_model.bin", weights_only=True)
    assert {k: v.dtype for k, v in weights.items()} == {
        k: torch.float32 for k in ("inp.weight", "inp.bias", "out.weight", "out.bias")
    }


#: DeepSpeed's reader of ZeRO checkpoints, which its engine calls for a ZeRO-3
#: `load_checkpoint(..., load_optimizer_states=False)` or `load_module_only=True` and the Hugging
#: Face helper `load_state_dict_from_zero_checkpoint` calls: run on our checkpoint and on its
#: decompressed plain copy, in a fresh process as a user's script would.
_DEEPSPEED_READER = """
import os, sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as read

def module(folder):  # what a script beside DeepSpeed does: torch.load of the model states
    tag = open(os.path.join(folder, "latest")).read().strip()
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO-3
    path = next(p for p in (os.path.join(folder, tag, n) for n in names) if os.path.exists(p))
    return torch.load(path, weights_only=False)["module"]

torch.save({"ours": read(sys.argv[1]), "plain": read(sys.argv[2]),
            "ours_module": module(sys.argv[1]), "plain_module": module(sys.argv[2])}, sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["z3-fp32", "z2-fp32"])
def test_deepspeeds_own_reader_reads_our_shards(runs: Runs, name: str, tmp_path: Path) -> None:
    """With the package installed, DeepSpeed's own `torch.load` of our shards reads them (the
    hook's shim), and so does a script's `torch.load` of a shard in a process that imported
    DeepSpeed: bit-exact with the same calls on the plain copy (before the shim, both met the
    shards' guard: `TorchLoadOfShardError`)."""
    from nvcomp_ckpt_engine import cli

    ckpt = runs.case(name) / "ckpt"
    plain = tmp_path / "plain"
    assert cli.main(["decompress", str(ckpt), str(plain)]) == 0
    result = tmp_path / "fp32.pt"
    subprocess.run([sys.executable, "-c", _DEEPSPEED_READER, str(ckpt), str(plain), str(result)],
                   env=runs.launcher.env, capture_output=True, text=True, timeout=300, check=True)
    read = torch.load(result, weights_only=True)
    assert sorted(read["ours"]) == sorted(read["plain"]) and read["ours"]
    for key, tensor in read["plain"].items():
        assert tensor.dtype == torch.float32, key
        assert torch.equal(raw_bytes(read["ours"][key]), raw_bytes(tensor)), key
    assert sorted(read["ours_module"]) == sorted(read["plain_module"])
    for key, tensor in read["plain_module"].items():
        assert_same_tensor(read["ours_module"][key], tensor, key)


@pytest.mark.slow
def test_other_data_parallel_size_is_resharded(runs: Runs) -> None:
    """ZeRO-2 saved at 2 ranks loads at 1 (tests/test_elastic.py checks the state bit for bit,
    and that what cannot be resharded is refused naming the way out)."""
    (outcome,) = runs.outcomes("worldsize")
    assert outcome["type"] is None, outcome


@pytest.mark.slow
def test_module_only_load_accepts_other_data_parallel_size(runs: Runs) -> None:
    (outcome,) = runs.outcomes("moduleonly")
    assert outcome["type"] is None, outcome


@pytest.mark.slow
def test_checkpoint_without_manifest_is_refused(runs: Runs) -> None:
    for outcome in runs.outcomes("nomanifest"):
        assert outcome["type"] == "IncompleteCheckpointError", outcome
        assert "not complete" in outcome["message"] and "global_step3" in outcome["message"]


@pytest.mark.slow
def test_corrupt_shard_is_refused_before_use(runs: Runs) -> None:
    for outcome in runs.outcomes("corrupt"):
        assert outcome["type"] == "CorruptCheckpointError", outcome
        # The damaged chunk's own checksum, checked before it is decoded, names it.
        assert "checksum mismatch" in outcome["message"] and "optim_states.pt" in outcome["message"]
        assert "chunk" in outcome["message"]


@pytest.mark.slow
def test_failed_save_fails_commit_on_every_rank(runs: Runs) -> None:
    outcomes = runs.outcomes("savefail")
    assert len(outcomes) == 2
    for outcome in outcomes:
        assert outcome["type"] == "CommitError", outcome
        assert "rank 1" in outcome["message"] and "No space left" in outcome["message"]
    save_dir = runs.out / "savefail" / "ckpt"
    assert not (save_dir / "bad" / manifest.MANIFEST_NAME).exists()
    assert (save_dir / "latest").read_text() == "good"
    assert discovery.resolve_load_tag(save_dir) == "good"


@pytest.mark.slow
def test_deepspeed_launcher_uses_the_engine(tmp_path: Path) -> None:
    if shutil.which("deepspeed") is None and importlib.util.find_spec("deepspeed.launcher") is None:
        pytest.skip("the deepspeed launcher is not installed")
    launcher = Launcher(tmp_path)
    launcher.run(2, "save:z1-fp32=launcher", launcher="deepspeed")
    failures = sorted((tmp_path / "launcher").glob("failed_*_rank*.txt"))
    assert not failures, "\n".join(f.read_text() for f in failures)
    found = manifest.read_manifest(tmp_path / "launcher" / "ckpt" / "global_step3")
    assert len(found.files) == 3


@pytest.mark.slow
def test_async_save_while_busy_is_refused_on_every_rank(runs: Runs) -> None:
    for outcome in runs.outcomes("asyncrefuse"):
        assert outcome["type"] == "CheckpointError", outcome
        assert "'second' refused" in outcome["message"] and "'first'" in outcome["message"]
    found = manifest.read_manifest(runs.out / "asyncrefuse" / "ckpt" / "first")
    assert found.tag == "first"
    assert not (runs.out / "asyncrefuse" / "ckpt" / "second" / manifest.MANIFEST_NAME).exists()


def test_an_async_saves_persistent_copy_commits_beside_training_not_in_the_next_stall(
    tmp_path: Path, bare_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the node-local tier, the drain's commit in the save folder (manifest, ``latest``)
    runs in the drain's thread once the copies are done: it is there before the next save, whose
    `save_checkpoint` then has nothing of it left to do."""
    from nvcomp_ckpt_engine import commit as commit_module

    save_dir = tmp_path / "ckpt"
    engine = bare_engine(async_save=True, local_tier={"path": str(tmp_path / "local" / "node{node}")})
    info = _commit_info(save_dir, "global_step1")
    engine.create(info)
    engine.save({"w": torch.randn(1000)}, str(save_dir / "global_step1" / "mp_rank_00_model_states.pt"))
    deadline = time.monotonic() + 60
    while engine.get_commit_info() is None:
        assert time.monotonic() < deadline, "the background write did not finish"
        time.sleep(0.01)
    engine.commit(info)
    assert (tmp_path / "local" / "node0" / "global_step1" / manifest.MANIFEST_NAME).is_file()
    while not (save_dir / "latest").is_file():
        assert time.monotonic() < deadline, "the persistent copy was not committed in the background"
        time.sleep(0.01)
    assert (save_dir / "latest").read_text().strip() == "global_step1"
    assert (save_dir / "global_step1" / manifest.MANIFEST_NAME).is_file()

    commits: list[Any] = []
    real = commit_module.commit_checkpoint
    monkeypatch.setattr(commit_module, "commit_checkpoint", lambda *a, **k: commits.append(a[0]) or real(*a, **k))
    engine.create(_commit_info(save_dir, "global_step2"))
    assert commits == [], "the next save committed the persistent copy in its stall"
    engine.save({"w": torch.randn(1000)}, str(save_dir / "global_step2" / "mp_rank_00_model_states.pt"))
    engine.cleanup()
    assert (save_dir / "latest").read_text().strip() == "global_step2"
