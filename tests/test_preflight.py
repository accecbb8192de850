"""Bad inputs on a node fail before anything starts: the real bootstrap, run as on a node, against a port
that is taken, a model folder that is missing or incomplete, a dataset that is missing or malformed.
Each must exit non-zero within seconds, name the node and the file or port, and start no vLLM server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from launcher import config as C
from launcher.commands import redact_argv
from launcher.jobdir import write_job_dir
from launcher.topology import plan

from .conftest import PY, REPO


def job(tmp_path: Path, model: str, dataset: str, port: int = 18000) -> Path:
    cfg = C.from_dict(
        {
            "job": {"device": "cpu"},
            "vllm": {"model": model, "port": port, "dtype": "float32"},
            "slurm": {"nodes": 1, "gpus_per_node": 3},
            "trainer": {"dataset": dataset, "dtype": "float32", "rendezvous_port": port + 1, "weight_transfer_port": port + 2},
        }
    )
    d = tmp_path / "job"
    write_job_dir(cfg, plan(cfg, str(d)))
    return d


def bootstrap(d: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.time()
    r = subprocess.run(
        [PY, "-m", "launcher.bootstrap", str(d / "plan.json")], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    return r, time.time() - t0


def assert_failed_before_start(d: Path, r, took: float, *needles: str) -> None:
    assert r.returncode != 0
    assert took < 30, took
    for n in ("node 0", *needles):
        assert n in r.stderr, (n, r.stderr)
    events = [json.loads(x)["event"] for x in (d / "logs" / "node0-events.jsonl").read_text().splitlines()]
    assert "vllm_start" not in events and "failed" in events, events


def copy_model(tiny_model: str, dst: Path) -> Path:
    shutil.copytree(tiny_model, dst)
    return dst


def test_port_in_use(tmp_path, tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = job(tmp_path, tiny_model, str(REPO / "data/letters.jsonl"), port=port)
        r, took = bootstrap(d)
    assert_failed_before_start(d, r, took, f"port {port}", "vllm.port", "already in use")


@pytest.mark.parametrize(
    "breakage, needles",
    [
        ("missing", ["no such folder", "gone"]),
        ("no weights", ["missing weights"]),
        ("no config", ["missing config.json"]),
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
