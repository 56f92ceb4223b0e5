"""What every `nvcomp-ckpt` command shares: where a PATH argument points, a tag's shard files,
progress bars and sizes, and the walk and output checks of a conversion."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

from tqdm import tqdm

from .. import discovery, manifest
from ..container import is_shard_file, is_torch_file
from ..errors import CheckpointError
from ..manifest import RESERVED_MARK
from ..manifest_files import record_file
from ..fileio import is_inside
from ..storage import locations, open_storage, storage_for
from ..storage.locations import Location

logger = logging.getLogger(__name__)

#: argparse's _SubParsersAction is private: what `add_parser(sub)` of each command receives.
SubParsers = Any


#: DeepSpeed's pointer to the newest tag, in a save directory.
LATEST = discovery.LATEST_NAME
T = TypeVar("T")


class UsageError(Exception):
    """A request the CLI refuses before touching anything (exit status 2)."""


@dataclass(frozen=True)
class Target:
    """What an `inspect` / `verify` PATH names: one shard file, or one tag folder."""

    path: Location
    tag: str | None = None

    @property
    def is_file(self) -> bool:
        return location_is_file(self.path)


# A PATH of `inspect` and `verify` may be a URL (``s3://bucket/prefix/tag``): these answer for
# both kinds what `Path.exists`, `is_file`, `is_dir` and `rglob` answer for a path.

def _url_kind(where: Location) -> str | None:
    """"file", "dir" or None (missing) for a URL location, through its storage."""
    if where.name:
        storage, key = storage_for(where)
        try:
            info = storage.stat(key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return "dir" if info.is_prefix else "file"
    return "dir" if next(iter(open_storage(where).list()), None) is not None else None


def location_exists(where: Location) -> bool:
    return _url_kind(where) is not None if locations.is_url(where) else where.exists()


def location_is_file(where: Location) -> bool:
    return _url_kind(where) == "file" if locations.is_url(where) else where.is_file()


def location_is_dir(where: Location) -> bool:
    return _url_kind(where) == "dir" if locations.is_url(where) else where.is_dir()


def _files_under(folder: Location) -> list[Location]:
    """Every regular file under `folder`, recursively, in name order."""
    if not locations.is_url(folder):
        return [p for p in sorted(folder.rglob("*")) if p.is_file()]
    storage, found, prefixes = open_storage(folder), [], [""]
    while prefixes:
        for entry in storage.list(prefixes.pop()):
            if entry.is_prefix:
                prefixes.append(entry.key)
            else:
                found.append(folder / entry.key)
    return sorted(found, key=str)


def _dirs_in(folder: Location) -> list[Location]:
    """The folders directly in `folder`, in name order."""
    if not locations.is_url(folder):
        return sorted(d for d in folder.iterdir() if d.is_dir())
    return [folder / entry.key for entry in open_storage(folder).list() if entry.is_prefix]




def _read_latest(save_dir: Location) -> str:
    """The tag `latest` names; a clear error when it is missing, empty or names no folder: a
    folder without any tag folder holds no engine checkpoint (`no_shards_error`, exit status
    1, as for every command), one with tag folders needs `--tag` (a usage error).

    A universal checkpoint's folder (what `to-universal` writes) has `latest_universal` and no
    `latest`: there, the tag `latest_universal` names.
    """
    pointer = discovery.inspect_latest(save_dir)
    if (pointer.tag is None and not _lexists(save_dir / LATEST)
            and _lexists(save_dir / discovery.LATEST_UNIVERSAL_NAME)):
        pointer = discovery.inspect_latest(save_dir, name=discovery.LATEST_UNIVERSAL_NAME)
    if pointer.tag is None:
        tags = ", ".join(d.name for d in _tag_dirs(save_dir))
        if not tags:
            raise no_shards_error(save_dir)
        raise UsageError(f"{pointer.reason}; pass --tag TAG (tag folders here: {tags})")
    return pointer.tag


def _lexists(where: Location) -> bool:
    return location_exists(where) if locations.is_url(where) else os.path.lexists(where)


def _plain_torch_files(folder: Location) -> list[Location]:
    return [p for p in _files_under(folder) if is_torch_file(p)]


#: Why the `compress` command the hints print has `--trusted`: DeepSpeed's files need it.
COMPRESS_TRUSTED_WHY = ("--trusted because DeepSpeed's files hold objects, such as its "
                        "LossScaler, that torch.load refuses without it: for files you trust")


def no_shards_error(folder: Location, checkpoint: Location | None = None) -> CheckpointError:
    """The error for a folder without engine shards, naming `compress` where it holds torch files
    (a plain DeepSpeed checkpoint, for instance); `checkpoint` is the path to convert, when it
    is not `folder` itself (the save directory of a tag folder).

    Every command exits with status 1 for such a folder (a CheckpointError): the path exists and
    the request is well formed, but there is no engine checkpoint to work on."""
    plain = _plain_torch_files(folder)
    hint = ""
    if plain:
        names = ", ".join(locations.relative_to(p, folder) for p in plain[:3])
        more = ", ..." if len(plain) > 3 else ""
        hint = (f"; its {len(plain)} plain torch.save file(s) ({names}{more}) are read with "
                f"torch.load, and `nvcomp-ckpt compress --trusted {checkpoint or folder} OUT_DIR` "
                f"converts them into engine shards ({COMPRESS_TRUSTED_WHY})")
    return CheckpointError(f"{folder} holds no nvcomp_ckpt_engine shard files{hint}")


def resolve_target(path: str | os.PathLike, tag: str | None) -> Target:
    """A shard file, a tag folder, or the tag of a save directory (`tag`, else ``latest``): a
    path, or a URL (``s3://bucket/prefix``)."""
    path = locations.location(path)
    if not location_exists(path):
        raise UsageError(f"{path} does not exist")
    if location_is_file(path) or discovery.is_engine_tag(path):
        if tag is not None:
            raise UsageError(f"--tag applies to a save directory; {path} is a file or tag folder")
        return Target(path, path.name if location_is_dir(path) else None)
    tag = tag if tag is not None else _read_latest(path)
    tag_dir = path / tag
    if not location_is_dir(tag_dir):
        raise UsageError(f"{path}: tag folder {tag!r} does not exist")
    return Target(tag_dir, tag)


def _tag_dirs(save_dir: Location) -> list[Location]:
    """The tag folders of a save directory, by name."""
    return [d for d in _dirs_in(save_dir) if discovery.is_engine_tag(d)]


def _shard_files(tag_dir: Location) -> list[Location]:
    """Every shard file under a tag folder (recursively, in name order), staged ones aside."""
    return [p for p in _files_under(tag_dir) if RESERVED_MARK not in p.name and is_shard_file(p)]


@dataclass(frozen=True)
class TagFiles:
    """A tag folder's shard files: the manifest's records, or a scan where it has none."""

    files: tuple[tuple[str, Location], ...]  # (path relative to the tag folder, file to read)
    manifest: manifest.Manifest | None
    manifest_error: str | None


def tag_files(tag_dir: Location) -> TagFiles:
    """The shards that make up a tag; the manifest decides when it can be read."""
    try:
        found = manifest.read_manifest(tag_dir)
    except CheckpointError as exc:
        scanned = tuple((_relative(p, tag_dir), p) for p in _shard_files(tag_dir))
        return TagFiles(scanned, None, str(exc))
    listed = {r.path: record_file(tag_dir, found, r) for r in found.files}  # one per path
    return TagFiles(tuple(sorted(listed.items())), found, None)


def _relative(path: Location, folder: Location) -> str:
    """`path` relative to `folder` as found in it (links not resolved)."""
    if locations.is_url(path):
        return locations.relative_to(path, folder)
    return path.relative_to(folder).as_posix()


def target_files(target: Target) -> TagFiles:
    if target.is_file:
        return TagFiles(((str(target.path), target.path),), None, None)
    return tag_files(target.path)


def progress_bar(items: Sequence[T], enabled: bool, what: str) -> Iterable[T]:
    """Wrap `items` in a progress bar on stderr (stdout stays the command's output)."""
    if not enabled or not items:
        return items
    return tqdm(items, desc=what, unit="file", file=sys.stderr, leave=False)


def size_text(n: float) -> str:
    """Bytes in binary units, as `ls -h` and `du -h` show them."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"


def dcp_folder(path: str | os.PathLike) -> Location | None:
    """`path` if it is a torch.distributed.checkpoint folder written by our DCP writer.

    Checked before anything else: our DCP rank files carry the shard magic, so a DCP folder
    would otherwise look like a DeepSpeed tag folder. Without torch a DCP folder is refused
    (CheckpointError naming torch) and any other path is left to the torch-free commands.
    """
    try:
        from .. import dcp
    except ImportError as exc:  # torch (or its torch.distributed) is not installed
        if locations.is_url(path):
            return None
        if (Path(path) / ".metadata").is_file():  # DCP's own metadata file name
            raise CheckpointError(f"{path}: a torch.distributed.checkpoint folder; reading it "
                                  f"needs torch, which this Python cannot import ({exc})") from None
        return None
    return locations.location(path) if dcp.is_dcp_checkpoint(path) else None


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
    folders = [d for d in sorted(src.iterdir()) if d.is_dir() and inside_source(d, src)]
    tags = [d for d in folders if is_tag_dir(d)]
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
        for other in (d for d in folders if d not in tags):
            logger.warning("%s: not a tag folder of this checkpoint; not converted", other)
    top_files = tuple(p for p in sorted(src.iterdir())
                      if p.is_file() and p.name != LATEST and not discovery.is_engine_file(p)
                      and inside_source(p, src))
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
    check_empty_output(out)


def check_empty_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} exists and is not an empty directory")


def copy_file(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)


def inside_source(path: Path, root: Path) -> bool:
    """Whether a conversion may read `path`, a file or a folder of the checkpoint `root`: it
    must lie inside `root` with every link along it resolved. A link that stays inside is
    followed (the file or folder it names is part of the checkpoint, converted under the
    link's name); a link out is never followed, since the conversion would copy whatever it
    names into the output: such a path is left out, with a warning. A folder must lie strictly
    inside: a link to `root` itself (or above it) would make the checkpoint hold itself.
    """
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if is_inside(path, root) and not (path.is_dir() and real == real_root):
        return True
    logger.warning("%s: a link to %s, outside %s; left out", path, real, root)
    return False


def other_files(tag_dir: Path, skip: Callable[[Path], bool]) -> list[Path]:
    """Regular files under `tag_dir` to copy as they are: neither converted nor the engine's,
    nor links out of the tag folder."""
    return sorted(p for p in tag_dir.rglob("*")
                  if p.is_file() and not discovery.is_engine_file(p) and inside_source(p, tag_dir)
                  and not skip(p))


def add_local_tier_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local-tier", metavar="PATH",
                        help='also show each node\'s copy of the tag in the node-local tier: '
                        'the "local_tier" "path" of ds_config ("{node}" is filled with 0, 1, ...)')


def print_tier_copies(report: list[dict[str, Any]], tag: str) -> None:
    """One line per node's copy of `tag` in the node-local tier (`tiers.local.tier_copies`)."""
    print(f"node-local tier, tag {tag}:")
    if not report:
        print("  no node folder found")
    for entry in report:
        state = (f"committed, {entry['intact']} of {entry['files']} files intact"
                 if entry["committed"] else "no committed copy")
        held = "" if entry["held"] is None else f", holds {len(entry['held'])} by placement"
        lost = ", ".join([*(f"{n} missing" for n in entry["missing"]),
                          *(f"{n} damaged" for n in entry["damaged"])])
        print(f"  node {entry['node']} ({entry['folder']}): {state}{held}{'; ' + lost if lost else ''}")
