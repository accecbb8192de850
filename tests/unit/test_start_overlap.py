"""The trainer starts beside its server (trainer.start_with_server): the bootstrap watches the server's start while the
trainer runs (launcher.node.bootstrap.HealthWatch inside supervise), the trainer's client waits for /health before its
first request (trainer.rollout.server.VllmServer.wait_started), `slurm-grpo status` shows where the start-up stands
and what each phase took, and each node's server keeps its compile caches where a restart finds them.

The server is a real HTTP server on 127.0.0.1 whose /health says 503 until the test makes it healthy (no timing:
the test flips it between polls); the node's processes are the fakes of tests/unit/test_supervise.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from launcher.core import config
from launcher.core.jobdir import JobDir
from launcher.core.plan import plan
from launcher.core.records import Event
from launcher.node.bootstrap import HealthWatch, supervise
from launcher.node.commands import vllm_command
from launcher.node.peers import NodeFailure
from launcher.status import startup_now, startup_phases
from tests.support.fakes import JsonHandler, LocalHttpServer
from tests.unit.test_supervise import FakeProc, events, node_run, procs, settle_clock  # noqa: F401 (fixtures)
from trainer.rollout.server import ServerError, VllmServer


class Health(LocalHttpServer):
    """/health: 503 until `up` is set; counts the asks."""

    def __init__(self) -> None:
        super().__init__(HealthHandler)
        self.up = threading.Event()
        self.asked = 0
        self.up_after = 0
        """> 0: healthy from that ask on (the server comes up while the client waits)."""
        self.posts: list[str] = []
        self.start()


class HealthHandler(JsonHandler):
    server: Health

    def do_GET(self) -> None:
        self.server.asked += 1
        if self.server.up_after and self.server.asked >= self.server.up_after:
            self.server.up.set()
        self.answer({}, 200 if self.server.up.is_set() else 503)

    def do_POST(self) -> None:
        self.server.posts.append(self.path)
        self.answer({"ok": True})


@pytest.fixture
def health():
    srv = Health()
    yield srv
    srv.close()


def test_the_bootstrap_notes_the_server_healthy_while_the_trainer_runs_beside_it(node_run, health):  # noqa: F811 (the fixture)
    """The trainer is running before the server is healthy; supervise writes vllm_healthy (with the seconds since the
    server's start) the first poll /health answers, then goes on watching the trainer until it ends."""
    v, t = procs(node_run, {}, {"code": 0, "exit_after": 6})
    watch = HealthWatch(v, health.url, 60, node_run.where)
    v.poll = lambda: health.up.set() if health.asked >= 2 else None  # type: ignore[method-assign]
    assert supervise(node_run, v, t, [], watch) == 0
    assert events(node_run) == ["vllm_healthy", "trainer_exit"]
    assert watch.took is not None and health.asked == 3, "asked until healthy, then never again"


def test_a_server_that_exits_while_the_trainer_starts_beside_it_is_named_as_never_healthy(node_run, health):  # noqa: F811 (the fixture)
    v, t = procs(node_run, {"code": 1, "exit_after": 2, "log": "RuntimeError: Engine core initialization failed\n"}, {})
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [], HealthWatch(v, health.url, 60, node_run.where))
    msg = str(e.value)
    assert "vLLM server vllm" in msg and "exited with code 1 before it was healthy" in msg, msg
    assert "Engine core initialization failed" in msg and "node1-vllm.log" in msg, msg


def test_the_server_start_deadline_holds_while_the_trainer_runs(node_run, health, monkeypatch):  # noqa: F811 (the fixture)
    v, t = procs(node_run, {}, {})
    watch = HealthWatch(v, health.url, 5, node_run.where)
    watch.t0 -= 6  # started 6 s ago, deadline 5 s
    with pytest.raises(NodeFailure) as e:
        supervise(node_run, v, t, [], watch)
    assert "not healthy at" in str(e.value) and "after 5 s (vllm.health_timeout_s)" in str(e.value), e.value


def test_a_signal_before_the_server_is_healthy_stops_the_node_as_before(node_run, health):  # noqa: F811 (the fixture)
    v, t = procs(node_run, {}, {})
    with pytest.raises(NodeFailure, match="stopped by signal 15 before training started"):
        supervise(node_run, v, t, [15], HealthWatch(v, health.url, 60, node_run.where))


def test_the_trainers_first_request_waits_for_the_servers_health_then_never_again(health, monkeypatch):
    monkeypatch.setattr(VllmServer, "START_POLL_S", 0.01)
    client = VllmServer(health.url, "m", 0, timeout_s=10, start_timeout_s=60)
    health.up_after = 3  # the server comes up while the first request waits
    client.pause_keep(step=0)
    assert health.asked == 3 and health.posts == ["/pause?mode=keep"]
    asked = health.asked
    client.resume(step=1)
    assert health.asked == asked and client.start_deadline is None, "the wait happens before the first request only"
    assert client.requests_sent == 2, "the health polls are not the trainer's requests"


def test_a_server_that_never_starts_fails_the_trainers_first_request_at_its_deadline(health, monkeypatch):
    monkeypatch.setattr(VllmServer, "START_POLL_S", 0.01)
    client = VllmServer(health.url, "m", 3, timeout_s=10, start_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        client.prompt_logprobs([1, 2], step=0)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert msg.startswith("node 3: vLLM server http://127.0.0.1:") and "not healthy 0 s after the trainer started" in msg
    assert "(vllm.health_timeout_s); see logs/node3-vllm.log" in msg and health.posts == []


def test_a_client_of_a_server_already_up_never_asks_for_health(health):
    health.up.set()
    client = VllmServer(health.url, "m", 0, timeout_s=10)
    client.resume()
    assert health.asked == 0 and health.posts == ["/resume"]


def write_events(job: Path, node: int, stamps: list[tuple[Event, float]]) -> None:
    (job / "logs").mkdir(parents=True, exist_ok=True)
    with open(JobDir(job).events(node), "a") as f:
        for event, t in stamps:
            f.write(json.dumps({"t": t, "node": node, "event": str(event)}) + "\n")


def test_status_shows_where_the_start_up_stands_and_what_each_phase_took(tmp_path):
    e = Event
    write_events(tmp_path, 0, [(e.BOOTSTRAP_START, 100.0), (e.VLLM_START, 101.0), (e.TRAINER_START, 101.5)])
    assert startup_now(tmp_path, 0, now=131.0) == "vLLM starting (30 s); trainer launched"
    write_events(tmp_path, 0, [(e.RENDEZVOUS_DONE, 110.0), (e.MODEL_LOADED, 115.0)])
    assert startup_now(tmp_path, 0, now=131.0) == "vLLM starting (30 s); trainer loaded and sharded"
    write_events(tmp_path, 0, [(e.VLLM_HEALTHY, 160.0)])
    assert startup_now(tmp_path, 0, now=161.0) == "vLLM healthy; trainer loaded and sharded"
    write_events(tmp_path, 0, [(e.FIRST_STEP, 163.5)])
    assert startup_now(tmp_path, 0) is None, "started: nothing to show"
    phases = startup_phases(tmp_path, 0)
    assert phases["server start"] == 59.0 and phases["trainer launch + rendezvous"] == 8.5
    assert phases["model load + shard"] == 5.0 and phases["total to step 1"] == 63.5
    assert phases["trainer loaded, waiting for vLLM"] == 45.0 and phases["vLLM healthy -> step 1"] == 3.5
    assert phases["trainer build + wait + first step"] == 48.5 and "trainer build + first step" not in phases
    # a restart (a new attempt in the same file) starts over
    write_events(tmp_path, 0, [(e.BOOTSTRAP_START, 300.0), (e.VLLM_START, 300.5)])
    assert startup_now(tmp_path, 0, now=310.5) == "vLLM starting (10 s); trainer not launched yet"
    assert startup_phases(tmp_path, 0) == {}


def test_each_nodes_server_keeps_its_compile_caches_in_the_job_folder_or_the_named_cache_dir(tmp_path):
    def cache_env(**vllm: object) -> list[dict[str, str]]:
        cfg = config.from_dict(
            {
                "job": {"device": "cpu"},
                "slurm": {"nodes": 2, "gpus_per_node": 2},
                "vllm": {"model": "m", **vllm},
                "trainer": {"dtype": "float32"},
            }
        )
        p = plan(cfg, str(tmp_path / "job"))
        keys = ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
        return [{k: vllm_command(p, n).env[k] for k in keys} for n in range(2)]

    job = tmp_path / "job"
    assert cache_env() == [
        {
            "VLLM_CACHE_ROOT": f"{job}/cache/node{n}/vllm",
            "TORCHINDUCTOR_CACHE_DIR": f"{job}/cache/node{n}/inductor",
            "TRITON_CACHE_DIR": f"{job}/cache/node{n}/triton",
        }
        for n in range(2)
    ]
    assert cache_env(cache_dir="/shared/cache")[1]["VLLM_CACHE_ROOT"] == "/shared/cache/node1/vllm"
    with pytest.raises(config.ConfigError, match="vllm.cache_dir 'rel/cache' must be an absolute path"):
        cache_env(cache_dir="rel/cache")


def test_the_plan_gives_the_trainer_the_servers_start_deadline_only_when_it_starts_beside_it(tmp_path):
    pytest.importorskip("torch")
    import torch

    from trainer.rollout.node import GenerationSettings

    def settings(**trainer: object) -> GenerationSettings:
        cfg = config.from_dict(
            {"job": {"device": "cpu"}, "vllm": {"model": "m", "health_timeout_s": 77}, "trainer": {"dtype": "float32", **trainer}}
        )
        return GenerationSettings.from_plan(plan(cfg, str(tmp_path)), 0, torch.float32)

    assert settings().server_start_timeout_s == 77.0 and settings().parity_every == 10
    assert settings(start_with_server=False).server_start_timeout_s == 0.0
    assert settings(parity_every=1).parity_every == 1


def test_a_compile_cache_path_a_compiler_would_split_moves_to_a_stable_temp_folder(tmp_path):
    """Inductor passes the cache path to g++ unquoted: a job folder with a space kept every CPU compile failing
    (seen on the cluster tier). Such folders get a stable per-job folder in the temp dir; plain ones stay in the job."""
    from launcher.core.jobdir import JobDir

    plain = JobDir(tmp_path / "job-1").compile_cache(0)
    assert plain == tmp_path / "job-1" / "cache" / "node0"
    spaced = JobDir(tmp_path / "rank death").compile_cache(1)
    assert " " not in str(spaced) and spaced.name == "node1" and spaced.parent.name.startswith("slurm-grpo-cache-")
    assert spaced == JobDir(tmp_path / "rank death").compile_cache(1), "a restart must find the same folder"
    assert JobDir(tmp_path / "other job").compile_cache(1) != spaced


@pytest.mark.parametrize(("shared", "fixed"), [(True, False), (False, False), (True, True)])
def test_a_resume_on_a_gpu_shared_with_vllm_waits_for_the_server_before_loading_its_checkpoint(
    health, monkeypatch, shared, fixed
):
    """NodeRollout.before_resume (the callback's on_train_begin, before checkpoint.load): where vLLM shares the GPU,
    the optimizer state must not land while vLLM profiles its KV cache (a 2.8 B restart on an H100 got -9.7 GiB and
    never started): every rank waits for /health first. On a GPU of its own the load goes on beside the start, and on
    a shared one too where the server was given the KV cache size its first start measured (launcher.node.kv_reuse)."""
    from types import SimpleNamespace

    from trainer.rollout.node import NodeRollout

    monkeypatch.setattr(VllmServer, "START_POLL_S", 0.01)
    rollout = object.__new__(NodeRollout)  # only what before_resume reads: the settings and the starting server
    rollout.settings = SimpleNamespace(server_shares_gpu=shared, server_kv_fixed=fixed)  # type: ignore[assignment]
    rollout.server_start = VllmServer(health.url, "m", 0, timeout_s=10, start_timeout_s=60)
    health.up_after = 3
    rollout.before_resume()
    if shared and not fixed:
        assert health.up.is_set() and health.asked == 3 and rollout.server_start is None
    else:
        assert health.asked == 0 and rollout.server_start is not None, "no wait: the first step waits instead"
