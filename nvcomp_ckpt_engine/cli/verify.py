"""`nvcomp-ckpt verify`: the manifest and every chunk checksum of a shard, tag or save directory,
checked without decoding (but for the sources of derived storages, whose rebuilt bytes are
compared with the digests recorded); one line per fault."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .. import manifest_files
from ..container import ShardIndex, verify_file
from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedCheckpointError
from ..opened import ShardIndexes
from ..siblings import SiblingSources
from ..storage import is_file, locations
from ..tiers.local import tier_copies, tier_faults
from .common import (SubParsers, Target, add_local_tier_option, dcp_folder, location_exists,
                     print_tier_copies, progress_bar, resolve_target, target_files)

T = TypeVar("T")
logger = logging.getLogger(__name__)


def verify_target(target: Target, *, progress: bool) -> list[str]:
    """Every fault found, one per damaged file: the manifest (completeness, sizes, CRC), every
    chunk checksum, and for a file with derived storages that each source it names is there,
    inside the checkpoint folder (no link out), holds the elements itself (is not derived in
    turn) and is the file the derived one was saved with: in a tag, the file the manifest
    committed with it (its CRC), and, where torch is installed, the one whose elements rebuild
    the digests the file records (`SiblingSources.check_digests` decodes the source tensors,
    once every file's own checks are done: a source found damaged is reported on its own line
    only; a source coded for a GPU this machine lacks is left to the manifest, with a warning).

    Keeps going after a fault so one run names every damaged file; returns the messages. Each
    shard's index is read once (`ShardIndexes`) and serves every check: the file's CRC-32 the
    manifest records is compared with the one its index implies, which is the file's own once
    every chunk matches its checksum, as `verify_file` then checks (so no file is read twice).
    A file whose CRC differs from the manifest is read, and its damaged chunk named when the
    chunk checksums find it; a file of the wrong size, outside the folder or not a regular file
    is reported as the manifest check found it. With node-local storage (the manifest says so)
    only the files this host can see are checked.
    """
    found = target_files(target)
    faults = [] if found.manifest_error is None else [found.manifest_error]
    indexes = ShardIndexes()
    problems: dict[str, manifest_files.FileProblem] = {}
    if found.manifest is not None:
        _, listed = manifest_files.check_files(target.path, found.manifest, check_crc=False,
                                               crc_of=_index_crc(indexes),
                                               local_only=found.manifest.node_local_storage)
        problems = {problem.record.path: problem for problem in listed}
    files = dict(found.files)
    within = None if target.is_file else target.path
    faulted: set[str] = set()
    rebuilds: list[_Rebuild] = []
    for name, path in progress_bar(list(found.files), progress, "verifying"):
        problem = problems.get(name)
        fault = None
        if problem is not None and problem.kind != "crc":
            fault = problem.message
        elif problem is not None or found.manifest is None or location_exists(path):
            # (a listed file that does not exist here, unreported: another node's)
            sources = _Sources(sibling_paths(files, name), sibling_paths(problems, name), within)
            fault = _fault_of(path, lambda: _check_file(name, path, sources, indexes, rebuilds))
            fault = fault or (problem.message if problem is not None else None)
        if fault is not None:
            faults.append(fault)
            faulted.add(name)
    for rebuild in rebuilds:
        if not faulted & set(rebuild.sources):
            fault = _fault_of(rebuild.path, lambda: _check_digests(rebuild.siblings, rebuild.index))
            if fault is not None:
                faults.append(fault)
    return faults


def _index_crc(indexes: ShardIndexes) -> Callable[[Path], int | None]:
    """`indexes.crc` for the manifest check, where an index its reader fails on other than with
    a CheckpointError (a reader bug on a hostile file) gives no CRC: the file's own check
    (`_check_file`) then reports that failure as the file's one fault, and the run goes on."""
    def crc(path: Path) -> int | None:
        try:
            return indexes.crc(path)
        except CheckpointError:
            raise
        except Exception:
            return None

    return crc


@dataclass(frozen=True)
class _Sources:
    """What `_check_file` knows of the files beside a shard: their paths by name (`paths`),
    the manifest's problems with them by name (`problems`), and the tag folder every source
    must lie in (`within`, None for a single file)."""

    paths: dict[str, Path]
    problems: dict[str, manifest_files.FileProblem]
    within: Path | None


@dataclass(frozen=True)
class _Rebuild:
    """A derived file whose ranges are rebuilt once every file's own checks are done: its
    sources (paths relative to the tag, as the run names files) and how to read them."""

    path: Path
    sources: tuple[str, ...]
    siblings: SiblingSources
    index: ShardIndex


def _check_file(name: str, path: Path, sources: _Sources, indexes: ShardIndexes,
                rebuilds: list[_Rebuild]) -> None:
    """Raise what `verify_file` finds wrong with one shard (`name`, relative to the tag); a
    shard with derived storages also needs each source it names to hold them, inside the
    checkpoint, and to be the file it was saved with: the manifest's (its problems with the
    sources are the derived file's too), and, where torch is installed, one that gives back
    the bytes recorded (added to `rebuilds`)."""
    index = verify_file(path, indexes.get(path))
    if not index.derived_files:
        return
    siblings = SiblingSources(path.parent, files=sources.paths, within=sources.within,
                              indexes=_source_indexes(index, path.parent, sources.paths, indexes))
    siblings.check(index)
    for source in index.derived_files:
        if source in sources.problems:
            raise CorruptCheckpointError(f"{path}: its tensors are partly derived from {source}, which is "
                                         f"not the file committed with it: "
                                         f"{sources.problems[source].message}")
    if _torch_installed():
        folder = Path(name).parent
        rebuilds.append(_Rebuild(path, tuple((folder / source).as_posix() for source in index.derived_files),
                                 siblings, index))


def _fault_of(path: Path, check: Callable[[], None]) -> str | None:
    """What `check` of the file `path` raises, as one FAULT line; None if nothing."""
    try:
        check()
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: cannot be read ({exc})"
    except Exception as exc:  # a reader bug on a hostile file: still one FAULT line, then go on
        return f"{path}: cannot be verified ({type(exc).__name__}: {exc})"
    return None


def _source_indexes(index: ShardIndex, folder: Path, siblings: dict[str, Path],
                    indexes: ShardIndexes) -> dict[str, ShardIndex]:
    """The indexes of the sources `index`'s derived ranges name, from the ones this run reads
    (each once); a source that is not a shard file here is left to `SiblingSources` to report."""
    found = {}
    for name in index.derived_files:
        path = siblings.get(name, folder / name)
        source = indexes.get(path) if is_file(*locations.resolve(path)) else None
        if source is not None:
            found[name] = source
    return found


def _check_digests(siblings: SiblingSources, index: ShardIndex) -> None:
    """`siblings.check_digests(index)`, unless a source is coded for a device this machine
    lacks (the manifest's CRCs then vouch for the sources alone, and a warning says so)."""
    try:
        siblings.check_digests(index)
    except UnsupportedCheckpointError as exc:
        logger.warning("%s: its derived ranges were not rebuilt here to check their digests: %s",
                       index.path, exc)


def _torch_installed() -> bool:
    """Whether derived ranges can be rebuilt here (verify itself runs without torch, which
    only a file with derived ranges imports)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def sibling_paths(files: Mapping[str, T], relative: str) -> dict[str, T]:
    """The entries of `files` (by path relative to the tag) beside `relative`, by name: as
    `load`'s ``sources``, where a derived storage's source lives (its staged name while a
    re-save's renames are pending)."""
    folder = Path(relative).parent
    return {Path(rel).name: value for rel, value in files.items() if Path(rel).parent == folder}


def run(args: argparse.Namespace) -> int:
    folder = dcp_folder(args.path)
    if folder is not None:
        from .. import dcp

        return _report_faults(folder, [str(fault) for fault in dcp.dcp_faults(folder)])
    target = resolve_target(args.path, args.tag)
    faults = verify_target(target, progress=not args.quiet)
    if args.local_tier:
        tag = target.tag or locations.location(target.path).name
        report = tier_copies(args.local_tier, tag)
        print_tier_copies(report, tag)
        faults += tier_faults(report, tag)
    return _report_faults(target.path, faults)


def _report_faults(path: Path, faults: list[str]) -> int:
    """One FAULT line per fault and a summary; the exit status: 1 on any fault."""
    for fault in faults:
        print(f"FAULT: {fault}")
    if faults:
        print(f"{path}: {len(faults)} fault(s) found")
        return 1
    print(f"{path}: OK")
    return 0


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("verify", help="check every checksum and the manifest (no GPU needed)",
                       description="Check the manifest (every file present, sizes, CRC-32) and "
                       "every chunk checksum of every shard, without decoding; the sources of "
                       "a derived module: inside the folder, not derived, and (with torch) "
                       "rebuilding the bytes it was saved with. Exit status 1 and one line per "
                       "fault, naming the file, tensor and chunk.")
    p.add_argument("path", help="a shard file, a tag folder, or a save directory")
    p.add_argument("--tag", help="in a save directory: the tag to check (default: 'latest', or "
                   "'latest_universal' in a universal checkpoint's folder)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_local_tier_option(p)
    p.set_defaults(func=run)
