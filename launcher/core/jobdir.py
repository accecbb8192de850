"""The job folder: created owner-only, holding config.yaml, plan.json, logs/, checkpoints/, metrics."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from launcher.core.config import JobConfig, to_yaml
from launcher.core.plan import Plan, plan

# Secrets that must never be written into the job folder, the sbatch text or the logs. The job
# inherits them from the submitting environment through SLURM (sbatch exports the environment).
SECRET_ENV_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "API_KEY", "CREDENTIAL")

WANDB_ID_FILE = "wandb_run_id"
"""The job's one W&B run id, written once with the folder: every attempt (requeue, resume) continues that run."""


def resolve_job_dir(cfg: JobConfig, now: float | None = None) -> Path:
    if cfg.job.job_dir:
        return Path(cfg.job.job_dir).expanduser().absolute()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return (Path("runs") / f"{cfg.job.name}-{stamp}").absolute()


def make_plan(cfg: JobConfig, now: float | None = None) -> Plan:
    return plan(cfg, str(resolve_job_dir(cfg, now)))


def write_job_dir(cfg: JobConfig, p: Plan) -> Path:
    """Create the job folder (mode 0700: logs and checkpoints are the owner's only) and write the inputs."""
    d = Path(p.job_dir)
    old = os.umask(0o077)
    try:
        for sub in ("", "logs", "checkpoints", "submitit"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        (d / "config.yaml").write_text(to_yaml(cfg))
        (d / "plan.json").write_text(p.to_json())
        if not (d / WANDB_ID_FILE).is_file():  # W&B's own id format: 8 of [a-z0-9]
            alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
            (d / WANDB_ID_FILE).write_text("".join(secrets.choice(alphabet) for _ in range(8)) + "\n")
    finally:
        os.umask(old)
    return d


def is_secret(name: str) -> bool:
    up = name.upper()
    return any(m in up for m in SECRET_ENV_MARKERS)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under root, oldest first. A folder counts only once
    its meta.json exists (written last); step-N.tmp folders of an interrupted write never count."""
    out = []
    for d in Path(root).glob("step-*"):
        if d.is_dir() and not d.name.endswith(".tmp") and (d / "meta.json").is_file():
            try:
                out.append((int(d.name.split("-")[1]), d))
            except ValueError:
                continue
    return sorted(out)


def checkpoint_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


PREEMPTED_EXIT = 3
"""Exit code of a trainer (and of a node's bootstrap) that checkpointed on a preemption signal: requeue, not failure."""


class Events:
    """logs/node{i}-events.jsonl: phase timestamps (server start, healthy, trainer start, exits). The node's
    bootstrap and its trainer leader both append to it; `slurm-grpo status` reads it."""

    def __init__(self, job_dir: Path, node: int):
        self.path = job_dir / "logs" / f"node{node}-events.jsonl"
        self.node = node

    def __call__(self, event: str, **kw: object) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"t": time.time(), "node": self.node, "event": event, **kw}) + "\n")
