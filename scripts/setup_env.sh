#!/usr/bin/env bash
# Creates .venv (if missing) and installs nvcomp_ckpt_engine into it, editable, with what the demo
# and the tests need. Safe to run again: it only installs what is missing.
#
#   usage: bash scripts/setup_env.sh [EXTRAS]      (EXTRAS default: deepspeed,test)
#
# torch: a machine without an NVIDIA GPU gets the CPU build torch==2.13.0 (pinned here so pip
# never pulls a multi-GB CUDA build onto it); a GPU machine keeps the torch it has, or gets the
# index's default. Add the nvCOMP extra that matches your CUDA on GPU machines: cu12 or cu13.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-deepspeed,test}

[ -x .venv/bin/python3 ] || python3 -m venv .venv
py=.venv/bin/python3
pip_install() { "$py" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$py" -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install torch
  else
    pip_install torch==2.13.0
  fi
fi
# DS_BUILD_OPS=0: DeepSpeed installs as pure Python and JIT-builds the few ops it needs.
DS_BUILD_OPS=0 pip_install -e ".[${extras}]"
echo "environment ready: source .venv/bin/activate"
