"""Cluster tier: `slurm-grpo submit` of a 2-node GRPO job on the real SLURM cluster that
scripts/start_cluster.sh starts (each node its own network namespace; fake GPUs as GRES).
Everything is asserted from the job's own outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import PY, REPO

pytestmark = pytest.mark.cluster
ENV_FILE = os.environ.get("SLURM_GRPO_CLUSTER_ENV", "/tmp/slurm-grpo-cluster/env.sh")


def cluster_env() -> dict:
    if not Path(ENV_FILE).is_file():
        pytest.fail(f"no test cluster: {ENV_FILE} missing; start it with scripts/start_cluster.sh 2 3 (scripts/test.sh does)")
    env = dict(os.environ)
    for line in Path(ENV_FILE).read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)", line)
        if m:
            env[m.group(1)] = m.group(2).strip("'")
    return env


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def sacct_state(job_id: str, env: dict) -> str:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True, env=env)
    return out.stdout.strip().split("\n")[0] if out.stdout.strip() else ""


def test_two_node_grpo_job(tmp_path, tiny_model):
    env = cluster_env()
    job = tmp_path / "cluster job"
    r = subprocess.run([PY, "-m", "launcher", "submit", "configs/cluster_cpu.yaml", "--set", f"vllm.model={tiny_model}",
                        "--set", f"job.job_dir={job}", "--set", f"job.python={PY}",
                        "--set", f"trainer.dataset={REPO}/data/letters.jsonl"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    job_id = re.search(r"submitted job (\d+)", r.stdout).group(1)

    # while both servers are up: a server bound to loopback on n1 is not reachable from n2 (dev routes stay private)
    deadline = time.time() + 600
    checked = False
    while time.time() < deadline:
        state = sacct_state(job_id, env)
        if state and state not in ("PENDING", "RUNNING", "REQUEUED"):
            break
        healthy = [any(e["event"] == "vllm_healthy" for e in read(job / "logs" / f"node{n}-events.jsonl")) for n in (0, 1)]
        if all(healthy) and not checked:
            probe = "import socket,sys\ntry:\n socket.create_connection(('10.200.0.11', 8000), timeout=3); print('OPEN')\nexcept OSError as e: print('CLOSED', e)"
            out = subprocess.run(["nsenter", "--net=/run/netns/slc-n2", PY, "-c", probe], capture_output=True, text=True)
            assert "CLOSED" in out.stdout, f"n1's vLLM server is reachable from n2: {out.stdout} {out.stderr}"
            checked = True
        time.sleep(2)
    logs = subprocess.run([PY, "-m", "launcher", "logs", str(job)], capture_output=True, text=True, cwd=REPO).stdout
    assert sacct_state(job_id, env) == "COMPLETED", f"job {job_id} ended {sacct_state(job_id, env)}\n{logs[-4000:]}"
    assert checked, "never saw both servers healthy"

    s = json.loads((job / "summary.json").read_text())
    hosts = {n: next(e["host"] for e in read(job / "logs" / f"node{n}-events.jsonl") if e["event"] == "bootstrap_start")
             for n in (0, 1)}
    assert hosts == {0: "n1", 1: "n2"}  # one bootstrap on each node
    assert s["allreduce_check"] == {"got": 10.0, "expected": 10.0}  # 4 ranks across 2 nodes: 1+2+3+4
    assert s["dtensor_params"]["dtensor"] == s["dtensor_params"]["total"]
    steps = s["final_step"]
    for n in ("0", "1"):
        node = s["nodes"][n]
        assert node["pushes"] == steps + 1  # every step's push plus the final one
        assert node["parity_final"] <= 1e-4  # the server holds the final weights
        vllm_log = (job / "logs" / f"node{n}-vllm.log").read_text()
        # each node's ranks sent their generation requests only to their own server: the server's own
        # request log counts one /v1/completions per generation step plus two parity probes per push
        gens = len(re.findall(r'"POST /v1/completions HTTP/1.1" 200', vllm_log))
        # (loopback in the node's own namespace: only that node's ranks can have sent them)
        assert gens >= steps, (n, gens, steps)
        assert len(re.findall(r'"POST /update_weights HTTP/1.1" 200', vllm_log)) == steps + 1
    rows = [x for x in read(job / "metrics.jsonl") if "reward" in x]
    assert [x["step"] for x in rows] == list(range(1, steps + 1))
    assert s["reward_last"] > s["reward_first"], (s["reward_first"], s["reward_last"])
    assert (job / "metrics.png").exists() and (Path(s["final_checkpoint"]) / "meta.json").exists()
    # the job folder is the owner's only
    assert oct((job).stat().st_mode & 0o777) == "0o700"
