"""`nvcomp-ckpt`: look into, check, convert and price engine checkpoints from a shell.

Every command takes the places DeepSpeed users already know: a shard file, a tag folder
(``global_step100/``) or a save directory (the one holding ``latest``). `inspect` and `verify`
read only headers, indexes and checksummed bytes -- never a full restore -- so they are cheap and
need no GPU. `decompress` and `compress` convert between engine checkpoints and plain
`torch.save` checkpoints that DeepSpeed's own tools (``zero_to_fp32``, ``ds_to_universal``)
read. `cost` turns measured figures into hours and dollars (costmodel.py).

Adding a subcommand: write ``add_NAME(subparsers)`` that creates its parser and sets
``func=`` to a function ``(argparse.Namespace) -> int`` (the exit status), and list it in
`COMMANDS`. `main` turns `CheckpointError`, `OSError` and `ValueError` into a one-line message
and exit status 1, and `UsageError` into exit status 2 (what argparse uses).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
from tqdm import tqdm

from . import __version__, commit, costmodel, manifest
from .api import DEFAULT_CHUNK_MB, is_shard_file, load, save
from .codecs import ALGORITHMS
from .compat import patch_torch_load, wrap_recovery_script
from .container import read_index, verify_file
from .errors import CheckpointError, IncompleteCheckpointError
from .manifest import MANIFEST_NAME, RESERVED_MARK, TAG_MARKER_NAME
from .pipeline import ShardInfo
from .siblings import SiblingSources
from .storage import PARTIAL_SUFFIX, fsync_dir

logger = logging.getLogger(__name__)

#: DeepSpeed's pointer to the newest tag, in a save directory.
LATEST = commit.LATEST_NAME
#: Default figures for `cost` when nothing measured is given: nvCOMP ANS (float modes, 1 MiB
#: chunks) on DeepSpeed bf16 training state (14 bytes/param), measured on one H200.
DEFAULT_RATIO = 1.22
DEFAULT_COMPRESS_GBPS = 100.0

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


def _has_checkpoint_files(directory: Path) -> bool:
    """A tag folder holds a manifest, the engine's tag marker or shard files itself; a save
    directory holds tag folders."""
    if any((directory / name).is_file() for name in (MANIFEST_NAME, TAG_MARKER_NAME)):
        return True
    return any(p.is_file() and is_shard_file(p) for p in directory.iterdir())


def _read_latest(save_dir: Path) -> str:
    """The tag `latest` names; a clear error when it is missing, empty or names no folder."""
    pointer = commit.inspect_latest(save_dir)
    if pointer.tag is None:
        tags = ", ".join(d.name for d in _tag_dirs(save_dir)) or "none"
        raise UsageError(f"{pointer.reason}; pass --tag TAG (tag folders here: {tags})")
    return pointer.tag


def resolve_target(path: str | os.PathLike, tag: str | None) -> Target:
    """A shard file, a tag folder, or the tag of a save directory (`tag`, else ``latest``)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_file() or _has_checkpoint_files(path):
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
    return sorted(d for d in save_dir.iterdir() if d.is_dir() and _has_checkpoint_files(d))


def _shard_files(tag_dir: Path) -> list[Path]:
    """Every shard file under a tag folder (recursively, in name order), staged ones aside."""
    return sorted(p for p in tag_dir.rglob("*")
                  if p.is_file() and RESERVED_MARK not in p.name and is_shard_file(p))


def _record_file(tag_dir: Path, found: manifest.Manifest, record: manifest.ShardRecord) -> Path:
    """The file holding a record's bytes: its staged name while a re-save's rename is pending."""
    staged = manifest.staged_path(tag_dir, found, record)
    return staged if staged is not None and staged.exists() else tag_dir / record.path


# ---------------------------------------------------------------------------------------------
# inspect


def _storage_stats(storage: Any) -> dict[str, Any]:
    stored = sum(c.length for c in storage.chunks)
    return {
        "raw_bytes": storage.nbytes,
        "stored_bytes": stored,
        "derived_bytes": storage.nbytes - storage.stored_nbytes,
        "derived_from": sorted({r.file for r in storage.derived}),
        "ratio": storage.nbytes / stored if stored else 1.0,
        "codec": storage.codec,
        "transform": storage.transform,
        "chunks": len(storage.chunks),
    }


def describe_shard(path: Path, name: str) -> dict[str, Any]:
    """One shard's metadata from its index alone: per-file and per-tensor sizes and codecs."""
    index = read_index(path)
    storages = [_storage_stats(s) for s in index.storages]
    first_viewer: dict[int, str] = {}
    tensors = []
    for t in index.tensors:
        entry = {"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "storage": t.storage,
                 **storages[t.storage]}
        if t.storage in first_viewer:
            entry["shares_storage_with"] = first_viewer[t.storage]
        first_viewer.setdefault(t.storage, t.key)
        tensors.append(entry)
    return {
        "path": name,
        "format_version": index.format_version,
        "writer": index.writer,
        "file_bytes": index.file_bytes,
        "raw_bytes": index.raw_bytes,
        "stored_bytes": sum(s["stored_bytes"] for s in storages),
        "derived_bytes": sum(s["derived_bytes"] for s in storages),
        "derived_from": list(index.derived_files),
        "ratio": index.raw_bytes / index.file_bytes if index.file_bytes else 1.0,
        "codecs": list(index.codecs),
        "tensors": tensors,
    }


def _totals(files: list[dict[str, Any]]) -> dict[str, Any]:
    files = [f for f in files if "error" not in f]
    raw = sum(f["raw_bytes"] for f in files)
    on_disk = sum(f["file_bytes"] for f in files)
    return {
        "files": len(files),
        "tensors": sum(len(f["tensors"]) for f in files),
        "raw_bytes": raw,
        "stored_bytes": sum(f["stored_bytes"] for f in files),
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
    listed = {r.path: _record_file(tag_dir, found, r) for r in found.files}  # one per path
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
        if tensors:
            _print_tensor_rows(f["tensors"])
    t = doc["totals"]
    print(f"total: {t['files']} files, {t['tensors']} tensors, raw {_size(t['raw_bytes'])}, "
          f"on disk {_size(t['file_bytes'])}, ratio {t['ratio']:.3f}x")


def _print_tensor_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        sizes = (f"= storage of {r['shares_storage_with']!r}" if "shares_storage_with" in r else
                 f"{_size(r['raw_bytes'])} -> {_size(r['stored_bytes'])} ({r['ratio']:.3f}x)"
                 + (f", {_size(r['derived_bytes'])} derived" if r["derived_bytes"] else ""))
        shape = "x".join(map(str, r["shape"])) or "scalar"
        print(f"    {r['key']}  {r['dtype']}[{shape}]  {_codec_name(r['codec'])}  "
              f"{r['transform'].get('name', '-')}  {sizes}")


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
        doc = inspect_target(resolve_target(args.path, args.tag))
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
    """Every fault found: the manifest (completeness, sizes, CRC), every chunk checksum, and for
    a file with derived storages that each source it names is there and holds the elements.

    Keeps going after a fault so one run names every damaged file; returns the messages. With
    node-local storage (the manifest says so) only the files this host can see are checked.
    """
    found = _target_files(target)
    faults = [] if found.manifest_error is None else [found.manifest_error]
    if found.manifest is not None:
        try:
            manifest.verify_files(target.path, found.manifest,
                                  local_only=found.manifest.node_local_storage)
        except CheckpointError as exc:
            faults.append(str(exc))
    # Files the manifest found missing are reported once, above.
    files = dict(found.files)
    listed = [(rel, path) for rel, path in found.files if found.manifest is None or path.exists()]
    for rel, path in _progress(listed, progress, "verifying"):
        try:
            index = verify_file(path)
            if index.derived_files:
                SiblingSources(path.parent, files=sibling_paths(files, rel), verify=False).check(index)
        except CheckpointError as exc:
            faults.append(str(exc))
        except OSError as exc:
            faults.append(f"{path}: cannot be read ({exc})")
    return faults


def _progress(items: Sequence[T], enabled: bool, what: str) -> Iterable[T]:
    """Wrap `items` in a progress bar on stderr (stdout stays the command's output)."""
    if not enabled or not items:
        return items
    return tqdm(items, desc=what, unit="file", file=sys.stderr, leave=False)


def cmd_verify(args: argparse.Namespace) -> int:
    folder = _dcp_folder(args.path)
    if folder is not None:
        from . import dcp

        try:
            dcp.verify_dcp(folder)
            return _report_faults(folder, [])
        except CheckpointError as exc:
            return _report_faults(folder, [str(exc)])
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


def _engine_owned(path: Path) -> bool:
    """The engine's own bookkeeping files, which never belong in a converted copy."""
    return (path.name in (MANIFEST_NAME, TAG_MARKER_NAME) or RESERVED_MARK in path.name
            or path.name.endswith(PARTIAL_SUFFIX))


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
    for other in sorted(d for d in src.iterdir() if d.is_dir() and d not in tags):
        logger.warning("%s: not a tag folder of this checkpoint; not converted", other)
    top_files = tuple(p for p in sorted(src.iterdir())
                      if p.is_file() and p.name != LATEST and not _engine_owned(p))
    latest = tag if tag is not None else _latest_if_present(src, {d.name for d in tags})
    return Conversion(tuple(tags), top_files, latest, every_tag=tag is None)


def _latest_if_present(src: Path, tags: set[str]) -> str | None:
    latest = commit.inspect_latest(src).tag
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
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory")


def _copy_file(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)


def _other_files(tag_dir: Path, skip: Callable[[Path], bool]) -> list[Path]:
    """Regular files under `tag_dir` to copy as they are: neither converted nor the engine's."""
    return sorted(p for p in tag_dir.rglob("*")
                  if p.is_file() and not _engine_owned(p) and not skip(p))


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
    found = manifest.read_manifest(tag_dir)
    manifest.verify_files(tag_dir, found, check_crc=False, local_only=found.node_local_storage)
    shards = dict(tag_files(tag_dir).files)
    for rel in _progress(list(shards), progress, f"decompressing {tag_dir.name}"):
        _torch_save_atomically(load_tag_file(shards, rel, trusted=trusted), out_tag / rel)

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


def load_tag_file(files: dict[str, Path], relative: str, *, trusted: bool) -> Any:
    """One file of a tag (`files`: a `TagFiles.files` mapping), whole, in host memory: what
    `decompress` writes, and how any converter of a checkpoint reads it. A module stored as
    derived from the tag's ZeRO shards comes back rebuilt (`nvcomp_ckpt_engine.load`, given the
    paths of the files beside it, staged names included)."""
    return load(files[relative], map_location="cpu", trusted=trusted, sources=sibling_paths(files, relative))


def sibling_paths(files: dict[str, Path], relative: str) -> dict[str, Path]:
    """The files beside `relative` in a tag, by name, as `load`'s ``sources``: where a derived
    storage's source lives (its staged name while a re-save's renames are pending)."""
    folder = Path(relative).parent
    return {Path(rel).name: path for rel, path in files.items() if Path(rel).parent == folder}


def _is_engine_tag(directory: Path) -> bool:
    return _has_checkpoint_files(directory)


def cmd_decompress(args: argparse.Namespace) -> int:
    src, out = Path(args.ckpt_dir), Path(args.out_dir)
    if _dcp_folder(src) is not None:
        from . import dcp

        dcp.decompress_dcp(src, out, trusted=args.trusted)
        print(f"wrote a plain torch.distributed.checkpoint to {out}")
        return 0
    plan = plan_conversion(src, args.tag, _is_engine_tag)
    check_output_dir(src, out, plan)
    out.mkdir(parents=True, exist_ok=True)
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
        commit.write_latest(out, plan.latest)
    print(f"wrote {converted} torch.save files in {len(written)} tag(s) to {out}")
    return 0


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


def is_torch_file(path: Path) -> bool:
    """A torch.save file in the zip format (what torch has written by default since 1.6)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name == "data.pkl" or name.endswith("/data.pkl") for name in archive.namelist())


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
    torch_files = [p for p in sorted(tag_dir.rglob("*")) if p.is_file() and is_torch_file(p)]
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
    out.mkdir(parents=True, exist_ok=True)
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
        commit.write_latest(out, plan.latest)
    ratio = raw / on_disk if on_disk else 1.0
    print(f"wrote {len(plan.tags)} tag(s) to {out}: raw {_size(raw)} -> {_size(on_disk)} "
          f"({ratio:.3f}x)")
    return 0


def add_compress(sub: _SubParsers) -> None:
    p = sub.add_parser("compress", help="turn a plain torch.save checkpoint into engine shards",
                       description="Compress every torch.save file of a DeepSpeed checkpoint into "
                       "an engine shard at the same relative path and write each tag's manifest, "
                       "so the result loads through the engine. Other files are copied.")
    p.add_argument("src", help="a plain save directory (all tags, or --tag) or one tag folder")
    p.add_argument("dst", help="a new or empty directory outside SRC")
    p.add_argument("--tag", help="in a save directory: convert only this tag")
    p.add_argument("--algorithm", default="auto", choices=ALGORITHMS,
                   help="codec (default: auto, chosen per storage from a sample)")
    p.add_argument("--portable", action="store_true",
                   help="only codecs a machine without a GPU can decode (zstd, deflate)")
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_MB,
                   help=f"chunk size in MiB (default {DEFAULT_CHUNK_MB})")
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
                   help="split the output into files of this size, e.g. 5GB (needs "
                   "huggingface_hub); default 'none': one file")
    p.add_argument("--safe-serialization", action="store_true",
                   help="write safetensors (needs safetensors)")
    p.add_argument("--exclude-frozen-parameters", action="store_true")
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist)")
    p.set_defaults(func=cmd_zero_to_fp32)


# ---------------------------------------------------------------------------------------------
# cost


def measured_ratio(path: Path, tag: str | None) -> float:
    """Raw bytes / bytes on disk of a real checkpoint, from its shard indexes."""
    totals = inspect_target(resolve_target(path, tag))["totals"]
    if not totals["files"]:
        raise CheckpointError(f"{path}: no readable shard files to measure a ratio from")
    return totals["ratio"]


def cost_inputs(args: argparse.Namespace) -> tuple[costmodel.CostInputs, dict[str, str]]:
    """The model's inputs and where each measured figure came from (given > measured > default)."""
    figures: dict[str, tuple[float | None, str]] = {
        "checkpoint_gb": (782.0, "default"), "write_gbps": (5.0, "default"),
        "ratio": (DEFAULT_RATIO, "default (nvCOMP ANS, H200)"),
        "compress_gbps": (DEFAULT_COMPRESS_GBPS, "default (nvCOMP ANS, H200)"),
    }
    if args.from_dir:
        figures["ratio"] = (measured_ratio(Path(args.from_dir), args.tag),
                            f"measured in {args.from_dir}")
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
          f"{i.write_gbps:g} GB/s [{sources['write_gbps']}], every {i.interval_min:g} min "
          f"({report.checkpoints_per_month:,.0f}/month), {i.gpus} GPUs at "
          f"${i.gpu_hour_usd:.2f}/GPU-hour, keep {i.keep}")
    print(f"compression {i.ratio:.3f}x [{sources['ratio']}], {i.compress_gbps:g} GB/s per GPU "
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
                       "8 GPUs at $4.40/GPU-hour: 156.4 s per checkpoint, $2,202/month).")
    p.add_argument("--size-gb", dest="checkpoint_gb", type=float,
                   help="raw checkpoint size in GB (1e9 bytes; default 782)")
    p.add_argument("--write-gbps", type=float,
                   help="aggregate storage write bandwidth in GB/s (default 5)")
    p.add_argument("--interval-min", type=float, default=30.0, help="minutes between saves")
    p.add_argument("--gpus", type=int, default=8, help="GPUs idle during a save")
    p.add_argument("--gpu-hour-usd", type=float, default=4.40, help="$ per GPU-hour")
    p.add_argument("--keep", type=int, default=1, help="checkpoints retained (default 1)")
    p.add_argument("--storage-usd-per-gb-month", type=float, default=0.0,
                   help="storage price in $ per GB-month (default 0: storage not priced)")
    p.add_argument("--ratio", type=float, help=f"compression ratio (default {DEFAULT_RATIO})")
    p.add_argument("--compress-gbps", type=float,
                   help=f"GPU compress throughput per GPU (default {DEFAULT_COMPRESS_GBPS:g})")
    p.add_argument("--copy-gbps", type=float,
                   help="device-to-host copy GB/s per GPU (default: not a bottleneck)")
    p.add_argument("--module-gb", type=float, default=0.0,
                   help="of --size-gb, the 16-bit module that DeepSpeed ZeRO-1/2 writes on rank 0 "
                   "alone (2 bytes/param in bf16; default 0); priced both on rank 0 and derived "
                   "from the optimizer shards, as the engine stores it")
    p.add_argument("--rank-write-gbps", type=float,
                   help="the most one rank can write, GB/s (a node's link or file-system client; "
                   "default: no per-rank limit): a save waits for its slowest rank or for the "
                   "aggregate --write-gbps, whichever binds")
    p.add_argument("--days", type=float, default=30.0, help="days per month")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--from", dest="from_dir", metavar="CKPT",
                        help="take the compression ratio (raw / on-disk bytes) from a real "
                        "checkpoint: a save dir, tag folder or shard")
    source.add_argument("--from-bench", metavar="FILE.json",
                        help='take ratio and throughput from a benchmark JSON: {"ratio": float, '
                        '"compress_gbps": float, "write_gbps": float (optional)}, or the report '
                        'of benchmarks/bench_deepspeed.py')
    p.add_argument("--tag", help="with --from on a save directory: the tag to measure")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_cost)


# ---------------------------------------------------------------------------------------------
# entry point

COMMANDS: tuple[Callable[[_SubParsers], None], ...] = (
    add_inspect, add_verify, add_decompress, add_compress, add_zero_to_fp32, add_cost,
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
