"""Living next to tools that call `torch.load` on checkpoint files.

DeepSpeed copies `zero_to_fp32.py` into every save directory, and `ds_to_universal` and many
user scripts `torch.load` the shard files directly. Our shard files are not torch files, so
three things make that meet a clear message or a working conversion instead of a traceback:

1. Every shard file starts with a small pickle (the "guard") that calls `refuse_torch_load`.
   `torch.load(path, weights_only=False)`, which DeepSpeed's scripts use, unpickles it first and
   gets `TorchLoadOfShardError`, naming the two ways out. Under torch's default
   ``weights_only=True`` torch refuses the guard's global itself, and its message names
   ``nvcomp_ckpt_engine.compat.refuse_torch_load``.
2. `patch_torch_load()` makes `torch.load` read our shard files through the engine (and hands
   every other file to the real `torch.load`), for the lifetime of a ``with`` block.
3. `wrap_recovery_script(save_dir)` rewrites the copied `zero_to_fp32.py` so that it applies
   the patch before it runs: ``python zero_to_fp32.py . out/`` then works unchanged. Where the
   package is not installed, the wrapped script runs as DeepSpeed wrote it and, if it fails for
   want of the package, prints how to get a plain checkpoint.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import torch

from . import api
from .deepspeed import allowlist as _ds_allowlist  # noqa: F401  (registers DeepSpeed's objects)
from .errors import UnsupportedCheckpointError
from .fileio import atomic_write_bytes

logger = logging.getLogger(__name__)

#: How to get at a shard's contents, in every message that meets a user holding one.
WAYS_OUT = (
    "Load it with nvcomp_ckpt_engine.load(path), or write a plain DeepSpeed checkpoint with "
    "`nvcomp-ckpt decompress CKPT_DIR OUT_DIR` (CKPT_DIR: the save directory or one tag "
    "folder); `nvcomp-ckpt zero-to-fp32 CKPT_DIR OUT_DIR` runs DeepSpeed's zero_to_fp32 on it "
    "directly."
)

#: The DeepSpeed recovery scripts to wrap. `zero_to_torch.py` imports the `zero_to_fp32.py`
#: next to it, so wrapping the latter covers both.
RECOVERY_SCRIPTS = ("zero_to_fp32.py",)

_BEGIN = "# >>> nvcomp_ckpt_engine: read compressed shards (added by nvcomp_ckpt_engine) >>>"
_END = "# <<< nvcomp_ckpt_engine <<<"
_PREAMBLE = f'''{_BEGIN}
try:
    from nvcomp_ckpt_engine.compat import patch_torch_load as _nvckpt_patch_torch_load
except ImportError:
    import sys as _nvckpt_sys

    def _nvckpt_hint(kind, value, tb, _previous=_nvckpt_sys.excepthook):
        _previous(kind, value, tb)
        if isinstance(value, ImportError) and (value.name or "").startswith("nvcomp_ckpt_engine"):
            _nvckpt_sys.stderr.write(
                "\\nThis checkpoint was written by nvcomp_ckpt_engine, which is not installed "
                "here. Install the nvcomp_ckpt_engine package and run this script again, "
                "or write a plain checkpoint where it is installed: "
                "nvcomp-ckpt decompress CKPT_DIR OUT_DIR\\n")

    _nvckpt_sys.excepthook = _nvckpt_hint
else:
    # Entered and never left (the global keeps it alive): torch.load reads engine shards for
    # the rest of this process.
    _nvckpt_torch_load_patch = _nvckpt_patch_torch_load()
    _nvckpt_torch_load_patch.__enter__()
{_END}
'''


class TorchLoadOfShardError(UnsupportedCheckpointError, RuntimeError):
    """`torch.load` was called on an nvcomp_ckpt_engine shard file.

    Also a `RuntimeError`, because that is what code written for `torch.load` catches.
    `detail` holds the text the writing engine put in the file's guard.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def refuse_torch_load(detail: str) -> NoReturn:
    """Raise the clear error; the guard pickle at the start of every shard file calls this.

    `detail` is the text the writing engine put in the guard. The message comes from the
    installed package instead, so it names the commands this installation has; `detail` stays
    on the exception for anyone who wants the file's own words.
    """
    raise TorchLoadOfShardError(
        "This file is an nvcomp_ckpt_engine shard (a compressed checkpoint file), not a "
        f"torch.save file, so torch.load cannot read it. {WAYS_OUT}",
        detail,
    )


@contextlib.contextmanager
def patch_torch_load(*, trusted: bool = False) -> Iterator[None]:
    """Within the block, `torch.load` reads engine shard files too and returns their objects.

    A path that `is_shard_file` accepts is read with `nvcomp_ckpt_engine.load(path,
    map_location, trusted=trusted)`: checksums verified, the skeleton read with the allowlist
    unless `trusted`. The caller's ``weights_only`` and ``mmap`` are ignored for shard files (the
    allowlist is the engine's own restriction and covers DeepSpeed checkpoints). Everything else
    -- plain files, file objects, buffers -- goes to the real `torch.load` untouched.

    This replaces the process-wide ``torch.load`` attribute: blocks nest (each restores what it
    found), but another thread calling `torch.load` meanwhile is patched too.
    """
    real_load = torch.load

    @functools.wraps(real_load)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)) and api.is_shard_file(f):
            logger.debug("torch.load(%s): reading an nvcomp_ckpt_engine shard", f)
            return api.load(f, map_location=map_location, trusted=trusted)
        return real_load(f, map_location, *args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


def load_for_deepspeed(real_load: Callable[..., Any], f: str | os.PathLike, map_location: Any = None,
                       *args: Any, **kwargs: Any) -> Any:
    """`torch.load` as DeepSpeed's own modules see it with the package installed.

    The import hook (`_nvcomp_ckpt_engine_hook.shim_torch_load`) sends here the calls that
    DeepSpeed's modules make with a path. A shard file is read with `nvcomp_ckpt_engine.load`:
    every chunk's CRC checked and its objects made only from the allowlist, whatever
    ``weights_only`` DeepSpeed passed (the allowlist covers DeepSpeed's checkpoint objects, and a
    shard never runs code). Any other file goes to `real_load` exactly as DeepSpeed called it.
    """
    if api.is_shard_file(f):
        logger.debug("DeepSpeed's torch.load(%s): reading an nvcomp_ckpt_engine shard", f)
        return api.load(f, map_location=map_location)
    return real_load(f, map_location, *args, **kwargs)


def wrap_recovery_script(save_dir: str | os.PathLike) -> list[Path]:
    """Make the save directory's copied `zero_to_fp32.py` able to read our shards.

    Called by the DeepSpeed adapter on rank 0 after each save (DeepSpeed copies a fresh script
    before `commit`). Idempotent: an existing preamble is replaced by the current one, and a file
    already up to date is not rewritten. A script that cannot be parsed or written is left as it
    is, with a warning (the checkpoint itself is fine; `nvcomp-ckpt decompress` still works).
    Returns the scripts that carry the preamble afterwards.
    """
    wrapped = []
    for name in RECOVERY_SCRIPTS:
        path = Path(save_dir) / name
        if path.is_file() and _wrap_one(path):
            wrapped.append(path)
    return wrapped


def _wrap_one(path: Path) -> bool:
    try:
        source = path.read_text(encoding="utf-8")
        new = add_preamble(source)
        if new != source:
            mode = path.stat().st_mode
            atomic_write_bytes(path, new.encode("utf-8"))
            os.chmod(path, mode)  # keep DeepSpeed's executable bit
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
        logger.warning(
            "could not add the nvcomp_ckpt_engine preamble to %s (%s); running it on this "
            "checkpoint will fail. %s", path, exc, WAYS_OUT,
        )
        return False
    return True


def add_preamble(source: str) -> str:
    """`source` with exactly one, current preamble before its first statement.

    "First statement" skips the module docstring and ``from __future__`` imports, which Python
    requires to come first; the shebang and comments above stay where they are.
    """
    lines = _strip_preamble(source).splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    insert_at = _first_statement_line(ast.parse("".join(lines)))
    return "".join(lines[: insert_at - 1]) + _PREAMBLE + "".join(lines[insert_at - 1:])


def _strip_preamble(source: str) -> str:
    begin = source.find(_BEGIN)
    if begin < 0:
        return source
    end = source.index(_END, begin) + len(_END)  # ValueError: a hand-edited, broken preamble
    return source[:begin] + source[end:].removeprefix("\n")


def _first_statement_line(module: ast.Module) -> int:
    """1-based line to insert before; one past the end when the module has nothing else."""
    for i, node in enumerate(module.body):
        is_docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(
            getattr(node, "value", None), ast.Constant) and isinstance(node.value.value, str)
        is_future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        if not (is_docstring or is_future):
            return node.lineno
    last = module.body[-1].end_lineno if module.body else 0
    return (last or 0) + 1


__all__ = [
    "TorchLoadOfShardError",
    "refuse_torch_load",
    "patch_torch_load",
    "load_for_deepspeed",
    "wrap_recovery_script",
    "add_preamble",
]
