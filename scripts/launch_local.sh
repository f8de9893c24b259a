#!/usr/bin/env bash
# Multi-process training on the GPUs of one host: one process per GPU, explicit coordinator.
#
#   scripts/launch_local.sh 2 configs/gem_sharded.py runs/gem [gem-train args]
#
# Process i drives GPU i (GEM_LOCAL_DEVICE_IDS) and reaches process 0 on 127.0.0.1.
# On other clusters set GEM_COORDINATOR_ADDRESS, GEM_NUM_PROCESSES and GEM_PROCESS_ID
# per process the same way (gem_jax.parallel.distributed).
# SIGTERM, SIGINT and SIGUSR1 sent to this script are forwarded to every process: each finishes
# its step, saves a checkpoint and exits with 75 (the script then exits 75 too); a second signal
# aborts them. Exit status 2 for a bad argument.
set -euo pipefail
USAGE="usage: scripts/launch_local.sh NUM_PROCESSES CONFIG WORKDIR [gem-train args]"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/scripts/common.sh"
[ $# -ge 3 ] || usage_error "expected NUM_PROCESSES CONFIG WORKDIR, got $# argument(s)"
NPROC=$1 CONFIG=$2 WORKDIR=$3
shift 3
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || usage_error "NUM_PROCESSES must be a positive number, got '$NPROC'"
[ -f "$CONFIG" ] || usage_error "config file '$CONFIG' not found"
XLA_ENV=$("$PYTHON" "$REPO/scripts/xla_flags.py" --env)
eval "$XLA_ENV"
export GEM_COORDINATOR_ADDRESS=${GEM_COORDINATOR_ADDRESS:-127.0.0.1:$((20000 + RANDOM % 20000))}
export GEM_NUM_PROCESSES=$NPROC
pids=()
for ((i = 0; i < NPROC; i++)); do
  GEM_PROCESS_ID=$i GEM_LOCAL_DEVICE_IDS=$i \
    "$PYTHON" -c 'from gem_jax.cli import train_main; train_main()' --config "$CONFIG" --workdir "$WORKDIR" "$@" &
  pids+=($!)
done
forward() { kill -s "$1" "${pids[@]}" 2> /dev/null || true; }
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1
status=0
for pid in "${pids[@]}"; do
  # A trapped signal ends `wait` early (status > 128): wait again until the process itself has exited.
  while true; do
    wait "$pid"
    code=$?
    kill -0 "$pid" 2> /dev/null || break
  done
  [ "$code" -ne 0 ] && status=$code
done
exit $status
