#!/usr/bin/env bash
# Run every benchmark of the Performance section on an accelerator, if one is present, in under 5 minutes.
#
# Usage: benchmarks/gpu.sh [--dry-run] OUTDIR
#
# It checks `jax.default_backend()`. On "cpu" it says so and exits 0 without running anything,
# unless --dry-run is given.
#
# On an accelerator it runs:
#   1. benchmarks/throughput.py: the one-user configs, the users scaling and the floors, with 3
#      interleaved repeats. The PyTorch, torch.compile and NumPy references run on the host CPU,
#      because the torch here is the CPU build. torch.compile is timed for the paper config only,
#      since each config costs tens of seconds of inductor compilation. Time limit: 180 s.
#   2. benchmarks/peer_vw.py: Vowpal Wabbit against rmm-jax on the LoCoMo streams
#      ($RMM_LOCOMO_DIR, default ../shared/data/locomo), or on the synthetic users when that data
#      is absent. It uses the VW setting tuned in benchmarks/results/peer_vw.json, so it skips
#      the tuning grid, seed 0 and the precision/recall citations only, without the ablation:
#      VW runs on the host CPU at about 35 s per pass, and the CPU run already covers its seeds,
#      both citation models and the ablation. (Under the class-calibrated citations rmm-jax's
#      seed-0 held-out gain is about 0, so one seed of it would trip the floor.) Time limit: 100 s.
# Each writes OUTDIR/<name>_<backend>.json and a .log, and throughput also writes a .png.
# OUTDIR/summary.json lists each benchmark with its exit status, seconds and files.
#
# --dry-run runs the same steps on whatever backend is present, CPU included, in their smallest
# form: throughput.py --quick and peer_vw.py --synthetic --quick --citations precision_recall
# (one citation model, so one rmm-jax compile). It checks the script, both
# benchmarks and their JSON in about a minute; CI runs it (tests/test_bench_references.py).
#
# PYTHON overrides the interpreter (default: .venv/bin/python if present, else python).
# The exit status is 0 when every benchmark that ran exited 0.
set -uo pipefail
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUTDIR=${1:?usage: benchmarks/gpu.sh [--dry-run] OUTDIR}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
BACKEND=$("$PYTHON" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none)
if [[ "$BACKEND" == "none" ]]; then
  echo "gpu.sh: cannot import jax with $PYTHON" >&2
  exit 2
fi
if [[ "$BACKEND" == "cpu" && $DRY -eq 0 ]]; then
  echo "gpu.sh: no accelerator (jax backend: cpu); nothing to do (--dry-run runs the smoke versions here)."
  exit 0
fi
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT"
TAG=$BACKEND
[[ $DRY -eq 1 ]] && TAG="${BACKEND}_dryrun"
echo "gpu.sh: jax backend $BACKEND$([[ $DRY -eq 1 ]] && echo ' (dry run)'); writing into $OUTDIR"

LOCOMO=${RMM_LOCOMO_DIR:-$ROOT/../shared/data/locomo}
TUNED=()   # the VW settings tuned by the committed CPU run (benchmarks/results/peer_vw.json)
[[ -f "$HERE/results/peer_vw.json" ]] && TUNED=(--tuned "$HERE/results/peer_vw.json")
if [[ $DRY -eq 1 ]]; then
  THROUGHPUT_ARGS=(--quick --no-profile)
  VW_ARGS=(--synthetic --quick --citations precision_recall)
  T_THROUGHPUT=240; T_VW=120
else
  THROUGHPUT_ARGS=(--repeats 3 --compile-configs paper)
  if [[ -d "$LOCOMO" ]]; then VW_ARGS=(--data "$LOCOMO"); else VW_ARGS=(--synthetic); fi
  VW_ARGS+=(--seeds 0 --citations precision_recall --no-ablation "${TUNED[@]}")
  T_THROUGHPUT=180; T_VW=100
fi

STATUS=0
SUMMARY="["
run_one() {  # name timeout_s command...
  local name=$1 limit=$2; shift 2
  local t0 rc t1
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUTDIR/${name}_$TAG.log" 2>&1
  rc=$?
  t1=$(date +%s)
  tail -n 40 "$OUTDIR/${name}_$TAG.log"
  echo "gpu.sh: $name exit $rc after $((t1 - t0)) s"
  [[ $rc -ne 0 ]] && STATUS=1
  [[ "$SUMMARY" != "[" ]] && SUMMARY+=","
  SUMMARY+="{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $((t1 - t0)), \"json\": \"${name}_$TAG.json\", \"log\": \"${name}_$TAG.log\"}"
}

run_one throughput "$T_THROUGHPUT" "$PYTHON" benchmarks/throughput.py "${THROUGHPUT_ARGS[@]}" \
  --json "$OUTDIR/throughput_$TAG.json" --plot "$OUTDIR/throughput_$TAG.png"
run_one peer_vw "$T_VW" "$PYTHON" benchmarks/peer_vw.py "${VW_ARGS[@]}" --json "$OUTDIR/peer_vw_$TAG.json"
SUMMARY+="]"
printf '{"backend": "%s", "dry_run": %s, "benchmarks": %s}\n' "$BACKEND" \
  "$([[ $DRY -eq 1 ]] && echo true || echo false)" "$SUMMARY" > "$OUTDIR/summary.json"
echo "gpu.sh: summary in $OUTDIR/summary.json"
exit $STATUS
