"""The adapter contract, run against DeepSpeed, torch.distributed.checkpoint and Megatron-Core.

Each framework saves through the engine the way its users turn it on (DeepSpeed: the
``nvcomp_checkpoint`` section of ds_config; DCP: `NvcompFileSystemWriter`/`Reader`;
Megatron-Core: the ``nvcomp_torch_dist`` strategies), and every one must:
- give back a state of bf16, fp32 and integer tensors bit for bit;
- refuse a checkpoint with one flipped payload byte in a shard, with a `CheckpointError` that
  names the file;
- refuse a checkpoint whose shard file is missing (its manifest or metadata left), never
  loading it silently;
- write with an async save what a sync save of the same state writes, unchanged by updates to
  the state made once the async save has returned.

All run in this process, as one rank of a one-rank gloo group (the group a one-GPU job has);
the frameworks' multi-rank behaviour is in their own test files.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from nvcomp_ckpt_engine import container
from nvcomp_ckpt_engine.errors import CheckpointError

from conftest import assert_same_tensor

#: Small chunks, so every tensor spans several and a flipped byte lands in one of them.
CHUNK_MB = 1 / 256


def reference_state() -> dict[str, torch.Tensor]:
    """The tensors every adapter saves: the dtypes of training state, odd sizes, NaN payloads.

    Every dtype is stored on every machine: DeepSpeed trains here in fp32 and carries these
    tensors as client state, so no accelerator capability (tests/capabilities.py) applies.
    """
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(37, 19, generator=g),
        "bf16": (torch.randn(1001, generator=g) * 0.02).bfloat16(),
        "int64": torch.randint(-(2**40), 2**40, (33,), generator=g),
        "int32": torch.randint(-1000, 1000, (7, 3), generator=g, dtype=torch.int32),
        "special": torch.tensor([0x7FC00001, 0x7F800001, -0x80000000, 1], dtype=torch.int32)
        .view(torch.float32),
    }


def update(state: dict[str, torch.Tensor]) -> None:
    """What a training step after a save does to the state: changes it in place."""
    for value in state.values():
        value.view(torch.uint8).bitwise_xor_(0xFF)


class Adapter(Protocol):
    """One framework driven through the engine."""

    def save(self, state: dict[str, torch.Tensor], directory: Path, *, async_: bool) -> None:
        """Save `state` into `directory`; an async save returns once it has captured the state,
        and `finish` completes it."""

    def finish(self) -> None:
        """Complete a pending async save (its writes and whatever commits it)."""

    def load(self, directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors saved in `directory` (`like` gives their names, dtypes and shapes)."""

    def files(self, directory: Path) -> list[Path]:
        """The compressed shard files of the checkpoint in `directory`."""


def _unwrapped(exc: BaseException) -> BaseException:
    """What a load raised, out of DCP's `CheckpointException` wrapper: the `CheckpointError`
    behind `exc` (itself, its cause or context, or a rank's failure), else the first rank's
    failure, else `exc`."""
    seen: list[BaseException] = []
    stack: list[BaseException | None] = [exc]
    first_failure = None
    while stack:
        e = stack.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, CheckpointError):
            return e
        stack += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values():
            failure = failure[0] if isinstance(failure, tuple) else failure
            first_failure = first_failure or failure
            stack.append(failure)
    return first_failure or exc


# ----------------------------------------------------------------------------- DeepSpeed


class DeepSpeedAdapter:
    """DeepSpeed with the engine switched on in ds_config; the state is the client state of
    `save_checkpoint` next to the module and its ZeRO-1 optimizer."""

    def __init__(self) -> None:
        self._engines: list[Any] = []
        self._pending: Any = None

    def _engine(self, *, async_: bool) -> Any:
        import deepspeed

        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        config = {
            "train_batch_size": 1,
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "nvcomp_checkpoint": {"enabled": True, "algorithm": "zstd", "chunk_mb": CHUNK_MB,
                                  "async": async_},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        assert type(engine.checkpoint_engine).__name__ == "NvcompCheckpointEngine"
        self._engines.append(engine)
        return engine

    def save(self, state: dict[str, torch.Tensor], directory: Path, *, async_: bool) -> None:
        engine = self._engine(async_=async_)
        engine.save_checkpoint(str(directory), tag="t", client_state={"contract": state})
        self._pending = engine if async_ else None

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.checkpoint_engine.wait()
            self._pending = None

    def load(self, directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        engine = self._engine(async_=False)
        path, client = engine.load_checkpoint(str(directory), tag="t")
        assert path is not None, f"DeepSpeed loaded nothing from {directory}"
        return client["contract"]

    def files(self, directory: Path) -> list[Path]:
        return sorted(p for p in (directory / "t").iterdir() if p.suffix == ".pt")

    def close(self) -> None:
        for engine in self._engines:
            engine.destroy()
        self._engines.clear()


# ----------------------------------------------------------------------------------- DCP


class DcpAdapter:
    """`torch.distributed.checkpoint.save/async_save/load` with the engine's writer and reader."""

    def __init__(self) -> None:
        self._pending: Any = None

    def save(self, state: dict[str, torch.Tensor], directory: Path, *, async_: bool) -> None:
        import torch.distributed.checkpoint as dcp

        from nvcomp_ckpt_engine.dcp import NvcompFileSystemWriter

        writer = NvcompFileSystemWriter(directory, algorithm="zstd", chunk_mb=CHUNK_MB)
        if async_:
            response = dcp.async_save(state, storage_writer=writer)
            self._pending = getattr(response, "upload_completion", response)
        else:
            dcp.save(state, storage_writer=writer)

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def load(self, directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        from nvcomp_ckpt_engine.dcp import NvcompFileSystemReader

        loaded = {k: torch.zeros_like(v) for k, v in like.items()}
        try:
            dcp.load(loaded, storage_reader=NvcompFileSystemReader(directory))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise _unwrapped(exc) from exc
        return loaded

    def files(self, directory: Path) -> list[Path]:
        return sorted(directory.glob("*.distcp"))

    def close(self) -> None:
        self.finish()


# ------------------------------------------------------------------------------ Megatron


class MegatronAdapter:
    """Megatron-Core's `dist_checkpointing` with the ``nvcomp_torch_dist`` strategies; an async
    save runs its request the way Megatron's `TemporalAsyncCaller` does (stage now, write,
    then finalize), in this process."""

    def __init__(self) -> None:
        self._pending: Any = None

    @staticmethod
    def _sharded(state: dict[str, torch.Tensor]) -> dict[str, Any]:
        from megatron.core.dist_checkpointing import ShardedTensor

        return {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in state.items()}

    def save(self, state: dict[str, torch.Tensor], directory: Path, *, async_: bool) -> None:
        from megatron.core import dist_checkpointing

        from nvcomp_ckpt_engine import megatron as nm

        directory.mkdir(parents=True, exist_ok=True)
        strategy = nm.NvcompTorchDistSaveShardedStrategy(algorithm="zstd", chunk_mb=CHUNK_MB)
        if not async_:
            dist_checkpointing.save(self._sharded(state), str(directory), sharded_strategy=strategy)
            return
        request = dist_checkpointing.save(self._sharded(state), str(directory),
                                          sharded_strategy=strategy, async_sharded_save=True)
        args = list(request.async_fn_args)
        args[1] = request.preload_fn()
        self._pending = (request, args)

    def finish(self) -> None:
        if self._pending is None:
            return
        request, args = self._pending
        self._pending = None
        request.async_fn(*args, **request.async_fn_kwargs)
        for finalize in request.finalize_fns:
            finalize()

    def load(self, directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from megatron.core import dist_checkpointing

        blank = {k: torch.zeros_like(v) for k, v in like.items()}
        try:
            return dict(dist_checkpointing.load(self._sharded(blank), str(directory)))
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            raise _unwrapped(exc) from exc

    def files(self, directory: Path) -> list[Path]:
        return sorted(directory.glob("*.distcp"))

    def close(self) -> None:
        self.finish()


# ------------------------------------------------------------------------------ fixtures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo group, and the environment DeepSpeed's launcher would set, for the
    module's tests; both gone afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": _extensions_dir()}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        store = tmp_path_factory.mktemp("group") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _needs(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module} ({install})")


def _extensions_dir() -> str:
    """DeepSpeed's JIT-extension folder, the one tests/test_deepspeed_engine.py uses (one per
    Python environment), so its CPU communication op is built once and kept between runs."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    env_id = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    return str(Path.home() / ".cache" / "nvcomp_ckpt_engine" / "torch_extensions" / env_id)


#: DeepSpeed's CPU accelerator builds a C++ op at its first `deepspeed.initialize` (45-75 s):
#: its cases are `slow`, like every other DeepSpeed run.
ADAPTERS = [pytest.param("deepspeed", marks=pytest.mark.slow), "dcp", "megatron"]


@pytest.fixture(params=ADAPTERS)
def adapter(request: pytest.FixtureRequest, one_rank: None) -> Iterator[Adapter]:
    name = request.param
    if name == "deepspeed":
        _needs("deepspeed", "pip install nvcomp_ckpt_engine[deepspeed]")
        made: Any = DeepSpeedAdapter()
    elif name == "dcp":
        made = DcpAdapter()
    else:
        _needs("megatron.core", "pip install megatron-core==0.16.1")
        made = MegatronAdapter()
    try:
        yield made
    finally:
        made.close()


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for key in want:
        assert_same_tensor(got[key].contiguous(), want[key].contiguous(), f"{where}: {key}")


# --------------------------------------------------------------------------------- tests


def test_a_round_trip_is_bit_exact(adapter: Adapter, tmp_path: Path) -> None:
    state = reference_state()
    adapter.save(state, tmp_path / "ckpt", async_=False)
    assert adapter.files(tmp_path / "ckpt"), "no shard files written"
    for path in adapter.files(tmp_path / "ckpt"):
        assert container.is_shard_file(path), path
    _assert_same(adapter.load(tmp_path / "ckpt", reference_state()), reference_state(), "load")


def _flip_payload_byte(path: Path) -> None:
    """One flipped bit in the middle of the largest chunk: indexes and CRCs are untouched."""
    index = container.read_index(path)
    chunk = max((c for s in index.storages for c in s.chunks), key=lambda c: c.length)
    data = bytearray(path.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_payload_byte_is_refused_naming_the_file(adapter: Adapter, tmp_path: Path) -> None:
    adapter.save(reference_state(), tmp_path / "ckpt", async_=False)
    for victim in adapter.files(tmp_path / "ckpt"):
        copy = tmp_path / f"damaged-{victim.name}"
        shutil.copytree(tmp_path / "ckpt", copy)
        damaged = copy / victim.relative_to(tmp_path / "ckpt")
        _flip_payload_byte(damaged)
        with pytest.raises(CheckpointError) as info:
            adapter.load(copy, reference_state())
        assert damaged.name in str(info.value), info.value


def test_a_missing_shard_is_refused(adapter: Adapter, tmp_path: Path) -> None:
    adapter.save(reference_state(), tmp_path / "ckpt", async_=False)
    for victim in adapter.files(tmp_path / "ckpt"):
        copy = tmp_path / f"without-{victim.name}"
        shutil.copytree(tmp_path / "ckpt", copy)
        (copy / victim.relative_to(tmp_path / "ckpt")).unlink()
        with pytest.raises(CheckpointError):
            adapter.load(copy, reference_state())


def test_an_async_save_equals_a_sync_save(adapter: Adapter, tmp_path: Path) -> None:
    adapter.save(reference_state(), tmp_path / "sync", async_=False)
    state = reference_state()
    adapter.save(state, tmp_path / "async", async_=True)
    update(state)  # the training step after the save must not reach the files
    adapter.finish()
    sync = adapter.load(tmp_path / "sync", reference_state())
    _assert_same(adapter.load(tmp_path / "async", reference_state()), sync, "async against sync")
    _assert_same(sync, reference_state(), "sync")
