#!/usr/bin/env bash
# runs.sh - ON THE DEVICE, after the carry: several short gpu/device.sh runs in one call, each in its own /tmp/o-TAG,
# all tarred into $OUT/r.tgz at the end (the device returns at most 8 files a call). Each run removes its body and job
# folder's checkpoints after it (the 64 GiB disk). RUNS: lines of "TAG|STEPS|RUN_TIMEOUT|MODEL_BUILDER|EXTRA".
# E.g. RUNS=$'ds3|6|140|python3 -m trainer.tiny_model --family deepseek_v3 ... --device cuda|--set trainer.final_checkpoint=false'
set -uo pipefail
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}
mkdir -p "$O"
rc=0
tags=()
while IFS='|' read -r tag steps limit builder extra; do
  [ -n "$tag" ] || continue
  mkdir -p "/tmp/o-$tag"
  OUT="/tmp/o-$tag" TAG="$tag" STEPS="$steps" RUN_TIMEOUT="$limit" FLOOR=0 MODEL_BUILDER="$builder" EXTRA="$extra" \
    bash gpu/device.sh > "/tmp/o-$tag/device.out" 2>&1 < /dev/null  # not the RUNS lines this loop reads
  r=$?
  echo "== $tag: exit $r"; grep -E "summary:|vLLM healthy|FAILED|engine core's error" "/tmp/o-$tag/device.out" | cut -c1-400
  [ "$r" = 0 ] || rc=$r
  rm -rf "/tmp/model-$tag" "/tmp/job-$tag/checkpoints" "/tmp/job-$tag/model"
  tags+=("o-$tag")
  tar czf "$O/r.tgz" -C /tmp "${tags[@]}"  # after each run: a call stopped at its limit still returns the runs done
done <<< "${RUNS:-}"
exit $rc
