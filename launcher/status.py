"""Job commands on an existing job folder: status, logs, cancel; and the run summary they print."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

from launcher.core.config import ConfigError


def q(path: str | Path) -> str:
    """A path as the user may paste it into a shell: quoted when it holds anything the shell would interpret
    (a job folder named `it's $(touch x) one` must not run the `$()`)."""
    return shlex.quote(str(path))


JOB_ID_RE = re.compile(r"\d+(_\d+)?")
"""A SLURM job id, or an array task's (4242_3: point 3 of a sweep)."""


def find_job_dir(ref: str, root: str = "runs") -> Path:
    """A job folder (or a sweep's), or a SLURM job id looked up in the job_id files under root: runs/*/job_id (a
    job's newest submission, a sweep's array) and runs/*/point-*/job_id (a sweep point's array task)."""
    p = Path(ref)
    if (p / "plan.json").is_file() or (p / "sweep.json").is_file():
        return p
    if JOB_ID_RE.fullmatch(ref):
        for f in sorted([*Path(root).glob("*/job_id"), *Path(root).glob("*/point-*/job_id")]):
            if f.read_text().strip() == ref:
                return f.parent
        raise ConfigError(
            f"no job folder under {q(Path(root).absolute())}/ has job id {ref} (a resumed job has its newest id there); "
            f"pass the job folder instead"
        )
    raise ConfigError(f"{ref!r} is neither a job folder (with plan.json), a sweep folder (with sweep.json) nor a job id")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return rows


def summarize(rows: list[dict[str, Any]], k: int = 0) -> dict[str, Any]:
    """Reward first vs last steps, push seconds per node, parity, tokens/s: from metrics.jsonl rows."""
    steps = [r for r in rows if "step" in r and "reward" in r]
    if not steps:
        return {}
    k = k or max(1, min(5, len(steps) // 4))
    first = sum(r["reward"] for r in steps[:k]) / k
    last = sum(r["reward"] for r in steps[-k:]) / k
    push: dict[str, list[float]] = {}
    for r in steps:
        for node, s in (r.get("push_s") or {}).items():
            push.setdefault(node, []).append(s)
    parity = [r["parity_max"] for r in steps if r.get("parity_max") is not None]
    tps = [r["gen_tokens_per_s"] for r in steps if r.get("gen_tokens_per_s")]
    return {
        "steps": len(steps),
        "last_step": steps[-1]["step"],
        "window": k,
        "reward_first": round(first, 4),
        "reward_last": round(last, 4),
        "push_s_median": {n: round(sorted(v)[len(v) // 2], 4) for n, v in sorted(push.items())},
        "parity_max": float(f"{max(parity):.3g}") if parity else None,
        "gen_tokens_per_s_median": round(sorted(tps)[len(tps) // 2], 1) if tps else None,
        "step_s_median": round(sorted(r["step_s"] for r in steps)[len(steps) // 2], 3)
        if all("step_s" in r for r in steps)
        else None,
    }


def format_summary(s: dict[str, Any]) -> str:
    if not s:
        return "no training steps recorded yet"
    push = ", ".join(f"node {n}: {v:.3f} s" for n, v in s["push_s_median"].items()) or "none"
    return (
        f"steps {s['steps']} (last {s['last_step']}); reward first {s['window']} steps {s['reward_first']:.4f} -> "
        f"last {s['window']} {s['reward_last']:.4f}; push median {push}; parity max {s['parity_max']}; "
        f"generation {s['gen_tokens_per_s_median']} tokens/s; step {s['step_s_median']} s"
    )


def slurm_state(job_id: str) -> list[str]:
    try:
        out = subprocess.run(
            ["sacct", "-j", job_id, "-n", "-P", "-o", "JobID,State,NodeList,Elapsed,ExitCode"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"(sacct not available: {e})"]
    if out.returncode != 0:
        return [f"(sacct failed: {out.stderr.strip()})"]
    return [ln for ln in out.stdout.splitlines() if ln.strip()]


PHASES = (
    ("server start", "vllm_start", "vllm_healthy"),
    ("trainer launch + rendezvous", "trainer_start", "rendezvous_done"),
    ("model load + shard", "rendezvous_done", "model_loaded"),
    ("trainer build + first step", "model_loaded", "first_step"),
)


def startup_phases(job_dir: Path, node: int) -> dict[str, float]:
    """Seconds of each start-up phase of the node's latest attempt, from its events file (the bootstrap
    and the node's trainer leader both append to it), plus the total from bootstrap start to step 1."""
    ev = read_jsonl(job_dir / "logs" / f"node{node}-events.jsonl")
    starts = [i for i, e in enumerate(ev) if e["event"] == "bootstrap_start"]
    t: dict[str, float] = {}
    for e in ev[starts[-1] :] if starts else []:
        t.setdefault(e["event"], e["t"])
    out = {name: round(t[b] - t[a], 2) for name, a, b in PHASES if a in t and b in t}
    if "bootstrap_start" in t and "first_step" in t:
        out["total to step 1"] = round(t["first_step"] - t["bootstrap_start"], 2)
    return out


ENDED_RESUMABLE = ("NODE_FAIL", "TIMEOUT", "FAILED", "PREEMPTED", "OUT_OF_MEMORY", "CANCELLED")
"""sacct states after which `slurm-grpo resume` is the next step."""


def next_step(job_dir: Path, state: str, slurm: Any) -> str | None:
    """What to do after a job ended in `state` (sacct's State, e.g. "CANCELLED by 1000"): resume from the newest
    checkpoint, with the setting that ended it raised where one did (time, memory); submit again if nothing was
    checkpointed, since resume would refuse."""
    from launcher.core.jobdir import complete_checkpoints

    word = state.split()[0] if state.split() else ""
    if word not in ENDED_RESUMABLE:
        return None
    why = {
        "TIMEOUT": f"it reached its time limit, slurm.time={slurm.time}; add --set slurm.time=HH:MM:SS for more",
        "OUT_OF_MEMORY": (
            f"a process on a node passed the job's host memory limit (slurm.mem={slurm.mem or 'unset: the partition default'}); "
            "add --set slurm.mem=<more>, or slurm.mem=0 for all of each node's memory"
        ),
        "NODE_FAIL": "a node failed; add --set slurm.nodes=N to go on with the nodes left",
        "PREEMPTED": "the scheduler preempted it",
        "CANCELLED": "it was cancelled (scancel)",
        "FAILED": f"slurm-grpo logs {q(job_dir)} shows the first error",
    }[word]
    done = complete_checkpoints(job_dir / "checkpoints")
    if not done:
        return (
            f"next: nothing to resume ({why}; no complete checkpoint was written): "
            f"slurm-grpo submit {q(job_dir / 'config.yaml')} --set job.job_dir= starts it again in a new folder"
        )
    return f"next: slurm-grpo resume {q(job_dir)}   (continues from step {done[-1][0]}; {why})"


def status(job_dir: Path) -> str:
    from launcher.core.plan import Plan
    from launcher.sweep import is_sweep, sweep_status

    if is_sweep(job_dir):  # found by the array's job id
        return sweep_status(job_dir)
    lines = [f"job folder: {q(job_dir)}"]
    plan = Plan.load(job_dir / "plan.json")
    jid = (job_dir / "job_id").read_text().strip() if (job_dir / "job_id").is_file() else None
    if jid:
        lines.append(f"SLURM job {jid}:")
        states = slurm_state(jid) or [f"(sacct has no record of job {jid}; is this the cluster it was submitted to?)"]
        lines += ["  " + ln.replace("|", "  ") for ln in states]
        main = next((ln.split("|") for ln in states if ln.split("|")[0] == jid), None)
        hint = next_step(job_dir, main[1], plan.config.slurm) if main and len(main) > 1 else None
        if hint:
            lines.append(hint)
    else:
        lines.append("local run (no SLURM job id)")
    for n in range(plan.num_nodes):
        ev = read_jsonl(job_dir / "logs" / f"node{n}-events.jsonl")
        names = [e["event"] for e in ev]
        host = next((e.get("host") for e in ev if e["event"] == "bootstrap_start"), "?")
        health = next(
            (f"healthy after {e['seconds']:.0f} s" for e in reversed(ev) if e["event"] == "vllm_healthy"), "not healthy yet"
        )
        if "vllm_exit" in names or "failed" in names:
            health += "; " + next(
                e.get("error", f"vllm exited {e.get('code')}") for e in reversed(ev) if e["event"] in ("failed", "vllm_exit")
            )
        lines.append(f"node {n} ({host}): vLLM {health}; last event: {names[-1] if names else 'none'}")
        phases = startup_phases(job_dir, n)
        if phases:
            lines.append("  start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    rows = read_jsonl(job_dir / "metrics.jsonl")
    if rows:
        lines.append("last metrics: " + json.dumps(rows[-1]))
    lines.append("summary: " + format_summary(summarize(rows)))
    return "\n".join(lines)


def log_files(job_dir: Path, node: int | None) -> list[Path]:
    """The job's own logs (every node's, or one node's) and SLURM's output of each node's task (submitit writes
    <job>_<task>_log.out, a task per node; a sweep point's are in the sweep folder, as <array>_<point>_<task>)."""
    from launcher.core.plan import Plan

    if (job_dir / "sweep.json").is_file():
        raise ConfigError(f"{q(job_dir)} is a sweep; pass one of its points, e.g. {q(job_dir / 'point-000')}")
    nodes = Plan.load(job_dir / "plan.json").num_nodes
    if node is not None and not 0 <= node < nodes:
        raise ConfigError(f"--node {node}: the job has nodes 0 to {nodes - 1}")
    files = sorted((job_dir / "logs").glob("node*-*.log"))
    if node is not None:
        files = [f for f in files if f.name.startswith(f"node{node}-")]
    task = "*" if node is None else str(node)
    jid = (job_dir / "job_id").read_text().strip() if (job_dir / "job_id").is_file() else ""
    if "_" in jid and (job_dir.parent / "sweep.json").is_file():  # a sweep point: its array task's output
        return files + sorted((job_dir.parent / "submitit").glob(f"{jid}_{task}_log.out"))
    return files + sorted((job_dir / "submitit").glob(f"*/*_{task}_log.out"))


def cancel(job_dir: Path) -> str:
    """scancel the job's newest submission (a sweep folder: the whole array; a sweep point: its task)."""
    jf = job_dir / "job_id"
    if not jf.is_file():
        raise ConfigError(f"{q(job_dir)} has no job_id (a local run); stop it with Ctrl-C")
    jid = jf.read_text().strip()
    try:
        out = subprocess.run(["scancel", jid], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"scancel {jid} could not run ({e}); cancel it on a host with SLURM's commands") from None
    if out.returncode != 0:
        raise RuntimeError(f"scancel {jid} failed: {out.stderr.strip()}")
    return f"cancelled job {jid}; `slurm-grpo status {q(job_dir)}` shows it CANCELLED once SLURM has stopped it"
