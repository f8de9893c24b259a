#!/usr/bin/env bash
# Kills and restarts a training run N times at random moments (SIGTERM and SIGKILL mixed), lets it
# finish, and checks that its final parameters equal an uninterrupted run's bit for bit.
#
#   scripts/chaos.sh [N=20] [CONFIG=configs/movielens.py] [ROOT=a new temporary folder] [--set ...]
#
# ROOT/reference is the uninterrupted run, ROOT/chaos the interrupted one; ROOT/chaos.log lists
# every kill (signal, seconds after the start, exit status: 75 after a SIGTERM stop, 137 after a
# SIGKILL). Kill moments are uniform in [CHAOS_MIN_S, CHAOS_MAX_S] seconds after each start
# (defaults 10 and 60: start-up, compile, steps and saves on a CPU); CHAOS_SEED seeds them. Extra
# arguments go to gem-train (default: --set checkpoint.every_steps=5). A kill counts only if it
# interrupted a run still training; the run must last long enough for N of them (the default
# config's 400 steps take about 8 CPU-minutes), else the script fails saying so. Exit status 0
# when N kills interrupted the run and the parameters match; 2 for a bad argument.
set -uo pipefail
USAGE="usage: scripts/chaos.sh [N=20] [CONFIG=configs/movielens.py] [ROOT=a new temporary folder] [--set ...]"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/scripts/common.sh"
N=${1:-20}
CONFIG=${2:-configs/movielens.py}
[[ "$N" =~ ^[1-9][0-9]*$ ]] || usage_error "N must be a positive number of kills, got '$N'"
[ -f "$CONFIG" ] || usage_error "config file '$CONFIG' not found"
ROOT=${3:-$(mktemp -d -t gem-chaos-XXXXXX)}
shift $(( $# < 3 ? $# : 3 ))
EXTRA=("$@")
[ ${#EXTRA[@]} -eq 0 ] && EXTRA=(--set checkpoint.every_steps=5)
RANDOM=${CHAOS_SEED:-$$}
MIN=${CHAOS_MIN_S:-10}
MAX=${CHAOS_MAX_S:-60}
LOG=$ROOT/chaos.log
mkdir -p "$ROOT"
train() { exec "$PYTHON" -m gem_jax.cli --config "$CONFIG" --workdir "$1" --no-progress "${EXTRA[@]}"; }

echo "chaos: $N kills of $CONFIG in $ROOT" | tee "$LOG"
(train "$ROOT/reference") > "$ROOT/reference.out" 2>&1 || { echo "chaos: the reference run failed, see $ROOT/reference.out"; exit 1; }
for ((i = 1; i <= N; i++)); do
  train "$ROOT/chaos" >> "$ROOT/chaos.out" 2>&1 &
  pid=$!
  delay=$(( MIN + RANDOM % (MAX - MIN + 1) ))
  signal=$([ $((RANDOM % 2)) -eq 0 ] && echo TERM || echo KILL)
  sleep "$delay"
  kill -s "$signal" "$pid" 2> /dev/null
  wait "$pid"
  status=$?
  echo "kill $i: SIG$signal after ${delay}s, exit status $status" | tee -a "$LOG"
  if [ "$status" -ne 75 ] && [ "$status" -ne 137 ] && [ "$status" -ne 143 ]; then
    echo "chaos: kill $i found no run in training (exit status $status): the run ended before $N kills; use more steps" | tee -a "$LOG"
    exit 1
  fi
done
(train "$ROOT/chaos") >> "$ROOT/chaos.out" 2>&1 || { echo "chaos: the final start failed, see $ROOT/chaos.out"; exit 1; }
"$PYTHON" - "$ROOT/reference" "$ROOT/chaos" <<'PY' | tee -a "$LOG"
import sys

import jax
import numpy as np

from gem_jax.train import load_params

reference, chaos = (load_params(path) for path in sys.argv[1:3])
leaves = [(jax.tree_util.keystr(path), np.asarray(a), np.asarray(b)) for (path, a), b in
          zip(jax.tree_util.tree_leaves_with_path(reference.params), jax.tree.leaves(chaos.params))]
differ = [name for name, a, b in leaves if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes()]
print(f"chaos: step {chaos.step} vs reference step {reference.step}; {len(leaves)} parameter arrays, {len(differ)} differ {differ[:5]}")
sys.exit(0 if not differ and chaos.step == reference.step else 1)
PY
