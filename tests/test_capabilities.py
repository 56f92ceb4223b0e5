"""The simulated CPU of NVCOMP_TEST_UNSUPPORTED_DTYPES reaches the processes the tests start.

The multi-process tests only prove that a CPU without fp16 (or bf16) runs every other case if
their DeepSpeed children see the same CPU as the test process: tests/simulate/sitecustomize.py
patches DeepSpeed's CPU accelerator in each child that has that folder on PYTHONPATH. A child
here asks DeepSpeed's `get_accelerator()`, as DeepSpeed itself does, without starting a job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capabilities import SIMULATE_ENV

SIMULATE_DIR = Path(__file__).resolve().parent / "simulate"

#: What a child reports: the accelerator's answers and whether the patch was installed.
CHILD = """
import json, sys
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
print(json.dumps({"name": accelerator.device_name(), "fp16": accelerator.is_fp16_supported(),
                  "bf16": accelerator.is_bf16_supported(),
                  "dtypes": [str(d) for d in accelerator.supported_dtypes()],
                  "patched": "sitecustomize" in sys.modules
                             and hasattr(sys.modules["sitecustomize"], "patch_accelerator")}))
"""


def child_report(unsupported: str | None) -> dict:
    """What DeepSpeed's accelerator says in a fresh child started as conftest starts them."""
    env = {k: v for k, v in os.environ.items() if k not in (SIMULATE_ENV, "PYTHONPATH")}
    env["DS_ACCELERATOR"] = "cpu"
    if unsupported is not None:
        env[SIMULATE_ENV] = unsupported
        env["PYTHONPATH"] = str(SIMULATE_DIR)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unpatched() -> dict:
    """The child's answers with no dtype simulated: this CPU's own."""
    return child_report(None)


def test_without_the_variable_nothing_is_patched(unpatched: dict) -> None:
    assert unpatched["name"] == "cpu"
    assert unpatched["patched"] is False


@pytest.mark.parametrize("gone, kept", [("fp16", "bf16"), ("bf16", "fp16")])
def test_a_child_sees_the_simulated_dtype_unsupported_and_the_other_unchanged(
        unpatched: dict, gone: str, kept: str) -> None:
    report = child_report(gone)
    assert report["patched"] is True
    assert report[gone] is False
    assert report[kept] is unpatched[kept]
    torch_name = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}[gone]
    assert torch_name not in report["dtypes"]
    assert set(report["dtypes"]) == set(unpatched["dtypes"]) - {torch_name}


def test_both_dtypes_can_be_simulated_at_once() -> None:
    report = child_report("fp16,bf16")
    assert (report["fp16"], report["bf16"]) == (False, False)
