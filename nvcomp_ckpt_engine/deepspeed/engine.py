"""`NvcompCheckpointEngine`: DeepSpeed's checkpoint files, compressed and committed as a whole.

A thin adapter: compression and the file format live in `nvcomp_ckpt_engine.api`, the
distributed commit in `commit`, the manifest in `manifest`. This module maps DeepSpeed's calls
onto them.

Call sequence in DeepSpeed 0.19 `save_checkpoint` (every rank):
    rank 0 makes ``save_dir``; barrier; ``create(info)``; ``save(state, path)`` for each file
    this rank writes (ZeRO shards on every rank, the model states on data-parallel rank 0);
    ``commit(info)``; rank 0 writes ``save_dir/latest``; barrier.
`commit` returns on no rank before the manifest is durable, and rank 0 points ``latest`` at the
tag (atomically, durably) only then, so ``latest`` never names a checkpoint without a manifest.

`save_16bit_model` goes through the same `create`/`save`/`commit`, but its file is a model
export for other tools (HF ``from_pretrained``, inference servers), so the engine writes it as
DeepSpeed's default engine would (`torch.save`) and commits nothing. It is told apart by the
caller: only `DeepSpeedEngine.save_checkpoint` starts a compressed save
(`_compat.called_from_save_checkpoint`); every rank runs the same method, so all agree.

Load (`load_checkpoint`, every rank): ``load(path, map_location)`` for each file the rank reads.
Before the first load from a tag the engine checks it: complete (`commit.resolve_load_tag`,
which also finishes an interrupted re-save), a known manifest version, the same parallel layout,
and the sizes and (with ``verify``) CRCs of the files this rank wrote; a file written by
another rank (rank 0's model states) is checked when it is first loaded. Plain torch files load
exactly as DeepSpeed's default engine loads them, ``torch.load(..., weights_only=False)``: a
job that turns the engine on resumes from its last plain checkpoint, and that is DeepSpeed's own
trust model for its checkpoint folders. Our own files never run code from the file: their
skeleton goes through the allowlist.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from .. import api, commit, compat, manifest
from ..config import NvcompConfig
from ..errors import IncompleteCheckpointError
from . import _compat

logger = logging.getLogger(__name__)

ENGINE_NAME = "NvcompCheckpointEngine"

_STEP_IN_TAG = re.compile(r"global_step(\d+)$")


@dataclasses.dataclass
class _PendingSave:
    """One `save_checkpoint` in progress on this rank: where files go and what was written.

    `plan` is None only when preparing the tag folder failed; `error` then says why.
    """

    info: CheckpointCommitInfo
    tag_dir: Path
    plan: commit.SavePlan | None
    started: float = dataclasses.field(default_factory=time.monotonic)
    records: list[manifest.ShardRecord] = dataclasses.field(default_factory=list)
    error: BaseException | None = None


class NvcompCheckpointEngine(CheckpointEngine):
    """A DeepSpeed `CheckpointEngine` that writes compressed shards and commits a manifest.

    DeepSpeed's factory builds it on every rank during ``deepspeed.initialize`` (see
    `nvcomp_ckpt_engine.deepspeed`). `options` and `zero_stage` default to what
    `config_params` says.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        options: NvcompConfig | None = None,
        zero_stage: int | None = None,
    ) -> None:
        super().__init__(config_params)
        _compat.check_version()
        self.name = ENGINE_NAME
        self.options = options or NvcompConfig.from_ds_config(_compat.raw_config(config_params))
        if zero_stage is None and config_params is not None:
            zero_stage = config_params.zero_optimization_stage
        self._zero_stage = int(zero_stage or 0)
        self._node_local = _compat.node_local_storage(config_params)
        self._zipfile = _compat.zipfile_serialization(config_params)
        self._collective = commit.TorchDistributedCollective(
            timeout_s=self.options.commit_timeout_s
        )
        self._pending: _PendingSave | None = None
        self._manifests: dict[str, manifest.Manifest | None] = {}
        self._checked: set[str] = set()
        if self.options.async_save:
            logger.warning(
                'nvcomp_checkpoint: "async": true is accepted but not implemented yet; '
                "checkpoints are saved synchronously"
            )
        if self._collective.rank == 0:
            logger.info("%s: %s", ENGINE_NAME, json.dumps(self.options.to_json(), sort_keys=True))

    # ----------------------------------------------------------------------------------- save

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start a save; every rank calls it with the same `info`."""
        self._pending = None
        if not _compat.called_from_save_checkpoint():
            return  # a model export: plain torch files, nothing to commit
        tag_dir = Path(info.save_dir) / str(info.tag)
        self._forget(str(tag_dir.resolve()))
        leader = _compat.local_rank() == 0 if self._node_local else None
        try:
            plan = commit.prepare_tag_dir(
                info.save_dir, str(info.tag), rank=self._collective.rank, leader=leader
            )
        except Exception as exc:  # reported by commit, on every rank (see `save`)
            self._pending = _PendingSave(info=info, tag_dir=tag_dir, plan=None, error=exc)
            return
        self._pending = _PendingSave(info=info, tag_dir=tag_dir, plan=plan)

    def save(self, state_dict: Any, path: str) -> None:
        """Write one of DeepSpeed's files at `path` (a staged name while re-saving a tag).

        A failure is kept for `commit`, which reports it on every rank at once: raising here
        would leave the other ranks waiting in the commit until its timeout.
        """
        pending = self._pending
        if pending is None:
            torch.save(state_dict, path, _use_new_zipfile_serialization=self._zipfile)
            return
        if pending.plan is None or pending.error is not None:
            return  # this save has failed already; commit will say so
        try:
            relative = pending.plan.record_path(path)
            shard = api.save(
                state_dict,
                pending.plan.write_path(path),
                algorithm=self.options.algorithm,
                portable=self.options.portable,
                chunk_mb=self.options.chunk_mb,
                durable=True,
            )
            pending.records.append(
                manifest.ShardRecord(
                    path=relative,
                    rank=self._collective.rank,
                    raw_bytes=shard.raw_bytes,
                    file_bytes=shard.file_bytes,
                    crc32=shard.crc32,
                    codecs=shard.codecs,
                )
            )
        except Exception as exc:  # reported by commit, on every rank
            logger.error("rank %d: saving %s failed: %s", self._collective.rank, path, exc)
            pending.error = exc

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Make the checkpoint complete; every rank calls it.

        No rank returns before the manifest is durable; if any rank's save failed, every rank
        raises `CommitError` naming the ranks and their errors, and no manifest is written.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return True
        started = time.monotonic()
        step = _STEP_IN_TAG.search(str(pending.info.tag))
        result = commit.commit_checkpoint(
            pending.tag_dir,
            pending.records,
            collective=self._collective,
            layout=_compat.parallel_layout(self._zero_stage),
            timeout_s=self.options.commit_timeout_s,
            durable=True,
            plan=pending.plan,
            error=pending.error,
            step=int(step.group(1)) if step else None,
            versions=_compat.versions(),
            node_local_storage=self._node_local,
        )
        self._after_commit(pending, result, time.monotonic() - started)
        return True

    def _after_commit(
        self, pending: _PendingSave, result: commit.CommitResult, commit_s: float
    ) -> None:
        """The chores once the checkpoint is complete, on the ranks that own them.

        A failing chore is logged, not raised: the checkpoint is complete and loadable, and an
        exception on one rank here would leave the others in DeepSpeed's closing barrier.
        """
        save_dir, tag = pending.info.save_dir, result.tag
        rank = self._collective.rank
        storage_leader = _compat.local_rank() == 0 if self._node_local else rank == 0
        if storage_leader and pending.info.save_latest:
            # DeepSpeed rewrites it right after (on rank 0 only), without fsync; ours is the
            # durable copy, on every node's storage when that is node-local.
            _chore("pointing latest at the new checkpoint", commit.write_latest, save_dir, tag)
        if rank == 0:
            compat.wrap_recovery_script(save_dir)
        if storage_leader and self.options.keep_last is not None:
            _chore(
                f"keep_last={self.options.keep_last}", commit.apply_retention, save_dir,
                self.options.keep_last, protect={tag}, local_only=self._node_local,
            )
        if rank == 0 and self.options.log_jsonl is not None:
            _append_jsonl(self.options.log_jsonl, _commit_record(pending, result, commit_s))

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed need not clone tensors to the CPU before `save`.

        DeepSpeed clones so that `torch.save` does not write the whole storage behind a view;
        our format stores only the span the tensors view, and compresses on their device.
        """
        return False

    # ----------------------------------------------------------------------------------- load

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one of DeepSpeed's files: ours after the checks, plain torch files as they are."""
        tag_dir = str(Path(path).resolve().parent)
        found = self._manifest(tag_dir)
        relative = Path(os.path.relpath(Path(path).resolve(), tag_dir)).as_posix()
        records = () if found is None else tuple(r for r in found.files if r.path == relative)
        if not records:
            if api.is_shard_file(path):
                raise IncompleteCheckpointError(_unlisted_message(path, tag_dir, found))
            return torch.load(path, map_location=map_location, weights_only=False)
        self._check_file(tag_dir, found, records, relative)
        return api.load(
            path,
            map_location,
            verify=self.options.verify,
            safe_classes=self.options.trusted_classes,
        )

    def _manifest(self, tag_dir: str) -> manifest.Manifest | None:
        """The manifest of `tag_dir` (None: it has none), checked on first use.

        Checked: the checkpoint is complete (all files present with their sizes; an interrupted
        re-save is finished), the parallel layout fits, and the files this rank wrote have
        their sizes and, with `verify`, their CRCs.
        """
        if tag_dir in self._manifests:
            return self._manifests[tag_dir]
        found = None
        if manifest.manifest_path(tag_dir).exists():
            save_dir, tag = os.path.split(tag_dir)
            commit.resolve_load_tag(save_dir, tag, local_only=self._node_local)
            found = manifest.read_manifest(tag_dir)
            manifest.check_layout(
                found, _compat.parallel_layout(self._zero_stage),
                keys=_layout_keys_to_match(), source=tag_dir,
            )
            mine = manifest.verify_files(
                tag_dir, found, ranks=[self._collective.rank], check_crc=self.options.verify,
                local_only=found.node_local_storage,
            )
            self._checked.update(f"{tag_dir}/{r.path}" for r in mine)
        self._manifests[tag_dir] = found
        return found

    def _check_file(
        self,
        tag_dir: str,
        found: manifest.Manifest,
        records: tuple[manifest.ShardRecord, ...],
        relative: str,
    ) -> None:
        """Check a file another rank wrote (e.g. rank 0's model states) before reading it."""
        key = f"{tag_dir}/{relative}"
        if key in self._checked:
            return
        manifest.verify_files(
            tag_dir, dataclasses.replace(found, files=records), check_crc=self.options.verify,
            local_only=found.node_local_storage,
        )
        self._checked.add(key)

    def _forget(self, tag_dir: str) -> None:
        """Drop what was checked about `tag_dir`: it is being written again."""
        self._manifests.pop(tag_dir, None)
        self._checked = {key for key in self._checked if not key.startswith(tag_dir + "/")}


def _layout_keys_to_match() -> tuple[str, ...]:
    """Model-parallel sizes always; the data-parallel size unless only weights are loaded.

    DeepSpeed re-partitions module weights for any data-parallel size, but not ZeRO optimizer
    shards, whose partitioning is fixed by the size they were saved with.
    """
    return ("dp", "tp", "pp") if _compat.optimizer_state_requested() else ("tp", "pp")


def _unlisted_message(path: str, tag_dir: str, found: manifest.Manifest | None) -> str:
    if found is not None:
        return (
            f"{path} is an nvcomp_ckpt_engine shard, but the manifest of {tag_dir} does not list "
            "it: it is not part of that checkpoint"
        )
    save_dir = os.path.dirname(tag_dir)
    complete = commit.find_complete_checkpoints(save_dir)
    hint = (
        f" The newest complete checkpoint in {save_dir} is {complete[0]!r}: load it with "
        f"load_checkpoint({save_dir!r}, tag={complete[0]!r})."
        if complete
        else f" {save_dir} holds no complete checkpoint."
    )
    return (
        f"{tag_dir} holds nvcomp_ckpt_engine shards but no {manifest.MANIFEST_NAME}: its save "
        "did not complete (a rank failed or the job stopped during the save), so it must not be "
        f"loaded.{hint}"
    )


def _commit_record(
    pending: _PendingSave, result: commit.CommitResult, commit_s: float
) -> dict[str, Any]:
    return {
        "event": "commit",
        "unix_time": time.time(),
        "tag": result.tag,
        "save_dir": str(pending.info.save_dir),
        "world_size": result.world_size,
        "files": result.files,
        "raw_bytes": result.raw_bytes,
        "file_bytes": result.file_bytes,
        "ratio": result.raw_bytes / result.file_bytes if result.file_bytes else 1.0,
        "rank0_save_s": time.monotonic() - pending.started - commit_s,
        "commit_s": commit_s,
    }


def _chore(what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        function(*args, **kwargs)
    except Exception:  # see NvcompCheckpointEngine._after_commit
        logger.error("after a complete checkpoint, %s failed", what, exc_info=True)


def _append_jsonl(path: str, record: dict[str, Any]) -> None:
    """One line per commit; a failed log write is reported and never fails the checkpoint."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    except OSError as exc:
        logger.warning("could not append to log_jsonl %s: %s", path, exc)
