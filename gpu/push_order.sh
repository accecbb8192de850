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
if [ ! -f /tmp/site/.installed ]; then
  log "reassembling and installing $(ls /tmp/parts | wc -l) files (wheels and wheel pieces)"
  mkdir -p /tmp/wheels
  cp /tmp/parts/*.whl /tmp/wheels/ 2>/dev/null
  for first in /tmp/parts/*.whl.part.00; do
    [ -e "$first" ] || continue
    base=$(basename "$first" .part.00); cat /tmp/parts/"$base".part.* > /tmp/wheels/"$base"
  done
  (cd /tmp/wheels && sha256sum -c --quiet /tmp/parts/SHA256SUMS) || { log "checksum mismatch: a part is missing"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wheels/*.whl || exit 1
  touch /tmp/site/.installed
fi
# flashinfer is not carried; the image's cuDNN 9.19 runs torch 2.13 (9.20 named); NVLink multicast stays off
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - > "$OUT/versions.json" <<'PY'
import json, torch, importlib.metadata as m
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "gpu": torch.cuda.get_device_name(0),
                  **{n: m.version(n) for n in ("vllm", "transformers", "pytest")}}))
PY
cat "$OUT/versions.json" || exit 1
log "tests/unit/test_gpu_push_order.py"
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -s -v -p no:cacheprovider tests/unit/test_gpu_push_order.py 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|^E |passed|failed|PUSH-ORDER"
rc=${PIPESTATUS[0]}
grep -o 'PUSH-ORDER .*' "$OUT/pytest.log" | sed 's/^PUSH-ORDER //' > "$OUT/push_order.jsonl"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
log "pytest exit $rc"
exit "$rc"
