#!/usr/bin/env bash
# device.sh - ON THE H200 DEVICE, in the last of the back-to-back calls (the parts of gpu/carry.sh are in
# /tmp/parts): install the pinned stack (torch 2.13.0 + vLLM 0.32.0 + NCCL 2.29.7 + TRL 1.16) into /tmp/site once,
# build a random Qwen2 body (bf16, from a config, no hub; MODEL_ARGS for another shape), measure the copy floor,
# run `slurm-grpo local` with the one-GPU config (vLLM and the FSDP2 trainer share the GPU, packed ipc push) and,
# with TRL=1, TRL's own GRPOTrainer in colocate mode on the same model, prompts, reward, batch and steps
# (gpu/trl_colocate.py). Results under $OUT.   Env: STEPS, RUN_TIMEOUT, MODEL_ARGS, CONFIG, TRL, TAG,
# EXTRA (more `--set k=v` of the local run), FLOOR=0 (skip the copy-floor measurement), RESTART_STEPS=N (then resume the
# same job folder for N more steps: the restart's start-up phases and vLLM's compile-cache lines; RESTART_EXTRA: its own
# `--set k=v`, e.g. trainer.max_staleness=1 to time asynchronous steps on the warm restart). WARM_IMPORTS=1: import vLLM's
# API server and TRL once first (-X importtime: import_top.txt), so start-up comparisons all find warm .pyc files.
# TRL_WARM_CACHES=1: TRL's run keeps the machine's compile caches (default: cold ones of its own, as a job folder's are).
# TRL_SETS (the same as k=v for TRL's run, e.g. trainer.lora.r=16). JOB: the job folder (default /tmp/job-$TAG; never
# job.job_dir in EXTRA: the results are collected from $JOB). MODEL_BUILDER: a command that builds the model folder
# given as its argument, in place of the random Qwen2 body (MODEL_ARGS), e.g. the tool model of configs/agents_1gpu.yaml.
# LOCAL=0 (with TRL=1): skip the local run, TRL's alone in this call, the report over the job folder and OUT that an
# earlier call on the same warm machine left (same TAG/JOB and OUT=/tmp/...): a big body whose two runs do not fit one call.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${STEPS:-30}
TAG=${TAG:-run}
cd "$(dirname "$0")/.."
log() { echo "[device $(date +%T)] $*"; }
# G9 (../shared/GPU-AUDIT.md turn 4): one device call gets at most 600 s; the runs' own limits must leave the install
# (about 30 s), the model build and the report inside 550 s, or a slow first run silently eats the next one's time.
RUN_TIMEOUT=${RUN_TIMEOUT:-250} TRL_TIMEOUT=${TRL_TIMEOUT:-250} RESTART_TIMEOUT=${RESTART_TIMEOUT:-200}
budget=$(((${LOCAL:-1} == 0 ? 0 : RUN_TIMEOUT) + (${TRL:-0} == 1 ? TRL_TIMEOUT : 0) + (${RESTART_STEPS:-0} > 0 ? RESTART_TIMEOUT : 0)))
if [ "$budget" -gt "${RUNS_BUDGET_S:-500}" ]; then
  echo "device.sh: RUN_TIMEOUT + TRL_TIMEOUT (TRL=1) + RESTART_TIMEOUT (RESTART_STEPS) = $budget s > ${RUNS_BUDGET_S:-500} s: \
lower them so the call fits 550 s (install and model build take the rest)" >&2
  exit 2
fi
[ "${CHECK_ONLY:-0}" = 1 ] && { echo "device.sh: run limits $budget s of ${RUNS_BUDGET_S:-500}"; exit 0; }
. gpu/stack.sh  # the pinned stack in /tmp/site, the plugin, the environment, versions.json
if [ "${WARM_IMPORTS:-0}" = 1 ]; then  # start-up comparisons: every run after this one finds the .pyc files and page cache
  log "warm imports (vLLM's API server, TRL): -X importtime's slowest 25 -> import_top.txt"
  t=$SECONDS; python3 -X importtime -c "import vllm.entrypoints.openai.api_server, trl" 2> "$OUT/importtime.txt"
  log "imported in $((SECONDS - t)) s"; grep "import time:" "$OUT/importtime.txt" | sort -t'|' -k2 -n -r | head -25 > "$OUT/import_top.txt"
fi
MODEL=/tmp/model-$TAG JOB=${JOB:-/tmp/job-$TAG}
case " ${EXTRA:-} " in *job.job_dir=*)  # the logs, metrics and report below are read from $JOB
  echo "device.sh: set JOB=/path instead of --set job.job_dir in EXTRA (the results are collected from \$JOB)" >&2; exit 2;;
esac
# the device's disk is 64 GiB: three bodies of 3-7 B with their job folders (final model, checkpoints) filled it
# (2026-12-06, call 9): another tag's bodies and job folders go first when less than 40 GiB is free
if [ "$(df -k --output=avail /tmp | tail -1)" -lt $((40 * 1024 * 1024)) ]; then
  for d in /tmp/model-* /tmp/job-*; do
    case $d in "$MODEL" | "$JOB") ;; *) [ -e "$d" ] && { log "disk: removing $d"; rm -rf "$d"; } ;; esac
  done
fi
log "building the model"
if [ -n "${MODEL_BUILDER:-}" ]; then  # e.g. "python3 -m trainer.agents.tiny_tool_model --like qwen2-1.5b --dtype bfloat16 --device cuda"
  [ -f $MODEL/config.json ] || $MODEL_BUILDER $MODEL | tail -1
else
  [ -f $MODEL/config.json ] || python3 -m trainer.tiny_model $MODEL ${MODEL_ARGS:---hidden 896 --layers 24 --kv-heads 2 --intermediate 4864} \
    --dtype bfloat16 --vocab 4096 | tail -1
fi
CONFIG=${CONFIG:-configs/gpu_1gpu.yaml}
if [ "${FLOOR:-1}" = 1 ]; then
  log "copy bandwidth, GPU 0 -> GPU 0"
  python3 gpu/copy_bandwidth.py $MODEL cuda:0 > "$OUT/d2d.json"; cat "$OUT/d2d.json"
fi
rc=0
if [ "${LOCAL:-1}" != 0 ]; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_mem_used_mib.txt" 2>/dev/null &
  smi=$!
  (while sleep 1; do free -m | awk '/^Mem:/ {print $3}'; done) > "$OUT/host_mem_used_mib.txt" &
  hostmem=$!
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 > "$OUT/gpu_busy_pct.txt" 2>/dev/null &
  busy=$!
  log "slurm-grpo local $CONFIG ($STEPS steps)"
  rm -rf $JOB
  timeout "$RUN_TIMEOUT" python3 -m launcher local $CONFIG --set job.job_dir=$JOB --set vllm.model=$MODEL \
    --set "trainer.max_steps=$STEPS" ${EXTRA:-} 2>&1 | grep -v "^\[\#" | tail -25
  rc=${PIPESTATUS[0]}
  kill $smi $hostmem $busy 2>/dev/null
  log "local run exit $rc"
  cp $JOB/metrics.jsonl $JOB/summary.json "$OUT/" 2>/dev/null
  tar -czf "$OUT/logs.tgz" -C $JOB logs config.yaml plan.json || log "logs.tgz: tar failed (see above)"
  cp -r $JOB/profile "$OUT/" 2>/dev/null  # trainer.profile_steps' tables, when asked for
  python3 gpu/report.py $JOB "$OUT" > /dev/null || true
  if [ -n "${RESTART_STEPS:-}" ]; then  # a restart of the same job: it resumes, and vLLM finds its compile cache in the job folder
    log "restart: the same job folder, $RESTART_STEPS more steps"
    cp "$OUT/gpu_results.json" "$OUT/gpu_results.first.json"
    timeout "$RESTART_TIMEOUT" python3 -m launcher local $CONFIG --set job.job_dir=$JOB --set vllm.model=$MODEL \
      --set "trainer.max_steps=$((STEPS + RESTART_STEPS))" ${EXTRA:-} ${RESTART_EXTRA:-} 2>&1 | grep -v "^\[\#" | tail -6
    python3 -c "import json,sys; from launcher.status import startup_phases; print(json.dumps(startup_phases(sys.argv[1], 0)))" $JOB \
      | tee "$OUT/restart_phases.json"
    grep -hoE "init engine \(profile, create kv cache, warmup model\) took [0-9.]+ s|torch\.compile takes [0-9.]+ s[^\n]*|Compiling model again due to a load failure[^\n]*|Directly load the compiled graph[^\n]*|Available KV cache memory[^\n]*" \
      $JOB/logs/node0-vllm*.log > "$OUT/vllm_compile_lines.txt"; cat "$OUT/vllm_compile_lines.txt"
    cp $JOB/metrics.jsonl "$OUT/" 2>/dev/null
    tar -czf "$OUT/logs.tgz" -C $JOB logs config.yaml plan.json  # again: both starts' logs
    python3 -c "import json,sys; from launcher.vllm_log import node_starts; print(json.dumps(node_starts(__import__('pathlib').Path(sys.argv[1]))))" \
      $JOB/logs/node0-vllm.log | tee "$OUT/vllm_start_phases.json"
  fi
fi  # LOCAL
if [ "${TRL:-0}" = 1 ]; then
  log "TRL $(python3 -c 'import trl; print(trl.__version__)') GRPOTrainer, colocate mode, same work"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/trl_gpu_mem_used_mib.txt" 2>/dev/null &
  smi=$!
  # TRL's compile caches cold as ours are (a fresh job folder's cache/): its own folders, not the machine's ~/.cache,
  # ~/.triton and /tmp/torchinductor_* that an earlier TRL run of this machine filled (TRL_WARM_CACHES=1 keeps those)
  if [ "${TRL_WARM_CACHES:-0}" != 1 ]; then
    trl_cache=$(mktemp -d /tmp/trl-cache.XXXX)
    export VLLM_CACHE_ROOT=$trl_cache/vllm TORCHINDUCTOR_CACHE_DIR=$trl_cache/inductor TRITON_CACHE_DIR=$trl_cache/triton
  fi
  timeout "$TRL_TIMEOUT" python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29555 gpu/trl_colocate.py \
    $CONFIG $MODEL "$OUT/trl.json" $STEPS ${TRL_SETS:-} 2>&1 | grep -E "^\[trl|Error|error" | tail -40
  kill $smi 2>/dev/null
fi
# the report needs a local run's job folder (LOCAL=0 with TRL=1: TRL's figures are in trl.json alone)
[ "${LOCAL:-1}" = 0 ] || python3 gpu/report.py $JOB "$OUT" 2>&1 | tail -40
exit $rc
