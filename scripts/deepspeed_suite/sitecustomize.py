"""Turns nvcomp_ckpt_engine on in every DeepSpeed config this interpreter builds.

`scripts/deepspeed_suite.sh` puts this folder first on PYTHONPATH for its second run of
DeepSpeed's checkpoint tests, so the test process and every rank it spawns import it at start.
It wraps `deepspeed.initialize` once DeepSpeed is imported and adds the section named by
NVCOMP_SUITE_SECTION (JSON) to the config it is given (a dict, a JSON file, or the
`args.deepspeed_config` file), unless the config has the section already. Nothing else of the
tests changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys

SECTION = json.loads(os.environ.get("NVCOMP_SUITE_SECTION", '{"enabled": true, "algorithm": "zstd"}'))


def _with_section(config):
    """The config as a dict with our section added (a path is read; anything else is kept)."""
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if isinstance(config, dict) and "nvcomp_checkpoint" not in config:
        config = {**config, "nvcomp_checkpoint": dict(SECTION)}
    return config


def _wrap(initialize):
    @functools.wraps(initialize)
    def wrapped(*args, **kwargs):
        if kwargs.get("config") is not None:
            kwargs["config"] = _with_section(kwargs["config"])
        elif kwargs.get("config_params") is not None:
            kwargs["config_params"] = _with_section(kwargs["config_params"])
        else:
            ds_args = kwargs.get("args", args[0] if args else None)
            path = getattr(ds_args, "deepspeed_config", None)
            if path is not None:
                kwargs["config"] = _with_section(path)
                ds_args.deepspeed_config = None
        return initialize(*args, **kwargs)

    wrapped.__nvcomp_suite__ = True
    return wrapped


class _Loader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        if not getattr(module.initialize, "__nvcomp_suite__", False):
            module.initialize = _wrap(module.initialize)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
