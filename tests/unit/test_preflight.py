"""Bad inputs on a node fail before anything starts: the real bootstrap, run as on a node, against a port
that is taken, a model folder that is missing or incomplete, a dataset that is missing or malformed.
Each must exit non-zero within seconds, name the node and the file or port, and start no vLLM server.

Ports are checked twice before anything starts: launcher.node.stale names a holder it can see in /proc (pid, user, job),
then the bootstrap's own preflight binds each port, the only guard against a holder /proc cannot show (another user's
process, another PID namespace's)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core.config import redact_argv
from launcher.core.jobdir import Events, write_job_dir
from launcher.core.plan import Plan, plan
from launcher.node.bootstrap import NodeRun, preflight
from launcher.node.peers import Heartbeats, JobAbort, NodeFailure
from tests.conftest import PY, REPO
from tests.support.fakes import clean_env, fake_vllm, free_ports


def job(tmp_path: Path, model: str, dataset: str, port: int | None = None, nodes: int = 1) -> Path:
    """A job folder for one node; `port`: the vllm.port (the other two ports are free ones)."""
    rdzv, weights, vport = free_ports(3)
    cfg = C.from_dict(
        {
            "job": {"device": "cpu"},
            "vllm": {"model": model, "port": vport if port is None else port, "dtype": "float32"},
            "slurm": {"nodes": nodes, "gpus_per_node": 3},
            "trainer": {"dataset": dataset, "dtype": "float32", "rendezvous_port": rdzv, "weight_transfer_port": weights},
        }
    )
    d = tmp_path / "job"
    write_job_dir(cfg, plan(cfg, str(d)))
    return d


@dataclass
class Booted:
    returncode: int
    stderr: str
    vllm_starts: list[str]
    """Each start of the (fake) vLLM server: none when the node failed before starting anything."""


def bootstrap(d: Path, wrap: tuple[str, ...] = ()) -> tuple[Booted, float]:
    """The node's bootstrap as node 0, outside any SLURM allocation the tests may run in. A fake vLLM server (which
    exits at once) stands first on PYTHONPATH: a check that lets a bad input through costs no real server start,
    and assert_failed_before_start sees the start."""
    fake = fake_vllm(d.parent, "fake vLLM: started", exit_code=1)
    t0 = time.time()
    r = subprocess.run(
        [*wrap, PY, "-m", "launcher.node.bootstrap", str(d / "plan.json"), "--node", "0"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(PYTHONPATH=fake.pythonpath()),
        timeout=120,
    )
    return Booted(r.returncode, r.stderr, fake.starts), time.time() - t0


def assert_failed_before_start(d: Path, r: Booted, took: float, *needles: str) -> None:
    assert r.returncode != 0
    assert took < 30, took
    for n in ("node 0", *needles):
        assert n in r.stderr, (n, r.stderr)
    events = [json.loads(x)["event"] for x in (d / "logs" / "node0-events.jsonl").read_text().splitlines()]
    assert "vllm_start" not in events and "failed" in events, events
    assert r.vllm_starts == [], r.vllm_starts


def copy_model(tiny_model: str, dst: Path) -> Path:
    shutil.copytree(tiny_model, dst)
    return dst


def test_a_port_holder_visible_in_proc_is_named_by_the_stale_check(tmp_path, tiny_model):
    """A listener in /proc (this test's own socket) is found by launcher.node.stale before preflight binds: the message
    names the holder's pid and user, and that it is not this job's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = job(tmp_path, tiny_model, str(REPO / "data/letters.jsonl"), port=port)
        r, took = bootstrap(d)
    assert_failed_before_start(d, r, took, f"port {port} (vllm.port) is already in use by pid {os.getpid()} (uid {os.getuid()}")
    assert "not this job's: stop it" in r.stderr and "already in use on this node" not in r.stderr, r.stderr


def node_run(d: Path, node: int = 0) -> NodeRun:
    p = Plan.load(d / "plan.json")
    return NodeRun(
        plan=p,
        node=node,
        host="testhost",
        attempt="t.0",
        events=Events(d, node),
        abort=JobAbort(d, "t.0", node, p.num_nodes),
        heartbeats=Heartbeats(d, "t.0", node, p.num_nodes, "testhost", 30),
    )


@pytest.mark.parametrize("key", ["vllm.port", "trainer.rendezvous_port", "trainer.weight_transfer_port"])
def test_preflight_binds_every_port_and_names_the_one_taken(tmp_path, tiny_model, key):
    """The real check (launcher.node.bootstrap.preflight), no /proc involved: a listener on any of the node's three ports
    fails it naming the node, the port, the key and how to find the holder; with the port free it passes."""
    d = job(tmp_path, tiny_model, str(REPO / "data/letters.jsonl"))
    run = node_run(d)
    p = run.plan
    port = {"vllm.port": p.vllm_port, "trainer.rendezvous_port": p.rendezvous_port,
            "trainer.weight_transfer_port": p.nodes[0].weight_transfer_port}[key]  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(NodeFailure) as got:
            preflight(run)
    assert str(got.value) == (
        f"node 0 (testhost): port {port} ({key}) is already in use on this node; "
        f"stop what holds it (`ss -ltnp 'sport = :{port}'`) or pick another port in the config"
    )
    preflight(run)  # the same ports, free again: passes (model and dataset are good)


def test_only_the_first_node_needs_the_rendezvous_port(tmp_path, tiny_model):
    d = job(tmp_path, tiny_model, str(REPO / "data/letters.jsonl"), nodes=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", Plan.load(d / "plan.json").rendezvous_port))
        s.listen()
        preflight(node_run(d, node=1))  # node 1 connects to the rendezvous port of node 0's host; it binds none
        with pytest.raises(NodeFailure, match=r"^node 0 \(testhost\): port \d+ \(trainer.rendezvous_port\) is already in use"):
            preflight(node_run(d, node=0))


def private_pid_namespace() -> tuple[str, ...]:
    """A wrapper that runs a command in new PID and mount namespaces (a user namespace too, so no root is needed) with
    its own /proc and an empty /dev/shm: /proc there shows none of this machine's processes, as a node's /proc shows
    no other container's, and launcher.node.stale's shared-memory sweep sees only the empty /dev/shm."""
    exe = shutil.which("unshare")
    wrap = (exe or "unshare", "-Urpf", "--mount-proc", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh")
    try:
        ok = exe is not None and subprocess.run([*wrap, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("unshare -Urpf --mount-proc is not permitted here (user namespaces off)")
    return wrap


def test_a_port_holder_proc_cannot_show_is_caught_by_preflight(tmp_path, tiny_model):
    """The holder (this test) is invisible to the bootstrap's /proc: launcher.node.stale finds nobody, and the preflight
    bind is what stops the node, naming the port and the `ss` command that shows the holder."""
    wrap = private_pid_namespace()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = job(tmp_path, tiny_model, str(REPO / "data/letters.jsonl"), port=port)
        r, took = bootstrap(d, wrap)
    assert_failed_before_start(
        d, r, took, f"port {port} (vllm.port) is already in use on this node; stop what holds it (`ss -ltnp 'sport = :{port}'`)"
    )
    assert "in use by pid" not in r.stderr, r.stderr  # the stale check did not see it: this was preflight's catch


@pytest.mark.parametrize(
    "breakage, needles",
    [
        ("missing", ["no such folder", "gone"]),
        ("no weights", ["missing weights"]),
        ("no config", ["missing config.json"]),
        ("no tokenizer", ["missing a tokenizer's vocabulary (tokenizer.json, or tokenizer.model"]),
        ("config not JSON", ["config.json is unreadable (Expecting"]),
    ],
)
def test_model_folder(tmp_path, tiny_model, breakage, needles):
    m = copy_model(tiny_model, tmp_path / "model")
    if breakage == "missing":
        m = m.rename(tmp_path / "gone")
        shutil.rmtree(m)
    elif breakage == "no weights":
        for f in m.glob("*.safetensors"):
            f.unlink()
    elif breakage == "no tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"):
            (m / f).unlink(missing_ok=True)
    elif breakage == "config not JSON":
        (m / "config.json").write_text('{"model_type": "qwen2", "hidden_size": ')
    else:
        (m / "config.json").unlink()
    d = job(tmp_path, str(m), str(REPO / "data/letters.jsonl"))
    r, took = bootstrap(d)
    assert_failed_before_start(d, r, took, "vllm.model", *needles)


@pytest.mark.parametrize(
    "content, needles",
    [
        ('{"prompt": "ok"}\n{"prompt": "fine"}\n{"prompt": broken\n', ["line 3 is not valid JSON"]),
        ('{"prompt": "ok"}\n{"text": "no prompt"}\n', ["line 2 has no 'prompt' field"]),
        ("\n\n", ["is empty"]),
    ],
)
def test_malformed_dataset(tmp_path, tiny_model, content, needles):
    data = tmp_path / "bad data.jsonl"
    data.write_text(content)
    d = job(tmp_path, tiny_model, str(data))
    r, took = bootstrap(d)
    assert_failed_before_start(d, r, took, "bad data.jsonl", *needles)


def test_missing_dataset(tmp_path, tiny_model):
    d = job(tmp_path, tiny_model, str(tmp_path / "nowhere.jsonl"))
    r, took = bootstrap(d)
    assert_failed_before_start(d, r, took, "nowhere.jsonl", "does not exist")


def test_secret_flags_are_redacted_where_commands_are_shown():
    argv = ["python", "-m", "vllm", "--hf-token", "hf_PLANTED", "--api-key=sk-PLANTED", "--model", "/m"]
    shown = redact_argv(argv)
    assert "hf_PLANTED" not in " ".join(shown) and "sk-PLANTED" not in " ".join(shown)
    assert shown[-2:] == ["--model", "/m"] and "--hf-token" in shown
