"""Living next to tools that call `torch.load` on checkpoint files.

DeepSpeed copies `zero_to_fp32.py` into every save directory, and `ds_to_universal` and many
user scripts `torch.load` the shard files directly. Our shard files are not torch files, so
three things make that meet a clear message or a working conversion instead of a traceback:

1. Every shard file starts with a small pickle (the "guard") that calls `refuse_torch_load`.
   `torch.load(path, weights_only=False)`, which DeepSpeed's scripts use, unpickles it first and
   gets `TorchLoadOfShardError`, naming the two ways out. Under torch's default
   ``weights_only=True`` torch refuses the guard's global itself, and its message names
   ``nvcomp_ckpt_engine.compat.refuse_torch_load``.
2. `patch_torch_load()` makes `torch.load` read our shard files through the engine, for the
   lifetime of a ``with`` block: in a tag folder of ours only the files its manifest lists,
   checked against it; any other file is refused unread unless ``trusted=True`` (the real
   `torch.load` would run whatever code it names).
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

from . import api, discovery, fileio, opened
from .deepspeed import allowlist as _ds_allowlist  # noqa: F401  (registers DeepSpeed's objects)
from .errors import UnsafeObjectError, UnsupportedCheckpointError
from .fileio import atomic_write_bytes

logger = logging.getLogger(__name__)

#: How to get at a shard's contents, in every message that meets a user holding one.
WAYS_OUT = (
    "Load it with nvcomp_ckpt_engine.load(path), or write a plain DeepSpeed checkpoint with "
    "`nvcomp-ckpt decompress CKPT_DIR OUT_DIR` (CKPT_DIR: the save directory or one tag "
    "folder); `nvcomp-ckpt zero-to-fp32 CKPT_DIR OUT_DIR` runs DeepSpeed's zero_to_fp32 on it "
    "directly."
)

#: What a refusal of `patch_torch_load` says to do.
_TRUST_HINT = (
    "If you trust the checkpoint, run `nvcomp-ckpt zero-to-fp32 --trusted CKPT_DIR OUT_DIR`, "
    "which lets torch.load read it as DeepSpeed's own scripts do."
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
def patch_torch_load(*, trusted: bool = False,
                     root: str | os.PathLike | None = None) -> Iterator[None]:
    """Within the block, `torch.load` of a path reads checked engine shards, and nothing else.

    A path inside a tag folder the engine made (`discovery.enclosing_tag_folder`) is read only if
    the folder's manifest lists it, at a real path inside the folder, with the size and CRC-32
    the manifest records (`opened.OpenedCheckpoint.load`); the skeleton is read through the
    allowlist. A shard file elsewhere is read by `nvcomp_ckpt_engine.load` (checksums, the
    allowlist; a module copied out of its checkpoint, as DeepSpeed's ``ds_to_universal`` copies
    one, rebuilt from that checkpoint: `opened.load_lone_shard`). Anything else -- an unlisted
    file planted in a tag folder, a listed name replaced by a link out of it, a plain torch
    file, a path outside `root` (where DeepSpeed's ``latest`` names ``../elsewhere``) -- would
    reach the real ``torch.load(weights_only=False)``, which runs whatever code the file names:
    it is refused unread with `UnsafeObjectError` naming the file. ``trusted=True`` restores the
    old way for files you trust: shards read with any class allowed, every other file by the
    real `torch.load`. The caller's ``weights_only`` and ``mmap`` are ignored for shard files;
    file objects and buffers, which no checkpoint folder names, go to the real `torch.load`
    untouched.

    This replaces the process-wide ``torch.load`` attribute: blocks nest (each restores what it
    found), but another thread calling `torch.load` meanwhile is patched too.
    """
    real_load = torch.load
    tags: dict[Path, opened.OpenedCheckpoint] = {}

    @functools.wraps(real_load)
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(f, (str, os.PathLike)):
            return real_load(f, map_location, *args, **kwargs)
        if trusted:
            if api.is_shard_file(f):
                return api.load(f, map_location=map_location, trusted=True)
            return real_load(f, map_location, *args, **kwargs)
        return _checked_load(f, map_location, root, tags)

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


def load_with_shards(real_load: Callable[..., Any], f: str | os.PathLike, map_location: Any = None,
                       *args: Any, **kwargs: Any) -> Any:
    """`torch.load` as a process that imported DeepSpeed sees it with the package installed.

    The import hook (`_nvcomp_ckpt_engine_hook.shim_torch_load`) sends here the calls on a path
    that DeepSpeed's modules make, and any call on one of our shard files. A path inside a tag
    folder the engine made is read as `patch_torch_load` reads it: only a file the manifest
    lists, at a real path inside the folder, with its recorded size and CRC-32, through the
    allowlist; anything else there is refused unread (`UnsafeObjectError`). A shard elsewhere is
    read by `nvcomp_ckpt_engine.load` (checksums, the allowlist; `opened.load_lone_shard`),
    whatever ``weights_only`` the caller passed. Every other file -- DeepSpeed's own plain
    checkpoints, where the engine was never on -- goes to `real_load` exactly as it was called:
    the hook changes nothing for them.
    """
    where = Path(os.path.abspath(f))
    if discovery.enclosing_tag_folder(where) is not None or api.is_shard_file(where):
        logger.debug("DeepSpeed's torch.load(%s): reading an nvcomp_ckpt_engine file", where)
        return _checked_load(where, map_location, None, {})
    return real_load(f, map_location, *args, **kwargs)


def _checked_load(f: str | os.PathLike, map_location: Any, root: str | os.PathLike | None,
                  tags: dict[Path, opened.OpenedCheckpoint]) -> Any:
    """`patch_torch_load`'s read of path `f` without ``trusted`` (`tags`: the tag folders
    opened so far, each manifest read once)."""
    where = Path(os.path.abspath(f))
    if root is not None and not fileio.is_inside(where, root):
        raise UnsafeObjectError(
            f"{where}: outside the checkpoint {root} (resolves to {os.path.realpath(where)}); "
            f"refused unread. {_TRUST_HINT}")
    tag_dir = discovery.enclosing_tag_folder(where)
    if tag_dir is None:
        if api.is_shard_file(where):
            logger.debug("torch.load(%s): reading an nvcomp_ckpt_engine shard", where)
            return opened.load_lone_shard(where, map_location)
        raise UnsafeObjectError(
            f"{where}: not a file of an nvcomp_ckpt_engine checkpoint (no manifest lists it), so "
            f"torch.load would run whatever code it names; refused unread. {_TRUST_HINT}")
    if tag_dir not in tags:
        tags[tag_dir] = opened.open_tag_dir(tag_dir)
    checkpoint = tags[tag_dir]
    relative = where.relative_to(tag_dir).as_posix()
    if not checkpoint.records(relative):
        raise UnsafeObjectError(
            f"{where}: not listed in the manifest of {tag_dir}, so not part of that checkpoint "
            f"(a file placed there later); refused unread. {_TRUST_HINT}")
    logger.debug("torch.load(%s): reading a listed nvcomp_ckpt_engine shard", where)
    return checkpoint.load(relative, map_location)


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
    "load_with_shards",
    "wrap_recovery_script",
    "add_preamble",
]
