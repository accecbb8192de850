#!/usr/bin/env bash
# test.sh - the whole test suite on a fresh machine: install, lint, then the three tiers:
#   unit (fast, no servers) -> integration (real vLLM CPU servers, real torch.distributed)
#   -> cluster (a real 2-node SLURM cluster started here by scripts/start_cluster.sh; needs root).
# The unit tier runs as on a fresh machine (scripts/as_fresh_machine.sh): this machine's SLURM hidden (a cluster tier
# run before installs it and leaves it), /tmp, /dev/shm and the HF cache empty, so a unit test that reaches a real
# SLURM command or an earlier run's files fails here too, not only on a machine that never had them.
# TIERS="unit integration" bash scripts/test.sh   runs a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
TIERS=${TIERS:-unit integration cluster}
bash scripts/install.sh
. .venv/bin/activate
ruff check launcher trainer bench tests gpu
ruff format --check launcher trainer bench tests gpu
mypy launcher trainer bench tests
rc=0
for tier in $TIERS; do
  echo "===== tier: $tier ($(date +%T))"
  case $tier in
    unit) bash scripts/as_fresh_machine.sh pytest -q -n 2 --durations=25 -m "not integration and not cluster" || rc=1;;
    # --dist loadfile: a test file's tests share a worker, so a module's runs (test_agents_integration.py's
    # module-scoped fixtures) are made once; loadgroup would not do it with these pins (pytest-xdist 3.8.0 sets
    # item._nodeid, which pytest 9.2 no longer reads)
    integration) pytest -q -n 2 --dist loadfile --durations=25 -m integration || rc=1;;
    cluster)
      # the cluster's apt installs (slurm-wlm, munge, mariadb) happen inside start_cluster.sh
      bash scripts/start_cluster.sh 2 3 --cpus 4 --mem 12000 --base /tmp/slurm-grpo-cluster > /dev/null  # it writes /tmp/slurm-grpo-cluster/env.sh
      trap 'bash scripts/stop_cluster.sh --base /tmp/slurm-grpo-cluster' EXIT
      SLURM_GRPO_CLUSTER_ENV=/tmp/slurm-grpo-cluster/env.sh pytest -q --durations=25 -m cluster || rc=1
      ;;
  esac
done
exit $rc
