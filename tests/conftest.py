"""Shared fixtures. Tiers by marker: default (unit, no servers), integration (real vLLM CPU servers,
real torch.distributed), cluster (the real SLURM cluster of scripts/start_cluster.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture
def weird_tmp_path(tmp_path: Path) -> Path:
    """A folder whose path has spaces and quotes: job folders must still work (shlex quoting)."""
    p = tmp_path / "job dir with 'quotes' and \"double\" $(echo no)"
    p.mkdir()
    return p


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Qwen2 built once per session with the project's own command."""
    d = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([PY, "-m", "launcher", "make-tiny-model", str(d)], check=True, cwd=REPO, capture_output=True)
    return str(d)


def cli(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "launcher", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})}
    )


def read(path: Path) -> list[dict]:
    """A JSON-lines file (metrics, events) as rows; none yet if it does not exist."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def report(what: str, seconds: float, outcome: int | str) -> None:
    """Injection-to-stop times of the fault tests, collected for the closing note (tests assert bounds,
    not speeds): printed, and appended to $SLURM_GRPO_FAULT_TIMES."""
    line = json.dumps({"fault": what, "seconds": round(seconds, 1), "outcome": outcome})
    print(line)
    with open(os.environ.get("SLURM_GRPO_FAULT_TIMES", "/tmp/slurm-grpo-fault-times.jsonl"), "a") as f:
        f.write(line + "\n")


def assert_tracked(job: Path, attempts: int, steps: int) -> None:
    """One W&B run (the id the launcher wrote into the job folder) with a part per attempt, each holding TRL's and the
    project's figures; TensorBoard events, read back with TensorBoard's own reader, for every step."""
    run_id = (job / "wandb_run_id").read_text().strip()
    parts = sorted((job / "wandb").glob("offline-run-*"))
    assert len(parts) == attempts and all(p.name.endswith("-" + run_id) for p in parts), (run_id, parts)
    for p in parts:
        log = (p / f"run-{run_id}.wandb").read_bytes()
        assert b"train/reward" in log and b"slurm_grpo/push_s/node0" in log and b"slurm_grpo/parity/node0" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(job / "tensorboard"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("train/reward")] == list(range(1, steps + 1))
    parity = tb.Scalars("train/slurm_grpo/parity/node0")
    assert len(parity) == steps and max(e.value for e in parity) <= 1e-4
