"""The non-tensor objects of DeepSpeed's checkpoints that a skeleton may rebuild, registered
with the core's allowlist (`state.register_safe_globals`) when this adapter is imported.

They are plain "module.QualName" strings, so registering them imports no DeepSpeed: the CLI's
`decompress` and `zero-to-fp32` (through `compat`) read DeepSpeed tags on machines without it.
"""

from __future__ import annotations

from .. import state

#: DeepSpeed's loss scalers, ZeRO enums and fragment addresses (0.19.x), as checkpoints name them.
DEEPSPEED_SAFE_GLOBALS: frozenset[str] = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
        "deepspeed.checkpoint.constants.ZeroStageEnum",
    }
)

state.register_safe_globals(DEEPSPEED_SAFE_GLOBALS)
