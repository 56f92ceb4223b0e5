"""save → load is bit-exact for every dtype, shape, stride, sharing pattern and nesting."""

from __future__ import annotations

import collections
import enum
import math

import pytest
import torch
from hypothesis import given, strategies as st

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine.container import DTYPES, read_index

from conftest import assert_same_tensor

ALL_DTYPES = list(DTYPES.values())
CPU_ALGORITHMS = ["auto", "zstd", "deflate", "none"]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of any dtype (NaN payloads included): built as bytes, then viewed."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        data = data % 2
    return data.view(dtype).reshape(shape)


def assert_tree_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert type(a) is type(b), path
        assert a.requires_grad == b.requires_grad, path
        assert_same_tensor(a, b, path)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}/{i}")
    else:
        assert a == b or (a != a and b != b), path


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(shapes)
    t = make_tensor(dtype, shape, draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["plain", "transpose", "slice", "expand"]))
    if kind == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif kind == "slice" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1::2]
    elif kind == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    return t


leaves = st.one_of(
    tensors(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.binary(max_size=8),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=5), children, max_size=4),
        st.dictionaries(st.text(max_size=5), children, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=12,
)


@given(obj=trees, algorithm=st.sampled_from(CPU_ALGORITHMS), chunk_kib=st.sampled_from([1, 4, 1024]))
def test_any_nested_state_round_trips(tmp_path_factory, obj, algorithm, chunk_kib):
    path = tmp_path_factory.mktemp("rt") / "shard.pt"
    nce.save(obj, path, algorithm=algorithm, chunk_mb=chunk_kib / 1024, durable=False)
    assert_tree_equal(obj, nce.load(path))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("algorithm", CPU_ALGORITHMS)
def test_every_dtype_every_cpu_codec(tmp_path, dtype, algorithm):
    state = {
        "big": make_tensor(dtype, (3000, 7), 1),
        "scalar": make_tensor(dtype, (), 2),
        "empty": make_tensor(dtype, (0, 4), 3),
    }
    nce.save(state, tmp_path / "s.pt", algorithm=algorithm, chunk_mb=1 / 64)
    assert_tree_equal(state, nce.load(tmp_path / "s.pt"))


def test_shared_storage_is_stored_once_and_stays_shared(tmp_path):
    base = torch.randn(256, 64)
    state = {"base": base, "row": base[3], "cols": base[:, ::4], "t": base.t(), "tail": base.view(-1)[100:]}
    info = nce.save(state, tmp_path / "s.pt", algorithm="none")
    index = read_index(tmp_path / "s.pt")
    assert len(index.storages) == 1
    assert index.storages[0].nbytes == base.numel() * 4
    assert info.raw_bytes < 2 * base.numel() * 4
    out = nce.load(tmp_path / "s.pt")
    assert_tree_equal(state, out)
    ptrs = {v.untyped_storage().data_ptr() for v in out.values()}
    assert len(ptrs) == 1
    out["base"][3, 0] = 42.0
    assert out["row"][0].item() == 42.0


def test_views_of_a_large_buffer_store_only_the_span_they_use(tmp_path):
    flat = torch.randn(1_000_000)
    state = {"a": flat[1000:1100], "b": flat[2000:2100]}
    nce.save(state, tmp_path / "s.pt", algorithm="none")
    (storage,) = read_index(tmp_path / "s.pt").storages
    assert storage.nbytes < 1200 * 4
    assert_tree_equal(state, nce.load(tmp_path / "s.pt"))


def test_parameters_and_requires_grad_survive(tmp_path):
    state = {"p": torch.nn.Parameter(torch.randn(4)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
             "g": torch.randn(3, requires_grad=True)}
    nce.save(state, tmp_path / "s.pt")
    assert_tree_equal(state, nce.load(tmp_path / "s.pt"))


class Stage(enum.IntEnum):
    ONE = 1


def test_python_objects_in_the_skeleton(tmp_path):
    state = {"set": {1, 2}, "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"),
             "big": 2**100, "nan": float("nan"), "bytes": b"\x00\xff", "stage": Stage.ONE}
    nce.save(state, tmp_path / "s.pt")
    out = nce.load(tmp_path / "s.pt", safe_classes=[Stage])
    assert out["set"] == {1, 2} and out["size"] == torch.Size([2, 3]) and out["dtype"] is torch.bfloat16
    assert out["stage"] is Stage.ONE and out["big"] == 2**100 and out["bytes"] == b"\x00\xff"


def test_map_location_forms(tmp_path):
    state = {"x": torch.randn(10), "y": torch.arange(5)}
    nce.save(state, tmp_path / "s.pt")
    for loc in ("cpu", torch.device("cpu"), {"cpu": "cpu"}):
        assert_tree_equal(state, nce.load(tmp_path / "s.pt", map_location=loc))
    seen = []

    def fn(storage, location):
        seen.append(location)
        return storage

    assert_tree_equal(state, nce.load(tmp_path / "s.pt", map_location=fn))
    assert seen == ["cpu", "cpu"]
    with pytest.raises(TypeError, match="map_location"):
        nce.load(tmp_path / "s.pt", map_location=3)


def test_float_state_compresses_better_with_byte_planes(tmp_path):
    torch.manual_seed(0)
    weights = (torch.randn(1 << 18) * 0.02).bfloat16()
    plain = nce.save({"w": weights}, tmp_path / "plain.pt", algorithm="zstd")
    assert plain.ratio > 1.2, plain


def test_incompressible_chunks_are_stored_raw_never_larger(tmp_path):
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    info = nce.save({"n": noise}, tmp_path / "s.pt", algorithm="zstd", chunk_mb=1 / 64)
    (storage,) = read_index(tmp_path / "s.pt").storages
    assert all(c.stored_raw for c in storage.chunks)
    assert info.file_bytes < noise.numel() + 8192


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    nce.save({"x": torch.ones(3)}, tmp_path / "s.pt")
    with pytest.raises(TypeError):
        nce.save({"x": torch.ones(3), "bad": torch.ones(2).to_sparse()}, tmp_path / "s.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pt"]
    assert torch.equal(nce.load(tmp_path / "s.pt")["x"], torch.ones(3))


def test_bad_arguments_are_caller_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown algorithm"):
        nce.save({}, tmp_path / "s.pt", algorithm="brotli")
    with pytest.raises(ValueError, match="portable"):
        nce.save({}, tmp_path / "s.pt", algorithm="ans", portable=True)
    with pytest.raises(ValueError, match="chunk_mb"):
        nce.save({}, tmp_path / "s.pt", chunk_mb=0)


def test_gpu_only_codec_without_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(nce.UnsupportedCheckpointError, match="CUDA"):
        nce.save({"x": torch.ones(3)}, tmp_path / "s.pt", algorithm="ans")


def test_the_cpu_only_backend_is_announced_once(tmp_path, caplog):
    from nvcomp_ckpt_engine import codecs

    if codecs.gpu_codecs_available():
        pytest.skip("nvCOMP and CUDA are usable here")
    codecs._announce_cpu_codecs.cache_clear()
    caplog.clear()
    with caplog.at_level("INFO", logger="nvcomp_ckpt_engine.codecs"):
        nce.save({"x": torch.ones(3)}, tmp_path / "a.pt")
        nce.save({"x": torch.ones(3)}, tmp_path / "b.pt")
    notes = [r for r in caplog.records if "CPU codecs" in r.getMessage()]
    assert len(notes) == 1


def test_a_load_says_nothing_about_compressing(tmp_path, caplog):
    """Reading compresses nothing, so the CPU-codecs note of a save has no place there."""
    from nvcomp_ckpt_engine import codecs

    nce.save({"x": torch.ones(3)}, tmp_path / "a.pt")
    codecs._announce_cpu_codecs.cache_clear()
    codecs._gpu_module.cache_clear()
    with caplog.at_level("INFO", logger="nvcomp_ckpt_engine"):
        assert torch.equal(nce.load(tmp_path / "a.pt")["x"], torch.ones(3))
    assert not [r for r in caplog.records if "CPU codecs" in r.getMessage()]
