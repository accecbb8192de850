"""A whole node lost (launcher.node.lost, launcher.node.bootstrap.act_on_lost_nodes): which survivor asks SLURM, what
it asks and in what order, with slurm.requeue on and off, outside SLURM and without scontrol. SLURM is faked at the
process boundary (conftest's fake_slurm: commands on PATH that record their argv and answer as the test says)."""

from __future__ import annotations

import json
import shutil

import pytest

from launcher.core import config
from launcher.core.jobdir import Events
from launcher.core.plan import plan
from launcher.node import lost
from launcher.node.bootstrap import NodeRun, act_on_lost_nodes
from launcher.node.peers import Heartbeats, JobAbort, PeerLost
from tests.conftest import FakeSlurm


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def node_run(tmp_path, node: int, requeue: bool = True, nodes: int = 3, act: str = "requeue_now") -> NodeRun:
    (tmp_path / "logs").mkdir(exist_ok=True)
    cfg = config.from_dict(
        {
            "job": {"device": "cpu"},
            "slurm": {"nodes": nodes, "gpus_per_node": 3, "requeue": requeue, "node_loss_action": act},
            "vllm": {"model": "m"},
            "trainer": {"dtype": "float32"},
        }
    )
    p = plan(cfg, str(tmp_path))
    return NodeRun(
        plan=p,
        node=node,
        host=f"n{node + 1}",
        attempt="77.0",
        events=Events(tmp_path, node),
        abort=JobAbort(tmp_path, "77.0", node, nodes),
        heartbeats=Heartbeats(tmp_path, "77.0", node, nodes, f"n{node + 1}", timeout_s=20),
    )


def asked(run: NodeRun) -> list[dict]:
    return (
        [json.loads(x) for x in run.events.path.read_text().splitlines() if '"slurm_asked"' in x]
        if run.events.path.exists()
        else []
    )


@pytest.fixture
def slurm_job(fake_slurm: FakeSlurm, monkeypatch) -> FakeSlurm:
    """Inside job 77 on n[1-3], which already kept off n9; SLURM's answers as 22.05 gives them."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    fake_slurm.answer("scontrol show hostnames", stdout="n1\nn2\nn3\n")
    fake_slurm.answer(
        "scontrol show job", stdout="JobId=77 JobName=grpo\n   ReqNodeList=(null) ExcNodeList=n9\n   NodeList=n[1-3]\n"
    )
    return fake_slurm


def argvs(fake: FakeSlurm) -> list[list[str]]:
    return [[c["cmd"], *c["argv"]] for c in fake.calls()]


def test_the_lowest_index_survivor_asks():
    assert lost.asker(3, {1}) == 0
    assert lost.asker(3, {0}) == 1  # the batch host lost: the next node asks
    assert lost.asker(4, {0, 1}) == 2
    assert lost.asker(2, {0, 1}) is None


def test_every_lost_node_is_listed_and_the_first_named(tmp_path):
    clock = Clock()
    beats = [Heartbeats(tmp_path, "77.0", k, 4, f"n{k + 1}", timeout_s=20, clock=clock) for k in range(4)]
    for _ in range(3):
        for b in beats:
            b.check()
        clock.now += 2
    with pytest.raises(PeerLost) as e:  # nodes 1 and 3 went quiet together; node 2 keeps beating
        for _ in range(30):
            clock.now += 1
            beats[2].beat()
            beats[0].check()
    assert e.value.lost == {1: "n2", 3: "n4"} and e.value.remote
    msg = str(e.value)
    assert (
        "node 1 (n2) stopped answering: no heartbeat for 2" in msg
        and "node 2" not in msg.split("also lost")[1]
        and "also lost: node 3 (n4)" in msg
    ), msg


def test_requeue_held_without_the_lost_node_then_released(tmp_path, slurm_job, capsys):
    act_on_lost_nodes(node_run(tmp_path, 0), PeerLost("node 0: stopping, because node 1 (n2) ...", {1: "n2"}))
    assert argvs(slurm_job) == [
        ["scontrol", "show", "hostnames", "n[1-3]"],
        ["scontrol", "show", "job", "77"],
        ["scontrol", "requeuehold", "77"],
        ["scontrol", "update", "JobId=77", "ExcNodeList=n9,n2"],  # added to the job's own exclusion
        ["scontrol", "release", "77"],
    ]
    ev = asked(node_run(tmp_path, 0))
    assert len(ev) == 1 and ev[0]["code"] == 0 and ev[0]["lost"] == "node 1 (n2)", ev
    assert [c["argv"][1] for c in ev[0]["commands"]] == ["show", "show", "requeuehold", "update", "release"]
    assert "asked SLURM to requeue without the lost nodes of job 77" in capsys.readouterr().out


def test_only_the_asker_asks(tmp_path, slurm_job):
    act_on_lost_nodes(node_run(tmp_path, 2), PeerLost("node 2: stopping ...", {1: "n2"}))
    act_on_lost_nodes(node_run(tmp_path, 1), PeerLost("node 1: stopping ...", {0: "n1"}))  # node 1 asks for node 0
    assert argvs(slurm_job)[2:] == [
        ["scontrol", "requeuehold", "77"],
        ["scontrol", "update", "JobId=77", "ExcNodeList=n9,n1"],
        ["scontrol", "release", "77"],
    ]
    assert not asked(node_run(tmp_path, 2)) and len(asked(node_run(tmp_path, 1))) == 1


def test_slurm_host_names_come_from_the_job_node_list_not_the_heartbeat(tmp_path, slurm_job):
    slurm_job.answer("scontrol show hostnames", stdout="gpu001\ngpu002\ngpu003\n")
    slurm_job.answer("scontrol show job", stdout="JobId=77 ExcNodeList=(null)\n")
    act_on_lost_nodes(node_run(tmp_path, 0), PeerLost("...", {1: "gpu002.cluster.example", 2: "?"}))
    assert ["scontrol", "update", "JobId=77", "ExcNodeList=gpu002,gpu003"] in argvs(slurm_job)


def test_without_requeue_the_job_is_cancelled(tmp_path, slurm_job):
    act_on_lost_nodes(node_run(tmp_path, 0, requeue=False), PeerLost("...", {1: "n2"}))
    assert argvs(slurm_job) == [["scancel", "77"]]
    assert asked(node_run(tmp_path, 0))[0]["action"] == "cancel (slurm.requeue is off)"


def test_wait_and_the_default_with_requeue_leave_the_job_to_slurm_and_the_default_without_requeue_cancels(
    tmp_path, slurm_job, capsys
):
    act_on_lost_nodes(node_run(tmp_path, 0, act="wait"), PeerLost("...", {1: "n2"}))
    assert slurm_job.calls() == [] and "slurm.node_loss_action wait" in capsys.readouterr().out
    # auto (the default): SLURM's own requeue, which restarts a GRES job on slurm-wlm 22.05 (requeue_now's does not)
    act_on_lost_nodes(node_run(tmp_path, 0, act="auto"), PeerLost("...", {1: "n2"}))
    assert slurm_job.calls() == [] and "requeue_now would requeue it at once" in capsys.readouterr().out
    act_on_lost_nodes(node_run(tmp_path, 0, requeue=False, act="auto"), PeerLost("...", {1: "n2"}))
    assert argvs(slurm_job) == [["scancel", "77"]]


def test_a_refused_exclusion_is_retried_within_its_deadline_and_the_job_released_anyway(tmp_path, slurm_job):
    slurm_job.answer("scontrol update", stderr="scontrol: error: Job is no longer pending execution\n", rc=1)
    said: list[str] = []
    clock = Clock()
    done = lost.ask("77", "n[1-3]", {1: "n2"}, True, said.append, sleep=clock.sleep, clock=clock)
    updates = [a for a in argvs(slurm_job) if a[1] == "update"]
    assert len(updates) == 1 + int(lost.PENDING_WAIT_S / 0.5), updates  # every 0.5 s until the deadline, no longer
    assert argvs(slurm_job)[-1] == ["scontrol", "release", "77"]  # a held job never starts by itself
    assert [a.code for a in done] == [0, 0, 0, 1, 0]
    assert said == [
        "`scontrol update JobId=77 ExcNodeList=n9,n2` failed (rc 1): scontrol: error: Job is no longer pending execution"
    ]


def test_a_refused_requeue_asks_nothing_more_and_is_logged(tmp_path, slurm_job, capsys):
    slurm_job.answer("scontrol requeuehold", stderr="scontrol: error: Access/permission denied\n", rc=1)
    act_on_lost_nodes(node_run(tmp_path, 0), PeerLost("...", {1: "n2"}))
    assert argvs(slurm_job)[-1] == ["scontrol", "requeuehold", "77"]
    out = capsys.readouterr().out
    assert "`scontrol requeuehold 77` failed (rc 1): scontrol: error: Access/permission denied" in out, out
    assert asked(node_run(tmp_path, 0))[0]["code"] == 1


def test_no_scontrol_on_the_node_keeps_slurms_own_verdict(tmp_path, slurm_job, monkeypatch, capsys):
    for cmd in ("scontrol", "scancel"):
        (slurm_job.bin / cmd).unlink()
    monkeypatch.setenv("PATH", str(slurm_job.bin))  # this machine's own SLURM hidden too
    assert shutil.which("scontrol") is None
    act_on_lost_nodes(node_run(tmp_path, 0), PeerLost("...", {1: "n2"}))
    assert "scontrol/scancel is not on this node" in capsys.readouterr().out
    assert asked(node_run(tmp_path, 0))[0]["code"] == 127


def test_outside_slurm_nothing_is_asked(tmp_path, fake_slurm, capsys):
    act_on_lost_nodes(node_run(tmp_path, 0), PeerLost("...", {1: "n2"}))
    assert fake_slurm.calls() == [] and not asked(node_run(tmp_path, 0))
    assert "node 1 (n2) lost outside SLURM" in capsys.readouterr().out


def test_the_commands_after_the_requeue_outlive_slurmsteps_sigterm():
    """The requeue makes slurmstepd SIGTERM every process of the job: the asker's next commands ignore it."""
    a = lost.run_command(["sh", "-c", 'grep SigIgn /proc/$$/status; kill -TERM $$; echo "still here"'])
    ignored = int(a.stdout.split()[1], 16)
    assert ignored & (1 << (15 - 1)) and "still here" in a.stdout and a.code == 0, a


def test_a_failed_lookup_is_logged_and_the_heartbeat_names_the_lost_host(tmp_path, slurm_job, capsys):
    slurm_job.answer("scontrol show hostnames", stderr="scontrol: error: Unable to contact slurm controller\n", rc=1)
    act_on_lost_nodes(node_run(tmp_path, 0), PeerLost("...", {1: "n2"}))
    assert ["scontrol", "update", "JobId=77", "ExcNodeList=n9,n2"] in argvs(slurm_job)
    assert "`scontrol show hostnames n[1-3]` failed (rc 1): scontrol: error: Unable to contact" in capsys.readouterr().out
    assert asked(node_run(tmp_path, 0))[0]["code"] == 1  # the first failure's code, for whoever reads the event
