#!/usr/bin/env bash
# MPI: mpirun starts NP ranks of the demo; DeepSpeed learns rank and world size from MPI (mpi4py).
#   usage: bash launch_scripts/mpirun.sh [DS_CONFIG] [NP] [demo options...]
#   e.g.   HOSTFILE=hosts.txt bash launch_scripts/mpirun.sh configs/ds_zero2.json 16
# DS_CONFIG defaults to configs/ds_zero2.json, NP to the number of GPUs here (2 without one).
# HOSTFILE spreads the ranks over several nodes (default: this node only); MASTER_PORT (29500)
# must be free on the node of rank 0, whose address DeepSpeed takes from `hostname -I`.
# Needs mpi4py and an MPI (`pip install mpi4py mpich` gives both). Written for MPICH's mpirun;
# with Open MPI use --hostfile instead of -f and `-x VAR` for each variable instead of -genvall.
set -euo pipefail
source "$(dirname "$0")/common.sh"
ds_config=${1:-configs/ds_zero2.json}
np=${2:-$default_nproc}
shift $(( $# < 2 ? $# : 2 ))

export MASTER_PORT=${MASTER_PORT:-29500}
# -genvall: every rank, on every node, gets this environment (NVLink multicast off, the port).
run_and_explain mpirun -np "$np" ${HOSTFILE:+-f "$HOSTFILE"} -genvall \
  python3 -m nvcomp_ckpt_engine.demo --ds-config "$ds_config" "$@"
