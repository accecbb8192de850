#!/usr/bin/env bash
# emulated.sh - ON THE DEVICE, in the call after the carry calls of gpu/carry.sh (the pinned wheels in /tmp/parts): the
# emulated multi-GPU runs of issue 33 (job.emulate_gpus: a cluster node's layout on the one GPU, every process with its
# own NCCL host id), as tests/unit/test_gpu_emulated.py. One layout per device call (each run fits inside 550 s with the
# install): LAYOUTS=split3_k0 (also: split3_k1 split3_k2 tp2_ranks2 nodes2 lora_adapter_tp2 lora_merged_dp2 fault_vllm
# fault_rank; a pytest -k expression, e.g. "split3_k1 or split3_k2" on a machine without a call limit). Results under
# $OUT/<layout>/ (gpu_results.json, metrics, each node's bootstrap log, logs.tgz), $OUT/versions.json, $OUT/pytest.log.
# Env: LAYOUTS, TEST_TIMEOUT (500), EMU_MODEL (/tmp/model-emu, built here once from a config).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"  # a folder of its own per call (the queued commands tar it into the device's $OUT)
cd "$(dirname "$0")/.."
log() { echo "[emulated $(date +%T)] $*"; }
if [ -z "${LAYOUTS:-}" ] && [ "${ALL:-0}" != 1 ]; then
  echo "emulated.sh: name LAYOUTS (one per device call; ALL=1 runs every layout, for a machine without the 600 s limit)" >&2
  exit 2
fi
. gpu/stack.sh  # the pinned stack in /tmp/site, the plugin, the environment, versions.json
export OUT NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_mem_used_mib.txt" 2>/dev/null &
smi=$!
sel=()
[ -n "${LAYOUTS:-}" ] && sel=(-k "$LAYOUTS")
log "tests/unit/test_gpu_emulated.py ${sel[*]}"
timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -s -v -p no:cacheprovider tests/unit/test_gpu_emulated.py "${sel[@]}" 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|^E |passed|failed|\[emulated"
rc=${PIPESTATUS[0]}
kill $smi 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
log "pytest exit $rc"
exit "$rc"
