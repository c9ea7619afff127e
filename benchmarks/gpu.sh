#!/usr/bin/env bash
# Run the throughput benchmark on an accelerator, if one is present, in under 5 minutes.
#
# Usage: benchmarks/gpu.sh OUTDIR
#
# Checks `jax.default_backend()`; on "cpu" it says so and exits 0 without running anything.
# Otherwise it runs benchmarks/throughput.py (all configs, users scaling, floor; 3 rmm-jax
# repeats, 1 PyTorch/NumPy repeat — the references stay on CPU: torch here is the CPU build)
# under a 280 s timeout, writing OUTDIR/throughput_<backend>.json, .png and .log.
# PYTHON overrides the interpreter (default: .venv/bin/python if present, else python).
set -euo pipefail
OUTDIR=${1:?usage: benchmarks/gpu.sh OUTDIR}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
BACKEND=$("$PYTHON" -c "import jax; print(jax.default_backend())" 2>/dev/null || echo none)
if [[ "$BACKEND" == "cpu" || "$BACKEND" == "none" ]]; then
  echo "gpu.sh: no accelerator (jax backend: $BACKEND); nothing to do."
  exit 0
fi
mkdir -p "$OUTDIR"
echo "gpu.sh: jax backend $BACKEND; running throughput benchmark into $OUTDIR"
cd "$ROOT"
timeout 280 "$PYTHON" benchmarks/throughput.py --repeats 3 --ref-repeats 1 \
  --json "$OUTDIR/throughput_$BACKEND.json" --plot "$OUTDIR/throughput_$BACKEND.png" \
  2>&1 | tee "$OUTDIR/throughput_$BACKEND.log"
