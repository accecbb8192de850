"""Start-up of a 2-node job on the test cluster, first start and restart (`slurm-grpo resume` of the same job folder),
node by node:

    python -m bench.startup_cluster --cluster-env /tmp/slurm-grpo-cluster/env.sh [--steps 3] [--more 2]
                                    [--out bench/results/<date>-startup-cluster/results.json] [--set key=value ...]

Builds the tiny model, submits configs/cluster_cpu.yaml (2 nodes x (vLLM CPU + 2 ranks)) for --steps steps with a
checkpoint at the end, then resumes the same folder for --more steps: a new SLURM job that finds the checkpoint and
the compile caches in the job folder (JOB/cache/node<i>), on whichever host SLURM gives each node this time. Prints
each node's phases (launcher.status.startup_phases), submit -> bootstrap (the queue and sbatch), what vLLM did with
its compile cache (its log: the paths it named, whether they lie in the job folder, loaded or compiled again), the
cache folder's files before and after, the `starting:` lines `slurm-grpo status` showed while it started (sampled
with launcher.status.startup_now, the function behind them) and `slurm-grpo status` after each job.
The CPU build runs vLLM eagerly unless vllm.extra_args decide the compilation (launcher.core.vllm_start.CPU_EAGER):
--set 'vllm.extra_args=[-O2]' (vLLM's default level) measures the compile and its caches as the 2026-12-04 results did.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import cluster_env, write_results
from bench.startup import compile_cache_use, compile_notes, this_start
from launcher.cli import cli_argv
from launcher.core.jobdir import JobDir
from launcher.core.records import Event, read_events
from launcher.status import startup_now, startup_phases

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CONFIG = "configs/cluster_cpu.yaml"
NODES = 2
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def say(msg: str) -> None:
    print(f"[startup-cluster {time.strftime('%T')}] {msg}", flush=True)


def job_id_of(out: str) -> str:
    """The SLURM job id `slurm-grpo submit` ("submitted job N") or `slurm-grpo resume` ("... as job N") printed."""
    m = re.search(r"(?:submitted job|as job) (\d+)\b", out)
    if not m:
        raise RuntimeError(f"no job id in the command's output:\n{out}")
    return m.group(1)


def sacct_state(jid: str, env: dict[str, str]) -> str:
    r = subprocess.run(["sacct", "-j", jid, "-X", "-n", "-P", "-o", "State"], env=env, capture_output=True, text=True, timeout=60)
    return r.stdout.strip().split("\n")[0] if r.stdout.strip() else ""


def cache_files(job: Path, node: int) -> dict:
    """The node's compile-cache folder in the job folder: how many files, how many bytes, the newest write."""
    files = [f for f in JobDir(job).compile_cache(node).rglob("*") if f.is_file()]
    return {
        "files": len(files),
        "mb": round(sum(f.stat().st_size for f in files) / 1e6, 1),
        "newest": max((f.stat().st_mtime for f in files), default=0.0),
    }


def after_last_healthy(job: Path, nodes: int = NODES, attempt: int = -1) -> dict[int, float]:
    """Seconds from the last node's vLLM healthy to each node's step 1, in one attempt (the events between two
    bootstrap starts; -1: the latest). Step 1 is collective across the nodes (FSDP over all ranks), so a node whose
    server was healthy first waits for the slowest node's: this, not its own `vLLM healthy -> step 1`, is what the
    job spends after vLLM is up. {} when a node has no healthy server or no step 1 in that attempt."""
    healthy: dict[int, float] = {}
    first: dict[int, float] = {}
    for n in range(nodes):
        ev = read_events(JobDir(job).events(n))
        starts = [i for i, e in enumerate(ev) if e.event == Event.BOOTSTRAP_START]
        if not starts or not -len(starts) <= attempt < len(starts):
            return {}
        i = starts[attempt]
        end = next((j for j in starts if j > i), len(ev))
        t = {e.event: e.t for e in reversed(ev[i:end])}  # the first of each event in the attempt
        if Event.VLLM_HEALTHY not in t or Event.FIRST_STEP not in t:
            return {}
        healthy[n], first[n] = t[Event.VLLM_HEALTHY], t[Event.FIRST_STEP]
    last = max(healthy.values())
    return {n: round(first[n] - last, 2) for n in range(nodes)}


def run_job(argv: list[str], job: Path, env: dict[str, str], timeout: float) -> dict:
    """Run `slurm-grpo submit` or `resume`, follow the job until it ends (sampling the nodes' start-up as `status`
    shows it), and return its phases and compile-cache use per node."""
    t0 = time.time()
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    jid = job_id_of(r.stdout)
    say(f"job {jid} submitted; following it (deadline {timeout:.0f} s)")
    seen: list[str] = []  # the distinct start-up lines `slurm-grpo status` would have shown, in order
    shown: list[str] = []  # the same, each with its time since the submit
    state, deadline = "", t0 + timeout
    while True:
        for n in range(NODES):
            now = startup_now(job, n)
            line = f"node {n}: " + re.sub(r"starting \(\d+ s\)", "starting", now) if now else ""
            if line and line not in seen:
                seen.append(line)
                shown.append(f"+{time.time() - t0:.0f} s {line}")
                say(line)
        state = sacct_state(jid, env)
        if state.split()[:1] and state.split()[0] in ENDED:
            break
        if time.time() > deadline:
            subprocess.run(["scancel", jid], env=env, capture_output=True, timeout=60)
            raise SystemExit(
                f"job {jid} did not end within {timeout:.0f} s (last state {state or 'none'}); cancelled; see {job}/logs"
            )
        time.sleep(2)
    wall = time.time() - t0
    if not state.startswith("COMPLETED"):
        raise SystemExit(f"job {jid} ended {state}; see {job}/logs and `slurm-grpo logs {job}`")
    status = subprocess.run(
        [PY, "-m", "launcher", "status", str(job)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    nodes = {}
    last = after_last_healthy(job)
    for n in range(NODES):
        ev = read_events(JobDir(job).events(n))
        boot = [e for e in ev if e.event == Event.BOOTSTRAP_START]
        log = JobDir(job).log(n, "vllm")
        nodes[n] = {
            "host": boot[-1].host if boot else "?",
            "submit -> bootstrap start": round(boot[-1].t - t0, 2) if boot else None,
            "phases_s": startup_phases(job, n),
            "last vLLM healthy -> step 1": last.get(n),
            "compile": compile_notes(log),
            "cache": compile_cache_use(this_start(log), job),
            "cache_folder": cache_files(job, n),
        }
    return {
        "job_id": jid,
        "state": state,
        "wall_s": round(wall, 1),
        "t0": t0,
        "status_while_starting": shown,
        "status": status.stdout,
        "nodes": nodes,
    }


def versions() -> dict[str, str]:
    """torch, vLLM and TRL as this venv has them (vLLM's CPU build carries no package metadata: ask the modules)."""
    code = "import json, torch, vllm, trl; print(json.dumps({m.__name__: m.__version__ for m in (torch, vllm, trl)}))"
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300)
    return json.loads(r.stdout.splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {"error": r.stderr[-300:]}


def engine_init(notes: list[str]) -> float | None:
    """vLLM's engine init (profile, KV cache, warm-up: the compile or the cache load inside) from its compile lines."""
    m = next((re.search(r"took ([0-9.]+) s", x) for x in notes if x.startswith("init engine")), None)
    return float(m.group(1)) if m else None


def table(runs: list[tuple[str, dict]]) -> str:
    """The runs side by side (first start, restart, ...), one row per node and phase; - where a run lacks a figure."""
    keys: list[str] = ["submit -> bootstrap start"]
    for n in range(NODES):
        for _, run in runs:
            keys += [k for k in run["nodes"][n]["phases_s"] if k not in keys]
    keys.append("last vLLM healthy -> step 1")

    def cell(x: object) -> str:
        return "-" if x is None else str(x)

    lines = ["| node | phase | " + " | ".join(f"{name} (s)" for name, _ in runs) + " |", "|---|---|" + "---|" * len(runs)]
    for n in range(NODES):
        nodes = [run["nodes"][n] for _, run in runs]
        rows = [("host", [x["host"] for x in nodes])]
        rows += [(k, [cell(x[k] if k in x else x["phases_s"].get(k)) for x in nodes]) for k in keys]
        rows.append(("vLLM engine init (from its log)", [cell(engine_init(x.get("compile", []))) for x in nodes]))
        rows.append(("vLLM compiled graph", [x["cache"]["aot"] for x in nodes]))
        rows.append(("cache paths in the job folder", [str(x["cache"]["in_job_folder"]) for x in nodes]))
        if all("cache_folder" in x for x in nodes):
            files = [f"{x['cache_folder']['files']}, {x['cache_folder']['mb']}" for x in nodes]
            rows.append(("cache folder after the job (files, MB)", files))
        lines += [f"| {n} | {what} | " + " | ".join(cells) + " |" for what, cells in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster-env", required=True, help="the test cluster's env.sh (scripts/start_cluster.sh writes it)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=2, help="steps the restart adds")
    ap.add_argument(
        "--cold", action="store_true", help="then a third job: resume again with the job folder's compile caches removed"
    )
    ap.add_argument("--timeout", type=float, default=1200, help="seconds each job may take, queue included")
    ap.add_argument("--out", default="")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    env = cluster_env(a.cluster_env)
    work = Path(tempfile.mkdtemp(prefix="startup-cluster-", dir="/tmp"))  # /tmp: the cluster's nodes see it
    model, job = work / "model", work / "job"
    subprocess.run([PY, "-m", "launcher", "make-tiny-model", str(model)], check=True, cwd=REPO, capture_output=True, timeout=300)
    sets = [f"vllm.model={model}", f"job.python={PY}", f"trainer.dataset={REPO}/data/letters.jsonl", *a.sets]
    steps = [f"trainer.max_steps={a.steps}", f"trainer.save_steps={a.steps}"]
    say(f"first start: {CONFIG}, {a.steps} steps, checkpoint at {a.steps}; job folder {job}")
    first = run_job(cli_argv(PY, "submit", CONFIG, f"job.job_dir={job}", *sets, *steps), job, env, a.timeout)
    print(first["status"], flush=True)
    total = a.steps + a.more
    say(f"restart: slurm-grpo resume {job} to step {total}")
    more = [f"trainer.max_steps={total}", f"trainer.save_steps={total}"]
    again = run_job(cli_argv(PY, "resume", str(job), *more), job, env, a.timeout)
    print(again["status"], flush=True)
    for n in range(NODES):
        c = again["nodes"][n]["cache_folder"]
        c["written_by_restart"] = c["newest"] >= again["t0"]
    runs = [("first start", first), ("restart", again)]
    if a.cold:
        total += a.more
        say(f"restart without the compile caches: removing {job}/cache/node*, then slurm-grpo resume {job} to step {total}")
        for n in range(NODES):
            shutil.rmtree(JobDir(job).compile_cache(n), ignore_errors=True)
        more = [f"trainer.max_steps={total}", f"trainer.save_steps={total}"]
        runs.append(("restart, caches removed", run_job(cli_argv(PY, "resume", str(job), *more), job, env, a.timeout)))
        print(runs[-1][1]["status"], flush=True)
    print(table(runs), flush=True)
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    slurm = subprocess.run(["sinfo", "--version"], env=env, capture_output=True, text=True, timeout=60)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git.stdout.strip(),
        "config": CONFIG,
        "sets": a.sets,
        "steps": a.steps,
        "more": a.more,
        "host": platform.node(),
        "python": platform.python_version(),
        "versions": versions() | {"slurm": slurm.stdout.strip()},
        "job": str(job),
        "first_start": first,
        "restart": again,
        "restart_caches_removed": runs[2][1] if a.cold else None,
    }
    write_results(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
