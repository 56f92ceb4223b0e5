"""`nvcomp-ckpt zero-to-fp32`: DeepSpeed's own ``zero_to_fp32`` run on an engine checkpoint, its
``torch.load`` reading the engine's shards (no decompressed copy on disk)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compat import patch_torch_load
from ..errors import CorruptCheckpointError
from . import transfer
from .common import SubParsers

#: What DeepSpeed's converter raises on a layout it does not expect (a value of another type,
#: a missing key, its own asserts and checks); the command says it in one line naming the
#: checkpoint.
_DEEPSPEEDS_OWN = (AssertionError, AttributeError, KeyError, IndexError, TypeError, ValueError,
                   ZeroDivisionError, OverflowError, RecursionError, RuntimeError)


def run(args: argparse.Namespace) -> int:
    with transfer.local_tag_conversion(args.ckpt_dir, args.out_dir, args.tag) as (src, out):
        _convert(src, out, args)
    print(f"wrote consolidated {args.dtype} weights to {args.out_dir}")
    return 0


def _convert(src: str, out: str, args: argparse.Namespace) -> None:
    """DeepSpeed's converter on the local save folder `src`, writing `out`."""
    # Imported here: DeepSpeed takes seconds to import and no other command needs it.
    from deepspeed.utils import zero_to_fp32

    with patch_torch_load(trusted=args.trusted, root=src):
        try:
            zero_to_fp32.convert_zero_checkpoint_to_state_dict(
                src, out, dtype=args.dtype,
                max_shard_size=None if args.max_shard_size == "none" else args.max_shard_size,
                safe_serialization=args.safe_serialization, tag=args.tag,
                exclude_frozen_parameters=args.exclude_frozen_parameters,
            )
        except _DEEPSPEEDS_OWN as exc:  # its converter trusts the layout it reads
            where = Path(src) / args.tag if args.tag else Path(src)
            raise CorruptCheckpointError(
                f"{where}: DeepSpeed's zero_to_fp32 cannot convert this checkpoint "
                f"({type(exc).__name__}: {exc})") from exc


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("zero-to-fp32", help="run DeepSpeed's zero_to_fp32 on an engine checkpoint",
                       description="Consolidate a ZeRO checkpoint into one state dict with "
                       "DeepSpeed's own deepspeed.utils.zero_to_fp32, reading engine shards "
                       "directly (no decompressed copy on disk).")
    p.add_argument("ckpt_dir", help="the save directory (the folder holding the tag folders); a "
                   "path or an s3:// URL")
    p.add_argument("out_dir", help="directory for the consolidated weights (or an s3:// prefix "
                   "that holds no object)")
    p.add_argument("-t", "--tag", help="the tag to convert (default: 'latest')")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "fp32", "float16", "fp16", "bfloat16", "bf16"])
    p.add_argument("--max-shard-size", default="none",
                   help="split the output into files of this size, e.g. 5GB (with "
                   "huggingface_hub, installed with the deepspeed extra); default 'none': one file")
    p.add_argument("--safe-serialization", action="store_true",
                   help="write safetensors (needs safetensors)")
    p.add_argument("--exclude-frozen-parameters", action="store_true")
    p.add_argument("--trusted", action="store_true",
                   help="let the files create any class (skip the allowlist), and torch.load "
                   "read files that no manifest lists (only for checkpoints you trust)")
    p.set_defaults(func=run)
