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
import json
import os

from _nvcomp_ckpt_engine_hook import when_imported

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


def _wrap_initialize(module) -> None:
    if not getattr(module.initialize, "__nvcomp_suite__", False):
        module.initialize = _wrap(module.initialize)


# The package's import hook module (installed with it) patches a module once it is imported.
when_imported("deepspeed", _wrap_initialize)
