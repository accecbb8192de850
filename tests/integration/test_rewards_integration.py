"""Integration tier: a user reward that raises in a real local run (vLLM CPU server, two trainer ranks, TRL) names
itself, the exception, the step and the node in the line the run stops with (unit tests: tests/unit/test_rewards.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli
from tests.support.fakes import clean_env, port_sets

pytestmark = pytest.mark.integration


def test_a_reward_that_raises_mid_run_stops_the_local_run_naming_itself(tmp_path, tiny_model):
    """A real local run (vLLM CPU server, two trainer ranks, TRL): a user reward that scores step 1 and raises at step 2
    stops the run, and the bootstrap's one-line cause names the reward, the exception, the step and the node."""
    (tmp_path / "midrun_rewards.py").write_text(
        "def fail_at_step_two(completions, trainer_state=None, **kwargs):\n"
        "    if trainer_state.global_step >= 1:\n"
        "        raise ValueError(f'cannot score {len(completions)} completions')\n"
        "    return [0.5] * len(completions)\n"
    )
    sets = [
        f"vllm.model={tiny_model}",
        f"job.job_dir={tmp_path / 'job'}",
        *port_sets(),
        "trainer.max_steps=4",
        "trainer.reward_funcs=[letter_a_fraction, midrun_rewards:fail_at_step_two]",
    ]
    r = cli(
        "local",
        str(REPO / "configs/smoke_cpu.yaml"),
        *[x for s in sets for x in ("--set", s)],
        env=clean_env(PYTHONPATH=str(tmp_path)),
        timeout=900,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    named = "RewardError: reward 'midrun_rewards:fail_at_step_two' raised ValueError at step 2 on node 0: cannot score"
    # the node's FAILED line: the trainer's exit with its root cause, the named line (not the bare ValueError)
    assert any("FAILED: node 0" in ln and f"exited with code 1: {named}" in ln for ln in r.stderr.splitlines()), r.stderr
    rows = [json.loads(x) for x in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [x["step"] for x in rows if "reward" in x] == [1], rows  # step 1 scored with both rewards, step 2 did not
