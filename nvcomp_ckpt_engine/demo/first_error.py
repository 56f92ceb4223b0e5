"""The line of a launch's log that explains why it failed: the first error, not the last lines.

When a rank fails, the end of a torchrun log is torchrun's own report (``ChildFailedError``, the
exit code of each rank), and the cause -- the exception the rank raised -- is further up, often
among the interleaved output of the other ranks. This finds it: the exception line that ends the
first traceback (with the ``File`` line above it: where it was raised), or an error line printed
without a traceback (``RuntimeError: ...``), whichever comes first.

Lines may carry the prefix torch's distributed runtime puts before a rank's traceback
(``[rank0]: ``) or torchrun's per-rank prefix (``[default0]:``); each prefix is followed as its
own stream, so two ranks' tracebacks printed at once are not mixed up.

    python -m nvcomp_ckpt_engine.demo.first_error LOG [NAME]   (used by launch_scripts/)

It imports nothing beyond the standard library, so it runs where the job could not even start.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

TRACEBACK = "Traceback (most recent call last):"
#: "[rank0]: " (torch.distributed's exception hook), "[default0]:" (torchrun's --tee prefix).
_RANK_PREFIX = re.compile(r"^\[[\w.-]+\]:\s?")
#: An exception's line: a (dotted) class name ending in Error, Exception, ... and its message.
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)(:.*)?$")


@dataclass(frozen=True)
class FirstError:
    """The explaining line: its 1-based number in the log, its text (prefix removed) and, for a
    traceback, its last ``File "...", line N, in f`` line."""

    line_number: int
    text: str
    raised_at: str | None = None

    def describe(self, name: str) -> str:
        """Where and what, for a log called `name` (its path, or "the output above")."""
        where = f"\n  {self.raised_at}" if self.raised_at else ""
        return f"--- the first error in {name} (line {self.line_number}):{where}\n{self.text}"


def first_error(lines: Iterable[str]) -> FirstError | None:
    """The first error of a log: the exception that ends the first complete traceback, or an
    error line outside any traceback, whichever is first; None when there is neither."""
    open_tracebacks: dict[str, str | None] = {}  # prefix -> its traceback's last File line
    for number, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        match = _RANK_PREFIX.match(line)
        prefix = match.group(0).strip() if match else ""
        line = line[match.end():] if match else line
        if line.startswith(TRACEBACK):
            open_tracebacks[prefix] = None
        elif prefix in open_tracebacks:
            if line[:1] in (" ", "\t"):  # a frame: its File line, its code, a caret line
                if line.lstrip().startswith('File "'):
                    open_tracebacks[prefix] = line.strip()
            elif line.strip():
                return FirstError(number, line, open_tracebacks[prefix])
        elif _ERROR_LINE.match(line):
            return FirstError(number, line)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``first_error LOG [NAME]``: print the first error of LOG, called NAME in the message
    (default: LOG's path); exit status 1 where it has none."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) not in (1, 2):
        print("usage: python -m nvcomp_ckpt_engine.demo.first_error LOG [NAME]", file=sys.stderr)
        return 2
    log, name = argv[0], argv[-1]
    with Path(log).open(encoding="utf-8", errors="replace") as f:
        found = first_error(f)
    if found is None:
        print(f"--- no error line in {name}")
        return 1
    print(found.describe(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
