"""How DeepSpeed comes to use `NvcompCheckpointEngine`: its factory, `enable`, `install`.

Three ways in, from least to most code (docs/DEEPSPEED.md has the details):

1. ds_config only. With the package installed, the ``nvcomp_ckpt_engine_hook.pth`` import hook
   (see `_nvcomp_ckpt_engine_hook`) replaces DeepSpeed's checkpoint-engine factory as soon as
   DeepSpeed is imported, so ``"nvcomp_checkpoint": {"enabled": true}`` in ds_config is all a
   ``deepspeed``/``torchrun``/``mpirun``/HF Trainer job needs.
2. ``nvcomp_ckpt_engine.deepspeed.enable()`` before ``deepspeed.initialize``: the same
   replacement, explicitly (for ``python -S``, ``NVCOMP_CKPT_DEEPSPEED_HOOK=0``, or a source
   checkout on ``PYTHONPATH``). ds_config still decides.
3. ``nvcomp_ckpt_engine.deepspeed.install(engine, **options)`` after ``deepspeed.initialize``:
   swaps the initialized engine's checkpoint engine, whatever ds_config says.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from ..config import SECTION, NvcompConfig, section_mistake
from . import _compat
from .engine import NvcompCheckpointEngine

logger = logging.getLogger(__name__)


def create_checkpoint_engine(
    config_params: Any,
    groups: Any = None,
    zero_stage: int | None = None,
    has_moe_layers: bool = False,
    optimize_dp_state: bool = False,
    *,
    original: Callable[..., CheckpointEngine],
) -> CheckpointEngine:
    """DeepSpeed's factory with our engine in front: used when ds_config enables it.

    Called with DeepSpeed's arguments by the replaced ``deepspeed.runtime.engine.
    create_checkpoint_engine``; `original` is DeepSpeed's own factory, which builds the engine
    for every config that does not enable ours. A bad ``"nvcomp_checkpoint"`` section raises
    `ValueError` here, at ``deepspeed.initialize``, on every rank and before anything is said
    about it (a misspelled key inside it is that error, naming the key it is close to, not a
    warning that the section lacks ``"enabled"``); a valid section without ``"enabled"``, or a
    misspelled section name, gets a warning on rank 0, once per process
    (`config.section_mistake`).
    """
    delegate = (config_params, groups, zero_stage, has_moe_layers, optimize_dp_state)
    raw = _compat.raw_config(config_params)
    if raw is None:
        logger.warning(
            "nvcomp_ckpt_engine cannot read this DeepSpeed version's ds_config; any %r section "
            "is ignored and DeepSpeed's own checkpoint engine is used",
            SECTION,
        )
        return original(*delegate)
    options = NvcompConfig.from_ds_config(raw)
    mistake = section_mistake(raw)
    if mistake is not None and _is_rank_zero():
        _warn_once(mistake)
    if not options.enabled:
        return original(*delegate)
    competitor = _compat.competing_engine(config_params)
    if competitor is not None:
        raise ValueError(
            f'ds_config enables both "{SECTION}" and {competitor}; DeepSpeed uses one checkpoint '
            f'engine: remove one of them or set "{SECTION}": {{"enabled": false}}'
        )
    _compat.patch_load_checkpoint()
    _compat.patch_save_checkpoint()
    return NvcompCheckpointEngine(config_params, options=options, zero_stage=zero_stage)


def _is_rank_zero() -> bool:
    """Rank 0 of the job (or a process outside one): the rank that speaks for all of them."""
    return not dist.is_initialized() or dist.get_rank() == 0


@functools.cache
def _warn_once(message: str) -> None:
    """Log `message` once per process: a script that initializes DeepSpeed several times (or an
    HF Trainer run that does) hears about the same ds_config mistake once."""
    logger.warning("nvcomp_ckpt_engine: %s", message)


def enable() -> None:
    """Make DeepSpeed consult ds_config's ``"nvcomp_checkpoint"`` section, as the hook does.

    Call before ``deepspeed.initialize``; idempotent. Needed only where the automatic import
    hook does not run; it ignores ``NVCOMP_CKPT_DEEPSPEED_HOOK``.
    """
    import _nvcomp_ckpt_engine_hook

    import deepspeed.runtime.engine

    _nvcomp_ckpt_engine_hook.patch(deepspeed.runtime.engine)


def install(engine: Any, **options: Any) -> NvcompCheckpointEngine:
    """Give an initialized `DeepSpeedEngine` an `NvcompCheckpointEngine`; returns it.

    `options` are `NvcompConfig` fields (``algorithm="zstd"``, ``keep_last=3``, ...) and
    override ds_config's section, which need not exist; the engine is enabled regardless.
    Every rank must call it. DeepSpeed decided which ranks write the model states with its
    previous engine, whose rule (data-parallel rank 0) ours keeps, so nothing else changes.
    """
    config_params = _compat.engine_config(engine)
    settings = NvcompConfig.from_ds_config(_compat.raw_config(config_params))
    settings = settings.replace(**{**options, "enabled": True})
    checkpoint_engine = NvcompCheckpointEngine(
        config_params, options=settings, zero_stage=engine.zero_optimization_stage()
    )
    _compat.patch_load_checkpoint()
    _compat.patch_save_checkpoint()
    engine.checkpoint_engine = checkpoint_engine
    if settings.async_save:
        checkpoint_engine.prepin(engine)
    return checkpoint_engine


__all__ = ["NvcompCheckpointEngine", "create_checkpoint_engine", "enable", "install"]
