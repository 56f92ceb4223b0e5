#!/usr/bin/env bash
# Failure and resume, end to end, on whatever this machine has (GPUs, or the CPU alone):
#   1. a reference run of the tiny GPT, uninterrupted, saving a checkpoint every SAVE_EVERY steps;
#   2. the same job again, which SIGKILLs itself (rank KILL_RANK, -1: every rank) after step KILL_AT;
#   3. the same command relaunched: it resumes from the last complete checkpoint and finishes;
#   4. the engine's check of the last checkpoint, and both loss sequences side by side;
#      exit status 1 unless they are identical.
# With RESUME_NPROC, step 3 relaunches on that many ranks instead (a node lost, or added): every
# launch keeps the same global batch by gradient accumulation, the plain load_checkpoint
# reshards the checkpoint, and step 4's verdict says whether the state right after the resume is
# the saved one bit for bit (every parameter's fp32 master and Adam moments), with the losses
# beside the uninterrupted run's (on another number of ranks they add in another order).
#
#   usage: bash launch_scripts/demo_failure_resume.sh [DS_CONFIG] [NPROC]
# DS_CONFIG defaults to configs/ds_zero2.json, NPROC to the number of GPUs (2 without one).
# Environment: LAUNCHER (torchrun or deepspeed; torchrun), STEPS (30), SAVE_EVERY (10),
# KILL_AT (25), KILL_RANK (-1), RUN_DIR (runs/demo_failure_resume; emptied first),
# RESUME_NPROC (NPROC: the relaunch's ranks).
#
# It uses the active Python environment if the package is installed there, and otherwise sets
# up .venv with scripts/setup_env.sh (EXTRAS, default "deepspeed"; on a GPU machine add the
# nvCOMP extra for its CUDA, e.g. EXTRAS=deepspeed,cu13).
set -euo pipefail
cd "$(dirname "$0")/.."

# Checked from / so that the source tree in the current directory does not count: the DeepSpeed
# import hook that turns the engine on comes with an installed package only.
installed() { (cd / && python3 -c 'import deepspeed, nvcomp_ckpt_engine.demo') >/dev/null 2>&1; }
if ! installed; then
  bash scripts/setup_env.sh "${EXTRAS:-deepspeed}"
  source .venv/bin/activate
fi

ds_config=${1:-configs/ds_zero2.json}
nproc=${2:-}
resume_nproc=${RESUME_NPROC:-}
launcher=launch_scripts/${LAUNCHER:-torchrun}.sh
run_dir=${RUN_DIR:-runs/demo_failure_resume}
steps=${STEPS:-30} save_every=${SAVE_EVERY:-10} kill_at=${KILL_AT:-25}
# A failure before the first checkpoint would recur at every relaunch (nothing to resume from).
if (( kill_at <= save_every || kill_at > steps )); then
  echo "need SAVE_EVERY < KILL_AT <= STEPS (got $save_every, $kill_at, $steps)" >&2
  exit 2
fi
rm -rf "$run_dir"
mkdir -p "$run_dir"
common=(--steps "$steps" --save-every "$save_every")
resized=()
if [[ -n "$resume_nproc" ]]; then
  source launch_scripts/common.sh
  nproc=${nproc:-$default_nproc}
  # The ds_config's global batch at NPROC ranks, kept at RESUME_NPROC by gradient accumulation.
  global_batch=$(python3 -c 'import json, sys
c = json.load(open(sys.argv[1]))
print(c.get("train_micro_batch_size_per_gpu", 1) * c.get("gradient_accumulation_steps", 1) * int(sys.argv[2]))' \
    "$ds_config" "$nproc")
  common+=(--global-batch "$global_batch")
fi
job=("${common[@]}" --save-dir "$run_dir/job" --loss-log "$run_dir/job.jsonl"
     --kill-at-step "$kill_at" --kill-rank "${KILL_RANK:--1}")
# On another number of ranks the losses may differ in the last bits: what must be identical is
# the state the job resumes from, which the job then writes at each save and after the resume.
if [[ -n "$resume_nproc" && "$resume_nproc" != "$nproc" ]]; then
  job+=(--state-dir "$run_dir/job_state")
  resized=(--states "$run_dir/job_state" --ranks-changed)
fi

# Each launch's full output goes to a log file. The lines that show how far it got (DeepSpeed
# starting, which on the first run in an environment builds its ops for a minute or more with
# nothing to show; the first step; each committed checkpoint; the failure and the resume) are
# shown as they come. On failure the log's last lines are shown, then the first error in it:
# the end of a failed torchrun's output is its own report, not the exception a rank raised.
progress='^\[demo rank 0\] starting DeepSpeed|^step +[0-9]+ |committed |rank 0\] resumed from|simulated failure'
launch() {
  local log=$1 ranks=$nproc status=0; shift
  if [[ "$1" == --ranks ]]; then ranks=$2; shift 2; fi
  { bash "$launcher" "$ds_config" "$ranks" "$@" 2>&1 | tee "$log" \
      | { grep --line-buffered -E "$progress" || true; } | first_step_only
    status=${PIPESTATUS[0]}; } || true
  return "$status"
}
# Of the step lines, the first of each launch (training has begun); the rest are in the log.
first_step_only() { awk '/^step / { if (seen++) next } { print "    " $0; fflush() }'; }
show_failure() {
  echo "--- last lines of $1:"
  tail -n 30 "$1"
  # A launch script ends a failed launch's output with its first error; anything else, here.
  grep -q '^--- the first error in' "$1" || python3 -m nvcomp_ckpt_engine.demo.first_error "$1" || true
}
phase() { printf 'phase %s/4: %s...\n' "$1" "$2"; }

phase 1 "reference run, $steps steps without interruption, a checkpoint every $save_every \
(log: $run_dir/reference.log; the first run in a new environment also builds DeepSpeed's ops, \
a minute or more on a CPU)"
launch "$run_dir/reference.log" "${common[@]}" --save-dir "$run_dir/reference" \
  --loss-log "$run_dir/reference.jsonl" || { show_failure "$run_dir/reference.log"; exit 1; }

phase 2 "the job, SIGKILLed after step $kill_at: a simulated failure (log: $run_dir/attempt1.log)"
if launch "$run_dir/attempt1.log" "${job[@]}"; then
  echo "the job should have died after step $kill_at but finished" >&2
  exit 1
fi
grep -q "simulated failure" "$run_dir/attempt1.log" || { show_failure "$run_dir/attempt1.log"; exit 1; }

if [[ -n "$resume_nproc" ]]; then
  phase 3 "the same command relaunched on $resume_nproc rank(s), the global batch of \
$global_batch samples kept: it resumes from the last complete checkpoint (log: $run_dir/attempt2.log)"
  relaunch=(--ranks "$resume_nproc")
else
  phase 3 "the same command relaunched: it resumes from the last complete checkpoint \
(log: $run_dir/attempt2.log)"
  relaunch=()
fi
launch "$run_dir/attempt2.log" "${relaunch[@]}" "${job[@]}" || { show_failure "$run_dir/attempt2.log"; exit 1; }

phase 4 "the engine's check of the job's last checkpoint, and both loss sequences"
python3 -m nvcomp_ckpt_engine verify -q "$run_dir/job"
python3 -m nvcomp_ckpt_engine.demo.compare "$run_dir/reference.jsonl" "$run_dir/job.jsonl" \
  "${resized[@]}"
