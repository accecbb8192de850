"""A whole node lost mid-run on the test cluster (issue 33, item 2f): how soon the surviving nodes name it, how soon
every process of the job is gone from them, and what SLURM makes of the job:

    bash scripts/start_cluster.sh 3 3 --cpus 4 --mem 12000 --base /tmp/slurm-grpo-cluster
    flock /tmp/heavy.lock python -m bench.node_loss_cluster --cluster-env /tmp/slurm-grpo-cluster/env.sh \\
        [--nodes 3] [--node-timeout 20] [--kill-node 1] [--after-step 2] [--resume-wait 300] \\
        [--out bench/results/<date>-node-loss-cluster/results.json] [--set key=value ...]
    bash scripts/stop_cluster.sh --base /tmp/slurm-grpo-cluster

Submits configs/cluster_cpu.yaml on --nodes nodes (each: vLLM CPU + 2 ranks) with job.node_timeout_s=--node-timeout,
waits for step --after-step, then powers job node --kill-node off: SIGKILL, all at once, to every process of its
emulated host (its UTS namespace: slurmd, slurmstepd, the bootstrap, vLLM, torchrun, the ranks), as the cluster tier's
lost-node test does. From then on it scans /proc every --poll seconds and reads, per surviving node, relative to the
kill:
  - named: the node's `failed` event (launcher.node.bootstrap) and its message (it must name the lost node);
  - the bootstrap's own stop: its trainer_exit / bootstrap_end events;
  - gone: when the last process of each kind on that node was gone: ours (bootstrap, vLLM with its engine core,
    torchrun, the ranks, anything else under the bootstrap) and SLURM's (slurmstepd, the batch script, srun),
    found by the job id (SLURM_JOB_ID in their environment; slurmstepd by its title) and placed on a node by their
    UTS namespace (the nodes share this machine's process table);
  - SLURM's view: the job's state (squeue, then sacct with every requeued instance), its controller record
    (scontrol show job: state, reason, restarts, excluded nodes, node list, begin time) and the killed node's state
    (sinfo), each change with its time, and slurmctld's log lines about the job and the node;
  - what the surviving node that asks SLURM asked (its slurm_asked event: launcher.node.lost).
Only the processes the job had at the kill are counted: a requeued copy keeps the job id. If the requeued copy starts
(a 2-node job on the 3-node cluster: on the two nodes left), the bench waits --resume-wait seconds for it to resume
from its checkpoint and train one step (its `resumed` row), and records where and when. Then it cancels the job,
and puts the node back (start_cluster.sh --restart-node) so the cluster is whole again.
The target (issue 33): every process of the job gone within job.node_timeout_s + 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.run import cluster_env, write_results
from launcher.cli import cli_argv
from launcher.core.jobdir import JobDir
from launcher.core.records import Event, NodeEvent, read_events, read_jsonl

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIG = "configs/cluster_cpu.yaml"
OURS = ("bootstrap", "vllm", "torchrun", "rank", "under the bootstrap")
SLURMS = ("slurmstepd", "batch script", "srun", "other")
RUNNING = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING")


def say(msg: str) -> None:
    print(f"[node-loss {time.strftime('%T')}] {msg}", flush=True)


def run(argv: list[str], env: dict[str, str], timeout: float = 60) -> str:
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return ""


@dataclass(frozen=True)
class JobProc:
    pid: int
    host: str
    """The emulated node (n1, n2, ...) whose UTS namespace holds it; 'host' for this machine's own."""
    kind: str
    cmd: str


def uts_namespaces(base: Path) -> dict[str, str]:
    """Every node's UTS namespace (start_cluster.sh records it in nodes/<node>/utsns) -> the node's name."""
    return {(d / "utsns").read_text().strip(): d.name for d in (base / "nodes").iterdir() if (d / "utsns").is_file()}


def proc_table() -> dict[int, tuple[int, str, str, bytes]]:
    """pid -> (parent pid, UTS namespace, command line, environment) of every process that can be read."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if stat[stat.rindex(")") + 2] in "ZX":  # dead, not yet reaped: gone
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(d.name)] = (ppid, os.readlink(d / "ns" / "uts"), cmd, (d / "environ").read_bytes())
        except (OSError, ValueError):
            continue
    return out


def kind_of(cmd: str, under_bootstrap: bool) -> str:
    """What a process of the job is, from its command line (SLURM's first: srun's names the bootstrap it starts)."""
    argv0 = Path(cmd.split(" ", 1)[0]).name
    if cmd.startswith("slurmstepd"):
        return "slurmstepd"
    if argv0 == "srun":
        return "srun"
    if "slurm_script" in cmd:
        return "batch script"
    if "launcher.node.bootstrap" in cmd:
        return "bootstrap"
    if "torch.distributed.run" in cmd:
        return "torchrun"
    if "trainer.main" in cmd:
        return "rank"
    if "vllm" in cmd.lower():  # the API server (vllm.entrypoints) and its engine core (title VLLM::EngineCore)
        return "vllm"
    if under_bootstrap:
        return "under the bootstrap"
    return "other"


def job_processes(job_id: str, namespaces: dict[str, str]) -> list[JobProc]:
    """Every live process of the job on any node: those whose environment carries SLURM_JOB_ID=<job_id> and the
    job's slurmstepd (its title names the job: `slurmstepd: [<job_id>.<step>]`)."""
    table = proc_table()
    mark, title = f"SLURM_JOB_ID={job_id}".encode(), f"[{job_id}."
    ours = {pid for pid, (_, _, cmd, environ) in table.items() if mark in environ.split(b"\0") or title in cmd}
    boots = {pid for pid in ours if "launcher.node.bootstrap" in table[pid][2]}

    def under(pid: int) -> bool:
        seen = 0
        while pid in table and seen < 64:
            pid, seen = table[pid][0], seen + 1
            if pid in boots:
                return True
        return False

    return [
        JobProc(pid, namespaces.get(table[pid][1], "host"), kind_of(table[pid][2], under(pid)), table[pid][2][:160])
        for pid in sorted(ours)
    ]


def kill_host(base: Path, host: str) -> list[str]:
    """Power loss of one emulated node: SIGKILL every process of its UTS namespace at once."""
    uts = (base / "nodes" / host / "utsns").read_text().strip()
    victims = [(pid, row[2][:80]) for pid, row in proc_table().items() if row[1] == uts]
    for pid, _ in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [cmd for _, cmd in victims]


def steps_done(job: Path) -> int:
    return max((x["step"] for x in read_jsonl(JobDir(job).metrics) if "reward" in x), default=0)


def node_hosts(job: Path, nodes: int) -> dict[int, str]:
    """Job node index -> the emulated host its bootstrap started on (its bootstrap_start event)."""
    out = {}
    for n in range(nodes):
        boot = [e for e in read_events(JobDir(job).events(n)) if e.event == Event.BOOTSTRAP_START]
        if boot and boot[-1].host:
            out[n] = boot[-1].host
    return out


def job_state(job_id: str, env: dict[str, str]) -> str:
    """The controller's state of the job (squeue), else the accounting's (sacct), else ''."""
    st = run(["squeue", "-h", "-j", job_id, "-o", "%T"], env, 30).strip()
    if st:
        return st.splitlines()[0]
    st = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], env, 30).strip()
    return st.splitlines()[-1] if st else ""


RECORD = ("JobState", "Reason", "Restarts", "ExcNodeList", "NodeList", "BeginTime")
"""What the bench follows of the controller's record of the job (scontrol show job)."""


def job_record(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = run(["scontrol", "-o", "show", "job", job_id], env, 30)
    got = dict(re.findall(r"\b(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}
    return {k: got[k] for k in RECORD if k in got}


def node_state(host: str, env: dict[str, str]) -> str:
    return run(["sinfo", "-h", "-N", "-n", host, "-o", "%T"], env, 30).strip().split("\n")[0]


def bootstrap_lines(job: Path) -> dict[str, list[str]]:
    """The last lines each task's bootstrap (and srun) printed, from submitit's per-task output."""
    out: dict[str, list[str]] = {}
    for f in sorted(JobDir(job).submitit.rglob("*.out")):
        lines = [x for x in f.read_text(errors="replace").splitlines() if "[bootstrap node" in x or "srun:" in x]
        out[f.name] = lines[-12:]
    return out


def ctld_lines(base: Path, job_id: str, host: str, since: float) -> list[str]:
    """slurmctld's log lines (after the kill) about the job or the lost node."""
    log = base / "log" / "slurmctld.log"
    if not log.is_file():
        return []
    keep = []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 1))
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"\[(\S+?)(?:\.\d+)?\]", line)
        if m and m.group(1) >= stamp and (job_id in line or re.search(rf"\b{host}\b", line)):
            keep.append(line[:240])
    return keep[:60]


def watch(
    job: Path, job_id: str, env: dict[str, str], base: Path, hosts: dict[int, str], lost: int, t_kill: float, before: set[int], a
) -> dict:
    """From the kill on: per surviving node, when it named the loss and when each kind of the job's processes (those
    it had at the kill: `before`) was last there; the job's and the lost node's SLURM states. Until nothing of the
    job is left on the surviving nodes and SLURM no longer runs that instance, or --watch seconds."""
    namespaces = uts_namespaces(base)
    survivors = {n: h for n, h in hosts.items() if n != lost}
    seen: dict[tuple[str, str], float] = {}  # (host, kind) -> last scan that found one, seconds after the kill
    first_seen: dict[tuple[str, str], list[str]] = {}  # (host, kind) -> its command lines, as first found after the kill
    on_lost: list[str] = []  # processes of the job still found on the lost node (there must be none)
    job_states: list[tuple[float, str]] = []
    lost_states: list[tuple[float, str]] = []
    records: list[tuple[float, dict[str, str]]] = []
    last_slurm = 0.0
    while True:
        now = time.time() - t_kill
        for p in job_processes(job_id, namespaces):
            if p.pid not in before:  # a requeued copy of the job (same id) started on the nodes left
                continue
            if p.host == hosts[lost]:
                on_lost.append(f"+{now:.1f} s {p.kind} {p.pid} {p.cmd[:80]}")
            seen[(p.host, p.kind)] = now
            first_seen.setdefault((p.host, p.kind), []).append(f"{p.pid} {p.cmd[:100]}")
        if time.time() - last_slurm >= 1.0:
            last_slurm = time.time()
            for states, value in ((job_states, job_state(job_id, env)), (lost_states, node_state(hosts[lost], env))):
                if not states or states[-1][1] != value:
                    states.append((round(time.time() - t_kill, 1), value))
                    say(f"+{time.time() - t_kill:.1f} s {'job' if states is job_states else hosts[lost]}: {value}")
            follow_record(records, job_id, env, t_kill)
        left = [k for k, t in seen.items() if t == now and k[0] != hosts[lost]]
        # that instance is over once the job left RUNNING (requeued: pending or held) and is no longer COMPLETING
        slurm_done = any(st.split()[:1] != ["RUNNING"] for _, st in job_states) and "COMPLETING" not in job_states[-1][1]
        if (not left and slurm_done) or now > a.watch:
            break
        time.sleep(a.poll)
    nodes = {}
    for n, h in survivors.items():
        ev = [e for e in read_events(JobDir(job).events(n)) if e.t >= t_kill - 1]
        t: dict[str, NodeEvent] = {}
        for e in ev:
            t.setdefault(str(e.event), e)
        failed = t.get(str(Event.FAILED))
        gone = {kind: round(seen[(h, kind)] + a.poll, 1) for kind in OURS + SLURMS if (h, kind) in seen}
        ours = [v for k, v in gone.items() if k in OURS]
        slurm = [v for k, v in gone.items() if k in SLURMS]
        nodes[n] = {
            "host": h,
            "named_s": round(failed.t - t_kill, 1) if failed else None,
            "named": failed.error if failed else None,
            "names_lost_node": bool(failed and failed.error and f"node {lost} ({hosts[lost]})" in failed.error),
            "events_s": {k: round(e.t - t_kill, 1) for k, e in t.items()},
            "gone_s": gone,
            "ours_gone_s": max(ours) if ours else 0.0,
            "slurm_gone_s": max(slurm) if slurm else 0.0,
            "processes": {k[1]: v[:3] for k, v in first_seen.items() if k[0] == h},
        }
    asked = [
        {"node": n, "t_s": round(e.t - t_kill, 1), **e.extra}
        for n in survivors
        for e in read_events(JobDir(job).events(n))
        if e.event == Event.SLURM_ASKED and e.t >= t_kill - 1
    ]
    return {
        "nodes": nodes,
        "job_states": job_states,
        "job_records": records,
        "asked": asked,
        "lost_node_states": lost_states,
        "on_lost_node": on_lost[:10],
    }


def follow_record(records: list[tuple[float, dict[str, str]]], job_id: str, env: dict[str, str], t_kill: float) -> None:
    """Append the job's controller record when it changed (scontrol show job)."""
    rec = job_record(job_id, env)
    if rec and (not records or records[-1][1] != rec):
        records.append((round(time.time() - t_kill, 1), rec))
        say(f"+{time.time() - t_kill:.1f} s job record: {rec}")


def follow_requeue(job: Path, job_id: str, env: dict[str, str], t_kill: float, records: list, wait_s: float) -> dict:
    """After the lost instance is over: does the requeued copy start (on which nodes), resume from its checkpoint and
    train a step? Up to wait_s seconds after the kill."""
    out: dict = {"started_s": None, "nodes": None, "resumed_s": None, "resumed_from_step": None, "first_step_s": None}
    while time.time() - t_kill < wait_s:
        follow_record(records, job_id, env, t_kill)
        rec = records[-1][1] if records else {}
        if rec.get("JobState") == "RUNNING" and rec.get("Restarts", "0") != "0" and out["started_s"] is None:
            out["started_s"], out["nodes"] = round(time.time() - t_kill, 1), rec.get("NodeList")
        if rec.get("JobState") not in (None, "RUNNING", "PENDING", "REQUEUED", "REQUEUE_HOLD", "COMPLETING", "CONFIGURING"):
            break  # ended (or cancelled)
        if rec.get("JobState") == "PENDING" and rec.get("Reason") in ("ReqNodeNotAvail", "BadConstraints", "JobHeldUser"):
            if time.time() - t_kill > 120:  # it cannot start here (too few nodes left): nothing more to see
                break
        rows = read_jsonl(JobDir(job).metrics)
        res = [x for x in rows if x.get("event") == "resumed" and x.get("time", 0) > t_kill]
        if res and out["resumed_s"] is None:
            out["resumed_s"], out["resumed_from_step"] = round(res[-1]["time"] - t_kill, 1), res[-1].get("from_step")
        after = [x for x in rows if "reward" in x and res and x.get("time", 0) > res[-1]["time"]]
        if after:
            out["first_step_s"], out["first_step"] = round(after[0]["time"] - t_kill, 1), after[0]["step"]
            break
        time.sleep(1)
    out["hosts"] = sorted(
        {
            e.host
            for n in range(8)
            for e in read_events(JobDir(job).events(n))
            if e.event == Event.BOOTSTRAP_START and e.t > t_kill and e.host
        }
    )
    return out


def versions() -> dict[str, str]:
    code = "import json, torch, vllm, trl; print(json.dumps({m.__name__: m.__version__ for m in (torch, vllm, trl)}))"
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(r.stdout.splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {"error": r.stderr[-300:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster-env", required=True, help="the test cluster's env.sh (scripts/start_cluster.sh writes it)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--node-timeout", type=int, default=20, help="job.node_timeout_s")
    ap.add_argument("--kill-node", type=int, default=1, help="the job's node index to power off (0 holds the batch script)")
    ap.add_argument("--after-step", type=int, default=2, help="kill once this many steps are done")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds the job may take to reach --after-step")
    ap.add_argument("--watch", type=float, default=300, help="seconds to watch after the kill, at most")
    ap.add_argument("--resume-wait", type=float, default=300, help="seconds after the kill for the requeued copy to resume")
    ap.add_argument("--poll", type=float, default=0.25)
    ap.add_argument("--no-put-back", action="store_true", help="leave the killed node down")
    ap.add_argument("--out", default="")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    if not 0 <= a.kill_node < a.nodes:
        ap.error(f"--kill-node must be 0..{a.nodes - 1}")
    env = cluster_env(a.cluster_env)
    base = Path(env["SLC_BASE"])
    if int(env.get("SLC_NODES", "0")) < a.nodes:
        raise SystemExit(
            f"the cluster has {env.get('SLC_NODES')} nodes, the job needs {a.nodes}: start_cluster.sh {a.nodes} 3 ..."
        )
    work = Path(tempfile.mkdtemp(prefix="node-loss-cluster-", dir="/tmp"))  # /tmp: the cluster's nodes see it
    model, job = work / "model", work / "job"
    subprocess.run([PY, "-m", "launcher", "make-tiny-model", str(model)], check=True, cwd=REPO, capture_output=True, timeout=300)
    sets = [
        f"vllm.model={model}",
        f"job.python={PY}",
        f"job.job_dir={job}",
        f"trainer.dataset={REPO}/data/letters.jsonl",
        f"slurm.nodes={a.nodes}",
        f"job.node_timeout_s={a.node_timeout}",
        "trainer.max_steps=200",
        "trainer.save_steps=1",  # the requeued copy resumes from the last step's checkpoint
        "slurm.node_loss_action=requeue_now",  # what this bench measures (the default waits for SLURM's own requeue)
        *a.sets,
    ]
    t0 = time.time()
    r = subprocess.run(cli_argv(PY, "submit", CONFIG, *sets), cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    m = re.search(r"submitted job (\d+)", r.stdout)
    if r.returncode != 0 or not m:
        raise SystemExit(f"submit failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    job_id = m.group(1)
    say(f"job {job_id}: {CONFIG}, {a.nodes} nodes, job.node_timeout_s={a.node_timeout}; folder {job}")
    try:
        while steps_done(job) < a.after_step:
            st = job_state(job_id, env)
            if st and st.split()[0] not in RUNNING:
                raise SystemExit(f"job {job_id} ended {st} before step {a.after_step}; see {job}/logs")
            if time.time() - t0 > a.timeout:
                raise SystemExit(f"job {job_id} reached no step {a.after_step} in {a.timeout:.0f} s; see {job}/logs")
            time.sleep(1)
        hosts = node_hosts(job, a.nodes)
        if len(hosts) < a.nodes:
            raise SystemExit(f"not every node has a bootstrap_start event: {hosts}")
        lost = hosts[a.kill_node]
        say(f"step {steps_done(job)} done ({time.time() - t0:.0f} s after the submit); nodes {hosts}; killing {lost}")
        before = {p.pid for p in job_processes(job_id, uts_namespaces(base))}
        t_kill = time.time()
        killed = kill_host(base, lost)
        say(f"killed {len(killed)} processes on {lost} (slurmd: {any('slurmd' in c for c in killed)})")
        w = watch(job, job_id, env, base, hosts, a.kill_node, t_kill, before, a)
        w["requeued_copy"] = follow_requeue(job, job_id, env, t_kill, w["job_records"], a.resume_wait)
        before_cancel = job_state(job_id, env)
    finally:
        run(["scancel", job_id], env)  # a requeued job would wait for the lost node
    deadline = time.time() + 120
    while time.time() < deadline and job_state(job_id, env).split()[:1] in (["PENDING"], ["RUNNING"], ["COMPLETING"]):
        time.sleep(1)
    sacct = run(["sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o", "JobID,State,ExitCode,Start,End,NodeList"], env).strip()
    ctld = ctld_lines(base, job_id, lost, t_kill)
    said = bootstrap_lines(job)
    if not a.no_put_back:
        r = subprocess.run(
            ["bash", "scripts/start_cluster.sh", "--restart-node", lost, "--base", str(base)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        say(f"{lost} put back: rc={r.returncode} {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
    limit = a.node_timeout + 10
    print(
        f"\njob node {a.kill_node} ({lost}) killed after step {a.after_step}; job.node_timeout_s={a.node_timeout}, target {limit} s"
    )
    print(
        "| node (host) | named (s) | names the lost node | bootstrap_end (s) | ours gone (s) | per kind (s) | SLURM's gone (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, x in w["nodes"].items():
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(x["gone_s"].items(), key=lambda kv: kv[1]))
        print(
            f"| {n} ({x['host']}) | {x['named_s']} | {x['names_lost_node']} | {x['events_s'].get('bootstrap_end')} | "
            f"{x['ours_gone_s']} | {kinds} | {x['slurm_gone_s']} |"
        )
    for n, x in w["nodes"].items():
        print(f"node {n} named: {x['named']}")
    print(f"job states: {w['job_states']}; state before the bench's scancel: {before_cancel}")
    for t, rec in w["job_records"]:
        print(f"  +{t} s {rec}")
    for x in w["asked"]:
        print(f"node {x['node']} asked SLURM at +{x['t_s']} s ({x.get('action')}): " + "; ".join(
            f"{' '.join(c['argv'])} -> rc {c['code']} {c['stderr']}" for c in x.get("commands", [])))  # fmt: skip
    print(f"requeued copy: {w['requeued_copy']}")
    print(f"{lost} states: {w['lost_node_states']}")
    print(f"sacct (every instance):\n{sacct}")
    print("slurmctld:\n" + "\n".join(ctld[-25:]))
    ours = max((x["ours_gone_s"] for x in w["nodes"].values()), default=0.0)
    every = max((max(x["ours_gone_s"], x["slurm_gone_s"]) for x in w["nodes"].values()), default=0.0)
    print(f"last process of ours gone {ours} s, of the job (SLURM's too) {every} s after the kill; target {limit} s")
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git.stdout.strip(),
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": versions() | {"slurm": run(["sinfo", "--version"], env).strip()},
        "config": CONFIG,
        "sets": sets,
        "nodes": a.nodes,
        "node_timeout_s": a.node_timeout,
        "target_s": limit,
        "job_id": job_id,
        "job": str(job),
        "killed": {"node": a.kill_node, "host": lost, "after_step": a.after_step, "processes": killed},
        "hosts": hosts,
        "survivors": w["nodes"],
        "last_ours_gone_s": ours,
        "last_job_process_gone_s": every,
        "job_states": w["job_states"],
        "job_records": w["job_records"],
        "asked": w["asked"],
        "requeued_copy": w["requeued_copy"],
        "state_before_cancel": before_cancel,
        "lost_node_states": w["lost_node_states"],
        "on_lost_node_after_kill": w["on_lost_node"],
        "sacct": sacct.splitlines(),
        "slurmctld": ctld,
        "bootstrap_said": said,
    }
    write_results(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
