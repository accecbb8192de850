"""The emulated multi-GPU runs of issue 33 (job.emulate_gpus, launcher.core.emulation): each layout of a cluster node
laid out on the one GPU of a device machine, run with the production code end to end (a bootstrap per node, as srun
starts them), and its figures written as gpu_results.json. tests/unit/test_gpu_emulated.py asserts on them (CUDA
only), gpu/emulated.sh runs that on the device, tests/unit/test_emulation.py dry-runs every layout's config on CPU.

Faults (issue 33 item 2f): `vllm_mid_push` SIGKILLs the node's vLLM processes while a push is in flight (the server
log shows /start_weight_update answered and /finish_weight_update not yet): the leader's NCCL broadcast breaks half
way; `rank_mid_step` SIGKILLs trainer rank 2 (a non-leader) after step 3. Either way the job must end within its
deadline, the bootstrap naming the node, the process and its log.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "gpu_emulated.yaml"
PARITY_TOLERANCE = 0.25  # trainer.rollout.parity's own


@dataclass(frozen=True)
class Layout:
    what: str
    sets: dict = field(default_factory=dict)
    steps: int = 12
    fault: str = ""
    timeout_s: int = 400
    """The whole run's deadline: well inside one 550 s device call, with the install and the model build before it."""


SPLIT = {"slurm.gpus_per_node": 4}  # vLLM on GPU 0, 3 trainer ranks
TP2 = {**SPLIT, "vllm.tensor_parallel_size": 2, "trainer.max_completion_length": 64}
"""TP 2 on one GPU decodes slowly: every decode step's two all-reduces per layer go GPU -> host -> loopback socket between
two time-sliced processes. Measured on an H100 (gpu/results/2026-12-05-emulated/tp2_ranks2): 29 s of generation a step
at 128 tokens, so 12 steps did not fit the 400 s deadline (9 did, parity after every push). Half the tokens, 6 steps."""
LORA = {"trainer.lora.r": 16, "trainer.learning_rate": 3e-3}
"""LoRA at 10x full fine-tuning's learning rate (LoRA's usual ratio). At the config's 3e-4 (gpu/results/
2026-12-05-emulated-2) the adapters' updates stayed within bf16's noise (the stale probe at step 11: 0.029, full
fine-tuning's 0.212) and the reward flat: the run showed the transport, not that an update reaches the server. The
test now asks the probe's drift since the first push to stand well above the parity's noise."""
LAYOUTS: dict[str, Layout] = {
    "split3_k0": Layout("2a: vLLM TP 1 + 3 ranks, FSDP2 over NCCL, the nccl push from the leader", SPLIT),
    "split3_k1": Layout("2a: the same at trainer.max_staleness 1", {**SPLIT, "trainer.max_staleness": 1}, steps=10),
    "split3_k2": Layout("2a: the same at trainer.max_staleness 2", {**SPLIT, "trainer.max_staleness": 2}, steps=10),
    "tp2_ranks2": Layout("2b: vLLM TP 2 (two workers) + 2 ranks", TP2, steps=6),
    "nodes2": Layout(
        "2c: 2 nodes x (vLLM + 2 ranks), HSDP, each node pushing to its own server",
        {"slurm.nodes": 2, "slurm.gpus_per_node": 3, "trainer.fsdp": "hsdp"},
    ),
    "lora_adapter_tp2": Layout("2e: LoRA, the adapter path on a TP 2 server", {**TP2, **LORA}, steps=6),
    "lora_merged_dp2": Layout("2e: LoRA, the merged path with vLLM DP 2", {**SPLIT, "vllm.data_parallel_size": 2, **LORA}),
    "fault_vllm": Layout("2f: vLLM killed mid-push (the leader's push breaks half way)", SPLIT, steps=30, fault="vllm_mid_push"),
    "fault_rank": Layout("2f: a trainer rank killed mid-step", SPLIT, steps=30, fault="rank_mid_step"),
}


REAL = os.environ.get("EMU_REAL") == "1"
"""EMU_REAL=1: the same layouts on a machine with the GPUs they name (nvidia-h100-x4 and up), job.emulate_gpus off:
what emulation cannot show (NVLink, the real topology; several nodes need several hosts)."""


def overrides(layout: Layout, model: str, job_dir: str) -> list[str]:
    sets = {**layout.sets, "vllm.model": model, "job.job_dir": job_dir, "trainer.max_steps": layout.steps}
    if REAL:
        sets["job.emulate_gpus"] = False
    return [f"{k}={json.dumps(v)}" for k, v in sets.items()]


def load_config(layout: Layout, model: str, job_dir: str):
    from launcher.core.config import load

    return load(CONFIG, overrides(layout, model, job_dir))


# ------------------------------------------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    """Every descendant of pid (from /proc: ppid of each process)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def started_pid(job: Path, node: int, event: str) -> int | None:
    from launcher.core.jobdir import JobDir
    from launcher.core.records import read_events

    evs = [e for e in read_events(JobDir(job).events(node)) if e.event == event]
    return evs[-1].to_dict().get("pid") if evs else None


def kill_vllm_mid_push(job: Path, say) -> dict:
    """Wait for a push in flight after step 2 (the server answered /start_weight_update, not yet /finish), SIGKILL
    every process of node 0's server."""
    from launcher.core.jobdir import JobDir
    from launcher.core.records import Event

    log = JobDir(job).log(0, "vllm")
    deadline = time.time() + 300
    while time.time() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        starts, finishes = text.count("/start_weight_update"), text.count("/finish_weight_update")
        pid = started_pid(job, 0, Event.VLLM_START)
        if pid and starts >= 3 and starts > finishes:
            victims = [pid, *children(pid)]
            for v in victims:
                try:
                    os.kill(v, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            say(f"fault: SIGKILL vLLM {victims} with push {starts} in flight")
            return {"fault_at": time.time(), "killed": victims, "mid_push": True, "push": starts}
        time.sleep(0.01)
    return {"fault_at": None, "mid_push": False}


def kill_rank_mid_step(job: Path, say, rank: int = 2) -> dict:
    """After step 3, SIGKILL trainer rank `rank` (as the OOM killer would)."""
    from launcher.core.jobdir import JobDir
    from launcher.core.records import Event, read_rows, step_rows

    deadline = time.time() + 300
    while time.time() < deadline:
        jd = JobDir(job)
        done = len(step_rows(read_rows(jd.metrics))) if jd.metrics.exists() else 0
        torchrun = started_pid(job, 0, Event.TRAINER_START)
        if torchrun and done >= 3:
            for pid in children(torchrun):
                try:
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in env:
                    os.kill(pid, signal.SIGKILL)
                    say(f"fault: SIGKILL trainer rank {rank} (pid {pid}) after step {done}")
                    return {"fault_at": time.time(), "killed": [pid], "after_step": done}
        time.sleep(0.1)
    return {"fault_at": None}


FAULTS = {"vllm_mid_push": kill_vllm_mid_push, "rank_mid_step": kill_rank_mid_step}


# ------------------------------------------------------------------------------------------------- one run


def run_layout(name: str, model: str, out: Path, job_root: Path = Path("/tmp")) -> dict:
    """Run one layout end to end (every node's bootstrap on this host) and write out/<name>/gpu_results.json."""
    from launcher.core.jobdir import JobDir, write_job_dir
    from launcher.core.plan import plan as make

    layout = LAYOUTS[name]
    job = job_root / f"job-emu-{name}"
    subprocess.run(["rm", "-rf", str(job)], check=True)
    cfg = load_config(layout, model, str(job))
    p = make(cfg, str(job))
    write_job_dir(cfg, p)
    dest = out / name
    dest.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []

    def say(line: str) -> None:
        notes.append(line)
        print(f"[emulated {name}] {line}", flush=True)

    t0 = time.time()
    boots = []
    for node in range(p.num_nodes):
        f = open(dest / f"node{node}-bootstrap.log", "w")  # noqa: SIM115 - closed below
        boots.append((subprocess.Popen(
            [sys.executable, "-u", "-m", "launcher.node.bootstrap", str(JobDir(job).plan), "--node", str(node)],
            stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
        ), f))  # fmt: skip
    fault: dict = {}
    if layout.fault:
        th = threading.Thread(target=lambda: fault.update(FAULTS[layout.fault](job, say)), daemon=True)
        th.start()
    deadline = t0 + layout.timeout_s
    while time.time() < deadline and any(b.poll() is None for b, _ in boots):
        time.sleep(0.5)
    ended = time.time()
    timed_out = any(b.poll() is None for b, _ in boots)
    for b, _ in boots:
        if b.poll() is None:
            b.send_signal(signal.SIGTERM)
    for b, f in boots:
        try:
            b.wait(p.bootstrap_grace_s + 30)
        except subprocess.TimeoutExpired:
            b.kill()
            b.wait()
        f.close()
    res = figures(p, job, name, layout)
    res.update(
        wall_s=round(ended - t0, 1),
        timed_out=timed_out,
        exit_codes=[b.returncode for b, _ in boots],
        notes=notes,
        fault=layout.fault or None,
        bootstrap_tail={  # keyed as in gpu_results.json (str), like every per-node figure
            str(i): (dest / f"node{i}-bootstrap.log").read_text(errors="replace")[-4000:] for i in range(len(boots))
        },
    )
    if fault:
        res["fault_detail"] = fault
        res["stopped_after_fault_s"] = round(ended - fault["fault_at"], 1) if fault.get("fault_at") else None
    versions = out / "versions.json"
    if versions.exists():
        res["versions"] = json.loads(versions.read_text())
    (dest / "gpu_results.json").write_text(json.dumps(res, indent=1))
    subprocess.run(["tar", "-czf", str(dest / "logs.tgz"), "-C", str(job), "logs", "plan.json", "config.yaml"], check=False)
    for kept in ("metrics.jsonl", "summary.json"):
        if (job / kept).exists():
            (dest / kept).write_bytes((job / kept).read_bytes())
    return res


def figures(p, job: Path, name: str, layout: Layout) -> dict:
    """What the run did, per phase, from its own files (metrics.jsonl, events)."""
    from launcher.core.jobdir import JobDir
    from launcher.core.records import read_rows, step_rows
    from launcher.status import startup_phases

    jd = JobDir(job)
    steps = step_rows(read_rows(jd.metrics)) if jd.metrics.exists() else []
    later = steps[1:] or steps

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    nodes = [str(n) for n in range(p.num_nodes)]
    return {
        "layout": name,
        "what": layout.what,
        "emulated": p.emulated,
        "nodes": p.num_nodes,
        "gpus_per_node": p.gpus_per_node,
        "trainer_ranks": p.ranks_per_node,
        "world_size": p.world_size,
        "tensor_parallel_size": p.tensor_parallel_size,
        "data_parallel_size": p.data_parallel_size,
        "server_world": p.server_world,
        "push_backend": p.weight_transfer_backend,
        "lora_push": p.lora_push or None,
        "fsdp": p.config.trainer.fsdp,
        "max_staleness": p.config.trainer.max_staleness,
        "steps": len(steps),
        "reward": [round(r.reward, 4) for r in steps],
        "reward_first3": round(statistics.mean(r.reward for r in steps[:3]), 4) if steps else None,
        "reward_last3": round(statistics.mean(r.reward for r in steps[-3:]), 4) if steps else None,
        "parity_after_push": {n: [r.parity.get(n) for r in steps] for n in nodes},
        "parity_engines": {n: [r.parity_engines.get(n) for r in steps] for n in nodes},
        "parity_stale": {n: [r.parity_stale.get(n) for r in steps] for n in nodes},
        "probe_drift": {n: [r.probe_drift.get(n) for r in steps] for n in nodes},
        "parity_max": max((r.parity_max for r in steps if r.parity_max is not None), default=None),
        "pushes_per_node": {n: sum(1 for r in steps if r.push_s.get(n)) for n in nodes},
        "push_s_median": {n: med([r.push_s[n] for r in later if r.push_s.get(n)]) for n in nodes},
        "gen_s_median": {n: med([r.gen_s[n] for r in later if r.gen_s.get(n)]) for n in nodes},
        "parity_s_median": {n: med([r.parity_s[n] for r in later if r.parity_s.get(n) is not None]) for n in nodes},
        "step_s_median": med([r.step_s for r in later if r.step_s]),
        "staleness": [max((v for v in r.staleness.values() if v is not None), default=None) for r in steps],
        "startup_phases_s": {n: startup_phases(job, int(n)) for n in nodes},
    }


def main(argv: list[str]) -> int:
    """python -m tests.support.emulated LAYOUT MODEL OUT: one run without pytest (prints its gpu_results.json)."""
    name, model, out = argv
    print(json.dumps(run_layout(name, model, Path(out)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
