"""The bootstrap's pre-flight on ROCm: before the node starts vLLM and torchrun, check that the trainer leader's
GPU and the server's GPUs can reach each other with the visibility both will have (trainer.reach, a short torch
process with a deadline). A failure names the node, the process and its log, in seconds instead of after the
server's load and the first push."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from launcher.core.jobdir import JobDir
from launcher.core.plan import Plan
from launcher.core.platform import MASKS, node_visibility
from launcher.node.commands import NodeCommand, trainer_command, vllm_command
from launcher.node.diagnose import tail
from launcher.node.peers import NodeFailure

DEADLINE_S = 180.0
"""The least the check waits: importing torch from a cold shared file system can take minutes at scale (launcher.startup
models it), so the deadline is the larger of this and vllm.health_timeout_s; the check itself takes a second."""


def reach_command(p: Plan, node: int, python: str) -> NodeCommand | None:
    """The check for this node, or None where it does not apply (cuda: a mask per process; a shared GCD: no pair)."""
    n = p.nodes[node]
    if p.platform != "rocm" or n.shared_gpu:
        return None
    # the two processes' own environments must show the node alike: on rocm neither narrows it
    env_v, env_t = vllm_command(p, node, python).env, trainer_command(p, node, "127.0.0.1", python).env
    masks = {k for k in (*env_v, *env_t) if k in MASKS}
    assert not masks, f"rocm node processes must not get a device mask, got {sorted(masks)}"
    argv = [python, "-m", "trainer.reach", "--leader", str(n.trainer_gpus[0]), "--server", *map(str, n.vllm_gpus)]
    return NodeCommand(name="reach", argv=argv, env=env_t, log=str(JobDir(Path()).log(node, "reach")))


def node_allocation(p: Plan) -> str | None:
    """Make this bootstrap's environment show the node's GPUs as its processes must see them (rocm: one node-wide
    HIP_ or ROCR_ mask, no CUDA_VISIBLE_DEVICES; launcher.core.platform.node_visibility), and return the allocation
    the commands map the plan's indices through (cuda: SLURM's CUDA_VISIBLE_DEVICES; rocm and cpu: None)."""
    for k, v in node_visibility(p.platform, os.environ, p.gpus_per_node).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return os.environ.get("CUDA_VISIBLE_DEVICES") if p.device == "cuda" and p.platform == "cuda" else None


def check_reach(p: Plan, node: int, python: str, where: str, say=print) -> float | None:
    """Seconds the check took (None: not run); NodeFailure naming the node, the check and its log when it fails."""
    cmd = reach_command(p, node, python)
    if cmd is None:
        return None
    log = Path(p.job_dir) / cmd.log
    deadline = max(DEADLINE_S, float(p.config.vllm.health_timeout_s))
    what = f"pre-flight reach check (trainer leader GPU {cmd.argv[4]} <-> vLLM GPUs {','.join(cmd.argv[6:])})"
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd.argv, env={**os.environ, **cmd.env}, stdout=f, stderr=subprocess.STDOUT, timeout=deadline
            ).returncode
        except subprocess.TimeoutExpired:
            raise NodeFailure(
                f"{where}: {what} did not finish in {deadline:.0f} s\n  last lines of {log}:\n{tail(log)}"
            ) from None
    if rc != 0:
        raise NodeFailure(f"{where}: {what} failed with code {rc}\n  last lines of {log}:\n{tail(log)}")
    took = time.time() - t0
    say(f"{what}: ok in {took:.1f} s")
    return took
