"""Start-up of a 2-node job on the local SLURM test cluster with and without slurm.stage_env: this project's whole
venv (torch, vLLM CPU, TRL) packed into one tar, sbcast to the nodes and unpacked there, against the venv where it is.
Run under the shared lock with the cluster up (scripts/start_cluster.sh 2 3 --cpus 4 --mem 12000 --base
/tmp/slurm-grpo-cluster):

    flock /tmp/sg-heavy.lock python -m bench.stage_env --out bench/results/2026-12-04-stage-env [--runs 1]

Per job, from the events and metrics the job writes (all on this machine's clock): job start (SLURM's StartTime) ->
each node's bootstrap start (the batch script's setup, with staging, and srun) -> vLLM healthy -> trainer started ->
first training step written. The nodes share this machine's disk, so "shared" here is a local disk without
contention: what staging costs, not what it saves (launcher/startup.py models that at 64-256 nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = str(REPO / ".venv" / "bin" / "python")


def cluster_env(path: str = "/tmp/slurm-grpo-cluster/env.sh") -> dict[str, str]:
    env = dict(os.environ)
    for line in Path(path).read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip("'")
    return env


def submit(env: dict, job: Path, model: str, *sets: str) -> str:
    argv = [PY, "-m", "launcher", "submit", "configs/cluster_cpu.yaml", "--set", f"vllm.model={model}"]
    for s in (
        f"job.job_dir={job}",
        f"trainer.dataset={REPO}/data/letters.jsonl",
        "trainer.max_steps=2",
        "trainer.save_steps=0",
        *sets,
    ):
        argv += ["--set", s]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    m = re.search(r"submitted job (\d+)", r.stdout)
    if not m:
        sys.exit(f"submit failed:\n{r.stdout}\n{r.stderr}")
    return m.group(1)


def job_state(env: dict, job_id: str) -> tuple[str, float]:
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,Start"],
        capture_output=True,
        text=True,
        env={**env, "SLURM_TIME_FORMAT": "%s"},
        timeout=30,
    ).stdout.split("\n")[0]
    state, _, start = out.partition("|")
    return state.strip(), float(start) if start.strip().isdigit() else 0.0


def figures(job: Path, start: float) -> dict[str, float]:
    ev = [json.loads(x) for n in (0, 1) for x in (job / "logs" / f"node{n}-events.jsonl").read_text().splitlines()]
    first = {e: min(x["t"] for x in ev if x["event"] == e) for e in ("bootstrap_start", "vllm_healthy", "trainer_start")}
    last = {e: max(x["t"] for x in ev if x["event"] == e) for e in ("bootstrap_start", "vllm_healthy", "trainer_start")}
    rows = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    step1 = min(r["time"] for r in rows if r.get("step") == 1 and "reward" in r)
    said = "".join(f.read_text(errors="replace") for f in (job / "submitit").rglob("*.out"))
    m = re.search(r"staged in \S+ on \d+ node\(s\), (\d+) s into the job", said)
    return {
        "staged_s_into_job": float(m.group(1)) if m else 0.0,
        "to_bootstrap_s": round(last["bootstrap_start"] - start, 1),
        "to_vllm_healthy_s": round(last["vllm_healthy"] - start, 1),
        "to_trainer_start_s": round(last["trainer_start"] - start, 1),
        "to_first_step_s": round(step1 - start, 1),
        "bootstrap_spread_s": round(last["bootstrap_start"] - first["bootstrap_start"], 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--work", default="/tmp/sg-stage-bench")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = cluster_env()
    model = work / "model"
    if not model.exists():
        subprocess.run([PY, "-m", "launcher", "make-tiny-model", str(model)], check=True, cwd=REPO, capture_output=True)
    packed = work / "env.tar"
    pack_s = None  # None: packed by an earlier run
    if not packed.exists():
        t0 = time.time()
        subprocess.run(["tar", "-cf", str(packed), "-C", str(REPO / ".venv"), "."], check=True)
        pack_s = round(time.time() - t0, 1)
    size_gb = packed.stat().st_size / 1e9
    results: dict = {"env_tar_gb": round(size_gb, 2), "pack_s": pack_s, "runs": []}
    for i in range(a.runs):
        for mode, sets in (("shared", [f"job.python={PY}"]), ("staged", ["job.python=python", f"slurm.stage_env={packed}"])):
            job = work / f"job-{mode}-{i}"
            subprocess.run(["rm", "-rf", str(job)], check=True)
            job_id = submit(env, job, str(model), *sets)
            deadline = time.time() + 900
            while True:
                state, start = job_state(env, job_id)
                if state and state not in ("PENDING", "RUNNING", "REQUEUED"):
                    break
                if time.time() > deadline:
                    subprocess.run(["scancel", job_id], env=env)
                    sys.exit(f"job {job_id} ({mode}) did not end in 900 s")
                time.sleep(2)
            if state != "COMPLETED":
                sys.exit(f"job {job_id} ({mode}) ended {state}; see {job}/submitit")
            row = {"mode": mode, "job_id": job_id, **figures(job, start)}
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
