"""Regenerates the golden shard files of format versions 1, 3 and 4.

Run only on a deliberate format change (then bump FORMAT_VERSION and keep the old files):
    python tests/golden/make_golden.py

The version-2 files (`v2_derived/`) are kept as the release before version 4 wrote them: a
writer now records each derived range's digest, which makes such a file version 4
(`v4_derived/`, the same states).
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch

import nvcomp_ckpt_engine as nce

HERE = Path(__file__).parent
ALGORITHMS = ("zstd", "deflate", "none")


def golden_state() -> dict:
    """A small state with every feature the format has: dtypes, views, sharing, nesting."""
    gen = torch.Generator().manual_seed(1234)
    weights = torch.randn(64, 16, generator=gen)
    return {
        "module": collections.OrderedDict(
            weight=weights.bfloat16(),
            bias=torch.zeros(16, dtype=torch.float16),
        ),
        "master": weights,
        "master_view": weights[::2, 3:],
        "exp_avg": torch.randn(1024, generator=gen) * 1e-3,
        "step": torch.tensor(12, dtype=torch.int64),
        "mask": torch.arange(10) % 3 == 0,
        "fp8": torch.randn(32, generator=gen).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3),
        "meta": {"global_steps": 12, "lr": [1e-3, 2e-3], "name": "golden", "none": None},
    }


#: Version 2: a "module" file whose weights are derived from the fp32 "master" of a shard beside it.
V2_FOLDER = HERE / "v2_derived"
V2_SOURCE, V2_MODULE = "optim_states.nvckpt", "model_states.nvckpt"
#: Version 4: the same two files, the module's derived ranges recording their digests.
V4_FOLDER = HERE / "v4_derived"
V2_KEY = "optimizer_state_dict/single_partition_of_fp32_groups/0"


def golden_v2_states() -> tuple[dict, dict]:
    """The source shard's state and the module file's state (half derived, half stored)."""
    gen = torch.Generator().manual_seed(4321)
    master = torch.randn(96, generator=gen)
    flat = master.bfloat16()
    flat[80:] = flat[80:] * 2  # no longer the master rounded: stored
    module = {"module": collections.OrderedDict(weight=flat[:64].view(8, 8), bias=flat[64:80],
                                                 scale=flat[80:]), "buffer": torch.arange(4)}
    return {"optimizer_state_dict": {"single_partition_of_fp32_groups": [master]}}, module


def golden_v2_derive(tensor: torch.Tensor) -> list:
    """The pieces of the module's tensors that equal the master cast (all but `scale`)."""
    from nvcomp_ckpt_engine.derived import Piece

    start = tensor.storage_offset()
    if tensor.dtype != torch.bfloat16 or start >= 80:
        return []
    return [Piece(0, tensor.numel(), V2_SOURCE, V2_KEY, start)]


#: Version 3: tensors carrying Python attributes (their skeleton references hold them).
V3_FILE = HERE / "v3_attributes.nvckpt"


def golden_v3_state() -> dict:
    """DeepSpeed-like state whose tensors carry attributes (`ds_id` on a flat fp32 group, a
    Parameter's shape and name), one of them referred to twice, beside a plain tensor."""
    gen = torch.Generator().manual_seed(5678)
    flat = torch.randn(48, generator=gen)
    flat.ds_id = 7
    weight = torch.nn.Parameter(torch.randn(4, 4, generator=gen))
    weight.ds_shape, weight.param_name = (4, 4), "inp.weight"
    return {"fp32_flat_groups": [flat], "module": {"weight": weight, "tied": weight},
            "step": torch.tensor(3, dtype=torch.int64)}


def write_v3() -> None:
    nce.save(golden_v3_state(), V3_FILE, algorithm="zstd")


def main() -> None:
    for algorithm in ALGORITHMS:
        nce.save(golden_state(), HERE / f"v1_{algorithm}.nvckpt", algorithm=algorithm, chunk_mb=1 / 256)
    write_v3()
    source, module = golden_v2_states()
    V4_FOLDER.mkdir(exist_ok=True)
    nce.save(source, V4_FOLDER / V2_SOURCE, algorithm="zstd")
    nce.save(module, V4_FOLDER / V2_MODULE, algorithm="zstd", derive=golden_v2_derive)


if __name__ == "__main__":
    main()
