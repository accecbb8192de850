"""TRL's GRPOTrainer, wired for one vLLM server per node.

The TRL internals this depends on (checked by tests/test_pinned_internals.py, which fails with a clear
message if a TRL upgrade moves them):
  - trl.trainer.grpo_trainer.VLLMGeneration: the module-level name GRPOTrainer instantiates in server
    mode; we bind it to trainer.generation.NodeLocalGeneration for the trainer's construction.
  - its use: `.generate(prompts=, images=, num_generations=, profiler=)` -> (prompt_ids, completion_ids,
    logprobs[seq][tok][k], logprob_token_ids) and `.sync_weights()` when global_step changed;
    `.vllm_client.get_server_info()` on the main process.
  - transformers' Trainer honours `model._is_distributed_loading_by_transformers` (no DDP/FSDP wrap of a
    model that shards itself).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from launcher.config import TrainerConfig
from trainer import checkpoint, data, tracking
from trainer.generation import NodeLocalGeneration, StepClock
from trainer.metrics import MetricsWriter
from trainer.parallel import Parallel


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


@contextmanager
def trl_generation_backend(make: Callable[..., NodeLocalGeneration]):
    """Within the block, TRL's GRPOTrainer builds `make(**its kwargs)` as its vLLM generation backend."""
    import trl.trainer.grpo_trainer as gt

    if not hasattr(gt, "VLLMGeneration"):
        raise RuntimeError(
            "trl.trainer.grpo_trainer.VLLMGeneration is gone: this TRL is not the pinned 1.16.0; "
            "install the version in pyproject.toml"
        )
    old = gt.VLLMGeneration
    gt.VLLMGeneration = make  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gt.VLLMGeneration = old  # type: ignore[misc]


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
        self.rng_from: Path | None = None
        """The checkpoint whose RNG states the next step starts with (set on resume)."""
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
        self.rng_from = path  # restored at the first step's start (on_step_begin)
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
                {
                    "event": "resumed",
                    "from_step": got,
                    "checkpoint": str(path),
                    # why it was written: periodic, final or preempt (a requeue after preemption resumes from "preempt")
                    "reason": checkpoint.meta(path).get("reason"),
                    "steps_redone": redone,
                    "data_indices_skipped": self.cursor.base_indices,
                }
            )

    def on_step_begin(self, args, state, control, **kw):
        if self.rng_from is not None:
            checkpoint.restore_rng(self.rng_from, self.par.rank)
            self.rng_from = None
        self.step_t0 = time.time()
        self.clock.step = state.global_step

    # -------------------------------------------------------------- metrics
    def on_log(self, args, state, control, logs=None, **kw):
        if self.par.rank != 0 or not logs or "reward" not in logs:
            return
        by = self.stats.by_node
        row = {
            "step": state.global_step,
            "reward": logs.get("reward"),
            "reward_std": logs.get("reward_std"),
            "loss": logs.get("loss"),
            "kl": logs.get("kl"),
            "lr": logs.get("learning_rate"),
            # rank 0's torch RNG state after the step: a resumed run continues it (checkpoint.load restores it)
            "rng_digest": hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12],
            "step_s": round(time.time() - self.step_t0, 3),
            "push_s": {str(n): round(s.get("push_s", 0.0), 4) for n, s in sorted(by.items()) if "push_s" in s},
            "gen_s": {str(n): round(s["gen_s"], 4) for n, s in sorted(by.items()) if s.get("gen_s")},
            "gen_wait_s": {str(n): round(s["gen_wait_s"], 4) for n, s in sorted(by.items()) if "gen_wait_s" in s},
            "parity": {str(n): s.get("parity") for n, s in sorted(by.items())},
            "parity_stale": {str(n): s.get("parity_stale") for n, s in sorted(by.items())},
            # with vLLM data parallelism: the parity of each engine of the node's server, checked one by one
            "parity_engines": {str(n): s.get("parity_engines") for n, s in sorted(by.items())},
            "parity_max": max((s["parity"] for s in by.values() if s.get("parity") is not None), default=None),
            "gen_tokens": {str(n): s.get("gen_tokens") for n, s in sorted(by.items())},
            "gen_tokens_per_s_node": {
                str(n): round(s["gen_tokens"] / max(s["gen_s"], 1e-9), 1) for n, s in sorted(by.items()) if s.get("gen_s")
            },
            "server_requests": {str(n): s.get("server_requests") for n, s in sorted(by.items())},
            "prompts_digest": {str(n): s.get("prompts_digest") for n, s in sorted(by.items())},
            # asynchronous generation: how many optimizer steps old the weights were that generated this step's
            # completions, per node; TRL's importance-sampling ratio and the vLLM-vs-trainer logprob difference
            "staleness": {str(n): s.get("staleness") for n, s in sorted(by.items())},
            "ahead_misses": {str(n): s.get("ahead_misses", 0) for n, s in sorted(by.items())},
            # pushes so far that paused requests still running (max_staleness >= 2) and resumed them after
            "pushes_paused": {str(n): s.get("pushes_paused", 0) for n, s in sorted(by.items())},
            "pushes_paused_running": {str(n): s.get("pushes_paused_running", 0) for n, s in sorted(by.items())},
            "is_ratio_mean": logs.get("sampling/importance_sampling_ratio/mean"),
            "logp_mismatch_mean": logs.get("sampling/sampling_logp_difference/mean"),
        }
        tps = row["gen_tokens_per_s_node"]
        row["gen_tokens_per_s"] = round(sum(tps.values()), 1) if tps else None
        self.metrics.write(row)
        # the same dict the trackers' callbacks get next (lr: TRL's own learning_rate figure is in it already)
        logs.update(tracking.flat_figures({k: v for k, v in row.items() if k != "lr"}))
        print(
            f"step {row['step']}/{state.max_steps} reward {row['reward']:.4f} push {row['push_s']} "
            f"parity {row['parity_max']} step {row['step_s']:.2f}s",
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
            self.job_dir / "checkpoints",
            state.global_step,
            tr.model,
            tr.optimizer,
            tr.lr_scheduler,
            {
                "reason": reason,
                "attempt": os.environ.get("SLURM_GRPO_ATTEMPT", ""),
                "data_indices_consumed": self.cursor.at(state.global_step),
                "reward_last": (tr.state.log_history[-1] if tr.state.log_history else {}).get("reward"),
            },
        )
        self.last_saved = state.global_step


def grpo_config(job_dir: Path, t: TrainerConfig, device: str, **overrides: Any):
    """TRL's GRPOConfig for the trainer section. overrides: what gpu/trl_colocate.py changes to run TRL's own
    colocate mode on the same work (the same function builds both, so the comparison cannot drift)."""
    from trl import GRPOConfig

    bf16 = t.dtype == "bfloat16" and device == "cuda"
    settings: dict[str, Any] = dict(
        output_dir=str(job_dir / "hf"),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.per_device_train_batch_size,
        num_generations=t.num_generations,
        max_completion_length=t.max_completion_length,
        learning_rate=t.learning_rate,
        beta=t.beta,
        temperature=t.temperature,
        seed=t.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=tracking.trackers(t) or "none",
        run_name=job_dir.name,
        use_cpu=device == "cpu",
        bf16=bf16,
        use_vllm=True,
        vllm_mode="server",
        disable_tqdm=True,
        dataloader_num_workers=0,
        # TRL defaults this to True; trainer.activation_checkpointing decides (the loader applies it per layer)
        gradient_checkpointing=t.activation_checkpointing,
    )
    return GRPOConfig(**{**settings, **t.grpo, **overrides})


def build_trainer(
    model, tokenizer, dataset, rewards, args, callback: SlurmGrpoCallback, make_backend: Callable[..., NodeLocalGeneration]
):
    from trl import GRPOTrainer

    with trl_generation_backend(make_backend):
        tr = GRPOTrainer(
            model=model, reward_funcs=rewards, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[callback]
        )
    if not isinstance(tr.vllm_generation, NodeLocalGeneration):
        raise RuntimeError("GRPOTrainer did not use the node-local generation backend; TRL changed how it builds it")
    # first in line: its on_log adds the project's figures to the record the reporting callbacks (W&B, TensorBoard) send
    tr.callback_handler.callbacks.remove(callback)
    tr.callback_handler.callbacks.insert(0, callback)
    callback.trainer = tr
    return tr
