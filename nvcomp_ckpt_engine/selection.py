"""Which codec plan a storage gets under ``algorithm="auto"``: the candidate that codes a sample
of it smallest.

The dtype alone does not decide the best coding: fp32 Adam second moments compress better after
the byte-plane split than with ANS's float mode (1.248x against 1.210x on the H200 reference
state), while the master weights and first moments go the other way. So `auto` offers each
storage a few plans of the same speed class (`codecs.candidates_for`) and codes a sample — a few
windows spread over the storage, 1 MiB at most — with each. The dtype's plan (the first
candidate, what `auto` chose before) stays unless another codes the sample at least `MARGIN`
smaller, so no part compresses worse than before on its sample. The choice is made once per
role of a file (the key path with its numbers dropped: every layer's ``qkv.weight``, every
group's ``exp_avg_sq``), which bounds the cost for files of many tensors: a few nvCOMP calls of
1 MiB on a GPU, a few milliseconds of zstd on the CPU.
"""

from __future__ import annotations

import re

import torch

from . import transforms
from .codecs import Plan

#: Storages smaller than this keep the dtype's plan: too small for the choice to matter.
MIN_SAMPLED_BYTES = 4 << 20
#: The sample: this many windows of this many bytes, spread evenly over the storage.
WINDOWS = 4
WINDOW_BYTES = 256 << 10
#: Another plan must code the sample this much smaller than the dtype's plan to be chosen.
MARGIN = 0.005


def role(key: str) -> str:
    """What a tensor is, from its key path: the path with every number replaced by ``#``."""
    return re.sub(r"\d+", "#", key)


def sample(span: torch.Tensor) -> list[torch.Tensor]:
    """`WINDOWS` windows of `WINDOW_BYTES` of a 1-D uint8 span, evenly spread, 16-byte aligned
    (so every window holds whole elements of any width)."""
    stride = (span.numel() - WINDOW_BYTES) // max(1, WINDOWS - 1)
    starts = [min(i * stride, span.numel() - WINDOW_BYTES) // 16 * 16 for i in range(WINDOWS)]
    return [span[s : s + WINDOW_BYTES] for s in starts]


def coded_size(plan: Plan, windows: list[torch.Tensor]) -> int:
    """Bytes `plan` codes `windows` to (on the plan's device, as the pipeline would)."""
    device = torch.device("cuda", torch.cuda.current_device()) if plan.codec.device == "cuda" else torch.device("cpu")
    chunks = [transforms.to_planes(w.to(device), plan.width) for w in windows]
    return sum(p.numel() for p in plan.codec.encode_batch(chunks, element=plan.element))


def choose(candidates: list[Plan], span: torch.Tensor) -> Plan:
    """The plan for a storage whose bytes are `span` (see the module docstring)."""
    if len(candidates) == 1 or span.numel() < MIN_SAMPLED_BYTES:
        return candidates[0]
    windows = sample(span)
    sizes = [coded_size(plan, windows) for plan in candidates]
    best = min(range(len(candidates)), key=sizes.__getitem__)
    return candidates[best] if sizes[best] < sizes[0] * (1 - MARGIN) else candidates[0]


__all__ = ["MARGIN", "MIN_SAMPLED_BYTES", "choose", "coded_size", "role", "sample"]
