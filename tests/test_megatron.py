"""Megatron-Core `dist_checkpointing` through the ``nvcomp_torch_dist`` strategies.

Two ranks (gloo) save a small sharded state dict (a row-sharded tensor, a replicated bf16
tensor, a ShardedObject, common state) synchronously, through Megatron's fully parallel save
wrapper, and as an async request, load it back
with a plain ``dist_checkpointing.load`` (which finds our strategy from ``metadata.json``),
reshard it (rows → columns), and read a decompressed copy with stock Megatron-Core.

Megatron-Core's own async scheduler (`AsyncCallsQueue`) calls CUDA unconditionally, so on the
CPU the async request is run the way its `TemporalAsyncCaller` runs it (stage in the training
process, write in a forked process, finalize on all ranks); the test with the real queue
needs a GPU, as does Megatron's FullyParallelLoadStrategyWrapper (it exchanges tensors
through CUDA buffers).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import raw_bytes
from worker_exit import exit_worker_now

# Looked up, not imported: importing Megatron-Core costs ~10 s, and only the workers need it.
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (pip install megatron-core==0.16.1)", allow_module_level=True)

WORLD = 2
CHUNK_MB = 1 / 256


def _entry(rank: int, world: int, store: str, backend: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    exit_worker_now()


def run_ranks(tmp: Path, fn, *args, world: int = WORLD, backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` in `world` processes joined by one process group."""
    store = str(tmp / f"store-{fn.__name__}")
    mp.spawn(_entry, args=(world, store, backend, fn, args), nprocs=world)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 8, generator=g), "b": torch.randn(5, generator=g).bfloat16()}


def sharded_state(rank: int, world: int, *, layout: str = "rows", blank: bool = False) -> dict:
    """Rank `rank`'s sharded state dict: `w` split by rows (or columns), `b` replicated."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    full = full_tensors()
    if layout == "rows":
        w, dim = full["w"].chunk(world, dim=0)[rank], 0
    else:
        w, dim = full["w"].chunk(world, dim=1)[rank], 1
    w, b = w.clone(), full["b"].clone()
    obj = {"rank": rank, "lr": 0.1}
    if blank:
        w, b, obj = torch.zeros_like(w), torch.zeros_like(b), None
    state = {
        "w": ShardedTensor.from_rank_offsets("w", w, (dim, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", b, replica_id=rank),
        "obj": ShardedObject("obj", obj, (world,), (rank,), replica_id=0),
    }
    if not blank:
        state["common"] = {"iteration": 100}
    return state


def check_loaded(loaded: dict, rank: int, world: int, layout: str = "rows") -> None:
    full = full_tensors()
    w = full["w"].chunk(world, dim=0 if layout == "rows" else 1)[rank]
    assert same_bits(loaded["w"], w.contiguous()), f"w on rank {rank}"
    assert same_bits(loaded["b"], full["b"]), f"b on rank {rank}"
    assert loaded["obj"] == {"rank": rank, "lr": 0.1}
    assert loaded["common"] == {"iteration": 100}


def megatron_worker(rank: int, world: int, tmp: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    from nvcomp_ckpt_engine import dcp as ndcp
    from nvcomp_ckpt_engine import megatron as nm

    assert isinstance(get_default_strategy(StrategyAction.LOAD_SHARDED, nm.BACKEND, nm.VERSION),
                      nm.NvcompTorchDistLoadShardedStrategy)

    dist_checkpointing.save(sharded_state(rank, world), f"{tmp}/sync",
                            sharded_strategy=nm.NvcompTorchDistSaveShardedStrategy(chunk_mb=CHUNK_MB))
    # Megatron-LM's --ckpt-fully-parallel-save wraps the strategy; the wrapper keeps ours.
    wrapped = FullyParallelSaveStrategyWrapper(nm.NvcompTorchDistSaveShardedStrategy())
    dist_checkpointing.save(sharded_state(rank, world), f"{tmp}/parallel", sharded_strategy=wrapped)

    state = sharded_state(rank, world)
    request = dist_checkpointing.save(state, f"{tmp}/async", sharded_strategy=(nm.BACKEND, nm.VERSION),
                                      async_sharded_save=True)
    # What Megatron-Core's TemporalAsyncCaller does, minus its CUDA calls: stage in this
    # process, write in a forked one, then finalize on every rank.
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    state["w"].data.add_(1.0)  # the training step after staging must not reach the file
    state["b"].data.zero_()
    process = mp.get_context("fork").Process(target=request.async_fn, args=args,
                                             kwargs=request.async_fn_kwargs)
    process.start()
    process.join()
    assert process.exitcode == 0
    dist.barrier()
    for finalize in request.finalize_fns:
        finalize()

    for name in ("sync", "async", "parallel"):
        loaded = dist_checkpointing.load(sharded_state(rank, world, blank=True), f"{tmp}/{name}")
        check_loaded(loaded, rank, world)
    resharded = dist_checkpointing.load(sharded_state(rank, world, layout="cols", blank=True),
                                        f"{tmp}/sync")
    check_loaded(resharded, rank, world, layout="cols")

    if rank == 0:
        ndcp.decompress_dcp(f"{tmp}/sync", f"{tmp}/plain")
    dist.barrier()
    plain = dist_checkpointing.load(sharded_state(rank, world, blank=True), f"{tmp}/plain",
                                    sharded_strategy=None)
    check_loaded(plain, rank, world)


@pytest.mark.slow
def test_megatron_save_async_load_reshard_and_decompress(tmp_path):
    for name in ("sync", "async", "parallel"):
        (tmp_path / name).mkdir()
    run_ranks(tmp_path, megatron_worker, str(tmp_path))

    from nvcomp_ckpt_engine import dcp as ndcp
    from nvcomp_ckpt_engine import manifest

    for name in ("sync", "async", "parallel"):
        ckpt = tmp_path / name
        assert ndcp.is_dcp_checkpoint(ckpt)
        ndcp.verify_dcp(ckpt)
        found = manifest.read_manifest(ckpt)  # the commit point of the DCP files
        assert [(r.path, r.rank) for r in found.files] == [
            (".metadata", 0), ("__0_0.nvcomp.distcp", 0), ("__1_0.nvcomp.distcp", 1)], name
        assert dict(found.layout) == {"framework": "megatron"}
        assert '"sharded_backend": "nvcomp_torch_dist"' in (ckpt / "metadata.json").read_text()
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == [
            "__0_0.nvcomp.distcp", "__1_0.nvcomp.distcp"]
    assert '"sharded_backend": "torch_dist"' in (tmp_path / "plain" / "metadata.json").read_text()
    assert not (tmp_path / "plain" / "nvcomp_manifest.json").exists()
    assert not ndcp.is_dcp_checkpoint(tmp_path / "plain")


def on_gpu(state: dict) -> dict:
    """`state` with every ShardedTensor's data moved to the current GPU."""
    for value in state.values():
        if isinstance(getattr(value, "data", None), torch.Tensor):
            value.data = value.data.cuda()
    return state


def gpu_queue_worker(rank: int, world: int, tmp: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    from nvcomp_ckpt_engine import megatron as nm

    torch.cuda.set_device(rank)
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(on_gpu(sharded_state(rank, world)), tmp,
                                      sharded_strategy=(nm.BACKEND, nm.VERSION),
                                      async_sharded_save=True)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    queue.close()
    loaded = dist_checkpointing.load(on_gpu(sharded_state(rank, world, blank=True)), tmp)
    check_loaded(loaded, rank, world)
    parallel = FullyParallelLoadStrategyWrapper(nm.NvcompTorchDistLoadShardedStrategy())
    loaded = dist_checkpointing.load(on_gpu(sharded_state(rank, world, blank=True)), tmp,
                                     sharded_strategy=parallel)
    check_loaded(loaded, rank, world)


@pytest.mark.gpu
@pytest.mark.slow
def test_megatron_async_calls_queue_on_gpu(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    (tmp_path / "ckpt").mkdir()
    run_ranks(tmp_path, gpu_queue_worker, str(tmp_path / "ckpt"), backend="cpu:gloo,cuda:nccl")
