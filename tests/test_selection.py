"""`auto` chooses each storage's plan from a sample: the dtype's plan stays unless another codes
the sample smaller (`selection`). CPU candidates here; the GPU's (nvCOMP ANS typed vs ANS after
byte planes) in the `gpu` tests at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import codecs, container, selection
from nvcomp_ckpt_engine.codecs import Plan
from nvcomp_ckpt_engine.codecs.cpu import NoneCodec, ZstdCodec
from nvcomp_ckpt_engine.options import DEFAULT_CHUNK_MB

from conftest import assert_same_tensor

ROOT = Path(__file__).resolve().parents[1]


def _text_as_floats(nbytes: int) -> torch.Tensor:
    """Bytes that are not numbers (this repository's source), in a float32 tensor: byte planes
    tear its words apart, plain zstd does not."""
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "nvcomp_ckpt_engine").glob("*.py")))
    return torch.frombuffer(bytearray((text * (nbytes // len(text) + 1))[:nbytes]), dtype=torch.float32)


def _plans(path: Path) -> dict[str, tuple[str, int]]:
    index = container.read_index(path)
    return {t.key: (index.storages[t.storage].codec["name"],
                    index.storages[t.storage].transform.get("width", 1)) for t in index.tensors}


def test_auto_keeps_the_dtype_plan_unless_the_sample_codes_smaller(tmp_path: Path) -> None:
    if codecs.gpu_codecs_available():
        pytest.skip("the CPU candidates are chosen only where no GPU codec is usable")
    state = {"text": _text_as_floats(8 << 20), "moments": torch.randn(2 << 20) ** 2,
             "small_text": _text_as_floats(1 << 20)}
    nce.save(state, tmp_path / "s.pt")
    assert _plans(tmp_path / "s.pt") == {
        "text": ("zstd", 1),  # plain zstd codes it smaller: chosen
        "moments": ("zstd", 4),  # the dtype's plan, byte planes, wins
        "small_text": ("zstd", 4),  # too small to sample: the dtype's plan
    }
    loaded = nce.load(tmp_path / "s.pt")
    for key, tensor in state.items():
        assert_same_tensor(tensor, loaded[key], key)


def test_the_first_candidate_wins_ties_and_near_ties() -> None:
    none_plan, zstd_plan = Plan(NoneCodec(), 1, "u1"), Plan(ZstdCodec(), 1, "u1")
    noise = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert selection.choose([none_plan, zstd_plan], noise) is none_plan  # zstd gains nothing on noise
    zeros = torch.zeros(8 << 20, dtype=torch.uint8)
    assert selection.choose([none_plan, zstd_plan], zeros) is zstd_plan
    assert selection.choose([zstd_plan], zeros) is zstd_plan


@pytest.mark.parametrize("window", [selection.WINDOW_BYTES, 4 << 20])
def test_the_sample_is_small_and_spread_over_the_storage(window: int) -> None:
    span = torch.empty((64 << 20) + 8, dtype=torch.uint8)
    windows = selection.sample(span, window)
    assert len(windows) == selection.WINDOWS
    assert all(w.numel() == window for w in windows)
    starts = [w.data_ptr() - span.data_ptr() for w in windows]
    assert starts[0] == 0 and starts[-1] >= span.numel() - 2 * window
    assert all(s % 16 == 0 for s in starts)
    assert len(set(starts)) == len(starts)


def test_a_storage_of_few_windows_is_sampled_in_distinct_windows_or_whole() -> None:
    span = torch.empty(9 << 20, dtype=torch.uint8)
    starts = [w.data_ptr() - span.data_ptr() for w in selection.sample(span, 4 << 20)]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] + (4 << 20) <= span.numel()
    assert [w.numel() for w in selection.sample(span, 16 << 20)] == [span.numel()]


class _Framed(ZstdCodec):
    """A codec that models `frame_bytes` at a time, as nvCOMP does."""

    frame_bytes = 1 << 20


def test_windows_give_each_byte_plane_a_whole_frame_but_never_exceed_a_chunk() -> None:
    """A window smaller than width × frame would code every plane with one model, measuring the
    planes at their worst (the H200 kept ANS's float mode for second moments so); a window
    larger than a chunk would measure what the pipeline never codes."""
    typed, planes = Plan(_Framed(), 1, "f4"), Plan(_Framed(), 4, "u1")
    assert selection.window_bytes([typed, planes]) == 4 << 20
    assert selection.window_bytes([typed, planes], chunk_bytes=1 << 20) == 1 << 20
    assert selection.window_bytes([Plan(ZstdCodec(), 4, "u1")]) == selection.WINDOW_BYTES


def test_each_role_is_chosen_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if codecs.gpu_codecs_available():
        pytest.skip("counts the CPU candidates' samples")
    sampled: list[int] = []
    real = selection.coded_size
    monkeypatch.setattr(selection, "coded_size", lambda plan, windows: sampled.append(1) or real(plan, windows))
    layers = {f"layer.{i}.exp_avg_sq": torch.randn(1 << 20) ** 2 for i in range(6)}
    nce.save({"state": layers, "other": torch.randn(1 << 20)}, tmp_path / "s.pt")
    assert len(sampled) == 2 * 2  # two roles, two candidates each


def test_candidates_start_with_the_dtype_choice() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for algorithm in ("auto", "zstd", "deflate"):
            first = codecs.candidates_for(dtype, torch.device("cpu"), algorithm=algorithm, portable=False)[0]
            plan = codecs.plan_for(dtype, torch.device("cpu"), algorithm=algorithm, portable=False)
            assert (first.codec.name, first.width, first.element) == (plan.codec.name, plan.width, plan.element)
    assert len(codecs.candidates_for(torch.int64, torch.device("cpu"), algorithm="auto", portable=False)) == 1
    assert len(codecs.candidates_for(torch.float32, torch.device("cpu"), algorithm="zstd", portable=False)) == 1


@pytest.mark.gpu
def test_gpu_candidates_are_ans_typed_and_ans_planes_and_round_trip() -> None:
    if not codecs.gpu_codecs_available():
        pytest.skip("needs nvCOMP")
    device = torch.device("cuda")
    typed, planes = codecs.candidates_for(torch.float32, device, algorithm="auto", portable=False)
    assert (typed.codec.name, typed.width, typed.element) == ("ans", 1, "f4")
    assert (planes.codec.name, planes.width, planes.element) == ("ans", 4, "u1")
    moments = (torch.randn(4 << 20, device=device) * 1e-3) ** 2  # Adam second moments look like this
    chosen = selection.choose([typed, planes], moments.view(torch.uint8))
    windows = selection.sample(moments.view(torch.uint8), selection.window_bytes([typed, planes]))
    assert selection.coded_size(chosen, windows) <= selection.coded_size(typed, windows)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [
    lambda d: (torch.randn(16 << 20, device=d) * 1e-3) ** 2,          # second moments
    lambda d: torch.randn(16 << 20, device=d) * 0.02,                 # master weights
    lambda d: torch.randn(16 << 20, device=d) * 1e-4,                 # first moments
    lambda d: (torch.rand(16 << 20, device=d) * 1e-6).clamp_min(1e-9),
], ids=["exp_avg_sq", "master", "exp_avg", "uniform"])
def test_the_sample_chooses_what_codes_the_whole_storage_smaller(make) -> None:
    """The sample's choice is the plan that codes the whole storage, in the save's chunks,
    smaller (wherever the two differ by more than the margin twice over)."""
    if not codecs.gpu_codecs_available():
        pytest.skip("needs nvCOMP")
    device = torch.device("cuda")
    candidates = codecs.candidates_for(torch.float32, device, algorithm="auto", portable=False)
    span = make(device).view(torch.uint8)
    chunk = DEFAULT_CHUNK_MB << 20
    whole = [selection.coded_size(p, list(span.split(chunk))) for p in candidates]
    chosen = selection.choose(candidates, span, chunk_bytes=chunk)
    if abs(whole[0] - whole[1]) > 2 * selection.MARGIN * whole[0]:
        assert chosen is candidates[whole.index(min(whole))], whole


@pytest.mark.gpu
def test_gpu_auto_files_round_trip_whatever_plan_each_part_got(tmp_path: Path) -> None:
    if not codecs.gpu_codecs_available():
        pytest.skip("needs nvCOMP")
    device = torch.device("cuda")
    state = {"master": torch.randn(4 << 20, device=device), "exp_avg_sq": (torch.randn(4 << 20, device=device) * 1e-3) ** 2,
             "weights": torch.randn(4 << 20, device=device).bfloat16()}
    nce.save(state, tmp_path / "s.pt")
    plans = _plans(tmp_path / "s.pt")
    assert {name for name, _ in plans.values()} == {"ans"}
    loaded = nce.load(tmp_path / "s.pt")
    for key, tensor in state.items():
        assert_same_tensor(tensor, loaded[key], key)


def test_a_file_saved_again_keeps_its_choices_until_its_tensors_change_or_the_recheck(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ChoiceCache`: the second save of a file samples nothing and makes no codec; a change
    of a tensor's size, and every `recheck_every`-th save, sample again; another file has its
    own choices. The files are the same as without the cache."""
    if codecs.gpu_codecs_available():
        pytest.skip("counts the CPU candidates' samples")
    sampled: list[int] = []
    made: list[int] = []
    real_size, real_candidates = selection.coded_size, codecs.candidates_for
    monkeypatch.setattr(selection, "coded_size",
                        lambda plan, windows: sampled.append(1) or real_size(plan, windows))
    from nvcomp_ckpt_engine.pipeline import plan as plan_module
    monkeypatch.setattr(plan_module, "candidates_for",
                        lambda *a, **k: made.append(1) or real_candidates(*a, **k))
    state = {"moments": torch.randn(1 << 20) ** 2, "text": _text_as_floats(4 << 20)}
    cache = selection.ChoiceCache(recheck_every=3)
    nce.save(state, tmp_path / "plain.pt")
    counts = []
    for i in range(4):
        sampled.clear()
        made.clear()
        (tmp_path / f"{i}").mkdir()
        nce.save(state, tmp_path / f"{i}" / "s.pt", choices=cache)
        counts.append((len(sampled), len(made)))
        assert (tmp_path / f"{i}" / "s.pt").read_bytes() == (tmp_path / "plain.pt").read_bytes()
    assert counts == [(4, 1), (0, 0), (0, 0), (4, 0)]  # sampled, then kept, then rechecked
    sampled.clear()
    nce.save({"moments": torch.randn(1 << 20) ** 2, "text": _text_as_floats(8 << 20)},
             tmp_path / "0" / "s.pt", choices=cache)
    assert len(sampled) == 4  # a tensor changed size
    sampled.clear()
    nce.save(state, tmp_path / "0" / "other.pt", choices=cache)
    assert len(sampled) == 4  # another file


def test_the_choice_cache_refuses_a_recheck_period_below_one() -> None:
    with pytest.raises(ValueError, match="recheck_every"):
        selection.ChoiceCache(recheck_every=0)
