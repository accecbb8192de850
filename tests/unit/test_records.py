"""The records the processes exchange through the job folder (launcher/core/records.py) and its paths
(launcher/core/jobdir.py): every row kind survives a write and a read, rows written before "kind" existed still read
as their kind, the summary of a run's rows, the checkpoint meta that decides a requeue, node events, and JobDir's
names (which must match the folders earlier versions wrote, or old job folders stop reading)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.core.jobdir import Env, Events, JobDir, checkpoint_meta, complete_checkpoints, meta_file, point_dir
from launcher.core.records import (
    CheckpointMeta,
    Event,
    FinalRow,
    NodeFigures,
    NodeFinal,
    ParityRecord,
    ResumedRow,
    StepRow,
    format_summary,
    read_events,
    read_rows,
    row_from_dict,
    step_rows,
    summarize,
)
from trainer.metrics import MetricsWriter
from trainer.tracking import flat_figures

TRL_LOGS = {
    "reward": 0.5,
    "reward_std": 0.1,
    "loss": 0.01,
    "kl": 0.0,
    "sampling/importance_sampling_ratio/mean": 1.02,
    "sampling/sampling_logp_difference/mean": 0.003,
}
FIGURES = {
    0: NodeFigures(push_s=0.123456, gen_s=2.0, gen_wait_s=0.5, parity=1e-5, parity_stale=0.2, parity_engines=[1e-5],
                   gen_tokens=400, server_requests=3, prompts_digest="abc", staleness=1, ahead_misses=2,
                   pushes_paused=1, pushes_paused_running=1, parity_s=0.031234, probe_drift=0.42),
    1: NodeFigures(push_s=0.2, gen_s=4.0, gen_wait_s=4.0, parity=3e-5, parity_stale=None, gen_tokens=200, staleness=0),
}  # fmt: skip

TODAYS_STEP_KEYS = {
    "step", "reward", "reward_std", "loss", "kl", "step_s", "push_s", "gen_s", "gen_wait_s", "parity", "parity_stale",
    "parity_engines", "parity_max", "gen_tokens", "gen_tokens_per_s_node", "server_requests", "prompts_digest",
    "staleness", "ahead_misses", "pushes_paused", "pushes_paused_running", "is_ratio_mean", "logp_mismatch_mean",
    "gen_tokens_per_s", "lr", "rng_digest", "agents", "push_bytes",
}  # fmt: skip
"""The keys trainer/callback.py on_log wrote before the rows were typed (readers of old folders rely on them)."""


def test_a_step_row_is_built_from_the_nodes_figures_with_todays_keys_and_values():
    row = StepRow.build(7, {**TRL_LOGS, "learning_rate": 3e-4}, 3.14159, FIGURES, rng_digest="0123456789ab", checkpoint_s=2.5)
    d = row.to_dict()
    assert d["lr"] == 3e-4 and d["rng_digest"] == "0123456789ab"
    assert set(d) == TODAYS_STEP_KEYS | {"kind", "parity_s", "probe_drift", "checkpoint_s"} and d["kind"] == "step"
    assert d["checkpoint_s"] == 2.5  # the seconds the step was held by its checkpoint
    assert d["push_s"] == {"0": 0.1235, "1": 0.2} and d["step_s"] == 3.142
    assert d["gen_tokens_per_s_node"] == {"0": 200.0, "1": 50.0} and d["gen_tokens_per_s"] == 250.0
    assert d["parity_max"] == 3e-5 and d["parity_stale"] == {"0": 0.2, "1": None}
    assert d["parity_engines"] == {"0": [1e-5], "1": None} and d["ahead_misses"] == {"0": 2, "1": 0}
    assert d["is_ratio_mean"] == 1.02 and d["logp_mismatch_mean"] == 0.003
    assert d["parity_s"] == {"0": 0.0312}, "the parity seconds, their own column (node 1 measured none)"
    assert d["probe_drift"] == {"0": 0.42, "1": None}


def test_every_row_kind_survives_the_file(tmp_path):
    step = StepRow.build(7, TRL_LOGS, 1.0, FIGURES)
    resumed = ResumedRow(from_step=4, checkpoint="/j/checkpoints/step-000004", steps_redone=1, data_indices_skipped=32)
    history = [ParityRecord(step=8, kind="after_push", max_diff=1e-5, per_engine=[1e-5])]
    final = FinalRow(
        step=8, nodes={"0": NodeFinal(node=0, parity_final=1e-5, push_s_final=0.1, pushes=9, parity_history=history)}
    )
    m = MetricsWriter(tmp_path)
    for r in (resumed, step, final):
        m.write(r)
    got = read_rows(JobDir(tmp_path).metrics)
    assert [type(r) for r in got] == [ResumedRow, StepRow, FinalRow]
    assert all(g.time is not None for g in got), "the writer stamps each row"
    assert [g.__class__(**{**g.__dict__, "time": None}) for g in got] == [resumed, step, final]
    raw = [json.loads(x) for x in JobDir(tmp_path).metrics.read_text().splitlines()]
    assert [x["kind"] for x in raw] == ["resumed", "step", "final"]
    assert raw[0]["event"] == "resumed" and raw[2]["event"] == "final", "the old discriminator is still written"


def test_rows_written_before_kind_existed_read_as_their_kind(tmp_path):
    lines = [
        {"time": 1.0, "event": "resumed", "from_step": 2, "checkpoint": "c", "steps_redone": 0, "data_indices_skipped": 8},
        {"time": 2.0, "step": 3, "reward": 0.25, "push_s": {"0": 0.1}, "parity": {"0": None}},  # older: fewer keys
        {"time": 3.0, "event": "final", "step": 3, "nodes": {"0": {"node": 0, "parity_final": 1e-6, "pushes": 3}}},
        {"time": 4.0, "event": "something_new"},
        {"kind": "from_a_newer_version", "step": 9, "reward": 1.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "rew')  # the last line cut by a crash
    got = read_rows(path)
    assert [type(r) for r in got] == [ResumedRow, StepRow, FinalRow]
    resumed, step, final = got
    assert isinstance(resumed, ResumedRow) and resumed.from_step == 2 and resumed.data_indices_skipped == 8
    assert isinstance(step, StepRow) and step.step == 3 and step.reward == 0.25 and step.push_s == {"0": 0.1}
    assert step.gen_wait_s == {} and step.parity_max is None
    assert isinstance(final, FinalRow) and final.nodes["0"].parity_final == 1e-6 and final.nodes["0"].parity_history == []
    assert row_from_dict({"step": 1}) is None, "a row with a step but no reward was never a step row"


def steps_with(rewards: list[float], **kw) -> list[StepRow]:
    return [StepRow(step=i + 1, reward=r, **kw) for i, r in enumerate(rewards)]


def test_summarize_reads_typed_rows_and_format_summary_prints_them():
    rows = [
        ResumedRow(from_step=0, checkpoint="c"),
        *[
            StepRow(step=i, reward=i / 10, step_s=1.0 + i, push_s={"0": 0.1 * i}, parity_max=i * 1e-6, gen_tokens_per_s=10.0 * i)
            for i in range(1, 9)
        ],
        FinalRow(step=8),
    ]
    s = summarize(rows)
    assert s is not None
    assert (s.steps, s.last_step, s.window) == (8, 8, 2)
    assert (s.reward_first, s.reward_last) == (0.15, 0.75)
    assert s.push_s_median == {"0": 0.5} and s.parity_max == 8e-6
    assert s.gen_tokens_per_s_median == 50.0 and s.step_s_median == 6.0
    assert format_summary(s) == (
        "steps 8 (last 8); reward first 2 steps 0.1500 -> last 2 0.7500; push median node 0: 0.500 s; "
        "parity max 8e-06; generation 50.0 tokens/s; step 6.0 s"
    )
    assert summarize(rows, k=1) is not None and summarize(rows, k=1).reward_first == 0.1  # type: ignore[union-attr]
    timed = [StepRow(step=i, reward=0.0, parity_s={"0": 0.01 * i, "1": 0.02}) for i in range(1, 4)]
    s2 = summarize(timed)
    assert s2 is not None and s2.parity_s_median == {"0": 0.02, "1": 0.02}
    assert "; parity checks, median per step: node 0: 0.020 s, node 1: 0.020 s" in format_summary(s2)
    assert "None" not in format_summary(s2)  # figures the run did not record are left out


def test_a_summary_of_no_steps_says_so_and_a_missing_step_time_gives_none():
    assert summarize([ResumedRow(from_step=0, checkpoint="c")]) is None
    assert format_summary(None) == "no training steps recorded yet"
    s = summarize([StepRow(step=1, reward=1.0, step_s=2.0), StepRow(step=2, reward=1.0)])
    assert s is not None and s.step_s_median is None and s.push_s_median == {} and s.parity_max is None


def test_checkpoint_meta_round_trips_and_older_metas_still_read(tmp_path):
    root = JobDir(tmp_path).checkpoints
    folder = JobDir(tmp_path).checkpoint(4)
    folder.mkdir(parents=True)
    assert complete_checkpoints(root) == [], "a folder without its meta file is not a checkpoint"
    meta = CheckpointMeta(step=4, world_size=2, reason="preempt", attempt="7.0", data_indices_consumed=32, reward_last=0.5)
    meta.write(meta_file(folder))
    assert complete_checkpoints(root) == [(4, folder)] and checkpoint_meta(folder) == meta
    meta_file(folder).write_text(json.dumps({"step": 4, "time": 1.0, "world_size": 2, "reason": "periodic", "attempt": ""}))
    old = checkpoint_meta(folder)
    assert old.reason == "periodic" and old.data_indices_consumed is None and old.reward_last is None
    with pytest.raises(ValueError, match="reason 'preempted' is not one of periodic, preempt"):
        CheckpointMeta(step=1, world_size=1, reason="preempted")  # type: ignore[arg-type]


def test_node_events_are_written_and_read_typed(tmp_path):
    JobDir(tmp_path).logs.mkdir()
    ev = Events(tmp_path, 2)
    ev(Event.BOOTSTRAP_START, host="n2", attempt="5.0")
    ev(Event.VLLM_HEALTHY, seconds=41.5)
    ev(Event.FAILED, error="node 2 (n2): vLLM server died")
    with open(JobDir(tmp_path).events(2), "a") as f:
        f.write(json.dumps({"t": 9.0, "node": 2, "event": "from_a_newer_version"}) + "\n")
    got = read_events(JobDir(tmp_path).events(2))
    assert [e.event for e in got] == [Event.BOOTSTRAP_START, Event.VLLM_HEALTHY, Event.FAILED, "from_a_newer_version"]
    assert got[0].host == "n2" and got[0].extra == {"attempt": "5.0"} and got[0].node == 2
    assert got[1].seconds == 41.5 and got[2].error == "node 2 (n2): vLLM server died"
    assert json.loads(JobDir(tmp_path).events(2).read_text().splitlines()[0])["event"] == "bootstrap_start"


def test_job_dir_names_the_files_earlier_versions_wrote():
    j = JobDir(Path("/runs/a"))
    names = {
        j.plan: "plan.json", j.config: "config.yaml", j.job_id: "job_id", j.wandb_id: "wandb_run_id",
        j.submitit: "submitit", j.sbatch: "job.sbatch", j.logs: "logs", j.log(1, "vllm"): "logs/node1-vllm.log",
        j.log(0, "trainer"): "logs/node0-trainer.log", j.events(3): "logs/node3-events.jsonl",
        j.abort("7.0"): "logs/abort-7.0.json", j.heartbeats("7.0"): "logs/heartbeat-7.0",
        j.heartbeat("7.0", 1): "logs/heartbeat-7.0/node1.json", j.metrics: "metrics.jsonl",
        j.metrics_lost: "metrics.lost.jsonl", j.summary: "summary.json", j.plot: "metrics.png",
        j.checkpoints: "checkpoints", j.checkpoint(12): "checkpoints/step-000012", j.hf_output: "hf", j.wandb: "wandb",
        j.tensorboard: "tensorboard", j.sweep: "sweep.json", j.point(3).root: "point-003",
        j.point(3).metrics: "point-003/metrics.jsonl", meta_file(j.checkpoint(1)): "checkpoints/step-000001/meta.json",
    }  # fmt: skip
    assert {str(p.relative_to(j.root)): n for p, n in names.items()} == {n: n for n in names.values()}
    assert point_dir(Path("/runs/s"), 12) == Path("/runs/s/point-012")
    assert JobDir("/x").root == Path("/x")  # type: ignore[arg-type]


def test_job_dir_finds_node_logs_and_the_env_names_are_the_jobs(tmp_path):
    j = JobDir(tmp_path)
    j.logs.mkdir()
    for f in (j.log(0, "vllm"), j.log(0, "trainer"), j.log(1, "vllm"), j.events(0)):
        f.write_text("x")
    assert j.node_logs() == [j.log(0, "trainer"), j.log(0, "vllm"), j.log(1, "vllm")]
    assert j.node_logs(1) == [j.log(1, "vllm")]
    assert j.read_job_id() is None
    j.job_id.write_text("4242_3\n")
    assert j.read_job_id() == "4242_3"
    names = [v for k, v in vars(Env).items() if k.isupper()]
    assert len(set(names)) == len(names) >= 6 and all(n.startswith("SLURM_GRPO_") for n in names)


def test_the_trackers_get_every_per_node_figure_of_a_step_row_and_none_of_trls_own():
    flat = flat_figures(StepRow.build(7, TRL_LOGS, 1.0, FIGURES))
    assert flat["slurm_grpo/push_s/node0"] == 0.1235 and flat["slurm_grpo/gen_tokens_per_s"] == 250.0
    assert flat["slurm_grpo/parity_engines/node0/0"] == 1e-5 and "slurm_grpo/parity_stale/node1" not in flat
    assert flat["slurm_grpo/pushes_paused_running/node0"] == 1.0 and flat["slurm_grpo/step_s"] == 1.0
    assert not any(k.split("/")[1] in ("reward", "loss", "kl", "step", "time", "kind", "prompts_digest") for k in flat)


def test_step_rows_picks_the_step_rows():
    rows = [ResumedRow(from_step=0, checkpoint="c"), *steps_with([0.1, 0.2]), FinalRow(step=2)]
    assert [r.step for r in step_rows(rows)] == [1, 2]
