"""Evaluation on held-out prompts (trainer.eval), run by every rank together between two optimizer steps.

push     the weights of the step just finished go to every node's server first: the push the next step would make,
         brought forward (trainer.rollout.node.NodeRollout skips a push of weights the server already holds). It waits
         as a training push does for what runs ahead (trainer.max_staleness), so no eval request races a push and
         every eval completion comes from the current weights.
share    each rank takes a contiguous block of the eval prompts (scores.shard), each prompt k times; so each node
         generates its ranks' share on its own server, all nodes at once.
generate single-turn: the node's ranks' prompts in one request to the node's server (trainer.rollout.node.node_generate,
         the training path); multi-turn (tools, environments): each rank runs its episodes through the project's
         episode loop (trainer.agents.episodes) on its own client, as the training episodes run.
score    each rank calls the eval reward functions on its completions (TRL's keyword arguments: prompts, completions,
         completion_ids, the dataset's other columns, trainer_state); rank 0 gathers every share and computes pass@k
         and mean@k (scores.score), writes an EvalRow into metrics.jsonl and reports it to the trackers.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from launcher.core.config import EvalConfig
from launcher.core.records import EvalRow, format_eval
from trainer import trl_glue
from trainer.evaluation.scores import score, scored_prompts, shard, summed
from trainer.metrics import MetricsWriter
from trainer.parallel import Parallel
from trainer.rollout.node import node_generate


@dataclass
class Share:
    """One rank's part of an evaluation, gathered on rank 0."""

    node: int
    indices: list[int]
    """The eval prompts it scored (positions in the eval set)."""
    totals: list[list[float | None]]
    """Per prompt: the summed reward of each of its k completions (None: no eval reward applied to it)."""
    per_func: dict[str, list[float]] = field(default_factory=dict)
    """Each reward function's values over the rank's completions (None left out)."""
    tokens: int = 0
    completions: int = 0
    gen_s: float = 0.0


def due(cfg: EvalConfig, step: int, max_steps: int) -> bool:
    """Whether to evaluate after optimizer step `step` (0: before training)."""
    if step == 0:
        return cfg.before_training
    return step == max_steps or (cfg.every_steps > 0 and step % cfg.every_steps == 0)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _no_op(*args: Any, **kwargs: Any) -> None:
    """TRL hands reward functions log_extra and log_metric; eval completions are not logged by them."""


def call_reward(fn: Callable, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
                state: Any) -> list[float | None]:  # fmt: skip
    """One reward function on a batch, with the keyword arguments TRL gives it (an async one is run to its end)."""
    out = fn(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        **columns,
        trainer_state=state,
        log_extra=_no_op,
        log_metric=_no_op,
    )
    if inspect.isawaitable(out):
        out = asyncio.run(out)  # type: ignore[arg-type]
    out = list(out)
    if len(out) != len(prompts):
        raise ValueError(f"eval reward {_name(fn)!r} returned {len(out)} rewards for {len(prompts)} completions")
    return out


class Evaluator:
    """Held on every rank; `attach(trainer)` once the trainer exists, then `run(step)` at the steps `due` says."""

    def __init__(
        self,
        cfg: EvalConfig,
        par: Parallel,
        rows: list[dict],
        reward_fns: list[Callable],
        job_dir: Path,
        agents: Any = None,
        server_max_model_len: int = 0,
    ) -> None:
        """rows: the eval set (already cut to max_prompts); agents: trainer.agents.resolve.Agents for multi-turn;
        server_max_model_len: vllm.max_model_len, which bounds a multi-turn episode (0 = the model's own)."""
        self.server_max_model_len = server_max_model_len
        self.cfg, self.par, self.rows, self.reward_fns, self.agents = cfg, par, rows, reward_fns, agents
        self.metrics = MetricsWriter(job_dir) if par.rank == 0 else None
        self.trainer: Any = None
        self.backend: Any = None
        self.loop: Any = None
        self.push_s = 0.0
        """The push the last evaluation brought forward, in seconds (the next step counts it as its own)."""

    def attach(self, trainer) -> None:
        self.trainer = trainer
        self.backend = trl_glue.generation_backend(trainer)
        if self.agents is not None:
            from trainer.agents.ahead_rollout import trainer_loop

            self.loop = trainer_loop(trainer, self.agents, self.server_max_model_len)

    def due(self, step: int, max_steps: int) -> bool:
        return due(self.cfg, step, max_steps)

    def take_push_s(self) -> float:
        s, self.push_s = self.push_s, 0.0
        return s

    # ------------------------------------------------------------------ the run (collective over the world)
    def run(self, step: int) -> EvalRow | None:
        """Evaluate the weights after `step` optimizer steps. Every rank calls it; rank 0 returns the row it wrote."""
        assert self.trainer is not None, "attach(trainer) first"
        rollout = self.backend.rollout
        rollout.step = step  # the push and every request name the step they follow
        t0 = time.time()
        self.backend.sync_weights()
        self.push_s = time.time() - t0
        t1 = time.time()
        k = self.cfg.samples_per_prompt
        mine = list(shard(len(self.rows), self.par.world, self.par.rank))
        rows = [self.rows[i] for i in mine for _ in range(k)]
        g0 = time.time()
        if self.loop is None:
            prompts, completions, completion_ids, extra = self._single_turn(rows, step)
        else:
            prompts, completions, completion_ids, extra = self._episodes(rows, step)
        # the eval push's parity (every rank: a collective), compared here, before any optimizer step could change the
        # weights it checks; single-turn ran its trainer side while the server generated, multi-turn runs it now
        rollout.settle_parity()
        # single-turn: the node's time is its leader's (the others wait in the gather for it); multi-turn: each rank
        # generates its own, the node's time is its slowest rank's
        gen_s = time.time() - g0 if self.loop is not None or self.par.is_leader else 0.0
        share = Share(node=self.par.node, indices=mine, totals=[], gen_s=gen_s, completions=len(rows))
        share.tokens = sum(len(c) for c in completion_ids)
        if rows:
            columns = {key: [r.get(key) for r in rows] for key in rows[0] if key != "prompt"}
            columns.update(extra)
            values = [
                call_reward(fn, prompts, completions, completion_ids, columns, self.trainer.state) for fn in self.reward_fns
            ]
            for fn, vals in zip(self.reward_fns, values, strict=True):
                share.per_func[_name(fn)] = [float(v) for v in vals if v is not None]
            per_completion = [summed(vs) for vs in zip(*values, strict=True)]
            share.totals = [per_completion[j * k : (j + 1) * k] for j in range(len(mine))]
        gathered: list[Any] | None = [None] * self.par.world if self.par.rank == 0 else None
        dist.gather_object(share, gathered, dst=0)
        if gathered is None:
            return None
        row = build_row(step, gathered, self.cfg, time.time() - t1)
        assert self.metrics is not None
        self.metrics.write(row)
        print(f"eval {format_eval(row)}", flush=True)
        trl_glue.report(self.trainer, row.figures())
        return row

    def _single_turn(self, rows: list[dict], step: int) -> tuple[list, list, list[list[int]], dict[str, list]]:
        """The node's ranks' prompts in one request to the node's server (collective over the node)."""
        tokenizer = self.trainer.processing_class
        prompts = [r["prompt"] for r in rows]
        ids = trl_glue.tokenize_prompts(self.trainer, prompts) if prompts else []
        client, sampling = self.backend.rollout.client, self.backend.sampling

        def ask_server(flat: list[list[int]]):
            return client.complete(flat, **sampling, step=step)

        # the eval push's trainer side of parity while the server generates (settled in run)
        comps, _ = node_generate(self.par, ids, ask_server, meanwhile=self.backend.rollout.probe_forward)
        completion_ids = [list(c) for c, _ in comps]
        return prompts, decode(tokenizer, prompts, ids, completion_ids), completion_ids, {}

    def _episodes(self, rows: list[dict], step: int) -> tuple[list, list, list[list[int]], dict[str, list]]:
        """This rank's episodes through the project's episode loop, on this rank's own client (no collective)."""
        client, sampling = self.backend.client, self.backend.sampling
        eps = self.loop.run([dict(r) for r in rows], lambda p: client.complete(p, **sampling, step=step)) if rows else []
        extra: dict[str, list] = {
            "env_reward": [ep.env.get_reward() if callable(getattr(ep.env, "get_reward", None)) else None for ep in eps],
            "env_class": [type(ep.env).__name__ if ep.env is not None else "" for ep in eps],
            "environments": [ep.env for ep in eps],
        }
        return [r["prompt"] for r in rows], [ep.messages for ep in eps], [ep.completion_ids for ep in eps], extra


def decode(tokenizer, prompts: list, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list:
    """Completions as TRL hands them to rewards: text for plain prompts; for conversational ones an assistant message,
    parsed by TRL's response parser when the tokenizer has a response schema."""
    if not prompts or not isinstance(prompts[0], list):
        return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema", None) is not None:
        return [[trl_glue.parse_response(tokenizer, c, p, [])] for c, p in zip(completion_ids, prompt_ids, strict=True)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts]


def build_row(step: int, shares: list[Share], cfg: EvalConfig, seconds: float) -> EvalRow:
    """Rank 0: every rank's share, in prompt order, made into the evaluation's row."""
    by_prompt: dict[int, list[float | None]] = {}
    per_func: dict[str, list[float]] = {}
    gen_s: dict[str, float] = {}
    per_node: dict[str, int] = {}
    tokens = completions = 0
    for s in shares:
        by_prompt.update(zip(s.indices, s.totals, strict=True))
        for name, vals in s.per_func.items():
            per_func.setdefault(name, []).extend(vals)
        node = str(s.node)
        gen_s[node] = max(gen_s.get(node, 0.0), round(s.gen_s, 4))
        per_node[node] = per_node.get(node, 0) + len(s.indices)
        tokens, completions = tokens + s.tokens, completions + s.completions
    kept, left_out = scored_prompts(by_prompt)
    scores = score([kept[i] for i in sorted(kept)], cfg.pass_threshold) if kept else None
    return EvalRow(
        step=step,
        prompts=len(kept),
        samples_per_prompt=cfg.samples_per_prompt,
        threshold=cfg.pass_threshold,
        pass_at={str(j): round(v, 6) for j, v in scores.pass_at.items()} if scores else {},
        mean_at_k=round(scores.mean_at_k, 6) if scores else None,
        reward_std=round(scores.reward_std, 6) if scores else None,
        prompts_left_out=left_out,
        reward_funcs={name: round(sum(v) / len(v), 6) for name, v in per_func.items() if v},
        completion_tokens_mean=round(tokens / max(completions, 1), 2),
        seconds=round(seconds, 3),
        gen_s=dict(sorted(gen_s.items())),
        prompts_per_node=dict(sorted(per_node.items())),
    )


def load_rows(cfg: EvalConfig, columns: dict[str, str] | None = None, system_prompt: str = "") -> list[dict]:
    """The eval set, through the trainer's own loader (the same formats, checks, column mapping and system prompt as
    trainer.dataset)."""
    from trainer import data

    ds = data.load_prompts(cfg.dataset, columns, system_prompt)
    if cfg.max_prompts:
        ds = ds.select(range(min(cfg.max_prompts, len(ds))))
    return [dict(r) for r in ds]
