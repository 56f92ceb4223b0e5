"""Train a tiny GPT-2 with the Hugging Face Trainer and DeepSpeed; checkpoints are compressed.

Nothing here names nvcomp_ckpt_engine: the ``"nvcomp_checkpoint"`` section of ds_config.json
turns it on, through the import hook the package installs. Every ``checkpoint-N/global_stepN/``
the Trainer saves then holds compressed shards and a manifest; `nvcomp-ckpt inspect` and
`nvcomp-ckpt verify` read them. Run again with ``--resume`` to continue from the newest
checkpoint.

    torchrun --nproc_per_node 2 examples/hf_trainer/train.py --output-dir runs/hf_trainer

It runs on GPUs and, without one, on the CPU (DeepSpeed's CPU accelerator; the Trainer then
needs ``use_cpu=True``, and ds_config.json uses torch's Adam, which needs no compiled op).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # DeepSpeed picks its accelerator when it is first imported (by transformers, below).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

DS_CONFIG = Path(__file__).with_name("ds_config.json")


class RandomTokens(torch.utils.data.Dataset):
    """Seeded random token sequences, so the example needs no download."""

    def __init__(self, samples: int = 64, length: int = 32, vocab: int = 128) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=4)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2))
    training = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=str(DS_CONFIG),  # the only line that involves DeepSpeed and the engine
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=4,
        max_steps=args.steps,
        save_steps=args.save_steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
    )
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens())
    trainer.train(resume_from_checkpoint=True if args.resume else None)


if __name__ == "__main__":
    main()
