"""Make DeepSpeed's CPU accelerator report the dtypes in NVCOMP_TEST_UNSUPPORTED_DTYPES unsupported.

Python imports a `sitecustomize` module at start-up when one is on sys.path; tests/conftest.py
puts this folder on PYTHONPATH only while that variable is set, so every process the tests
start (torchrun, the deepspeed launcher, mpirun and their workers) sees the same CPU as the
test process: one without fp16 (or bf16) kernels, as on many x86 CPUs. See tests/capabilities.py.

It stays cheap and imports nothing heavy: the accelerator class is patched when DeepSpeed
imports its module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "deepspeed.accelerator.cpu_accelerator"
_METHODS = {"fp16": "is_fp16_supported", "bf16": "is_bf16_supported"}


def patch_accelerator(module: object, dtypes: frozenset[str]) -> None:
    """Make `module.CPU_Accelerator` answer False for `dtypes` (and drop them from its list)."""
    cls = module.CPU_Accelerator
    for dtype in dtypes:
        setattr(cls, _METHODS[dtype], lambda self: False)
    real_supported = cls.supported_dtypes

    def supported_dtypes(self):
        import torch

        gone = {"fp16": torch.float16, "bf16": torch.bfloat16}
        return [d for d in real_supported(self) if d not in {gone[n] for n in dtypes}]

    cls.supported_dtypes = supported_dtypes


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of `_TARGET` to patch the module it runs."""

    def __init__(self, dtypes: frozenset[str]) -> None:
        self.dtypes = dtypes

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec, dtypes = spec.loader.exec_module, self.dtypes

        def exec_module(module):
            real_exec(module)
            patch_accelerator(module, dtypes)

        spec.loader.exec_module = exec_module
        return spec


def _dtypes() -> frozenset[str]:
    names = os.environ.get("NVCOMP_TEST_UNSUPPORTED_DTYPES", "")
    return frozenset(n.strip() for n in names.split(",") if n.strip() in _METHODS)


if _dtypes():
    if _TARGET in sys.modules:
        patch_accelerator(sys.modules[_TARGET], _dtypes())
    else:
        sys.meta_path.insert(0, _PatchOnImport(_dtypes()))
