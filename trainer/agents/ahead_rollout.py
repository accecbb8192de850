"""Multi-turn with trainer.max_staleness k >= 1: the project's episode loop (trainer.agents.episodes) as TRL's
rollout_func. At step g it hands TRL the episodes sent at step g - 1 (or earlier; whole episodes, every turn under the
weights of their start), or runs them now on a lookahead miss, then sends the episodes of steps g+1..g+k (the train
dataloader read ahead, trainer.data.LookaheadPrompts) to its background thread. Tools and environments are the ones
TRL would run (same deadlines); TRL is given neither, only this rollout_func and a reward function per environment
class that reads get_reward()'s value."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

from trainer import trl_glue
from trainer.agents.deadline import CLOCK
from trainer.agents.episodes import AheadEpisodes, Episode, EpisodeLoop, LoopSettings, UnitBounds, rollout_output
from trainer.agents.figures import Trace, log, trace, turns
from trainer.agents.generation import RankGeneration
from trainer.agents.resolve import Agents
from trainer.rollout.server import VllmServer


def tool_suffix_ids(tokenizer, chat_template: str | None, kwargs: dict, tool_messages: list[dict]) -> list[int]:
    """The ids of the template's tool turn after an assistant turn that called the tools (what TRL 1.16's
    _get_tool_suffix_ids computes: a dummy conversation rendered with and without the tool messages)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    render = dict(tokenize=True, chat_template=chat_template, return_dict=False, **kwargs)
    prefix = list(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **render))
    full = list(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, **render))
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:  # aligned at the assistant turn's end (EOS), as TRL does
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders the tool turn in a way that changes the turns before it")
    return full[len(prefix) :]


def episode_len_limit(server_max_model_len: int, max_position_embeddings: int) -> int:
    """The length an episode's next prompt must stay under: the server's --max-model-len (vllm.max_model_len; vLLM
    refuses a longer prompt with an HTTP 400, which would fail the step instead of ending the episode), else the model's
    own (0 = vLLM takes max_position_embeddings). G8 of ../shared/GPU-AUDIT.md; TRL's colocate branch uses vLLM's too."""
    return server_max_model_len or max_position_embeddings


def make_loop(tokenizer, agents: Agents, max_completion_length: int, max_model_len: int, max_iterations: int,
              template_kwargs: dict) -> EpisodeLoop:  # fmt: skip
    """The loop with TRL's own tokenization, template choice and response parser."""
    template = trl_glue.response_parsing(tokenizer)  # TRL's parser, and its template if the model's would not do
    factory = agents.environment_factory
    factories: dict[str | None, Callable] = {}
    if isinstance(factory, dict):
        factories.update(factory)
    elif factory is not None:
        factories[None] = factory

    def render(prompt: list[dict], tools: list[Callable]) -> list[int]:
        out = tokenizer.apply_chat_template(
            conversation=[prompt], tools=tools or None, chat_template=template, add_generation_prompt=True,
            tokenize=True, return_dict=True, **template_kwargs,
        )  # fmt: skip
        return list(out["input_ids"][0])

    return EpisodeLoop(
        factories,
        list(agents.tools or []),
        render,
        lambda messages: tool_suffix_ids(tokenizer, template, template_kwargs, messages),
        lambda ids, prefix, tools: trl_glue.parse_response(tokenizer, ids, prefix, tools),
        LoopSettings(max_completion_length, max_model_len, max_iterations),
    )


def trainer_loop(trainer, agents: Agents, server_max_model_len: int) -> EpisodeLoop:
    """The loop with the trainer's tokenizer and settings (the episodes run ahead, and the eval episodes); episodes are
    bounded by the server's context (vllm.max_model_len, 0 = the model's own)."""
    args = trainer.args
    return make_loop(
        trainer.processing_class,
        agents,
        args.max_completion_length,
        episode_len_limit(server_max_model_len, trainer.model.config.max_position_embeddings),
        args.max_tool_calling_iterations if args.max_tool_calling_iterations is not None else 2**31,
        args.chat_template_kwargs or {},
    )


def environment_rewards(agents: Agents) -> list[Callable]:
    """One reward function per environment class with a get_reward (named after it, as TRL names its own), reading the
    episode's value from the rollout's extra field."""
    factory = agents.environment_factory
    factories = list(factory.values()) if isinstance(factory, dict) else ([factory] if factory else [])
    out, seen = [], set()
    for f in factories:
        cls = type(f())
        if cls in seen or not callable(getattr(cls, "get_reward", None)):
            continue
        seen.add(cls)

        def reward(completions, env_reward, env_class, _cls=cls.__name__, **kwargs):
            return [r if c == _cls else None for r, c in zip(env_reward, env_class, strict=True)]

        reward.__name__ = cls.__name__
        out.append(reward)
    return out


class AheadRollout:
    """The rollout_func TRL calls on every rank, once per generation (k >= 1, multi-turn)."""

    def __init__(
        self, agents: Agents, lookahead, max_staleness: int, max_steps: int, bounds: UnitBounds, max_model_len: int = 0
    ) -> None:
        """bounds: trainer.request_timeout_s and trainer.tool_timeout_s, which bound every wait for the episodes;
        max_model_len: the plan's vllm.max_model_len (0: the model's own)."""
        self.agents, self.lookahead, self.k, self.max_steps, self.bounds = agents, lookahead, max_staleness, max_steps, bounds
        self.max_model_len = max_model_len
        self.rows: list[dict] = []
        self.loop: EpisodeLoop | None = None
        self.ahead: AheadEpisodes | None = None
        self.backend: RankGeneration | None = None
        self.write: Trace = lambda kind, **data: None

    def attach(self, trainer, backend: RankGeneration) -> None:
        """After the trainer is built: its tokenizer and settings, a background client, the push waits for it."""
        self.loop = trainer_loop(trainer, self.agents, self.max_model_len)
        self.backend = backend
        s, sampling = backend.rollout.settings, backend.sampling
        client = VllmServer(s.server_url, s.model, s.node, s.request_timeout_s)  # the background thread's own
        self.ahead = AheadEpisodes(
            self.loop,
            lambda prompts: client.complete(prompts, **sampling, step=backend.rollout.step),
            self.bounds,
            f"node {s.node} rank {os.environ.get('RANK', '0')}",
        )
        backend.before_push = lambda: self.ahead.wait_all() if self.ahead else None
        trl_glue.before_generate_and_score(trainer, self._keep_rows)
        self.write = trace(trainer, int(os.environ.get("RANK", "0")))

    def _keep_rows(self, inputs: list[dict]) -> None:
        self.rows = [dict(x) for x in inputs]

    def __call__(self, prompts: list, trainer) -> dict[str, Any]:
        assert self.loop is not None and self.ahead is not None and self.backend is not None, "attach() first"
        step, backend = trainer.state.global_step, self.backend
        got = self.ahead.take(step, prompts)
        if got is not None:
            eps, staleness = got[0], step - got[1]
        else:  # nothing sent ahead for these prompts (the first step, or a lookahead miss): run them now
            eps = self.loop.run(self.rows, lambda p: backend.client.complete(p, **backend.sampling, step=step))
            staleness = 0
        following = self.lookahead.loader.following if self.lookahead.loader is not None else []
        for j, rows in enumerate(following[: self.k], start=1):
            if step + j < self.max_steps:
                self.ahead.send(step + j, [dict(r) for r in rows], weights_step=step)
        self._log(trainer, eps, staleness)
        out = rollout_output(eps, staleness)
        out["env_class"] = [type(ep.env).__name__ if ep.env is not None else "" for ep in eps]
        return out

    def close(self, wait: bool = True) -> None:
        """Ends the background thread (trainer.run.Run.train, however the training ended; AheadEpisodes.close)."""
        if self.ahead is not None:
            self.ahead.close(wait)

    def _log(self, trainer, eps: list[Episode], staleness: int) -> None:
        per_episode = turns([ep.mask for ep in eps], len(eps))
        calls, tools = sum(ep.tool_calls for ep in eps), CLOCK.take()
        figures = {
            "agents/staleness": staleness,
            "agents/turns_per_episode": statistics.mean(per_episode) if per_episode else 0.0,
            "agents/turns_max": max(per_episode, default=0),
            "tools/call_frequency": calls / max(1, len(eps)),
            "tools/failure_frequency": sum(ep.tool_failures for ep in eps) / max(1, calls),
            "agents/tool_calls": calls,
            "agents/tool_failures": sum(ep.tool_failures for ep in eps),
            "agents/tool_timeouts": tools["timeouts"],
            "agents/tool_s": tools["seconds"],
        }
        log(trainer, figures)
        self.write(
            "generated",
            prompt_ids=[ep.prompt_ids for ep in eps],
            completion_ids=[ep.completion_ids for ep in eps],
            tool_mask=[ep.mask for ep in eps],
            figures=figures,
        )
