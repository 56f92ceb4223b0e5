"""`python -m nvcomp_ckpt_engine.demo`: one rank of the demo job (see `train.py`).

Two settings must be in the environment before the libraries that read them start: DeepSpeed
picks its accelerator when it is first imported, so without CUDA the CPU accelerator is chosen
here, before `train` imports DeepSpeed; cuBLAS is deterministic only with a fixed workspace
configuration, read when it is initialised.
"""

import os
import sys

import torch

if torch.cuda.is_available():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
else:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from .train import main  # noqa: E402  (must follow the accelerator choice)

sys.exit(main())
