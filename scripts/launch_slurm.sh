#!/usr/bin/env bash
# Multi-host training under SLURM: one process per GPU, jax.distributed from SLURM's variables.
#
#   sbatch --nodes=4 --gpus-per-node=8 --ntasks-per-node=8 scripts/launch_slurm.sh configs/gem_sharded.py runs/gem
#
# SLURM's default block distribution numbers the tasks node-major, which is what
# gem_jax.mesh.make_mesh expects. Every task sees its node's GPUs; JAX's SLURM
# detection gives task SLURM_LOCALID the GPU of that index. The config's
# Topology must match the allocation (zones x nodes_per_zone = nodes, gpus_per_node = 8).
#
# Preemption: add `--signal=B:USR1@120` to sbatch (SIGUSR1 to this script 120 s before the time
# limit). SIGUSR1 and SIGTERM (scancel, preemption) reaching this script are forwarded to every
# task through srun; each task finishes its step, saves a checkpoint and exits with 75, and so
# does this script. `sbatch --requeue` with the same command resumes from that checkpoint.
# Exit status 2 for a bad argument.
set -euo pipefail
USAGE="usage: sbatch [sbatch options] scripts/launch_slurm.sh CONFIG WORKDIR [gem-train args]"
# sbatch runs a copy of this script from its spool folder: the repository is then the folder
# the job was submitted from.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -f "$REPO/scripts/common.sh" ] || REPO=${SLURM_SUBMIT_DIR:-$PWD}
source "$REPO/scripts/common.sh"
[ $# -ge 2 ] || usage_error "expected CONFIG WORKDIR, got $# argument(s)"
CONFIG=$1 WORKDIR=$2
shift 2
[ -f "$CONFIG" ] || usage_error "config file '$CONFIG' not found"
XLA_ENV=$("$PYTHON" "$REPO/scripts/xla_flags.py" --env)
eval "$XLA_ENV"
srun --kill-on-bad-exit=1 \
  "$PYTHON" -c 'from gem_jax.cli import train_main; train_main()' --config "$CONFIG" --workdir "$WORKDIR" "$@" &
SRUN=$!
# srun forwards SIGTERM and SIGUSR1 to the tasks (SIGINT to srun only prints its status: send TERM).
trap 'kill -s USR1 $SRUN 2> /dev/null || true' USR1
trap 'kill -s TERM $SRUN 2> /dev/null || true' TERM INT
while true; do
  wait $SRUN
  code=$?
  kill -0 $SRUN 2> /dev/null || exit $code
done
