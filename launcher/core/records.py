"""The records the three processes exchange through the job folder, typed: a step's row, an evaluation's row, a resume's
row and a run's final row in metrics.jsonl, a node's figures for one step, a checkpoint's meta.json, the node events. Writers build
these dataclasses, readers parse them (`read_rows`, `read_events`, `CheckpointMeta.read`); no reader picks a row apart
by string key or tells a row's kind by which keys it happens to hold.

The JSON keys are today's (plus "kind" on metrics rows), so job folders written before still read: a metrics row
without "kind" is recognised once, in `row_from_dict`, by the rule used before (a step row holds "reward", the others
name themselves under "event")."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

# ---------------------------------------------------------------------------------------------------- node events


class Event(str, Enum):
    """What logs/node{i}-events.jsonl records: the node supervisor's phases (launcher.node.bootstrap) and the trainer
    leader's start-up (trainer.run). `slurm-grpo status` reads them."""

    BOOTSTRAP_START = "bootstrap_start"
    LEFTOVERS = "leftovers"
    VLLM_START = "vllm_start"
    VLLM_HEALTHY = "vllm_healthy"
    TRAINER_START = "trainer_start"
    RENDEZVOUS_DONE = "rendezvous_done"
    MODEL_LOADED = "model_loaded"
    FIRST_STEP = "first_step"
    PREEMPT_SIGNAL = "preempt_signal"
    VLLM_EXIT = "vllm_exit"
    TRAINER_EXIT = "trainer_exit"
    FAILED = "failed"
    REQUEUE = "requeue"
    SLURM_ASKED = "slurm_asked"
    """A node was lost: the one surviving node that asks SLURM (launcher.node.lost) sent these commands."""
    BOOTSTRAP_END = "bootstrap_end"

    def __str__(self) -> str:  # the name written to and read from the events file (a str Enum prints its member)
        return self.value


@dataclass(frozen=True)
class NodeEvent:
    """One line of logs/node{i}-events.jsonl: when, which node, what; the fields some events carry are typed here,
    the rest (pids, the requeue's stderr, the loader's figures) stay in `extra` for people reading the file."""

    t: float
    node: int
    event: Event | str
    """An `Event`; a name this version does not know stays a str (a newer writer)."""
    host: str | None = None
    seconds: float | None = None
    error: str | None = None
    code: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeEvent:
        known = {"t", "node", "event", "host", "seconds", "error", "code"}
        name = d["event"]
        return cls(
            t=float(d["t"]),
            node=int(d.get("node", -1)),
            event=_event(name),
            host=d.get("host"),
            seconds=d.get("seconds"),
            error=d.get("error"),
            code=d.get("code"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t, "node": self.node, "event": str(self.event)}
        for k in ("host", "seconds", "error", "code"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return {**out, **self.extra}


def _event(name: Any) -> Event | str:
    try:
        return Event(name)
    except ValueError:
        return str(name)


def event_line(node: int, event: Event, **kw: Any) -> str:
    """The JSON line an events file gets for `event` now (kw: the event's own fields)."""
    return json.dumps({"t": time.time(), "node": node, "event": str(event), **kw}) + "\n"


def read_events(path: Path) -> list[NodeEvent]:
    """A node's events file, oldest first ([] when none yet; a line being written now is skipped)."""
    return [NodeEvent.from_dict(d) for d in read_jsonl(path) if "event" in d and "t" in d]


@dataclass(frozen=True)
class AbortRecord:
    """logs/abort-<attempt>.json: the first node of an attempt that failed, and why (every other node stops)."""

    node: int
    host: str
    error: str
    t: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AbortRecord:
        return _from_dict(cls, json.loads(text))


@dataclass(frozen=True)
class Heartbeat:
    """logs/heartbeat-<attempt>/node<i>.json: a node's supervisor is alive (beat grows), or ending (done)."""

    node: int
    host: str
    beat: int
    done: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Heartbeat:
        return _from_dict(cls, json.loads(text))


# ---------------------------------------------------------------------------------------------------- metrics rows


@dataclass(frozen=True)
class NodeFigures:
    """One node's generation, push and parity figures for one step, as its leader holds them when the step's batch
    is generated (None: not measured on this node at this step). Counters (ahead_*, pushes_paused*) run from the
    attempt's start."""

    push_s: float | None = None
    gen_s: float | None = None
    """The server's time for this step's batch."""
    gen_wait_s: float | None = None
    """What the step waited for its batch (less than gen_s when it was generated ahead)."""
    parity: float | None = None
    """Largest logprob difference, trainer vs server, right after this step's push."""
    parity_stale: float | None = None
    """The same, before the push: how far the server's weights were behind."""
    parity_engines: list[float] | None = None
    """With vLLM data parallelism: the after-push parity of each engine of the node's server."""
    probe_drift: float | None = None
    """How far the trainer's probe logprobs have moved since the attempt's first push (largest difference): with the
    parity holding, how far the server followed; near 0 after many steps, the model is barely learning."""
    gen_tokens: int | None = None
    server_requests: int | None = None
    prompts_digest: str | None = None
    """Which prompts the node generated for at this step (a resumed run must continue the same order)."""
    staleness: int | None = None
    """How many optimizer steps old the weights were that generated this step's completions."""
    ahead_hits: int = 0
    ahead_misses: int = 0
    pushes_paused: int = 0
    """Pushes so far that paused requests sent ahead (max_staleness >= 2) and resumed them after."""
    pushes_paused_running: int = 0
    """Of those, the ones where a paused request was still generating."""
    parity_s: float | None = None
    """Seconds the step's parity checks took (the trainer's forward and the server's probes, stale and after)."""
    push_bytes: int | None = None
    """What the last push moved to the server: every weight's bytes, or only the adapter's (trainer.lora)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeFigures:
        return _from_dict(cls, d)


PerNode = dict[str, Any]
"""The JSON shape of a per-node figure: node index (as a string, JSON's keys) -> value."""


@dataclass(frozen=True)
class StepRow:
    """metrics.jsonl: one optimizer step (written by the trainer's rank 0 after TRL logs the step). Per-node maps are
    keyed by the node index as a string (JSON object keys)."""

    step: int
    reward: float
    reward_std: float | None = None
    loss: float | None = None
    kl: float | None = None
    lr: float | None = None
    """The learning rate of the step (TRL's learning_rate): a resumed run continues the schedule."""
    rng_digest: str | None = None
    """Rank 0's torch RNG state after the step, hashed: a resumed run continues the same draws."""
    step_s: float | None = None
    checkpoint_s: float | None = None
    """Seconds the step was held by a checkpoint written at its end (rank 0): the whole write, or with
    trainer.async_checkpoint the copy into host memory (and any wait for the previous write); None: none written."""
    push_s: dict[str, float] = field(default_factory=dict)
    gen_s: dict[str, float] = field(default_factory=dict)
    gen_wait_s: dict[str, float] = field(default_factory=dict)
    parity: dict[str, float | None] = field(default_factory=dict)
    parity_stale: dict[str, float | None] = field(default_factory=dict)
    parity_engines: dict[str, list[float] | None] = field(default_factory=dict)
    probe_drift: dict[str, float | None] = field(default_factory=dict)
    parity_max: float | None = None
    gen_tokens: dict[str, int | None] = field(default_factory=dict)
    gen_tokens_per_s_node: dict[str, float] = field(default_factory=dict)
    server_requests: dict[str, int | None] = field(default_factory=dict)
    prompts_digest: dict[str, str | None] = field(default_factory=dict)
    staleness: dict[str, int | None] = field(default_factory=dict)
    ahead_misses: dict[str, int] = field(default_factory=dict)
    pushes_paused: dict[str, int] = field(default_factory=dict)
    pushes_paused_running: dict[str, int] = field(default_factory=dict)
    parity_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the step's parity checks per node (trainer.parity_every)."""
    push_bytes: dict[str, int | None] = field(default_factory=dict)
    is_ratio_mean: float | None = None
    """TRL's importance-sampling ratio (asynchronous generation)."""
    logp_mismatch_mean: float | None = None
    """TRL's vLLM-vs-trainer logprob difference."""
    gen_tokens_per_s: float | None = None
    agents: dict[str, float] = field(default_factory=dict)
    """Multi-turn figures of rank 0 (trainer.agents.figures: agents/turns_per_episode, agents/tool_s, ...) and TRL's
    tools/call_frequency, tools/failure_frequency; empty for single-turn runs."""
    time: float | None = None
    """When the row was written (the writer adds it)."""
    kind: Literal["step"] = "step"

    PER_NODE = (
        "push_s",
        "gen_s",
        "gen_wait_s",
        "parity",
        "parity_stale",
        "parity_engines",
        "probe_drift",
        "gen_tokens",
        "gen_tokens_per_s_node",
        "server_requests",
        "prompts_digest",
        "staleness",
        "ahead_misses",
        "pushes_paused",
        "pushes_paused_running",
        "parity_s",
        "push_bytes",
    )
    """The fields that hold one value per node."""

    @classmethod
    def build(
        cls,
        step: int,
        logs: Mapping[str, Any],
        step_s: float,
        by_node: Mapping[int, NodeFigures],
        rng_digest: str | None = None,
        checkpoint_s: float | None = None,
    ) -> StepRow:
        """The row of one step from TRL's log record of it (`logs`, TRL's own keys) and each node's figures."""
        nodes = sorted(by_node.items())
        tps = {str(n): round(f.gen_tokens / max(f.gen_s, 1e-9), 1) for n, f in nodes if f.gen_s and f.gen_tokens is not None}
        return cls(
            step=step,
            reward=logs["reward"],
            reward_std=logs.get("reward_std"),
            loss=logs.get("loss"),
            kl=logs.get("kl"),
            lr=logs.get("learning_rate"),
            rng_digest=rng_digest,
            step_s=round(step_s, 3),
            checkpoint_s=checkpoint_s,
            push_s={str(n): round(f.push_s, 4) for n, f in nodes if f.push_s is not None},
            gen_s={str(n): round(f.gen_s, 4) for n, f in nodes if f.gen_s},
            gen_wait_s={str(n): round(f.gen_wait_s, 4) for n, f in nodes if f.gen_wait_s is not None},
            parity={str(n): f.parity for n, f in nodes},
            parity_stale={str(n): f.parity_stale for n, f in nodes},
            parity_engines={str(n): f.parity_engines for n, f in nodes},
            probe_drift={str(n): f.probe_drift for n, f in nodes},
            parity_max=max((f.parity for _, f in nodes if f.parity is not None), default=None),
            gen_tokens={str(n): f.gen_tokens for n, f in nodes},
            gen_tokens_per_s_node=tps,
            server_requests={str(n): f.server_requests for n, f in nodes},
            prompts_digest={str(n): f.prompts_digest for n, f in nodes},
            staleness={str(n): f.staleness for n, f in nodes},
            ahead_misses={str(n): f.ahead_misses for n, f in nodes},
            pushes_paused={str(n): f.pushes_paused for n, f in nodes},
            pushes_paused_running={str(n): f.pushes_paused_running for n, f in nodes},
            parity_s={str(n): round(f.parity_s, 4) for n, f in nodes if f.parity_s is not None},
            push_bytes={str(n): f.push_bytes for n, f in nodes},
            is_ratio_mean=logs.get("sampling/importance_sampling_ratio/mean"),
            logp_mismatch_mean=logs.get("sampling/sampling_logp_difference/mean"),
            gen_tokens_per_s=round(sum(tps.values()), 1) if tps else None,
            agents={k: float(v) for k, v in logs.items() if k.startswith(("agents/", "tools/"))},
        )

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepRow:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class ParityRecord:
    """One parity check of a node: at which step, before ("stale") or after ("after_push") the push, the largest
    difference and each engine's."""

    step: int
    kind: str
    max_diff: float
    per_engine: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParityRecord:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class NodeFinal:
    """One node's figures at the end of a run (its leader's; the run's last push included)."""

    node: int
    parity_final: float | None = None
    push_s_final: float | None = None
    pushes: int = 0
    server_requests: int | None = None
    trainer_peak_gpu_gb: float | None = None
    parity_history: list[ParityRecord] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeFinal:
        d = dict(d)
        d["parity_history"] = [ParityRecord.from_dict(h) for h in d.get("parity_history") or []]
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FinalRow:
    """metrics.jsonl: the run's end (after the last push), each node's final figures by node index."""

    step: int
    nodes: dict[str, NodeFinal] = field(default_factory=dict)
    time: float | None = None
    kind: Literal["final"] = "final"

    def to_dict(self) -> dict[str, Any]:
        out = _to_dict(self)
        out["nodes"] = {n: f.to_dict() for n, f in self.nodes.items()}
        return {"event": "final", **out}  # "event": how rows were told apart before "kind"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FinalRow:
        d = dict(d)
        d["nodes"] = {str(n): NodeFinal.from_dict(f) for n, f in (d.get("nodes") or {}).items()}
        return _from_dict(cls, d)


@dataclass(frozen=True)
class ResumedRow:
    """metrics.jsonl: a run resumed from a checkpoint (the rows of later steps were set aside in metrics.lost.jsonl)."""

    from_step: int
    checkpoint: str
    reason: str | None = None
    """The checkpoint's CheckpointMeta.reason (periodic, preempt, final)."""
    steps_redone: int = 0
    data_indices_skipped: int = 0
    time: float | None = None
    kind: Literal["resumed"] = "resumed"

    def to_dict(self) -> dict[str, Any]:
        return {"event": "resumed", **_to_dict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResumedRow:
        return _from_dict(cls, d)


@dataclass(frozen=True)
class EvalRow:
    """metrics.jsonl: one evaluation on the held-out prompts (trainer.eval), with the weights after optimizer step
    `step` (0: before training). Each prompt got k completions; pass@j is the unbiased estimator (Chen et al. 2021)
    of the chance that one of j completions passes (summed eval reward >= threshold), averaged over the prompts."""

    step: int
    prompts: int
    """Eval prompts scored (every node's share together), those left out not counted."""
    samples_per_prompt: int
    """k: completions per prompt."""
    threshold: float
    """A completion passes when its summed eval reward is >= this."""
    pass_at: dict[str, float] = field(default_factory=dict)
    """j (as a string, JSON's keys) -> pass@j, for j = 1, 2, 4, ... and k."""
    mean_at_k: float | None = None
    """The mean summed reward of the k completions of a prompt, averaged over the prompts."""
    reward_std: float | None = None
    """The standard deviation of the summed reward over every completion."""
    reward_funcs: dict[str, float] = field(default_factory=dict)
    """Each eval reward function's mean (its name -> mean; None values, TRL's "does not apply", left out)."""
    completion_tokens_mean: float | None = None
    seconds: float | None = None
    """The evaluation's wall time (generation, rewards, gathering), without the weight push it may have started with
    (the next step's push, brought forward: StepRow.push_s has it)."""
    gen_s: dict[str, float] = field(default_factory=dict)
    """Per node: the seconds its generation of its share took (the slowest of its ranks)."""
    prompts_per_node: dict[str, int] = field(default_factory=dict)
    prompts_left_out: int = 0
    """Eval prompts left out of pass@j, mean@k and reward_std: a completion of theirs got no reward (every eval reward
    function returned None, e.g. math_accuracy on a solution that does not parse), so it is neither a pass nor a fail."""
    time: float | None = None
    kind: Literal["eval"] = "eval"

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EvalRow:
        return _from_dict(cls, d)

    def figures(self) -> dict[str, float]:
        """The row as tracker scalars, named as transformers names evaluation figures ("eval_" prefix: W&B and
        TensorBoard show them under eval/)."""
        out = {f"eval_pass@{j}": v for j, v in self.pass_at.items()}
        out |= {f"eval_rewards/{name}": v for name, v in self.reward_funcs.items()}
        for name in ("mean_at_k", "reward_std", "completion_tokens_mean", "seconds"):
            value = getattr(self, name)
            if value is not None:
                out["eval_" + ("mean@k" if name == "mean_at_k" else name)] = float(value)
        return out


def format_eval(row: EvalRow | None) -> str:
    if row is None:
        return "no evaluation yet"
    k = row.samples_per_prompt
    passes = ", ".join(f"pass@{j} {v:.3f}" for j, v in row.pass_at.items())
    mean = f"mean@{k} {row.mean_at_k:.4f}" if row.mean_at_k is not None else f"mean@{k} n/a"
    took = f", {row.seconds:.1f} s" if row.seconds is not None else ""
    left = f", {row.prompts_left_out} left out: no reward" if row.prompts_left_out else ""
    passes = passes or "no prompt scored"
    return (
        f"step {row.step}: {passes}; {mean} (reward >= {row.threshold:g} passes; {row.prompts} prompts x {k} samples{left}{took})"
    )


def eval_rows(rows: Iterable[Row]) -> list[EvalRow]:
    return [r for r in rows if isinstance(r, EvalRow)]


Row = StepRow | FinalRow | ResumedRow | EvalRow
ROW_KINDS: dict[str, type[StepRow] | type[FinalRow] | type[ResumedRow] | type[EvalRow]] = {
    "step": StepRow,
    "final": FinalRow,
    "resumed": ResumedRow,
    "eval": EvalRow,
}


def row_from_dict(d: Mapping[str, Any]) -> Row | None:
    """A metrics.jsonl row, typed by its "kind"; None for a kind this version does not know. Rows written before
    "kind" existed: a step row is the one holding "reward" (and "step"), the others name themselves under "event"."""
    kind = d.get("kind")
    if kind is None:  # the one place the old rule lives
        kind = "step" if "reward" in d and "step" in d else d.get("event")
    cls = ROW_KINDS.get(str(kind))
    return cls.from_dict(d) if cls is not None else None


def row_to_json(row: Row) -> str:
    return json.dumps(row.to_dict())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of a file ([] when it does not exist; a line being written right now is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def read_rows(path: Path) -> list[Row]:
    """metrics.jsonl, typed (rows of unknown kinds and lines cut by a crash skipped)."""
    return [r for r in (row_from_dict(d) for d in read_jsonl(path) if isinstance(d, dict)) if r is not None]


def step_rows(rows: Iterable[Row]) -> list[StepRow]:
    return [r for r in rows if isinstance(r, StepRow)]


# ---------------------------------------------------------------------------------------------------- the summary


@dataclass(frozen=True)
class Summary:
    """What `summarize` finds in a run's step rows: reward over the first vs the last `window` steps, push seconds
    per node, parity, generation tokens/s, step seconds."""

    steps: int
    last_step: int
    window: int
    reward_first: float
    reward_last: float
    push_s_median: dict[str, float]
    parity_max: float | None
    gen_tokens_per_s_median: float | None
    step_s_median: float | None
    parity_s_median: dict[str, float] = field(default_factory=dict)
    """The parity checks' seconds per step, per node (trainer.parity_every)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def summarize(rows: Iterable[Row], k: int = 0) -> Summary | None:
    """The summary of a run's rows (None before its first step row). k: the window (default: a quarter of the
    steps, 1 to 5)."""
    steps = step_rows(rows)
    if not steps:
        return None
    k = k or max(1, min(5, len(steps) // 4))
    push: dict[str, list[float]] = {}
    parity_s: dict[str, list[float]] = {}
    for r in steps:
        for node, s in r.push_s.items():
            push.setdefault(node, []).append(s)
        for node, s in r.parity_s.items():
            parity_s.setdefault(node, []).append(s)
    parity = [r.parity_max for r in steps if r.parity_max is not None]
    tps = [r.gen_tokens_per_s for r in steps if r.gen_tokens_per_s]
    step_s = [r.step_s for r in steps if r.step_s is not None]
    return Summary(
        steps=len(steps),
        last_step=steps[-1].step,
        window=k,
        reward_first=round(sum(r.reward for r in steps[:k]) / k, 4),
        reward_last=round(sum(r.reward for r in steps[-k:]) / k, 4),
        push_s_median={n: round(_median(v), 4) for n, v in sorted(push.items())},
        parity_max=float(f"{max(parity):.3g}") if parity else None,
        gen_tokens_per_s_median=round(_median(tps), 1) if tps else None,
        step_s_median=round(_median(step_s), 3) if len(step_s) == len(steps) else None,
        parity_s_median={n: round(_median(v), 4) for n, v in sorted(parity_s.items())},
    )


def format_summary(s: Summary | None) -> str:
    """One line; a figure the run did not record is left out (never printed as None)."""
    if s is None:
        return "no training steps recorded yet"
    push = ", ".join(f"node {n}: {v:.3f} s" for n, v in s.push_s_median.items()) or "none"
    checks = ", ".join(f"node {n}: {v:.3f} s" for n, v in s.parity_s_median.items())
    parts = [
        f"steps {s.steps} (last {s.last_step})",
        f"reward first {s.window} steps {s.reward_first:.4f} -> last {s.window} {s.reward_last:.4f}",
        f"push median {push}",
    ]
    if s.parity_max is not None:
        parts.append(f"parity max {s.parity_max}" + (f" (its checks, median per step: {checks})" if checks else ""))
    elif checks:
        parts.append(f"parity checks, median per step: {checks}")
    if s.gen_tokens_per_s_median is not None:
        parts.append(f"generation {s.gen_tokens_per_s_median} tokens/s")
    if s.step_s_median is not None:
        parts.append(f"step {s.step_s_median} s")
    return "; ".join(parts)


def _per_node(values: Mapping[str, Any], fmt: str) -> str:
    return ", ".join(f"node {n}: {format(v, fmt)}" for n, v in values.items() if v is not None)


def format_step(r: StepRow) -> str:
    """A step row as `status` shows it: the figures it recorded, one line (the raw row is in metrics.jsonl)."""
    head = [f"reward {r.reward:.4f}" + (f" (std {r.reward_std:.4f})" if r.reward_std is not None else "")]
    head += [f"{name} {v:.4g}" for name, v in (("loss", r.loss), ("kl", r.kl), ("lr", r.lr)) if v is not None]
    head += [f"{r.step_s:.2f} s"] if r.step_s is not None else []
    parts = [", ".join(head)]
    push, parity = _per_node(r.push_s, ".3f"), _per_node(r.parity, ".3g")
    parts += [f"push {push} s"] if push else []
    parts += [f"parity {parity}"] if parity else []
    parts += [f"generation {r.gen_tokens_per_s:.0f} tokens/s"] if r.gen_tokens_per_s else []
    return f"step {r.step}: " + "; ".join(parts)


def format_final(r: FinalRow) -> str:
    """The run's end row: each node's last parity, push and peak, one line."""
    nodes = []
    for n, f in r.nodes.items():
        what = [f"{f.pushes} pushes"]
        what += [f"last push {f.push_s_final:.3f} s"] if f.push_s_final is not None else []
        what += [f"final parity {f.parity_final:.3g}"] if f.parity_final is not None else []
        what += [f"{len(f.parity_history)} parity checks"] if f.parity_history else []
        what += [f"trainer peak {f.trainer_peak_gpu_gb:.1f} GB GPU"] if f.trainer_peak_gpu_gb is not None else []
        nodes.append(f"node {n}: " + ", ".join(what))
    return f"finished at step {r.step}" + (": " + "; ".join(nodes) if nodes else "")


# ---------------------------------------------------------------------------------------------------- checkpoints

CheckpointReason = Literal["periodic", "preempt", "final"]
"""Why a checkpoint was written: every save_steps (and the final one), or on a preemption signal (then the node's
bootstrap requeues the job, `launcher.node.bootstrap.preempt_checkpoint`)."""


@dataclass(frozen=True)
class CheckpointMeta:
    """checkpoints/step-N/meta.json, written last (a folder counts as a checkpoint only once it exists)."""

    step: int
    world_size: int
    reason: CheckpointReason = "periodic"
    attempt: str = ""
    """The attempt that wrote it ($SLURM_GRPO_ATTEMPT): the bootstrap requeues only on its own attempt's preempt."""
    data_indices_consumed: int | None = None
    """How far into the sampler's stream the run was (None: written before it was recorded)."""
    reward_last: float | None = None
    time: float = 0.0

    def __post_init__(self) -> None:
        if self.reason not in get_args(CheckpointReason):
            raise ValueError(f"checkpoint meta: reason {self.reason!r} is not one of {', '.join(get_args(CheckpointReason))}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckpointMeta:
        return _from_dict(cls, d)

    @classmethod
    def read(cls, path: Path) -> CheckpointMeta:
        """A checkpoint's meta file (its path: launcher.core.jobdir.meta_file)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def write(self, path: Path) -> Path:
        """Flushed to disk (the file's presence marks the checkpoint complete: write it last)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        return path


# ---------------------------------------------------------------------------------------------------- helpers

T = TypeVar("T")


def _from_dict(cls: type[T], d: Mapping[str, Any]) -> T:
    """cls from a JSON object: keys the dataclass does not have are dropped (a newer writer), missing ones default
    (an older writer)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in d.items() if k in names})


def _to_dict(obj: Any) -> dict[str, Any]:
    """A row as JSON: "kind" and "time" first (as the writer has always put "time"), then the fields in order."""
    d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    head = {"kind": d.pop("kind")}
    if d.get("time") is not None:
        head["time"] = d["time"]
    d.pop("time", None)
    return {**head, **d}
