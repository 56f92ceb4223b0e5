"""The save/load pipeline on a GPU: nvCOMP on CUDA tensors, bit-exact, and CPU-readable when
portable. Skipped without CUDA (see conftest)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine.container import read_index

from conftest import assert_same_tensor

pytestmark = pytest.mark.gpu


def _state(device: str = "cuda") -> dict:
    torch.manual_seed(0)
    w = (torch.randn(3_000_000, device=device) * 0.02)
    return {
        "module": {"w": w.bfloat16(), "h": w[:1000].half()},
        "master": w,
        "exp_avg": torch.randn(3_000_000, device=device) * 1e-3,
        "exp_avg_sq": torch.rand(3_000_000, device=device) * 1e-6,
        "view": w[5:1005:3],
        "step": torch.tensor(7, device=device),
        "mask": torch.rand(1001, device=device) > 0.5,
        "cpu_offload": torch.randn(100_000),  # ZeRO-Offload state lives in host memory
    }


def _check(a: dict, b: dict) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq", "view", "step", "mask", "cpu_offload"):
        assert_same_tensor(a[key], b[key], key)
    for key in ("w", "h"):
        assert_same_tensor(a["module"][key], b["module"][key], key)


@pytest.mark.parametrize("algorithm", ["auto", "ans", "zstd", "gdeflate", "bitcomp", "cascaded", "lz4", "deflate", "none"])
def test_cuda_state_round_trips_bit_exact(tmp_path, algorithm):
    state = _state()
    info = nce.save(state, tmp_path / "s.nvckpt", algorithm=algorithm, chunk_mb=4)
    out = nce.load(tmp_path / "s.nvckpt")
    assert out["master"].is_cuda and not out["cpu_offload"].is_cuda
    assert out["view"].untyped_storage().data_ptr() == out["master"].untyped_storage().data_ptr()
    _check(state, out)
    _check(state, nce.load(tmp_path / "s.nvckpt", map_location="cpu"))
    if algorithm == "auto":
        assert "ans" in info.codecs
        assert info.ratio > 1.05


def test_auto_uses_ans_typed_modes_and_beats_plain(tmp_path):
    state = {"w": (torch.randn(8_000_000, device="cuda") * 0.02).bfloat16()}
    auto = nce.save(state, tmp_path / "a.nvckpt")
    (storage,) = read_index(tmp_path / "a.nvckpt").storages
    assert storage.codec["name"] == "ans" and storage.codec["library"].startswith("nvcomp ")
    plain = nce.save(state, tmp_path / "z.nvckpt", algorithm="zstd")
    assert auto.ratio >= plain.ratio * 0.98


def test_portable_gpu_file_loads_without_cuda(tmp_path):
    state = _state()
    nce.save(state, tmp_path / "p.nvckpt", portable=True)
    torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                if k != "module"}, tmp_path / "expected.pt")
    code = (
        "import torch, nvcomp_ckpt_engine as nce\n"
        "assert not torch.cuda.is_available()\n"
        f"out = nce.load({str(tmp_path / 'p.nvckpt')!r}, map_location='cpu')\n"
        f"exp = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "for k, v in exp.items():\n"
        "    a, b = v.contiguous().reshape(-1), out[k].contiguous().reshape(-1)\n"
        "    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k\n"
        "print('ok')\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_ans_file_without_cuda_names_the_ways_out(tmp_path):
    nce.save({"w": torch.randn(1000, device="cuda")}, tmp_path / "a.nvckpt", algorithm="ans")
    code = (
        "import nvcomp_ckpt_engine as nce\n"
        "try:\n"
        f"    nce.load({str(tmp_path / 'a.nvckpt')!r}, map_location='cpu')\n"
        "except nce.UnsupportedCheckpointError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "GPU" in done.stdout and "nvcomp-ckpt decompress" in done.stdout, done.stdout + done.stderr[-2000:]


def test_cpu_written_file_loads_onto_the_gpu(tmp_path):
    state = _state("cpu")
    nce.save(state, tmp_path / "c.nvckpt", algorithm="deflate")
    _check(state, nce.load(tmp_path / "c.nvckpt", map_location="cuda"))


def test_async_save_of_cuda_state(tmp_path):
    state = _state()
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = nce.save_async(state, tmp_path / "a.nvckpt", host_budget_bytes=8 << 30)
    state["master"].add_(1.0)
    pending.result(timeout=120)
    out = nce.load(tmp_path / "a.nvckpt")
    assert_same_tensor(out["master"], expected["master"])


@pytest.mark.parametrize("gpu_budget", [0, 64 << 20, 8 << 30])
def test_async_capture_left_on_the_gpu_is_immune_to_the_next_steps(tmp_path, gpu_budget):
    """With a GPU budget the save returns before its payloads reach host memory; the live
    state, stored-raw chunks (incompressible bytes) included, may change at once."""
    state = _state()
    state["noise"] = torch.randint(0, 256, (5_000_000,), dtype=torch.uint8, device="cuda")
    expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = nce.save_async(state, tmp_path / "a.nvckpt", host_budget_bytes=8 << 30,
                             gpu_budget_bytes=gpu_budget, gpu_batch_mb=4, gpu_snapshot=False)
    assert (pending.device_bytes > 0) == (gpu_budget > 0) and pending.snapshot_bytes == 0
    assert pending.device_bytes <= max(gpu_budget, 3 * (4 << 20))  # the budget, or the window
    for key in ("master", "exp_avg", "exp_avg_sq", "noise"):
        state[key].add_(1)
    pending.result(timeout=120)
    out = nce.load(tmp_path / "a.nvckpt")
    for key in ("master", "exp_avg", "exp_avg_sq", "noise"):
        assert_same_tensor(out[key], expected[key], key)


def _frozen(state: dict) -> dict:
    """A copy of `state`'s top-level tensors as they are now, strides kept (a view's too)."""
    return {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).copy_(v)
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def _layout(path) -> list:
    """What a file's index says of its storages, less the compressed bytes: two GPU saves of
    one state were seen to differ in their files on an H100, so two saves compare by their
    chunking, codecs and tensors, and by their loads (bit for bit)."""
    index = read_index(path)
    return [(s.nbytes, s.dtype, s.codec, s.transform, [(c.raw_length, c.stored_raw) for c in s.chunks])
            for s in index.storages] + [index.tensors]


def _gpu_storage_bytes(state: dict) -> int:
    """The bytes of the distinct GPU storages `state`'s tensors view (each viewed whole here)."""
    storages = {}
    for value in [*state.values(), *state["module"].values()]:
        if isinstance(value, torch.Tensor) and value.is_cuda:
            storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def test_a_snapshot_save_waits_for_the_copy_only_and_writes_the_sync_file(tmp_path):
    """Where the GPU budget holds a raw copy of the state, the save copies it on the GPU and
    returns; the state may change at once (the optimizer's next step, queued after the copy on
    the same stream); the file, encoded beside it, is byte for byte the synchronous save's,
    and loads bit-exact."""
    state = _state()
    state["noise"] = torch.randint(0, 256, (5_000_000,), dtype=torch.uint8, device="cuda")
    expected = _frozen(state)
    nce.save(state, tmp_path / "sync.nvckpt", gpu_batch_mb=4)
    pending = nce.save_async(state, tmp_path / "a.nvckpt", host_budget_bytes=8 << 30,
                             gpu_budget_bytes=1 << 30, gpu_batch_mb=4, gpu_snapshot=True)
    for key in ("master", "exp_avg", "exp_avg_sq", "noise", "step", "cpu_offload"):
        state[key].add_(1)
    state["module"]["w"].zero_()
    assert pending.snapshot_bytes == pending.device_bytes == _gpu_storage_bytes(state)
    assert pending.staged_bytes == expected["cpu_offload"].nbytes and not pending.blocked
    pending.result(timeout=120)
    out = nce.load(tmp_path / "a.nvckpt")
    for key, value in expected.items():
        assert_same_tensor(out[key], value, key)
    assert_same_tensor(out["module"]["w"], expected["master"].bfloat16(), "module.w")
    assert _layout(tmp_path / "a.nvckpt") == _layout(tmp_path / "sync.nvckpt")


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_budget_too_small_for_the_copy_or_no_snapshot_encodes_before_returning(tmp_path, snapshot):
    """Below the raw state's size (or with ``gpu_snapshot=False``) the save encodes as before,
    bit-exact; a budget too small asks for the raw copy's size (`wanted_device_bytes`), which
    the engine then caches for its next save."""
    state = _state()
    expected = _frozen(state)
    budget = _gpu_storage_bytes(state) - 1 if snapshot else 1 << 30
    pending = nce.save_async(state, tmp_path / "a.nvckpt", host_budget_bytes=8 << 30,
                             gpu_budget_bytes=budget, gpu_batch_mb=4, gpu_snapshot=snapshot)
    assert pending.snapshot_bytes == 0
    if snapshot:
        assert pending.wanted_device_bytes >= _gpu_storage_bytes(state)
    state["master"].add_(1)
    pending.result(timeout=120)
    out = nce.load(tmp_path / "a.nvckpt")
    for key, value in expected.items():
        assert_same_tensor(out[key], value, key)


def test_a_snapshot_larger_than_a_cache_segment_is_copied_in_whole_chunks(tmp_path, monkeypatch):
    """The copy is cut into pieces that fit the GPU cache's segments, each a whole number of
    chunks, so the file is chunked as the live state would be."""
    from nvcomp_ckpt_engine.pipeline import encode

    monkeypatch.setattr(encode, "SEGMENT_BYTES", 5 << 20)
    state = _state()
    nce.save(state, tmp_path / "sync.nvckpt", chunk_mb=2, gpu_batch_mb=4)
    pending = nce.save_async(state, tmp_path / "a.nvckpt", host_budget_bytes=8 << 30,
                             gpu_budget_bytes=1 << 30, chunk_mb=2, gpu_batch_mb=4, gpu_snapshot=True)
    assert pending.snapshot_bytes > 0
    pending.result(timeout=120)
    assert _layout(tmp_path / "a.nvckpt") == _layout(tmp_path / "sync.nvckpt")
    _check(nce.load(tmp_path / "a.nvckpt"), state)


def test_snapshot_saves_one_after_another_reuse_the_gpu_memory_of_the_last(tmp_path):
    """The copies go back to the allocator on the training stream, the encoding's working
    memory stays cached on the one snapshot stream: a second save reserves nothing new."""
    state = _state()
    for name in ("1.nvckpt", "2.nvckpt"):
        pending = nce.save_async(state, tmp_path / name, host_budget_bytes=8 << 30,
                                 gpu_budget_bytes=1 << 30, gpu_batch_mb=4, gpu_snapshot=True)
        assert pending.snapshot_bytes > 0
        pending.result(timeout=120)
        torch.cuda.synchronize()
        if name == "1.nvckpt":
            reserved = torch.cuda.memory_reserved()
    assert torch.cuda.memory_reserved() <= reserved
    assert _layout(tmp_path / "1.nvckpt") == _layout(tmp_path / "2.nvckpt")
    _check(nce.load(tmp_path / "2.nvckpt"), state)


def _large_pool_reserved() -> int:
    return torch.cuda.memory_stats()["reserved_bytes.large_pool.current"]


def _save_from_the_cache(state: dict, path, working: int):
    """An async save budgeted from what the allocator has cached (as the engine's are), checked
    to reserve no new large segment during its capture and to defer every payload. (Blocks under
    1 MiB come from the allocator's small pool, 2 MiB segments the cache's growth does not make:
    payloads of tiny storages left waiting may take a few.)"""
    from nvcomp_ckpt_engine.pipeline import gpu_cache

    reserved = _large_pool_reserved()
    pending = nce.save_async(state, path, host_budget_bytes=8 << 30, gpu_batch_mb=4,
                             gpu_budget_bytes=gpu_cache.budget_from_cache(
                                 8 << 30, gpu_cache.cached_free_bytes(), working),
                             gpu_snapshot=False)
    assert _large_pool_reserved() == reserved
    assert pending.device_bytes == pending.wanted_device_bytes > 0
    pending.result(timeout=120)
    assert_same_tensor(nce.load(path)["master"], state["master"], str(path))


def _grow(target: int) -> None:
    from nvcomp_ckpt_engine.pipeline import gpu_cache

    grown = gpu_cache.grow_cache(target, torch.cuda.current_stream(), segment_bytes=64 << 20)
    if grown is not None:
        grown.join()
    assert gpu_cache.cached_free_bytes() >= target


def test_a_save_budgeted_from_the_cache_grown_after_the_first_allocates_nothing(tmp_path):
    """The first save finds too little cached and copies as it encodes (`wanted_device_bytes`
    says what it would have held); once `grow_cache` has cached that, the next save defers all
    its payloads from the cache: the allocator reserves no new memory during its capture."""
    from nvcomp_ckpt_engine.pipeline import gpu_cache

    state = _state()
    working = gpu_cache.working_bytes(4 << 20, 16 << 20)  # the batch, and the default chunk
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    first = nce.save_async(state, tmp_path / "1.nvckpt", host_budget_bytes=8 << 30,
                           gpu_budget_bytes=gpu_cache.budget_from_cache(8 << 30, 0, working),
                           gpu_batch_mb=4, gpu_snapshot=False)
    assert first.device_bytes == 0 and first.wanted_device_bytes > 0
    first.result(timeout=120)
    torch.cuda.synchronize()
    _grow(gpu_cache.cache_target(8 << 30, first.wanted_device_bytes, working))
    _save_from_the_cache(state, tmp_path / "2.nvckpt", working)
    assert_same_tensor(nce.load(tmp_path / "1.nvckpt")["master"], state["master"], "1.nvckpt")


def test_a_first_save_with_its_cache_grown_ahead_from_the_raw_state_allocates_nothing(tmp_path):
    """What the engine caches before a job's first save (`growth_ahead`, from the raw size of
    the state on the GPU) holds every payload of that save: its capture reserves no new memory
    and defers every payload."""
    from nvcomp_ckpt_engine.pipeline import gpu_cache

    state = _state()
    raw = sum(v.untyped_storage().nbytes() for v in state.values() if isinstance(v, torch.Tensor))
    working = gpu_cache.working_bytes(4 << 20, 16 << 20)  # the batch, and the default chunk
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _grow(gpu_cache.growth_ahead(8 << 30, raw, working))
    _save_from_the_cache(state, tmp_path / "1.nvckpt", working)


def test_warm_up_sets_up_every_plan_auto_may_choose_on_the_gpu():
    from nvcomp_ckpt_engine import pipeline

    pipeline.warm_up([torch.float32, torch.bfloat16, torch.int64], torch.device("cuda"),
                     algorithm="auto", portable=False)
    pipeline.warm_up([torch.float32], torch.device("cuda"), algorithm="zstd", portable=True)


def test_gpu_headroom_leaves_the_peak_free():
    from nvcomp_ckpt_engine import pipeline

    free, _ = torch.cuda.mem_get_info()
    headroom = pipeline.gpu_headroom_bytes()
    assert 0 < headroom <= (free + torch.cuda.memory_reserved()) // 2


def test_repeated_async_saves_reuse_the_pinned_arena(tmp_path):
    from nvcomp_ckpt_engine import staging

    state = _state()
    held = []
    for step in range(3):
        expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        pending = nce.save_async(state, tmp_path / f"{step}.nvckpt", host_budget_bytes=8 << 30,
                                 gpu_batch_mb=4)  # many batches: copies overlap encoding
        state["master"].add_(1.0)
        state["exp_avg"].zero_()
        pending.result(timeout=120)
        out = nce.load(tmp_path / f"{step}.nvckpt")
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert_same_tensor(out[key], expected[key], key)
        held.append(staging.ARENA.pinned_bytes)
    assert held[0] > 0 and held[0] == held[1] == held[2]


def test_load_to_host_memory_through_the_gpu_is_bit_exact_for_many_small_storages(tmp_path):
    torch.manual_seed(1)
    state = {f"p{i}": torch.randn(1 + 997 * i, device="cuda").bfloat16() for i in range(300)}
    nce.save(state, tmp_path / "m.nvckpt", gpu_batch_mb=1)
    for location in ("cpu", lambda storage, loc: storage):
        out = nce.load(tmp_path / "m.nvckpt", map_location=location)
        for key, tensor in state.items():
            assert out[key].device.type == "cpu"
            assert_same_tensor(out[key], tensor.cpu(), key)


@pytest.mark.parametrize("algorithm", ["ans", "gdeflate"])
def test_zero_filled_cuda_storages_are_proven_then_load_bit_exact(tmp_path, algorithm):
    """64 MiB of zeros code far past `formats.PLAUSIBLE_EXPANSION`: nvCOMP decodes their chunks
    into scratch first, then into the storage, on the GPU and into host memory alike."""
    from nvcomp_ckpt_engine import formats

    zeros = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    path = tmp_path / "zeros.nvckpt"
    nce.save({"zeros": zeros}, path, algorithm=algorithm)
    (storage,) = read_index(path).storages
    assert storage.codec["name"] == algorithm
    assert storage.nbytes > formats.plausible_raw(sum(c.length for c in storage.chunks))
    assert_same_tensor(zeros, nce.load(path)["zeros"], "on the GPU")
    assert_same_tensor(zeros, nce.load(path, map_location="cpu")["zeros"], "in host memory")


@pytest.mark.parametrize("algorithm", ["ans", "gdeflate"])
def test_a_forged_nvcomp_storage_allocates_a_chunk_at_most_on_the_gpu(tmp_path, algorithm):
    """Chunks of nvCOMP's formats declaring 30,000x their bytes (a 9 GB storage from a file of
    a few hundred KB) fail to prove themselves before the storage is allocated."""
    from nvcomp_ckpt_engine.errors import CorruptCheckpointError
    from test_reliability_files import forge_declared_sizes

    data = torch.randint(0, 4, (1 << 20,), dtype=torch.uint8, device="cuda")
    path = tmp_path / "forged.nvckpt"
    nce.save({"buffer": data}, path, algorithm=algorithm, chunk_mb=1 / 64)
    forge_declared_sizes(path)
    (storage,) = read_index(path).storages
    assert storage.nbytes > 4 << 30
    chunk = max(c.raw_length for c in storage.chunks)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with pytest.raises(CorruptCheckpointError, match="forged.nvckpt.*chunk 0"):
        nce.load(path)
    assert torch.cuda.max_memory_allocated() - before < 4 * chunk + (256 << 20)
