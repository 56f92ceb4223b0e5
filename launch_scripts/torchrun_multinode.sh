#!/usr/bin/env bash
# Several nodes, torchrun with a c10d rendezvous: run this same command once on every node.
#   usage: MASTER_ADDR=HOST bash launch_scripts/torchrun_multinode.sh [DS_CONFIG] [NNODES] [NPROC_PER_NODE] [demo options...]
#   e.g.   MASTER_ADDR=node001 bash launch_scripts/torchrun_multinode.sh configs/ds_zero3.json 4 8
# MASTER_ADDR: a host every node reaches, which hosts the rendezvous (required);
# MASTER_PORT: a free port there (29500); RDZV_ID: the job's name, the same on every node.
# DS_CONFIG defaults to configs/ds_zero2.json, NNODES to 2, NPROC_PER_NODE to the GPUs here.
# --save-dir must be on storage that every node shares: DeepSpeed's `latest` file and the
# engine's manifest are written once, for all ranks.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ds_config=${1:-configs/ds_zero2.json}
nnodes=${2:-2}
nproc=${3:-$default_nproc}
shift $(( $# < 3 ? $# : 3 ))

# No --node_rank: the rendezvous numbers the nodes in the order they arrive.
run_and_explain torchrun --nnodes "$nnodes" --nproc_per_node "$nproc" \
  --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host}:${MASTER_PORT:-29500}" \
  --rdzv_id "${RDZV_ID:-nvcomp-ckpt-demo}" \
  -m nvcomp_ckpt_engine.demo --ds-config "$ds_config" "$@"
