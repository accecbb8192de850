"""The project's own episode loop, for multi-turn with trainer.max_staleness k >= 1: an episode of step s+k runs whole
(every turn and tool call) in the background on this rank, under the weights the server had when it started, while
the ranks train; TRL's own loop cannot (it runs inside TRL's generation step). It is handed to TRL as a rollout_func
and mirrors TRL 1.16's tool loop token for token (tests/unit/test_agents_episodes.py runs both on the same episodes):

  prompt    the chat template with the episode's tools, after reset(**row) appended its observation
  turn      one completion per live episode, parsed by TRL's parse_response; its tool calls run (with deadlines) and
            their results come back through the template's tool turn (the ids after the assistant turn's end), masked
            out of the loss (env_mask 0, logprob 0.0); a result that would pass max_completion_length or the model's
            length ends the episode instead; at most max_tool_calling_iterations rounds
  reward    get_reward() at the episode's end, handed to TRL as the extra field `env_reward` (a reward function named
            after the environment's class reads it), the episode's messages as `messages`, its staleness as `staleness`

Each episode gets a fresh environment instance (instances of a step s+k episode must not be reset while step s's
rewards read theirs). Weights: RankGeneration.sync_weights waits for every episode this rank has running before the
push, so none straddles two weight versions; an episode used at step g started at step g - staleness.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.agents.deadline import RESERVED

Generate = Callable[[list[list[int]]], list[tuple[list[int], list[float]]]]
"""One completion (token ids, logprob of each) per prompt entry."""

Note = Callable[[str], None]
"""Told the kind of each unit of an episode's work as it begins: "reset", "generate" or "tool" (UNITS)."""


def _no_note(unit: str) -> None:
    pass


@dataclass
class Episode:
    prompt: list[dict]
    """The conversation before generation (after reset's observation)."""
    env: Any
    tools: dict[str, Callable]
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """What TRL's loop calls the completion: the assistant and tool messages of the episode."""
    tool_calls: int = 0
    tool_failures: int = 0


@dataclass(frozen=True)
class LoopSettings:
    max_completion_length: int
    max_model_len: int
    max_iterations: int


class EpisodeLoop:
    """Runs a batch of episodes with `generate`; pure with respect to the trainer (safe on a background thread).

    render(prompt, tools) -> prompt ids (TRL's tokenization with tools); suffix(tool_messages) -> the ids of the
    template's tool turn (TRL's _get_tool_suffix_ids); parse(ids, prefix, tools) -> an assistant message (TRL's
    parse_response)."""

    def __init__(
        self,
        factories: dict[str | None, Callable[[], Any]],
        standalone_tools: list[Callable],
        render: Callable[[list[dict], list[Callable]], list[int]],
        suffix: Callable[[list[dict]], list[int]],
        parse: Callable[[list[int], list[int], list[Callable]], dict],
        settings: LoopSettings,
    ) -> None:
        self.factories, self.standalone_tools = factories, standalone_tools
        self.render, self.suffix, self.parse, self.settings = render, suffix, parse, settings

    def start(self, rows: list[dict], note: Note = _no_note) -> list[Episode]:
        episodes = []
        multi = None not in self.factories
        for row in rows:
            if self.factories:  # watched from before the factory: it is user code too (a sandbox may start there)
                note("reset")
            env = self.factories[row.get("environment") if multi else None]() if self.factories else None
            prompt = copy.deepcopy(row["prompt"])
            if env is not None:
                observation = env.reset(**({k: v for k, v in row.items() if k != "environment"} if multi else row))
                if observation is not None:  # appended to the last message, as TRL does
                    prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
            methods = [
                getattr(env, n)
                for n, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
                if n not in RESERVED and not n.startswith("_")
            ] if env is not None else []  # fmt: skip
            tools = {t.__name__: t for t in self.standalone_tools + methods}
            episodes.append(Episode(prompt=prompt, env=env, tools=tools))
        return episodes

    def run(self, rows: list[dict], generate: Generate, note: Note = _no_note) -> list[Episode]:
        """note: told of each reset, generation request and tool call as it begins (AheadEpisodes' deadline)."""
        s = self.settings
        eps = self.start(rows, note)
        for ep in eps:
            ep.prompt_ids = self.render(ep.prompt, list(ep.tools.values()))
        note("generate")
        for ep, (ids, lps) in zip(eps, generate([ep.prompt_ids for ep in eps]), strict=True):
            ep.completion_ids, ep.logprobs, ep.mask = list(ids), list(lps), [1] * len(ids)
            ep.messages = [self.parse(ids, ep.prompt_ids, list(ep.tools.values()))]
        live = [ep for ep in eps if ep.messages[-1].get("tool_calls")]
        iteration = 0
        while live and iteration < s.max_iterations:
            pending = []
            for ep in live:
                before = (len(ep.messages), len(ep.prompt))
                ep.prompt.append(ep.messages[-1])
                results = [self.call(ep, c, note) for c in ep.messages[-1]["tool_calls"]]
                tool_messages = [
                    {"role": "tool", "name": name, "content": r if isinstance(r, list) else str(r)} for name, r in results
                ]
                ep.prompt += tool_messages
                ep.messages += tool_messages
                ids = ep.prompt_ids + ep.completion_ids + self.suffix(tool_messages)
                if len(ids) - len(ep.prompt_ids) > s.max_completion_length or len(ids) >= s.max_model_len:
                    del ep.messages[before[0] :], ep.prompt[before[1] :]  # the episode ends as it was
                    continue
                pending.append((ep, ids))
            if not pending:
                break
            note("generate")
            outs = generate([ids for _, ids in pending])
            live = []
            for (ep, ids), (post, post_lps) in zip(pending, outs, strict=True):
                tool_len = len(ids) - len(ep.prompt_ids) - len(ep.completion_ids)
                room = s.max_completion_length - (len(ids) - len(ep.prompt_ids))
                post, post_lps = list(post[: max(room, 0)]), list(post_lps[: max(room, 0)])
                ep.mask += [0] * tool_len + [1] * len(post)
                ep.logprobs += [0.0] * tool_len + post_lps
                ep.completion_ids = ids[len(ep.prompt_ids) :] + post
                if post:
                    ep.messages.append(self.parse(post, ids, list(ep.tools.values())))
                    if ep.messages[-1].get("tool_calls"):
                        live.append(ep)
            iteration += 1
        return eps

    def call(self, ep: Episode, tool_call: dict, note: Note = _no_note) -> tuple[str, Any]:
        """One tool call as TRL's loop makes it: a failure becomes {"error": ...} for the model."""
        note("tool")
        ep.tool_calls += 1
        if tool_call.get("type") != "function":
            ep.tool_failures += 1
            return tool_call.get("name", "unknown"), {"error": f"Unsupported tool call type: {tool_call.get('type')}"}
        name, args = tool_call["function"]["name"], tool_call["function"]["arguments"]
        try:
            if name not in ep.tools:
                raise ValueError(f"Tool {name} not found.")
            out = ep.tools[name](**args)
            return name, asyncio.run(out) if inspect.iscoroutine(out) else out
        except Exception as e:
            ep.tool_failures += 1
            return name, {"error": str(e)}


def rollout_output(eps: list[Episode], staleness: int) -> dict[str, list]:
    """TRL's rollout_func output (prompt_ids, completion_ids, logprobs, env_mask) and the extra fields."""
    return {
        "prompt_ids": [ep.prompt_ids for ep in eps],
        "completion_ids": [ep.completion_ids for ep in eps],
        "logprobs": [ep.logprobs for ep in eps],
        "env_mask": [ep.mask for ep in eps],
        "env_reward": [ep.env.get_reward() if callable(getattr(ep.env, "get_reward", None)) else None for ep in eps],
        "messages": [ep.messages for ep in eps],
        "staleness": [staleness] * len(eps),
    }


@dataclass(frozen=True)
class UnitBounds:
    """What bounds each unit of an episode's work, from the settings that set it (UNITS)."""

    request_timeout_s: float
    """One generation request: the client's deadline for the whole answer (trainer.request_timeout_s)."""
    tool_timeout_s: float
    """One tool call, abandoned past it (trainer.tool_timeout_s)."""
    slack_s: float = 60.0
    """The loop's own work between two units (chat template, response parser): seconds at most."""

    @property
    def reset_s(self) -> float:
        """An environment's construction and reset() (user code with no deadline of its own, often a sandbox's start):
        the larger of the two settings, so a slow reset is not cut off at a tool call's short bound."""
        return max(self.request_timeout_s, self.tool_timeout_s)


UNITS = {
    "generate": ("a generation request", "request_timeout_s", "trainer.request_timeout_s"),
    "tool": ("a tool call", "tool_timeout_s", "trainer.tool_timeout_s"),
    "reset": (
        "an environment's construction and reset()",
        "reset_s",
        "the larger of trainer.request_timeout_s and trainer.tool_timeout_s",
    ),
}
"""unit -> (what it is, the UnitBounds field that bounds it, the setting(s) behind that bound)."""


class Watch:
    """The deadline of the batch of episodes running in the background. A batch is a sequence of units of work, each
    bounded by a setting: at most 1 + max_tool_calling_iterations generation requests (trainer.request_timeout_s
    each), its tool calls (trainer.tool_timeout_s each; how many per turn is the model's choice) and one construction
    + reset() per episode (the larger of the two settings). So its worst case is that sum, known only as the batch
    goes: the deadline moves on as each unit begins, to its start + its bound + slack. A batch past it is stuck
    outside every deadline (a reset() slower than allowed, a hang in the loop itself), never merely slow."""

    def __init__(self, bounds: UnitBounds) -> None:
        self.bounds = bounds
        self.lock = threading.Lock()
        self.unit: str | None = None
        self.step = -1
        self.started = self.deadline = 0.0
        self.thread: int | None = None

    def begin(self, unit: str, step: int) -> None:
        bound = getattr(self.bounds, UNITS[unit][1])
        with self.lock:
            self.unit, self.step, self.thread = unit, step, threading.get_ident()
            self.started = time.monotonic()
            self.deadline = self.started + bound + self.bounds.slack_s

    def idle(self) -> None:
        with self.lock:
            self.unit = None

    def late(self, who: str) -> str | None:
        """Why the running batch is past its deadline (None when it is not, or none runs)."""
        with self.lock:
            unit, step, started, deadline, thread = self.unit, self.step, self.started, self.deadline, self.thread
        now = time.monotonic()
        if unit is None or now <= deadline:
            return None
        what, bound, setting = UNITS[unit]
        frame = sys._current_frames().get(thread) if thread is not None else None
        where = "".join(traceback.format_stack(frame, limit=3)) if frame is not None else "(the thread has ended)\n"
        return (
            f"{who}: the episodes sent ahead for step {step} are stuck: {what} began {now - started:.0f} s ago, past its "
            f"bound of {getattr(self.bounds, bound):g} s ({setting}) + {self.bounds.slack_s:g} s for the "
            f"episode loop's own work. If it legitimately takes that long, raise {setting}. The background "
            f"thread is at:\n{where}"
        )


class EpisodesClosed(Exception):
    """Raised in the background thread at its next unit of work once AheadEpisodes.close() was called."""


class AheadEpisodes:
    """This rank's episodes of the next steps, run in the background (one thread: the turns of one batch at a time)
    with a client of their own; by the step they are for. Every wait for them has the moving deadline of Watch.
    close() ends the thread; it must run however the training ends (trainer.run.Run.train calls it)."""

    POLL_S = 0.5
    """How often a wait looks at the deadline."""

    def __init__(self, loop: EpisodeLoop, generate: Generate, bounds: UnitBounds, who: str = "this rank") -> None:
        self.loop, self.generate, self.who = loop, generate, who
        self.watch = Watch(bounds)
        self.closing = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="episodes-ahead")
        self.pending: dict[int, tuple[list[dict], int, concurrent.futures.Future]] = {}

    def send(self, step: int, rows: list[dict], weights_step: int) -> None:
        if step not in self.pending and not self.closing.is_set():
            self.pending[step] = (rows, weights_step, self.pool.submit(self._run, step, rows))

    def _run(self, step: int, rows: list[dict]) -> list[Episode]:
        def note(unit: str) -> None:
            if self.closing.is_set():
                raise EpisodesClosed(f"{self.who}: the run ended while the episodes of step {step} were running")
            self.watch.begin(unit, step)

        try:
            return self.loop.run(rows, self.generate, note)
        finally:
            self.watch.idle()

    def _wait(self, futures: list[concurrent.futures.Future]) -> None:
        """Until every one is done; TimeoutError when the batch running is past its deadline (Watch)."""
        while pending := [f for f in futures if not f.done()]:  # done() (not wait()) counts a cancelled one as done
            concurrent.futures.wait(pending, timeout=self.POLL_S)
            why = self.watch.late(self.who) if any(not f.done() for f in pending) else None
            if why:
                raise TimeoutError(why)

    def take(self, step: int, prompts: list) -> tuple[list[Episode], int] | None:
        """The episodes sent for `step` if they were for these prompts (else None: a lookahead miss)."""
        sent = self.pending.pop(step, None)
        if sent is None:
            return None
        rows, weights_step, future = sent
        self._wait([future])
        eps = future.result()
        if [r["prompt"] for r in rows] != list(prompts):
            return None
        return eps, weights_step

    def wait_all(self) -> None:
        """Before a push: nothing of this rank is generating (every episode sent finishes under the weights it began)."""
        futures = [f for _, _, f in self.pending.values()]
        self._wait(futures)
        for f in futures:
            f.result()  # an episode's own error surfaces here, before the push

    def close(self, wait: bool = True) -> None:
        """Ends the background thread: batches not begun are dropped, the running one stops at its next unit of work
        (the current request or tool call ends by its own deadline); wait: until it has, under the same deadline
        (not on an error's way out, which must not be delayed: the process exits at once, trainer.main)."""
        self.closing.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        futures = [f for _, _, f in self.pending.values()]
        self.pending.clear()
        if wait:
            self._wait(futures)
            self.pool.shutdown(wait=True)  # at once: the thread has no batch left
