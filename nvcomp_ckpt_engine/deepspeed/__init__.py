"""The DeepSpeed adapter: `NvcompCheckpointEngine` and the ways DeepSpeed comes to use it
(`integration`: ds_config through the import hook, `enable()`, `install()`).

The public names load DeepSpeed on first use, not on import of this package: the CLI's
DeepSpeed file-name rules (`names`) must not cost a DeepSpeed import, or need one installed.
Importing the package registers DeepSpeed's checkpoint objects with the skeleton allowlist
(`allowlist`, plain names), so every reader of DeepSpeed files that imports it gets them.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import allowlist  # noqa: F401  (registers DeepSpeed's objects with the allowlist)

#: Public name -> the module of this package that defines it.
_EXPORTS = {
    "NvcompCheckpointEngine": "engine",
    "create_checkpoint_engine": "integration",
    "enable": "integration",
    "install": "integration",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = sorted(_EXPORTS)
