"""`nvcomp-ckpt`: look into, check, convert and price engine checkpoints from a shell.

Every command takes the places DeepSpeed users already know: a shard file, a tag folder
(``global_step100/``) or a save directory (the one holding ``latest``). `inspect` and `verify`
read only headers, indexes and checksummed bytes -- never a full restore -- so they are cheap and
need no GPU. `decompress` and `compress` convert between engine checkpoints and plain
`torch.save` checkpoints that DeepSpeed's own tools (``zero_to_fp32``, ``ds_to_universal``)
read; `to-universal` writes what ``ds_to_universal`` would, compressed, straight from the
shards (deepspeed/universal.py). `cost` turns measured figures into hours and dollars
(costmodel.py).

Adding a subcommand: write ``add_NAME(subparsers)`` that creates its parser and sets
``func=`` to a function ``(argparse.Namespace) -> int`` (the exit status), and list it in
`COMMANDS`. `main` turns `CheckpointError`, `OSError` and `ValueError` into a one-line message
and exit status 1, and `UsageError` into exit status 2 (what argparse uses).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import os
import pickle
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
from tqdm import tqdm

from . import commit, costmodel, discovery, manifest
from ._version import __version__
from .api import is_shard_file, save
from .codecs import ALGORITHMS
from .compat import patch_torch_load, wrap_recovery_script
from .container import is_torch_file, read_index, verify_file
from .describe import describe_index
from .errors import CheckpointError, IncompleteCheckpointError
from .manifest import RESERVED_MARK
from .options import DEFAULT_CHUNK_MB
from .pipeline import ShardInfo
from .siblings import SiblingSources
from .storage import PARTIAL_SUFFIX, fsync_dir, is_inside, staged_directory
from .opened import record_file
from .tagreader import TagReader

logger = logging.getLogger(__name__)

#: DeepSpeed's pointer to the newest tag, in a save directory.
LATEST = discovery.LATEST_NAME
#: Default figures for `cost` when nothing measured is given: nvCOMP ANS (float modes, 1 MiB
#: chunks) on DeepSpeed bf16 training state (14 bytes/param), measured on one H200.
DEFAULT_RATIO = 1.22
DEFAULT_COMPRESS_GBPS = 100.0
#: NVIDIA's example: a 70B model's checkpoint (GB) written at this storage bandwidth (GB/s).
DEFAULT_CHECKPOINT_GB = 782.0
DEFAULT_WRITE_GBPS = 5.0

_SubParsers = Any  # argparse's _SubParsersAction is private
T = TypeVar("T")


class UsageError(Exception):
    """A request the CLI refuses before touching anything (exit status 2)."""


# ---------------------------------------------------------------------------------------------
# Where a PATH argument points


@dataclass(frozen=True)
class Target:
    """What an `inspect` / `verify` PATH names: one shard file, or one tag folder."""

    path: Path
    tag: str | None = None

    @property
    def is_file(self) -> bool:
        return self.path.is_file()


def _read_latest(save_dir: Path) -> str:
    """The tag `latest` names; a clear error when it is missing, empty or names no folder."""
    pointer = discovery.inspect_latest(save_dir)
    if pointer.tag is None:
        tags = ", ".join(d.name for d in _tag_dirs(save_dir))
        if not tags and _plain_torch_files(save_dir):
            raise _no_shards_error(save_dir)
        raise UsageError(f"{pointer.reason}; pass --tag TAG (tag folders here: {tags or 'none'})")
    return pointer.tag


def _plain_torch_files(folder: Path) -> list[Path]:
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and is_torch_file(p)]


def _no_shards_error(folder: Path, checkpoint: Path | None = None) -> CheckpointError:
    """The error for a folder without engine shards, naming `compress` where it holds torch files
    (a plain DeepSpeed checkpoint, for instance); `checkpoint` is the path to convert, when it
    is not `folder` itself (the save directory of a tag folder)."""
    plain = _plain_torch_files(folder)
    hint = ""
    if plain:
        names = ", ".join(p.relative_to(folder).as_posix() for p in plain[:3])
        more = ", ..." if len(plain) > 3 else ""
        hint = (f"; its {len(plain)} plain torch.save file(s) ({names}{more}) are read with "
                f"torch.load, and `nvcomp-ckpt compress {checkpoint or folder} OUT_DIR` converts "
                "them into engine shards")
    return CheckpointError(f"{folder} holds no nvcomp_ckpt_engine shard files{hint}")


def resolve_target(path: str | os.PathLike, tag: str | None) -> Target:
    """A shard file, a tag folder, or the tag of a save directory (`tag`, else ``latest``)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_file() or discovery.is_engine_tag(path):
        if tag is not None:
            raise UsageError(f"--tag applies to a save directory; {path} is a file or tag folder")
        return Target(path, path.name if path.is_dir() else None)
    tag = tag if tag is not None else _read_latest(path)
    tag_dir = path / tag
    if not tag_dir.is_dir():
        raise UsageError(f"{path}: tag folder {tag!r} does not exist")
    return Target(tag_dir, tag)


def _tag_dirs(save_dir: Path) -> list[Path]:
    """The tag folders of a save directory, by name."""
    return sorted(d for d in save_dir.iterdir() if d.is_dir() and discovery.is_engine_tag(d))


def _shard_files(tag_dir: Path) -> list[Path]:
    """Every shard file under a tag folder (recursively, in name order), staged ones aside."""
    return sorted(p for p in tag_dir.rglob("*")
                  if p.is_file() and RESERVED_MARK not in p.name and is_shard_file(p))


# ---------------------------------------------------------------------------------------------
# inspect


def describe_shard(path: Path, name: str) -> dict[str, Any]:
    """One shard's metadata from its index alone: per-file, per-storage and per-tensor figures."""
    return describe_index(read_index(path), name)


def _totals(files: list[dict[str, Any]]) -> dict[str, Any]:
    files = [f for f in files if "error" not in f]
    raw = sum(f["raw_bytes"] for f in files)
    on_disk = sum(f["file_bytes"] for f in files)
    return {
        "files": len(files),
        "tensors": sum(len(f["tensors"]) for f in files),
        "raw_bytes": raw,
        "tensor_raw_bytes": sum(f["tensor_raw_bytes"] for f in files),
        "stored_bytes": sum(f["stored_bytes"] for f in files),
        "overhead_bytes": sum(f["overhead_bytes"] for f in files),
        "file_bytes": on_disk,
        "ratio": raw / on_disk if on_disk else 1.0,
    }


@dataclass(frozen=True)
class TagFiles:
    """A tag folder's shard files: the manifest's records, or a scan where it has none."""

    files: tuple[tuple[str, Path], ...]  # (path relative to the tag folder, file to read)
    manifest: manifest.Manifest | None
    manifest_error: str | None


def tag_files(tag_dir: Path) -> TagFiles:
    """The shards that make up a tag; the manifest decides when it can be read."""
    try:
        found = manifest.read_manifest(tag_dir)
    except CheckpointError as exc:
        scanned = tuple((p.relative_to(tag_dir).as_posix(), p) for p in _shard_files(tag_dir))
        return TagFiles(scanned, None, str(exc))
    listed = {r.path: record_file(tag_dir, found, r) for r in found.files}  # one per path
    return TagFiles(tuple(sorted(listed.items())), found, None)


def _target_files(target: Target) -> TagFiles:
    if target.is_file:
        return TagFiles(((str(target.path), target.path),), None, None)
    return tag_files(target.path)


def _describe_or_error(name: str, path: Path) -> dict[str, Any]:
    try:
        return describe_shard(path, name)
    except (CheckpointError, OSError) as exc:
        return {"path": name, "error": str(exc)}


def _manifest_summary(found: manifest.Manifest) -> dict[str, Any]:
    return {"tag": found.tag, "step": found.step, "world_size": found.world_size,
            "layout": dict(found.layout), "versions": dict(found.versions),
            "files": len(found.files), "raw_bytes": found.raw_bytes,
            "file_bytes": found.file_bytes}


def inspect_target(target: Target) -> dict[str, Any]:
    """The JSON document `inspect --json` prints; a file that cannot be read gets an "error"."""
    found = _target_files(target)
    files = [_describe_or_error(name, path) for name, path in found.files]
    return {
        "path": str(target.path),
        "tag": target.tag,
        "manifest": None if found.manifest is None else _manifest_summary(found.manifest),
        "manifest_error": found.manifest_error,
        "files": files,
        "totals": _totals(files),
    }


def _size(n: float) -> str:
    """Bytes in binary units, as `ls -h` and `du -h` show them."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"


def _codec_name(descriptor: dict[str, Any]) -> str:
    options = descriptor.get("options") or {}
    mode = options.get("data_type")
    return f"{descriptor['name']}/{descriptor.get('version', '?')}" + (f"({mode})" if mode else "")


def _print_inspection(doc: dict[str, Any], *, tensors: bool) -> None:
    print(doc["path"] + (f"  (tag {doc['tag']})" if doc["tag"] else ""))
    if doc["manifest"] is not None:
        m = doc["manifest"]
        print(f"  manifest: {m['files']} files, world size {m['world_size']}, "
              f"layout {json.dumps(m['layout'], sort_keys=True)}")
    elif doc["manifest_error"] is not None:
        print(f"  manifest: NONE USABLE: {doc['manifest_error']}")
    for f in doc["files"]:
        if "error" in f:
            print(f"  {f['path']}: ERROR: {f['error']}")
            continue
        derived = (f", {_size(f['derived_bytes'])} derived from {len(f['derived_from'])} other "
                   "file(s)" if f["derived_bytes"] else "")
        print(f"  {f['path']}: {len(f['tensors'])} tensors, raw {_size(f['raw_bytes'])}, "
              f"file {_size(f['file_bytes'])}, ratio {f['ratio']:.3f}x, "
              f"codecs {','.join(f['codecs']) or '-'}, format v{f['format_version']}{derived}")
        _print_overhead_note(f, "    ", "file")
        if tensors:
            _print_tensor_rows(f)
    t = doc["totals"]
    print(f"total: {t['files']} files, {t['tensors']} tensors, raw {_size(t['raw_bytes'])}, "
          f"on disk {_size(t['file_bytes'])}, ratio {t['ratio']:.3f}x")
    _print_overhead_note(t, "  ", "checkpoint")


def _print_overhead_note(figures: dict[str, Any], indent: str, what: str) -> None:
    """Why a ratio is below 1: fixed per-file bytes dominate the file.

    Every shard carries a 4 KiB header, its index and a trailer; a file with little data (a
    ZeRO-3 model-states file holds no parameters) is mostly those, so its ratio drops below 1.
    """
    size = figures["file_bytes"]
    if figures["raw_bytes"] >= size or 2 * figures["overhead_bytes"] <= size:
        return
    tensors = figures["tensor_raw_bytes"]
    data = (f"its tensors alone: {_size(tensors)} -> {_size(figures['stored_bytes'])} "
            f"({tensors / figures['stored_bytes']:.3f}x)" if figures["stored_bytes"]
            else "it holds no tensor data")
    print(f"{indent}note: {_size(figures['overhead_bytes'])} of this {_size(size)} {what} is "
          "fixed per-file overhead (header, index, trailer), so the ratio reflects its small "
          f"size, not the codec; {data}")


def _print_tensor_rows(f: dict[str, Any]) -> None:
    """One row per tensor; a storage that several tensors view (ZeRO's flat buffers), or that
    one tensor views only part of, gets its own row once, its tensors indented below it."""
    storages, rows = f["storages"], {r["key"]: r for r in f["tensors"]}
    shown: set[int] = set()
    for r in f["tensors"]:
        s = storages[r["storage"]]
        if len(s["tensors"]) == 1 and r["nbytes"] == s["raw_bytes"]:
            print(f"    {_tensor_text(r)}  {_storage_text(s)}")
        elif r["storage"] not in shown:
            shown.add(r["storage"])
            print(f"    storage {r['storage']}, viewed by {len(s['tensors'])} tensor(s): "
                  f"{_storage_text(s)}")
            for key in s["tensors"]:
                print(f"      {_tensor_text(rows[key])}  {_size(rows[key]['nbytes'])}")


def _tensor_text(row: dict[str, Any]) -> str:
    shape = "x".join(map(str, row["shape"])) or "scalar"
    return f"{row['key']}  {row['dtype']}[{shape}]"


def _storage_text(storage: dict[str, Any]) -> str:
    derived = (f", {_size(storage['derived_bytes'])} derived from "
               f"{', '.join(storage['derived_from'])}" if storage["derived_bytes"] else "")
    return (f"{_codec_name(storage['codec'])}  {storage['transform'].get('name', '-')}  "
            f"{_size(storage['raw_bytes'])} -> {_size(storage['stored_bytes'])} "
            f"({storage['ratio']:.3f}x{derived})")


def _dcp_folder(path: str | os.PathLike) -> Path | None:
    """`path` if it is a torch.distributed.checkpoint folder written by our DCP writer.

    Checked before anything else: our DCP rank files carry the shard magic, so a DCP folder
    would otherwise look like a DeepSpeed tag folder.
    """
    from . import dcp

    return Path(path) if dcp.is_dcp_checkpoint(path) else None


def cmd_inspect(args: argparse.Namespace) -> int:
    folder = _dcp_folder(args.path)
    if folder is not None:
        from . import dcp

        files = dcp.inspect_dcp(folder)
        doc = {"path": str(folder), "tag": None, "kind": "dcp", "manifest": None,
               "manifest_error": None, "files": files,
               "totals": _totals(files)}
    else:
        target = resolve_target(args.path, args.tag)
        doc = inspect_target(target)
        if not doc["files"]:
            raise _no_shards_error(target.path, Path(args.path))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_inspection(doc, tensors=not args.files_only)
    return 1 if any("error" in f for f in doc["files"]) else 0


def add_inspect(sub: _SubParsers) -> None:
    p = sub.add_parser("inspect", help="codecs, sizes and ratios of a shard, tag or save dir",
                       description="Show per-file and per-tensor codec, transform, raw and "
                       "stored sizes from the shard indexes (no tensor is decoded).")
    p.add_argument("path", help="a shard file, a tag folder, or a save directory")
    p.add_argument("--tag", help="in a save directory: the tag to show (default: 'latest')")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--files-only", action="store_true", help="leave out the per-tensor rows")
    p.set_defaults(func=cmd_inspect)


# ---------------------------------------------------------------------------------------------
# verify


def verify_target(target: Target, *, progress: bool) -> list[str]:
    """Every fault found, one per damaged file: the manifest (completeness, sizes, CRC), every
    chunk checksum, and for a file with derived storages that each source it names is there and
    holds the elements.

    Keeps going after a fault so one run names every damaged file; returns the messages. A file
    whose CRC differs from the manifest is read, and its damaged chunk named when the chunk
    checksums find it; a file of the wrong size, outside the folder or not a regular file is
    reported as the manifest check found it. With node-local storage (the manifest says so)
    only the files this host can see are checked.
    """
    found = _target_files(target)
    faults = [] if found.manifest_error is None else [found.manifest_error]
    problems: dict[str, manifest.FileProblem] = {}
    if found.manifest is not None:
        _, listed = manifest.check_files(target.path, found.manifest,
                                         local_only=found.manifest.node_local_storage)
        problems = {problem.record.path: problem for problem in listed}
    files = dict(found.files)
    for name, path in _progress(list(found.files), progress, "verifying"):
        problem = problems.get(name)
        if problem is not None and problem.kind != "crc":
            faults.append(problem.message)
        elif problem is not None or found.manifest is None or path.exists():
            # (a listed file that does not exist here, unreported: another node's)
            fault = _file_fault(path, sibling_paths(files, name))
            if fault is not None or problem is not None:
                faults.append(fault or problem.message)
    return faults


def _file_fault(path: Path, siblings: dict[str, Path]) -> str | None:
    """What `verify_file` finds wrong with one shard, or None; a shard with derived storages
    also needs each source it names (`siblings`: the files beside it, by name) to hold them."""
    try:
        index = verify_file(path)
        if index.derived_files:
            SiblingSources(path.parent, files=siblings, verify=False).check(index)
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: cannot be read ({exc})"
    return None


def _progress(items: Sequence[T], enabled: bool, what: str) -> Iterable[T]:
    """Wrap `items` in a progress bar on stderr (stdout stays the command's output)."""
    if not enabled or not items:
        return items
    return tqdm(items, desc=what, unit="file", file=sys.stderr, leave=False)


def cmd_verify(args: argparse.Namespace) -> int:
    folder = _dcp_folder(args.path)
    if folder is not None:
        from . import dcp

        return _report_faults(folder, [str(fault) for fault in dcp.dcp_faults(folder)])
    target = resolve_target(args.path, args.tag)
    return _report_faults(target.path, verify_target(target, progress=not args.quiet))


def _report_faults(path: Path, faults: list[str]) -> int:
    """One FAULT line per fault and a summary; the exit status: 1 on any fault."""
    for fault in faults:
        print(f"FAULT: {fault}")
    if faults:
        print(f"{path}: {len(faults)} fault(s) found")
        return 1
    print(f"{path}: OK")
    return 0


def add_verify(sub: _SubParsers) -> None:
    p = sub.add_parser("verify", help="check every checksum and the manifest (no GPU needed)",
                       description="Check the manifest (every file present, sizes, CRC-32) and "
                       "every chunk checksum of every shard, without decoding. Exit status 1 "
                       "and one line per fault, naming the file, tensor and chunk.")
    p.add_argument("path", help="a shard file, a tag folder, or a save directory")
    p.add_argument("--tag", help="in a save directory: the tag to check (default: 'latest')")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)


# ---------------------------------------------------------------------------------------------
# decompress and compress share the walk over a checkpoint


@dataclass(frozen=True)
class Conversion:
    """What to convert: tag folders (each written to OUT/<name>), top-level files, `latest`.

    `every_tag` is true when the user asked for a whole save directory: an incomplete tag is then
    skipped with a warning instead of failing the command.
    """

    tags: tuple[Path, ...]
    top_files: tuple[Path, ...]
    latest: str | None
    every_tag: bool


def plan_conversion(src: Path, tag: str | None, is_tag_dir: Callable[[Path], bool]) -> Conversion:
    """A save directory (all tags, or `tag`) or a single tag folder, as a `Conversion`.

    A directory whose subfolders hold checkpoint files is a save directory even if it holds
    some itself (a Hugging Face checkpoint folder keeps rng_state_*.pth next to global_stepN/).
    """
    if not src.is_dir():
        raise UsageError(f"{src} is not a directory")
    tags = sorted(d for d in src.iterdir() if d.is_dir() and is_tag_dir(d))
    if not tags and is_tag_dir(src):
        if tag is not None:
            raise UsageError(f"--tag applies to a save directory; {src} is a tag folder")
        return Conversion((src,), (), src.name, every_tag=False)
    if tag is not None:
        tags = [d for d in tags if d.name == tag]
        if not tags:
            raise CheckpointError(f"{src}: no tag folder {tag!r} with checkpoint files")
    if not tags:
        raise CheckpointError(f"{src}: no tag folders with checkpoint files")
    if tag is None:  # with --tag, every other folder was left out on purpose
        for other in sorted(d for d in src.iterdir() if d.is_dir() and d not in tags):
            logger.warning("%s: not a tag folder of this checkpoint; not converted", other)
    top_files = tuple(p for p in sorted(src.iterdir())
                      if p.is_file() and p.name != LATEST and not discovery.is_engine_file(p)
                      and _inside(p, src))
    latest = tag if tag is not None else _latest_if_present(src, {d.name for d in tags})
    return Conversion(tuple(tags), top_files, latest, every_tag=tag is None)


def _latest_if_present(src: Path, tags: set[str]) -> str | None:
    latest = discovery.inspect_latest(src).tag
    return latest if latest in tags else None


def check_output_dir(src: Path, out: Path, plan: Conversion) -> None:
    """Refuse an output that overlaps the checkpoint, or is not empty.

    For a single tag folder in a save directory (one with `latest`), the checkpoint is the whole
    save directory: a converted copy inside it would sit among the tags.
    """
    in_save_dir = plan.tags == (src,) and (src.parent / LATEST).is_file()
    protected = src.parent if in_save_dir else src
    src_r, out_r = protected.resolve(), out.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        raise UsageError(f"refusing to write {out} into or around the checkpoint {protected}; "
                         "choose an output directory outside it")
    _check_empty_output(out)


def _check_empty_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory")


def _copy_file(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)


def _inside(path: Path, root: Path) -> bool:
    """Whether `path` lies inside `root` with its links resolved. A conversion never follows a
    link out of the checkpoint (it would copy whatever the link names into the output): such a
    file is left out, with a warning."""
    if is_inside(path, root):
        return True
    logger.warning("%s: a link to %s, outside %s; left out", path, os.path.realpath(path), root)
    return False


def _other_files(tag_dir: Path, skip: Callable[[Path], bool]) -> list[Path]:
    """Regular files under `tag_dir` to copy as they are: neither converted nor the engine's,
    nor links out of the tag folder."""
    return sorted(p for p in tag_dir.rglob("*")
                  if p.is_file() and not discovery.is_engine_file(p) and _inside(p, tag_dir) and not skip(p))


def _torch_save_atomically(obj: Any, dest: Path) -> None:
    """torch.save under a temporary name, fsync, rename: a crash never leaves a torn file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}{PARTIAL_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dest.parent)


# ---------------------------------------------------------------------------------------------
# decompress


def decompress_tag(tag_dir: Path, out_tag: Path, *, trusted: bool, progress: bool) -> int:
    """Write every shard of a complete tag as a torch.save file; copy the other files.

    The manifest decides what the checkpoint is: all its files must be present with the right
    sizes before anything is written (each chunk's checksum is then checked as it is loaded).
    A shard file the manifest does not list is left out, with a warning. Returns the number of
    shard files converted.
    """
    reader = TagReader(tag_dir, trusted=trusted)
    shards = {rel: reader.path(rel) for rel in reader.paths}
    for rel in _progress(reader.paths, progress, f"decompressing {tag_dir.name}"):
        _torch_save_atomically(reader.load(rel), out_tag / rel)

    def listed_or_stray_shard(path: Path) -> bool:
        if path.relative_to(tag_dir).as_posix() in shards:
            return True
        if is_shard_file(path):
            logger.warning("%s: a shard the manifest does not list (from another save?); "
                           "left out", path)
            return True
        return False

    for path in _other_files(tag_dir, listed_or_stray_shard):
        _copy_file(path, out_tag / path.relative_to(tag_dir))
    return len(shards)


def sibling_paths(files: dict[str, Path], relative: str) -> dict[str, Path]:
    """The files beside `relative` in a tag, by name, as `load`'s ``sources``: where a derived
    storage's source lives (its staged name while a re-save's renames are pending)."""
    folder = Path(relative).parent
    return {Path(rel).name: path for rel, path in files.items() if Path(rel).parent == folder}


def cmd_decompress(args: argparse.Namespace) -> int:
    src, out = Path(args.ckpt_dir), Path(args.out_dir)
    if _dcp_folder(src) is not None:
        from . import dcp

        _check_empty_output(out)
        with staged_directory(out) as staging:
            dcp.decompress_dcp(src, staging, trusted=args.trusted)
        print(f"wrote a plain torch.distributed.checkpoint to {out}")
        return 0
    plan = plan_conversion(src, args.tag, discovery.is_engine_tag)
    check_output_dir(src, out, plan)
    with staged_directory(out) as staging:
        converted, written = _decompress_plan(plan, staging, args)
    print(f"wrote {converted} torch.save files in {len(written)} tag(s) to {out}")
    return 0


def _decompress_plan(plan: Conversion, out: Path,
                     args: argparse.Namespace) -> tuple[int, list[str]]:
    """Write the plan's tags, top-level files and `latest` into `out`; returns the number of
    files converted and the tags written."""
    written, converted = [], 0
    for tag_dir in plan.tags:
        try:
            converted += decompress_tag(tag_dir, out / tag_dir.name, trusted=args.trusted,
                                        progress=not args.quiet)
        except IncompleteCheckpointError as exc:
            if not plan.every_tag:
                raise
            print(f"warning: skipping incomplete tag {tag_dir.name}: {exc}", file=sys.stderr)
            continue
        written.append(tag_dir.name)
    for path in plan.top_files:
        _copy_file(path, out / path.name)
    if plan.latest in written:
        discovery.write_latest(out, plan.latest)
    return converted, written


def add_decompress(sub: _SubParsers) -> None:
    p = sub.add_parser("decompress", help="write a plain DeepSpeed (torch.save) checkpoint",
                       description="Convert an engine checkpoint to plain torch.save files at the "
                       "same relative paths (plus 'latest', without the manifest), which "
                       "DeepSpeed's zero_to_fp32 and ds_to_universal read. A tag folder is "
                       "written to OUT_DIR/<tag>/. Incomplete tags of a save directory are "
                       "skipped with a warning.")
    p.add_argument("ckpt_dir", help="a save directory (all tags, or --tag) or one tag folder")
    p.add_argument("out_dir", help="a new or empty directory outside CKPT_DIR")
    p.add_argument("--tag", help="in a save directory: convert only this tag")
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist); only for files "
                   "you trust")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_decompress)


# ---------------------------------------------------------------------------------------------
# compress


def _is_plain_tag(directory: Path) -> bool:
    return any(p.is_file() and is_torch_file(p) for p in directory.iterdir())


_OPTIM_NAME = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states")
_MODEL_NAME = re.compile(r"^mp_rank_(\d+)_model_states")


def rank_of(name: str, tp_size: int) -> int:
    """The global rank that wrote a DeepSpeed file, from its name where it says; else 0.

    Optimizer shards ``[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`` come from rank
    ``D * tp_size + MM`` (Megatron's order: tensor-parallel ranks adjacent), model states
    ``mp_rank_MM_model_states.pt`` from the first data-parallel rank of model-parallel rank MM.
    Pipeline-parallel layer files and anything else are attributed to rank 0.
    """
    if match := _OPTIM_NAME.search(name):
        return int(match[1]) * tp_size + int(match[2])
    if match := _MODEL_NAME.match(name):
        return int(match[1])
    return 0


def layout_hints(obj: Any) -> dict[str, Any]:
    """What one DeepSpeed file says about the parallel layout it was saved with.

    Model-states files carry the data-, tensor- and pipeline-parallel sizes and the step;
    optimizer files the ZeRO stage. Anything else says nothing.
    """
    if not isinstance(obj, dict):
        return {}
    hints: dict[str, Any] = {}
    if isinstance(obj.get("dp_world_size"), int):
        dims = obj.get("checkpoint_parallel_dimensions") or {}
        hints["dp_size"] = obj["dp_world_size"]
        hints["tp_size"] = int(dims.get("tp_degree", obj.get("mp_world_size", 1)))
        hints["pp_size"] = int(dims.get("pp_degree", 1))
        if isinstance(obj.get("global_steps"), int):
            hints["step"] = obj["global_steps"]
    optim = obj.get("optimizer_state_dict")
    if isinstance(optim, dict) and "zero_stage" in optim:
        hints["zero_stage"] = int(optim["zero_stage"])
    if "ds_version" in obj:
        hints["deepspeed_version"] = str(obj["ds_version"])
    return hints


def _torch_load_input(path: Path, *, trusted: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if "Unsupported" in line),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise CheckpointError(
            f"{path}: torch.load(weights_only=True) refused it ({reason}). DeepSpeed's optimizer "
            "files hold such objects; if you trust the files, run again with --trusted."
        ) from exc


@dataclass(frozen=True)
class CompressedFile:
    """One torch file compressed into a shard: where it is in the tag, and what `save` wrote."""

    rel: str
    info: ShardInfo


def compress_tag(tag_dir: Path, out_tag: Path, *, options: dict[str, Any], trusted: bool,
                 progress: bool) -> tuple[list[CompressedFile], dict[str, Any]]:
    """Compress every torch file of a tag folder and copy the rest.

    Returns the shards written and the layout hints found in them.
    """
    torch_files = [p for p in sorted(tag_dir.rglob("*"))  # links out: left out by _other_files
                   if p.is_file() and is_inside(p, tag_dir) and is_torch_file(p)]
    commit.prepare_tag_dir(out_tag.parent, out_tag.name, rank=0)  # the engine's tag marker
    written, hints = [], {}
    for path in _progress(torch_files, progress, f"compressing {tag_dir.name}"):
        obj = _torch_load_input(path, trusted=trusted)
        hints.update(layout_hints(obj))
        dest = out_tag / path.relative_to(tag_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        info = save(obj, dest, **options)
        written.append(CompressedFile(path.relative_to(tag_dir).as_posix(), info))
    for path in _other_files(tag_dir, skip=lambda p: p in torch_files):
        _copy_file(path, out_tag / path.relative_to(tag_dir))
    return written, hints


def build_tag_manifest(tag: str, files: list[CompressedFile],
                       hints: dict[str, Any]) -> manifest.Manifest:
    """The manifest a single-process save of these files would have had.

    With DeepSpeed's layout hints the layout matches what the DeepSpeed adapter records (so
    the engine loads the result with the same layout checks); without them, the files are
    attributed to rank 0 of a world of one.
    """
    tp = hints.get("tp_size", 1)
    records = [
        manifest.ShardRecord(path=f.rel, rank=rank_of(Path(f.rel).name, tp),
                             raw_bytes=f.info.raw_bytes, file_bytes=f.info.file_bytes,
                             crc32=f.info.crc32, codecs=tuple(f.info.codecs))
        for f in files
    ]
    layout: dict[str, Any] = {"framework": "torch"}
    if "dp_size" in hints:
        layout = {
            "framework": "deepspeed", "node_local_storage": False,
            "world_size": hints["dp_size"] * hints["tp_size"] * hints["pp_size"],
            **{k: hints[k] for k in ("deepspeed_version", "dp_size", "tp_size", "pp_size",
                                     "zero_stage") if k in hints},
        }
    world_size = max([layout.get("world_size", 1)] + [r.rank + 1 for r in records])
    return manifest.build_manifest(
        tag=tag, world_size=world_size, files=records, layout=layout,
        versions={"nvcomp_ckpt_engine": __version__}, step=hints.get("step"),
        created_unix_ns=time.time_ns(),
    )


def cmd_compress(args: argparse.Namespace) -> int:
    src, out = Path(args.src), Path(args.dst)
    plan = plan_conversion(src, args.tag, _is_plain_tag)
    check_output_dir(src, out, plan)
    with staged_directory(out) as staging:
        raw, on_disk = _compress_plan(plan, staging, args)
    ratio = raw / on_disk if on_disk else 1.0
    print(f"wrote {len(plan.tags)} tag(s) to {out}: raw {_size(raw)} -> {_size(on_disk)} "
          f"({ratio:.3f}x)")
    return 0


def _compress_plan(plan: Conversion, out: Path, args: argparse.Namespace) -> tuple[int, int]:
    """Write the plan's tags (shards and manifests), top-level files and `latest` into `out`;
    returns the raw and on-disk bytes of the shards."""
    options = {"algorithm": args.algorithm, "portable": args.portable, "chunk_mb": args.chunk_mb}
    raw = on_disk = 0
    for tag_dir in plan.tags:
        files, hints = compress_tag(tag_dir, out / tag_dir.name, options=options,
                                    trusted=args.trusted, progress=not args.quiet)
        # Written last, once every shard is durable: the tag is complete from here on.
        manifest.write_manifest(out / tag_dir.name, build_tag_manifest(tag_dir.name, files, hints))
        raw += sum(f.info.raw_bytes for f in files)
        on_disk += sum(f.info.file_bytes for f in files)
    for path in plan.top_files:
        _copy_file(path, out / path.name)
    wrap_recovery_script(out)
    if plan.latest is not None:
        discovery.write_latest(out, plan.latest)
    return raw, on_disk


def add_codec_options(p: argparse.ArgumentParser) -> None:
    """--algorithm, --portable and --chunk-mb: how a command that writes shards compresses them."""
    p.add_argument("--algorithm", default="auto", choices=ALGORITHMS,
                   help="codec of the written shards (default: auto, chosen per storage from a "
                   "sample)")
    p.add_argument("--portable", action="store_true",
                   help="only codecs a machine without a GPU can decode (zstd, deflate, none)")
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                   help=f"chunk size in MiB (default {DEFAULT_CHUNK_MB})")


def add_compress(sub: _SubParsers) -> None:
    p = sub.add_parser("compress", help="turn a plain torch.save checkpoint into engine shards",
                       description="Compress every torch.save file of a DeepSpeed checkpoint into "
                       "an engine shard at the same relative path and write each tag's manifest, "
                       "so the result loads through the engine. Other files are copied.")
    p.add_argument("src", help="a plain save directory (all tags, or --tag) or one tag folder")
    p.add_argument("dst", help="a new or empty directory outside SRC")
    p.add_argument("--tag", help="in a save directory: convert only this tag")
    add_codec_options(p)
    p.add_argument("--trusted", action="store_true",
                   help="read inputs with torch.load(weights_only=False): only for files you "
                   "trust (DeepSpeed's optimizer files need it)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_compress)


# ---------------------------------------------------------------------------------------------
# zero-to-fp32


def cmd_zero_to_fp32(args: argparse.Namespace) -> int:
    # Imported here: DeepSpeed takes seconds to import and no other command needs it.
    from deepspeed.utils import zero_to_fp32

    with patch_torch_load(trusted=args.trusted):
        zero_to_fp32.convert_zero_checkpoint_to_state_dict(
            args.ckpt_dir, args.out_dir, dtype=args.dtype,
            max_shard_size=None if args.max_shard_size == "none" else args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    print(f"wrote consolidated {args.dtype} weights to {args.out_dir}")
    return 0


def add_zero_to_fp32(sub: _SubParsers) -> None:
    p = sub.add_parser("zero-to-fp32", help="run DeepSpeed's zero_to_fp32 on an engine checkpoint",
                       description="Consolidate a ZeRO checkpoint into one state dict with "
                       "DeepSpeed's own deepspeed.utils.zero_to_fp32, reading engine shards "
                       "directly (no decompressed copy on disk).")
    p.add_argument("ckpt_dir", help="the save directory (the folder holding the tag folders)")
    p.add_argument("out_dir", help="directory for the consolidated weights")
    p.add_argument("-t", "--tag", help="the tag to convert (default: 'latest')")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "fp32", "float16", "fp16", "bfloat16", "bf16"])
    p.add_argument("--max-shard-size", default="none",
                   help="split the output into files of this size, e.g. 5GB (with "
                   "huggingface_hub, installed with the deepspeed extra); default 'none': one file")
    p.add_argument("--safe-serialization", action="store_true",
                   help="write safetensors (needs safetensors)")
    p.add_argument("--exclude-frozen-parameters", action="store_true")
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist)")
    p.set_defaults(func=cmd_zero_to_fp32)


# ---------------------------------------------------------------------------------------------
# to-universal


#: glibc's `mallopt` parameter: the size from which malloc gives a buffer a mapping of its own.
_M_MMAP_THRESHOLD = -3


def _map_large_buffers() -> None:
    """Give every buffer of 1 MiB or more its own mapping, returned to the OS when freed.

    glibc raises this threshold (up to 32 MiB) whenever such a buffer is freed, and from then on
    chunk-sized buffers come from per-thread heaps that keep what is freed: a conversion's
    resident memory grew to 3.4 times what it held at once (16 MiB chunks, measured). A fixed
    threshold keeps it at what is live. Where glibc is not the allocator, nothing changes.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here: the allocator keeps its own policy")


def cmd_to_universal(args: argparse.Namespace) -> int:
    # Imported here: DeepSpeed takes seconds to import and most commands do not need it.
    from .deepspeed import universal

    _map_large_buffers()

    src, out = Path(args.ckpt_dir), Path(args.out_dir)
    target = resolve_target(src, args.tag)
    if target.is_file:
        raise UsageError(f"{src} is a file; give a save directory or a tag folder")
    check_output_dir(src, out, Conversion((target.path,), (), target.tag, every_tag=False))
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")

    def progress(items: Iterable[T], total: int) -> Iterable[T]:
        if args.quiet:
            return items
        return tqdm(items, total=total, desc=f"to-universal {target.path.name}", unit="param",
                    file=sys.stderr, leave=False)

    with staged_directory(out) as staging:
        done = universal.convert(target.path, staging, trusted=args.trusted,
                                 workers=args.workers, algorithm=args.algorithm,
                                 portable=args.portable, chunk_mb=args.chunk_mb, progress=progress)
    found = done.manifest
    ratio = found.raw_bytes / found.file_bytes if found.file_bytes else 1.0
    print(f"wrote the universal checkpoint {out / found.tag} (ZeRO-{done.zero_stage}, saved at "
          f"data-parallel size {done.dp_size}; {done.parameters} parameters, {len(found.files)} "
          f"files, raw {_size(found.raw_bytes)} -> {_size(found.file_bytes)}, {ratio:.3f}x) and "
          f"{out / universal.LATEST_UNIVERSAL}")
    print('resume at any data-parallel size with "checkpoint": {"load_universal": true} in '
          f"ds_config and engine.load_checkpoint({str(out)!r})")
    return 0


def add_to_universal(sub: _SubParsers) -> None:
    p = sub.add_parser("to-universal", help="write DeepSpeed's universal checkpoint, compressed",
                       description="Write the DeepSpeed universal checkpoint of a ZeRO checkpoint "
                       "(what deepspeed.checkpoint.ds_to_universal writes, file for file) straight "
                       "from the engine's shards, itself compressed and with a manifest, so a job "
                       'can resume at another data-parallel size with "checkpoint": '
                       '{"load_universal": true}. No decompressed copy is written; memory stays '
                       "bounded by a few parameters and the model-states file.")
    p.add_argument("ckpt_dir", help="a save directory (its 'latest', or --tag) or one tag folder")
    p.add_argument("out_dir", help="a new or empty directory outside CKPT_DIR: gets OUT_DIR/<tag>/ "
                   "and OUT_DIR/latest_universal")
    p.add_argument("--tag", help="in a save directory: the tag to convert (default: 'latest')")
    p.add_argument("--workers", type=int, default=4,
                   help="parameters converted at once (default 4; each holds up to twice its "
                   "fp32 size in memory)")
    add_codec_options(p)
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist); only for files "
                   "you trust")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_to_universal)


# ---------------------------------------------------------------------------------------------
# cost


@dataclass(frozen=True)
class MeasuredCheckpoint:
    """What `cost --from` reads from a real checkpoint, and how to say where it came from."""

    raw_bytes: int
    ratio: float
    size_source: str


def measure_checkpoint(path: Path, tag: str | None) -> MeasuredCheckpoint:
    """A real checkpoint's raw size and ratio (raw / on-disk bytes), from its indexes.

    The size is the manifest's: the raw bytes of every rank's files (all `world_size` ranks,
    also where this host sees only its own). Without a manifest (one shard file, or a folder
    without one) it is the raw bytes of the shard files read, and the source says so.
    """
    doc = inspect_target(resolve_target(path, tag))
    totals = doc["totals"]
    if not totals["files"]:
        raise CheckpointError(f"{path}: no readable shard files to measure a ratio from")
    found = doc["manifest"]
    if found is not None:
        raw = found["raw_bytes"]
        what = f"raw bytes of the files of all {found['world_size']} rank(s)"
    else:
        raw = totals["raw_bytes"]
        what = f"raw bytes of the {totals['files']} shard file(s) read; no manifest names others"
    return MeasuredCheckpoint(raw, totals["ratio"], f"measured in {path}: {what}")


def cost_inputs(args: argparse.Namespace) -> tuple[costmodel.CostInputs, dict[str, str]]:
    """The model's inputs and where each figure came from (given > measured > default)."""
    figures: dict[str, tuple[float | None, str]] = {
        "checkpoint_gb": (DEFAULT_CHECKPOINT_GB, "default"),
        "write_gbps": (DEFAULT_WRITE_GBPS, "default"),
        "ratio": (DEFAULT_RATIO, "default (nvCOMP ANS, H200)"),
        "compress_gbps": (DEFAULT_COMPRESS_GBPS, "default (nvCOMP ANS, H200)"),
    }
    if args.from_dir:
        measured = measure_checkpoint(Path(args.from_dir), args.tag)
        figures["checkpoint_gb"] = (measured.raw_bytes / costmodel.GB, measured.size_source)
        figures["ratio"] = (measured.ratio, f"measured in {args.from_dir}")
    if args.from_bench:
        bench = costmodel.read_bench_json(args.from_bench)
        for name in ("ratio", "compress_gbps", "write_gbps"):
            value = getattr(bench, name)
            if value is not None:
                note = bench.notes.get(name)
                figures[name] = (value, f"from {args.from_bench}" + (f" ({note})" if note else ""))
    for name in figures:
        given = getattr(args, name)
        if given is not None:
            figures[name] = (given, "given")
    inputs = costmodel.CostInputs(
        **{name: value for name, (value, _) in figures.items()},
        interval_min=args.interval_min, gpus=args.gpus, gpu_hour_usd=args.gpu_hour_usd,
        keep=args.keep, storage_usd_per_gb_month=args.storage_usd_per_gb_month,
        copy_gbps=args.copy_gbps, days_per_month=args.days, module_gb=args.module_gb,
        rank_write_gbps=args.rank_write_gbps,
    )
    return inputs, {name: source for name, (_, source) in figures.items()}


def _print_cost(report: costmodel.CostReport, sources: dict[str, str]) -> None:
    i = report.inputs
    print(f"checkpoint {i.checkpoint_gb:,.1f} GB [{sources['checkpoint_gb']}], storage "
          f"{i.write_gbps:.1f} GB/s [{sources['write_gbps']}], every {i.interval_min:g} min "
          f"({report.checkpoints_per_month:,.0f}/month), {i.gpus} GPUs at "
          f"${i.gpu_hour_usd:.2f}/GPU-hour, keep {i.keep}")
    print(f"compression {i.ratio:.3f}x [{sources['ratio']}], {i.compress_gbps:.1f} GB/s per GPU "
          f"[{sources['compress_gbps']}]")
    per_rank = i.module_gb > 0 or i.rank_write_gbps is not None
    if per_rank:
        limit = "no per-rank limit" if i.rank_write_gbps is None else f"{i.rank_write_gbps:g} GB/s per rank"
        print(f"rank 0 writes the {i.module_gb:,.1f} GB module on top of its share; {limit}")
    columns = [("plain", report.baseline, report.ranks_baseline)]
    if i.module_gb > 0:
        columns.append(("module rank 0", report.compressed_module_on_rank0, report.ranks_module_on_rank0))
        columns.append(("derived", report.compressed, report.ranks_compressed))
    else:
        columns.append(("compressed", report.compressed, report.ranks_compressed))
    print(f"{'':34}" + "".join(f"{name:>15}" for name, _, _ in columns))
    rows = [
        ("wait per checkpoint (s)", "wait_s", "{:,.1f}"),
        ("GPU waiting per month (h)", "wait_hours_month", "{:,.1f}"),
        ("idle GPUs per month ($)", "idle_gpu_usd_month", "{:,.0f}"),
        ("stored (GB)", "stored_gb", "{:,.1f}"),
        ("storage per month ($)", "storage_usd_month", "{:,.0f}"),
        ("total per month ($)", "total_usd_month", "{:,.0f}"),
    ]
    for label, field, fmt in rows:
        print(f"{label:34}" + "".join(f"{fmt.format(getattr(cost, field)):>15}" for _, cost, _ in columns))
    if per_rank:
        for label, field in (("rank 0 writes (GB)", "rank0_gb"), ("each other rank writes (GB)", "other_gb"),
                             ("rank 0 / other ranks", "straggler")):
            print(f"{label:34}" + "".join(f"{getattr(ranks, field):>15,.2f}" for _, _, ranks in columns))
    print(f"pipelined save waits for: {report.bottleneck} (compress {report.compress_s:.1f} s, "
          f"write {report.compressed_write_s:.1f} s)")
    print(f"savings: {report.savings_hours_month:,.1f} h and ${report.savings_usd_month:,.0f} "
          "per month")


def cmd_cost(args: argparse.Namespace) -> int:
    inputs, sources = cost_inputs(args)
    report = costmodel.estimate(inputs)
    if args.json:
        print(json.dumps({**report.to_dict(), "sources": sources}, indent=2))
    else:
        _print_cost(report, sources)
    return 0


def add_cost(sub: _SubParsers) -> None:
    p = sub.add_parser("cost", help="what checkpointing costs in idle GPUs and storage",
                       description="Price a checkpoint policy with and without compression. "
                       "Defaults reproduce NVIDIA's example (782 GB at 5 GB/s every 30 min, "
                       "8 GPUs at $4.40/GPU-hour: 156.4 s per checkpoint, $2,202/month). "
                       "The output says where each figure came from.")
    p.add_argument("--size-gb", dest="checkpoint_gb", type=float,
                   help="raw checkpoint size in GB (1e9 bytes) "
                   f"(default: {DEFAULT_CHECKPOINT_GB:g}, or measured with --from)")
    p.add_argument("--write-gbps", type=float,
                   help="aggregate storage write bandwidth in GB/s "
                   f"(default: {DEFAULT_WRITE_GBPS:g}, or measured with --from-bench)")
    p.add_argument("--interval-min", type=float, default=30.0,
                   help="minutes between saves (default: %(default)g)")
    p.add_argument("--gpus", type=int, default=8,
                   help="GPUs idle during a save (default: %(default)s)")
    p.add_argument("--gpu-hour-usd", type=float, default=4.40,
                   help="$ per GPU-hour (default: %(default).2f)")
    p.add_argument("--keep", type=int, default=1,
                   help="checkpoints retained (default: %(default)s)")
    p.add_argument("--storage-usd-per-gb-month", type=float, default=0.0,
                   help="storage price in $ per GB-month (default: %(default)g: storage not "
                   "priced)")
    p.add_argument("--ratio", type=float,
                   help="compression ratio, raw / on-disk bytes "
                   f"(default: {DEFAULT_RATIO}, or measured with --from or --from-bench)")
    p.add_argument("--compress-gbps", type=float,
                   help="GPU compress throughput per GPU in GB/s "
                   f"(default: {DEFAULT_COMPRESS_GBPS:g}, or measured with --from-bench)")
    p.add_argument("--copy-gbps", type=float,
                   help="device-to-host copy GB/s per GPU (default: none, not a bottleneck)")
    p.add_argument("--module-gb", type=float, default=0.0,
                   help="of --size-gb, the 16-bit module that DeepSpeed ZeRO-1/2 writes on rank 0 "
                   "alone (2 bytes/param in bf16), priced both on rank 0 and derived from the "
                   "optimizer shards, as the engine stores it (default: %(default)g)")
    p.add_argument("--rank-write-gbps", type=float,
                   help="the most one rank can write, GB/s (a node's link or file-system client): "
                   "a save waits for its slowest rank or for the aggregate --write-gbps, whichever "
                   "binds (default: none, no per-rank limit)")
    p.add_argument("--days", type=float, default=30.0,
                   help="days per month (default: %(default)g)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--from", dest="from_dir", metavar="CKPT",
                        help="take the raw size (every rank's files) and the compression ratio "
                        "(raw / on-disk bytes) from a real checkpoint: a save dir, tag folder "
                        "or shard (default: none)")
    source.add_argument("--from-bench", metavar="FILE.json",
                        help='take ratio and throughput from a benchmark JSON: {"ratio": float, '
                        '"compress_gbps": float, "write_gbps": float (optional)}, or the report '
                        "of benchmarks/bench_deepspeed.py (default: none)")
    p.add_argument("--tag", help="with --from on a save directory: the tag to measure "
                   "(default: the one 'latest' names)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (default: a table)")
    p.set_defaults(func=cmd_cost)


# ---------------------------------------------------------------------------------------------
# entry point

COMMANDS: tuple[Callable[[_SubParsers], None], ...] = (
    add_inspect, add_verify, add_decompress, add_compress, add_zero_to_fp32, add_to_universal,
    add_cost,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nvcomp-ckpt",
        description="Inspect, verify, convert and price nvcomp_ckpt_engine checkpoints.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 fault or error, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"nvcomp-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"nvcomp-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return 1
