"""Start-up at 64-256 nodes: every node process importing the Python stack from the shared file system, against the
environment staged to node-local storage first (slurm.stage_env). A model with stated terms, printed by `slurm-grpo
simulate`; its local figures were measured on this project's stack (bench/results/2026-12-04-stage-env/).

  processes   P per node import torch + vLLM (+ TRL): vLLM's API server, its engine core and TP x DP workers,
              torchrun and its G - TP x DP ranks, the bootstrap's reach check
  shared FS   every import is a storm of metadata operations (stat, open, getdents: ops_per_import, measured with
              strace on `import torch, vllm, trl`), all processes of all nodes at once against the metadata servers
              (mds_ops_per_s): N x P x ops / rate when no client caches a lookup (worst), N x ops / rate when each
              node's client caches them for its other processes (best); never less than local_import_s
  staged      sbcast sends the file once through SLURM's tree of slurmds (store and forward, pipelined):
              env_gb / sbcast_gbs + depth x hop_s, depth = ceil(log_fanout N); a packed venv is unpacked
              (env_gb / unpack_gbs; an image is not); 3 srun steps (mkdir, check/unpack, and the job's) x step_s;
              then every import is local: local_import_s
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STARTUP_DEFAULTS = {
    "ops_per_import": 44_000.0,  # measured: strace -c of `python -c "import torch, vllm, trl"` (38.9k stat, 4.3k open)
    "local_import_s": 8.4,  # measured here: the same import from a local disk, warm (2 cores)
    "mds_ops_per_s": 200_000.0,  # assumption: a Lustre file system's metadata servers, all MDTs together
    "env_gb": 10.0,  # assumption: a vLLM ROCm image as squashfs (.sif); a packed venv of this stack is 4 GB
    "sbcast_gbs": 1.0,  # assumption: sbcast's forwarding through slurmd (user space), per hop
    "hop_s": 1.0,  # assumption: one tree level's latency
    "fanout": 50.0,  # SLURM's TreeWidth default
    "unpack_gbs": 1.0,  # assumption: tar -x onto node-local NVMe
    "step_s": 2.0,  # assumption: one srun step over all nodes at 256 nodes
}


@dataclass(frozen=True)
class StartupRow:
    nodes: int
    processes: int
    shared_best_s: float
    shared_worst_s: float
    staged_copy_s: float
    staged_s: float


def predict_startup(nodes: list[int], processes: int, packed_venv: bool, f: dict[str, float]) -> list[StartupRow]:
    rows = []
    for n in nodes:
        best = max(f["local_import_s"], n * f["ops_per_import"] / f["mds_ops_per_s"])
        worst = max(f["local_import_s"], n * processes * f["ops_per_import"] / f["mds_ops_per_s"])
        depth = max(1, math.ceil(math.log(max(n, 2), f["fanout"])))
        copy = f["env_gb"] / f["sbcast_gbs"] + depth * f["hop_s"]
        unpack = f["env_gb"] / f["unpack_gbs"] if packed_venv else 0.0
        rows.append(StartupRow(n, processes, best, worst, copy, copy + unpack + 3 * f["step_s"] + f["local_import_s"]))
    return rows


def processes_per_node(gpus: int, tp: int, dp: int) -> int:
    """Processes that import the stack on a node: vLLM's API server, engine core and TP x DP workers, torchrun, its
    ranks, the reach check."""
    return 2 + tp * dp + 1 + (gpus - tp * dp) + 1


def startup_table(rows: list[StartupRow], f: dict[str, float], packed_venv: bool) -> list[str]:
    kind = "packed venv (unpacked on each node)" if packed_venv else "image (run in place)"
    out = [
        f"start-up: imports from the shared file system vs slurm.stage_env ({kind}, {f['env_gb']:g} GB), "
        f"{rows[0].processes} importing processes per node (launcher/startup.py; "
        + ", ".join(f"{k}={v:g}" for k, v in f.items())
        + ")",
        f"  {'nodes':>6} {'shared FS, best':>16} {'shared FS, worst':>17} {'sbcast':>8} {'staged total':>13}",
    ]
    for r in rows:
        out.append(
            f"  {r.nodes:>6} {r.shared_best_s:>15.0f}s {r.shared_worst_s:>16.0f}s {r.staged_copy_s:>7.0f}s {r.staged_s:>12.0f}s"
        )
    return out
