"""Package metadata, plus the one build step setuptools cannot express: installing a .pth file.

`nvcomp_ckpt_engine_hook.pth` must land directly in site-packages, where Python's `site` runs
it at interpreter start (see `_nvcomp_ckpt_engine_hook`). A wheel puts what is at the root of
its build folder into site-packages, so `build_py` copies the file there. An editable install
(``pip install -e``) builds its wheel from another folder, the one `install_lib` points at
during `editable_wheel`, so in editable mode the file is copied there too. ``data_files`` or a
custom ``install_lib`` alone miss editable installs. The file is listed in the wheel's RECORD,
so ``pip uninstall`` removes it.
"""

from __future__ import annotations

import os
import re

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH_FILE = "nvcomp_ckpt_engine_hook.pth"


class build_py_with_pth(build_py):
    """`build_py` that also places the import-hook .pth file at the root of the wheel."""

    def run(self) -> None:
        super().run()
        targets = [self.build_lib]
        if getattr(self, "editable_mode", False):
            targets.append(self.get_finalized_command("install").install_lib)
        for target in targets:
            os.makedirs(target, exist_ok=True)
            self.copy_file(os.path.join(HERE, PTH_FILE), os.path.join(target, PTH_FILE))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_FILE)]


def _version() -> str:
    with open(os.path.join(HERE, "nvcomp_ckpt_engine", "_version.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("nvcomp_ckpt_engine/_version.py has no __version__ line")
    return match.group(1)


def _readme() -> str:
    path = os.path.join(HERE, "README.md")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


DEEPSPEED = "deepspeed>=0.19,<0.20"
#: The zero_to_fp32.py DeepSpeed copies into every save directory splits its output with
#: huggingface_hub unless told not to (`python zero_to_fp32.py . out/` fails without it).
HF_HUB = "huggingface_hub>=0.23"
#: The S3 client (docs/STORAGE.md, "Choosing the client"): 1.36 sends If-None-Match on PUT.
S3_CLIENT = "boto3>=1.36"
#: A real S3 API server for the object-store tests (its server mode; enforces If-None-Match).
S3_TEST_SERVER = "moto[server]>=5.1"

setup(
    name="nvcomp_ckpt_engine",
    version=_version(),
    description="Lossless GPU-compressed, crash-safe distributed checkpoints for DeepSpeed",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["nvcomp_ckpt_engine", "nvcomp_ckpt_engine.*"]),
    py_modules=["_nvcomp_ckpt_engine_hook"],
    # No upper bound on torch: the index's torch would replace a CPU or site-built one.
    install_requires=["torch>=2.4", "zstandard>=0.22", "tqdm", "numpy"],
    extras_require={
        "cu12": ["nvidia-nvcomp-cu12>=6.0,<7"],
        "cu13": ["nvidia-nvcomp-cu13>=6.0,<7"],
        # GPUDirect Storage (`io_path`: "gds"): kvikio for the same CUDA as the nvCOMP extra,
        # never both (docs/STORAGE.md, "GPUDirect Storage").
        "gds-cu12": ["nvidia-nvcomp-cu12>=6.0,<7", "kvikio-cu12>=25.4"],
        "gds-cu13": ["nvidia-nvcomp-cu13>=6.0,<7", "kvikio-cu13>=25.4"],
        "deepspeed": [DEEPSPEED, HF_HUB],
        "mpi": ["mpi4py"],
        "s3": [S3_CLIENT],
        "hf": ["transformers>=5.24,<6", "accelerate>=1.15,<2"],
        "megatron": ["megatron-core>=0.16,<0.17", "psutil"],
        # Everything the test suite exercises on a CPU-only machine, MPICH included for mpirun,
        # and the S3 client with a local S3 server.
        "test": [
            "pytest", "hypothesis", "ruff", DEEPSPEED, HF_HUB, "mpi4py", "mpich",
            "transformers>=5.24,<6", "accelerate>=1.15,<2", "megatron-core>=0.16,<0.17", "psutil",
            S3_CLIENT, S3_TEST_SERVER,
        ],
    },
    entry_points={"console_scripts": ["nvcomp-ckpt = nvcomp_ckpt_engine.cli:main"]},
    cmdclass={"build_py": build_py_with_pth},
    zip_safe=False,
)
