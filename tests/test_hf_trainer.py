"""The Hugging Face Trainer saves through the engine and resumes from its checkpoint, on the CPU.

The Trainer calls `deepspeed.initialize` itself (through accelerate), so only ds_config's
"nvcomp_checkpoint" section and the package's import hook can bring the engine in: this file's
training code never imports it. Under DeepSpeed on a CPU the Trainer works only with
`TrainingArguments(use_cpu=True, deepspeed=...)` and ZeRO-2.

This file is also the training program: the test starts it under torchrun with 2 ranks.
1. reference: 6 steps of a tiny GPT-2, a checkpoint every 3 steps;
2. the job: a fresh output directory that holds only the reference's `checkpoint-3`, as if the
   job had died after step 3, and `resume_from_checkpoint=True`: steps 4-6 must have the
   reference's losses on every rank, bit for bit, and end with the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from worker_exit import exit_worker_now

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE_STEPS = 6, 3
LAUNCH_TIMEOUT_S = 600


def ds_config() -> dict[str, Any]:
    """ZeRO-2, fp32, torch's Adam (no fused op on a CPU); "auto" values come from the Trainer."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto",
                "torch_adam": True,
            },
        },
        "nvcomp_checkpoint": {"enabled": True},
    }


class TokenDataset(torch.utils.data.Dataset):
    """Seeded random token sequences: the same samples in every process and every run."""

    def __init__(self, samples: int = 64, length: int = 16, vocab: int = 64) -> None:
        self.tokens = torch.randint(
            0, vocab, (samples, length), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def train(output_dir: Path, resume: bool) -> None:
    """One rank of the training job; writes `losses_rank{R}.json`: {step: loss} of this rank."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class LossRecordingTrainer(Trainer):
        """Keeps each step's exact loss; the Trainer's own log rounds it to 4 digits."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.losses: dict[int, float] = {}

        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses[self.state.global_step + 1] = loss.item()
            return loss

    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, deepspeed=ds_config(),
        per_device_train_batch_size=4, max_steps=STEPS,
        save_strategy="steps", save_steps=SAVE_STEPS,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to="none",
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=TokenDataset())
    trainer.train(resume_from_checkpoint=True if resume else None)
    rank = torch.distributed.get_rank()
    (output_dir / f"losses_rank{rank}.json").write_text(json.dumps(trainer.losses))
    trainer.model_wrapped.destroy()
    torch.distributed.destroy_process_group()


def run_job(output_dir: Path, *, resume: bool) -> None:
    """This file under torchrun, 2 ranks on the CPU; fails the test with the output's tail."""
    torchrun_2_ranks([__file__, "--output-dir", str(output_dir),
                      *(["--resume"] if resume else [])])


def torchrun_2_ranks(script_and_args: list[str]) -> None:
    """A script under torchrun, 2 ranks on the CPU; fails the test with the output's tail."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if sys.prefix != sys.base_prefix:  # one JIT-op cache per environment
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", *script_and_args]
    result = subprocess.run(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]


def read_losses(output_dir: Path, rank: int) -> dict[int, float]:
    return {
        int(step): loss
        for step, loss in json.loads((output_dir / f"losses_rank{rank}.json").read_text()).items()
    }


@pytest.mark.slow
def test_trainer_resumes_bit_exact_from_engine_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip(
        "transformers", reason="needs transformers (pip install transformers accelerate)"
    )
    pytest.importorskip(
        "accelerate", reason="needs accelerate (pip install transformers accelerate)"
    )
    from safetensors.torch import load_file

    from nvcomp_ckpt_engine import is_shard_file
    from nvcomp_ckpt_engine.cli import main as nvcomp_ckpt_cli
    from nvcomp_ckpt_engine.manifest import MANIFEST_NAME

    reference, job = tmp_path / "reference", tmp_path / "job"
    run_job(reference, resume=False)
    first = reference / f"checkpoint-{SAVE_STEPS}"
    tag_dir = first / f"global_step{SAVE_STEPS}"
    assert (tag_dir / MANIFEST_NAME).is_file(), (
        f"{tag_dir} has no {MANIFEST_NAME}: is the package installed (pip install -e .), so that "
        f"its DeepSpeed import hook runs?"
    )
    shards = sorted(tag_dir.glob("*.pt"))
    assert shards and all(is_shard_file(p) for p in shards), [p.name for p in shards]
    assert nvcomp_ckpt_cli(["verify", "-q", str(first)]) == 0

    shutil.copytree(first, job / first.name)
    run_job(job, resume=True)
    for rank in (0, 1):
        expected = {
            step: loss for step, loss in read_losses(reference, rank).items() if step > SAVE_STEPS
        }
        assert read_losses(job, rank) == expected, f"rank {rank}"
    final = f"checkpoint-{STEPS}"
    assert json.loads((job / final / "trainer_state.json").read_text())["global_step"] == STEPS
    weights, reference_weights = load_file(job / final / "model.safetensors"), load_file(
        reference / final / "model.safetensors"
    )
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)


@pytest.mark.slow
def test_the_readme_example_saves_compressed_checkpoints(tmp_path: Path) -> None:
    """examples/hf_trainer/train.py, as README shows it: ds_config.json alone brings the engine."""
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    from nvcomp_ckpt_engine import is_shard_file
    from nvcomp_ckpt_engine.cli import main as nvcomp_ckpt_cli
    from nvcomp_ckpt_engine.manifest import MANIFEST_NAME, read_manifest

    worker = Path(__file__).with_name("example_worker.py")
    example = ROOT / "examples" / "hf_trainer" / "train.py"
    torchrun_2_ranks([str(worker), str(example), "--output-dir", str(tmp_path), "--steps", "4",
                      "--save-steps", "2"])
    for step in (2, 4):
        tag_dir = tmp_path / f"checkpoint-{step}" / f"global_step{step}"
        assert (tag_dir / MANIFEST_NAME).is_file(), sorted(tmp_path.rglob("*"))
        found = read_manifest(tag_dir)
        assert found.world_size == 2 and found.files
        assert all(is_shard_file(tag_dir / record.path) for record in found.files)
        assert nvcomp_ckpt_cli(["verify", "-q", str(tag_dir.parent)]) == 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="one rank of the HF Trainer job (see the module docstring)"
    )
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    cli = parser.parse_args()
    train(cli.output_dir, cli.resume)
    exit_worker_now()
