#!/usr/bin/env bash
# One node, the `deepspeed` launcher: NPROC ranks of the demo job.
#   usage: bash launch_scripts/deepspeed.sh [DS_CONFIG] [NPROC] [demo options...]
#   e.g.   MASTER_PORT=29600 bash launch_scripts/deepspeed.sh configs/ds_zero1.json 4 --steps 100
# DS_CONFIG defaults to configs/ds_zero2.json, NPROC to the number of GPUs (2 without one);
# MASTER_PORT (29500) must be free on this node.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ds_config=${1:-configs/ds_zero2.json}
nproc=${2:-$default_nproc}
shift $(( $# < 2 ? $# : 2 ))

# --num_gpus counts ranks, also on the CPU accelerator; --module runs the demo as `python -m`.
run_and_explain deepspeed --num_gpus "$nproc" --master_port "${MASTER_PORT:-29500}" \
  --module nvcomp_ckpt_engine.demo --ds-config "$ds_config" "$@"
