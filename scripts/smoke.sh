#!/usr/bin/env bash
# smoke.sh - the main job on a fresh CPU machine: install, build the tiny model, and run a real GRPO job
# locally (one vLLM CPU server, two FSDP2 trainer ranks) for 30 steps; prints progress and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
MODEL=${SLURM_GRPO_TINY:-/tmp/slurm-grpo-tiny}
[ -f "$MODEL/config.json" ] || slurm-grpo make-tiny-model "$MODEL"
exec slurm-grpo local configs/smoke_cpu.yaml --set vllm.model="$MODEL" "$@"
