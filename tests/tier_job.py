"""A DeepSpeed job with the node-local tier, for tests/test_tiers_ds.py; one process per rank.

Started by torchrun (two launchers, ``--nnodes 2 --nproc_per_node 2``: two simulated nodes on
this machine) with DS_ACCELERATOR=cpu, reusing tests/ds_train.py's tiny model and data:

    tier_job.py PHASE STAGE OUT [async | one-node]

``save``: train, save ``global_step3`` into ``OUT/ckpt`` through the local tier
``OUT/local/node{node}`` (one replica), write this rank's state (``OUT/save_rank<R>.pt``);
``engine.destroy()`` commits the drain. ``load``: a fresh engine (another seed) loads the newest
checkpoint; this rank's state and the bytes it read from files under ``OUT/ckpt`` go to
``OUT/load_rank<R>.pt``. ``async``: an async save, its replicas sent in the background and
committed during the training steps that follow (up to 100: ``committed_while_training``),
drained at ``destroy()``. ``one-node``: a load by a job of one node (``--nnodes 1``) with the
config of the save (``"replicas": 1``, which one node caps at none); the save and this load
also write every parameter's full fp32 master weights and Adam moments (``full``,
`ds_elastic.full_state`), which a resume at another data-parallel size must reproduce (right after a
ZeRO-1/2 load at the saved size, DeepSpeed's `safe_get_full_optimizer_state` fails: its
optimizer fragments are not linked yet).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ds_train  # noqa: E402
from ds_elastic import full_state  # noqa: E402

from nvcomp_ckpt_engine.storage import faults, wrap_storages  # noqa: E402


class _CountingStorage(faults.FaultyStorage):
    """Counts the bytes read through any reader of a storage under the persistent tier."""

    read_bytes = 0

    def open_reader(self, key: str):  # type: ignore[no-untyped-def]
        reader = super().open_reader(key)
        inner = reader.read_into

        def read_into(offset: int, buffer: memoryview) -> None:
            _CountingStorage.read_bytes += len(buffer)
            inner(offset, buffer)

        reader.read_into = read_into  # type: ignore[method-assign]
        return reader


def main() -> None:
    phase, stage, out, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    ckpt = os.path.join(out, "ckpt")
    case = ds_train.Case(stage, "fp32", nvcomp={
        "algorithm": "zstd", "async": mode == ["async"],
        "local_tier": {"path": os.path.join(out, "local", "node{node}"),
                       "replicas": 1}})
    rank = int(os.environ["RANK"])
    try:
        if phase == "save":
            engine = ds_train.make_engine(case, seed=1234, engine_on=True, case_dir=out)
            losses = ds_train.train(engine, range(3))
            engine.save_checkpoint(ckpt, tag="global_step3")
            state = {**ds_train.snapshot(engine, case, losses), "full": full_state(engine)}
            if case.nvcomp["async"]:  # the replicas travel, and the commit comes, while training
                step = 3  # every rank commits at the same step, so all stop at the same one
                while not engine.checkpoint_engine.committed("global_step3") and step < 100:
                    ds_train.train(engine, range(step, step + 1))
                    step += 1
                state["committed_while_training"] = engine.checkpoint_engine.committed("global_step3")
        else:
            wrap_storages(lambda s: _CountingStorage(s) if s.describe().startswith(ckpt) else s)
            engine = ds_train.make_engine(case, seed=999, engine_on=True, case_dir=out)
            path, _ = engine.load_checkpoint(ckpt)
            state = ds_train.snapshot(engine, case, [])
            if mode == ["one-node"]:  # resharded at load, which links the optimizer fragments
                state["full"] = full_state(engine)
            state["load_path"] = path
            state["persistent_read_bytes"] = _CountingStorage.read_bytes
        engine.destroy()
        torch.save(state, os.path.join(out, f"{phase}_rank{rank}.pt"))
    except Exception:
        with open(os.path.join(out, f"failed_{phase}_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
