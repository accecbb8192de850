"""Integration tier, faults: a real vLLM CPU server killed, a trainer rank killed mid-checkpoint, a server paused in a
push; each run stops fast, names what failed and leaves nothing behind (a file of its own so that pytest-xdist's
--dist loadfile, scripts/test.sh, balances the tier's two workers)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import read
from tests.integration.test_integration import (  # noqa: F401  (ports: the fixture)
    assert_all_gone,
    children,
    linear_lr,
    local,
    pids,
    poll_until,
    ports,
    processes,
    start_local,
    stopped_after,
    wait_for_step,
)
from trainer.checkpoint import HOLD_ENV, HOLD_MARKER

pytestmark = pytest.mark.integration


def test_killed_server_stops_the_run_fast_and_names_it(tmp_path, tiny_model, ports, vllm_cache):  # noqa: F811 - the fixture
    job = tmp_path / "kill"
    p = start_local(job, tiny_model, ports, "trainer.max_steps=500", "trainer.save_steps=2", cache=vllm_cache)
    wait_for_step(p, job, 3)
    vllm_pid, trainer_pid = pids(job)
    workers = children(trainer_pid)
    t0 = time.time()
    os.killpg(vllm_pid, signal.SIGKILL)
    err, took = stopped_after(p, t0, "vLLM server killed (SIGKILL), local", timeout=180)
    # the node's supervisor saw the server die (its own wording, not the trainer's connection error, which also
    # names the node, the server and its log), and stopped the run well before any request deadline (120 s here)
    assert f"vLLM server vllm (pid {vllm_pid}" in err and "died with code -9 during training" in err, err[-2000:]
    assert "node 0" in err and "node0-vllm.log" in err, err[-2000:]
    assert took < 30, took  # 0.4-5 s measured
    # nothing left behind: neither the server's group nor torchrun's, nor torchrun's workers (own sessions)
    assert_all_gone(vllm_pid, trainer_pid, *workers)
    # the last checkpoint is complete and loadable metadata-wise
    from trainer.checkpoint import latest

    found = latest(job / "checkpoints")
    assert found is not None and json.loads((found[1] / "meta.json").read_text())["step"] == found[0]


def rank_pid(torchrun_pid: int, rank: int) -> int:
    for pid in children(torchrun_pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


def test_rank_killed_mid_checkpoint_keeps_the_last_good_one_and_resume_uses_it(tmp_path, tiny_model, ports, vllm_cache):  # noqa: F811 - the fixture
    """Kill rank 0 (which writes meta.json and renames) while step 6 is being written: the run stops with
    a message naming the trainer, step-000006 never counts, and the next run resumes from step 3, continuing the
    data order, the LR schedule and the random state of the lost attempt. That run's user reward raises at step 8:
    it stops naming the reward, the exception, the step and the node."""
    job = tmp_path / "ckpt"
    ck = job / "checkpoints"
    # the test-only hold: rank 0 stops in step 6's write, after the shards and before meta.json, and says so
    p = start_local(job, tiny_model, ports, "trainer.max_steps=8", "trainer.save_steps=3", env={HOLD_ENV: "6"}, cache=vllm_cache)
    held = ck / "step-000006.tmp" / HOLD_MARKER
    poll_until(held.exists, p, "rank 0 held in the checkpoint write of step 6", 600)
    vllm_pid, torchrun_pid = pids(job)
    victim = rank_pid(torchrun_pid, 0)
    assert held.read_text() == str(victim)
    workers = children(torchrun_pid)
    os.kill(victim, signal.SIGKILL)
    err, took = stopped_after(p, time.time(), "trainer rank 0 killed during a checkpoint write, local")
    assert "node 0" in err and "trainer" in err and "node0-trainer.log" in err, err[-2000:]
    assert_all_gone(vllm_pid, torchrun_pid, *workers)
    from trainer.checkpoint import latest

    assert not (ck / "step-000006" / "meta.json").exists(), "the kill came too late: step 6 was completed"
    assert latest(ck)[0] == 3
    assert (ck / "step-000006.tmp").is_dir()  # the half-written one is still there, and does not count

    # the resumed run also carries a user reward that scores until step 7 and raises at step 8 (the integration check
    # of tests/unit/test_rewards.py, in a run that starts anyway): the run stops on it, naming reward, step and node
    (tmp_path / "midrun_rewards.py").write_text(
        "def fail_at_step_eight(completions, trainer_state=None, **kwargs):\n"
        "    if trainer_state.global_step >= 7:\n"
        "        raise ValueError(f'cannot score {len(completions)} completions')\n"
        "    return [0.0] * len(completions)\n"
    )
    rewards = "trainer.reward_funcs=[letter_a_fraction, midrun_rewards:fail_at_step_eight]"
    path = os.pathsep.join(x for x in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if x)
    r = local(
        job, tiny_model, ports, "trainer.max_steps=8", "trainer.save_steps=3", rewards, env={"PYTHONPATH": path}, cache=vllm_cache
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    named = "RewardError: reward 'midrun_rewards:fail_at_step_eight' raised ValueError at step 8 on node 0: cannot score"
    # the node's FAILED line: the trainer's exit with its root cause, the named line (not the bare ValueError)
    assert any("FAILED: node 0" in ln and f"exited with code 1: {named}" in ln for ln in r.stderr.splitlines()), r.stderr
    rows = read(job / "metrics.jsonl")
    i = max(k for k, x in enumerate(rows) if x.get("event") == "resumed")
    assert rows[i]["from_step"] == 3 and rows[i]["reason"] == "periodic", rows[i]
    assert [x["step"] for x in rows[i + 1 :] if "reward" in x] == [4, 5, 6, 7]  # step 8 was not scored
    # the redone steps continue the lost attempt (its rows for steps 4 and 5 were set aside in metrics.lost.jsonl),
    # which ran the same 8-step config uninterrupted up to there: the prompts (the data cursor, not the start of the
    # data again), the learning rate (the schedule at step 4, not at its start) and rank 0's torch RNG state
    lost = {x["step"]: x for x in read(job / "metrics.lost.jsonl") if "reward" in x}
    redone = {x["step"]: x for x in rows[i + 1 :] if "reward" in x}
    assert {4, 5} <= set(lost), lost
    for k in lost:
        assert redone[k]["prompts_digest"] == lost[k]["prompts_digest"], (k, lost[k], redone[k])
        assert redone[k]["lr"] == lost[k]["lr"], (k, lost[k]["lr"], redone[k]["lr"])
        assert redone[k]["rng_digest"] == lost[k]["rng_digest"], (k, "the resumed run's random state is not the lost one's")
    assert [redone[k]["lr"] for k in range(4, 8)] == pytest.approx([linear_lr(k, 8) for k in range(4, 8)])
    # the resumed run's server starts from the base model: its first push (before step 4's generation) must bring it
    # to the checkpoint's weights, which parity proves (stale before, equal after)
    assert redone[4]["parity_stale"]["0"] > 1e-3, redone[4]  # the server held the base model
    assert redone[4]["parity"]["0"] <= 1e-4, redone[4]  # ... and holds the checkpoint's weights now
    first = {x["step"]: x for x in rows[:i] if "reward" in x}
    assert redone[4]["prompts_digest"] != first[1]["prompts_digest"], "step 4 saw step 1's prompts: the data started over"
    assert redone[4]["rng_digest"] != first[1]["rng_digest"], "step 4 has step 1's random state: it started over"
    assert rows[i]["data_indices_skipped"] == 3 * 16, rows[i]  # 3 steps x 16 completions
    assert not list(ck.glob("*.tmp"))  # cleaned by the next write (step 6's, complete this time)
    assert latest(ck)[0] == 6


def test_server_paused_during_a_push_is_a_timeout_not_a_hang(tmp_path, tiny_model, ports, vllm_cache):  # noqa: F811 - the fixture
    """The server's process group stops (SIGSTOP) in the middle of the third push (the one before step 3's
    generation, at step 2), by the gloo engine's test-only fault point, once /start_weight_update has answered and
    the chunks are due: the push hits its deadline, the run stops naming the push, and the stopped server is cleaned
    up too."""
    from trainer.push.gloo_engine import PUSH_FAULT_ENV  # (imports vLLM: not at this file's collection)

    job = tmp_path / "pause"
    p = start_local(
        job,
        tiny_model,
        ports,
        "trainer.max_steps=500",
        "trainer.push_timeout_s=15",
        "trainer.request_timeout_s=15",
        "trainer.save_steps=0",
        env={PUSH_FAULT_ENV: "stop@3"},
        cache=vllm_cache,
    )
    wait_for_step(p, job, 2)
    vllm_pid, torchrun_pid = pids(job)
    workers = children(torchrun_pid)
    poll_until(lambda: processes().get(vllm_pid, ("",))[0] == "T", p, "the server stopped in the third push", 300, every=0.1)
    err, took = stopped_after(p, time.time(), "vLLM server paused (SIGSTOP) during a weight push, local")
    # the push deadline, plus a bounded stop (launcher.node.bootstrap.FAILED_STOP_GRACE_S): 16-17 s measured, 19-41 s
    # before the failed stop was bounded and the trainer exited at once
    assert took < 15 + 15, took
    assert_all_gone(vllm_pid, torchrun_pid, *workers)
    # the console names the push, its step and node, and the route that got no answer in time
    assert "weight push at step 2 (node 0)" in err and "/update_weights" in err, err[-3000:]
