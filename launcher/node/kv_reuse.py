"""The KV cache size a node's vLLM is given: the work's (vllm.kv_cache work), else the one its first start measured.

On a GPU it shares with the trainer, vLLM sizes its KV cache as its share of the GPU less every byte the GPU lost
while it profiled, other processes' included: a resumed trainer that loads its optimizer state (twice the fp32 model)
meanwhile leaves vLLM too little (-9.7 GiB on an H100, 2026-12-06), so the trainer waits for the server before it
loads (trainer.rollout.node before_resume), and a restart of a 2.8 B body spent 30 s after vLLM was healthy loading
33 GB (gpu/results/2026-12-07-ds3-lora-restart/). vLLM's `--kv-cache-memory-bytes` skips that sizing: the node's
first start records the size it measured (`record`), a later start of the same server on the same kind of GPU passes
it (`reused`), and the bootstrap tells the trainer (Env.KV_CACHE_FIXED), which then loads while the server starts.

A first start needs no measurement where the launcher can count the work (launcher.core.vllm_start.work_kv_bytes:
every sequence in flight at vllm.max_model_len). Given it, vLLM skips its memory profiling and the CUDA graph capture
that profiling repeats (17 s of a 7 B LoRA server's 118 s first start on an H100; a restart given the measured size:
`init engine` 5 s against 59 s), and the trainer gets the GPU vLLM's share would have left to an oversized cache (a
3 B body at 0.35 of an H100: 21.4 GiB measured, where 32 sequences of 512 tokens need 0.6). It is kept to what the
server's share holds after its weights (launcher.core.vllm_start.kv_share_left); more, and vLLM measures as before.

Only where the server shares its GPUs with trainer ranks (plan node `shared_gpu`) and the node runs CUDA (the GPU's
memory is read with nvidia-smi, which a node without it lacks: no reuse); the record is keyed by the server's whole
command line, so a changed vllm setting measures again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launcher import vllm_log
from launcher.core.jobdir import JobDir
from launcher.core.plan import Plan, generation_steps
from launcher.core.vllm_start import kv_share_left, kv_size_given, work_kv_bytes
from launcher.node.commands import NodeCommand

FLAG = "--kv-cache-memory-bytes"
SAFETY_BYTES = 16 * 2**20
"""vLLM prints the size to 0.01 GiB: the recorded bytes are that figure less this, never more than it measured."""


def applies(plan: Plan, node: int) -> bool:
    """Whether this node's server start can take a size: it shares a CUDA GPU with the trainer."""
    return kv_size_given(plan, node)


def server_key(argv: list[str]) -> str:
    """The server's command line less the interpreter, which differs between nodes of one job."""
    return hashlib.sha1(json.dumps(argv[1:]).encode()).hexdigest()[:16]


def gpu_memory_mib(devices: str) -> int | None:
    """The first of `devices`' (CUDA_VISIBLE_DEVICES) total memory by nvidia-smi, or None where it cannot say."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    first = devices.split(",")[0].strip()
    try:
        out = subprocess.run(
            [exe, *(["-i", first] if first else []), "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return int(lines[0]) if out.returncode == 0 and lines and lines[0].isdigit() else None


def reused(plan: Plan, node: int, argv: list[str], gpus: str) -> int | None:
    """The KV cache bytes recorded by an earlier start of this server on this kind of GPU, or None (measure)."""
    if not applies(plan, node):
        return None
    path = JobDir(Path(plan.job_dir)).kv_cache_record(node)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("server") != server_key(argv) or rec.get("gpu_mib") != gpu_memory_mib(gpus):
        return None
    size = rec.get("bytes")
    return size if isinstance(size, int) and size > 0 else None


def record(plan: Plan, node: int, server: NodeCommand) -> int | None:
    """After the server is healthy: the KV cache size this start measured (its log's latest start), written for the
    next start; None where it did not measure (a size passed in) or cannot be reused."""
    argv = server.argv
    if not applies(plan, node) or FLAG in argv:
        return None
    jd = JobDir(Path(plan.job_dir))
    log = jd.log(node, "vllm")
    parts = vllm_log.starts(log.read_text(errors="replace")) if log.is_file() else []
    gib = vllm_log.kv_cache_gib(parts[-1]) if parts else None
    mib = gpu_memory_mib(devices(server))
    if gib is None or mib is None:
        return None
    size = int(gib * 2**30) - SAFETY_BYTES
    path = jd.kv_cache_record(node)
    try:  # a record not written costs the next restart its wait, never this run
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"server": server_key(argv), "gpu_mib": mib, "bytes": size, "gib_measured": gib}))
    except OSError:
        return None
    return size


@dataclass(frozen=True)
class KvStart:
    """The server command to start and the KV cache size it was given (None: vLLM measures), with where it came from."""

    server: NodeCommand
    bytes: int | None
    why: str


def work_sized(plan: Plan, node: int, server: NodeCommand) -> tuple[int | None, str]:
    """vllm.kv_cache work: the bytes launcher.core.vllm_start.work_kv_bytes counts, where they fit the server's share."""
    size, why = work_kv_bytes(plan, generation_steps(plan.config, plan.world_size))
    if size is None:
        return None, why
    mib = gpu_memory_mib(devices(server))
    left = None if mib is None else kv_share_left(plan, mib * 2**20)
    if left is None:
        return None, "the GPU's memory is unknown (no nvidia-smi answer): vLLM measures"
    if size > left:
        return (
            None,
            f"the work needs {size / 2**30:.2f} GiB, more than the {left / 2**30:.2f} GiB its share leaves: vLLM measures",
        )
    return size, f"sized to the work: {why}"


def server_start(plan: Plan, node: int, server: NodeCommand) -> KvStart:
    """The server command to start, with a KV cache size where one applies: the work's (vllm.kv_cache work), else the
    one an earlier start measured; none where vLLM measures. A size in vllm.extra_args is the user's: kept."""
    if FLAG in server.argv or not applies(plan, node):
        return KvStart(server, None, "")
    size, why = work_sized(plan, node, server)
    if size is not None:
        return KvStart(given(server, size), size, why)
    earlier = reused(plan, node, server.argv, devices(server))
    if earlier is not None:
        return KvStart(given(server, earlier), earlier, f"as an earlier start measured (not the work's: {why})")
    return KvStart(server, None, f"measured by vLLM's profile (not the work's: {why})")


def given(server: NodeCommand, size: int) -> NodeCommand:
    return NodeCommand(server.name, [*server.argv, FLAG, str(size)], server.env, server.log)


def devices(server: NodeCommand) -> str:
    """The GPUs the server runs on (its CUDA_VISIBLE_DEVICES; empty: the node's)."""
    return server.env.get("CUDA_VISIBLE_DEVICES", "")
