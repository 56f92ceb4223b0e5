"""The environment DeepSpeed's just-in-time op builds need, set before DeepSpeed builds an op.

DeepSpeed compiles some ops at their first use (FusedAdam on a GPU, its shared-memory
communication op on the CPU accelerator). Two settings decide whether that works and how often
it happens:

- ``TORCH_CUDA_ARCH_LIST``: DeepSpeed 0.19's op builder reads each entry as ``M.N`` or
  ``M.N+PTX`` (``int()`` of each part) and fails on the arch-specific forms that PyTorch itself
  accepts and that CUDA images for Hopper and Blackwell commonly set (``9.0a``: "invalid literal
  for int() with base 10: '0a'"). The ops DeepSpeed builds use no arch-specific instructions,
  so ``9.0a`` is built as ``9.0``. An entry of another form (an architecture name such as
  ``Hopper``) leaves the variable unset, and DeepSpeed asks the visible GPUs instead.
- ``TORCH_EXTENSIONS_DIR``: one build cache per virtual environment, inside it; a cache shared by
  two environments is rebuilt at every switch between them.

A training program calls `prepare()` before DeepSpeed is first used (the demo job and the
Hugging Face example do), so that any launcher, or a bare ``torchrun train.py``, gets both.
Nothing here imports DeepSpeed.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Mapping, MutableMapping

ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
EXTENSIONS_DIR = "TORCH_EXTENSIONS_DIR"

#: One entry of an arch list: major.minor, an arch-specific suffix (9.0a, 10.0f), +PTX.
_ENTRY = re.compile(r"(\d+)\.(\d+)[a-z]*(\+PTX)?")


def deepspeed_arch_list(value: str) -> str | None:
    """`value` (a ``TORCH_CUDA_ARCH_LIST``, entries split by ``;`` or spaces) in the form
    DeepSpeed's op builder parses: ``M.N`` or ``M.N+PTX`` entries joined by ``;``, each once.
    None where an entry has no such form (the variable is then best left unset)."""
    entries: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        match = _ENTRY.fullmatch(entry)
        if match is None:
            return None
        major, minor, ptx = match.groups()
        entries.append(f"{int(major)}.{int(minor)}{ptx or ''}")
    return ";".join(dict.fromkeys(entries)) or None


def jit_environment(environ: Mapping[str, str], prefix: str, base_prefix: str
                    ) -> dict[str, str | None]:
    """What to change in `environ` before a DeepSpeed op is built: variable -> new value, or
    None to unset it. `prefix` / `base_prefix` are the interpreter's (``sys.prefix`` differs
    from ``sys.base_prefix`` inside a virtual environment)."""
    changes: dict[str, str | None] = {}
    arch_list = environ.get(ARCH_LIST)
    if arch_list is not None:
        fixed = deepspeed_arch_list(arch_list)
        if fixed != arch_list:
            changes[ARCH_LIST] = fixed
    if EXTENSIONS_DIR not in environ and prefix != base_prefix:
        changes[EXTENSIONS_DIR] = os.path.join(prefix, "torch_extensions")
    return changes


def prepare(environ: MutableMapping[str, str] | None = None) -> dict[str, str | None]:
    """Apply `jit_environment` to `environ` (the process environment by default) and return
    the changes made. Call it before DeepSpeed builds an op (before `deepspeed.initialize`)."""
    environ = os.environ if environ is None else environ
    changes = jit_environment(environ, sys.prefix, sys.base_prefix)
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return changes
