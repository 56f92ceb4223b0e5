#!/usr/bin/env bash
# One node, torchrun: NPROC ranks of the demo job.
#   usage: bash launch_scripts/torchrun.sh [DS_CONFIG] [NPROC] [demo options...]
#   e.g.   bash launch_scripts/torchrun.sh configs/ds_zero3.json 8 --steps 200 --save-every 50
# DS_CONFIG defaults to configs/ds_zero2.json, NPROC to the number of GPUs (2 without one).
# The checkpoints go through the nvcomp engine because DS_CONFIG has
# "nvcomp_checkpoint": {"enabled": true}; the training program itself does not name the engine.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ds_config=${1:-configs/ds_zero2.json}
nproc=${2:-$default_nproc}
shift $(( $# < 2 ? $# : 2 ))

# --standalone: a private rendezvous on a free port, so two jobs on one node never clash.
run_and_explain torchrun --standalone --nproc_per_node "$nproc" \
  -m nvcomp_ckpt_engine.demo --ds-config "$ds_config" "$@"
