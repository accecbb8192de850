"""Checkpoints in the job folder, written atomically: every rank writes its shards into
checkpoints/step-N.tmp (torch.distributed.checkpoint) and its own RNG states (rng-rankR.pt), rank 0 adds
meta.json last and renames the folder to step-N. A write interrupted half way leaves only a .tmp folder, which
resume ignores, so the previous good checkpoint is never replaced by a broken one.

trainer.async_checkpoint (periodic checkpoints): the step only copies its shards to host memory (dcp.async_save's
staging; on CUDA into pinned buffers every checkpoint reuses, pinned_stager) and a background thread writes them while
the next steps train; rank 0 completes the checkpoint (meta.json, the rename, retention) at the first step end after the
write, and before the next checkpoint starts. A preemption's and
the run's final checkpoint are written in the step (the job ends after them). A run that fails while a write runs
still completes it if it ends within SALVAGE_WAIT_S (`Checkpointer.salvage`, run by every rank on its way out), so a
failure loses no more steps than with checkpoints written in the step. Why: a synchronous save of a 3 B body's
33 GB of fp32 parameters and AdamW state held its step 61.5 s on an H100 (gpu/results/2026-12-07-ds3-lora-restart).

No checkpoint is begun where the file system has no room for every rank's shards (room_for): a periodic one is skipped
with a warning naming the fix and training goes on; so is the final one, before the final model (smaller: the weights
in the trainer's dtype) is written; a preemption's stops the job, naming it (NoRoom)."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from launcher.core.config import TrainerConfig
from launcher.core.jobdir import checkpoint_meta, free_space, meta_file
from launcher.core.jobdir import complete_checkpoints as step_dirs
from launcher.core.records import CheckpointMeta

KEEP = TrainerConfig.keep_checkpoints
"""trainer.keep_checkpoints's default (the config owns it): the newest complete checkpoints kept."""

HOLD_ENV = "SLURM_GRPO_TEST_HOLD_CHECKPOINT"
"""Test-only fault point (tests/integration/test_integration.py): set to a step, rank 0 stops in that step's write after the
shards and before meta.json, and writes HOLD_MARKER into the .tmp folder, so a test kills it mid-checkpoint for sure."""
HOLD_MARKER = "held-for-test"
HOLD_MAX_S = 300.0

WRITE_DEADLINE_S = 3600.0
"""The longest wait for a background write (trainer.async_checkpoint): a checkpoint not written in an hour is a hung
file system, not a slow one (33 GB took 33 s on an H100 node's local disk), and the run stops naming it."""

ROOM_MARGIN = 1.02
"""A checkpoint is begun only where the file system has its shards' bytes times this free (dcp's metadata, the RNG
states and the LR schedule besides: kilobytes)."""

SALVAGE_WAIT_S = 120.0
"""A failing run's wait for a background write still running (Checkpointer.salvage): long enough for the 33 GB above,
short against the job's stop after a failure."""


def latest(root: Path) -> tuple[int, Path] | None:
    dirs = step_dirs(root)
    return dirs[-1] if dirs else None


def save(root: Path, model, optimizer, scheduler, meta: CheckpointMeta, keep: int = KEEP) -> Path:
    """Collective: every rank calls it. `meta` (step, reason, ...) is written last, by rank 0, who then prunes the
    complete checkpoints to the newest `keep` (0 = keep all)."""
    pending = begin(root, model, optimizer, scheduler, meta, keep, group=None)
    pending.complete()
    dist.barrier()
    return pending.final


class NoRoom(RuntimeError):
    """A checkpoint whose shards the file system under the checkpoints folder has no room for (room_for): nothing of it
    was written. A periodic or final one is skipped (Checkpointer.save says so); a preemption's stops the job."""


def state_bytes(state, first_replica: bool) -> int:
    """The bytes this rank writes of a state dict (nested dicts and lists), as dcp dedups replicated data: a DTensor's
    local shard where this rank is its first replica on every replicated mesh dimension (HSDP's replicas write one
    copy), a plain tensor (an optimizer's step, the same on every rank) where first_replica (rank 0)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        coordinate = tuple(state.device_mesh.get_coordinate() or ())
        replicas = [c for c, placement in zip(coordinate, state.placements, strict=False) if placement.is_replicate()]
        return state.to_local().nbytes if not any(replicas) else 0
    if isinstance(state, torch.Tensor):
        return state.nbytes if first_replica else 0
    if isinstance(state, dict):
        return sum(state_bytes(v, first_replica) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v, first_replica) for v in state)
    return 0


def free_bytes(path: Path) -> int:
    """Free bytes of the file system holding `path` (its nearest existing folder: checkpoints/ appears at the first)."""
    return free_space(path)[1]


def room_for(root: Path, state: dict, step: int) -> None:
    """Collective: raises NoRoom, on every rank alike, where the file system under `root` has less free than every
    rank's shards of this checkpoint together (ROOM_MARGIN): ranks on several nodes write into one shared folder, and
    the least free space any rank sees decides. Why: a background write that ran out of room on an H100's 64 GB disk
    (a 33 GB checkpoint beside the last one) ended in torch.save's "unexpected pos 704 vs 598" at the run's end."""
    need = torch.tensor([state_bytes(state, dist.get_rank() == 0)], dtype=torch.float64)
    dist.all_reduce(need)  # CPU tensors: gloo (the default group has it beside NCCL on CUDA)
    free = torch.tensor([free_bytes(root)], dtype=torch.float64)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    total, left = need.item(), free.item()
    if total * ROOM_MARGIN > left:
        newest = latest(root)
        raise NoRoom(
            f"checkpoint step {step} needs {total / 1e9:.1f} GB under {root} ({dist.get_world_size()} ranks' shards) "
            f"and its file system has {left / 1e9:.1f} GB free; a resume starts from "
            f"{newest[1].name if newest else 'the model folder (no complete checkpoint)'}. Free space there, keep fewer "
            f"(trainer.keep_checkpoints), save less often (trainer.save_steps) or give the job folder a bigger file "
            f"system (job.job_dir)"
        )


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are being written (by dcp.save in the step, or by dcp.async_save's thread)."""

    tmp: Path
    final: Path
    meta: CheckpointMeta
    keep: int
    write: Future | None
    """dcp.async_save's write; None: written already (dcp.save)."""

    def done(self) -> bool:
        return self.write is None or self.write.done()

    def complete(self, deadline_s: float = WRITE_DEADLINE_S) -> None:
        """Waits for this rank's write (at most deadline_s), then (rank 0) meta.json, the rename and retention.
        Not collective: rank 0's write ends only after every rank's shards and dcp's metadata are written (dcp's
        finish step gathers every rank's write results first)."""
        if self.write is not None:
            try:
                self.write.result(timeout=deadline_s)
            except TimeoutError as e:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: checkpoint {self.final.name} was still being written after {deadline_s:.0f} s "
                    f"(a hung file system under {self.tmp.parent}?); a resume uses the newest complete checkpoint before "
                    f"it; trainer.async_checkpoint=false writes checkpoints in the step instead"
                ) from e
            except Exception as e:
                raise RuntimeError(
                    f"rank {dist.get_rank()}: writing checkpoint {self.final.name} failed in the background ({e}); "
                    f"{self.tmp} stays incomplete and a resume uses the newest complete checkpoint before it; "
                    f"its file system has {free_bytes(self.tmp) / 1e9:.1f} GB free now"
                ) from e
        if dist.get_rank() == 0:
            if os.environ.get(HOLD_ENV) == str(self.meta.step):
                hold_for_test(self.tmp)
            self.meta.write(meta_file(self.tmp))  # written last: its presence marks a complete checkpoint
            if self.final.exists():
                shutil.rmtree(self.final)
            os.rename(self.tmp, self.final)
            prune(self.final.parent, self.keep, self.final)


def begin(
    root: Path, model, optimizer, scheduler, meta: CheckpointMeta, keep: int, group, stager: AsyncStager | None = None
) -> PendingCheckpoint:
    """Collective: NoRoom where the file system has no room for it (room_for), else the folder, every rank's RNG
    states, rank 0's LR schedule and the shards' write: dcp.save in the step when `group` is None, else dcp.async_save
    on `group` (a gloo group of its own: the writer thread's collectives must not interleave with the training's on the
    default group), which returns once the shards are in host memory (`stager`'s buffers when given, else memory dcp
    allocates for this checkpoint)."""
    step = meta.step
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    if dist.get_rank() == 0:
        for stale in root.glob("step-*.tmp"):  # left by a write that was interrupted (it never counted)
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()  # its room freed before any rank measures
    msd, osd = get_state_dict(model, optimizer, options=state_options(model))
    state = {"model": without_frozen(model, msd), "optim": osd}
    room_for(root, state, step)  # NoRoom: nothing written, the folder not even made
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)
    dist.barrier()
    # each rank's own RNG states, written before the collective save (rank 0 passes it only once every rank is in it)
    torch.save(rng_state(), tmp / f"rng-rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None}, tmp / "trainer_state.pt")
    write = None
    if group is None:
        dcp.save(state, checkpoint_id=str(tmp))
    else:
        try:
            written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, async_stager=stager)
        except Exception as e:
            if stager is None:
                raise
            # no retry with dcp's own staging: a failed cudaHostRegister leaves its error as CUDA's last error, which
            # the next kernel launch would report as its own
            raise RuntimeError(
                f"rank {dist.get_rank()}: staging checkpoint step {step} into pinned host memory failed ({e}); "
                "trainer.async_checkpoint=false writes checkpoints in the step, without the pinned copy"
            ) from e
        assert isinstance(written, Future), "dcp.async_save with a stager that stages in the step returns a Future"
        write = written
    return PendingCheckpoint(tmp=tmp, final=final, meta=meta, keep=keep, write=write)


class Checkpointer:
    """The trainer's checkpoints (trainer.checkpoint's module docstring): synchronous, or with `asynchronous` the
    periodic ones written in the background, at most one at a time."""

    def __init__(self, root: Path, asynchronous: bool, keep: int = KEEP) -> None:
        self.root, self.asynchronous, self.keep = root, asynchronous, keep
        self.pending: PendingCheckpoint | None = None
        self.lock = threading.Lock()
        """Held while a write is completed: salvage runs on the failure watch's thread while the main thread may be
        completing the same write."""
        self.group = None
        """The gloo group of the background writes (made at the first, by every rank: new_group is collective)."""
        self.stager: AsyncStager | None = None
        """CUDA: the pinned host buffers every background write stages into (pinned_stager), made at the first."""

    def save(self, model, optimizer, scheduler, meta: CheckpointMeta, in_step: bool) -> float | None:
        """Collective. Returns the seconds the step was held: the whole write when in_step (or not asynchronous),
        else the wait for an earlier write still running plus the copy into host memory. A periodic or final checkpoint
        the file system has no room for is skipped, saying so (NoRoom): None; a preemption's raises it."""
        t0 = time.time()
        try:
            return self._save(model, optimizer, scheduler, meta, in_step, t0)
        except NoRoom as e:
            if meta.reason == "preempt":  # the requeue needs it (launcher.node.bootstrap): the job stops, naming why
                raise
            if dist.get_rank() == 0:  # periodic: the next one tries again; final: the model is written after it
                then = "the final model is still written" if meta.reason == "final" else "training goes on"
                print(f"WARNING: {e}. Skipped; {then}", flush=True)
            return None

    def _save(self, model, optimizer, scheduler, meta: CheckpointMeta, in_step: bool, t0: float) -> float:
        self.finish()
        if in_step or not self.asynchronous:
            save(self.root, model, optimizer, scheduler, meta, keep=self.keep)
            return time.time() - t0
        waited = time.time() - t0
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
            self.stager = pinned_stager(model)
        self.pending = begin(self.root, model, optimizer, scheduler, meta, self.keep, self.group, self.stager)
        if dist.get_rank() == 0:
            where = "pinned buffers" if self.stager is not None else "host memory"
            print(
                f"checkpoint step {meta.step}: copied into {where} in {time.time() - t0 - waited:.1f} s"
                + (f" after {waited:.1f} s waiting for the previous write" if waited >= 0.1 else "")
                + "; written in the background",
                flush=True,
            )
        return time.time() - t0

    def close(self) -> None:
        """After the last checkpoint: its write completed, then the pinned staging buffers released (the final model's
        write needs the host memory)."""
        self.finish()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def poll(self) -> Path | None:
        """Not collective, at each step end: completes the background write once it has ended (rank 0: meta.json and the
        rename); returns the checkpoint it completed."""
        if self.pending is None or not self.pending.done():
            return None
        return self.finish()

    def finish(self) -> Path | None:
        """Waits for the background write, if one runs, and completes it (rank 0 says so); returns its checkpoint."""
        with self.lock:
            pending, self.pending = self.pending, None
            if pending is not None:
                pending.complete()
        if pending is None:
            return None
        if dist.get_rank() == 0:
            print(f"checkpoint {pending.final.name} complete (written in the background)", flush=True)
        return pending.final

    def salvage(self, wait_s: float = SALVAGE_WAIT_S) -> Path | None:
        """On a failure, by every rank before it exits (trainer.parallel.on_failure_exit; not collective): the
        background write, if one runs, completed when it ends within wait_s (rank 0's ends only once every rank's shards
        are written, so a rank lost mid-write leaves it incomplete). Else it stays a .tmp folder that resume skips.
        Never raises: the run's own error is the one to report. Returns the checkpoint it completed."""
        t0 = time.time()
        if not self.lock.acquire(timeout=wait_s):  # the main thread is completing it (and may be stuck there)
            return None
        try:
            pending, self.pending = self.pending, None
            if pending is None:
                return None
            try:
                pending.complete(deadline_s=max(0.0, wait_s - (time.time() - t0)))
            except Exception as e:  # noqa: BLE001 - reported, and the failure's own error follows
                print(
                    f"rank {dist.get_rank()}: the run failed while checkpoint {pending.final.name} was written in the "
                    f"background, and it could not be completed ({e}); a resume uses the newest complete one before it",
                    flush=True,
                )
                return None
            if dist.get_rank() == 0:
                print(f"checkpoint {pending.final.name} complete (its background write ended after the failure)", flush=True)
            return pending.final
        finally:
            self.lock.release()


def pinned_stager(model) -> AsyncStager | None:
    """For a model on CUDA: a stager whose pinned host buffers every background checkpoint reuses (torchtitan's
    async_with_pinned_mem). dcp.async_save's default copies into pageable memory allocated per checkpoint: 33 GB at
    1.6 GB/s, 20.8 s of the step on an H100 (gpu/results/2026-12-07-resume-agents-7b); into pinned memory the copy runs
    at the link's speed after the first checkpoint has pinned the buffers. The buffers hold the rank's shards of the
    model and optimizer state between checkpoints (Checkpointer.close releases them). None on CPU: dcp's default."""
    if next(model.parameters()).device.type != "cuda":
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # staged in the step (not in a thread): the next step's optimizer must not change the tensors while they are copied
    return DefaultStager(
        StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True)
    )


def prune(root: Path, keep: int, written: Path) -> list[Path]:
    """Retention, once `written` is complete (renamed, meta.json in it): delete the complete checkpoints older than the
    newest `keep` (0 = keep all), never `written` itself. Each goes in two moves: its meta.json first, so a deletion
    cut short leaves a folder resume no longer counts as complete (never a half-deleted one it would load), then the
    rest; a folder left incomplete that way (older than `written`) goes at the next prune. Returns what was deleted."""
    assert meta_file(written).is_file(), f"prune before {written} is complete"
    if keep <= 0:
        return []
    complete = step_dirs(root)
    doomed = [d for _, d in complete[:-keep] if d != written]
    done = {d for _, d in complete}
    # folders a cut-short deletion left (no meta.json), older than the one just written; never a .tmp being written
    doomed += [
        d for d in root.glob("step-*") if d.is_dir() and not d.name.endswith(".tmp") and d not in done and d.name < written.name
    ]
    for d in doomed:
        meta_file(d).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def state_options(model) -> StateDictOptions | None:
    """A model with frozen parameters (trainer.lora: the base) checkpoints only what trains (the adapters and their
    AdamW state): the frozen base is the model folder's, read again at every start. None: everything (full training)."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def without_frozen(model, msd: dict) -> dict:
    """The state dict less every name of a frozen parameter: ignore_frozen_params misses the second name of a tied one
    (a tied embedding's lm_head.weight)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in msd.items() if k not in frozen}


def hold_for_test(tmp: Path) -> None:
    (tmp / HOLD_MARKER).write_text(str(os.getpid()))
    print(f"{HOLD_ENV}: holding the write of {tmp.name} before meta.json", flush=True)
    deadline = time.time() + HOLD_MAX_S  # bounded: a test that never kills us still ends
    while time.time() < deadline:
        time.sleep(0.5)


def rng_state() -> dict:
    """This rank's random number generators: torch (CPU and CUDA), NumPy and Python's (what TRL and the Trainer draw from)."""
    import numpy as np

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def set_aside(root: Path) -> Path | None:
    """Collective. For a run that starts over (trainer.resume: false) in a folder with checkpoints: rank 0 moves them
    (complete or not) into root/set-aside-<time>-<pid>/, where neither resume nor retention looks, so this run's own
    checkpoints are the ones that count. Returns that folder (rank 0, when there was something to move), else None."""
    aside = None
    if dist.get_rank() == 0:
        found = sorted(root.glob("step-*"))
        if found:
            aside = root / f"set-aside-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            aside.mkdir()
            for d in found:
                os.rename(d, aside / d.name)
            print(f"trainer.resume is false: moved the earlier checkpoints of {root} to {aside.name}/ ({len(found)})", flush=True)
    dist.barrier()
    return aside


def load(path: Path, model, optimizer, scheduler) -> int:
    """Collective. Restores model and optimizer shards, the LR schedule and the step; returns the step. The RNG
    states are restore_rng's, called later: right before the first step, as an uninterrupted run would be."""
    info = checkpoint_meta(path)
    if info.world_size != dist.get_world_size() and dist.get_rank() == 0:
        # DCP stores each tensor with its global shape and reads back whatever slice this rank's DTensor owns
        print(
            f"resharding checkpoint {path.name}: written by {info.world_size} ranks, loaded by {dist.get_world_size()}",
            flush=True,
        )
    options = state_options(model)
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": without_frozen(model, msd), "optim": stepped_only(osd, path)}
    dcp.load(state, checkpoint_id=str(path))  # every model key is in the checkpoint: dcp.load refuses a missing one
    if len(state["optim"]["state"]) < len(osd["state"]):  # parameters without AdamW state (stepped_only) stay so
        options = dataclasses.replace(options or StateDictOptions(), strict=False)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)  # type: ignore[arg-type]
    ts = torch.load(path / "trainer_state.pt", weights_only=False)
    if scheduler is not None and ts["scheduler"] is not None:
        scheduler.load_state_dict(ts["scheduler"])
        continue_schedule(scheduler, optimizer)
    return info.step


def stepped_only(osd: dict, path: Path) -> dict:
    """The optimizer state dict less the parameters the checkpoint holds no optimizer state for: those that never had
    a gradient when it was written (DeepSeek-V3.2's and GLM-5's sparse-attention indexer runs under no_grad in
    transformers), which AdamW leaves without state; get_state_dict makes state for every parameter, and dcp.load
    refused the missing keys. Left out, they keep the zero state get_state_dict made for them; with no gradient AdamW
    never steps them, so the resumed run computes what the uninterrupted one does."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    stepped = {k.rpartition(".")[0] for k in saved if k.startswith("optim.state.")}
    return {**osd, "state": {n: s for n, s in osd["state"].items() if f"optim.state.{n}" in stepped}}


def continue_schedule(scheduler, optimizer) -> None:
    """The LR the next step trains with: this run's schedule at the restored step. The optimizer's restored LR is
    the written run's, which differs when max_steps changed (a run resumed to go on longer: at the end of a linear
    schedule it is 0, and the first resumed step would not train). The Trainer's schedules are LambdaLRs, whose
    lambdas are this run's (a state dict does not carry them)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def restore_rng(path: Path, rank: int) -> bool:
    """This rank's RNG states as the checkpoint saved them (at the end of its step). Call it at the start of the
    first step after a resume, after the dataloader's iterator exists (creating one draws a seed from the global
    generator, as the Trainer's own resume does), so the step draws what it drew in the uninterrupted run. False
    when the checkpoint has none for this rank (written by fewer ranks): its draws go on from trainer.seed."""
    rng = path / f"rng-rank{rank}.pt"
    if not rng.exists():
        print(
            f"rank {rank}: checkpoint {path.name} has no RNG state for this rank; its draws continue from trainer.seed",
            flush=True,
        )
        return False
    set_rng_state(torch.load(rng, weights_only=False))
    return True
