"""The project's TrainerCallback: resume, the per-step metrics row, periodic and preemption checkpoints, the evaluations
(trainer.eval). It holds the node's rollout (built before TRL's trainer): it starts each step there (`begin_step`) and
writes each step's row from the rollout's figures. The model, optimizer and scheduler come with every event
(transformers' CallbackHandler passes them, trainer.trl_glue hook 3). Every TRL internal the trainer relies on is named
in trainer.trl_glue, and used only there."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from launcher.core.config import TrainerConfig
from launcher.core.jobdir import Env, JobDir, checkpoint_meta
from launcher.core.records import CheckpointMeta, CheckpointReason, ResumedRow, StepRow
from trainer import checkpoint, data, tracking
from trainer.evaluation.evaluator import Evaluator
from trainer.metrics import MetricsWriter
from trainer.parallel import Parallel, on_failure_exit
from trainer.profiling import StepProfiler
from trainer.rollout.node import NodeRollout


class PreemptionFlag:
    """Set by the preemption signals torchrun forwards (--signals-to-handle); the callback checkpoints at the
    next step boundary and the trainer exits with PREEMPTED_EXIT. Installed before anything slow starts."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None


class SlurmGrpoCallback(TrainerCallback):
    """Resume, per-step metrics, periodic and preemption checkpoints; starts each step on the node's rollout."""

    def __init__(
        self,
        job_dir: Path,
        par: Parallel,
        t: TrainerConfig,
        rollout: NodeRollout,
        preemption: PreemptionFlag,
        cursor: data.DataCursor,
        resume: tuple[int, Path] | None = None,
        on_first_step: Callable[[], None] | None = None,
        evaluator: Evaluator | None = None,
    ):
        self.job_dir, self.par, self.t, self.rollout = job_dir, par, t, rollout
        self.cursor = cursor
        """How far into the sampler's stream each step of this attempt is (recorded with each checkpoint)."""
        self.resume = resume
        """(step, folder) of the checkpoint this run continues from, found before the trainer was built."""
        self.preemption = preemption
        self.on_first_step = on_first_step
        self.evaluator = evaluator
        """trainer.eval: run before the first step and after the steps it says are due (trainer.evaluation)."""
        self.metrics = MetricsWriter(job_dir)
        self.step_t0 = time.time()
        self.resumed_from: int | None = None
        self.rng_from: Path | None = None
        """The checkpoint whose RNG states the next step starts with (set on resume)."""
        self.last_saved = -1
        self.checkpoints = checkpoint.Checkpointer(JobDir(job_dir).checkpoints, t.async_checkpoint, keep=t.keep_checkpoints)
        on_failure_exit(self.checkpoints.salvage)  # a failure mid-write keeps the checkpoint if its write ends soon
        self.checkpoint_s: float | None = None
        """The seconds the step now ending was held by a checkpoint (its row's checkpoint_s), None: no checkpoint."""
        self.preempted = False
        self.profiler = StepProfiler(t.profile_steps, JobDir(job_dir).profile(par.node, par.rank), enabled=par.is_leader)

    # -------------------------------------------------------------- resume
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        if self.resume is None:
            return
        step, path = self.resume
        self.rollout.before_resume()  # a GPU shared with vLLM: its KV cache sized before the optimizer state lands
        got = checkpoint.load(path, model, optimizer, lr_scheduler)
        state.global_step = got
        self.resumed_from = self.last_saved = got
        self.rng_from = path  # restored at the first step's start (on_step_begin), after the dataloader's seed draw
        if self.par.rank == 0:
            redone = self.metrics.set_aside_after(got)
            print(
                f"resumed from {path} at step {got}"
                + (
                    f"; {redone} later step rows of the lost attempt set aside in metrics.lost.jsonl (their steps run again)"
                    if redone
                    else ""
                ),
                flush=True,
            )
            self.metrics.write(
                ResumedRow(
                    from_step=got,
                    checkpoint=str(path),
                    # why it was written: a requeue after preemption resumes from "preempt"
                    reason=checkpoint_meta(path).reason,
                    steps_redone=redone,
                    data_indices_skipped=self.cursor.base_indices,
                )
            )

    def on_step_begin(self, args, state, control, **kw):
        if self.rng_from is not None:
            checkpoint.restore_rng(self.rng_from, self.par.rank)
            self.rng_from = None
        self.rollout.begin_step(state.global_step)  # first: it may wait for the server's start (not the step's time)
        pushed_s = 0.0
        if self.evaluator is not None:
            if state.global_step == 0 and self.evaluator.due(0, state.max_steps):  # before training (not again on resume)
                self.evaluator.run(0)
            pushed_s = self.evaluator.take_push_s()  # this step's push, brought forward by the evaluation: its time
        self.profiler.begin(state.global_step + 1)
        self.step_t0 = time.time() - pushed_s

    # -------------------------------------------------------------- metrics
    def on_log(self, args, state, control, logs=None, **kw):
        if self.par.rank != 0 or not logs or logs.get("reward") is None:  # TRL's step record carries the reward
            return
        # rank 0's torch RNG state after the step: a resumed run continues it (checkpoint.restore_rng)
        rng_digest = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]
        row = StepRow.build(
            state.global_step, logs, time.time() - self.step_t0, self.rollout.by_node, rng_digest, checkpoint_s=self.checkpoint_s
        )
        self.checkpoint_s = None
        self.metrics.write(row)
        logs.update(tracking.flat_figures(row))  # the same dict the trackers' callbacks get next
        print(
            f"step {row.step}/{state.max_steps} reward {row.reward:.4f} push {row.push_s} "
            f"parity {row.parity_max} step {row.step_s:.2f}s",
            flush=True,
        )

    # -------------------------------------------------------------- checkpoints, preemption
    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.rollout.end_step()  # multi-turn: the push's parity checked, every node's figures gathered (before on_log)
        self.profiler.end(state.global_step)
        if self.on_first_step is not None:  # start-up timing: the node's first finished step
            self.on_first_step()
            self.on_first_step = None
        flag = torch.tensor([1 if self.preemption.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must stop at the same step
        every = self.t.save_steps
        self.checkpoints.poll()  # a background write that has ended: rank 0 completes it (meta.json) and says so
        if flag.item():
            self.save(state, model, optimizer, lr_scheduler, reason="preempt")
            self.preempted = True
            control.should_training_stop = True
            if self.par.rank == 0:
                print(f"preemption signal: checkpointed step {state.global_step}, stopping", flush=True)
        elif every and state.global_step % every == 0:
            self.save(state, model, optimizer, lr_scheduler)
        if not self.preempted and self.evaluator is not None and self.evaluator.due(state.global_step, state.max_steps):
            t0 = time.time()
            self.evaluator.run(state.global_step)
            self.step_t0 += time.time() - t0  # the evaluation's seconds are its own row's, not the step's

    def save(self, state, model, optimizer, lr_scheduler, reason: CheckpointReason = "periodic") -> None:
        """Collective. A periodic checkpoint goes to the background with trainer.async_checkpoint; a preemption's and the
        final one are complete when this returns (the job ends after them)."""
        if self.last_saved == state.global_step:
            self.finish_checkpoints()  # the final checkpoint of a run whose last step wrote one: complete it now
            return
        # reason "preempt" is what the bootstrap looks for before it requeues the job
        meta = CheckpointMeta(
            step=state.global_step,
            world_size=self.par.world,
            reason=reason,
            attempt=os.environ.get(Env.ATTEMPT, ""),
            data_indices_consumed=self.cursor.at(state.global_step),
            reward_last=(state.log_history[-1] if state.log_history else {}).get("reward"),
            time=time.time(),
        )
        in_step = reason != "periodic"
        held = self.checkpoints.save(model, optimizer, lr_scheduler, meta, in_step=in_step)
        if held is None:  # a periodic checkpoint without room, skipped: the final one, if due, tries again
            return
        self.checkpoint_s = round(held, 3)
        self.last_saved = state.global_step

    def close_checkpoints(self) -> None:
        """After the run's last checkpoint: any background write completed, the staging buffers released."""
        self.checkpoints.close()

    def finish_checkpoints(self) -> None:
        """At the end of training: the background write still running, if any, waited for and completed."""
        self.checkpoints.finish()  # the last step's own checkpoint is often this one
