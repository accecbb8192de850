"""The project's TrainerCallback: resume, the per-step metrics row, periodic and preemption checkpoints. Every TRL
internal the trainer relies on is named in trainer.trl_glue, and used only there."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from launcher.core.config import TrainerConfig
from launcher.core.jobdir import Env, JobDir
from launcher.core.records import NodeFigures, ResumedRow, StepRow
from trainer import checkpoint, data, tracking, trl_glue
from trainer.metrics import MetricsWriter
from trainer.parallel import Parallel
from trainer.rollout.node import NodeLocalGeneration, StepClock
from trainer.trl_glue import grpo_config

__all__ = ["grpo_config"]  # re-exported: gpu/trl_colocate.py imports it from here


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


class NodeStats:
    """Per-node generation/push/parity figures, gathered from every node leader once per generation."""

    def __init__(self, par: Parallel):
        self.par = par
        self.by_node: dict[int, dict[str, Any]] = {}

    def gather(self, stats: dict[str, Any]) -> None:
        """Collective over the whole world (all_gather_object): every rank calls it, the leaders' stats count."""
        mine = {"node": self.par.node, **stats} if self.par.is_leader else None
        out: list[Any] = [None] * self.par.world
        dist.all_gather_object(out, mine)
        for s in out:
            if s is not None:
                self.by_node[s["node"]] = dict(s)


class SlurmGrpoCallback(TrainerCallback):
    """Resume, per-step metrics, periodic and preemption checkpoints; sets the step clock at each step."""

    def __init__(
        self,
        job_dir: Path,
        par: Parallel,
        t: TrainerConfig,
        stats: NodeStats,
        clock: StepClock,
        preemption: PreemptionFlag,
        resume: tuple[int, Path] | None = None,
        on_first_step: Callable[[], None] | None = None,
    ):
        self.job_dir, self.par, self.t, self.stats, self.clock = job_dir, par, t, stats, clock
        self.resume = resume
        """(step, folder) of the checkpoint this run continues from, found before the trainer was built."""
        self.preemption = preemption
        self.on_first_step = on_first_step
        self.metrics = MetricsWriter(job_dir)
        self.trainer: Any = None  # the GRPOTrainer, bound by build_trainer (it takes the callback as an argument)
        self.step_t0 = time.time()
        self.resumed_from: int | None = None
        self.cursor = data.DataCursor(0, 0, 0)  # set by trainer.run.build, which knows the sampler's rate
        self.last_saved = -1
        self.preempted = False

    # -------------------------------------------------------------- resume
    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        if self.resume is None:
            return
        step, path = self.resume
        got = checkpoint.load(path, self.trainer.model, optimizer, lr_scheduler)
        state.global_step = got
        self.resumed_from = self.last_saved = got
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
                    from_step=got, checkpoint=str(path), steps_redone=redone, data_indices_skipped=self.cursor.base_indices
                )
            )

    def on_step_begin(self, args, state, control, **kw):
        self.step_t0 = time.time()
        self.clock.step = state.global_step

    # -------------------------------------------------------------- metrics
    def on_log(self, args, state, control, logs=None, **kw):
        if self.par.rank != 0 or not logs or logs.get("reward") is None:  # TRL's step record carries the reward
            return
        figures = {n: NodeFigures.from_dict(s) for n, s in self.stats.by_node.items()}
        row = StepRow.build(state.global_step, logs, time.time() - self.step_t0, figures)
        self.metrics.write(row)
        logs.update(tracking.flat_figures(row))  # the same dict the trackers' callbacks get next
        print(
            f"step {row.step}/{state.max_steps} reward {row.reward:.4f} push {row.push_s} "
            f"parity {row.parity_max} step {row.step_s:.2f}s",
            flush=True,
        )

    # -------------------------------------------------------------- checkpoints, preemption
    def on_step_end(self, args, state, control, **kw):
        if self.on_first_step is not None:  # start-up timing: the node's first finished step
            self.on_first_step()
            self.on_first_step = None
        flag = torch.tensor([1 if self.preemption.requested else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must stop at the same step
        every = self.t.save_steps
        if flag.item():
            self.save(state, reason="preempt")
            self.preempted = True
            control.should_training_stop = True
            if self.par.rank == 0:
                print(f"preemption signal: checkpointed step {state.global_step}, stopping", flush=True)
        elif every and state.global_step % every == 0:
            self.save(state)

    def save(self, state, reason: str = "periodic") -> None:
        if self.last_saved == state.global_step:
            return
        tr = self.trainer
        # reason "preempt" is what the bootstrap looks for before it requeues the job
        checkpoint.save(
            JobDir(self.job_dir).checkpoints,
            state.global_step,
            tr.model,
            tr.optimizer,
            tr.lr_scheduler,
            {
                "reason": reason,
                "attempt": os.environ.get(Env.ATTEMPT, ""),
                "data_indices_consumed": self.cursor.at(state.global_step),
                "reward_last": (tr.state.log_history[-1] if tr.state.log_history else {}).get("reward"),
            },
        )
        self.last_saved = state.global_step


def build_trainer(
    model, tokenizer, dataset, rewards, args, callback: SlurmGrpoCallback, make_backend: Callable[..., NodeLocalGeneration]
):
    tr = trl_glue.build_trainer(model, tokenizer, dataset, rewards, args, callback, make_backend, NodeLocalGeneration)
    callback.trainer = tr
    return tr
