#!/usr/bin/env bash
# Several nodes, the `deepspeed` launcher with a hostfile (one "HOST slots=GPUS" line per node).
#   usage: bash launch_scripts/deepspeed_multinode.sh [DS_CONFIG] [NNODES] [GPUS_PER_NODE] [demo options...]
#   e.g.   HOSTFILE=hosts.txt bash launch_scripts/deepspeed_multinode.sh configs/ds_zero3.json 4 8
# HOSTFILE defaults to ./hostfile; DS_CONFIG to configs/ds_zero2.json; NNODES to every host in
# it; GPUS_PER_NODE to the slots the hostfile gives; MASTER_PORT (29500) must be free on node 0.
#
# Two ways to start it:
# - with passwordless ssh and pdsh: run it once, on the first host of the hostfile;
# - without ssh: set NODE_RANK (0..NNODES-1) and MASTER_ADDR (the first host) and run it on
#   every host.
# --save-dir must be on storage that every node shares.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ds_config=${1:-configs/ds_zero2.json}
nnodes=${2:--1}
gpus=${3:--1}
shift $(( $# < 3 ? $# : 3 ))

launch=(deepspeed --hostfile "${HOSTFILE:-hostfile}" --num_nodes "$nnodes" --num_gpus "$gpus"
        --master_port "${MASTER_PORT:-29500}")
if [ -n "${NODE_RANK:-}" ]; then
  launch+=(--no_ssh --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first host}")
else
  # pdsh forwards only NCCL_*, PYTHON* and a few other prefixes to the remote ranks; the rest of
  # the environment they need travels in a DeepSpeed environment file.
  DS_ENV_FILE=$(mktemp)
  trap 'rm -f "$DS_ENV_FILE"' EXIT
  export DS_ENV_FILE
  for var in TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS DS_ACCELERATOR TORCH_EXTENSIONS_DIR; do
    if [ -n "${!var:-}" ]; then echo "$var=${!var}" >> "$DS_ENV_FILE"; fi
  done
fi
run_and_explain "${launch[@]}" --module nvcomp_ckpt_engine.demo --ds-config "$ds_config" "$@"
