"""Pre-flight on ROCm nodes (launcher.node.reach runs it before vLLM and torchrun start): can the trainer leader's
GPU and the server's GPUs reach each other, as the RCCL weight push will need? With the visibility the node's
processes get (all of the node's GCDs), it checks the devices exist, peer access both ways, and a round trip of a
small tensor leader -> server GPU -> leader. Exit 0 and one line when they can; exit 3 and what failed otherwise.

    python -m trainer.reach --leader 1 --server 0            # GCD 1 (trainer rank 0) and GCD 0 (vLLM)
"""

from __future__ import annotations

import argparse
import os
import sys

MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def check(leader: int, servers: list[int]) -> str:
    """'' when every pair reaches; otherwise what failed, with the masks this process saw."""
    import torch

    masks = ", ".join(f"{k}={os.environ[k]!r}" for k in MASKS if k in os.environ) or "no device mask"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = max([leader, *servers])
    if count <= need:
        return f"this process sees {count} GPU(s) ({masks}), the plan needs index {need}"
    probe = torch.arange(1024, dtype=torch.float32, device=f"cuda:{leader}")
    for s in servers:
        if s == leader:
            continue
        for a, b in ((leader, s), (s, leader)):
            if not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b} as a peer ({masks}); RCCL between them would fail or crawl"
        back = probe.to(f"cuda:{s}").to(f"cuda:{leader}")
        torch.cuda.synchronize(leader)
        if not torch.equal(back, probe):
            return f"a tensor copied GPU {leader} -> {s} -> {leader} came back changed ({masks})"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.reach", description=__doc__)
    ap.add_argument("--leader", type=int, required=True, help="node-local GPU index of the trainer leader (rank 0 of the node)")
    ap.add_argument("--server", type=int, nargs="+", required=True, help="node-local GPU indices of the vLLM server")
    a = ap.parse_args(argv)
    try:
        problem = check(a.leader, a.server)
    except Exception as e:  # a driver error is the answer too
        problem = f"{type(e).__name__}: {e}"
    if problem:
        print(f"reach check failed: {problem}", flush=True)
        return 3
    print(f"reach check ok: trainer leader GPU {a.leader} <-> server GPUs {a.server}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
