"""What DeepSpeed's file names and files say about the run that wrote them: the rank behind a
checkpoint file's name, and the parallel layout a model-states or optimizer file records.

DeepSpeed knowledge for code that reads DeepSpeed checkpoints without DeepSpeed's engine
(`nvcomp-ckpt compress` builds a tag's manifest from it; the benchmarks count bytes per rank).
"""

from __future__ import annotations

import re
from typing import Any


_OPTIM_NAME = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states")
_MODEL_NAME = re.compile(r"^mp_rank_(\d+)_model_states")


def rank_of(name: str, tp_size: int) -> int:
    """The global rank that wrote a DeepSpeed file, from its name where it says; else 0.

    Optimizer shards ``[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`` come from rank
    ``D * tp_size + MM`` (Megatron's order: tensor-parallel ranks adjacent), model states
    ``mp_rank_MM_model_states.pt`` from the first data-parallel rank of model-parallel rank MM.
    Pipeline-parallel layer files and anything else are attributed to rank 0.
    """
    if match := _OPTIM_NAME.search(name):
        return int(match[1]) * tp_size + int(match[2])
    if match := _MODEL_NAME.match(name):
        return int(match[1])
    return 0


def layout_hints(obj: Any) -> dict[str, Any]:
    """What one DeepSpeed file says about the parallel layout it was saved with.

    Model-states files carry the data-, tensor- and pipeline-parallel sizes (``dp``, ``tp``,
    ``pp``: the names of `manifest.layout_record`'s arguments) and the step; optimizer files the
    ZeRO stage. Anything else says nothing.
    """
    if not isinstance(obj, dict):
        return {}
    hints: dict[str, Any] = {}
    if isinstance(obj.get("dp_world_size"), int):
        dims = obj.get("checkpoint_parallel_dimensions") or {}
        hints["dp"] = obj["dp_world_size"]
        hints["tp"] = int(dims.get("tp_degree", obj.get("mp_world_size", 1)))
        hints["pp"] = int(dims.get("pp_degree", 1))
        if isinstance(obj.get("global_steps"), int):
            hints["step"] = obj["global_steps"]
    optim = obj.get("optimizer_state_dict")
    if isinstance(optim, dict) and "zero_stage" in optim:
        hints["zero_stage"] = int(optim["zero_stage"])
    if "ds_version" in obj:
        hints["deepspeed_version"] = str(obj["ds_version"])
    return hints
