"""The floor of a push: a copy of the model's bf16 bytes (median of 10 after 3 warm-ups), counting the
bytes moved once (as the push figures do). Same GPU (the `ipc` push) by default; with a second argument
`cuda:1`, GPU 0 -> GPU 1 (the link an `nccl` push from a trainer GPU to vLLM's GPU crosses)."""

import json
import math
import statistics
import sys

import torch
from safetensors import safe_open

path = sys.argv[1]
n = 0
with safe_open(f"{path}/model.safetensors", "pt") as f:
    for k in f.keys():
        n += math.prod(f.get_slice(k).get_shape())
src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
dst = torch.empty_like(src, device=sys.argv[2] if len(sys.argv) > 2 else "cuda")
times = []
for i in range(13):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    dst.copy_(src)
    e.record()
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    if i >= 3:
        times.append(s.elapsed_time(e) / 1e3)
med = statistics.median(times)
print(
    json.dumps({"to": str(dst.device), "bytes": n * 2, "copy_s_median": round(med, 6), "gb_per_s": round(n * 2 / med / 1e9, 1)})
)
