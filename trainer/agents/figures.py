"""What a multi-turn step did, in the trainer's log record (metrics.jsonl's `agents`, the trackers): this rank's turns
per episode, tool calls, failures, timeouts and seconds, its generation requests and seconds. TRL adds its own
tools/call_frequency and tools/failure_frequency. Rank 0's figures are the ones logged (TRL logs rank 0's record).

TRACE_ENV names a folder where each rank appends every generated batch and every batch the loss sees (test-only: the
integration tier checks the tool mask that reaches the loss, token by token)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer import trl_glue
from trainer.agents.deadline import CLOCK
from trainer.agents.generation import RankGeneration

TRACE_ENV = "SLURM_GRPO_TEST_AGENT_TRACE"
"""Test-only: a folder; each rank appends rank<r>.jsonl there (one line per generated batch and per loss batch)."""


def turns(tool_mask: list[list[int]] | None, episodes: int) -> list[int]:
    """Turns of each episode: 1 + the number of tool results (runs of 0 in its tool mask) it read."""
    if tool_mask is None:
        return [1] * episodes
    return [1 + sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1)) for mask in tool_mask]


Trace = Callable[..., None]


def trace(trainer, rank: int) -> Trace:
    """write(kind, **data): a line of this rank's trace (nothing unless TRACE_ENV is set); the batch each loss sees is
    traced from now on."""
    folder = os.environ.get(TRACE_ENV)
    path = Path(folder) / f"rank{rank}.jsonl" if folder else None

    def write(kind: str, **data: Any) -> None:
        if path is not None:
            with path.open("a") as f:
                f.write(json.dumps({"kind": kind, "rank": rank, "step": trainer.state.global_step, **data}) + "\n")

    def before_loss(inputs: dict[str, Any]) -> None:
        mask = inputs.get("tool_mask")
        write(
            "loss",
            completion_ids=inputs["completion_ids"].tolist(),
            completion_mask=inputs["completion_mask"].tolist(),
            tool_mask=mask.tolist() if mask is not None else None,
        )

    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        trl_glue.before_loss(trainer, before_loss)
    return write


def log(trainer, figures: dict[str, float]) -> None:
    for name, value in figures.items():
        trl_glue.log_metric(trainer, name, float(value))


def attach(trainer, backend: RankGeneration, rank: int) -> None:
    """TRL's own tool loop (synchronous): the figures of each generated batch, after TRL's loop finished it."""
    write = trace(trainer, rank)

    def after_generate(prompt_ids, completion_ids, tool_mask) -> None:
        per_episode = turns(tool_mask, len(completion_ids))
        tools, gen = CLOCK.take(), backend.take_figures()
        figures = {
            "agents/turns_per_episode": sum(per_episode) / max(1, len(per_episode)),
            "agents/turns_max": max(per_episode, default=0),
            "agents/tool_calls": tools["calls"],
            "agents/tool_failures": tools["failures"],
            "agents/tool_timeouts": tools["timeouts"],
            "agents/tool_s": tools["seconds"],
            "agents/requests": gen["requests"],
            "agents/gen_s": gen["gen_s"],
            "agents/gen_tokens": gen["tokens"],
        }
        log(trainer, figures)
        write("generated", prompt_ids=prompt_ids, completion_ids=completion_ids, tool_mask=tool_mask, figures=figures)

    trl_glue.after_generate(trainer, after_generate)
