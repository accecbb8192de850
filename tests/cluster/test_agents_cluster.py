"""Cluster tier, multi-turn: a 2-node job (`slurm-grpo submit` on the real SLURM test cluster) of the tool-calling
tiny model in the countdown environment, each node's ranks generating their episodes on their own node's server,
turn by turn, with no collective between them. One job carries every assertion: it completes, every step's episodes
took the turns the environment asks for, tools never failed, the environment's reward reached the trainer, and both
nodes' servers served generations and got every push (parity). The same job starts from a staged environment
(slurm.stage_env), whose checks were a 2-node job of their own: the sbcast copy on every node, both bootstraps
started from it, the copy gone at the end."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from bench.agents import AGENT_SETS
from launcher.core.jobdir import JobDir
from launcher.core.records import read_rows, step_rows
from tests.cluster.test_cluster import cluster, sacct_state, wait_until  # noqa: F401  (cluster: the fixture)
from tests.conftest import PY, REPO

pytestmark = pytest.mark.cluster
STEPS = 4


def staged_env(tmp_path: Path) -> Path:
    """A packed "venv" whose bin/python records where it ran (next to its last argument: the job folder's file), then
    hands over to this venv's Python."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text(
        f'#!/bin/sh\nfor a; do last=$a; done\necho "$(hostname) $0" >> "$(dirname "$last")/staged-python.txt"\nexec {PY} "$@"\n'
    )
    wrapper.chmod(0o755)
    packed = tmp_path / "env.tar.gz"
    subprocess.run(["tar", "-czf", str(packed), "-C", str(venv), "."], check=True)
    return packed


def test_two_node_multi_turn_job_from_a_staged_env_completes_on_per_node_servers(tmp_path, cluster):  # noqa: F811
    """slurm.stage_env: the batch script sbcasts the packed env to node-local storage, unpacks it on every node (the
    test cluster's nodes share /tmp: once, under the lock), both bootstraps start from the staged copy (PATH), the
    job trains its multi-turn steps, and the copy is gone when the job ends."""
    model = tmp_path / "tool-model"
    subprocess.run([PY, "-m", "trainer.agents.tiny_tool_model", str(model)], check=True, cwd=REPO, capture_output=True)
    packed = staged_env(tmp_path)
    job = tmp_path / "agents staged"
    job_id = cluster.submit(
        job, str(model), f"trainer.max_steps={STEPS}", *AGENT_SETS, f"slurm.stage_env={packed}", "job.python=python"
    )
    t0 = time.time()
    wait_until(
        lambda: sacct_state(job_id, cluster.env) not in ("RUNNING", "PENDING", ""), 900, "the job's end", job_id, cluster.env, job
    )
    state = sacct_state(job_id, cluster.env)
    assert state == "COMPLETED", f"{state}; trainer log tail: {JobDir(job).log(0, 'trainer').read_text()[-2000:]}"
    rows = step_rows(read_rows(JobDir(job).metrics))
    assert [r.step for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        # countdown.jsonl asks 1-3 calls per episode and the model makes exactly those: turns = calls + 1
        calls, turns = r.agents["tools/call_frequency"], r.agents["agents/turns_per_episode"]
        assert 1 <= calls <= 3 and r.agents["tools/failure_frequency"] == 0.0, r.agents
        assert 2 <= turns <= 4 and r.agents["agents/tool_timeouts"] == 0.0, r.agents
        assert r.reward == pytest.approx(1.0)  # get_reward: the whole count done, on every episode of both nodes
        assert set(r.push_s) == {"0", "1"} and r.parity_max is not None and r.parity_max < 1e-3, r
    for node in (0, 1):  # each node's server answered generations of its own ranks
        log = JobDir(job).log(node, "vllm").read_text()
        assert len(re.findall(r"POST /v1/completions", log)) >= STEPS * 2, f"node {node}'s server log"
    print(f"2-node multi-turn job: {STEPS} steps in {time.time() - t0:.0f} s")

    # the staged environment
    said = "".join(f.read_text(errors="replace") for f in (job / "submitit").rglob("*.out"))
    m = re.search(r"slurm.stage_env: env.tar.gz staged in (\S+) on 2 node\(s\), (\d+) s into the job", said)
    assert m and m.group(1).startswith("/tmp/slurm-grpo-") and m.group(1).endswith(f"-{job_id}"), said[-3000:]
    stage = m.group(1)
    ran = sorted((job / "staged-python.txt").read_text().split("\n")[:-1])
    assert ran == [f"n1 {stage}/env/bin/python", f"n2 {stage}/env/bin/python"], ran  # each node's bootstrap
    assert json.loads((job / "summary.json").read_text())["final_step"] == STEPS
    wait_until(lambda: not Path(stage).exists(), 60, "the staged copy to be removed", job_id, cluster.env, job)
    print(f"slurm.stage_env: staged on 2 nodes {m.group(2)} s into the job")
