#!/usr/bin/env bash
# device.sh - ON THE H200 DEVICE, in the last of the back-to-back calls (the parts of gpu/carry.sh are in
# /tmp/parts): install the pinned stack (torch 2.13.0 + vLLM 0.32.0 + NCCL 2.29.7 + TRL 1.16) into /tmp/site once,
# build a random Qwen2 body (bf16, from a config, no hub; MODEL_ARGS for another shape), measure the copy floor,
# run `slurm-grpo local` with the one-GPU config (vLLM and the FSDP2 trainer share the GPU, packed ipc push) and,
# with TRL=1, TRL's own GRPOTrainer in colocate mode on the same model, prompts, reward, batch and steps
# (gpu/trl_colocate.py). Results under $OUT.   Env: STEPS, RUN_TIMEOUT, MODEL_ARGS, CONFIG, TRL, TAG,
# EXTRA (more `--set k=v` of the local run), TRL_SETS (the same as k=v for TRL's run, e.g. trainer.lora.r=16),
# FLOOR=0 (skip the copy-floor measurement).
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-30}
TAG=${TAG:-run}
cd "$(dirname "$0")/.."
log() { echo "[device $(date +%T)] $*"; }
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
# flashinfer is not carried (vLLM's sampler falls back to torch); the image's cuDNN 9.19 runs torch 2.13 (9.20 named)
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - > "$OUT/versions.json" <<'PY'
import json, torch, importlib.metadata as m
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "gpu": torch.cuda.get_device_name(0),
                  **{n: m.version(n) for n in ("vllm", "trl", "transformers", "accelerate", "datasets")}}))
PY
cat "$OUT/versions.json" || exit 1
MODEL=/tmp/model-$TAG JOB=/tmp/job-$TAG
log "building the model"
[ -f $MODEL/config.json ] || python3 -m trainer.tiny_model $MODEL ${MODEL_ARGS:---hidden 896 --layers 24 --kv-heads 2 --intermediate 4864} \
  --dtype bfloat16 --vocab 4096 | tail -1
CONFIG=${CONFIG:-configs/gpu_1gpu.yaml}
if [ "${FLOOR:-1}" = 1 ]; then
  log "copy bandwidth, GPU 0 -> GPU 0"
  python3 gpu/copy_bandwidth.py $MODEL cuda:0 > "$OUT/d2d.json"; cat "$OUT/d2d.json"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_mem_used_mib.txt" 2>/dev/null &
smi=$!
(while sleep 1; do free -m | awk '/^Mem:/ {print $3}'; done) > "$OUT/host_mem_used_mib.txt" &
hostmem=$!
nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_busy_pct.txt" 2>/dev/null &
busy=$!
log "slurm-grpo local $CONFIG ($STEPS steps)"
rm -rf $JOB
timeout "${RUN_TIMEOUT:-330}" python3 -m launcher local $CONFIG --set job.job_dir=$JOB --set vllm.model=$MODEL \
  --set "trainer.max_steps=$STEPS" ${EXTRA:-} 2>&1 | grep -v "^\[\#" | tail -25
rc=${PIPESTATUS[0]}
kill $smi $hostmem $busy 2>/dev/null
log "local run exit $rc"
cp $JOB/metrics.jsonl $JOB/summary.json "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C $JOB logs config.yaml plan.json 2>/dev/null
python3 gpu/report.py $JOB "$OUT" > /dev/null || true
if [ "${TRL:-0}" = 1 ]; then
  log "TRL $(python3 -c 'import trl; print(trl.__version__)') GRPOTrainer, colocate mode, same work"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/trl_gpu_mem_used_mib.txt" 2>/dev/null &
  smi=$!
  timeout "${TRL_TIMEOUT:-300}" python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29555 gpu/trl_colocate.py \
    $CONFIG $MODEL "$OUT/trl.json" $STEPS ${TRL_SETS:-} 2>&1 | grep -E "^\[trl|Error|error" | tail -40
  kill $smi 2>/dev/null
fi
python3 gpu/report.py $JOB "$OUT" 2>&1 | tail -40
exit $rc
