"""`nvcomp-ckpt verify`: the manifest and every chunk checksum of a shard, tag or save directory,
checked without decoding; one line per fault."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from .. import manifest_files
from ..container import ShardIndex, verify_file
from ..errors import CheckpointError
from ..opened import ShardIndexes
from ..siblings import SiblingSources
from .common import SubParsers, Target, dcp_folder, progress_bar, resolve_target, target_files


def verify_target(target: Target, *, progress: bool) -> list[str]:
    """Every fault found, one per damaged file: the manifest (completeness, sizes, CRC), every
    chunk checksum, and for a file with derived storages that each source it names is there and
    holds the elements.

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
    for name, path in progress_bar(list(found.files), progress, "verifying"):
        problem = problems.get(name)
        if problem is not None and problem.kind != "crc":
            faults.append(problem.message)
        elif problem is not None or found.manifest is None or path.exists():
            # (a listed file that does not exist here, unreported: another node's)
            fault = _file_fault(path, sibling_paths(files, name), indexes)
            if fault is not None or problem is not None:
                faults.append(fault or problem.message)
    return faults


def _index_crc(indexes: ShardIndexes) -> Callable[[Path], int | None]:
    """`indexes.crc` for the manifest check, where an index its reader fails on other than with
    a CheckpointError (a reader bug on a hostile file) gives no CRC: the file's own check
    (`_file_fault`) then reports that failure as the file's one fault, and the run goes on."""
    def crc(path: Path) -> int | None:
        try:
            return indexes.crc(path)
        except CheckpointError:
            raise
        except Exception:
            return None

    return crc


def _file_fault(path: Path, siblings: dict[str, Path], indexes: ShardIndexes) -> str | None:
    """What `verify_file` finds wrong with one shard, or None; a shard with derived storages
    also needs each source it names (`siblings`: the files beside it, by name) to hold them."""
    try:
        index = verify_file(path, indexes.get(path))
        if index.derived_files:
            SiblingSources(path.parent, files=siblings, verify=False,
                           indexes=_source_indexes(index, path.parent, siblings, indexes),
                           ).check(index)
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
        source = indexes.get(path) if path.is_file() else None
        if source is not None:
            found[name] = source
    return found


def sibling_paths(files: dict[str, Path], relative: str) -> dict[str, Path]:
    """The files beside `relative` in a tag, by name, as `load`'s ``sources``: where a derived
    storage's source lives (its staged name while a re-save's renames are pending)."""
    folder = Path(relative).parent
    return {Path(rel).name: path for rel, path in files.items() if Path(rel).parent == folder}


def run(args: argparse.Namespace) -> int:
    folder = dcp_folder(args.path)
    if folder is not None:
        from .. import dcp

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


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("verify", help="check every checksum and the manifest (no GPU needed)",
                       description="Check the manifest (every file present, sizes, CRC-32) and "
                       "every chunk checksum of every shard, without decoding. Exit status 1 "
                       "and one line per fault, naming the file, tensor and chunk.")
    p.add_argument("path", help="a shard file, a tag folder, or a save directory")
    p.add_argument("--tag", help="in a save directory: the tag to check (default: 'latest', or "
                   "'latest_universal' in a universal checkpoint's folder)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
