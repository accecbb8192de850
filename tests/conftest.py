"""Shared fixtures. Tiers by marker: default (unit, no servers), integration (real vLLM CPU servers,
real torch.distributed), cluster (the real SLURM cluster of scripts/start_cluster.sh)."""

from __future__ import annotations

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
    return subprocess.run([PY, "-m", "launcher", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})
