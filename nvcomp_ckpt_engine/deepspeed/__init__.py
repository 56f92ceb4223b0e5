"""The DeepSpeed adapter: `NvcompCheckpointEngine` and the ways DeepSpeed comes to use it
(`integration`: ds_config through the import hook, `enable()`, `install()`).

The public names load DeepSpeed on first use, not on import of this package: the CLI's
DeepSpeed file-name rules (`names`) must not cost a DeepSpeed import, or need one installed.
"""

from __future__ import annotations

import importlib
from typing import Any

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
