"""The floor for a same-GPU push: device-to-device copy of the model's bf16 bytes (median of 10 after 3
warm-ups), counting the bytes moved once (as the push figures do)."""

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
dst = torch.empty_like(src)
times = []
for i in range(13):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    dst.copy_(src)
    e.record()
    torch.cuda.synchronize()
    if i >= 3:
        times.append(s.elapsed_time(e) / 1e3)
med = statistics.median(times)
print(json.dumps({"bytes": n * 2, "copy_s_median": round(med, 6), "gb_per_s": round(n * 2 / med / 1e9, 1)}))
