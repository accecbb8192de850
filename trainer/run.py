"""One training run on this rank: built from the plan (model, data, rewards, node-local generation backend,
callback, TRL's GRPOTrainer), trained, and finished (final push and parity on every node, final checkpoint,
summary and plot)."""

from __future__ import annotations

import enum
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher.core.config import TrainerConfig
from launcher.core.jobdir import Events, JobDir, checkpoint_meta
from launcher.core.plan import Plan
from launcher.core.records import Event, FinalRow, NodeFinal
from trainer import callback as grpo
from trainer import checkpoint, data, final_model, loading, procmem, rewards, tracking, trl_glue
from trainer import lora as trainer_lora
from trainer.agents import figures as agent_figures
from trainer.agents.ahead_rollout import AheadRollout, environment_rewards
from trainer.agents.episodes import UnitBounds
from trainer.agents.generation import RankGeneration
from trainer.agents.resolve import resolve as resolve_agents
from trainer.evaluation.evaluator import Evaluator, load_rows
from trainer.metrics import MetricsWriter, write_summary_and_plot
from trainer.parallel import Parallel
from trainer.rollout.node import GenerationSettings, NodeRollout, TrlAdapter
from trainer.routing_replay import RoutingReplay


class Outcome(enum.Enum):
    FINISHED = "finished"
    PREEMPTED = "preempted"


@dataclass
class Run:
    plan: Plan
    par: Parallel
    trainer: Any
    """trl.GRPOTrainer"""
    callback: grpo.SlurmGrpoCallback
    rollout: NodeRollout
    train_s: float = 0.0
    ahead: AheadRollout | None = None
    """Multi-turn with max_staleness >= 1: the episodes running ahead, whose thread ends with train()."""

    def train(self) -> Outcome:
        t0 = time.time()
        try:
            self.trainer.train()
        except BaseException:
            if self.ahead is not None:  # stopped, not waited for: an error exits at once (trainer.main)
                self.ahead.close(wait=False)
            raise
        if self.ahead is not None:
            # done: nothing runs past the last step, and nothing may run into the final push (a quick wait: no batch
            # is sent past max_steps). Preempted: a batch of step s+1 is mid-request; waiting for it could outlast
            # the time-limit warning (slurm.signal_seconds) before the exit that lets the bootstrap requeue: stop it
            self.ahead.close(wait=not self.callback.preempted)
        self.train_s = time.time() - t0
        if self.callback.preempted:
            self.par.log(f"preempted at step {self.trainer.state.global_step}: checkpoint written, exiting for requeue")
            return Outcome.PREEMPTED
        return Outcome.FINISHED

    def finish(self) -> None:
        """Final push + parity on every node, the final checkpoint, and (rank 0) the summary and plot."""
        from torch.distributed.tensor import DTensor

        step = self.trainer.state.global_step
        params = list(self.trainer.model.parameters())
        # the trained parameters must still be FSDP2 shards (DTensors), not a silent DDP fallback
        dtensor_params = {"dtensor": sum(isinstance(p, DTensor) for p in params), "total": len(params)}
        mine = self.rollout.finish(step)
        finals: list[Any] = [None] * self.par.world
        dist.all_gather_object(finals, mine)
        peaks: list[Any] = [None] * self.par.world
        dist.all_gather_object(peaks, procmem.peaks_gb())
        if self.plan.config.trainer.final_checkpoint:
            tr = self.trainer
            self.callback.save(tr.state, tr.model, tr.optimizer, tr.lr_scheduler, reason="final")
        self.callback.close_checkpoints()  # a periodic checkpoint still written in the background: complete before the end
        model_dir = None
        t = self.plan.config.trainer
        if t.save_model and not t.lora.enabled:  # the model in Hugging Face's format, written by every rank's shards
            model_dir = final_model.save(
                self.trainer.model,
                getattr(torch, t.dtype),
                self.plan.config.vllm.model,
                JobDir(Path(self.plan.job_dir)).model,
                chat_template=t.chat_template,
            )
        lora_outputs = []
        if t.lora.enabled:  # the adapter in peft's format (and the merged model on request)
            lora_outputs = trainer_lora.save_outputs(
                self.trainer.model,
                t.lora,
                self.plan.config.vllm.model,
                Path(self.plan.job_dir),
                getattr(torch, t.dtype),
                chat_template=t.chat_template,
            )
        if self.par.rank == 0:
            job_dir = Path(self.plan.job_dir)
            per_node: dict[str, NodeFinal] = {str(f.node): f for f in finals if f is not None}
            MetricsWriter(job_dir).write(FinalRow(step=step, nodes=per_node))
            latest = checkpoint.latest(JobDir(job_dir).checkpoints)
            write_summary_and_plot(
                job_dir,
                {
                    "train_s": round(self.train_s, 2),
                    "final_step": step,
                    "resumed_from": self.callback.resumed_from,
                    "nodes": {n: f.to_dict() for n, f in per_node.items()},
                    "allreduce_check": self.par.allreduce_check,
                    "dtensor_params": dtensor_params,
                    "peak_memory_per_rank": {str(r): p for r, p in enumerate(peaks)},
                    "final_checkpoint": str(latest[1]) if latest else None,
                    "model": str(model_dir) if model_dir else None,
                    **({"lora_outputs": [str(p) for p in lora_outputs]} if lora_outputs else {}),
                },
            )


def make_evaluator(
    t: TrainerConfig, par: Parallel, job_dir: Path, reward_fns: list, agents, server_max_model_len: int
) -> Evaluator | None:
    """trainer.eval: the held-out prompts and the rewards that score them (trainer.eval.reward_funcs, else the training
    rewards and an environment's get_reward); None when no eval set is named."""
    if not t.eval.enabled:
        return None
    fns = [rewards.resolve(r) for r in t.eval.reward_funcs] or [*reward_fns, *(environment_rewards(agents) if agents else [])]
    if not fns:
        raise ValueError(
            "trainer.eval: no reward scores the eval completions (the environment has no get_reward); set trainer.eval.reward_funcs"
        )
    rows = load_rows(t.eval, t.columns, t.system_prompt)  # the training set's column mapping and system prompt
    return Evaluator(t.eval, par, rows, fns, job_dir, agents, server_max_model_len)


def build(plan: Plan, par: Parallel, preemption: grpo.PreemptionFlag) -> Run:
    from transformers import AutoTokenizer, set_seed

    t, job_dir = plan.config.trainer, Path(plan.job_dir)
    set_seed(t.seed)
    node_event = Events(job_dir, par.node) if par.is_leader else (lambda *a, **k: None)
    node_event(Event.RENDEZVOUS_DONE, world=par.world)
    dtype = getattr(torch, t.dtype)
    tokenizer = AutoTokenizer.from_pretrained(plan.config.vllm.model)
    data.use_chat_template(tokenizer, t.chat_template)
    # SLURM requeued this job (preemption, time limit): it continues this run even if the run started over
    # (trainer.resume: false), whose first attempt set the older checkpoints aside: a preempt checkpoint is never lost
    requeued = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    resume = checkpoint.latest(JobDir(job_dir).checkpoints) if t.resume or requeued else None
    if not (t.resume or requeued):  # a new start: earlier checkpoints would outrank this run's (retention, a resume)
        checkpoint.set_aside(JobDir(job_dir).checkpoints)
    # a resume of full training reads no weights from the model folder: its checkpoint replaces them all (a LoRA
    # checkpoint holds only the adapters, the base is the model folder's)
    read_weights = resume is None or t.lora.enabled
    # fp32 master weights; FSDP2 computes in the configured dtype (bf16 on GPU)
    model, report = loading.load_model(
        plan.config.vllm.model,
        par,
        dtype,
        loader=t.model_loading,
        activation_checkpointing=t.activation_checkpointing,
        cpu_offload=t.cpu_offload,
        lora=t.lora,
        seed=t.seed,
        attn_implementation=t.attn_implementation,
        read_weights=read_weights,
    )
    if resume is not None and not read_weights and report.loader == "sharded" and par.rank == 0:
        print(
            f"resuming from {resume[1].name}: the model folder's weights are not read (the checkpoint replaces them)", flush=True
        )
    node_event(
        Event.MODEL_LOADED, loader=report.loader, seconds=round(report.seconds, 2), read_gb=round(report.bytes_read / 1e9, 3)
    )
    # max_staleness >= 1: the node's server generates the next steps' completions while the ranks train
    lookahead = data.LookaheadPrompts(t.max_staleness) if t.max_staleness else None
    rollout = NodeRollout(model, tokenizer, par, GenerationSettings.from_plan(plan, par.node, dtype), lookahead)
    tracking.set_tracking_env(job_dir, t, plan.job_name)
    args = trl_glue.grpo_config(job_dir, t, plan.device)
    per_step = data.step_indices(args, par.world)
    if resume is None:
        cursor = data.DataCursor(0, 0, per_step)
    else:  # the data cursor: the prompts an uninterrupted run would see from this step on
        recorded = checkpoint_meta(resume[1]).data_indices_consumed
        consumed = resume[0] * per_step if recorded is None else int(recorded)  # older checkpoints did not record it
        cursor = data.DataCursor(consumed, resume[0], per_step)
    # multi-turn (tools, environments, rollout_func): each rank generates on its node's server by itself
    backend: type[TrlAdapter] = RankGeneration if t.multi_turn else TrlAdapter
    agents = resolve_agents(t.tools, t.environment, t.rollout_func, t.tool_timeout_s) if t.multi_turn else None
    reward_fns = [rewards.resolve(r) for r in t.reward_funcs]
    evaluator = make_evaluator(t, par, job_dir, reward_fns, agents, plan.config.vllm.max_model_len)
    # k >= 1: episodes run ahead in the background, whole, in the project's loop (TRL's runs inside its step)
    ahead = None
    if agents is not None and lookahead is not None and not t.rollout_func:
        bounds = UnitBounds(t.request_timeout_s, t.tool_timeout_s)
        ahead = AheadRollout(agents, lookahead, t.max_staleness, t.max_steps, bounds, plan.config.vllm.max_model_len)
        reward_fns += environment_rewards(agents)
    callback = grpo.SlurmGrpoCallback(
        job_dir,
        par,
        t,
        rollout,
        preemption,
        cursor,
        resume=resume,
        on_first_step=lambda: node_event(Event.FIRST_STEP),
        evaluator=evaluator,
    )
    trainer = trl_glue.build_trainer(
        model,
        tokenizer,
        data.load_prompts(t.dataset, t.columns, t.system_prompt),
        reward_fns,
        args,
        callback,
        functools.partial(backend, rollout),
        backend,
        agents={"rollout_func": ahead} if ahead is not None else agents.trainer_kwargs() if agents else None,
    )
    if t.importance_ratio_from_loss:  # no extra no-grad forward of each batch for TRL's vLLM importance ratio
        trl_glue.importance_ratio_from_loss(trainer)
    if t.routing_replay:  # MoE: the trainer's logprob forwards route each token as vLLM did when it sampled it
        RoutingReplay(model, rollout.routes).attach(trainer)
    if ahead is not None:
        ahead.attach(trainer, trl_glue.generation_backend(trainer))
    elif t.multi_turn:
        rank_generation = trl_glue.generation_backend(trainer)
        agent_figures.attach(trainer, rank_generation, par.rank)
        rank_generation.forward_in_first_turn = not t.rollout_func  # TRL's tool loop: every rank's first turn, each step
    if lookahead is not None:
        lookahead.attach(trainer)
    if evaluator is not None:
        evaluator.attach(trainer)
    if resume is not None:
        data.continue_data_order(trainer, cursor.base_indices)
    return Run(plan=plan, par=par, trainer=trainer, callback=callback, rollout=rollout, ahead=ahead)
