"""What `nvcomp-ckpt` prints and returns around its commands: a small checkpoint priced in units
that fit it, a closed output pipe, and one exit status for a folder that holds no checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nvcomp_ckpt_engine as nce
from nvcomp_ckpt_engine import cli
from nvcomp_ckpt_engine.cli import cost

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("gb, text", [
    (782.0, "782.0 GB"), (1980.0, "1,980.0 GB"), (0.0019, "1.9 MB"), (1.9e-6, "1.9 KB"),
    (3.12e-7, "312 B"), (0.0, "0.0 GB"),
])
def test_sizes_in_the_unit_that_fits(gb, text):
    assert cost.decimal_size_text(gb) == text


@pytest.mark.parametrize("usd, text", [
    (2202.4, "$2,202"), (3.4, "$3.40"), (0.042, "$0.04"), (0.0042, "$0.0042"),
    (0.000000038, "$0.000000038"), (0.0, "$0"),
])
def test_dollars_down_to_two_significant_digits(usd, text):
    assert cost.usd_text(usd) == text


def test_durations_in_the_unit_that_fits():
    assert cost.duration_text(156.4) == "156.4 s"
    assert cost.duration_text(0.0031) == "3.1 ms"
    assert cost.duration_text(62.6 * 3600, "h") == "62.6 h"
    assert cost.duration_text(0.5 * 3600, "h") == "30.0 min"


def test_cost_of_a_small_checkpoint_shows_no_zero_figures(tmp_path, capsys):
    shard = tmp_path / "mp_rank_00_model_states.pt"
    nce.save({"w": torch.arange(256, dtype=torch.float32)}, shard, algorithm="zstd")
    status, out, _ = run_cli(capsys, "cost", "--from", str(shard), "--gpus", "1",
                             "--storage-usd-per-gb-month", "0.02")
    assert status == 0
    assert not re.search(r"(?<![\d,])0\.0 GB(?!/s)|\$0\b(?!\.)", out), out
    assert out.startswith("checkpoint 1.") and " KB [measured in " in out
    stored = next(line for line in out.splitlines() if line.startswith("stored"))
    assert stored.startswith("stored (KB)") and all(float(v) > 0 for v in stored.split()[2:])
    for label in ("idle GPUs per month ($)", "storage per month ($)"):
        line = next(line for line in out.splitlines() if line.startswith(label))
        assert all(float(v) > 0 for v in line[len(label):].split()), line
    # Large figures keep their units and decimals.
    status, out, _ = run_cli(capsys, "cost", "--ratio", "1.25")
    assert "wait per checkpoint (s)" in out and "stored (GB)" in out and "2,202" in out


def test_a_closed_output_pipe_ends_quietly():
    """`nvcomp-ckpt ... | head`: the reader is gone before the command writes; no traceback."""
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "nvcomp_ckpt_engine", "cost", "--json"],
                            stdout=write_end, stderr=subprocess.PIPE, env=env)
    os.close(write_end)
    os.close(read_end)
    _, err = proc.communicate(timeout=120)
    assert err.decode() == "" and proc.returncode == cli.EXIT_BROKEN_PIPE


def test_a_folder_without_a_checkpoint_is_status_1_for_every_command(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "notes").mkdir(parents=True)
    for argv in (["inspect", str(empty)], ["verify", str(empty)],
                 ["decompress", str(empty), str(tmp_path / "out1")],
                 ["cost", "--from", str(empty)]):
        status, _, err = run_cli(capsys, *argv)
        assert status == 1, (argv, err)
        assert str(empty) in err
    # A save directory with tags but no `latest` is a request to complete: --tag (status 2).
    tagged = tmp_path / "tagged"
    (tagged / "global_step1").mkdir(parents=True)
    nce.save({"w": torch.ones(2)}, tagged / "global_step1" / "mp_rank_00_model_states.pt")
    status, _, err = run_cli(capsys, "inspect", str(tagged))
    assert status == 2 and "--tag" in err
