"""`nvcomp-ckpt`: look into, check, convert and price engine checkpoints from a shell.

Every command takes the places DeepSpeed users already know: a shard file, a tag folder
(``global_step100/``) or a save directory (the one holding ``latest``). `inspect` and `verify`
read only headers, indexes and checksummed bytes -- never a full restore -- so they are cheap and
need no GPU. `decompress` and `compress` convert between engine checkpoints and plain
`torch.save` checkpoints that DeepSpeed's own tools (``zero_to_fp32``, ``ds_to_universal``)
read; `to-universal` writes what ``ds_to_universal`` would, compressed, straight from the
shards (deepspeed/universal.py). `cost` turns measured figures into hours and dollars
(costmodel.py).

One module per command; what they share (where a PATH points, a tag's files, the walk of a
conversion) is in `common`. Only the module of the command that runs is imported, so a
command pays for (and needs) only what it uses: DeepSpeed is imported by `zero-to-fp32`,
`to-universal` and `compress` (its file names) alone.

Adding a subcommand: write a module with ``add_parser(subparsers)`` that creates its parser and
sets ``func=`` to a function ``(argparse.Namespace) -> int`` (the exit status), and list it in
`COMMANDS`. `main` turns `CheckpointError`, `OSError` and `ValueError` into a one-line message
and exit status 1, and `UsageError` into exit status 2 (what argparse uses). A PATH that holds
no engine checkpoint is status 1 for every command (`common.no_shards_error`). Output into a
pipe that closes early (``nvcomp-ckpt inspect --json | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Sequence

from ..errors import CheckpointError
from .common import UsageError

#: Every command, by the name it is called with, and its module in this package.
COMMANDS: dict[str, str] = {
    "inspect": "inspect",
    "verify": "verify",
    "decompress": "decompress",
    "compress": "compress",
    "zero-to-fp32": "zero_to_fp32",
    "to-universal": "to_universal",
    "cost": "cost",
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: with the command `argv` names, only that command's module is
    imported; without one (``--help``, a misspelt command) every command's, to list them."""
    parser = argparse.ArgumentParser(
        prog="nvcomp-ckpt",
        description="Inspect, verify, convert and price nvcomp_ckpt_engine checkpoints.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The top-level options take no value: the first other word is the command.
    named = next((word for word in argv if not word.startswith("-")), None)
    for name in [named] if named in COMMANDS else list(COMMANDS):
        importlib.import_module(f"{__name__}.{COMMANDS[name]}").add_parser(sub)
    return parser


#: The status of a command whose output pipe closed, as a shell reports a tool that SIGPIPE
#: ended (128 + 13).
EXIT_BROKEN_PIPE = 141


def _discard_stdout() -> None:
    """Point stdout at /dev/null after its reader went away (`| head`), so that the flush at
    the interpreter's exit does not fail again with a traceback."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured output)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 fault or error, 2 usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except UsageError as exc:
        print(f"nvcomp-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"nvcomp-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return 1
