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

# Runs a launch (the command and its arguments), its output shown as it comes and kept in a
# temporary log; when it fails, the first error in that log is shown last. The end of a failed
# torchrun's output is torchrun's own report (ChildFailedError), not the exception a rank raised.
run_and_explain() {
  local log status=0
  log=$(mktemp "${TMPDIR:-/tmp}/nvcomp_launch.XXXXXX")
  # In braces: a caller's errexit and pipefail must not end the script before the explanation.
  { "$@" 2>&1 | tee "$log"; status=${PIPESTATUS[0]}; } || true
  if [ "$status" -ne 0 ]; then
    python3 -m nvcomp_ckpt_engine.demo.first_error "$log" "the output above" || true
  fi
  rm -f "$log"
  return "$status"
}
