"""Integration tier: real vLLM CPU servers, real torch.distributed (gloo), the real bootstrap.
Servers take about a minute to start on 2 cores, so each test here is one whole local run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import PY, REPO

pytestmark = pytest.mark.integration


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def local(job_dir: Path, model: str, *sets: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "launcher", "local", "configs/smoke_cpu.yaml", "--set", f"vllm.model={model}",
                           "--set", f"job.job_dir={job_dir}", *[x for s in sets for x in ("--set", s)]],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_local_run_learns_pushes_land_and_resume_continues(tmp_path, tiny_model):
    job = tmp_path / "run"
    r = local(job, tiny_model, "trainer.max_steps=16", "trainer.save_steps=8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((job / "summary.json").read_text())
    # real FSDP2: every trained parameter is a DTensor
    assert s["dtensor_params"]["dtensor"] == s["dtensor_params"]["total"] > 0
    hist = s["nodes"]["0"]["parity_history"]
    after = [h["max_diff"] for h in hist if h["kind"] == "after_push"]
    stale = [h["max_diff"] for h in hist if h["kind"] == "stale"]
    assert after and max(after) <= 1e-4, after  # the server holds the trainer's weights after every push
    assert min(stale) > 1e-3, stale  # ... and each push really changed what the server computes
    assert s["nodes"]["0"]["parity_final"] <= 1e-4
    assert (job / "metrics.png").stat().st_size > 1000
    assert "step 16/16" in r.stdout  # the progress lines

    # resume: run on to step 24 in the same job folder
    r = local(job, tiny_model, "trainer.max_steps=24", "trainer.save_steps=8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read(job / "metrics.jsonl")
    resumed = [x for x in rows if x.get("event") == "resumed"]
    assert resumed and resumed[0]["from_step"] == 16
    steps = [x["step"] for x in rows if "reward" in x]
    assert steps == list(range(1, 25)), steps  # no step lost, none done twice
    # optimizer state continued: Adam's step count in the last checkpoint is 24, not 8
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(job / "checkpoints" / "step-000024"), str(tmp_path / "ck.pt"))
    osd = torch.load(tmp_path / "ck.pt", weights_only=False)["optim"]["state"]
    adam_steps = {float(v["step"]) for v in osd.values()}
    assert adam_steps == {24.0}, adam_steps
    rewards = [x["reward"] for x in rows if "reward" in x]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"reward first 5 {first:.3f} -> last 5 {last:.3f}")
    assert last > first + 0.05, (first, last)


def test_killed_server_stops_the_run_fast_and_names_it(tmp_path, tiny_model):
    job = tmp_path / "kill"
    p = subprocess.Popen([PY, "-m", "launcher", "local", "configs/smoke_cpu.yaml", "--set", f"vllm.model={tiny_model}",
                          "--set", f"job.job_dir={job}", "--set", "trainer.max_steps=500", "--set", "trainer.save_steps=2"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and not [x for x in read(job / "metrics.jsonl") if x.get("step", 0) >= 3]:
        assert p.poll() is None, p.communicate()
        time.sleep(1)
    ev = read(job / "logs" / "node0-events.jsonl")
    vllm_pid = [e["pid"] for e in ev if e["event"] == "vllm_start"][-1]
    trainer_pid = [e["pid"] for e in ev if e["event"] == "trainer_start"][-1]
    t0 = time.time()
    os.killpg(vllm_pid, signal.SIGKILL)
    out, err = p.communicate(timeout=180)
    took = time.time() - t0
    print(f"server killed -> bootstrap exited {p.returncode} after {took:.1f} s")
    assert p.returncode != 0
    assert "node 0" in err and "vLLM server" in err and "node0-vllm.log" in err, err[-2000:]
    assert took < 120
    # nothing left behind: neither the server's group nor torchrun's
    for pgid in (vllm_pid, trainer_pid):
        alive = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
        assert not alive, f"processes of group {pgid} still alive: {alive}"
    # the last checkpoint is complete and loadable metadata-wise
    from trainer.checkpoint import latest

    found = latest(job / "checkpoints")
    assert found is not None and json.loads((found[1] / "meta.json").read_text())["step"] == found[0]
