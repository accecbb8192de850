# stack.sh - sourced ON THE H200 DEVICE by gpu/device.sh and gpu/push_order.sh, in the last of the back-to-back calls that
# carried gpu/carry.sh's parts into /tmp/parts: install the pinned stack (torch 2.13.0 + vLLM 0.32.0 + NCCL 2.29.7 + TRL
# 1.16) into /tmp/site once, register this checkout's vLLM plugin (the gloo and mapped_ipc weight-transfer engines: vLLM
# finds plugins by their package's entry points, and the checkout is not pip-installed there), set the environment,
# and write $OUT/versions.json. Needs: OUT, the working directory at the repository root, log().
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
# the project's entry points, as `pip install -e .` would record them (pyproject.toml's [project.entry-points])
mkdir -p /tmp/site/slurm_grpo-0.0.0.dist-info
printf 'Metadata-Version: 2.1\nName: slurm-grpo\nVersion: 0.0.0\n' > /tmp/site/slurm_grpo-0.0.0.dist-info/METADATA
python3 - > /tmp/site/slurm_grpo-0.0.0.dist-info/entry_points.txt <<'PY'
import tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
for group, items in eps.items():
    print(f"[{group}]"); [print(f"{k} = {v}") for k, v in items.items()]
PY
# flashinfer is not carried (vLLM's sampler falls back to torch); the image's cuDNN 9.19 runs torch 2.13 (9.20 named);
# NVLink multicast stays off (KINDS.md)
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 - > "$OUT/versions.json" <<'PY'
import json, torch, importlib.metadata as m
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "gpu": torch.cuda.get_device_name(0),
                  **{n: m.version(n) for n in ("vllm", "trl", "transformers", "accelerate", "datasets", "pytest")}}))
PY
cat "$OUT/versions.json" || exit 1
