"""nvCOMP GPU codecs: what only nvCOMP has (typed ANS, standard empty streams, zstd frame
tables, bitstreams from CPU libraries, options, versions, misuse).

The contract every codec meets (round trips of every size and content, refused payloads,
descriptor and registry, CPU decodability) is tests/contracts/test_codec_contract.py's, run
there against every nvCOMP codec. Tests marked ``gpu`` need CUDA and nvCOMP and are skipped
elsewhere; the version checks and the import-safety test run everywhere (CPU CI included).
"""

from __future__ import annotations

import zlib

import pytest
import torch

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


@gpu
def test_ans_typed_modes_beat_plain_on_floats() -> None:
    """The element hint reaches nvCOMP: typed ANS compresses float-like bf16 and fp32 better."""
    typed, plain = NvcompCodec("ans"), NvcompCodec("ans", data_types={})
    for kind in ("bf16", "fp32"):
        chunk = _data(kind, 8 << 20, 1)
        typed_size = _round_trip(typed, [chunk], _element(kind))[0].numel()
        plain_size = _round_trip(plain, [chunk], _element(kind))[0].numel()
        assert typed_size < plain_size, (kind, typed_size, plain_size)


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
