"""What this machine's DeepSpeed CPU accelerator supports, asked at run time, never assumed.

DeepSpeed refuses a training dtype its accelerator does not support (`deepspeed.initialize`
raises "Type fp16 is not supported on your device."), and CPUs differ: the CPU accelerator
supports fp16 only where oneDNN has fp16 kernels (e.g. avx512_fp16), which many x86 CPUs lack.
Tests that train with DeepSpeed in half precision ask `unsupported_reason(dtype)` and skip with
its answer, so a machine without fp16 still runs every other case.

The test workers run DeepSpeed with ``DS_ACCELERATOR=cpu``, so this asks DeepSpeed's CPU
accelerator (not whatever accelerator the test process would detect).

To check that the suite holds on such a machine, set ``NVCOMP_TEST_UNSUPPORTED_DTYPES=fp16``
(or ``bf16``, or both, comma-separated): DeepSpeed's CPU accelerator then reports those dtypes
unsupported in the test process and, through `tests/simulate/sitecustomize.py` on PYTHONPATH
(conftest.py puts it there), in every process the tests start, exactly as such a CPU would.
"""

from __future__ import annotations

import functools
import os

#: Environment variable naming the dtypes to report unsupported ("fp16", "bf16").
SIMULATE_ENV = "NVCOMP_TEST_UNSUPPORTED_DTYPES"
DTYPES = ("fp16", "bf16")


def simulated_unsupported() -> frozenset[str]:
    """The dtypes ``NVCOMP_TEST_UNSUPPORTED_DTYPES`` says to report unsupported."""
    names = {n.strip() for n in os.environ.get(SIMULATE_ENV, "").split(",") if n.strip()}
    unknown = names - set(DTYPES)
    if unknown:
        raise ValueError(f"{SIMULATE_ENV}: unknown dtype(s) {sorted(unknown)}; use {DTYPES}")
    return frozenset(names)


@functools.cache
def _cpu_accelerator_supports(dtype: str) -> bool:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = CPU_Accelerator()
    return bool(accelerator.is_fp16_supported() if dtype == "fp16" else accelerator.is_bf16_supported())


def unsupported_reason(dtype: str) -> str | None:
    """Why DeepSpeed's CPU accelerator cannot train in `dtype` here; None if it can.

    `dtype` is a DeepSpeed case's dtype name: "fp32" (always supported), "fp16" or "bf16".
    """
    if dtype == "fp32":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"unknown DeepSpeed dtype {dtype!r}; expected fp32, fp16 or bf16")
    if dtype in simulated_unsupported():
        return f"{dtype} reported unsupported by {SIMULATE_ENV}"
    if not _cpu_accelerator_supports(dtype):
        return f"DeepSpeed's CPU accelerator does not support {dtype} on this CPU"
    return None
