"""Cluster tier, multi-turn: a 2-node job (`slurm-grpo submit` on the real SLURM test cluster) of the tool-calling
tiny model in the countdown environment, each node's ranks generating their episodes on their own node's server,
turn by turn, with no collective between them. One job carries every assertion: it completes, every step's episodes
took the turns the environment asks for, tools never failed, the environment's reward reached the trainer, and both
nodes' servers served generations and got every push (parity)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from bench.agents import AGENT_SETS
from launcher.core.jobdir import JobDir
from launcher.core.records import read_rows, step_rows
from tests.cluster.test_cluster import cluster, sacct_state, wait_until  # noqa: F401  (cluster: the fixture)
from tests.conftest import PY, REPO

pytestmark = pytest.mark.cluster
STEPS = 4


def test_two_node_multi_turn_job_with_an_environment_completes_on_per_node_servers(tmp_path, cluster):  # noqa: F811
    model = tmp_path / "tool-model"
    subprocess.run([PY, "-m", "trainer.agents.tiny_tool_model", str(model)], check=True, cwd=REPO, capture_output=True)
    job = tmp_path / "agents"
    job_id = cluster.submit(job, str(model), f"trainer.max_steps={STEPS}", *AGENT_SETS)
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
