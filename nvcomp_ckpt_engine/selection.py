"""Which codec plan a storage gets under ``algorithm="auto"``: the candidate that codes a sample
of it smallest.

The dtype alone does not decide the best coding: fp32 Adam second moments compress better after
the byte-plane split than with ANS's float mode (1.248x against 1.210x on the H200 reference
state), while the master weights and first moments go the other way. So `auto` offers each
storage a few plans of the same speed class (`codecs.candidates_for`) and codes a sample — a few
windows spread over the storage — with each. A window is coded as the pipeline codes a chunk, so
it must give each byte plane at least one of the codec's frames (nvCOMP ANS models 1 MiB at a
time): a 256 KiB window of fp32 planes would put all four planes in one frame, one model, and
measure the planes at their worst (on the H200 that kept ANS's float mode for second moments
that byte planes code 3% smaller). So windows are 256 KiB on the CPU, width × frame (4 MiB for
fp32) for nvCOMP: 16 MiB per role, a few milliseconds of ANS. The dtype's plan (the first
candidate, what `auto` chose before) stays unless another codes the sample at least `MARGIN`
smaller, so no part compresses worse than before on its sample. The choice is made once per
role of a file (the key path with its numbers dropped: every layer's ``qkv.weight``, every
group's ``exp_avg_sq``), which bounds the cost for files of many tensors.
"""

from __future__ import annotations

import re

import torch

from . import transforms
from .codecs import Plan

#: Storages smaller than this keep the dtype's plan: too small for the choice to matter.
MIN_SAMPLED_BYTES = 4 << 20
#: The sample: this many windows, spread evenly over the storage, of at least this many bytes
#: (`window_bytes`).
WINDOWS = 4
WINDOW_BYTES = 256 << 10
#: Another plan must code the sample this much smaller than the dtype's plan to be chosen.
MARGIN = 0.005


def role(key: str) -> str:
    """What a tensor is, from its key path: the path with every number replaced by ``#``."""
    return re.sub(r"\d+", "#", key)


def window_bytes(candidates: list[Plan], chunk_bytes: int | None = None) -> int:
    """The window that measures every candidate as the pipeline codes it: `WINDOW_BYTES`, or
    enough for each byte plane to fill one of the codec's frames, but never more than a chunk
    of the save (`chunk_bytes`: a chunk is what the pipeline codes as one)."""
    window = max([WINDOW_BYTES] + [p.width * p.codec.frame_bytes for p in candidates])
    return window if chunk_bytes is None else min(window, chunk_bytes)


def sample(span: torch.Tensor, window: int = WINDOW_BYTES) -> list[torch.Tensor]:
    """Up to `WINDOWS` distinct windows of `window` bytes of a 1-D uint8 span (the whole span if
    it is smaller), evenly spread, 16-byte aligned (so every window holds whole elements of any
    width)."""
    if span.numel() <= window:
        return [span]
    count = min(WINDOWS, span.numel() // window)
    stride = (span.numel() - window) // max(1, count - 1)
    starts = [min(i * stride, span.numel() - window) // 16 * 16 for i in range(count)]
    return [span[s : s + window] for s in starts]


def coded_size(plan: Plan, windows: list[torch.Tensor]) -> int:
    """Bytes `plan` codes `windows` to (on the plan's device, as the pipeline would)."""
    device = torch.device("cuda", torch.cuda.current_device()) if plan.codec.device == "cuda" else torch.device("cpu")
    chunks = [transforms.to_planes(w.to(device), plan.width) for w in windows]
    return sum(p.numel() for p in plan.codec.encode_batch(chunks, element=plan.element))


def choose(candidates: list[Plan], span: torch.Tensor, *, chunk_bytes: int | None = None) -> Plan:
    """The plan for a storage whose bytes are `span`, saved in chunks of `chunk_bytes` (see the
    module docstring)."""
    if len(candidates) == 1 or span.numel() < MIN_SAMPLED_BYTES:
        return candidates[0]
    windows = sample(span, window_bytes(candidates, chunk_bytes))
    sizes = [coded_size(plan, windows) for plan in candidates]
    best = min(range(len(candidates)), key=sizes.__getitem__)
    return candidates[best] if sizes[best] < sizes[0] * (1 - MARGIN) else candidates[0]


__all__ = ["MARGIN", "MIN_SAMPLED_BYTES", "WINDOWS", "WINDOW_BYTES", "choose", "coded_size", "role",
           "sample", "window_bytes"]
