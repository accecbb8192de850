#!/usr/bin/env bash
# device.sh - ON THE H200 DEVICE, in the last of the back-to-back calls (the parts are in /tmp/parts):
# install the carried wheels with --no-deps, build a random Qwen2 with the 0.5B model's transformer body
# (bf16, from a config, no hub; MODEL_ARGS for another shape), measure the copy floor, run a short GRPO job
# with `slurm-grpo local` (one GPU: configs/gpu_1gpu.yaml, vLLM and the FSDP2 trainer share the GPU, ipc push;
# two or more GPUs: configs/gpu_1node.yaml, nccl push; both chosen by the plan), and put the metrics, plot,
# summary and a results file under $OUT.  Env: STEPS, RUN_TIMEOUT, MODEL_ARGS, CONFIG, JOB.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-30}
cd "$(dirname "$0")/.."
log() { echo "[device $(date +%T)] $*"; }
log "unpacking $(ls /tmp/parts | wc -l) parts (the wheels, unzipped into one site folder: no pip needed)"
mkdir -p /tmp/site
# the image has no zstd: the first part carries this machine's binary (glibc 2.34+) and its liblz4
Z="env LD_LIBRARY_PATH=/tmp/parts/bin /tmp/parts/bin/zstd"
for set in d v; do cat /tmp/parts/$set.* | $Z -d -q --long=27 | tar -xf - -C /tmp/site || exit 1; done
# vLLM 0.26's ipc_engine imports ray at module level; ray is not used here, so an empty package will do
mkdir -p /tmp/site/ray && : > /tmp/site/ray/__init__.py
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - > "$OUT/versions.json" <<'PY'
import json, torch, importlib.metadata as m
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                  **{n: m.version(n) for n in ("vllm", "trl", "transformers", "accelerate", "datasets")}}))
PY
cat "$OUT/versions.json"
log "building the model"
# MODEL_ARGS picks another shape (e.g. the 1.5B body: --hidden 1536 --layers 28 --kv-heads 2 --intermediate 8960)
MODEL=/tmp/qwen2-body-$$ JOB=${JOB:-/tmp/job-$$}
python3 -m launcher make-tiny-model $MODEL ${MODEL_ARGS:---hidden 896 --layers 24 --kv-heads 2 --intermediate 4864} \
  --dtype bfloat16 --vocab 4096 | tail -1
# One GPU: vLLM and the trainer share it (configs/gpu_1gpu.yaml, ipc push). G >= 2 GPUs (issue 8, not yet
# run: no such kind has been lent): vLLM on GPU 0, FSDP2 ranks on 1..G-1 (configs/gpu_1node.yaml, nccl
# push), and the floor is the GPU 0 <-> GPU 1 copy.
G=$(nvidia-smi -L | wc -l)
if [ "$G" -ge 2 ]; then CONFIG=${CONFIG:-configs/gpu_1node.yaml} PEER=cuda:1 SETS="--set slurm.gpus_per_node=$G --set vllm.max_model_len=512"
else CONFIG=${CONFIG:-configs/gpu_1gpu.yaml} PEER=cuda:0 SETS=""; fi
log "copy bandwidth, GPU 0 -> $PEER ($G GPUs)"
python3 gpu/copy_bandwidth.py $MODEL $PEER > "$OUT/d2d.json"; cat "$OUT/d2d.json"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_mem_used_mib.txt" 2>/dev/null &
smi=$!
log "slurm-grpo local $CONFIG ($STEPS steps)"
timeout "${RUN_TIMEOUT:-420}" python3 -m launcher local $CONFIG $SETS --set job.job_dir=$JOB --set vllm.model=$MODEL \
  --set "trainer.max_steps=$STEPS" 2>&1 | tail -60
rc=${PIPESTATUS[0]}
kill $smi 2>/dev/null
log "local run exit $rc"
cp $JOB/metrics.jsonl $JOB/summary.json $JOB/metrics.png "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C $JOB logs config.yaml plan.json 2>/dev/null
python3 gpu/report.py $JOB "$OUT" || true
exit $rc
