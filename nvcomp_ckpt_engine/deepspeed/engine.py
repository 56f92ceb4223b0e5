"""`NvcompCheckpointEngine`: DeepSpeed's checkpoint files, compressed and committed as a whole.

A thin adapter: compression and the file format live in `nvcomp_ckpt_engine.api`, the
distributed commit in `commit`, the manifest in `manifest`, opening a checkpoint for a load in
`opened`. This module maps DeepSpeed's calls onto them; a save in progress and its commit record
are `saves`, the memory of async saves and what is made ready before them `async_memory`, what a
refused load says to do `remedies`.

Call sequence in DeepSpeed 0.19 `save_checkpoint` (every rank):
    rank 0 makes ``save_dir``; barrier; ``create(info)``; ``save(state, path)`` for each file
    this rank writes (ZeRO shards on every rank, the model states on data-parallel rank 0);
    ``commit(info)``; rank 0 writes ``save_dir/latest``; barrier.
`commit` returns on no rank before the manifest is durable, and rank 0 points ``latest`` at the
tag (atomically, durably) only then, so ``latest`` never names a checkpoint without a manifest.
With ``"local_tier"`` the files go to each node's local folder and `commit` is the local commit
after the replicas (`tiers.tiered.LocalTier`); the drain to ``save_dir`` commits at the next save
or at ``destroy()``, and only then moves ``latest``; a load first restores the tag into every
node's local folder and reads it there (docs/DEEPSPEED.md, "Node-local tier").

`save_16bit_model` goes through the same `create`/`save`/`commit`, but its file is a model
export for other tools (HF ``from_pretrained``, inference servers), so the engine writes it as
DeepSpeed's default engine would (`torch.save`) and commits nothing. It is told apart by the
caller: only `DeepSpeedEngine.save_checkpoint` starts a compressed save
(`_compat.called_from_save_checkpoint`); every rank runs the same method, so all agree.

Load (`load_checkpoint`, every rank, run by `run_load` through a wrapper `_compat` installs):
``load(path, map_location)`` for each file the rank reads; the ranks agree after each of
DeepSpeed's file-reading steps and at the end, so a load that fails on any rank raises the same
error, naming that rank and its file, on every rank (`verdict`).
Before the first load from a tag the engine opens it (`opened.open_checkpoint`, the
framework-neutral step every load takes: complete, an interrupted re-save finished, the manifest
read once and each shard's index once) and checks a known manifest version, the same parallel
layout, and the sizes and (with ``verify``) CRCs of the files this rank wrote; a file written by
another rank (rank 0's model states) is checked when it is first loaded. In a folder the engine
made, only the files its manifest lists are opened, at real paths inside the folder: anything
else placed there, or a link out of it, is refused unread. A universal checkpoint
(``nvcomp-ckpt to-universal``, `universal`) is checked the same way but for its layout, and
loads only with ``"load_universal": true``; its files under ``zero/`` reach `load` through
`_compat.route_universal_loads`. A ZeRO-1/2/3 load at another data-parallel size is resharded
(`reshard.ReshardLoad`: DeepSpeed is shown the files a save at the new size would hold); a load
at another size that cannot be names the conversion command and the ds_config setting that make
it work. Plain torch files in folders
the engine did not make (a job that turns the engine on resumes from its last plain checkpoint)
are read by torch's ``weights_only`` unpickler with the engine's allowlist
(`torchsave.load_file`), which DeepSpeed's own objects pass; ``"trust_plain_checkpoints":
true`` reads them as DeepSpeed's default engine does, ``weights_only=False``. Our own files
never run code from the file: their skeleton goes through the allowlist.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import io
import datetime
import functools
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from .. import (
    api, collectives, commit, compat, container, discovery, manifest, opened, pipeline,
    retention, selection, torchsave, verdict,
)
from ..config import SECTION, NvcompConfig
from ..pipeline import io_path
from ..storage import SinkIO, locations, open_storage
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
from ..siblings import SiblingSources
from ..tiers import transfer
from ..tiers.placement import replicas_for
from ..tiers.tiered import LocalTier
from . import _compat, derived_module, placement, remedies, saves, universal
from .reshard import ReshardLoad, save_layout
from .async_memory import AsyncMemory

logger = logging.getLogger(__name__)

ENGINE_NAME = "NvcompCheckpointEngine"

_STEP_IN_TAG = re.compile(r"global_step(\d+)$")
#: How much of a rank's files a load asks the kernel to read ahead of DeepSpeed (`_prefetch_rest`):
#: what the disk can read while DeepSpeed handles the model states, a few seconds' worth.
PREFETCH_BYTES = 2 << 30


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
        io_path.check_here(self.options.io_path, origin=f"{SECTION}: ")
        if zero_stage is None and config_params is not None:
            zero_stage = config_params.zero_optimization_stage
        self._zero_stage = int(zero_stage or 0)
        self._node_local = _compat.node_local_storage(config_params)
        self._load_universal = _compat.load_universal(config_params)
        self._zipfile = _compat.zipfile_serialization(config_params)
        self._collective = collectives.TorchDistributedCollective(
            timeout_s=self.options.commit_timeout_s
        )
        self._pending: saves.CheckpointSave | None = None
        #: The tags loaded from, opened (None: a folder without a manifest), by real path.
        self._opened: dict[str, opened.OpenedCheckpoint | None] = {}
        #: The tag `resolve_tag` chose on rank 0, opened, for the load that follows.
        self._resolved: dict[str, opened.OpenedCheckpoint] = {}
        self._prefetched: set[str] = set()
        self._committed: set[str] = set()
        #: The file this rank's last failed `load` was reading, for the verdict that follows.
        self._failed_file: str | None = None
        #: The save folder this engine resumed from, its tag, and the newer tags that load passed
        #: over with why: retention says so if it deletes one of them (`_after_commit`).
        self._resumed: _Resume | None = None
        #: This rank's ZeRO partitions decoded while a module was rebuilt, by shard path, kept for
        #: DeepSpeed's optimizer load that follows (`_load_module`).
        self._own_sources: dict[str, _DecodedShard] = {}
        #: The tags being loaded at another data-parallel size than saved, by real path, and
        #: whether the load in progress resharded optimizer state (`after_load`).
        self._reshards: dict[str, ReshardLoad] = {}
        self._resharded = False
        #: What ``save_checkpoint``'s caller asked of ``latest``, while DeepSpeed is told not to
        #: write it itself (`latest_on_store`); None outside such a save.
        self._store_latest: bool | None = None
        #: The memory budgets of async saves and what is made ready before them.
        self.memory = AsyncMemory(self.options)
        #: `auto`'s choices per file, kept from save to save (re-checked now and then).
        self._choices = selection.ChoiceCache()
        #: The node-local tier (None: saves go to the save folder alone); the channel, and the
        #: count, of async saves' replicas sent in the background; whether the save in progress
        #: asked for ``latest`` (`want_latest`), which the drain moves.
        self._replica_channel: transfer.TorchChannel | None = None
        self._async_saves = 0
        #: An async save's persistent commit, running in the drain's thread, and the count of
        #: them (`LocalTier.finish_drain_in_background`).
        self._drain_commit: cf.Future | None = None
        self._drains = 0
        self._tier = self._local_tier()
        self._latest_wanted = True
        if self.options.async_save:
            self.prepin(_compat.initializing_engine())
        if self._collective.rank == 0:
            logger.info("%s: %s", ENGINE_NAME, json.dumps(self.options.to_json(), sort_keys=True))

    def _local_tier(self) -> LocalTier | None:
        """The node-local tier of ``"local_tier"``, checked against the job's nodes now (at
        initialize) so that a bad value fails there, naming the key."""
        options = self.options.local_tier
        if options is None:
            return None
        if self._node_local:
            raise ValueError(
                '"nvcomp_checkpoint": {"local_tier": ...} and DeepSpeed\'s "checkpoint": '
                '{"use_node_local_storage": true} both keep checkpoints on each node: use one')
        per_node = _compat.local_world_size()
        nodes = max(1, self._collective.world_size // per_node)
        if replicas_for(options.replicas, nodes) < options.replicas:
            logger.warning(
                "nvcomp_checkpoint: local_tier.replicas = %d, but the job runs on %d node(s): each "
                "file is copied to the %d other node(s) only", options.replicas, nodes,
                replicas_for(options.replicas, nodes))
        channel = None
        if self._collective.world_size > 1:
            channel = transfer.TorchChannel(self._collective.gloo_group())
            if self.options.async_save:  # the replicas of async saves travel beside training
                self._replica_channel = transfer.TorchChannel(torch.distributed.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.options.commit_timeout_s)))
        return LocalTier(options, self._collective, local_world_size=per_node, channel=channel,
                         timeout_s=self.options.commit_timeout_s)

    def keeps_latest(self) -> bool:
        """True with the node-local tier: ``latest`` moves when the drain has committed the
        persistent copy, so DeepSpeed must not move it at the local commit
        (`_compat.patch_save_checkpoint`)."""
        return self._tier is not None

    def want_latest(self, wanted: bool) -> None:
        """Whether the save starting now asked for ``latest`` (its ``save_latest``)."""
        self._latest_wanted = bool(wanted)

    def prepin(self, engine: Any) -> None:
        """Start pinning the async arena for `engine`'s state in the background
        (`AsyncMemory.prepin`); `integration.enable` calls it for an engine built already."""
        self.memory.prepin(engine)

    @property
    def prepinning(self) -> threading.Thread | None:
        """The background pinning `prepin` started (None: nothing pinned ahead)."""
        return self.memory.prepinning

    # ----------------------------------------------------------------------------------- save

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """DeepSpeed's creation of the save folder and of each file's folder: a folder for a
        path, as DeepSpeed's own engine makes it; nothing for an object-store URL, whose
        prefixes exist by being named (a local folder named ``s3:`` would be made otherwise);
        with the node-local tier, not the tag folder in the save folder: the tag's files go to
        the local tier (`create` made the folder there) and the drain makes the persistent one."""
        if locations.is_url(path):
            return
        pending = self._pending
        if (self._tier is not None and pending is not None
                and os.path.abspath(path) == os.path.abspath(str(pending.tag_dir))):
            return
        super().makedirs(path, exist_ok=exist_ok)

    @contextlib.contextmanager
    def latest_on_store(self, save_latest: bool) -> Iterator[None]:
        """Within a ``save_checkpoint`` to a URL, which DeepSpeed is told not to point ``latest``
        at (it would `open` a local file): whether the caller asked for ``latest``, which the
        engine then publishes through the storage after the commit
        (`_compat.patch_save_checkpoint`)."""
        self._store_latest = save_latest
        try:
            yield
        finally:
            self._store_latest = None

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start a save; every rank calls it with the same `info`.

        An async save still being written is finished (written, committed) first: a new save
        waits for the previous one rather than racing it, or, with ``"async_if_busy":
        "refuse"``, is refused on every rank while the previous one is still being written.
        """
        if self.options.async_if_busy == "refuse" and self._pending is not None:
            busy = self.get_commit_info() is None  # a collective: every rank decides alike
            if busy:
                raise CheckpointError(
                    f"save of {info.tag!r} refused: the async save of "
                    f"{self._pending.info.tag!r} is still being written "
                    '("async_if_busy": "refuse"); it commits at a later step'
                )
        self.wait()
        if not _compat.called_from_save_checkpoint():
            return  # a model export: plain torch files, nothing to commit
        self._finish_drain()
        self._own_sources.clear()
        module = None
        if self._zero_stage in (1, 2):  # a collective: every rank of a ZeRO-1/2 job takes part
            module = derived_module.plan_module(
                self._collective, info.save_dir, str(info.tag), node_local=self._node_local,
                timeout_s=self.options.commit_timeout_s)
        tag_dir = locations.location(info.save_dir) / str(info.tag)
        self._forget(_real(tag_dir))
        leader = _compat.local_rank() == 0 if self._node_local else None
        try:
            if self._tier is not None:
                plan = self._tier.prepare(str(info.tag))
            else:
                plan = commit.prepare_tag_dir(
                    info.save_dir, str(info.tag), rank=self._collective.rank, leader=leader,
                    collective=self._collective, timeout_s=self.options.commit_timeout_s,
                )
        except Exception as exc:  # reported by commit, on every rank (see `save`)
            self._pending = saves.CheckpointSave(info=info, tag_dir=tag_dir, plan=None, error=exc)
            return
        budget = self.memory.host_budget_bytes() if self.options.async_save else 0
        cap = self.memory.gpu_cap_bytes() if self.options.async_save else 0
        self._pending = saves.CheckpointSave(
            info=info, tag_dir=tag_dir, plan=plan, host_budget_bytes=budget, module=module,
            publish_latest=info.save_latest or bool(self._store_latest),
            gpu_budget_bytes=self.memory.gpu_budget_bytes(cap), gpu_cap_bytes=cap,
            layout=save_layout(self._zero_stage))

    def save(self, state_dict: Any, path: str) -> None:
        """Write one of DeepSpeed's files at `path` (a staged name while re-saving a tag).

        A failure is kept for `commit`, which reports it on every rank at once: raising here
        would leave the other ranks waiting in the commit until its timeout.
        """
        pending = self._pending
        if pending is None:
            _export(state_dict, path, zipfile=self._zipfile)
            return
        if pending.plan is None or pending.error is not None:
            return  # this save has failed already; commit will say so
        options = dict(algorithm=self.options.algorithm, portable=self.options.portable,
                       chunk_mb=self.options.chunk_mb, gpu_batch_mb=self.options.gpu_batch_mb,
                       o_direct=self.options.o_direct, io_path=self.options.io_path, durable=True,
                       derive=pending.module.pieces_for if pending.module else None)
        try:
            if pending.module is not None:
                pending.module.check_shard(state_dict, os.path.basename(path))
            if self._tier is not None:
                path = self._tier.relocate(path, str(pending.info.save_dir), str(pending.info.tag))
            relative = pending.plan.record_path(path)
            target = pending.plan.write_path(path)
            if self.options.async_save:
                handle = api.save_async(state_dict, target, host_budget_bytes=max(
                    0, pending.host_budget_bytes), gpu_budget_bytes=max(0, pending.gpu_budget_bytes),
                    start=pending.may_write, pool=self.memory.pool(), choices=self._choices,
                    gpu_snapshot=self.options.async_gpu_snapshot, **options)
                pending.host_budget_bytes -= handle.staged_bytes
                pending.gpu_budget_bytes -= handle.device_bytes
                pending.gpu_held_bytes += handle.device_bytes
                pending.gpu_wanted_bytes += handle.wanted_device_bytes
                pending.gpu_snapshot_bytes += handle.snapshot_bytes
                pending.over_budget |= handle.blocked
                pending.writing.append((relative, handle))
            else:
                shard = api.save(state_dict, target, choices=self._choices, **options)
                pending.records.append(saves.shard_record(relative, self._collective.rank, shard))
        except Exception as exc:  # reported by commit, on every rank
            logger.error("rank %d: saving %s failed: %s", self._collective.rank, path, exc)
            pending.error = exc
        pending.blocked_s = time.monotonic() - pending.started

    # ------------------------------------------------------------------------------ async saves

    def is_decoupled(self) -> bool:
        """True with ``"async": true``: DeepSpeed then commits at a later `step()`, when
        `get_commit_info` says every rank's data is durable."""
        return self.options.async_save

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The pending async save's info once every rank's background writes are done.

        DeepSpeed calls this on every rank at every step boundary; while a save is pending the
        ranks agree through one all-reduce of one integer (`Collective.all_true`), so they all
        commit at the same step (a collective reached by only some ranks would hang).
        """
        pending = self._pending
        if not self.options.async_save:
            return None
        if pending is None:
            if not self._committed:
                self.memory.before_first_save()
            return None
        if not pending.may_write.is_set():  # DeepSpeed is stepping again: save_checkpoint returned
            pending.may_write.set()
            self.memory.grow_after_save(pending.gpu_cap_bytes, pending.gpu_wanted_bytes,
                                        pending.gpu_held_bytes)
            if self._tier is not None:  # every rank, at this same step
                self._replicate_in_background(pending)
        replicated = pending.replication is None or pending.replication.done()
        ready = self._collective.all_true(
            pending.writes_done() and replicated, step="async-ready",
            timeout_s=self.options.commit_timeout_s
        )
        return pending.info if ready else None

    def _replicate_in_background(self, pending: saves.CheckpointSave) -> None:
        """Start sending `pending`'s files to their replica ranks once written, in a thread that
        agrees through the job's store and sends on a group of its own: the deferred commit then
        finds the replicas done, and training is not held for them."""
        self._async_saves += 1
        rank = self._collective.rank
        collective = self._collective.for_background(
            f"nvcomp_ckpt_engine/replicas/{self._async_saves}")
        pending.replication = self._tier.replicate_in_background(
            str(pending.info.tag), pending.plan, lambda: pending.finished_records(rank),
            collective, self._replica_channel)

    def wait(self) -> None:
        """Finish a pending async save now: wait for its writes and commit it (every rank).

        Called by `create` (a new save waits for the previous one) and by DeepSpeed's
        `destroy()` through `cleanup`; call it before exiting a job that does not call
        ``engine.destroy()``, or its last async checkpoint stays uncommitted.
        """
        pending = self._pending
        if pending is not None and self.options.async_save:
            self.commit(pending.info)

    def cleanup(self) -> None:
        """DeepSpeed's ``destroy()`` hook for decoupled engines: commit what is pending, then
        close the async saves' threads."""
        self.wait()
        if self._tier is not None:
            self._finish_drain()
            self._tier.close()
        self.memory.close()

    def committed(self, tag: str) -> bool:
        """True once this engine has committed checkpoint `tag` (its manifest is durable)."""
        return str(tag) in self._committed

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Make the checkpoint complete; every rank calls it.

        No rank returns before the manifest is durable; if any rank's save failed, every rank
        raises `CommitError` naming the ranks and their errors, and no manifest is written.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return True
        # The background replicas read the save's records: done before `collect` takes them in.
        replicated = None if pending.replication is None else pending.replication.result()
        pending.collect(self._collective.rank)
        started = time.monotonic()
        step = _STEP_IN_TAG.search(str(pending.info.tag))
        if self._tier is not None:
            result = self._tier.commit(
                str(pending.info.tag), pending.plan, pending.records, error=pending.error,
                layout=pending.layout or _compat.parallel_layout(self._zero_stage),
                step=int(step.group(1)) if step else None, versions=_compat.versions(),
                replicated=replicated)
            self._committed.add(result.tag)
            self._after_local_commit(pending, result, time.monotonic() - started)
            return True
        result = commit.commit_checkpoint(
            pending.tag_dir,
            pending.records,
            collective=self._collective,
            layout=pending.layout or _compat.parallel_layout(self._zero_stage),
            timeout_s=self.options.commit_timeout_s,
            durable=True,
            plan=pending.plan,
            error=pending.error,
            step=int(step.group(1)) if step else None,
            versions=_compat.versions(),
            node_local_storage=self._node_local,
        )
        self._committed.add(result.tag)
        self._after_commit(pending, result, time.monotonic() - started)
        return True

    def _after_commit(
        self, pending: saves.CheckpointSave, result: commit.CommitResult, commit_s: float
    ) -> None:
        """The chores once the checkpoint is complete, on the ranks that own them.

        A failing chore is logged, not raised: the checkpoint is complete and loadable, and an
        exception on one rank here would leave the others in DeepSpeed's closing barrier.
        """
        save_dir, tag = pending.info.save_dir, result.tag
        rank = self._collective.rank
        storage_leader = _compat.local_rank() == 0 if self._node_local else rank == 0
        if storage_leader and pending.publish_latest:
            # DeepSpeed rewrites it right after (on rank 0 only), without fsync; ours is the
            # durable copy, on every node's storage when that is node-local, and the only one
            # on an object store.
            _chore("pointing latest at the new checkpoint", discovery.write_latest, save_dir, tag)
        if rank == 0:
            compat.wrap_recovery_script(save_dir)
        if storage_leader and self.options.keep_last is not None:
            resumed = self._resumed
            if resumed is not None and resumed.save_dir != _real(save_dir):
                resumed = None  # resumed from another folder: nothing here was passed over
            _chore(
                f"keep_last={self.options.keep_last}", retention.apply_retention, save_dir,
                self.options.keep_last, protect={tag}, local_only=self._node_local,
                resumed_from=resumed.tag if resumed else None,
                passed_over=resumed.passed_over if resumed else None,
            )
        record = saves.commit_record(pending, result, commit_s, asynchronous=self.options.async_save)
        if rank == 0:
            logger.info("%s: %s", ENGINE_NAME, saves.log_line(record))
            if self.options.log_jsonl is not None:
                saves.append_jsonl(self.options.log_jsonl, record)

    def _after_local_commit(self, pending: saves.CheckpointSave, result: commit.CommitResult,
                            commit_s: float) -> None:
        """Once the tag is committed in the node-local tier: its drain started when due, the
        local tier's retention, the save's log line (rank 0)."""
        drained = _chore_result("the drain and the local tier's retention", self._tier.after_commit,
                                result, str(pending.info.save_dir), self._latest_wanted)
        if drained and self.options.async_save:  # committed beside training, not in the next stall
            self._drains += 1
            self._drain_commit = self._tier.finish_drain_in_background(
                self._collective.for_background(f"nvcomp_ckpt_engine/drain/{self._drains}"),
                self._persistent_committed)
        record = saves.commit_record(pending, result, commit_s, asynchronous=self.options.async_save)
        record["tier"] = "local"
        record["draining"] = bool(drained)
        if self._collective.rank == 0:
            logger.info("%s: %s (node-local tier%s)", ENGINE_NAME, saves.log_line(record),
                        ", draining to the save folder" if drained else "")
            if self.options.log_jsonl is not None:
                saves.append_jsonl(self.options.log_jsonl, record)

    def _finish_drain(self) -> None:
        """Commit the persistent copy of the drain in progress (every rank together), then move
        ``latest`` and apply ``keep_last`` in the save folder; for an async save, wait for that
        commit, which runs in the drain's thread once its copies are done. A failed drain is
        logged on every rank alike and leaves the persistent tag incomplete; the local copy
        stays the one a load finds, so the training job goes on."""
        committing, self._drain_commit = self._drain_commit, None
        if committing is not None:
            committing.result()
            return
        if self._tier is None or self._tier.draining is None:
            return
        try:
            done, error = self._tier.finish_drain(), None
        except CheckpointError as exc:
            done, error = None, exc
        self._persistent_committed(done, error)

    def _persistent_committed(self, done: tuple[commit.CommitResult, str, bool] | None,
                              error: Exception | None) -> None:
        """After the persistent copy's commit (`LocalTier.finish_drain`'s result, or its error),
        on every rank: ``latest`` and ``keep_last`` in the save folder (rank 0), or the error
        logged."""
        if error is not None:
            logger.error("rank %d: the persistent copy was not committed: %s",
                         self._collective.rank, error)
            return
        if done is None:
            return
        result, save_dir, latest = done
        if self._collective.rank == 0:
            if latest:
                _chore("pointing latest at the drained checkpoint", discovery.write_latest,
                       save_dir, result.tag)
            compat.wrap_recovery_script(save_dir)
            if self.options.keep_last is not None:
                _chore(f"keep_last={self.options.keep_last}", retention.apply_retention, save_dir,
                       self.options.keep_last, protect={result.tag})

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed need not clone tensors to the CPU before `save`.

        DeepSpeed clones so that `torch.save` does not write the whole storage behind a view;
        our format stores only the span the tensors view, and compresses on their device.
        """
        return False

    # ----------------------------------------------------------------------------------- load

    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one of DeepSpeed's files: ours after the checks, plain torch files as they are.

        In a folder the engine made (`discovery.is_engine_tag`), only the
        files the manifest lists are opened, at their real paths, which must lie inside the
        folder; anything else there (a file planted beside them, a symlink out of the folder)
        is refused before it is opened. Only in folders the engine did not make are plain torch
        files read, through the allowlist (`torchsave.load_file`) unless
        ``trust_plain_checkpoints``. With ``"load_universal": true`` the files of a
        universal checkpoint come here too, from ``TAG/zero/`` (`_compat.route_universal_loads`).
        A module stored as derived from the ZeRO shards' fp32 partitions is rebuilt
        (`_load_module`); the rank's own ZeRO shard reuses the partitions that rebuild decoded.
        """
        try:
            return self._load(path, map_location)
        except Exception:
            self._failed_file = path  # named by the verdict on this load (`run_load`)
            raise

    def _load(self, path: str, map_location: Any) -> Any:
        tag_dir, relative = _tag_folder(path)
        try:
            checkpoint = self._open(tag_dir)
            resharding = self._reshards.get(tag_dir)
            if resharding is not None and resharding.is_optimizer_file(relative):
                self._own_sources.clear()  # partitions of the saved size: of no use to this load
                self._resharded = True
                return resharding.optimizer_file(relative, self._collective,
                                                 self.options.commit_timeout_s)
            records = () if checkpoint is None else checkpoint.records(relative)
            if not records:
                found = None if checkpoint is None else checkpoint.manifest
                copied = found is None and self._copied_by_deepspeeds_converter(tag_dir)
                if copied and api.is_shard_file(path):
                    return opened.load_lone_shard(path, map_location, verify=self.options.verify,
                                                  safe_classes=self.options.trusted_classes,
                                                  gpu_batch_mb=self.options.gpu_batch_mb)
                if found is not None or api.is_shard_file(path):
                    raise IncompleteCheckpointError(remedies.unlisted_message(path, tag_dir, found))
                return torchsave.load_file(path, map_location,
                                           safe_classes=self.options.trusted_classes,
                                           trusted=self.options.trust_plain_checkpoints)
            index = checkpoint.index(relative)
            if resharding is None:  # a reshard reads other ranks' files, and only parts of them
                self._prefetch_rest(tag_dir, checkpoint.manifest, relative)
            if index is None:  # a listed file that is no shard: `load` says what it is
                return api.load(checkpoint.checked(relative), map_location,
                                verify=self.options.verify)
            if index.derived_files:
                loaded = self._load_module(index, checkpoint, map_location)
                return loaded if resharding is None else resharding.model_states(loaded)
            options = dict(verify=self.options.verify, safe_classes=self.options.trusted_classes,
                           gpu_batch_mb=self.options.gpu_batch_mb)
            cached = self._own_sources.pop(index.path, None)
            if (cached is not None and map_location in ("cpu", torch.device("cpu"))
                    and _compat.loading_zero_shards()):
                return api.load_shard(index, cached.location, trusted=False,
                                      decoded=cached.storages, **options)
            loaded = api.load_shard(index, self._placement(index, records, map_location),
                                    trusted=False, **options)
            return loaded if resharding is None else resharding.model_states(loaded)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{exc}{self._intact_hint(tag_dir)}") from exc

    def _intact_hint(self, tag_dir: str) -> str:
        """Where to resume from instead of the damaged checkpoint in `tag_dir`."""
        save_dir, tag = os.path.split(tag_dir)
        newest = discovery.newest_intact_checkpoint(
            save_dir, exclude=[tag], local_only=self._node_local,
            crc_of=opened.ShardIndexes().crc if self.options.verify else None,
        )
        if newest is None:
            return f". {save_dir} holds no other intact checkpoint"
        if self.options.fallback_to_complete:  # a load that chose the tag falls back to it
            return f". The newest intact checkpoint in {save_dir} is {newest!r}"
        return (
            f". The newest intact checkpoint in {save_dir} is {newest!r}: load it with "
            f"load_checkpoint({save_dir!r}, tag={newest!r}); or resume with "
            '"fallback_to_complete": true, which falls back past such damage on every rank '
            'together ("fallback_to_complete": "verify" reads every byte of the newest '
            "checkpoint before resuming)"
        )

    def _load_module(self, index: container.ShardIndex, checkpoint: opened.OpenedCheckpoint,
                     map_location: Any) -> Any:
        """A file with derived storages (a ZeRO-1/2 module), rebuilt from the shards it names.

        Inside DeepSpeed's ``load_checkpoint``, with every source owned by a member of the
        data-parallel group: the group all-gathers the ranks' own cast partitions
        (`derived_module.ModuleGather`); the partitions stay decoded for the optimizer load
        that follows. Otherwise each source is read here (`api.load`, as every tool does).
        """
        tag_dir = str(checkpoint.tag_dir)
        folder = locations.location(index.path).parent
        records = {
            name: checkpoint.records(_relative(folder / name, tag_dir))
            for name in index.derived_files
        }
        owners = {name: found[0].rank for name, found in records.items() if found}
        own: _OwnSources | None = None

        def source(name: str, key: str) -> torch.Tensor:
            return own.tensor(name, key)  # set below, before the first fill

        engine = _compat.loading_engine()
        gather = derived_module.module_gather(engine, owners, source)
        reached = False

        def fill(shard: container.ShardIndex, outs: dict[int, torch.Tensor]) -> None:
            nonlocal reached
            reached = True
            gather.fill(shard, outs)

        try:
            files, indexes = checkpoint.sources(index)
            # The derived ranges' sizes, bounded by their sources (from the indexes, and
            # implausible source storages proven by decoding) before anything is allocated.
            siblings = SiblingSources(folder, files=files, indexes=indexes,
                                      verify=self.options.verify, within=tag_dir)
            siblings.check_for_load(index)
            self._own_sources = {p: d for p, d in self._own_sources.items() if _lies_under(p, tag_dir)}
            own = _OwnSources(self, indexes, records, keep=_compat.optimizer_state_requested())
            options = dict(verify=self.options.verify, safe_classes=self.options.trusted_classes,
                           gpu_batch_mb=self.options.gpu_batch_mb)
            if engine is not None:
                map_location = self._module_placement(index, map_location)
            return api.load_shard(index, map_location, trusted=False,
                                  fill_derived=siblings.fill if gather is None else fill, **options)
        except Exception as exc:
            if gather is not None and not reached:  # the others wait in the rebuild's status
                gather.fail(exc, index.path)  # exchange: tell them, whatever failed first
            raise

    def run_load(self, load: Callable[[str | None], Any], load_dir: str, tag: str | None, *,
                 universal: bool) -> Any:
        """DeepSpeed's ``load_checkpoint(load_dir, tag)``, with one verdict on every rank;
        `load` runs DeepSpeed's own method for a tag (`_compat.patch_load_checkpoint`). Every
        rank calls it.

        - The tag: with none given, `resolve_tag` chooses it (rank 0 decides, every rank
          follows; nothing to resume: DeepSpeed's ``(None, None)``, unless the folder holds only
          a universal checkpoint, `check_fresh_start`); the engine opens it (`open_tag`) before
          DeepSpeed looks for its files. A universal load (``"load_universal": true``) reads
          ``latest_universal`` as DeepSpeed does, unless ``latest`` names a later step
          (`check_universal_load`), its files routed here (`_compat.route_universal_loads`).
        - The verdict: each step of DeepSpeed's load that reads files ends in an agreement of
          every rank (`_compat.agreed_load_steps`), and so do the opening and the load as a
          whole (`verdict.agree`): if the load fails on any rank (a damaged or missing file, a
          refused layout, a codec this node lacks, a decode error), every rank raises the same
          error type, naming the rank and the file at fault, before any rank returns, and no
          rank waits in a collective that the failed rank never reaches.
        - The fallback: with ``fallback_to_complete`` and no tag given, a load that fails on any
          rank because the checkpoint's files are damaged, missing or undecodable
          (`verdict.DAMAGE_KINDS`) is retried, by every rank together, from the newest intact
          checkpoint not tried yet, with a warning naming what was wrong. The load that succeeds
          sets again everything the failed one had set (module, optimizer, scheduler, steps).
        """
        if universal:
            if tag is None:
                self.check_universal_load(load_dir)
            with _compat.route_universal_loads(self.load):
                return self._agreed_load(load, load_dir, tag)
        if self._tier is not None:
            restored = self._agreed("local-tier-restore", f"restoring a checkpoint of {load_dir} "
                                    "into the node-local tier", self._tier.restore, load_dir, tag)
            if restored is not None:  # else no tier holds one of ours: `save_dir` as without
                load_dir, tag = os.fspath(restored.root), restored.tag
                load = functools.partial(load, where=load_dir)
        chosen = tag is None
        if chosen:
            tag = self.resolve_tag(load_dir)
            if tag is None:
                self.check_fresh_start(load_dir)
                return None, None  # nothing to resume: DeepSpeed's own answer
        passed_over: dict[str, str] = {}
        while True:
            try:
                self._agreed("load-open", f"opening checkpoint {tag!r} of {load_dir}",
                             self.open_tag, load_dir, tag)
                result = self._agreed_load(load, load_dir, tag)
            except CheckpointError as exc:
                fault = getattr(exc, "fault", None)
                if not (chosen and self.options.fallback_to_complete
                        and isinstance(fault, verdict.Fault) and fault.damage):
                    raise
                passed_over[str(tag)] = fault.describe()
                tag = self._fall_back(load_dir, passed_over, exc)
                continue
            self._resumed = _Resume(_real(load_dir), str(tag), passed_over)
            return result

    def _agreed_load(self, load: Callable[[str | None], Any], load_dir: str,
                     tag: str | None) -> Any:
        """`load(tag)`, each of its file-reading steps and its end agreed on every rank."""
        what = f"load_checkpoint({load_dir!r}, tag={tag!r})"
        with _compat.agreed_load_steps(lambda step, error: self._agree(step, what, error)):
            return self._agreed("load-end", what, load, tag)

    def _agreed(self, step: str, what: str, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)`, then every rank's outcome agreed (`_agree`)."""
        try:
            result = function(*args)
        except Exception as exc:
            self._agree(step, what, exc)  # raises on every rank, this one included
            raise
        self._agree(step, what, None)
        return result

    def _agree(self, step: str, what: str, error: BaseException | None) -> None:
        """One verdict on every rank for the outcome of `step` (`verdict.agree`), naming the file
        this rank's failed `load` was reading, if one failed."""
        path, self._failed_file = self._failed_file, None
        verdict.agree(self._collective, error, what=what, step=step,
                      timeout_s=self.options.commit_timeout_s,
                      path=path if error is not None else None)

    def _fall_back(self, load_dir: str, passed_over: dict[str, str], error: CheckpointError) -> str:
        """The tag to load instead of those in `passed_over`, which failed: the newest intact
        checkpoint left, as rank 0 finds it (every rank follows). None left: `error`, saying so."""
        decision: dict[str, Any] = {"tag": None, "error": None}
        if self._collective.rank == 0:
            try:
                decision["tag"] = discovery.newest_intact_checkpoint(
                    load_dir, exclude=list(passed_over), local_only=self._node_local,
                    check_crc=self.options.fallback_to_complete == "verify",
                    crc_of=opened.ShardIndexes().crc if self.options.verify else None)
            except (OSError, CheckpointError) as exc:
                decision["error"] = f"{type(exc).__name__}: {exc}"
        decisions = self._collective.all_gather_object(
            decision, step="fall-back", timeout_s=self.options.commit_timeout_s)
        tag, problem = decisions[0]["tag"], decisions[0]["error"]
        if tag is None:
            why = f"looking for it failed: {problem}" if problem else "there is none"
            raised = type(error)(f"{error}; no intact checkpoint of {load_dir} is left to fall "
                                 f"back to ({why})")
            raised.fault = getattr(error, "fault", None)  # type: ignore[attr-defined]
            raise raised from error
        if self._collective.rank == 0:
            logger.warning("%s; falling back to the newest intact checkpoint %r of %s "
                           '("fallback_to_complete")', error, tag, load_dir)
        return str(tag)

    def resolve_tag(self, load_dir: str) -> str | None:
        """The tag `load_checkpoint(load_dir)` should load when the caller names none.

        DeepSpeed trusts ``latest``, which it writes without fsync: after a crash it can be
        missing, empty, or name a checkpoint whose save never completed; and a file of a
        complete checkpoint can be damaged later. Rank 0 decides (so every rank loads the same
        tag) and the others follow. It checks the sizes of every file of the checkpoint it
        chooses and, with ``verify``, the CRC-32 each shard's index records against the
        manifest (``"fallback_to_complete": "verify"``: every byte):
        - ``latest`` names a checkpoint that passes, or a plain DeepSpeed one (no shards of
          ours): that tag;
        - otherwise, with ``fallback_to_complete``: the newest checkpoint that passes, with a
          warning naming it; without: `IncompleteCheckpointError` naming it and the option;
        - nothing to resume at all (no ``latest``, no complete checkpoint): None, DeepSpeed's
          fresh start.
        """
        decision: dict[str, Any] = {"tag": None, "error": None}
        if self._collective.rank == 0:
            try:
                tag, checkpoint = _resolve_tag(load_dir, self.options, self._node_local)
                if checkpoint is not None:
                    self._resolved[_real(checkpoint.tag_dir)] = checkpoint
                decision["tag"] = tag
            except IncompleteCheckpointError as exc:
                decision["error"] = str(exc)
        decisions = self._collective.all_gather_object(
            decision, step="resolve-tag", timeout_s=self.options.commit_timeout_s
        )
        if decisions[0]["error"] is not None:
            raise IncompleteCheckpointError(decisions[0]["error"])
        return decisions[0]["tag"]

    def open_tag(self, load_dir: str, tag: str) -> None:
        """Open the tag `load_checkpoint` is about to read, before DeepSpeed looks for its
        files: one with a file missing is refused naming what it lacks, and this rank's own
        files are checked (sizes; with `verify`, their index CRCs), in a step every rank agrees
        on (`run_load`) before DeepSpeed's own collectives. The rest of `_open`'s checks (the
        parallel layout, which depends on what DeepSpeed's load asks for, the same on every
        rank) run at the first file DeepSpeed loads, on the checkpoint opened here."""
        self._resharded = False
        tag_dir = _real(locations.location(load_dir) / str(tag))
        checkpoint = self._opened.get(tag_dir) or self._resolved.get(tag_dir)
        if tag_dir not in self._opened and checkpoint is None and discovery.is_engine_tag(tag_dir):
            save_dir, name = os.path.split(tag_dir)
            checkpoint = self._resolved[tag_dir] = opened.open_checkpoint(
                save_dir, name, verify=self.options.verify, local_only=self._node_local)
        if checkpoint is not None:  # this rank's own files: their failure is this rank's alone
            checkpoint.check(r for r in checkpoint.manifest.files if r.rank == self._collective.rank)

    def resizes_zero3(self, load_dir: str, tag: str) -> bool:
        """Whether the load of `tag` (opened by `open_tag`) is a ZeRO-3 checkpoint of ours at
        another data-parallel size: then every rank reads rank 0's model-states file, as
        DeepSpeed's universal load does (`_compat.model_states_of_rank_0`), since a rank past
        the saved size has none of its own."""
        tag_dir = _real(locations.location(load_dir) / str(tag))
        checkpoint = self._opened.get(tag_dir) or self._resolved.get(tag_dir)
        if checkpoint is None or universal.is_universal(checkpoint.manifest):
            return False
        saved, current = checkpoint.manifest.layout, _compat.parallel_layout(self._zero_stage)
        return (saved.get("zero_stage") == current.get("zero_stage") == 3
                and "zero_partitions" in saved and saved.get("dp") != current.get("dp"))

    def check_universal_load(self, load_dir: str) -> None:
        """Refuse a universal load (``"load_universal": true``, no tag) that would roll back:
        `load_dir`'s ``latest`` names a checkpoint of a later step than ``latest_universal``,
        which DeepSpeed's universal load follows. Every rank reads the same pointers, so every
        rank raises alike."""
        newer = discovery.newer_than_universal(load_dir)
        if newer is not None:
            latest, universal_tag = newer
            raise UnsupportedCheckpointError(
                f"{load_dir}: latest names {latest!r}, a later step than {universal_tag!r}, which "
                f'latest_universal names and "load_universal": true would load, rolling training '
                f'back. Take "load_universal" out of ds_config: this engine loads {latest!r} at '
                "any data-parallel size (ZeRO-1, 2, 3) or names the conversion it needs; or load "
                f"the universal checkpoint by its tag, load_checkpoint({load_dir!r}, "
                f"tag={universal_tag!r})")

    def check_fresh_start(self, load_dir: str) -> None:
        """Refuse a fresh start (nothing to resume) from a folder that holds a universal
        checkpoint (``latest_universal``, no usable ``latest``): a job pointed at it would
        otherwise train from its first step without a word. Every rank reads the same pointer,
        so every rank raises alike."""
        pointer = discovery.inspect_latest(load_dir, name=discovery.LATEST_UNIVERSAL_NAME)
        if pointer.tag is not None and not self._load_universal:
            raise UnsupportedCheckpointError(
                f"{load_dir} holds no checkpoint to resume but a universal one "
                f"({discovery.LATEST_UNIVERSAL_NAME} names {pointer.tag!r}), which a plain "
                "load_checkpoint does not read: load the checkpoint it was converted from (this "
                "engine loads ZeRO-1/2/3 checkpoints at any data-parallel size), or set "
                '"checkpoint": {"load_universal": true} in ds_config')

    def after_load(self, engine: Any) -> None:
        """Called once DeepSpeed's `load_checkpoint` has returned: after a reshard, the
        optimizer's per-parameter views of the loaded states are linked (`ReshardLoad`)."""
        if self._resharded:
            self._resharded = False
            _compat.link_optimizer_states(engine)

    def _open(self, tag_dir: str) -> opened.OpenedCheckpoint | None:
        """`tag_dir` opened (None: not a tag folder of ours, `discovery.is_engine_tag`), checked
        on first use; IncompleteCheckpointError for one of ours whose save did not complete.

        Checked: the checkpoint is complete (all files present with their sizes; an interrupted
        re-save is finished), the parallel layout fits, and the files this rank wrote have
        their sizes and, with `verify`, their CRCs. The manifest is read once, and so is each
        index: on rank 0, by the `resolve_tag` that chose this tag.
        """
        if tag_dir in self._opened:
            return self._opened[tag_dir]
        checkpoint = None
        if discovery.is_engine_tag(tag_dir) and not self._copied_by_deepspeeds_converter(tag_dir):
            save_dir, tag = os.path.split(tag_dir)
            checkpoint = self._resolved.pop(tag_dir, None) or opened.open_checkpoint(
                save_dir, tag, verify=self.options.verify, local_only=self._node_local)
            found = checkpoint.manifest
            self._check_kind(tag_dir, found)
            if not universal.is_universal(found):
                current, keys = _compat.parallel_layout(self._zero_stage), _layout_keys_to_match()
                resharding = ReshardLoad.for_load(checkpoint, current, keys,
                                                  safe_classes=self.options.trusted_classes)
                if resharding is not None:  # its files are checked as they are read
                    self._reshards[tag_dir], keys = resharding, ("tp", "pp")
                manifest.check_layout(
                    found, current, keys=keys, source=tag_dir,
                    remedy=remedies.elastic_remedy(save_dir, tag, found),
                )
            if tag_dir not in self._reshards:
                checkpoint.check(r for r in found.files if r.rank == self._collective.rank)
        self._opened[tag_dir] = checkpoint
        return checkpoint

    def _copied_by_deepspeeds_converter(self, tag_dir: str) -> bool:
        """Whether a universal load reads a folder DeepSpeed's ``ds_to_universal`` wrote from a
        checkpoint of ours: its ``zero/`` files are plain, and it copied our model-states shards
        into it byte for byte, with no manifest (which only a complete save or `to-universal`
        writes) and no tag marker (which every save of ours writes before its first shard). Each
        such shard is read on its own, checked by its index and CRCs as `nvcomp_ckpt_engine.load`
        reads any shard, as the ``torch.load`` of the import hook reads it with the engine off;
        a ZeRO-1/2 model-states shard whose module is derived from the optimizer shards, which
        the converter does not copy, is rebuilt from the checkpoint it was copied out of, found
        beside the folder (`opened.load_lone_shard`), or refused naming the absent source."""
        return (self._load_universal
                and any(entry.is_prefix and entry.key == "zero"
                        for entry in open_storage(tag_dir).list(""))
                and not discovery.is_engine_tag(tag_dir, read_files=False))

    def _check_kind(self, tag_dir: str, found: manifest.Manifest) -> None:
        """A universal checkpoint loads only with ``"load_universal": true``, and such a load
        only from a universal checkpoint: either mistake would load the wrong files."""
        is_universal = universal.is_universal(found)
        if self._load_universal and not is_universal:
            save_dir, tag = os.path.split(tag_dir)
            raise UnsupportedCheckpointError(
                f'{tag_dir} is not a universal checkpoint, but ds_config sets "checkpoint": '
                f'{{"load_universal": true}}. Convert it once: {remedies.to_universal_command(save_dir, tag)}, '
                f"then load_checkpoint({remedies.universal_dir(save_dir)!r})"
            )
        if is_universal and not self._load_universal:
            raise UnsupportedCheckpointError(
                f'{tag_dir} is a universal checkpoint: load it with "checkpoint": '
                f'{{"load_universal": true}} in ds_config'
            )

    def _prefetch_rest(self, tag_dir: str, found: manifest.Manifest, loading: str) -> None:
        """At the first load from a tag, start reading this rank's other files of it.

        DeepSpeed loads the model states first (twice: once only to check the model-parallel
        size), decodes and copies them, and only then asks for this rank's optimizer shard; the
        disk would idle meanwhile. A module-only load reads no optimizer shard: nothing to start.
        """
        if tag_dir in self._prefetched or not _compat.optimizer_state_requested():
            return
        self._prefetched.add(tag_dir)
        rank = self._collective.rank
        mine = [r.path for r in found.files if r.rank == rank and r.path != loading]
        if mine:
            open_storage(tag_dir).prefetch(mine, PREFETCH_BYTES)

    def _module_placement(self, index: container.ShardIndex, requested: Any) -> Any:
        """Where DeepSpeed's load of a derived module is decoded: onto the GPU, where it is
        rebuilt from the partitions and where DeepSpeed copies the module next (a GPU-to-GPU copy
        then, instead of a round trip through host memory), when `load_to_gpu` allows
        (`placement`); else where DeepSpeed asks (its callable keeps what it is given)."""
        if self.options.load_to_gpu is False or not torch.cuda.is_available() or not callable(requested):
            return requested
        device = torch.device("cuda", torch.cuda.current_device())
        mapped = placement.shard_map_location(
            [(entry.device, entry.nbytes) for entry in index.storages], mode=self.options.load_to_gpu,
            device=device, available_bytes=placement.available_gpu_bytes(device), path=index.path)
        return requested if mapped is None else mapped

    def _placement(self, index: container.ShardIndex, records: tuple[manifest.ShardRecord, ...],
                   requested: Any, *, zero_load: bool | None = None) -> Any:
        """Where a file is decoded: the GPU for this rank's own ZeRO shard when `load_to_gpu`
        allows (`placement`), else `requested`, DeepSpeed's map_location. `zero_load`: whether
        DeepSpeed's ZeRO load asks (default: look at the call stack).

        Another rank's shard (an elastic load reads them all) stays where DeepSpeed asks.
        """
        if (
            self.options.load_to_gpu is False
            or not torch.cuda.is_available()
            or requested not in ("cpu", torch.device("cpu"))
            or any(r.rank != self._collective.rank for r in records)
            or not (_compat.loading_zero_shards() if zero_load is None else zero_load)
        ):
            return requested
        device = torch.device("cuda", torch.cuda.current_device())
        mapped = placement.shard_map_location(
            [(entry.device, entry.nbytes) for entry in index.storages],
            mode=self.options.load_to_gpu, device=device,
            available_bytes=placement.available_gpu_bytes(device), path=index.path,
        )
        return requested if mapped is None else mapped

    def _forget(self, tag_dir: str) -> None:
        """Drop what was checked about `tag_dir`: it is being written again."""
        self._own_sources.clear()
        self._reshards.pop(tag_dir, None)
        self._opened.pop(tag_dir, None)
        self._resolved.pop(tag_dir, None)
        self._prefetched.discard(tag_dir)


@dataclasses.dataclass(frozen=True)
class _Resume:
    """What a load resumed from: the save folder (real path), the tag loaded, and the tags it
    passed over, newer ones that failed to load, with why."""

    save_dir: str
    tag: str
    passed_over: dict[str, str]


@dataclasses.dataclass
class _DecodedShard:
    """Storages of one ZeRO shard decoded ahead of its load, and the map_location they used."""

    location: Any
    storages: dict[int, torch.Tensor]


class _OwnSources:
    """The module rebuild's source tensors this rank decodes: tensors of its own ZeRO shards,
    decoded where DeepSpeed's optimizer load will want them and, with `keep`, kept for it in
    the engine's cache (so the shard's fp32 partitions are read once per load)."""

    def __init__(self, engine: NvcompCheckpointEngine, indexes: dict[str, container.ShardIndex],
                 records: dict[str, tuple[manifest.ShardRecord, ...]], *, keep: bool) -> None:
        self.engine, self.indexes, self.records, self.keep = engine, indexes, records, keep
        self.decoded: dict[str, _DecodedShard] = {}  # for this rebuild, kept or not

    def tensor(self, name: str, key: str) -> torch.Tensor:
        index = self.indexes[name]
        entry = next((t for t in index.tensors if t.key == key), None)
        if entry is None:
            raise CorruptCheckpointError(f"{index.path}: the module is derived from its tensor {key!r}, "
                                         "which it does not hold")
        cached = self.decoded.get(index.path) or self.engine._own_sources.get(index.path)
        if cached is None:
            location = self.engine._placement(index, self.records[name], "cpu", zero_load=True)
            cached = _DecodedShard(location, {})
            if self.keep:
                self.engine._own_sources[index.path] = cached
        self.decoded[index.path] = cached
        if entry.storage not in cached.storages:
            device = pipeline.destination(index.storages[entry.storage].device, cached.location)
            with locations.open_reader(index.path) as reader, cf.ThreadPoolExecutor(
                    pipeline.default_workers(), thread_name_prefix="nvckpt-own") as pool:
                cached.storages[entry.storage] = pipeline.read_storage(
                    reader, index, entry.storage, device or torch.device("cpu"),
                    verify=self.engine.options.verify, pool=pool,
                    batch_bytes=int(self.engine.options.gpu_batch_mb * (1 << 20)))
        return pipeline.view_tensor(cached.storages[entry.storage], entry, index.path).reshape(-1)


def _resolve_tag(load_dir: str, options: NvcompConfig,
                 node_local: bool) -> tuple[str | None, opened.OpenedCheckpoint | None]:
    """`NvcompCheckpointEngine.resolve_tag`, on the rank that decides: the tag, and the
    checkpoint opened when it is one of ours."""
    pointer = discovery.inspect_latest(load_dir)
    if pointer.tag is not None and not discovery.is_engine_tag(locations.location(load_dir) / pointer.tag):
        return pointer.tag, None
    checkpoint = opened.open_checkpoint(
        load_dir, latest=pointer, fresh_start_ok=True, verify=options.verify,
        fallback_to_complete=bool(options.fallback_to_complete), local_only=node_local,
        check_crc=options.fallback_to_complete == "verify", check_indexes=options.verify,
    )
    return (None, None) if checkpoint is None else (checkpoint.tag_dir.name, checkpoint)


def _tag_folder(path: str) -> tuple[str, str]:
    """(real path of the tag folder `path` lies in, `path` relative to it, POSIX; for a URL,
    the tag folder's URL and the key under it).

    The tag folder is the nearest folder above `path` that the engine made
    (`discovery.enclosing_tag_folder`), else the folder holding `path`. `path` itself is not
    resolved: a symlink is judged where it lies, as one of the folder's entries.
    """
    if locations.is_url(path):
        url = locations.location(path)
        folder = discovery.enclosing_tag_folder(url) or url.parent
        return _real(folder), locations.relative_to(url, folder)
    where = Path(os.path.abspath(path))
    folder = discovery.enclosing_tag_folder(where) or where.parent
    return os.path.realpath(folder), where.relative_to(folder).as_posix()


def _export(state_dict: Any, path: str, *, zipfile: bool) -> None:
    """A model export (`save_16bit_model`) written as DeepSpeed's own engine writes it,
    `torch.save`: to the path, or for a URL into a storage sink (the object appears whole)."""
    if not locations.is_url(path):
        torch.save(state_dict, path, _use_new_zipfile_serialization=zipfile)
        return
    with locations.open_sink(path) as sink:
        with io.BufferedWriter(SinkIO(sink), 16 << 20) as f:
            torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile)
        sink.finish()


def _real(where: str | os.PathLike) -> str:
    """`where` as the engine keys what it opened: a path with its links resolved, a URL as it
    is (`locations.real`)."""
    return os.fspath(locations.real(where))


def _relative(where: locations.Location, folder: str) -> str:
    """`where` relative to the tag folder `folder`, '/'-separated, as its manifest names it; a
    path's links are not followed (a link is judged by the name it is listed under)."""
    if locations.is_url(folder):
        return locations.relative_to(where, folder)
    return Path(os.path.relpath(where, folder)).as_posix()


def _lies_under(location: str, folder: str) -> bool:
    """Whether `location` names something under `folder` (both as `_real` gives them)."""
    separator = "/" if locations.is_url(folder) else os.sep
    return location.startswith(folder.rstrip(separator) + separator)


def _layout_keys_to_match() -> tuple[str, ...]:
    """Model-parallel sizes always; the data-parallel size unless only weights are loaded.

    DeepSpeed re-partitions module weights for any data-parallel size, but not ZeRO optimizer
    shards, whose partitioning is fixed by the size they were saved with.
    """
    return ("dp", "tp", "pp") if _compat.optimizer_state_requested() else ("tp", "pp")


def _chore_result(what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`_chore`, returning what `function` returns (None if it failed)."""
    try:
        return function(*args, **kwargs)
    except Exception:  # see NvcompCheckpointEngine._after_commit
        logger.error("after a complete checkpoint, %s failed", what, exc_info=True)
        return None


def _chore(what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        function(*args, **kwargs)
    except Exception:  # see NvcompCheckpointEngine._after_commit
        logger.error("after a complete checkpoint, %s failed", what, exc_info=True)
