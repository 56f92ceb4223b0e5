"""Lets ds_config alone turn nvcomp_ckpt_engine on in DeepSpeed, with no change to the script.

DeepSpeed 0.19 has no registry of checkpoint engines: `DeepSpeedEngine._configure_checkpointing`
calls the module-level name `deepspeed.runtime.engine.create_checkpoint_engine` at
`deepspeed.initialize` time. This module replaces that name, right after DeepSpeed's engine module
has been imported, with the wrapper `create_checkpoint_engine_wrapper` builds, which hands
configs that carry an ``"nvcomp_checkpoint"`` section (or a top-level key that starts with
"nvcomp", so that a misspelled section is reported) to `nvcomp_ckpt_engine.deepspeed` and every
other config to DeepSpeed's own factory, unchanged.

The package installs `nvcomp_ckpt_engine_hook.pth` into site-packages; Python's `site` runs its
one line at every interpreter start (torchrun, the ``deepspeed`` launcher, mpirun and the HF
Trainer all start ordinary interpreters), which calls `install_from_site`. That runs in every
Python process of the environment, so this module imports only `os` and `sys` (no torch, no
DeepSpeed, no nvcomp_ckpt_engine) and only adds a finder to `sys.meta_path`: about 0.2 ms of
interpreter start, measured with its bytecode cached.
Our package is imported only when a config asks for the engine, or when DeepSpeed first reads a
file with `torch.load` (see below).

DeepSpeed's own readers of checkpoint files (`get_fp32_state_dict_from_zero_checkpoint`, which
a ZeRO-3 `load_checkpoint(..., load_optimizer_states=False)` and `load_module_only=True` call, the
converters in `deepspeed.checkpoint`, `load_state_dict_from_zero_checkpoint` that the Hugging
Face helpers call), and scripts written beside them, read files with `torch.load`. When DeepSpeed
is imported the hook also wraps `torch.load` (`shim_torch_load`): a call made from a DeepSpeed
module on a path, and any call on a path that is one of our shard files, goes to
`nvcomp_ckpt_engine.compat.load_with_shards` (checksums checked, objects only from the
allowlist, and in our tag folders only the files their manifest lists); any other call is
torch's own, untouched. In a process without DeepSpeed a `torch.load` of a shard still meets
the file's guard and its clear error.

Set ``NVCOMP_CKPT_DEEPSPEED_HOOK=0`` to keep the hook out of a process;
`nvcomp_ckpt_engine.deepspeed.enable()` installs the replacement explicitly and ignores it.
"""

from __future__ import annotations

import os
import sys

#: The module whose factory is replaced.
TARGET = "deepspeed.runtime.engine"
#: Environment variable that disables the automatic hook ("0", "false", "off", "no").
ENV_VAR = "NVCOMP_CKPT_DEEPSPEED_HOOK"
#: Modules whose `torch.load` calls on any path go to the engine's checks (other callers' only
#: when the path is one of our shards): DeepSpeed's.
SHIM_CALLER_PREFIX = "deepspeed."
#: A config with a top-level key that starts with this (in any case) goes to our factory: the
#: section "nvcomp_checkpoint", and misspellings of it, which the factory reports.
KEY_PREFIX = "nvcomp"

_DISABLED = frozenset({"0", "false", "off", "no"})


def create_checkpoint_engine_wrapper(original):
    """Return DeepSpeed's factory wrapped so that configs with our section reach our engine.

    The wrapper keeps DeepSpeed's signature (config_params, groups, zero_stage, has_moe_layers,
    optimize_dp_state) and remembers `original` as ``__wrapped__``, which also marks it as ours
    so patching twice is a no-op.
    """

    def create_checkpoint_engine(config_params, *args, **kwargs):
        raw = getattr(config_params, "_param_dict", None)
        if config_params is not None and (not isinstance(raw, dict) or _mentions_us(raw)):
            # Our factory decides (and says why) when it cannot read the config.
            from nvcomp_ckpt_engine.deepspeed import create_checkpoint_engine as create

            return create(config_params, *args, original=original, **kwargs)
        return original(config_params, *args, **kwargs)

    create_checkpoint_engine.__wrapped__ = original
    create_checkpoint_engine.__doc__ = original.__doc__
    create_checkpoint_engine.__qualname__ = getattr(
        original, "__qualname__", "create_checkpoint_engine"
    )
    return create_checkpoint_engine


def _mentions_us(ds_config: dict) -> bool:
    """The section, or a top-level key that looks like a misspelling of it ("nvcomp_checkpoints",
    "nvcomp"): our factory then warns that the engine stays off instead of staying silent."""
    return any(isinstance(key, str) and key.lower().startswith(KEY_PREFIX) for key in ds_config)


def patch(module) -> bool:
    """Replace `module.create_checkpoint_engine`; returns False if it already was."""
    current = module.create_checkpoint_engine
    if getattr(current, "__wrapped__", None) is not None and current.__module__ == __name__:
        return False
    module.create_checkpoint_engine = create_checkpoint_engine_wrapper(current)
    return True


def shim_torch_load(torch_module) -> bool:
    """Wrap `torch_module.load` so that DeepSpeed's calls, and any call on one of our shard
    files, read through the engine.

    A call made from a module whose name starts with `SHIM_CALLER_PREFIX` (told apart by the
    frame that calls `torch.load`) on a path, or any call on a path whose first bytes are a
    shard's (`container.is_shard_file`: 1 KiB read), goes to
    `nvcomp_ckpt_engine.compat.load_with_shards`, imported on the first such call; every other
    call goes to torch's own `load` unchanged. Returns False if the wrapper is in place already.
    """
    import functools  # here, not at interpreter start: only DeepSpeed's processes need it

    current = torch_module.load
    if getattr(current, "__nvcomp_shim__", False):
        return False

    @functools.wraps(current)
    def load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            from nvcomp_ckpt_engine.container import is_shard_file  # torch-free, small

            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith(SHIM_CALLER_PREFIX) or is_shard_file(f):
                from nvcomp_ckpt_engine.compat import load_with_shards

                return load_with_shards(current, f, *args, **kwargs)
        return current(f, *args, **kwargs)

    load.__nvcomp_shim__ = True
    torch_module.load = load
    return True


def _patch_deepspeed(module) -> None:
    """What DeepSpeed's engine module gets once imported: our factory, and the torch.load shim
    (DeepSpeed imports torch before its engine module, so torch is there)."""
    patch(module)
    torch_module = sys.modules.get("torch")
    if torch_module is not None:
        shim_torch_load(torch_module)


class _PatchingLoader:
    """Runs the real loader, gives the module back its real loader, then calls `after` on it."""

    def __init__(self, loader, after) -> None:
        self._loader = loader
        self._after = after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Restore the real loader first so that inspect, linecache and reload see nothing of us.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """A `sys.meta_path` finder that answers for one module name only, by asking the finders
    after it, and hands that module to `after` once it has run."""

    def __init__(self, name: str, after) -> None:
        self.name = name
        self.after = after

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self.after)
                return spec
        return None


def when_imported(name: str, after) -> None:
    """Call `after(module)` with module `name` once it is imported: now if it is loaded, else
    right after its code has run. Once per name: a second call for the same name is ignored."""
    module = sys.modules.get(name)
    if module is not None:
        after(module)
        return
    if not any(isinstance(finder, _Finder) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, after))


def install() -> None:
    """Patch DeepSpeed now if its engine module is loaded, else when it gets imported."""
    when_imported(TARGET, _patch_deepspeed)


def install_from_site() -> None:
    """Entry point of the .pth file: `install`, unless the environment variable says no."""
    if os.environ.get(ENV_VAR, "").strip().lower() in _DISABLED:
        return
    install()
