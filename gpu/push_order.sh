#!/usr/bin/env bash
# push_order.sh - ON THE H200 DEVICE, in the last of the back-to-back calls that carried gpu/carry.sh's parts into
# /tmp/parts: install the pinned stack (torch 2.13.0 + vLLM 0.32.0 + NCCL 2.29.7) into /tmp/site once, then run
# tests/unit/test_gpu_push_order.py (N1 and N3 of ../shared/GPU-AUDIT.md, each with its negative control, and the N6
# memory figures). Results under $OUT: versions.json, pytest.log, push_order.jsonl (the PUSH-ORDER lines).
# Results of a run: gpu/results/2026-12-04-push-order/README.md.
set -uo pipefail
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/.."
log() { echo "[push-order $(date +%T)] $*"; }
. gpu/stack.sh  # the pinned stack in /tmp/site, the plugin, the environment, versions.json
log "tests/unit/test_gpu_push_order.py tests/unit/test_gpu_lora_push_order.py"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -s -v -p no:cacheprovider tests/unit/test_gpu_push_order.py tests/unit/test_gpu_lora_push_order.py 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|^E |passed|failed|PUSH-ORDER"
rc=${PIPESTATUS[0]}
grep -o 'PUSH-ORDER .*' "$OUT/pytest.log" | sed 's/^PUSH-ORDER //' > "$OUT/push_order.jsonl"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
log "pytest exit $rc"
exit "$rc"
