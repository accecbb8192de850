"""gpu/report.py's step figures on the rows each kind of run writes (StepRow.build, the trainer's own path): single-turn
rows carry the node's gen_s; multi-turn rows carry none and the agents' own figures instead (issue 37: the report
crashed on them). The integration tier runs step_figures on real CPU agents runs' metrics.jsonl too
(tests/integration/test_agents_integration.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from launcher.core.records import NodeFigures, StepRow

REPO = Path(__file__).resolve().parents[2]


def load_report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "gpu" / "report.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load_report()


def row(step: int, step_s: float, logs: dict, **node) -> StepRow:
    return StepRow.build(step, {"reward": 1.0, **logs}, step_s, {0: NodeFigures(**node)})


def test_single_turn_rows_read_the_nodes_generation_time():
    rows = [row(s, 2.0, {}, gen_s=0.5, gen_tokens=500, push_s=0.2, parity_s=0.1) for s in (2, 3, 4)]
    f = report.step_figures(rows)
    assert f["gen_s_median"] == 0.5 and f["gen_tokens_per_s_median"] == 1000.0 and f["push_s_median"] == 0.2
    assert f["train_s_median"] == pytest.approx(1.2) and "agents" not in f and f["gen_s_source"].startswith("gen_s")


def test_multi_turn_rows_read_the_agents_figures():
    """Synchronous episodes (trainer/agents/figures.attach's keys): generation is rank 0's requests, summed."""
    logs = {
        "agents/turns_per_episode": 2.5,
        "agents/tool_calls": 6.0,
        "agents/tool_s": 0.05,
        "agents/requests": 3.0,
        "agents/gen_s": 0.4,
        "agents/gen_tokens": 200.0,
        "tools/call_frequency": 1.5,
    }
    rows = [row(s, 1.0, logs, push_s=0.3, parity_s=0.1) for s in (2, 3)]
    assert rows[0].gen_s == {} and rows[0].agents["agents/gen_s"] == 0.4  # what made the report crash
    f = report.step_figures(rows)
    assert f["gen_s_median"] == 0.4 and f["gen_tokens_per_s_median"] == 500.0 and f["gen_s_source"].startswith("agents/")
    assert f["train_s_median"] == pytest.approx(0.2)
    assert f["agents"]["tool_s_median"] == 0.05 and f["agents"]["gen_requests_median"] == 3.0
    assert f["agents"]["episodes_ran_ahead"] is False


def test_multi_turn_rows_with_episodes_run_ahead_have_no_generation_on_the_step():
    """max_staleness >= 1 (trainer/agents/ahead_rollout's keys): no generation time in the step's row at all."""
    logs = {"agents/staleness": 1.0, "agents/turns_per_episode": 2.0, "agents/tool_calls": 4.0, "agents/tool_s": 0.01}
    f = report.step_figures([row(s, 1.0, logs, push_s=0.3) for s in (2, 3)])
    assert f["gen_s_median"] is None and f["gen_s_source"] is None and f["gen_tokens_per_s_median"] is None
    assert f["train_s_median"] == pytest.approx(0.7) and f["agents"]["episodes_ran_ahead"] is True
    assert f["agents"]["staleness"] == [1.0, 1.0]


def test_per_hour_figures_put_reward_beside_steps_the_same_way_for_both_sides():
    per_hour = report.per_hour
    # 10 steps of 2 s: 1800 steps an hour; the reward rose 0.5 over 20 s of steps, 90 an hour
    assert per_hour(10, 2.0, 0.25, 0.75) == {"steps_per_hour": 1800.0, "reward_gain_per_hour": 90.0}
    assert per_hour(10, 4.0, 0.25, 0.75)["reward_gain_per_hour"] == 45.0  # twice the step, half the gain an hour
    assert per_hour(0, None, None, None) == {"steps_per_hour": None, "reward_gain_per_hour": None}


def test_the_report_names_an_moes_total_and_active_parameters_and_a_dense_bodys_as_equal():
    from launcher.memory import common_shape

    moe = report.model_figures(common_shape("Qwen3-30B-A3B"))
    assert moe["model_params_b"] == pytest.approx(30.53, abs=0.01)  # the published 30.53B total, 3.35B active
    assert moe["model_params_active_b"] == pytest.approx(3.35, abs=0.01)
    assert moe["model_experts"] == "8 of 128 per token, 48 MoE layers"
    dense = report.model_figures(common_shape("Qwen2.5-7B"))
    assert dense["model_params_b"] == dense["model_params_active_b"] and "model_experts" not in dense
