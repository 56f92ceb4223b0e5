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

A job saves the same files again and again with the same tensors in them: `ChoiceCache` keeps a
file's choices (and the candidates' codec objects) from one save to the next while its tensors'
keys, dtypes, sizes and devices are unchanged, and samples again every `RECHECK_EVERY` saves,
since the values drift as training goes on. Sampling and making the codecs took 0.03-0.04 s of
an async save's stall at 1.3B (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

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
#: A file's cached choices are sampled again at every this many saves of it (`ChoiceCache`).
RECHECK_EVERY = 10


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


@dataclasses.dataclass
class Choices:
    """`auto`'s choices for one file: the candidate plans per (dtype, device type), made once,
    and the plan chosen per (role, dtype, device type). Filled by the planner as it goes."""

    candidates: dict[tuple[torch.dtype, str], list[Plan]] = dataclasses.field(default_factory=dict)
    chosen: dict[tuple[str, torch.dtype, str], Plan] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Cached:
    signature: Any
    choices: Choices
    saves: int = 0


class ChoiceCache:
    """The choices of the files a job saves again and again, by file (`part`: its name in the
    checkpoint), kept while the file's signature (what the planner says of its storages: keys,
    dtypes, sizes, devices, options) is unchanged; sampled again every `recheck_every` saves,
    keeping the codec objects. For one job's saves: a file's saves do not overlap (the engine
    waits for one before the next), so the codec objects of one are free for the next."""

    def __init__(self, recheck_every: int = RECHECK_EVERY) -> None:
        if recheck_every < 1:
            raise ValueError(f"recheck_every must be at least 1, got {recheck_every}")
        self.recheck_every = recheck_every
        self._parts: dict[str, _Cached] = {}
        self._lock = threading.Lock()

    def for_part(self, part: str, signature: Any) -> Choices:
        """The choices to plan `part` with: the cached ones while `signature` is unchanged and
        the recheck is not due; else fresh ones (the codec objects kept for a recheck)."""
        with self._lock:
            cached = self._parts.get(part)
            if cached is None or cached.signature != signature:
                cached = self._parts[part] = _Cached(signature, Choices())
            elif cached.saves % self.recheck_every == 0:
                cached.choices = Choices(candidates=cached.choices.candidates)
            cached.saves += 1
            return cached.choices


__all__ = ["MARGIN", "MIN_SAMPLED_BYTES", "RECHECK_EVERY", "WINDOWS", "WINDOW_BYTES", "ChoiceCache",
           "Choices", "choose", "coded_size", "role", "sample", "window_bytes"]
