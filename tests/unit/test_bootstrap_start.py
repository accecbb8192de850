"""The node's bootstrap at the start of a job, at its process boundary: a vLLM server that never becomes healthy or
exits before it is, the command-line errors of `python -m launcher.node.bootstrap` (a sweep task without its array index,
a node index outside the plan), and torchrun's --shutdown-timeout dropped for a torch that lacks it.

The server is a fake vLLM package first on PYTHONPATH (tests/support/fakes.py), started by the bootstrap's own
`python -m vllm.entrypoints.openai.api_server ...` command line."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from launcher.core import config as C
from launcher.core.jobdir import write_job_dir
from launcher.core.plan import plan
from launcher.node.bootstrap import torchrun_compatible
from launcher.node.commands import trainer_command
from tests.conftest import PY, REPO
from tests.support.fakes import FakeVllm, clean_env, fake_vllm, free_ports

HEALTH_TIMEOUT_S = 2


def cpu_config(tmp_path: Path, model: str, trainer: dict | None = None, **vllm: object) -> C.JobConfig:
    vport, rdzv, weights = free_ports(3)
    return C.from_dict(
        {
            "job": {"device": "cpu"},
            "vllm": {"model": model, "port": vport, "dtype": "float32", **vllm},
            "slurm": {"nodes": 1, "gpus_per_node": 3},
            "trainer": {
                "dataset": str(REPO / "data/letters.jsonl"),
                "dtype": "float32",
                "rendezvous_port": rdzv,
                "weight_transfer_port": weights,
                **(trainer or {}),
            },
        }
    )


def job(tmp_path: Path, model: str, **trainer: object) -> Path:
    cfg = cpu_config(tmp_path, model, trainer, health_timeout_s=HEALTH_TIMEOUT_S)
    d = tmp_path / "job"
    write_job_dir(cfg, plan(cfg, str(d)))
    return d


def bootstrap(*args: str, fake: FakeVllm | None = None, **env: str) -> subprocess.CompletedProcess:
    extra = {"PYTHONPATH": fake.pythonpath()} if fake else {}
    return subprocess.run(
        [PY, "-m", "launcher.node.bootstrap", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(**extra, **env),
        timeout=120,
    )


def events(d: Path) -> list[str]:
    f = d / "logs" / "node0-events.jsonl"
    return [json.loads(x)["event"] for x in f.read_text().splitlines()] if f.exists() else []


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_server_that_never_becomes_healthy_fails_at_the_deadline_naming_node_url_and_log(tmp_path, tiny_model):
    fake = fake_vllm(tmp_path, "fake vLLM: loading the weights, slowly", exit_code=None)  # answers 503, forever
    d = job(tmp_path, tiny_model)
    port = json.loads((d / "plan.json").read_text())["vllm_port"]
    r = bootstrap(str(d / "plan.json"), "--node", "0", fake=fake)
    assert r.returncode == 1, r.stdout + r.stderr
    (start,) = fake.starts
    pid = int(start.split()[0])
    log = d / "logs" / "node0-vllm.log"
    assert (
        f"node 0 ({socket.gethostname()}): vLLM server vllm (pid {pid}, log {log}) not healthy at "
        f"http://127.0.0.1:{port} after {HEALTH_TIMEOUT_S} s (vllm.health_timeout_s)"
    ) in r.stderr, r.stderr
    tail = r.stderr[r.stderr.index(f"last lines of {log}:") :]
    assert tail.rstrip().endswith("\n    fake vLLM: loading the weights, slowly"), tail  # what the server printed last
    # no engine core line in its log: the way out of a forked engine core that hangs is named
    assert "hint: the engine core never logged" in r.stderr and "--set vllm.engine_start=spawn" in r.stderr, r.stderr
    ev = events(d)
    # the trainer started beside the server (trainer.start_with_server) and was stopped with it
    assert "vllm_start" in ev and "vllm_healthy" not in ev and "trainer_start" in ev and "failed" in ev, ev
    assert not alive(pid), "the server outlived its node's failure"
    trainer_pid = next(
        json.loads(x)["pid"] for x in (d / "logs" / "node0-events.jsonl").read_text().splitlines() if '"trainer_start"' in x
    )
    assert not alive(trainer_pid), "the trainer outlived its node's failure"
    abort = list((d / "logs").glob("abort-*.json"))
    assert len(abort) == 1 and "not healthy" in abort[0].read_text()  # the other nodes stop too


@pytest.mark.parametrize(
    "say, code, hint",
    [
        ("ERROR [plugins] Failed to load plugin slurm_grpo: No module named 'trainer'", 1, True),
        ("RuntimeError: Engine core initialization failed. See root cause above.", 3, False),
    ],
)
def test_a_server_that_exits_before_it_is_healthy_is_named_with_its_code_and_log(tmp_path, tiny_model, say, code, hint):
    fake = fake_vllm(tmp_path, say, exit_code=code)
    d = job(tmp_path, tiny_model, start_with_server=False)  # the trainer waits for the server's health: never started
    port = json.loads((d / "plan.json").read_text())["vllm_port"]
    r = bootstrap(str(d / "plan.json"), "--node", "0", fake=fake)
    assert r.returncode == 1, r.stdout + r.stderr
    (start,) = fake.starts
    log = d / "logs" / "node0-vllm.log"
    assert (
        f"vLLM server vllm (pid {start.split()[0]}, log {log}) exited with code {code} before it was healthy at "
        f"http://127.0.0.1:{port}"
    ) in r.stderr, r.stderr
    assert ("hint: the project's vLLM plugin did not load" in r.stderr) is hint, r.stderr
    assert f"last lines of {log}:" in r.stderr and say in r.stderr
    assert "trainer_start" not in events(d)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bootstrap: "), r.stderr
    return lines[0]


@pytest.mark.parametrize(
    "task, needle",
    [
        (None, "SLURM_ARRAY_TASK_ID is not set; a sweep runs as a SLURM job array"),
        ("x7", "SLURM_ARRAY_TASK_ID='x7' is not a task index"),
        ("5", "point-005/plan.json' not found"),
    ],
)
def test_a_sweep_task_without_its_point_fails_in_one_line(tmp_path, task, needle):
    env = {"SLURM_ARRAY_TASK_ID": task} if task is not None else {}
    line = one_line_error(bootstrap("--sweep", str(tmp_path / "sweep"), **env))
    assert needle in line, line


def test_a_node_index_outside_the_plan_fails_in_one_line_and_starts_nothing(tmp_path, tiny_model):
    d = job(tmp_path, tiny_model)
    line = one_line_error(bootstrap(str(d / "plan.json"), "--node", "1"))
    assert "node index 1 (--node) is outside the plan's 1 node(s), 0..0" in line and "pass --node 0..0" in line, line
    line = one_line_error(bootstrap(str(d / "plan.json"), SLURM_NODEID="3"))  # srun's node id of a bigger allocation
    assert "node index 3 ($SLURM_NODEID) is outside the plan's 1 node(s)" in line, line
    line = one_line_error(bootstrap(str(d / "plan.json"), SLURM_NODEID="n1"))
    assert "SLURM_NODEID='n1' is not a node index; pass --node N" in line, line
    assert events(d) == []  # nothing ran


def fake_torch(root: Path, version: str) -> Path:
    """An installed-package record for torch `version` (what importlib.metadata reads), first on sys.path."""
    info = root / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return root


@pytest.mark.parametrize(
    "version, dropped",
    [("2.11.0", True), ("2.9.1+cu128", True), ("2.12.0", False), ("2.13.0+cu130", False), ("nightly", False)],
)
def test_torchrun_shutdown_timeout_is_dropped_for_a_torch_before_2_12(tmp_path, monkeypatch, version, dropped):
    cfg = cpu_config(tmp_path, "/m")
    argv = trainer_command(plan(cfg, str(tmp_path / "job")), 0, "127.0.0.1", "python").argv
    monkeypatch.syspath_prepend(str(fake_torch(tmp_path / "site", version)))
    from importlib.metadata import version as installed

    assert installed("torch") == version  # the record this test made is the one found
    i = argv.index("--shutdown-timeout")
    without = argv[:i] + argv[i + 2 :]  # the flag and its value, nothing else
    assert torchrun_compatible(argv) == (without if dropped else argv)
    assert torchrun_compatible(without) == without  # an argv without the flag is left alone
