"""Every property of a tensor that `torch.save` keeps survives a save and load, or the save
refuses the tensor naming its key: never silently different values.

The conjugate and negative bits are applied to the data at save time (the loaded tensor has the
same values and no such bit); requires_grad, the Parameter type, dtype, shape, strides, storage
offset and storage sharing are kept as they are.
"""

from __future__ import annotations

import io
import pickle
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import dcp as ndcp
from nvcomp_ckpt_engine import pipeline
from nvcomp_ckpt_engine.container import _GRAD_DTYPES as GRAD_DTYPES
from nvcomp_ckpt_engine.container import DTYPE_NAMES, DTYPES
from nvcomp_ckpt_engine.lazy import LazyShard

from conftest import assert_same_tensor, raw_bytes


def _negatable(dtype: torch.dtype) -> bool:
    """Whether torch negates `dtype` on the CPU (a negative bit on the others cannot be applied)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch calls complex32 experimental
            torch.neg(torch.ones(1, dtype=dtype))
    except (RuntimeError, NotImplementedError):
        return False
    return True


NEGATABLE = [dtype for dtype in DTYPES.values() if _negatable(dtype)]


def round_trip(tmp_path, state, **load_options):
    path = tmp_path / "s.pt"
    nce.save(state, path, algorithm="zstd", chunk_mb=1 / 1024)
    return nce.load(path, **load_options)


def meant(t: torch.Tensor) -> torch.Tensor:
    """`t` as torch reads it, or, where torch has no kernel to read it (a complex32 view with
    both bits), its memory viewed without the bits, conjugated and negated in complex64 (a sign
    flip each, exact) and cast back."""
    if t.dtype != torch.complex32 or not (t.is_conj() and t.is_neg()):
        return t
    memory = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(),
                                                 t.shape, t.stride())
    return torch.neg(memory.to(torch.complex64).conj_physical()).to(torch.complex32)


def assert_same_values(loaded: torch.Tensor, original: torch.Tensor, key: str) -> None:
    """What the tensor means, bit for bit (conj and neg bits applied), and its other flags."""
    assert loaded.dtype == original.dtype and loaded.shape == original.shape, key
    assert torch.equal(raw_bytes(loaded), raw_bytes(meant(original))), key
    assert not loaded.is_conj() and not loaded.is_neg(), key
    assert loaded.requires_grad == original.requires_grad, key
    assert isinstance(loaded, torch.nn.Parameter) == isinstance(original, torch.nn.Parameter), key


def flagged_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    x = torch.randn(4, 3, generator=g)
    return {
        "conj": z.conj(),
        "conj-imag (a neg view)": z.conj().imag,
        "neg-view": torch._neg_view(x),
        "neg-of-conj": torch._neg_view(z.conj()),
        "conj-transposed": z.t().conj(),
        "conj-slice": z.conj()[1:, ::2],
        "conj-requires-grad": z.clone().requires_grad_(True).conj(),
        "conj-complex128": z.to(torch.complex128).conj(),
        "neg-int": torch._neg_view(torch.arange(6, dtype=torch.int32)),
        "conj-0d": z[0, 0].conj(),
        "conj-empty": z[:0].conj(),
        "conj-expanded": z[0:1].conj().expand(5, 3),
        "parameter-of-conj": torch.nn.Parameter(z.conj(), requires_grad=False),
    }


@pytest.mark.parametrize("key", sorted(flagged_tensors()))
def test_conjugate_and_negative_bits_load_as_the_values_they_mean(tmp_path, key):
    original = flagged_tensors()[key]
    assert original.is_conj() or original.is_neg()
    assert_same_values(round_trip(tmp_path, {key: original})[key], original, key)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["auto", "zstd"])
def test_flags_of_cuda_tensors_are_applied_on_their_gpu(tmp_path, algorithm):
    """The same on CUDA tensors, through nvCOMP (`auto`) and through the CPU codec path."""
    originals = {key: t.cuda() for key, t in flagged_tensors().items()}
    path = tmp_path / "s.pt"
    nce.save(originals, path, algorithm=algorithm, chunk_mb=1 / 1024)
    loaded = nce.load(path)
    for key, original in originals.items():
        assert loaded[key].is_cuda, key
        assert_same_values(loaded[key], original, key)


def test_the_dcp_writer_stores_the_values_too(tmp_path):
    import torch.distributed.checkpoint as dcp

    tensors = {k.replace(" ", "_"): v.detach() for k, v in flagged_tensors().items()}
    dcp.save(tensors, storage_writer=ndcp.NvcompFileSystemWriter(tmp_path / "c"), no_dist=True)
    loaded = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in tensors.items()}
    dcp.load(loaded, storage_reader=ndcp.NvcompFileSystemReader(tmp_path / "c"), no_dist=True)
    for key, value in tensors.items():
        assert torch.equal(raw_bytes(loaded[key]), raw_bytes(value)), key


@given(
    dtype=st.sampled_from(list(DTYPES.values())),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    transpose=st.booleans(), step=st.integers(1, 2), conj=st.booleans(), neg=st.booleans(),
    requires_grad=st.booleans(), parameter=st.booleans(), shared=st.booleans(),
)
def test_every_flag_torch_save_keeps_survives(tmp_path_factory, dtype, shape, transpose, step,
                                              conj, neg, requires_grad, parameter, shared):
    """The properties torch.save keeps, in every combination: what torch.save then torch.load
    gives back (flags aside from conj/neg, which are applied) is what load gives back."""
    # No zeros: torch itself reads a negated zero as +0.0 or -0.0 depending on the kernel.
    base = (torch.arange(max(1, int(np.prod(shape + [step]))), dtype=torch.float64) * 1.5 - 3.25)
    base = base if dtype.is_signed or dtype == torch.bool else base.abs()
    base = base.to(dtype) if not dtype.is_complex else torch.complex(base, -base).to(dtype)
    t = base[: int(np.prod(shape)) * step : step].reshape(shape)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)
    if conj and t.is_complex():
        t = t.conj()
    if neg and dtype in NEGATABLE:
        t = torch._neg_view(t)
    floating = DTYPE_NAMES[dtype] in GRAD_DTYPES
    if parameter:
        t = torch.nn.Parameter(t.detach(), requires_grad=requires_grad and floating)
    elif requires_grad and floating:
        t = t.detach().requires_grad_(True)
    other = base[:1] if shared else base.clone()[:1]
    loaded = round_trip(tmp_path_factory.mktemp("flags"), {"t": t, "other": other})
    assert_same_values(loaded["t"], t, "t")
    assert_same_tensor(loaded["other"], other, "other")
    if not (t.is_conj() or t.is_neg()):  # stored as it is: strides and sharing are kept
        assert loaded["t"].stride() == t.stride()
        view_shares = t.numel() > 0 and t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
        assert (loaded["t"].untyped_storage().data_ptr() == loaded["other"].untyped_storage().data_ptr()) == view_shares


# ----------------------------------------------------------- torch's own refusals, named


@pytest.mark.parametrize("make, words", [
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.strided),
     ["nested"]),
    (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged),
     ["NestedTensor"]),
    (lambda: torch._efficientzerotensor(3), ["storage"]),
    (lambda: torch.randn(4).to_sparse(), ["sparse"]),
])
def test_tensors_torch_cannot_expose_are_refused_naming_their_key(tmp_path, make, words):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that nested tensors are a prototype
        tensor = make()
    with pytest.raises(TypeError) as info:
        nce.save({"model": {"odd.weight": tensor}}, tmp_path / "s.pt")
    text = str(info.value)
    assert "'model/odd.weight'" in text and all(w in text for w in words), text
    assert not (tmp_path / "s.pt").exists()


def test_two_numpy_views_of_one_array_are_saved_and_load_bit_exact(tmp_path):
    """`torch.from_numpy` gives each view a storage of its own, starting where the array
    does; torch refused to extend the smaller storage to the larger one's bytes."""
    array = np.arange(40, dtype=np.float32)
    state = {"head": torch.from_numpy(array[:10]), "all": torch.from_numpy(array),
             "tail": torch.from_numpy(array[30:])}
    loaded = round_trip(tmp_path, state)
    for key, value in state.items():
        assert_same_tensor(loaded[key], value, key)


# ------------------------------------------------- a tensor's Python attributes, kept


def _attributed(make):
    t = make()
    t.note, t.__dict__["step"] = "fp32 master", 3
    return t


@pytest.mark.parametrize("make", [
    lambda: _attributed(lambda: torch.randn(3)),
    lambda: _attributed(lambda: torch.nn.Parameter(torch.randn(3))),
    lambda: _attributed(lambda: torch.nn.Parameter(torch.randn(3, dtype=torch.complex64).conj())),
    lambda: _attributed(lambda: torch.arange(4)[1:]),
], ids=["tensor", "parameter", "parameter-of-conj", "view"])
@pytest.mark.parametrize("trusted", [False, True], ids=["allowlist", "trusted"])
def test_python_attributes_of_a_tensor_load_as_torch_save_keeps_them(tmp_path, make, trusted):
    """torch.save keeps a tensor's `__dict__` (DeepSpeed sets `ds_id` on its flat fp32 groups);
    so does the format, for a tensor referred to twice as well."""
    tensor = make()
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    buffer.seek(0)
    assert vars(torch.load(buffer)) == {"note": "fp32 master", "step": 3}
    loaded = round_trip(tmp_path, {"optimizer": {"master": tensor, "again": [tensor]}},
                        trusted=trusted)
    assert loaded["optimizer"]["master"] is loaded["optimizer"]["again"][0]
    assert vars(loaded["optimizer"]["master"]) == {"note": "fp32 master", "step": 3}


def test_attributes_survive_a_lazy_read_and_a_stored_copy(tmp_path):
    """`LazyShard.read_tensor` and `copy` (the converters' path) keep them too."""
    tensor = _attributed(lambda: torch.randn(5))
    nce.save({"t": tensor, "plain": torch.ones(2)}, tmp_path / "s.pt")
    with LazyShard(tmp_path / "s.pt") as shard:
        assert vars(shard.read_tensor(shard.obj["t"])) == vars(tensor)
        assert vars(shard.read_tensor(shard.obj["plain"])) == {}
        shard.copy(shard.obj, tmp_path / "copy.pt")
    assert vars(nce.load(tmp_path / "copy.pt")["t"]) == vars(tensor)


def _written_as(path, version: int) -> None:
    """Rewrite the shard at `path` to say format `version` (header, index, trailer), resealing
    its CRC, as a forger or a damaged header would: only the skeleton's content differs from
    what that version's writers write."""
    import json
    import struct
    import zlib

    from nvcomp_ckpt_engine import container

    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, container.MAGIC_OFFSET + 8, version)
    offset, length, _, _, end = struct.unpack("<QQII8s", data[-container.TRAILER_SIZE:])
    index = json.loads(data[offset : offset + length])
    index["format_version"] = version
    body = json.dumps(index).encode()
    path.write_bytes(bytes(data[:offset]) + body + struct.pack(
        "<QQII8s", offset, len(body), zlib.crc32(body), version, end))


def test_a_file_is_version_3_only_when_a_tensor_carries_attributes(tmp_path):
    """The writer picks the lowest version that holds the file, for `save` and for a stored
    copy alike: attributes need 3; without them a file stays what older readers read."""
    from nvcomp_ckpt_engine import container

    plain, attributed = tmp_path / "plain.pt", tmp_path / "attributed.pt"
    nce.save({"t": torch.randn(5)}, plain)
    nce.save({"t": _attributed(lambda: torch.randn(5)), "plain": torch.ones(2)}, attributed)
    assert container.read_index(plain).format_version == 1
    assert container.read_index(attributed).format_version == 3
    with LazyShard(attributed) as shard:
        shard.copy({"plain": shard.obj["plain"]}, tmp_path / "plain_copy.pt")
        shard.copy(shard.obj, tmp_path / "copy.pt")
    assert container.read_index(tmp_path / "plain_copy.pt").format_version == 1
    assert container.read_index(tmp_path / "copy.pt").format_version == 3
    assert vars(nce.load(tmp_path / "copy.pt")["t"]) == {"note": "fp32 master", "step": 3}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("trusted", [False, True], ids=["allowlist", "trusted"])
def test_attributes_in_a_file_of_an_older_version_are_corruption(tmp_path, version, trusted):
    """A version-1 or -2 file cannot hold ``("tensor", i, attributes)``: such a reference is a
    damaged file (named), for `load` and `LazyShard`, and nothing is set on a tensor."""
    path = tmp_path / "older.pt"
    nce.save({"t": _attributed(lambda: torch.randn(5))}, path)
    _written_as(path, version)
    with pytest.raises(nce.CorruptCheckpointError, match=r"older\.pt: .*version 3"):
        nce.load(path, trusted=trusted)
    with pytest.raises(nce.CorruptCheckpointError, match=r"older\.pt: .*version 3"):
        LazyShard(path, trusted=trusted)


class _AttributeForger(pickle.Pickler):
    """Pickles a state whose every tensor reference carries `attributes`, as a forger's
    writer would (the library's own writer refuses such names)."""

    def __init__(self, file, attributes):
        super().__init__(file, protocol=4)
        self.attributes = attributes

    def persistent_id(self, obj):
        return ("tensor", 0, self.attributes) if isinstance(obj, torch.Tensor) else None


def _forged_with_attributes(path, attributes) -> None:
    """A valid version-3 shard (every CRC right) holding one tensor, ``optimizer/master``,
    whose reference sets `attributes`."""
    tensor = torch.randn(3)
    buffer = io.BytesIO()
    _AttributeForger(buffer, attributes).dump({"optimizer": {"master": tensor}})
    prepared = pipeline.prepare_shard(buffer.getvalue(), [tensor], ["optimizer/master"],
                                      algorithm="zstd", portable=False, chunk_bytes=1 << 20,
                                      writer_info={}, tensor_attributes=True)
    pipeline.write_prepared(prepared, path, durable=False)


@pytest.mark.parametrize("name", ["numel", "size", "tolist", "to", "copy_", "data", "T",
                                  "is_leaf", "_backward_hooks"])
@pytest.mark.parametrize("trusted", [False, True], ids=["allowlist", "trusted"])
def test_an_attribute_that_shadows_what_torch_tensor_defines_is_refused(tmp_path, name, trusted):
    """A file may set only attributes that torch.Tensor does not define: one named like a
    method or property (`numel`, `to`, ...) would replace it on the loaded tensor. Refused,
    naming the file, the tensor's key and the attribute, by `load` and `LazyShard` alike; the
    name's neighbours in the same reference are not set either."""
    path = tmp_path / "forged.pt"
    _forged_with_attributes(path, {"ds_id": 3, name: 7})
    pattern = rf"forged\.pt: tensor 'optimizer/master' carries the attribute '{name}'"
    with pytest.raises(nce.CorruptCheckpointError, match=pattern):
        nce.load(path, trusted=trusted)
    with pytest.raises(nce.CorruptCheckpointError, match=pattern):
        LazyShard(path, trusted=trusted)


def test_plain_attribute_names_still_load_from_a_forged_reference(tmp_path):
    """The same forged file with names torch.Tensor lacks loads, attributes set."""
    path = tmp_path / "plain.pt"
    _forged_with_attributes(path, {"ds_id": 3, "tensor_model_parallel": True})
    loaded = nce.load(path)["optimizer"]["master"]
    assert vars(loaded) == {"ds_id": 3, "tensor_model_parallel": True}
    assert loaded.numel() == 3


def test_saving_a_tensor_whose_attribute_shadows_a_tensor_method_is_refused(tmp_path):
    """What a load would refuse is never written: the save names the key and the attribute."""
    tensor = torch.randn(3)
    tensor.__dict__["numel"] = 7
    with pytest.raises(TypeError, match=r"'optimizer/master' carries the attribute 'numel'"):
        nce.save({"optimizer": {"master": tensor}}, tmp_path / "s.pt")
    assert not (tmp_path / "s.pt").exists()


class Unlisted:
    """A class no allowlist names."""

    year = 2026


def test_an_attribute_off_the_allowlist_is_refused_naming_its_class(tmp_path):
    """Attributes are unpickled with the skeleton, through the same allowlist."""
    tensor = torch.randn(3)
    tensor.when = Unlisted()
    nce.save({"t": tensor}, tmp_path / "s.pt")
    with pytest.raises(nce.UnsafeObjectError, match="Unlisted"):
        nce.load(tmp_path / "s.pt")
    assert nce.load(tmp_path / "s.pt", trusted=True)["t"].when.year == 2026


def _quantized(dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        return torch.quantize_per_tensor(torch.randn(8), 0.1, 0 if dtype != torch.quint8 else 8, dtype)


#: Dtypes torch.save round-trips on the CPU that the format does not list.
UNLISTED_DTYPES = [torch.bits8, torch.bits16, torch.bits1x8, torch.bits2x4, torch.bits4x2,
                   torch.float4_e2m1fn_x2, torch.float8_e8m0fnu]
QUANTIZED_DTYPES = [torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4]


def _unstorable() -> list:
    """(make, words the refusal names) for each tensor the format cannot store."""
    cases = [(lambda d=d: torch.zeros(4, dtype=d), d, "does not list") for d in UNLISTED_DTYPES]
    cases += [(lambda d=d: _quantized(d), d, "quantized") for d in QUANTIZED_DTYPES]
    cases += [(lambda d=d: torch.ones(3, dtype=d).requires_grad_(True), d, "requires grad")
              for d in DTYPES.values() if d.is_floating_point and DTYPE_NAMES[d] not in GRAD_DTYPES]
    cases += [(lambda d=d: torch._neg_view(torch.ones(3, dtype=d)), d, "negative bit")
              for d in DTYPES.values() if d not in NEGATABLE]
    return [pytest.param(make, [words] if words == "quantized" else [str(d), words],
                         id=f"{d} {words}") for make, d, words in cases]


@pytest.mark.parametrize("make, words", _unstorable())
def test_what_the_format_cannot_store_is_refused_naming_its_key(tmp_path, make, words):
    """Every dtype torch.save supports on the CPU either round-trips (the tests above) or is
    refused here: a file the reader would refuse (a float8 tensor requiring grad) or torch's
    own error without the key (negating a uint16) is never what a save ends in."""
    tensor = make()
    with pytest.raises(TypeError) as info:
        nce.save({"model": {"w": tensor}}, tmp_path / "s.pt")
    text = str(info.value)
    assert "'model/w'" in text and all(w in text for w in words), text
    assert not (tmp_path / "s.pt").exists()


def test_every_cpu_dtype_torch_saves_is_covered():
    """The lists above and the format's dtypes together hold every dtype torch.save writes."""
    covered = {*DTYPES.values(), *UNLISTED_DTYPES, *QUANTIZED_DTYPES}
    for dtype in {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}:
        try:
            torch.save(torch.empty(0, dtype=dtype), io.BytesIO())
        except (KeyError, RuntimeError, NotImplementedError):
            continue  # torch.save itself refuses it (int1..int7, uint1..uint7)
        assert dtype in covered, dtype
