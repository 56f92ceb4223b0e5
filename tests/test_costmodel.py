"""The cost model's arithmetic, checked against NVIDIA's published example and by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nvcomp_ckpt_engine.costmodel import CostInputs, estimate, read_bench_json

#: NVIDIA's write-up: a 70B model's 782 GB checkpoint, 5 GB/s of shared storage, a checkpoint
#: every 30 minutes (48 a day), a 30-day month, 8 GPUs at $4.40 per GPU-hour.
WRITE_UP = dict(checkpoint_gb=782, write_gbps=5, interval_min=30, gpus=8, gpu_hour_usd=4.40)


def test_write_up_baseline_figures():
    report = estimate(CostInputs(**WRITE_UP))
    assert report.checkpoints_per_month == 48 * 30
    assert report.baseline.wait_s == pytest.approx(156.4)
    assert report.baseline.wait_hours_month == pytest.approx(62.56)
    assert round(report.baseline.wait_hours_month, 1) == 62.6
    # 156.4 s x 48 x 30 / 3600 = 62.56 h; x 8 GPUs x $4.40 = $2,202.11
    assert report.baseline.idle_gpu_usd_month == pytest.approx(2202.112)


def test_without_compression_both_columns_agree():
    report = estimate(CostInputs(**WRITE_UP))
    assert report.compressed.wait_s == report.baseline.wait_s
    assert report.savings_usd_month == 0
    assert report.savings_hours_month == 0


def test_pipelined_wait_is_the_slowest_stage():
    # 782 GB / 8 GPUs = 97.75 GB each; compress at 100 GB/s per GPU = 0.9775 s.
    # Compressed write: 782 / 1.25 / 5 = 125.12 s; that is the bottleneck.
    report = estimate(CostInputs(**WRITE_UP, ratio=1.25, compress_gbps=100))
    assert report.compress_s == pytest.approx(0.9775)
    assert report.compressed_write_s == pytest.approx(125.12)
    assert report.compressed.wait_s == pytest.approx(125.12)
    assert report.bottleneck == "write"
    saved_h = (156.4 - 125.12) * 48 * 30 / 3600
    assert report.savings_hours_month == pytest.approx(saved_h)
    assert report.savings_usd_month == pytest.approx(saved_h * 8 * 4.40)


def test_slow_compression_becomes_the_bottleneck():
    # 97.75 GB per GPU at 0.5 GB/s = 195.5 s, slower than the uncompressed write.
    report = estimate(CostInputs(**WRITE_UP, ratio=1.25, compress_gbps=0.5))
    assert report.bottleneck == "compress"
    assert report.compressed.wait_s == pytest.approx(195.5)
    assert report.savings_usd_month < 0


def test_copy_stage_counts_when_given():
    # 97.75 GB / 1.25 per GPU at 0.5 GB/s = 156.4 s of device-to-host copy.
    report = estimate(CostInputs(**WRITE_UP, ratio=1.25, compress_gbps=100, copy_gbps=0.5))
    assert report.bottleneck == "copy"
    assert report.copy_s == pytest.approx(156.4)


def test_storage_cost_scales_with_retention_and_ratio():
    report = estimate(CostInputs(**WRITE_UP, keep=3, storage_usd_per_gb_month=0.10, ratio=1.25))
    assert report.baseline.stored_gb == pytest.approx(3 * 782)
    assert report.baseline.storage_usd_month == pytest.approx(234.6)
    assert report.compressed.stored_gb == pytest.approx(3 * 782 / 1.25)
    assert report.compressed.storage_usd_month == pytest.approx(187.68)
    assert report.baseline.total_usd_month == pytest.approx(2202.112 + 234.6)


def test_to_dict_is_json_and_has_no_infinity():
    text = json.dumps(estimate(CostInputs(**WRITE_UP)).to_dict(), allow_nan=False)
    data = json.loads(text)
    assert data["inputs"]["compress_gbps"] is None
    assert data["baseline"]["wait_s"] == pytest.approx(156.4)
    assert data["bottleneck"] == "write"


#: A ZeRO-1/2 bf16 job of 70B parameters on 64 GPUs: 980 GB (14 B/param), of which the 140 GB
#: bf16 module is written by rank 0 alone; each rank writes at most 1 GB/s, 100 GB/s in all.
STRAGGLER = dict(WRITE_UP, checkpoint_gb=980, module_gb=140, gpus=64, write_gbps=100, rank_write_gbps=1)


def test_the_module_on_rank_0_is_the_straggler_and_deriving_it_removes_it():
    report = estimate(CostInputs(**STRAGGLER, ratio=1.25, compress_gbps=100))
    share = (980 - 140) / 64  # 13.125 GB of optimizer state per rank
    plain = report.ranks_baseline
    assert (plain.rank0_gb, plain.other_gb) == (pytest.approx(share + 140), pytest.approx(share))
    assert plain.straggler == pytest.approx((share + 140) / share)
    # Rank 0's 153.1 GB at 1 GB/s bind; the aggregate would take 980 / 100 = 9.8 s.
    assert report.baseline.wait_s == pytest.approx(share + 140)
    assert report.compressed_module_on_rank0.wait_s == pytest.approx((share + 140) / 1.25)
    # Derived: every rank writes share / 1.25; still the per-rank bound (10.5 s > 672 / 100).
    assert report.ranks_compressed.straggler == 1.0
    assert report.compressed.wait_s == pytest.approx(share / 1.25)
    assert report.compressed.stored_gb == pytest.approx((980 - 140) / 1.25)
    assert report.compressed_module_on_rank0.stored_gb == pytest.approx(980 / 1.25)
    assert report.compress_s == pytest.approx(share / 100)


def test_the_aggregate_binds_when_ranks_are_fast():
    report = estimate(CostInputs(**{**STRAGGLER, "rank_write_gbps": 50}, ratio=1.25))
    assert report.baseline.wait_s == pytest.approx(980 / 100)  # 153.1 / 50 = 3.1 s < 9.8 s
    assert report.compressed.wait_s == pytest.approx(840 / 1.25 / 100)
    without_limit = estimate(CostInputs(**{**STRAGGLER, "rank_write_gbps": None}, ratio=1.25))
    assert without_limit.compressed_module_on_rank0.wait_s == pytest.approx(980 / 1.25 / 100)


def test_without_a_module_the_two_compressed_columns_agree():
    report = estimate(CostInputs(**WRITE_UP, ratio=1.25, compress_gbps=100))
    assert report.compressed_module_on_rank0 == report.compressed
    assert report.ranks_baseline.straggler == 1.0


@pytest.mark.parametrize(
    "field, value",
    [("checkpoint_gb", 0), ("write_gbps", -1), ("interval_min", 0), ("gpus", 0),
     ("ratio", 0), ("compress_gbps", 0), ("gpu_hour_usd", -1), ("keep", -1),
     ("copy_gbps", 0), ("ratio", math.nan), ("module_gb", -1), ("module_gb", 782),
     ("rank_write_gbps", 0)],
)
def test_bad_inputs_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CostInputs(**{**WRITE_UP, field: value})


def test_bench_json_schema(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"ratio": 1.22, "compress_gbps": 110.5, "extra": {"any": 1}}))
    figures = read_bench_json(path)
    assert (figures.ratio, figures.compress_gbps, figures.write_gbps) == (1.22, 110.5, None)
    path.write_text(json.dumps({"ratio": 1.2, "compress_gbps": 90, "write_gbps": 4}))
    assert read_bench_json(path).write_gbps == 4.0


@pytest.mark.parametrize(
    "content, message",
    [("[1, 2]", "JSON object"), ("{", "not valid JSON"), ('{"compress_gbps": 1}', "'ratio'"),
     ('{"ratio": 1.2, "compress_gbps": "fast"}', "'compress_gbps'"),
     ('{"ratio": true, "compress_gbps": 1}', "'ratio'"),
     ('{"ratio": 1.2, "compress_gbps": 1, "write_gbps": 0}', "'write_gbps'")],
)
def test_bad_bench_json_names_file_and_key(tmp_path, content, message):
    path = tmp_path / "bench.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        read_bench_json(path)
    assert "bench.json" in str(info.value)


def _deepspeed_report(*variants: dict, write_gbps: float = 1.5) -> dict:
    return {"bandwidth": {"write_fsync_gbps": write_gbps}, "results": list(variants)}


def test_bench_deepspeed_report_gives_ratio_capture_rate_and_write_bandwidth(tmp_path):
    path = tmp_path / "bench_deepspeed.json"
    path.write_text(json.dumps(_deepspeed_report(
        {"variant": "default", "bytes": 18e9, "blocked_s": 20.0},
        {"variant": "zstd", "bytes": 16e9, "blocked_s": 9.0},
        {"variant": "auto", "bytes": 15e9, "blocked_s": 8.0},
        {"variant": "auto-async", "bytes": 15e9, "blocked_s": 4.0, "blocked_s_later": 0.4},
    )))
    figures = read_bench_json(path)
    assert figures.ratio == pytest.approx(18 / 15)  # against auto, not zstd
    assert figures.compress_gbps == pytest.approx(18 / 0.4)  # a later save: no pinning in it
    assert figures.write_gbps == 1.5
    assert set(figures.notes) == {"ratio", "compress_gbps"}


def test_bench_deepspeed_report_without_async_has_no_compress_rate(tmp_path):
    path = tmp_path / "bench_deepspeed.json"
    path.write_text(json.dumps(_deepspeed_report({"variant": "default", "bytes": 10e9},
                                                 {"variant": "ans", "bytes": 8e9})))
    figures = read_bench_json(path)
    assert (figures.ratio, figures.compress_gbps) == (pytest.approx(1.25), None)


@pytest.mark.parametrize(
    "variants, message",
    [([{"variant": "auto", "bytes": 1}], "no 'default' variant"),
     ([{"variant": "default", "bytes": 1}, {"variant": "auto-async", "bytes": 1}], "no sync variant"),
     ([{"variant": "default", "bytes": 1}, {"variant": "auto", "bytes": 0}], r"results\[auto\].bytes")],
)
def test_bad_bench_deepspeed_report_names_what_is_missing(tmp_path, variants, message):
    path = tmp_path / "bench_deepspeed.json"
    path.write_text(json.dumps(_deepspeed_report(*variants)))
    with pytest.raises(ValueError, match=message) as info:
        read_bench_json(path)
    assert "bench_deepspeed.json" in str(info.value)


def test_the_published_h200_report_reads():
    report = Path(__file__).resolve().parents[1] / "docs" / "results" / "bench_deepspeed_h200.json"
    data = json.loads(report.read_text())
    sizes = {r["variant"]: r["bytes"] for r in data["results"]}
    figures = read_bench_json(report)
    assert figures.ratio == pytest.approx(sizes["default"] / sizes["auto"])
    assert figures.write_gbps == pytest.approx(data["bandwidth"]["write_fsync_gbps"])
    assert figures.compress_gbps > 0
