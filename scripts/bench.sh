#!/usr/bin/env bash
# bench.sh - the whole benchmark on this machine (about 8 minutes on 2 cores, 11 with CLUSTER=1): installs what it needs,
# then `python -m bench.run`, which writes bench/results/{results.json,RESULTS.md,scaling-*.png}.
#   bash scripts/bench.sh              push/generation/launcher/local-run/scaling model
#   CLUSTER=1 bash scripts/bench.sh    also start the 2-node test cluster (root) and time a 2-node job
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
args=()
if [ "${CLUSTER:-0}" = 1 ]; then
  bash scripts/start_cluster.sh 2 3 --cpus 4 --mem 12000 --base /tmp/slurm-grpo-cluster > /tmp/slurm-grpo-cluster.env
  trap 'bash scripts/stop_cluster.sh --base /tmp/slurm-grpo-cluster' EXIT
  args+=(--cluster-env /tmp/slurm-grpo-cluster/env.sh)
fi
python -m bench.run "${args[@]}" "$@"
