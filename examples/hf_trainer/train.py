"""Train a tiny GPT-2 with the Hugging Face Trainer and DeepSpeed; checkpoints are compressed.

The training code never names nvcomp_ckpt_engine: the ``"nvcomp_checkpoint"`` section of
ds_config.json turns it on, through the import hook the package installs. Every
``checkpoint-N/global_stepN/`` the Trainer saves then holds compressed shards and a manifest;
`nvcomp-ckpt inspect` and `nvcomp-ckpt verify` read them. Run again with ``--resume`` to
continue from the newest checkpoint for ``--steps`` more steps.

    pip install -e ".[deepspeed,hf]"      # transformers and accelerate come with the hf extra
    torchrun --nproc_per_node 2 examples/hf_trainer/train.py --output-dir runs/hf_trainer
    torchrun --nproc_per_node 2 examples/hf_trainer/train.py --output-dir runs/hf_trainer --resume

It runs on GPUs and, without one, on the CPU (DeepSpeed's CPU accelerator; the Trainer then
needs ``use_cpu=True``, and ds_config.json uses torch's Adam, which needs no compiled op).
DeepSpeed's first start in an environment builds an op (a minute or more on a CPU; the launch
scripts' demo shares the build), which the one line using the package here makes possible on
any machine and keeps in this environment (`jit_env.prepare`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from nvcomp_ckpt_engine.deepspeed import jit_env

if not torch.cuda.is_available():
    # DeepSpeed picks its accelerator when it is first imported (by transformers, below).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

DS_CONFIG = Path(__file__).with_name("ds_config.json")
#: Steps a run trains: from the start, or on from the checkpoint it resumes.
DEFAULT_STEPS = 8


class RandomTokens(torch.utils.data.Dataset):
    """Seeded random token sequences, so the example needs no download."""

    def __init__(self, samples: int = 64, length: int = 32, vocab: int = 128) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def resume_point(output_dir: str) -> tuple[str, int]:
    """The newest ``checkpoint-N`` folder in `output_dir` and its step N."""
    checkpoint = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if checkpoint is None:
        raise SystemExit(f"--resume: no checkpoint-N folder in {output_dir}; "
                         "run once without --resume first")
    return checkpoint, int(Path(checkpoint).name.rpartition("-")[2])


def target_step(steps: int | None, resumed_at: int | None) -> int:
    """The step to train until: `steps` where given, else DEFAULT_STEPS more than the run
    starts from; a target the resumed run has already reached is refused (it would train
    nothing)."""
    start = resumed_at or 0
    target = steps if steps is not None else start + DEFAULT_STEPS
    if target <= start:
        raise SystemExit(f"--steps {target}: the checkpoint is at step {start} already; "
                         f"give a later step, or leave --steps out to train {DEFAULT_STEPS} more")
    return target


def say(message: str) -> None:
    """Print once per job, on rank 0 (torchrun sets RANK)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"train until this step (default: {DEFAULT_STEPS}, and with "
                        f"--resume {DEFAULT_STEPS} more than the checkpoint's)")
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()

    jit_env.prepare()
    checkpoint, step = resume_point(args.output_dir) if args.resume else (None, None)
    max_steps = target_step(args.steps, step)
    if checkpoint is not None:
        say(f"resuming from {checkpoint} (step {step}); training until step {max_steps}")
    say("starting DeepSpeed (its first start in an environment builds an op: a minute or more "
        "on a CPU)")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2))
    training = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=str(DS_CONFIG),  # the only line that involves DeepSpeed and the engine
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_steps=args.save_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
    )
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=checkpoint)


if __name__ == "__main__":
    main()
