"""trainer.callback.SlurmGrpoCallback's step record: on_step_begin starts the step on the node's rollout, and on_log turns
TRL's log record of a step (TRL 1.16's keys) and every node's figures (rollout.by_node) into the StepRow it appends to
metrics.jsonl, read back here through launcher.core.records.read_rows and checked field by field.

The rollout is a real NodeRollout (tiny Qwen2, one rank in a world-1 gloo group in this process; its server is never
contacted): by_node is set as its world gather would leave it on a 2-node run (trainer.rollout.node.gather_figures)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerControl, TrainerState

from launcher.core.config import TrainerConfig
from launcher.core.jobdir import JobDir
from launcher.core.records import NodeFigures, StepRow, read_rows
from tests.support.ranks import cpu_parallel, free_port
from trainer.callback import PreemptionFlag, SlurmGrpoCallback
from trainer.data import DataCursor
from trainer.push.pusher import PushSettings
from trainer.rollout.node import GenerationSettings, NodeRollout
from trainer.tiny_model import make_tiny_model

# one step's record as TRL 1.16's GRPOTrainer logs it (GRPOTrainer.log: its _metrics averaged, plus Trainer's own)
TRL_LOGS = {
    "loss": 0.0123,
    "grad_norm": 0.5,
    "learning_rate": 1e-06,
    "num_tokens": 4096.0,
    "completions/mean_length": 12.5,
    "completions/min_length": 3.0,
    "completions/max_length": 16.0,
    "completions/clipped_ratio": 0.25,
    "completions/mean_terminated_length": 10.0,
    "completions/min_terminated_length": 3.0,
    "completions/max_terminated_length": 15.0,
    "rewards/letter_a_fraction/mean": 0.375,
    "rewards/letter_a_fraction/std": 0.125,
    "reward": 0.375,
    "reward_std": 0.125,
    "frac_reward_zero_std": 0.0,
    "sampling/sampling_logp_difference/mean": 0.031,
    "sampling/sampling_logp_difference/max": 0.4,
    "sampling/importance_sampling_ratio/min": 0.8,
    "sampling/importance_sampling_ratio/mean": 0.998,
    "sampling/importance_sampling_ratio/max": 1.2,
    "kl": 0.0042,
    "entropy": 2.5,
    "clip_ratio/low_mean": 0.0,
    "clip_ratio/low_min": 0.0,
    "clip_ratio/high_mean": 0.0,
    "clip_ratio/high_max": 0.0,
    "clip_ratio/region_mean": 0.0,
    "step_time": 3.2,
    "epoch": 0.5,
}

NODE_0 = NodeFigures(
    push_s=0.123456,
    gen_s=2.0,
    gen_wait_s=0.25,
    parity=2e-4,
    parity_stale=0.31,
    parity_engines=[2e-4],
    gen_tokens=500,
    server_requests=9,
    prompts_digest="aaaaaaaaaaaa",
    staleness=1,
    ahead_hits=3,
    ahead_misses=0,
    pushes_paused=2,
    pushes_paused_running=1,
)
NODE_1 = NodeFigures(
    push_s=0.2,
    gen_s=4.0,
    gen_wait_s=4.0,
    parity=5e-4,
    parity_stale=None,  # not measured on this node at this step
    parity_engines=[1e-4, 5e-4],
    gen_tokens=600,
    server_requests=7,
    prompts_digest="bbbbbbbbbbbb",
    staleness=0,
    ahead_hits=2,
    ahead_misses=1,
    pushes_paused=0,
    pushes_paused_running=0,
)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """A real NodeRollout on rank 0 of a world-1 gloo group (the leader of node 0)."""
    tiny = tmp_path_factory.mktemp("tiny")
    make_tiny_model(tiny)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    settings = GenerationSettings(
        server_url=f"http://127.0.0.1:{free_port()}",  # never contacted: no push, no generation here
        model="tiny",
        node=0,
        request_timeout_s=60.0,
        push=PushSettings("gloo", free_port(), 1, 60.0, torch.float32, 1 << 20),
        parity_tolerance=0.0,
        parity_action="fail",
    )
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    yield NodeRollout(model, AutoTokenizer.from_pretrained(tiny), cpu_parallel(0, 1), settings)
    dist.destroy_process_group()


@pytest.fixture
def callback(rollout, tmp_path):
    saved = {sig: signal.getsignal(sig) for sig in PreemptionFlag.SIGNALS}  # the flag installs handlers: give pytest its own back
    try:
        cb = SlurmGrpoCallback(
            tmp_path, rollout.par, TrainerConfig(), rollout, PreemptionFlag(), DataCursor(base_indices=0, base_step=0, per_step=8)
        )
        yield cb
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_on_step_begin_starts_the_step_on_the_rollout(callback, rollout):
    for step in (4, 5):
        callback.on_step_begin(None, TrainerState(global_step=step, max_steps=20), TrainerControl())
        assert rollout.step == step


def test_on_log_writes_the_step_row_from_trls_record_and_every_nodes_figures(callback, rollout, tmp_path: Path):
    rollout.by_node = {1: NODE_1, 0: NODE_0}  # as the world gather leaves it on a 2-node run (any order)
    state = TrainerState(global_step=7, max_steps=20)
    logs = dict(TRL_LOGS)
    t0 = time.time()
    callback.on_step_begin(None, state, TrainerControl())
    callback.on_log(None, state, TrainerControl(), logs=logs)
    elapsed = time.time() - t0

    rows = read_rows(JobDir(tmp_path).metrics)
    assert len(rows) == 1 and isinstance(rows[0], StepRow), rows
    row = rows[0]
    assert row.kind == "step" and row.step == 7
    assert row.reward == 0.375 and row.reward_std == 0.125 and row.loss == 0.0123 and row.kl == 0.0042
    assert row.is_ratio_mean == 0.998 and row.logp_mismatch_mean == 0.031
    assert row.step_s is not None and 0 <= row.step_s <= elapsed + 1e-3, (row.step_s, elapsed)
    assert row.time is not None and t0 - 1e-3 <= row.time <= t0 + elapsed + 1e-3
    assert row.push_s == {"0": 0.1235, "1": 0.2}
    assert row.gen_s == {"0": 2.0, "1": 4.0}
    assert row.gen_wait_s == {"0": 0.25, "1": 4.0}
    assert row.parity == {"0": 2e-4, "1": 5e-4} and row.parity_max == 5e-4
    assert row.parity_stale == {"0": 0.31, "1": None}
    assert row.parity_engines == {"0": [2e-4], "1": [1e-4, 5e-4]}
    assert row.gen_tokens == {"0": 500, "1": 600}
    assert row.gen_tokens_per_s_node == {"0": 250.0, "1": 150.0} and row.gen_tokens_per_s == 400.0
    assert row.server_requests == {"0": 9, "1": 7}
    assert row.prompts_digest == {"0": "aaaaaaaaaaaa", "1": "bbbbbbbbbbbb"}
    assert row.staleness == {"0": 1, "1": 0}
    assert row.ahead_misses == {"0": 0, "1": 1}
    assert row.pushes_paused == {"0": 2, "1": 0} and row.pushes_paused_running == {"0": 1, "1": 0}
    # the same dict goes on to the trackers' callbacks, with the project's figures added, per node
    assert logs["slurm_grpo/push_s/node1"] == 0.2 and logs["slurm_grpo/parity_engines/node1/1"] == 5e-4
    assert logs["slurm_grpo/staleness/node0"] == 1.0 and logs["slurm_grpo/gen_tokens_per_s"] == 400.0
    assert "slurm_grpo/reward" not in logs and "slurm_grpo/prompts_digest/node0" not in logs, "TRL logs those itself"
    assert {k: logs[k] for k in TRL_LOGS} == TRL_LOGS, "TRL's own keys are left as they were"


def test_on_log_without_a_reward_writes_no_row(callback, rollout, tmp_path: Path):
    """TRL's end-of-training summary (and any record without the step's reward) is not a step."""
    rollout.by_node = {0: NODE_0, 1: NODE_1}
    state = TrainerState(global_step=20, max_steps=20)
    callback.on_log(None, state, TrainerControl(), logs={"train_runtime": 12.0, "train_loss": 0.01, "epoch": 1.0})
    callback.on_log(None, state, TrainerControl(), logs={})
    assert read_rows(JobDir(tmp_path).metrics) == []
