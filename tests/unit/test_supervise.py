"""The bootstrap's failure logic (launcher.node.bootstrap.supervise) in seconds: the node's two processes are
faked at the process boundary (poll/signal/log, the way submitit fakes the scheduler), the job folder, the
abort file and the checkpoints are real files."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from launcher.core import config
from launcher.core.jobdir import PREEMPTED_EXIT, Events
from launcher.core.plan import plan
from launcher.node import bootstrap
from launcher.node.bootstrap import NodeRun, supervise
from launcher.node.peers import Heartbeats, JobAbort, NodeFailure


class FakeProc:
    """poll() answers None until `exit_after` polls, then `code`; signals are recorded."""

    def __init__(self, log_path: Path, name: str, code: int | None = None, exit_after: int = 0, log: str = ""):
        self.log_path, self.name, self.code, self.exit_after = log_path, name, code, exit_after
        self.started, self.polls = time.time(), 0
        self.signals: list[int] = []
        log_path.write_text(f"===== start {name}\n{log}")

    def poll(self) -> int | None:
        self.polls += 1
        return self.code if self.code is not None and self.polls > self.exit_after else None

    def signal(self, sig: int) -> None:
        self.signals.append(sig)

    def describe(self) -> str:
        return f"{self.name} (pid 0, log {self.log_path})"


class Clock:
    """A clock that only moves when told, or when something sleeps on it (sleep(s) records s and moves it)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []
        self.during_sleep = lambda: None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        self.during_sleep()


@pytest.fixture
def settle_clock() -> Clock:
    """The clock of the node's JobAbort: settle() waits on it, not on the wall."""
    return Clock()


@pytest.fixture
def node_run(tmp_path, monkeypatch, settle_clock):
    monkeypatch.setattr(bootstrap, "POLL_S", 0.01)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "logs").mkdir()
    (tmp_path / "checkpoints").mkdir()
    cfg = config.from_dict(
        {
            "job": {"device": "cpu"},
            "slurm": {"nodes": 2, "gpus_per_node": 3},
            "vllm": {"model": "m"},
            "trainer": {"dtype": "float32", "stall_timeout_s": 1},
        }
    )
    p = plan(cfg, str(tmp_path))
    return NodeRun(
        plan=p,
        node=1,
        host="n2",
        attempt="7.0",
        events=Events(tmp_path, 1),
        abort=JobAbort(tmp_path, "7.0", 1, p.num_nodes, clock=settle_clock, sleep=settle_clock.sleep),
        heartbeats=Heartbeats(tmp_path, "7.0", 1, p.num_nodes, "n2", timeout_s=60),
    )


def procs(run: NodeRun, vllm: dict, trainer: dict) -> tuple[FakeProc, FakeProc]:
    logs = run.job_dir / "logs"
    return FakeProc(logs / "node1-vllm.log", "vllm", **vllm), FakeProc(logs / "node1-trainer.log", "trainer", **trainer)


def events(run: NodeRun) -> list[str]:
    return [json.loads(x)["event"] for x in run.events.path.read_text().splitlines()]


def test_a_finished_trainer_is_success(node_run):
    v, t = procs(node_run, {}, {"code": 0, "exit_after": 3})
    assert supervise(node_run, v, t, []) == 0
    assert events(node_run) == ["trainer_exit"]


def test_a_dead_server_names_the_node_the_process_and_its_log(node_run):
    v, t = procs(node_run, {"code": -9, "exit_after": 2, "log": "RuntimeError: CUDA out of memory\n"}, {})
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [])
    msg = str(e.value)
    assert msg.startswith("node 1 (n2): vLLM server vllm") and "died with code -9" in msg, msg
    assert "node1-vllm.log" in msg and "CUDA out of memory" in msg, msg
    assert "vllm_exit" in events(node_run)


def test_a_failed_trainer_names_the_rank_that_raised(node_run, settle_clock):
    log = "[rank3]: ValueError: bad reward\n[rank2]: RuntimeError: Connection reset by peer\n"
    v, t = procs(node_run, {}, {"code": 1, "exit_after": 1, "log": log})
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [])
    assert "exited with code 1: ValueError: bad reward" in str(e.value), str(e.value)
    assert not e.value.remote
    # a trainer's own error waits only briefly (3 s) for another node's abort before claiming the failure
    assert sum(settle_clock.slept) == pytest.approx(3.0) and max(settle_clock.slept) <= 0.2, settle_clock.slept


def test_a_rank_that_lost_its_peers_waits_out_the_node_timeout_for_the_real_cause(node_run, settle_clock):
    """A "reset by peer" is a symptom of another node's failure: wait node_timeout_s + 5 s for that node's abort
    (or its heartbeat to stop) before calling this node the first failure."""
    log = "[rank2]: RuntimeError: Connection reset by peer\n"
    v, t = procs(node_run, {}, {"code": 1, "exit_after": 1, "log": log})
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [])
    assert "exited with code 1: RuntimeError: Connection reset by peer" in str(e.value) and not e.value.remote
    assert sum(settle_clock.slept) == pytest.approx(node_run.plan.config.job.node_timeout_s + 5.0), settle_clock.slept


def test_an_abort_written_while_this_node_settles_names_the_other_node(node_run, settle_clock):
    """The settle is there for this: node 0 writes its abort 1 s after this node's trainer died of it."""
    log = "[rank2]: RuntimeError: Connection reset by peer\n"
    v, t = procs(node_run, {}, {"code": 1, "exit_after": 1, "log": log})
    start = settle_clock.now
    other = JobAbort(node_run.job_dir, "7.0", 0, 2)

    def node0_fails() -> None:
        if settle_clock.now - start >= 1.0:
            other.write("n1", "node 0 (n1): vLLM server died")

    settle_clock.during_sleep = node0_fails
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [])
    assert e.value.remote and "because node 0 (n1) failed: node 0 (n1): vLLM server died" in str(e.value), str(e.value)
    assert 1.0 <= sum(settle_clock.slept) <= 1.2 + 1e-9, "it stops at the next poll after the abort, not at the settle's end"


def test_another_nodes_abort_stops_this_node_without_claiming_the_failure(node_run):
    JobAbort(node_run.job_dir, "7.0", 0, 2).write("n1", "node 0 (n1): vLLM server died")
    v, t = procs(node_run, {}, {})
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [])
    assert e.value.remote and "because node 0 (n1) failed: node 0 (n1): vLLM server died" in str(e.value)


def test_a_preemption_signal_is_forwarded_and_a_checkpoint_means_requeue(node_run):
    ck = node_run.job_dir / "checkpoints" / "step-000004"
    ck.mkdir()
    (ck / "meta.json").write_text(json.dumps({"step": 4, "world_size": 2, "reason": "preempt", "attempt": "7.0"}))
    v, t = procs(node_run, {"code": -15}, {"code": 1, "exit_after": 3})  # SLURM stopped the server too
    assert supervise(node_run, v, t, [signal.SIGTERM]) == PREEMPTED_EXIT
    assert t.signals == [signal.SIGUSR2], "the trainer is asked to checkpoint (SIGUSR2), once"
    assert events(node_run)[:2] == ["preempt_signal", "trainer_exit"]


def test_a_preemption_without_its_checkpoint_is_a_failure(node_run, settle_clock):
    v, t = procs(node_run, {}, {"code": 1, "exit_after": 3})
    with pytest.raises(NodeFailure, match=r"after signal 15 \(no preemption checkpoint was written\)"):
        supervise(node_run, v, t, [signal.SIGTERM])
    assert sum(settle_clock.slept) == pytest.approx(3.0), settle_clock.slept


def test_no_step_within_the_stall_timeout_stops_the_node(node_run):
    (node_run.job_dir / "metrics.jsonl").write_text("{}\n")
    old = time.time() - 10
    os.utime(node_run.job_dir / "metrics.jsonl", (old, old))
    v, t = procs(node_run, {}, {})
    t.started = old
    with pytest.raises(NodeFailure, match=r"no training step for 1 s \(trainer.stall_timeout_s\)"):
        supervise(node_run, v, t, [])


def test_a_node_whose_heartbeat_stops_is_named_within_the_timeout(tmp_path):
    clock = Clock()
    lost = Heartbeats(tmp_path, "7.0", 0, 2, "n1", timeout_s=30, clock=clock)
    me = Heartbeats(tmp_path, "7.0", 1, 2, "n2", timeout_s=30, clock=clock)
    for _ in range(10):  # both alive for 20 s: nothing to report
        lost.check()
        me.check()
        clock.now += 2
    assert (tmp_path / "logs" / "heartbeat-7.0" / "node0.json").is_file()
    # node 0 is gone (power loss: it writes nothing more); node 1 keeps checking every poll
    t_lost = clock.now
    with pytest.raises(NodeFailure) as e:
        while clock.now - t_lost < 60:
            me.check()
            clock.now += 0.5
    took = clock.now - t_lost
    # the timeout, counted from the last change node 1 saw (node 0's last beat, up to BEAT_S before it was lost)
    assert 30 - Heartbeats.BEAT_S <= took <= 31, took
    msg = str(e.value)
    assert e.value.remote and "node 0 (n1) stopped answering: no heartbeat for 3" in msg and "job.node_timeout_s=30" in msg, msg


def test_a_node_that_never_started_is_named_after_the_start_grace(tmp_path):
    clock = Clock()
    me = Heartbeats(tmp_path, "7.0", 1, 2, "n2", timeout_s=30, clock=clock)
    me.check()
    clock.now += Heartbeats.NEVER_SEEN_S - 1
    me.check()  # still within the start grace
    clock.now += 2
    with pytest.raises(NodeFailure, match=r"node 0 \(\?\) stopped answering: no heartbeat at all"):
        me.check()


def test_supervise_stops_when_the_other_node_goes_quiet(node_run, monkeypatch):
    clock = Clock()
    other = Heartbeats(node_run.job_dir, "7.0", 0, 2, "n1", timeout_s=1, clock=clock)
    other.beat()
    hb = Heartbeats(node_run.job_dir, "7.0", 1, 2, "n2", timeout_s=1, clock=clock)
    monkeypatch.setattr(bootstrap.time, "sleep", lambda s: setattr(clock, "now", clock.now + s))
    run = NodeRun(
        plan=node_run.plan, node=1, host="n2", attempt="7.0", events=node_run.events, abort=node_run.abort, heartbeats=hb
    )
    v, t = procs(run, {}, {})
    with pytest.raises(NodeFailure, match=r"node 0 \(n1\) stopped answering"):
        supervise(run, v, t, [])


@pytest.mark.parametrize("finished", [True, False])
def test_a_node_that_ended_is_not_called_lost(tmp_path, finished):
    """The same 60 s of silence: a node that said it is ending is left alone; one that did not is lost (the control)."""
    clock = Clock()
    ended = Heartbeats(tmp_path, "7.0", 0, 2, "n1", timeout_s=5, clock=clock)
    me = Heartbeats(tmp_path, "7.0", 1, 2, "n2", timeout_s=5, clock=clock)
    ended.check()
    me.check()
    if finished:
        ended.finish()  # its bootstrap is stopping its processes (its own failure, if any, is in the abort file)
    me.check()  # sees node 0's last write
    clock.now += 60
    if finished:
        me.check()
    else:
        with pytest.raises(NodeFailure, match=r"node 0 \(n1\) stopped answering: no heartbeat for 60 s"):
            me.check()
