#!/usr/bin/env bash
# Model quality of one setting against a reference: trains the same config and seed once per
# variant, all at once on one GPU (each process gets GEM_MEM_FRACTION of its memory; set
# GEM_SEQUENTIAL=1 to run them one after the other, where host work would be shared), then
# compares the runs with benchmarks/compare_runs.py (final eval NE/BCE and train loss, relative
# to the first variant).
#
#   benchmarks/quality_runs.sh OUT_NAME CONFIG "COMMON OVERRIDES" NAME="OVERRIDES" [NAME="OVERRIDES" ...]
#
# e.g. benchmarks/quality_runs.sh fp8_saved_movielens_h200 configs/movielens.py "model.compute_dtype=bfloat16" \
#          bf16_residuals="" fp8_saved_activations="model.fp8_saved_activations=True"
# writes runs/quality/OUT_NAME/<name>/ (workdirs and logs), benchmarks/results/OUT_NAME.json and
# benchmarks/figures/OUT_NAME.png. Run from the repository root with gem_jax importable.
# GEM_COMPARE=0 trains without the comparison (benchmarks/switch_table.py tabulates the runs of
# several such calls itself).
set -euo pipefail
out_name=$1 config=$2 common=$3
shift 3
root=runs/quality/$out_name
mkdir -p "$root"
unset XLA_PYTHON_CLIENT_MEM_FRACTION  # the deprecated name: jaxlib refuses it beside XLA_CLIENT_MEM_FRACTION
export XLA_CLIENT_MEM_FRACTION=${GEM_MEM_FRACTION:-0.18}
pids=() runs=()
for variant in "$@"; do
  name=${variant%%=*} overrides=${variant#*=}
  read -r -a settings <<< "$common $overrides"
  set_args=()
  [ ${#settings[@]} -eq 0 ] || set_args=(--set "${settings[@]}")
  python3 -m gem_jax.cli --config "$config" --workdir "$root/$name" --no-progress --force-new \
    "${set_args[@]}" > "$root/$name.log" 2>&1 &
  pids+=($!) runs+=(--run "$name=$root/$name")
  if [ "${GEM_SEQUENTIAL:-0}" = 1 ]; then wait $! || { echo "run $name failed: see $root/$name.log" >&2; exit 1; }; fi
done
# A stopped comparison stops its runs too (each checkpoints and exits on the first signal, at once on the second).
trap 'kill -TERM "${pids[@]}" 2>/dev/null; sleep 5; kill -TERM "${pids[@]}" 2>/dev/null; exit 143' TERM INT
status=0
[ "${GEM_SEQUENTIAL:-0}" = 1 ] && pids=()  # already waited for, one by one
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "run ${runs[$((2 * i + 1))]} failed: see its log" >&2; status=1; }
done
[ "$status" -eq 0 ] || exit 1
[ "${GEM_COMPARE:-1}" = 0 ] && exit 0
python3 benchmarks/compare_runs.py "${runs[@]}" --title "$out_name" \
  --out "benchmarks/results/$out_name.json" --figure "benchmarks/figures/$out_name.png"
