"""Experiment tracking (trainer.report_to: wandb, tensorboard) through transformers' own reporting callbacks, which
report on global rank 0 only. Made SLURM-aware here:

  one W&B run per job folder   the launcher writes the run id into the job folder once (launcher.core.jobdir); every
                               attempt (a requeue, `slurm-grpo resume`) continues that run (WANDB_RUN_ID, RESUME=allow)
  offline by default           compute nodes seldom reach the Internet: WANDB_MODE=offline writes the run under the
                               job folder's wandb/, and `slurm-grpo sync JOB` uploads it from the login node
  the project's own figures    per-node push seconds, parity, tokens/s, staleness, ... are added to TRL's log record
                               (under slurm_grpo/) before the reporting callbacks see it, so every tracker gets them
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from launcher.core.config import TrainerConfig
from launcher.core.jobdir import JobDir
from launcher.core.records import StepRow

PREFIX = "slurm_grpo/"


def trackers(t: TrainerConfig) -> list[str]:
    return [r for r in t.report_to if r != "none"]


def set_tracking_env(job_dir: Path, t: TrainerConfig, job_name: str) -> None:
    """Before the trainer is built (transformers reads these when its callbacks start)."""
    used = trackers(t)
    jd = JobDir(job_dir)
    if "wandb" in used:
        os.environ.update(
            WANDB_MODE=t.wandb_mode,
            WANDB_PROJECT=t.wandb_project,
            WANDB_DIR=str(job_dir),  # the run lands in JOB/wandb/
            WANDB_RUN_ID=jd.wandb_id.read_text().strip(),
            WANDB_RESUME="allow",  # the first attempt creates the run, a requeued one continues it
            WANDB_NAME=job_name,
            WANDB_SILENT="true",
        )
    if "tensorboard" in used:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(jd.tensorboard)


NOT_TRACKED = {
    "lr",  # TRL logs it as learning_rate already
    "rng_digest",
    "step",
    "reward",
    "reward_std",
    "loss",
    "kl",
    "time",
    "kind",
    "prompts_digest",
    "is_ratio_mean",
    "logp_mismatch_mean",
}
"""StepRow fields the trackers have already (TRL logs them itself) or that are no figure (the prompts' digest)."""


def flat_figures(row: StepRow) -> dict[str, float]:
    """The project's step row as scalars a tracker takes: per-node maps become .../node0, lists .../0."""
    out: dict[str, float] = {}
    for f in dataclasses.fields(row):
        value = getattr(row, f.name)
        if f.name in NOT_TRACKED or value is None:
            continue
        if f.name in StepRow.PER_NODE:
            for node, v in value.items():
                if isinstance(v, list):
                    out.update({f"{PREFIX}{f.name}/node{node}/{i}": float(x) for i, x in enumerate(v) if x is not None})
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{PREFIX}{f.name}/node{node}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{PREFIX}{f.name}"] = float(value)
    return out


def finish() -> None:
    """Close the W&B run (the trainer leaves with os._exit, which skips wandb's own exit hook): its summary and history
    are complete on disk. TensorBoard's writer was closed by transformers' callback at the end of training."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
