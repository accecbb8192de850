"""Checkpoints in the job folder, written atomically: every rank writes its shards into
checkpoints/step-N.tmp (torch.distributed.checkpoint), rank 0 adds meta.json last and renames the
folder to step-N. A write interrupted half way leaves only a .tmp folder, which resume ignores, so the
previous good checkpoint is never replaced by a broken one."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launcher.core.jobdir import complete_checkpoints as step_dirs

KEEP = 2


def latest(root: Path) -> tuple[int, Path] | None:
    dirs = step_dirs(root)
    return dirs[-1] if dirs else None


def meta(path: Path) -> dict:
    """A complete checkpoint's meta.json: step, world size, reason, and what the run recorded with it."""
    return json.loads((path / "meta.json").read_text())


def save(root: Path, step: int, model, optimizer, scheduler, extra: dict) -> Path:
    """Collective: every rank calls it."""
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    if dist.get_rank() == 0:
        for stale in root.glob("step-*.tmp"):  # left by a write that was interrupted (it never counted)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        torch.save(
            {"scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": torch.get_rng_state()},
            tmp / "trainer_state.pt",
        )
        with open(tmp / "meta.json", "w") as f:  # written last: its presence marks a complete checkpoint
            json.dump({"step": step, "time": time.time(), "world_size": dist.get_world_size(), **extra}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for _, old in step_dirs(root)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(path: Path, model, optimizer, scheduler) -> int:
    """Collective. Restores model and optimizer shards, the LR schedule and the step; returns the step."""
    info = meta(path)
    if info["world_size"] != dist.get_world_size() and dist.get_rank() == 0:
        # DCP stores each tensor with its global shape and reads back whatever slice this rank's DTensor owns
        print(
            f"resharding checkpoint {path.name}: written by {info['world_size']} ranks, loaded by {dist.get_world_size()}",
            flush=True,
        )
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])  # type: ignore[arg-type]
    ts = torch.load(path / "trainer_state.pt", weights_only=False)
    if scheduler is not None and ts["scheduler"] is not None:
        scheduler.load_state_dict(ts["scheduler"])
    return int(info["step"])
