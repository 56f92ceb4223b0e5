"""nvCOMP GPU codecs: bit-exact round trips, CPU decodability of the RAW bitstreams, errors.

Tests marked ``gpu`` need CUDA and nvCOMP and are skipped elsewhere; the version checks and the
import-safety test run everywhere (CPU CI included).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvcomp_ckpt_engine.codecs import nvcomp_gpu
from nvcomp_ckpt_engine.codecs.base import element_of
from nvcomp_ckpt_engine.codecs.nvcomp_gpu import (
    NVCOMP_CODEC_NAMES,
    NvcompCodec,
    check_bitstream_compatible,
    make_codec,
    nvcomp_available,
    nvcomp_version,
)
from nvcomp_ckpt_engine.errors import CodecError, UnsupportedCheckpointError



def gpu(test):  # noqa: ANN001, ANN201 - a pytest decorator
    """Mark `test` as a GPU test, skipped where CUDA or nvCOMP is missing."""
    skip = pytest.mark.skipif(not nvcomp_available(), reason="needs a CUDA device and nvCOMP")
    return pytest.mark.gpu(skip(test))


#: Byte sizes that cover empty, tiny, odd (not a multiple of 2 or 4), nvCOMP-chunk-boundary and
#: multi-chunk cases.
SIZES = [0, 1, 3, 7, 16, 1000, 4097, 65535, 65536, 65537, (1 << 20) + 3, 3 << 20]


def _data(kind: str, nbytes: int, seed: int) -> torch.Tensor:
    """`nbytes` bytes on the GPU: "random" bytes, or the bytes of float-like (normal) values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "random":
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
    if kind == "zeros":
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind]
    width = torch.empty((), dtype=dtype).element_size()
    values = torch.randn(nbytes // width + 1, device="cuda", generator=g) * 0.02
    return values.to(dtype).view(torch.uint8)[:nbytes].clone()


def _element(kind: str) -> str:
    """The element hint the engine would pass for data of `kind`."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(kind, torch.uint8)
    return element_of(dtype)


def _round_trip(codec: NvcompCodec, chunks: list[torch.Tensor], element: str) -> list[torch.Tensor]:
    """Encode and decode `chunks`; returns the payloads after asserting a bit-exact result."""
    payloads = codec.encode_batch(chunks, element=element)
    assert len(payloads) == len(chunks)
    for p in payloads:
        assert p.dtype == torch.uint8 and p.dim() == 1 and p.is_cuda
    outs = [torch.full_like(c, 0xA5) for c in chunks]
    codec.decode_batch(payloads, outs, element=element)
    for i, (c, o) in enumerate(zip(chunks, outs)):
        assert torch.equal(c, o), f"{codec.name} chunk {i} ({c.numel()} bytes) differs"
    return payloads


#: Every nvCOMP codec with its defaults, plus plain ANS and ANS with 64 KiB chunks.
VARIANTS = [(name, {}) for name in NVCOMP_CODEC_NAMES] + [
    ("ans", {"data_types": {}}),
    ("ans", {"uncomp_chunk_size": 1 << 16}),
]


@pytest.mark.parametrize("kind", ["random", "zeros", "bf16", "fp16", "fp32"])
@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=lambda v: str(v) if v else "default")
@gpu
def test_round_trip_batch_of_every_size(name: str, options: dict, kind: str) -> None:
    codec = NvcompCodec(name, **options)
    chunks = [_data(kind, n, seed) for seed, n in enumerate(SIZES)]
    _round_trip(codec, chunks, _element(kind))


@pytest.mark.parametrize("name", NVCOMP_CODEC_NAMES)
@gpu
def test_round_trip_single_chunks_and_empty_batch(name: str) -> None:
    codec = NvcompCodec(name)
    assert codec.encode_batch([], element="f4") == []
    codec.decode_batch([], [], element="f4")
    for n in (0, 1, 2, 5, 4096, 1 << 20):
        _round_trip(codec, [_data("fp32", n, n)], "f4")


@pytest.mark.parametrize("name", NVCOMP_CODEC_NAMES)
@gpu
def test_every_tiny_size_round_trips(name: str) -> None:
    """Sizes 1..160 in one batch: nvCOMP 6.0's Cascaded loses the last n % 4 bytes unless padded."""
    chunks = [_data("random", n, n) for n in range(1, 161)]
    _round_trip(NvcompCodec(name), chunks, "u1")


@pytest.mark.parametrize("name", NVCOMP_CODEC_NAMES)
@gpu
def test_misaligned_views_round_trip(name: str) -> None:
    """Chunks that start at odd byte offsets (views into a larger tensor) still round-trip."""
    codec = NvcompCodec(name)
    base = _data("bf16", 1 << 20, 7)
    chunks = [base[1:1001], base[3:65539], base[4097 : 4097 + 300_001]]
    payloads = codec.encode_batch(chunks, element="bf2")
    store = torch.zeros(base.numel() + 64, dtype=torch.uint8, device="cuda")
    outs = [store[5 : 5 + 1000], store[2000 : 2000 + 65536], store[70001 : 70001 + 300_001]]
    codec.decode_batch(payloads, outs, element="bf2")
    for c, o in zip(chunks, outs):
        assert torch.equal(c, o)


@gpu
@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300_000), min_size=1, max_size=6),
    name=st.sampled_from(["ans", "zstd", "deflate", "bitcomp"]),
    kind=st.sampled_from(["random", "bf16", "fp32"]),
)
def test_round_trip_property(sizes: list[int], name: str, kind: str) -> None:
    chunks = [_data(kind, n, seed) for seed, n in enumerate(sizes)]
    _round_trip(NvcompCodec(name), chunks, _element(kind))


@gpu
def test_ans_typed_modes_beat_plain_on_floats() -> None:
    """The element hint reaches nvCOMP: typed ANS compresses float-like bf16 and fp32 better."""
    typed, plain = NvcompCodec("ans"), NvcompCodec("ans", data_types={})
    for kind in ("bf16", "fp32"):
        chunk = _data(kind, 8 << 20, 1)
        typed_size = _round_trip(typed, [chunk], _element(kind))[0].numel()
        plain_size = _round_trip(plain, [chunk], _element(kind))[0].numel()
        assert typed_size < plain_size, (kind, typed_size, plain_size)


@pytest.mark.parametrize("kind", ["random", "bf16", "fp32"])
@gpu
def test_gpu_zstd_is_read_by_cpu_zstandard(kind: str) -> None:
    zstandard = pytest.importorskip("zstandard")
    codec = NvcompCodec("zstd")
    assert codec.cpu_decodable
    chunks = [_data(kind, n, n) for n in (1, 1000, 65537, (1 << 20) + 3, 5 << 20)]
    for chunk, payload in zip(chunks, _round_trip(codec, chunks, _element(kind))):
        raw = bytes(payload.cpu().numpy())
        # One zstd frame per MiB behind a skippable frame table: read across frames.
        decoded = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(raw)
        assert decoded == bytes(chunk.cpu().numpy())


@pytest.mark.parametrize("kind", ["random", "bf16", "fp32"])
@gpu
def test_gpu_deflate_is_read_by_cpu_zlib(kind: str) -> None:
    codec = NvcompCodec("deflate")
    assert codec.cpu_decodable
    chunks = [_data(kind, n, n) for n in (1, 1000, 65537, (1 << 20) + 3, 5 << 20)]
    for chunk, payload in zip(chunks, _round_trip(codec, chunks, _element(kind))):
        inflater = zlib.decompressobj(-15)
        decoded = inflater.decompress(bytes(payload.cpu().numpy())) + inflater.flush()
        assert inflater.eof and not inflater.unused_data
        assert decoded == bytes(chunk.cpu().numpy())


@gpu
def test_empty_chunks_give_standard_empty_streams() -> None:
    """A CPU reader must accept what an empty chunk became: nvCOMP itself refuses empty input."""
    zstandard = pytest.importorskip("zstandard")
    empty = torch.empty(0, dtype=torch.uint8, device="cuda")
    zstd_payload = bytes(NvcompCodec("zstd").encode_batch([empty])[0].cpu().numpy())
    assert zstandard.ZstdDecompressor().decompress(zstd_payload, max_output_size=1) == b""
    inflater = zlib.decompressobj(-15)
    assert inflater.decompress(bytes(NvcompCodec("deflate").encode_batch([empty])[0].cpu().numpy())) == b""
    assert inflater.eof
    for name in NVCOMP_CODEC_NAMES:
        _round_trip(NvcompCodec(name), [empty, _data("fp32", 40, 1), empty], "f4")


@gpu
def test_damaged_zstd_frame_table_raises_codec_error() -> None:
    codec = NvcompCodec("zstd")
    chunk = _data("bf16", 200_000, 9)
    payload = codec.encode_batch([chunk])[0]
    out = torch.empty_like(chunk)
    # Table layout: skippable magic [0,4), length [4,8), marker [8,12), frame bytes [12,16),
    # then one compressed size per frame ([16,20) here: one frame).
    for position, what in ((12, "frames"), (16, "add up")):
        damaged = payload.clone()
        damaged[position] ^= 0x40
        with pytest.raises(CodecError, match=what):
            codec.decode_batch([damaged], [out])
    with pytest.raises(CodecError, match="add up"):
        codec.decode_batch([payload[:-1]], [out])


@gpu
def test_cpu_written_zstd_and_deflate_decode_on_gpu() -> None:
    """The reverse direction: standard streams from CPU libraries decode with the GPU codecs."""
    zstandard = pytest.importorskip("zstandard")
    data = _data("bf16", (1 << 20) + 5, 3).cpu()
    raw = bytes(data.numpy())
    deflater = zlib.compressobj(6, zlib.DEFLATED, -15)
    streams = {
        "zstd": zstandard.ZstdCompressor(level=3).compress(raw),
        "deflate": deflater.compress(raw) + deflater.flush(),
    }
    for name, stream in streams.items():
        payload = torch.frombuffer(bytearray(stream), dtype=torch.uint8).cuda()
        out = torch.empty_like(data, device="cuda")
        NvcompCodec(name).decode_batch([payload], [out], element="bf2")
        assert torch.equal(out.cpu(), data), name


@pytest.mark.parametrize("name", NVCOMP_CODEC_NAMES)
@gpu
def test_wrong_output_size_raises_codec_error(name: str) -> None:
    codec = NvcompCodec(name)
    chunk = _data("fp32", 10_000, 5)
    payload = codec.encode_batch([chunk], element="f4")[0]
    for wrong in (9_996, 10_004):
        with pytest.raises(CodecError, match=r"10000|9996|10004"):
            out = torch.empty(wrong, dtype=torch.uint8, device="cuda")
            codec.decode_batch([payload], [out], element="f4")
    with pytest.raises(CodecError, match="empty"):
        codec.decode_batch([payload[:0]], [torch.empty(4, dtype=torch.uint8, device="cuda")])


@pytest.mark.parametrize("name", ["ans", "gdeflate", "bitcomp", "cascaded", "lz4"])
@gpu
def test_garbage_native_payload_raises_codec_error(name: str) -> None:
    garbage = _data("random", 4096, 11)
    with pytest.raises(CodecError, match="decode"):
        NvcompCodec(name).decode_batch([garbage], [torch.empty(4096, dtype=torch.uint8, device="cuda")])


@gpu
def test_misuse_raises_builtin_errors() -> None:
    codec = NvcompCodec("zstd")
    with pytest.raises(ValueError, match="CUDA"):
        codec.encode_batch([torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(TypeError, match="uint8"):
        codec.encode_batch([torch.zeros(4, device="cuda")])
    with pytest.raises(ValueError, match="payloads"):
        codec.decode_batch([], [torch.zeros(4, dtype=torch.uint8, device="cuda")])


@gpu
def test_descriptor_records_options_and_library() -> None:
    version = nvcomp_version()
    for name in NVCOMP_CODEC_NAMES:
        codec = NvcompCodec(name)
        d = codec.descriptor()
        assert d["name"] == name and d["library"] == f"nvcomp {version}"
        assert d["options"]["bitstream"] == ("raw" if name in ("zstd", "deflate") else "native")
        assert codec.device == "cuda" and codec.cpu_decodable == (name in ("zstd", "deflate"))
        assert make_codec(name, **d["options"]).descriptor() == d
    assert NvcompCodec("ans", data_types={}).descriptor()["options"]["data_types"] == {}
    assert NvcompCodec("gdeflate", level=4).descriptor()["options"]["level"] == 4


def _ans_descriptor(library: str) -> dict:
    return {"name": "ans", "version": 1, "options": {"bitstream": "native"}, "library": library}


def test_import_and_probes_never_raise() -> None:
    assert isinstance(nvcomp_available(), bool)
    assert nvcomp_version() is None or nvcomp_version()[0].isdigit()


def test_raw_bitstreams_pass_any_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvcomp_gpu, "nvcomp_version", lambda: None)
    check_bitstream_compatible({"name": "zstd", "options": {"bitstream": "raw"}, "library": "nvcomp 1.0.0"})


def test_native_bitstream_major_mismatch_names_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvcomp_gpu, "nvcomp_version", lambda: "7.1.0")
    with pytest.raises(UnsupportedCheckpointError, match=r"6\.0\.0.*7\.1\.0"):
        check_bitstream_compatible(_ans_descriptor("nvcomp 6.0.0"))
    check_bitstream_compatible(_ans_descriptor("nvcomp 7.0.2"))


def test_native_bitstream_without_nvcomp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvcomp_gpu, "nvcomp_version", lambda: None)
    with pytest.raises(UnsupportedCheckpointError, match=r"nvCOMP 6\.0\.0.*not installed.*GPU node"):
        check_bitstream_compatible(_ans_descriptor("nvcomp 6.0.0"))


def test_native_bitstream_without_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvcomp_gpu, "nvcomp_version", lambda: "6.0.0")
    with pytest.raises(UnsupportedCheckpointError, match="does not record"):
        check_bitstream_compatible({"name": "ans", "options": {"bitstream": "native"}})


def test_codec_without_nvcomp_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvcomp_gpu, "nvcomp_version", lambda: None)
    with pytest.raises(UnsupportedCheckpointError, match="nvidia-nvcomp-cu13"):
        NvcompCodec("ans")


def test_make_codec_refuses_what_it_cannot_read() -> None:
    with pytest.raises(UnsupportedCheckpointError, match="unknown nvCOMP codec"):
        make_codec("brotli")
    with pytest.raises(UnsupportedCheckpointError, match="bitstream 'native'"):
        make_codec("zstd", bitstream="native")
    with pytest.raises(UnsupportedCheckpointError, match="upgrade"):
        make_codec("ans", bitstream="native", dictionary=True)


def test_bad_options_are_value_errors() -> None:
    with pytest.raises(ValueError, match="unknown nvCOMP codec"):
        NvcompCodec("brotli")
    with pytest.raises(ValueError, match="no level"):
        NvcompCodec("ans", level=2)
    with pytest.raises(ValueError, match="no data_types"):
        NvcompCodec("zstd", data_types={})
