"""Manual CPU check of the emulated 2-node path and of tests/support/emulated.py's driver (not a CI test)."""

import json
import sys
from pathlib import Path

import tests.support.emulated as e

e.CONFIG = Path("configs/cluster_cpu.yaml")
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
e.LAYOUTS["cpu_nodes2"] = e.Layout(
    "CPU: 2 nodes x (vLLM + 1 rank) on one host, HSDP",
    {"job.emulate_gpus": True, "trainer.save_steps": 0},
    steps=steps,
    timeout_s=1200,
)
res = e.run_layout("cpu_nodes2", sys.argv[1], Path("/tmp/emu-cpu/out"))
res.pop("bootstrap_tail", None)
print(json.dumps(res, indent=1))
