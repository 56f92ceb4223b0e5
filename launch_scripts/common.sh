# shellcheck shell=bash
# Sourced by the other scripts here (not run on its own): the environment every launch shares.
# Run the scripts from the repository root, where `configs/` and the package are.

# NVLink multicast off in NCCL, PyTorch symmetric memory and NVSHMEM: on a multi-GPU host that is
# shared, a program that sets multicast up can put the host's GPUs out of service, and
# checkpoint traffic gains nothing from it. Harmless on a CPU run.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# No GPU on this node: DeepSpeed runs on its CPU accelerator (gloo between ranks).
gpus_here=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "$gpus_here" -eq 0 ]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi

# DeepSpeed JIT-builds an op at the first launch; a cache shared by two environments is rebuilt
# at every switch between them, so each virtual environment keeps its own.
if [ -n "${VIRTUAL_ENV:-}" ]; then
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$VIRTUAL_ENV/torch_extensions}
fi

# Processes per node when the caller does not say: one per GPU, or 2 on a CPU-only node.
# shellcheck disable=SC2034  # used by the scripts that source this file
default_nproc=$(( gpus_here > 0 ? gpus_here : 2 ))
