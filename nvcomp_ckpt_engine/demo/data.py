"""Deterministic training data: the Python standard library's own source as a byte corpus.

Every machine that runs the demo has these files, and the bytes never change for a given Python
version, so two runs see the same text. The order of the samples is a pure function of the seed
and the number of samples consumed so far: a resumed run that restores that number from the
checkpoint's client_state reads exactly the batches the interrupted run would have read next.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

# Plain-text modules present in every CPython install; ~0.2 MB of bytes together.
CORPUS_MODULES = ("argparse", "difflib", "textwrap")


def load_corpus(modules: tuple[str, ...] = CORPUS_MODULES) -> torch.Tensor:
    """Return the concatenated source bytes of `modules` as a 1-D uint8 tensor."""
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(".py"):
            raise RuntimeError(
                f"the demo corpus needs the source of the standard-library module {name!r}, "
                f"but this Python has {origin!r}; install the Python sources (e.g. Debian's "
                f"libpython3-stdlib) or use a Python from python.org or a venv of one"
            )
        parts.append(Path(origin).read_bytes())
    return torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)


class SampleOrder:
    """Maps a global sample number to a window of the corpus, in a seeded shuffled order.

    The corpus is cut into non-overlapping windows of `seq_len + 1` bytes. Epoch `e` visits all
    windows in the permutation drawn from a generator seeded with `seed + e`; sample number `n`
    is position `n % windows` of epoch `n // windows`. Nothing here depends on the rank or the
    world size: the caller decides which sample numbers a rank reads.
    """

    def __init__(self, corpus: torch.Tensor, seq_len: int, seed: int) -> None:
        self.windows = (corpus.numel() - 1) // (seq_len + 1)
        if self.windows < 1:
            raise ValueError(
                f"corpus of {corpus.numel()} bytes is shorter than one sample of {seq_len + 1}"
            )
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.windows)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.windows, generator=gen)
            self._epoch = epoch
        return int(self._perm[index])

    def batch(self, first_sample: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, both `[size, seq_len]` int64, of `size` samples from
        sample number `first_sample` on."""
        rows = []
        for sample in range(first_sample, first_sample + size):
            start = self._window(sample) * (self.seq_len + 1)
            rows.append(self.corpus[start : start + self.seq_len + 1])
        window = torch.stack(rows).long()
        return window[:, :-1], window[:, 1:]
