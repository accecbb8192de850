"""Job commands on an existing job folder: status, logs, cancel; and the run summary they print."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from launcher.core.config import ConfigError
from launcher.core.jobdir import JobDir
from launcher.core.records import (
    Event,
    FinalRow,
    eval_rows,
    format_eval,
    format_final,
    format_step,
    format_summary,
    read_events,
    read_rows,
    step_rows,
    summarize,
)


def q(path: str | Path) -> str:
    """A path as the user may paste it into a shell: quoted when it holds anything the shell would interpret
    (a job folder named `it's $(touch x) one` must not run the `$()`)."""
    return shlex.quote(str(path))


JOB_ID_RE = re.compile(r"\d+(_\d+)?")
"""A SLURM job id, or an array task's (4242_3: point 3 of a sweep)."""


def find_job_dir(ref: str, root: str = "runs") -> Path:
    """A job folder (or a sweep's), or a SLURM job id looked up in the job_id files under root: runs/*/job_id (a
    job's newest submission, a sweep's array) and runs/*/point-*/job_id (a sweep point's array task)."""
    p = JobDir(Path(ref))
    if p.plan.is_file() or p.is_sweep():
        return p.root
    if JOB_ID_RE.fullmatch(ref):
        folders = [JobDir(d) for d in [*Path(root).glob("*"), *Path(root).glob("*/point-*")] if d.is_dir()]
        for d in sorted(folders, key=lambda d: d.job_id):
            if d.read_job_id() == ref:
                return d.root
        raise ConfigError(
            f"no job folder under {q(Path(root).absolute())}/ has job id {ref} (a resumed job has its newest id there); "
            f"pass the job folder instead"
        )
    raise ConfigError(f"{ref!r} is neither a job folder (with plan.json), a sweep folder (with sweep.json) nor a job id")


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
    ("server start", Event.VLLM_START, Event.VLLM_HEALTHY),
    ("trainer launch + rendezvous", Event.TRAINER_START, Event.RENDEZVOUS_DONE),
    ("model load + shard", Event.RENDEZVOUS_DONE, Event.MODEL_LOADED),
    ("trainer build + first step", Event.MODEL_LOADED, Event.FIRST_STEP),
)


def attempts(job_dir: Path, node: int) -> int:
    """How many times the node started (its bootstrap_start events: the first start, then each requeue or resume)."""
    return sum(e.event == Event.BOOTSTRAP_START for e in read_events(JobDir(job_dir).events(node)))


def startup_phases(job_dir: Path, node: int, attempt: int = -1) -> dict[str, float]:
    """Seconds of each start-up phase of one of the node's attempts (default the latest; 0 = the first start), from
    its events file (the bootstrap and the node's trainer leader both append to it), plus the total from bootstrap
    start to step 1."""
    ev = read_events(JobDir(job_dir).events(node))
    starts = [i for i, e in enumerate(ev) if e.event == Event.BOOTSTRAP_START]
    if starts and not -len(starts) <= attempt < len(starts):
        return {}
    t: dict[Event | str, float] = {}
    if starts:
        begin = starts[attempt]
        end = next((i for i in starts if i > begin), len(ev))
        for e in ev[begin:end]:
            t.setdefault(e.event, e.t)
    out = {name: round(t[b] - t[a], 2) for name, a, b in PHASES if a in t and b in t}
    if Event.BOOTSTRAP_START in t and Event.FIRST_STEP in t:
        out["total to step 1"] = round(t[Event.FIRST_STEP] - t[Event.BOOTSTRAP_START], 2)
    # the trainer starts beside the server (trainer.start_with_server): what it waited, and the step after health
    if Event.MODEL_LOADED in t and Event.VLLM_HEALTHY in t and t[Event.VLLM_HEALTHY] > t[Event.MODEL_LOADED]:
        out["trainer loaded, waiting for vLLM"] = round(t[Event.VLLM_HEALTHY] - t[Event.MODEL_LOADED], 2)
        if "trainer build + first step" in out:  # that span now holds the wait too: say so
            out = {("trainer build + wait + first step" if k == "trainer build + first step" else k): v for k, v in out.items()}
    if Event.VLLM_HEALTHY in t and Event.FIRST_STEP in t:
        out["vLLM healthy -> step 1"] = round(t[Event.FIRST_STEP] - t[Event.VLLM_HEALTHY], 2)
    return out


STARTUP_STEPS = (
    (Event.FIRST_STEP, "first step done"),
    (Event.MODEL_LOADED, "loaded and sharded"),
    (Event.RENDEZVOUS_DONE, "rendezvous done, loading"),
    (Event.TRAINER_START, "launched"),
)


def startup_now(job_dir: Path, node: int, now: float | None = None) -> str | None:
    """Where the node's latest attempt stands in its start-up: the server (starting for N s, or healthy) and the
    trainer (launched, rendezvous done, loaded, first step done), from the events the bootstrap and the trainer
    leader write; None once the first step is done or before the node started."""
    ev = read_events(JobDir(job_dir).events(node))
    starts = [i for i, e in enumerate(ev) if e.event == Event.BOOTSTRAP_START]
    if not starts:
        return None
    t: dict[Event | str, float] = {}
    for e in ev[starts[-1] :]:
        t.setdefault(e.event, e.t)
    if Event.FIRST_STEP in t or Event.BOOTSTRAP_END in t or Event.VLLM_START not in t:
        return None
    now = time.time() if now is None else now
    server = "healthy" if Event.VLLM_HEALTHY in t else f"starting ({now - t[Event.VLLM_START]:.0f} s)"
    trainer = next((what for event, what in STARTUP_STEPS if event in t), "not launched yet")
    return f"vLLM {server}; trainer {trainer}"


def startup_lines(job_dir: Path, node: int) -> list[str]:
    """The node's start-up, for `status`: the job's phases (events) and vLLM's own (its log) of the first start and,
    after a requeue or resume, of the latest one, so the two starts can be compared."""
    from launcher import vllm_log

    n = attempts(job_dir, node)
    servers = vllm_log.node_starts(JobDir(job_dir).log(node, "vllm"))
    which = [(0, "first start")] + ([(-1, f"restart {n - 1}")] if n > 1 else [])
    out = []
    for attempt, name in which:
        phases = startup_phases(job_dir, node, attempt)
        if phases:
            out.append(f"  start-up, {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
        server = servers[attempt] if servers and (attempt == 0 or len(servers) > 1) else {}
        if server:
            out.append(f"  vLLM start, {name}: " + vllm_log.describe(server))
    return out


ENDED_RESUMABLE = ("NODE_FAIL", "TIMEOUT", "FAILED", "PREEMPTED", "OUT_OF_MEMORY", "CANCELLED")
"""sacct states after which `slurm-grpo resume` is the next step."""


QUEUED = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED")


def queued(job_id: str) -> bool:
    """Whether the controller still holds the job to run (squeue); True when it cannot tell."""
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if out.returncode != 0:
        return "Invalid job id" not in out.stderr  # purged from the controller: not queued
    return any(st in QUEUED for st in out.stdout.split())


def next_step(job_dir: Path, state: str, slurm: Any) -> str | None:
    """What to do after a job ended in `state` (sacct's State, e.g. "CANCELLED by 1000"): resume from the newest
    checkpoint, with the setting that ended it raised where one did (time, memory); submit again if nothing was
    checkpointed, since resume would refuse."""
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
    jd = JobDir(job_dir)
    done = jd.complete_checkpoints()
    if not done:
        return (
            f"next: nothing to resume ({why}; no complete checkpoint was written): "
            f"slurm-grpo submit {q(jd.config)} --set job.job_dir= starts it again in a new folder"
        )
    return f"next: slurm-grpo resume {q(job_dir)}   (continues from step {done[-1][0]}; {why})"


def status(job_dir: Path) -> str:
    from launcher.core.plan import Plan
    from launcher.sweep import sweep_status

    jd = JobDir(job_dir)
    if jd.is_sweep():  # found by the array's job id
        return sweep_status(job_dir)
    lines = [f"job folder: {q(job_dir)}"]
    plan = Plan.load(jd.plan)
    jid = jd.read_job_id()
    failed = submit_failure(jd)
    if failed and not jid and not failed["maybe_queued"]:  # no job exists: nothing below would mean anything
        return "\n".join([*lines, f"never submitted: sbatch failed ({failed['reason']}); {failed['fix']}"])
    if failed:
        before = f" (job {jid} below is the one before it)" if jid else ""
        lines.append(f"the newest submit failed{before}: {failed['reason']}; {failed['fix']}")
    if jid:
        lines.append(f"SLURM job {jid}:")
        states = slurm_state(jid) or [f"(sacct has no record of job {jid}; is this the cluster it was submitted to?)"]
        lines += ["  " + ln.replace("|", "  ") for ln in states]
        main = next((ln.split("|") for ln in states if ln.split("|")[0] == jid), None)
        state = main[1] if main and len(main) > 1 else ""
        if state == "REQUEUED" and not queued(jid):
            # requeued (by SLURM, or at once by a node's bootstrap after a node loss), then cancelled before it started
            # again: the accounting keeps only the requeued instance
            state = "CANCELLED after REQUEUED"
        hint = next_step(job_dir, state, plan.config.slurm) if state else None
        if hint:
            lines.append(hint)
    elif not failed:
        lines.append("local run (no SLURM job id)")
    for n in range(plan.num_nodes):
        ev = read_events(jd.events(n))
        names = [e.event for e in ev]
        host = next((e.host for e in ev if e.event == Event.BOOTSTRAP_START), None) or "?"
        health = next(
            (f"healthy after {e.seconds or 0:.0f} s" for e in reversed(ev) if e.event == Event.VLLM_HEALTHY), "not healthy yet"
        )
        ended = (Event.FAILED, Event.VLLM_EXIT)
        if any(name in ended for name in names):
            e = next(e for e in reversed(ev) if e.event in ended)
            health += "; " + (e.error if e.error is not None else f"vllm exited {e.code}")
        lines.append(f"node {n} ({host}): vLLM {health}; last event: {names[-1] if names else 'none'}")
        now = startup_now(job_dir, n)
        if now:
            lines.append("  starting: " + now)
        lines += startup_lines(job_dir, n)
    rows = read_rows(jd.metrics)
    steps = step_rows(rows)
    if steps:  # readable lines; the raw rows are in metrics.jsonl
        lines.append("last step: " + format_step(steps[-1]))
    if rows and isinstance(rows[-1], FinalRow):
        lines.append("end: " + format_final(rows[-1]))
    lines.append("summary: " + format_summary(summarize(rows)))
    evals = eval_rows(rows)
    if evals or plan.config.trainer.eval.enabled:
        lines.append("latest eval: " + format_eval(evals[-1] if evals else None))
    return "\n".join(lines)


def submit_failure(jd: JobDir) -> dict[str, Any] | None:
    """The folder's submit_failed.json (launcher.submit's record of an sbatch that gave no job id): reason, fix,
    maybe_queued; None when the newest submit went through (or none was made)."""
    try:
        return dict(json.loads(jd.submit_failed.read_text()))
    except (OSError, ValueError):
        return None


def log_files(job_dir: Path, node: int | None) -> list[Path]:
    """The job's own logs (every node's, or one node's) and SLURM's output of each node's task (submitit writes
    <job>_<task>_log.out, a task per node; a sweep point's are in the sweep folder, as <array>_<point>_<task>)."""
    from launcher.core.plan import Plan

    jd = JobDir(job_dir)
    if jd.is_sweep():
        raise ConfigError(f"{q(job_dir)} is a sweep; pass one of its points, e.g. {q(jd.point(0).root)}")
    nodes = Plan.load(jd.plan).num_nodes
    if node is not None and not 0 <= node < nodes:
        raise ConfigError(f"--node {node}: the job has nodes 0 to {nodes - 1}")
    files = jd.node_logs(node)
    task = "*" if node is None else str(node)
    jid = jd.read_job_id() or ""
    sweep = JobDir(job_dir.parent)
    if "_" in jid and sweep.is_sweep():  # a sweep point: its array task's output
        return files + sweep.array_task_logs(jid, task)
    return files + jd.task_logs(task)


def cancel(job_dir: Path) -> str:
    """scancel the job's newest submission (a sweep folder: the whole array; a sweep point: its task)."""
    jid = JobDir(job_dir).read_job_id()
    if jid is None:
        raise ConfigError(f"{q(job_dir)} has no job_id (a local run); stop it with Ctrl-C")
    try:
        out = subprocess.run(["scancel", jid], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"scancel {jid} could not run ({e}); cancel it on a host with SLURM's commands") from None
    if out.returncode != 0:
        raise RuntimeError(f"scancel {jid} failed: {out.stderr.strip()}")
    return f"cancelled job {jid}; `slurm-grpo status {q(job_dir)}` shows it CANCELLED once SLURM has stopped it"
