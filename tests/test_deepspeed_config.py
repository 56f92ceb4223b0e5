"""A ds_config that looks meant for the engine but does not turn it on is reported.

DeepSpeed accepts unknown top-level keys silently, so a misspelled ``"nvcomp_checkpoint"``
section, or the section without ``"enabled"``, would leave DeepSpeed's own engine saving every
checkpoint with nothing said. The import hook sends such configs to our factory, which warns
once per process, on rank 0 only, naming the key and the fix, and then builds DeepSpeed's engine
as before.
"""

from __future__ import annotations

import importlib.util
import logging
import types
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest

from nvcomp_ckpt_engine.config import SECTION, section_mistake

ROOT = Path(__file__).resolve().parents[1]
OWN = "deepspeed's own engine"


@pytest.mark.parametrize("config, words", [
    ({"nvcomp_checkpoints": {"enabled": True}},
     ["'nvcomp_checkpoints'", f"rename it to {SECTION!r}", "default checkpoint engine is used"]),
    ({"NVCOMP_CHECKPOINT": {"enabled": True}}, ["'NVCOMP_CHECKPOINT'", "rename"]),
    ({"nvcomp": {"enabled": True}}, ["'nvcomp'", "rename"]),
    ({SECTION: {"algorithm": "zstd"}}, ['no "enabled" key', 'add "enabled": true']),
    ({SECTION: {}}, ['add "enabled": true']),
    ({SECTION: {"enabled": True}, "nvcomp_checkpoints": {"keep_last": 2}},
     ["'nvcomp_checkpoints'", "ignored", "merge them"]),
])
def test_section_mistakes_name_the_key_and_the_fix(config: dict, words: list[str]) -> None:
    message = section_mistake({"train_batch_size": 4, **config})
    assert message is not None
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("config", [
    {}, {"train_batch_size": 4}, {SECTION: {"enabled": True}}, {SECTION: {"enabled": False}},
    {"checkpoint": {"nvcomp": 1}},  # only top-level keys are ours
])
def test_configs_without_a_mistake_say_nothing(config: dict) -> None:
    assert section_mistake(config) is None


# -------------------------------------------------------------------------- the factory


def _ds_config(raw: dict[str, Any]) -> Any:
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig({"train_batch_size": 4, **raw})


def _own_engine(*args: Any) -> str:
    return OWN


@pytest.fixture
def factory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Our factory, with the once-per-process memory of its warnings emptied around the test."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from nvcomp_ckpt_engine.deepspeed import integration as adapter

    adapter._warn_once.cache_clear()
    yield adapter
    adapter._warn_once.cache_clear()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("nvcomp_ckpt_engine")]


def test_factory_warns_once_per_process_and_keeps_deepspeeds_engine(
        factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    misspelled = _ds_config({"nvcomp_checkpoints": {"enabled": True}})
    for _ in range(3):  # deepspeed.initialize called again (a second model, a re-run)
        assert factory.create_checkpoint_engine(
            misspelled, None, 0, False, True, original=_own_engine) == OWN
    (warning,) = _warnings(caplog)
    assert "'nvcomp_checkpoints'" in warning and f"rename it to {SECTION!r}" in warning
    no_switch = _ds_config({SECTION: {"algorithm": "zstd"}})
    assert factory.create_checkpoint_engine(
        no_switch, None, 0, False, True, original=_own_engine) == OWN
    assert len(_warnings(caplog)) == 2 and 'add "enabled": true' in _warnings(caplog)[1]


def test_factory_warns_on_rank_zero_only(factory: Any, caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    misspelled = _ds_config({"nvcomp_checkpoints": {"enabled": True}})
    monkeypatch.setattr(factory.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(factory.dist, "get_rank", lambda: 1)
    factory.create_checkpoint_engine(misspelled, None, 0, False, True, original=_own_engine)
    assert _warnings(caplog) == []
    monkeypatch.setattr(factory.dist, "get_rank", lambda: 0)
    factory.create_checkpoint_engine(misspelled, None, 0, False, True, original=_own_engine)
    assert len(_warnings(caplog)) == 1


def test_factory_is_silent_for_an_enabled_or_switched_off_section(
        factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    for section in ({"enabled": False}, {"enabled": False, "algorithm": "zstd"}):
        factory.create_checkpoint_engine(_ds_config({SECTION: section}), None, 0, False, True,
                                         original=_own_engine)
    engine = factory.create_checkpoint_engine(_ds_config({SECTION: {"enabled": True}}), None, 0,
                                              False, True, original=_own_engine)
    assert isinstance(engine, factory.NvcompCheckpointEngine)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("section, key, meant", [
    ({"enabeld": True}, "enabeld", "enabled"),
    ({"enabled": True, "keeplast": 2}, "keeplast", "keep_last"),
    ({"algoritm": "zstd"}, "algoritm", "algorithm"),
])
def test_a_typo_inside_the_section_is_the_error_alone(
        factory: Any, caplog: pytest.LogCaptureFixture, section: dict, key: str,
        meant: str) -> None:
    """A misspelled key raises on every rank, naming the key it is close to; no warning first
    that the section lacks "enabled" (it has it, misspelled)."""
    config = _ds_config({SECTION: section})
    with caplog.at_level(logging.DEBUG), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=rf"{SECTION}: unknown key '{key}' \(did you mean "
                           rf"'{meant}'\?\); allowed keys: \["):
            factory.create_checkpoint_engine(config, None, 0, False, True, original=_own_engine)
    assert _warnings(caplog) == []
    assert not [r for r in caplog.records if "enabled" in r.getMessage()]
    assert not [w for w in caught if "enabled" in str(w.message)]


# ----------------------------------------------------------------------- the import hook


@pytest.fixture
def hook() -> types.ModuleType:
    """This checkout's hook module, loaded from its file whether or not it is installed."""
    spec = importlib.util.spec_from_file_location("hook_under_test",
                                                  ROOT / "_nvcomp_ckpt_engine_hook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_sends_a_misspelled_section_to_our_factory(
        hook: types.ModuleType, factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def original(config_params: Any, *args: Any) -> str:
        calls.append(config_params)
        return OWN

    create = hook.create_checkpoint_engine_wrapper(original)
    misspelled = _ds_config({"nvcomp_checkpoints": {"enabled": True}})
    assert create(misspelled, None, 0, False, True) == OWN
    assert calls == [misspelled]  # DeepSpeed's engine, built by DeepSpeed's factory
    assert len(_warnings(caplog)) == 1
    assert create(_ds_config({}), None, 0, False, True) == OWN
    assert len(_warnings(caplog)) == 1
