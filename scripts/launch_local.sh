#!/usr/bin/env bash
# Multi-process training on the GPUs of one host: one process per GPU, explicit coordinator.
#
#   scripts/launch_local.sh 2 configs/gem_sharded.py runs/gem [gem-train args]
#
# Process i drives GPU i (GEM_LOCAL_DEVICE_IDS) and reaches process 0 on 127.0.0.1.
# On other clusters set GEM_COORDINATOR_ADDRESS, GEM_NUM_PROCESSES and GEM_PROCESS_ID
# per process the same way (gem_jax.parallel.distributed).
set -euo pipefail
NPROC=${1:?usage: launch_local.sh NUM_PROCESSES CONFIG WORKDIR [gem-train args]}
CONFIG=${2:?usage: launch_local.sh NUM_PROCESSES CONFIG WORKDIR [gem-train args]}
WORKDIR=${3:?usage: launch_local.sh NUM_PROCESSES CONFIG WORKDIR [gem-train args]}
shift 3
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
eval "$(python3 "$REPO/scripts/xla_flags.py" --env)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export GEM_COORDINATOR_ADDRESS=${GEM_COORDINATOR_ADDRESS:-127.0.0.1:$((20000 + RANDOM % 20000))}
export GEM_NUM_PROCESSES=$NPROC
pids=()
for ((i = 0; i < NPROC; i++)); do
  GEM_PROCESS_ID=$i GEM_LOCAL_DEVICE_IDS=$i \
    python3 -c 'from gem_jax.cli import train_main; train_main()' --config "$CONFIG" --workdir "$WORKDIR" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
