"""Runs an example script as one torchrun worker, then ends the process as test workers do.

    torchrun ... tests/example_worker.py examples/NAME/train.py [ARGS...]

The example stays what a user would write; only the test's process exits through
`worker_exit.exit_worker_now` once the script has returned (see there for why).
"""

from __future__ import annotations

import runpy
import sys

from worker_exit import exit_worker_now

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    exit_worker_now()
