"""`python -m nvcomp_ckpt_engine`: the `nvcomp-ckpt` command, where no script is installed."""

import sys

from .cli import main

sys.exit(main())
