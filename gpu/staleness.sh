#!/usr/bin/env bash
# staleness.sh - ON THE H200 DEVICE, after the parts of gpu/carry.sh are in /tmp/parts: trainer.max_staleness 0, 1 and 2
# one after the other on one warm machine, the same model (0.36 B body unless MODEL_ARGS), config, prompts and steps;
# each run's files (metrics, summary, GPU busy samples, report) under $OUT/k<N>, everything tarred into
# $OUT/staleness.tgz (a call brings back few files). Env: STEPS (15), KS ("0 1 2"), RUN_TIMEOUT (150 each: all of them fit one call).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
KS=${KS:-0 1 2} RUN_TIMEOUT=${RUN_TIMEOUT:-150}
n=$(echo $KS | wc -w)
if [ $((n * RUN_TIMEOUT)) -gt "${RUNS_BUDGET_S:-500}" ]; then  # G9: all of them in one call of at most 550 s
  echo "staleness.sh: $n runs x RUN_TIMEOUT $RUN_TIMEOUT s > ${RUNS_BUDGET_S:-500} s: lower RUN_TIMEOUT or run fewer KS per call" >&2
  exit 2
fi
for k in $KS; do
  mkdir -p "$OUT/k$k"
  OUT="$OUT/k$k" TAG="k$k" FLOOR=0 STEPS=${STEPS:-15} RUN_TIMEOUT=$RUN_TIMEOUT \
    EXTRA="--set trainer.max_staleness=$k" bash gpu/device.sh 2>&1 | grep -E "device|summary|Error|error" | tail -12
  sleep 5  # the last run's processes are gone before the next node start checks the GPU for leftovers
done
tar -czf /tmp/staleness.tgz -C "$OUT" . && rm -rf "$OUT"/k* && mv /tmp/staleness.tgz "$OUT/"
