"""Where each file of a load comes from: computed alike on every rank from one inventory.

Every node says what it holds (`local.inventory`), rank 0 adds the tags complete in the
persistent tier; the ranks all-gather that, and each runs `choose` on the same input, so every
rank knows every transfer of the restore and no rank waits for bytes that nobody sends. The
tag is the newest one complete in some tier: each of its files intact on some node, or the
whole tag complete in the persistent tier. Per node and file, the source is the node's own
copy, else the node nearest after it that holds the file, else the persistent tier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..manifest import Manifest
from .local import NodeCopy, manifest_identity

#: The source of a file that no node holds: the persistent tier (``save_dir``).
PERSISTENT = -1


@dataclasses.dataclass(frozen=True)
class Fetch:
    """File `path` copied to node `node` from node `source` (or `PERSISTENT`)."""

    path: str
    node: int
    source: int


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """The tag to load, its manifest, and the copies that make every node hold all its files."""

    tag: str
    manifest: Manifest
    fetches: tuple[Fetch, ...]

    def persistent_bytes(self) -> int:
        sizes = {r.path: r.file_bytes for r in self.manifest.files}
        return sum(sizes[f.path] for f in self.fetches if f.source == PERSISTENT)


def _key(manifest: Manifest) -> tuple[int, int, str]:
    return (-1 if manifest.step is None else manifest.step, manifest.created_unix_ns, manifest.tag)


def choose(copies: Sequence[Mapping[str, NodeCopy]], persistent: Mapping[str, Manifest], *,
           tag: str | None = None) -> tuple[RestorePlan | None, dict[str, str]]:
    """The restore of `tag` (None: the newest tag complete in some tier) onto every node.

    `copies[n]` is node n's inventory; `persistent` the tags complete in the persistent tier.
    A node's copy counts only if its manifest is the same save's as the tag's (a re-save of the
    tag elsewhere is another checkpoint). Returns the plan (None: no tag is complete anywhere,
    a fresh start, or `tag` is not) and the newer tags passed over with what each lost.
    """
    candidates: dict[str, Manifest] = dict(persistent)
    for inventory in copies:
        for name, copy in inventory.items():
            known = candidates.get(name)
            if known is None or (name not in persistent and _key(copy.manifest) > _key(known)):
                candidates[name] = copy.manifest
    passed_over: dict[str, str] = {}
    order = sorted(candidates.values(), key=_key, reverse=True)
    for manifest in order:
        if tag is not None and manifest.tag != tag:
            continue
        identity = manifest_identity(manifest)
        holders = {r.path: [n for n, inventory in enumerate(copies)
                            if _holds(inventory.get(manifest.tag), identity, r.path)]
                   for r in manifest.files}
        in_persistent = manifest.tag in persistent and manifest_identity(
            persistent[manifest.tag]) == identity
        lost = sorted(path for path, nodes in holders.items() if not nodes)
        if lost and not in_persistent:
            ranks = {r.path: r.rank for r in manifest.files}
            shown = ", ".join(f"{p} (rank {ranks[p]})" for p in lost[:8])
            more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
            passed_over[manifest.tag] = (
                f"{len(lost)} of its {len(manifest.files)} files are on no node and it has no "
                f"complete persistent copy: {shown}{more}")
            continue
        return RestorePlan(tag=manifest.tag, manifest=manifest,
                           fetches=_fetches(holders, len(copies))), passed_over
    return None, passed_over


def _holds(copy: NodeCopy | None, identity: tuple, path: str) -> bool:
    return copy is not None and path in copy.intact and manifest_identity(copy.manifest) == identity


def _fetches(holders: Mapping[str, list[int]], nodes: int) -> tuple[Fetch, ...]:
    """Every node gets every file: from itself (nothing to do), the nearest node after it that
    holds one, or the persistent tier."""
    fetches = []
    for path in sorted(holders):
        have = holders[path]
        for node in range(nodes):
            if node in have:
                continue
            source = min(have, key=lambda h: (h - node) % nodes) if have else PERSISTENT
            fetches.append(Fetch(path=path, node=node, source=source))
    return tuple(fetches)


__all__ = ["Fetch", "PERSISTENT", "RestorePlan", "choose"]
