"""Multi-turn agents, integration tier: one real local run (vLLM CPU server, two FSDP2 ranks, TRL's tool loop) of
the tool-calling tiny model in tests.support.agent_envs.RankCountdown, shared by the tests below (module-scoped:
one server start). Rank 0's episodes take 2 turns, rank 1's take 6 (one call hangs past the deadline, one raises),
in the same steps, each rank generating on the node's server by itself. The ranks trace what they generated and the
batch each loss saw (trainer.agents.figures.TRACE_ENV)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, cli, read
from tests.support.fakes import clean_env, port_sets
from trainer.agents.figures import TRACE_ENV
from trainer.agents.tiny_tool_model import CALL

pytestmark = pytest.mark.integration

STEPS = 2
TOOL_TIMEOUT_S = 2
CALL_TURN = f"<tool_call>{CALL}</tool_call><|im_end|>"
"""What the model writes in a turn that calls the tool."""


class Run:
    def __init__(self, model: Path, job: Path, trace: Path, result, seconds: float) -> None:
        self.model, self.job, self.trace, self.result, self.seconds = model, job, trace, result, seconds

    def rows(self, rank: int, kind: str) -> list[dict]:
        return [r for r in read(self.trace / f"rank{rank}.jsonl") if r["kind"] == kind]


COUNTDOWN = (
    "trainer.environment=tests.support.agent_envs:RankCountdown",
    f"trainer.tool_timeout_s={TOOL_TIMEOUT_S}",
    "trainer.max_completion_length=640",
    "trainer.grpo={max_tool_calling_iterations: 8}",
)
"""The episodes most tests run: the countdown environment, a tool deadline, room for 8 tool calls."""


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The tool-calling tiny model, built once for the module's runs (each server only reads it)."""
    import subprocess

    model = tmp_path_factory.mktemp("tool-model") / "model"
    subprocess.run([PY, "-m", "trainer.agents.tiny_tool_model", str(model)], check=True, cwd=REPO, capture_output=True)
    return model


def local_run(tmp: Path, model: Path, cache: str, steps: int, *extra: str, agent: tuple[str, ...] = COUNTDOWN) -> Run:
    """One local run of `model`, its servers' compile caches in `cache` (tests.conftest.vllm_cache)."""
    job, trace = tmp / "job", tmp / "trace"
    sets = [
        f"vllm.model={model}",
        f"vllm.cache_dir={cache}",
        f"job.job_dir={job}",
        *port_sets(),
        f"trainer.max_steps={steps}",
        *extra,
        *agent,
        "trainer.per_device_train_batch_size=2",
        "trainer.num_generations=2",
    ]
    t0 = time.time()
    r = cli(
        "local",
        str(REPO / "configs/agents_cpu.yaml"),
        *[x for s in sets for x in ("--set", s)],
        env=clean_env(PYTHONPATH=str(REPO), **{TRACE_ENV: str(trace)}),
        timeout=900,
    )
    return Run(model, job, trace, r, time.time() - t0)


EVAL = ("trainer.eval.dataset=data/countdown.jsonl", "trainer.eval.samples_per_prompt=2", "trainer.eval.max_prompts=1")
"""An evaluation of one prompt (rank 0's share: 1 tool call, reward 1.0) twice, through the project's episode loop."""


@pytest.fixture(scope="module")
def run(tmp_path_factory, tool_model, vllm_cache) -> Run:
    """TRL's own tool loop (trainer.max_staleness 0)."""
    return local_run(tmp_path_factory.mktemp("agents"), tool_model, vllm_cache, STEPS, *EVAL)


AHEAD_STEPS = 4


@pytest.fixture(scope="module")
def ahead_run(tmp_path_factory, tool_model, vllm_cache) -> Run:
    """The project's episode loop, one step off (trainer.max_staleness 1): the second server start of this module."""
    return local_run(
        tmp_path_factory.mktemp("agents-ahead"),
        tool_model,
        vllm_cache,
        AHEAD_STEPS,
        "trainer.max_staleness=1",
        *EVAL,
        "trainer.eval.every_steps=2",
    )


def tokenizer(run: Run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run.model)


def test_two_ranks_with_different_numbers_of_turns_in_the_same_steps_finish(run):
    """No hang: rank 1 sends three times the requests of rank 0 in every step, with no collective between them."""
    assert run.result.returncode == 0, run.result.stdout[-3000:] + run.result.stderr[-3000:]
    gen = {rank: run.rows(rank, "generated") for rank in (0, 1)}
    assert [r["step"] for r in gen[0]] == [r["step"] for r in gen[1]] == list(range(STEPS))
    assert [r["figures"]["agents/requests"] for r in gen[0]] == [2.0] * STEPS  # a call turn and an answer turn
    assert [r["figures"]["agents/requests"] for r in gen[1]] == [6.0] * STEPS
    assert [r["figures"]["agents/turns_per_episode"] for r in gen[1]] == [6.0] * STEPS


def test_tool_results_are_appended_and_the_model_goes_on_to_its_answer(run):
    tok = tokenizer(run)
    for rank, results in ((0, ["DONE"]), (1, ["AGAIN", "gave no result within", "the counter is jammed", "AGAIN", "DONE"])):
        for row in run.rows(rank, "generated"):
            for ids in row["completion_ids"]:
                text = tok.decode(ids)
                assert text.count(CALL_TURN) == len(results) and text.endswith("ok<|im_end|>"), text
                responses = text.split("<tool_response>\n")[1:]
                assert len(responses) == len(results)
                for got, want in zip(responses, results, strict=True):
                    assert want in got.split("\n</tool_response>")[0], (got, want)


def test_tool_tokens_are_masked_out_of_the_loss(run):
    """The batch the loss saw: tool_mask is 0 on exactly the tool results (the template's tool turn around them) and
    1 on what the model wrote; the model-written tokens are the call turns and the answer, nothing else."""
    tok = tokenizer(run)
    for rank, calls in ((0, 1), (1, 5)):
        rows = run.rows(rank, "loss")
        assert len(rows) == STEPS, rows
        for row in rows:
            for ids, keep, tool in zip(row["completion_ids"], row["completion_mask"], row["tool_mask"], strict=True):
                trained = [t for t, k, m in zip(ids, keep, tool, strict=True) if k and m]
                masked = [t for t, k, m in zip(ids, keep, tool, strict=True) if k and not m]
                assert tok.decode(trained) == CALL_TURN * calls + "ok<|im_end|>"
                assert tok.decode(masked).count("<tool_response>") == calls and CALL not in tok.decode(masked)
                results = sum(1 for i, m in enumerate(tool) if m == 0 and (i == 0 or tool[i - 1] == 1))
                assert results == calls  # one masked run per tool result


def test_a_tool_that_hangs_or_raises_is_a_recorded_failure_within_the_deadline(run):
    steps = [r for r in read(run.job / "metrics.jsonl") if r.get("kind") == "step"]
    assert len(steps) == STEPS
    for s in steps:
        # every step: 4 episodes, 1 + 1 + 5 + 5 calls, 2 + 2 failures (TRL's own counts over both ranks)
        assert s["agents"]["tools/call_frequency"] == pytest.approx(12 / 4)
        assert s["agents"]["tools/failure_frequency"] == pytest.approx(4 / 12)
    for row in run.rows(1, "generated"):
        f = row["figures"]
        assert (f["agents/tool_calls"], f["agents/tool_failures"], f["agents/tool_timeouts"]) == (10.0, 4.0, 2.0)
        # two hangs cut at the deadline each, not the tool's 120 s sleep
        assert 2 * TOOL_TIMEOUT_S <= f["agents/tool_s"] < 2 * TOOL_TIMEOUT_S + 10
    assert run.seconds < 600


def test_the_environments_reward_reaches_the_trainer_and_pushes_land(run):
    steps = [r for r in read(run.job / "metrics.jsonl") if r.get("kind") == "step"]
    # get_reward: 1 successful call on rank 0's episodes, 3 on rank 1's; the trainer's reward is their mean
    assert [s["reward"] for s in steps] == [pytest.approx(2.0)] * STEPS
    for s in steps:
        assert s["push_s"]["0"] > 0 and s["parity_max"] is not None and s["parity_max"] < 1e-3
    summary = json.loads((run.job / "summary.json").read_text())
    assert summary["final_step"] == STEPS


def test_one_step_off_whole_episodes_run_ahead_and_train_with_their_staleness(ahead_run):
    """max_staleness 1: step 1 generates then (staleness 0), every later step trains on episodes that ran whole in the
    background during the step before (staleness 1), on both ranks, with the same turns, failures and masks as the
    synchronous run; the environment's reward reaches the trainer through the project's reward per class."""
    run = ahead_run
    assert run.result.returncode == 0, run.result.stdout[-3000:] + run.result.stderr[-3000:]
    steps = [r for r in read(run.job / "metrics.jsonl") if r.get("kind") == "step"]
    assert [s["agents"]["agents/staleness"] for s in steps] == [0.0] + [1.0] * (AHEAD_STEPS - 1)
    assert [s["reward"] for s in steps] == [pytest.approx(2.0)] * AHEAD_STEPS
    for s in steps:
        assert s["push_s"]["0"] > 0 and s["parity_max"] is not None and s["parity_max"] < 1e-3
    tok = tokenizer(run)
    for rank, calls, failures in ((0, 1, 0), (1, 5, 2)):
        gen = run.rows(rank, "generated")
        assert [r["step"] for r in gen] == list(range(AHEAD_STEPS))
        for row in gen:
            assert (row["figures"]["agents/tool_calls"], row["figures"]["agents/tool_failures"]) == (2 * calls, 2 * failures)
            for ids in row["completion_ids"]:
                assert tok.decode(ids).count(CALL_TURN) == calls and tok.decode(ids).endswith("ok<|im_end|>")
        for row in run.rows(rank, "loss"):
            for ids, keep, tool in zip(row["completion_ids"], row["completion_mask"], row["tool_mask"], strict=True):
                trained = [t for t, k, m in zip(ids, keep, tool, strict=True) if k and m]
                assert tok.decode(trained) == CALL_TURN * calls + "ok<|im_end|>"


def test_eval_episodes_run_through_the_episode_loop_beside_trls_loop_and_one_step_off(run, ahead_run):
    """trainer.eval with an environment: the eval prompt's episodes (rank 0's share) call the tool and answer, in both
    runs (TRL's loop trains, the project's loop evaluates; one step off, between the pushes), and the environment's
    get_reward scores them (RankCountdown: 1 on rank 0)."""
    call_tokens = len(tokenizer(run).encode(CALL_TURN, add_special_tokens=False))
    for r, steps in ((run, [0, STEPS]), (ahead_run, [0, 2, AHEAD_STEPS])):
        assert r.result.returncode == 0, r.result.stdout[-3000:] + r.result.stderr[-3000:]
        evals = [x for x in read(r.job / "metrics.jsonl") if x.get("kind") == "eval"]
        assert [x["step"] for x in evals] == steps, evals
        for x in evals:
            assert (x["prompts"], x["samples_per_prompt"], x["prompts_per_node"]) == (1, 2, {"0": 1}), x
            assert x["reward_funcs"] == {"RankCountdown": 1.0} and x["mean_at_k"] == 1.0, x
            # the episode's completion: the call turn, the tool's result and the answer
            assert x["pass_at"] == {"1": 1.0, "2": 1.0} and x["completion_tokens_mean"] > call_tokens, x


def test_a_clean_end_leaves_no_engine_traceback_in_the_vllm_log(run, ahead_run):
    """The bootstrap stops vLLM by SIGTERM to its API server, which stops its engine; the plugin keeps that expected
    EngineDeadError out of the log a user reads after a failure (trainer/push/clean_shutdown.py). The plugin's patches
    loaded in the real server (trainer/push/prefix_reset.py refuses a vLLM it was not checked against)."""
    from trainer.push.vllm_plugin import REGISTERED_MARK

    for r in (run, ahead_run):
        assert r.result.returncode == 0, r.result.stdout[-3000:] + r.result.stderr[-3000:]
        log = (r.job / "logs" / "node0-vllm.log").read_text(errors="replace")
        assert f"{REGISTERED_MARK} " in log and "prefix reset over cached blocks only: True" in log
        assert "EngineDeadError" not in log and "output_handler failed" not in log, log[-4000:]


def test_the_gpu_report_reads_both_runs_agents_rows(run, ahead_run, tmp_path):
    """gpu/report.py on these real multi-turn job folders (no per-node gen_s: it crashed on them, issue 37): the
    synchronous run's generation time from the agents' own figures, none for episodes run ahead."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "gpu" / "report.py")
    assert spec and spec.loader
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    for r, ahead in ((run, False), (ahead_run, True)):
        out = tmp_path / ("ahead" if ahead else "sync")
        out.mkdir()
        (out / "versions.json").write_text("{}")  # gpu/stack.sh writes it on the device
        report.main(r.job, out)
        res = json.loads((out / "gpu_results.json").read_text())
        assert res["kind"] == "agents" and res["push_s_median"] > 0 and res["agents"]["episodes_ran_ahead"] is ahead
        assert res["agents"]["tool_calls_median"] == 2.0 and res["train_s_median"] > 0  # rank 0: 2 episodes x 1 call
        assert (res["gen_s_median"] is None) is ahead and (res["gen_tokens_per_s_median"] is None) is ahead, res


def test_a_users_rollout_func_generates_on_the_nodes_server_and_its_field_reaches_the_reward(tmp_path, tool_model, vllm_cache):
    """trainer.rollout_func (tests.support.agent_rollout:rollout, TRL's signature and output) in a real local run:
    both ranks generate through their generation backend on the node's vLLM server (the tool model's own turn comes
    back, and the server's access log holds exactly their requests besides parity's), and the rollout's extra field
    reaches the reward function (rank_reward scores it: 0.25 on rank 0, 0.5 on rank 1, 0.375 the step's mean)."""
    rollout = (
        "trainer.environment=''",
        "trainer.rollout_func=tests.support.agent_rollout:rollout",
        "trainer.reward_funcs=[tests.support.agent_rollout:rank_reward]",
        "trainer.max_completion_length=16",
    )
    run = local_run(tmp_path, tool_model, vllm_cache, STEPS, agent=rollout)
    r, job = run.result, run.job
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tok = tokenizer(run)
    for rank in (0, 1):
        gen = run.rows(rank, "generated")
        assert [row["step"] for row in gen] == list(range(STEPS))
        assert [row["figures"]["agents/requests"] for row in gen] == [1.0] * STEPS  # one request per step, its own
        for row in gen:
            assert [tok.decode(ids) for ids in row["completion_ids"]] == [CALL_TURN] * 2  # what the model writes
    steps = [s for s in read(job / "metrics.jsonl") if s.get("kind") == "step"]
    assert [s["reward"] for s in steps] == [pytest.approx(0.375)] * STEPS
    summary = json.loads((job / "summary.json").read_text())
    assert summary["final_step"] == STEPS
    parity = summary["nodes"]["0"]["parity_history"]
    posts = (job / "logs" / "node0-vllm.log").read_text().count('"POST /v1/completions ')  # the access log
    assert posts == 2 * STEPS + len(parity), (posts, len(parity))
