"""The codec contract, run against every codec this machine offers.

Every codec, CPU (zstd, deflate, none) or nvCOMP on a GPU (every algorithm, and ANS in its plain
and 64 KiB-chunk variants), must: give back every chunk bit for bit whatever its size or
content and whatever element hint it is given; refuse an output of the wrong size with a
`CheckpointError`; a CPU codec also refuses a damaged payload (truncated, garbage, a flipped
byte) with one, never a crash or another exception (a damaged chunk never reaches a GPU
codec: its CRC is checked first); describe itself in JSON from which the registry rebuilds a
decoder that reads what it wrote; and, where it says a CPU can decode it, be decodable there.

GPU cases are marked ``gpu`` and skipped where CUDA or nvCOMP is missing, as in
test_gpu_codecs.py, which keeps the checks specific to nvCOMP (frame tables, versions,
options). File-level integrity (a chunk's CRC in the container) is test_corruption.py's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvcomp_ckpt_engine import codecs, formats
from nvcomp_ckpt_engine.codecs.base import element_of
from nvcomp_ckpt_engine.errors import CheckpointError

# ----------------------------------------------------------------------------- the codecs


@dataclass(frozen=True)
class Case:
    """One codec under test: how to build it, and whether it needs a GPU."""

    id: str
    make: Callable[[], codecs.Codec]
    gpu: bool


def _cpu(name: str) -> Case:
    # The registry's own CPU decoder for the name is the CPU encoder of that name.
    return Case(f"cpu-{name}", lambda: codecs.decoder_for({"name": name, "version": 1}, on_cuda=False), False)


def _gpu(name: str, label: str = "", **options: object) -> Case:
    def make() -> codecs.Codec:
        from nvcomp_ckpt_engine.codecs import nvcomp_gpu

        return nvcomp_gpu.make_codec(name, **options)

    return Case(f"gpu-{name}{label}", make, True)


def _gpu_names() -> tuple[str, ...]:
    from nvcomp_ckpt_engine.codecs import nvcomp_gpu

    return nvcomp_gpu.NVCOMP_CODEC_NAMES


CASES = [_cpu(name) for name in codecs.PORTABLE] + [_gpu(name) for name in _gpu_names()] + [
    _gpu("ans", "-plain", data_types={}),
    _gpu("ans", "-64k", uncomp_chunk_size=1 << 16),
]
_NO_GPU = not codecs.gpu_codecs_available()


def _params(cases: list[Case]) -> list:
    marks = [pytest.mark.gpu, pytest.mark.skipif(_NO_GPU, reason="needs a CUDA device and nvCOMP")]
    return [pytest.param(c, id=c.id, marks=marks if c.gpu else ()) for c in cases]


ALL = _params(CASES)

# ------------------------------------------------------------------------------- the data

#: Byte sizes: empty, tiny, odd (not a multiple of 2 or 4), nvCOMP's 64 KiB and 1 MiB chunk
#: boundaries, and several chunks.
SIZES = [0, 1, 3, 7, 16, 1000, 4097, 65535, 65536, 65537, (1 << 20) + 3, 3 << 20]

#: Contents by name: incompressible bytes, a constant, and float and integer values of the
#: dtypes training state holds (whose element hint typed codecs use).
KINDS: dict[str, torch.dtype] = {
    "random": torch.uint8,
    "zeros": torch.uint8,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int64": torch.int64,
}


@functools.lru_cache(maxsize=256)
def data(kind: str, nbytes: int, seed: int, device: str) -> torch.Tensor:
    """`nbytes` bytes of `kind` on `device`, as a 1-D uint8 tensor (shared between tests,
    which never write to it: each codec's cases reuse the same inputs)."""
    g = torch.Generator().manual_seed(seed)
    dtype = KINDS[kind]
    if kind == "random":
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    elif kind == "zeros":
        raw = torch.zeros(nbytes, dtype=torch.uint8)
    else:
        width = torch.empty((), dtype=dtype).element_size()
        count = nbytes // width + 1
        if dtype.is_floating_point:
            values = (torch.randn(count, generator=g) * 0.02).to(dtype)
        else:
            values = torch.randint(-1000, 1000, (count,), generator=g).to(dtype)
        raw = values.view(torch.uint8)[:nbytes].clone()
    return raw.to(device)


def round_trip(codec: codecs.Codec, chunks: list[torch.Tensor], element: str) -> list[torch.Tensor]:
    """Encode and decode `chunks` (into outputs prefilled with other bytes); returns the
    payloads after asserting a bit-exact result."""
    payloads = codec.encode_batch(chunks, element=element)
    assert len(payloads) == len(chunks)
    for p in payloads:
        assert p.dtype == torch.uint8 and p.dim() == 1 and p.device.type == codec.device
    outs = [torch.full_like(c, 0xA5) for c in chunks]
    codec.decode_batch(payloads, outs, element=element)
    for i, (c, o) in enumerate(zip(chunks, outs)):
        assert torch.equal(c, o), f"{codec.name} chunk {i} ({c.numel()} bytes) differs"
    return payloads


def _encoded(codec: codecs.Codec, nbytes: int = 200_000) -> tuple[torch.Tensor, torch.Tensor]:
    """One bf16-like chunk and its payload."""
    chunk = data("bf16", nbytes, 9, codec.device)
    return chunk, codec.encode_batch([chunk], element="bf2")[0]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("case", ALL)
def test_a_batch_of_every_size_round_trips(case: Case, kind: str) -> None:
    codec = case.make()
    chunks = [data(kind, n, seed, codec.device) for seed, n in enumerate(SIZES)]
    round_trip(codec, chunks, element_of(KINDS[kind]))


@pytest.mark.parametrize("case", ALL)
def test_an_empty_batch_and_single_chunks_round_trip(case: Case) -> None:
    codec = case.make()
    assert codec.encode_batch([], element="f4") == []
    codec.decode_batch([], [], element="f4")
    for n in (0, 1, 2, 5, 4096, 1 << 20):
        round_trip(codec, [data("fp32", n, n, codec.device)], "f4")


@pytest.mark.parametrize("case", ALL)
def test_every_tiny_size_round_trips_in_one_batch(case: Case) -> None:
    """Sizes 1..160: nvCOMP 6.0's Cascaded loses the last n % 4 bytes unless padded."""
    codec = case.make()
    round_trip(codec, [data("random", n, n, codec.device) for n in range(1, 161)], "u1")


@pytest.mark.parametrize("case", ALL)
def test_views_at_odd_offsets_round_trip(case: Case) -> None:
    """Chunks and outputs that start at odd byte offsets of larger tensors."""
    codec = case.make()
    base = data("bf16", 1 << 20, 7, codec.device)
    chunks = [base[1:1001], base[3:65539], base[4097 : 4097 + 300_001]]
    payloads = codec.encode_batch(chunks, element="bf2")
    store = torch.zeros(base.numel() + 64, dtype=torch.uint8, device=codec.device)
    outs = [store[5 : 5 + 1000], store[2000 : 2000 + 65536], store[70001 : 70001 + 300_001]]
    codec.decode_batch(payloads, outs, element="bf2")
    for c, o in zip(chunks, outs):
        assert torch.equal(c, o)


@pytest.mark.parametrize("case", ALL)
@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300_000), min_size=1, max_size=6),
    kind=st.sampled_from(["random", "zeros", "bf16", "fp32", "int64"]),
)
def test_any_batch_of_mixed_sizes_round_trips(case: Case, sizes: list[int], kind: str) -> None:
    codec = case.make()
    chunks = [data(kind, n, seed, codec.device) for seed, n in enumerate(sizes)]
    round_trip(codec, chunks, element_of(KINDS[kind]))


# ---------------------------------------------------------------- payloads that do not fit


@pytest.mark.parametrize("case", ALL)
def test_an_output_of_the_wrong_size_is_refused(case: Case) -> None:
    codec = case.make()
    chunk = data("fp32", 10_000, 5, codec.device)
    payload = codec.encode_batch([chunk], element="f4")[0]
    for wrong in (9_996, 10_004, 0):
        out = torch.empty(wrong, dtype=torch.uint8, device=codec.device)
        with pytest.raises(CheckpointError):
            codec.decode_batch([payload], [out], element="f4")
    with pytest.raises(CheckpointError):
        codec.decode_batch([payload[:0]], [torch.empty(4, dtype=torch.uint8, device=codec.device)])


#: Damaged payloads go to the CPU codecs only, whose payloads say where they end (a zstd
#: frame, a deflate stream's final block) and which raise on damage. A damaged chunk never
#: reaches nvCOMP: every chunk's CRC is checked in host memory before the chunk is copied to
#: the GPU (`pipeline.decode`), and file-level tests refuse damaged GPU-coded chunks that way
#: (test_corruption.py). nvCOMP's decoders are no such check: on the H200 a truncated RAW
#: deflate stream decoded without an error, and damaged payloads fed to the GPU decoders left
#: the process's CUDA context failing every later call.
DAMAGEABLE = [c for c in CASES if not c.gpu]
SELF_DELIMITING = _params(DAMAGEABLE)


@pytest.mark.parametrize("case", SELF_DELIMITING)
def test_a_truncated_payload_is_refused(case: Case) -> None:
    codec = case.make()
    chunk, payload = _encoded(codec)
    for length in (payload.numel() - 1, payload.numel() // 2, 1):
        out = torch.full_like(chunk, 0xA5)
        with pytest.raises(CheckpointError):
            codec.decode_batch([payload[:length].clone()], [out], element="bf2")


@pytest.mark.parametrize("case", _params([c for c in DAMAGEABLE if not c.id.endswith("-none")]))
def test_garbage_is_refused(case: Case) -> None:
    codec = case.make()
    garbage = data("random", 4096, 11, codec.device)
    with pytest.raises(CheckpointError):
        codec.decode_batch([garbage], [torch.empty(4096, dtype=torch.uint8, device=codec.device)])


@pytest.mark.parametrize("case", SELF_DELIMITING)
def test_a_garbled_payload_is_refused_or_decodes_never_crashes(case: Case) -> None:
    """A flipped byte anywhere: the codec raises a CheckpointError or fills its output; no
    other exception escapes (the chunk CRC then refuses wrong bytes, test_corruption.py)."""
    codec = case.make()
    chunk, payload = _encoded(codec, 20_000)
    for position in range(0, payload.numel(), max(1, payload.numel() // 64)):
        damaged = payload.clone()
        damaged[position] ^= 0x5A
        try:
            codec.decode_batch([damaged], [torch.empty_like(chunk)], element="bf2")
        except CheckpointError:
            pass


# ---------------------------------------------------------------- descriptor and registry


def _batch(codec: codecs.Codec) -> list[torch.Tensor]:
    return [data("bf16", n, n, codec.device) for n in (0, 1, 1000, 65537, (1 << 20) + 3, (2 << 20) + 5)]


def _decodes(decoder: codecs.Codec, payloads: list[torch.Tensor], chunks: list[torch.Tensor]) -> None:
    """`decoder` (on its own device) gives back `chunks` from `payloads`."""
    outs = [torch.full((c.numel(),), 0xA5, dtype=torch.uint8, device=decoder.device) for c in chunks]
    decoder.decode_batch([p.to(decoder.device) for p in payloads], outs, element="bf2")
    for i, (c, o) in enumerate(zip(chunks, outs)):
        assert torch.equal(c.cpu(), o.cpu()), f"{decoder.name} on {decoder.device}: chunk {i} differs"


@pytest.mark.parametrize("case", ALL)
def test_the_descriptor_is_json_and_rebuilds_a_decoder_of_what_was_written(case: Case) -> None:
    codec = case.make()
    descriptor = codec.descriptor()
    stored = json.loads(json.dumps(descriptor))
    assert stored == descriptor and stored["name"] == codec.name
    formats.check_descriptor(stored)
    formats.max_ratio(stored)
    chunks = _batch(codec)
    payloads = codec.encode_batch(chunks, element="bf2")
    decoder = codecs.decoder_for(stored, on_cuda=codec.device == "cuda")
    assert decoder.name == codec.name
    _decodes(decoder, payloads, chunks)


@pytest.mark.parametrize("case", ALL)
def test_the_cpu_decodable_flag_is_honoured(case: Case) -> None:
    """A codec that says a CPU decodes its payloads gets a CPU decoder for a CPU destination,
    which reads them; one that does not gets only a GPU decoder."""
    codec = case.make()
    decoder = codecs.decoder_for(json.loads(json.dumps(codec.descriptor())), on_cuda=False)
    if not codec.cpu_decodable:
        assert codec.device == "cuda" and decoder.device == "cuda"
        return
    assert decoder.device == "cpu"
    chunks = _batch(codec)
    _decodes(decoder, codec.encode_batch(chunks, element="bf2"), chunks)
