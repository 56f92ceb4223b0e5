"""examples/hf_trainer/train.py's choices before it trains (no training here): which checkpoint
`--resume` continues from, and that its default steps train on from there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer" / "train.py"


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("transformers", reason="needs the hf extra (pip install -e '.[hf]')")
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_finds_the_newest_checkpoint(example, tmp_path):
    for step in (4, 8, 12):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-99.txt").write_text("not a checkpoint folder")
    assert example.resume_point(str(tmp_path)) == (str(tmp_path / "checkpoint-12"), 12)
    with pytest.raises(SystemExit, match="no checkpoint-N folder"):
        example.resume_point(str(tmp_path / "nothing"))


def test_default_steps_train_on_after_a_resume(example):
    default = example.DEFAULT_STEPS
    assert example.target_step(None, None) == default
    assert example.target_step(None, 8) == 8 + default  # not 8: a resume that trains nothing
    assert example.target_step(20, 8) == 20
    with pytest.raises(SystemExit, match="at step 8 already"):
        example.target_step(8, 8)
