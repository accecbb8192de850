"""Routing replay (trainer.routing_replay, MoE only): the trainer's forward routes each token to the experts vLLM routed
it to when it generated the sample, so the trainer's logprobs are those of the routing that produced the tokens (the
"R3" fix of the vLLM-vs-trainer mismatch that routing flips cause). See shared MOE-NOTES §5.

  RouteTable     this rank's samples of the latest generation -> their routes (trainer.rollout.server.RoutedExperts),
                 keyed by the sequence's tokens (prompt + completion), which is how a training row finds its own sample
                 whatever TRL's shuffling, splitting and chunking did to the batch.
  RoutingReplay  installed on the model: wraps each MoE layer's router (transformers 5.19's TopKRouter of qwen3_moe,
                 qwen2_moe, olmoe, mixtral, gpt_oss) and, while `armed` (trainer.trl_glue.around_logprobs: TRL's logprob
                 forwards), looks up every row of each forward's input in the table. Rows replayed return vLLM's expert
                 ids with weights = the router's own softmax probabilities gathered at those ids (renormalized as the
                 family does), so router gradients and router_logits (the aux loss) stay. The indices stay set after the
                 forward: activation checkpointing recomputes the layers during backward, and must route the same way.

Alignment: the router sees hidden.reshape(-1, H), rows in (batch, position) order. vLLM's row t is input position
prompt_start + t of the sequence's real tokens (left-padded prompt, right-padded completion), covering positions up to
N-2 of N tokens; the last position and padding keep the router's own choice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from launcher.core.config import ROUTING_REPLAY_FAMILIES
from trainer import trl_glue
from trainer.rollout.server import RoutedExperts

ROUTERS = {
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "olmoe": "OlmoeTopKRouter",
    "mixtral": "MixtralTopKRouter",
    "gpt_oss": "GptOssTopKRouter",
}
"""model_type -> transformers 5.19's router class: forward(hidden) -> (router_logits, weights, indices), softmax over
the logits in fp32, top-k, renormalized when norm_topk_prob (mixtral: always); MOE-NOTES §5 gives file:line."""
TOPK_SOFTMAX = frozenset({"gpt_oss"})
"""Families whose router takes the top-k of the logits first and softmaxes those alone, in the logits' dtype (the same
weights as a renormalized softmax, up to rounding): replay weighs the replayed ids the same way, bit for bit."""
assert set(ROUTERS) == set(ROUTING_REPLAY_FAMILIES), "the launcher's menu and the trainer's overrides must agree"

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RouteTable:
    """This rank's routes of its latest generation, by the sequence's tokens."""

    def __init__(self) -> None:
        self.routes: dict[tuple[int, ...], RoutedExperts] = {}
        self.without_routes = 0
        self.misfit = 0
        """Completions whose routes do not cover their tokens (e.g. a request recomputed after a push): they keep the
        trainer's own routing, like a completion without routes, and are counted and warned about."""
        """Samples of the latest generation that came back without routes (aborted before their first forward)."""

    def replace(self, samples: Iterable[tuple[list[int], list[int], RoutedExperts | None]]) -> None:
        """(prompt ids, completion ids, routes) of a new generation; the previous one's are dropped (memory)."""
        self.routes, self.without_routes, self.misfit = {}, 0, 0
        for prompt, completion, routes in samples:
            if routes is None:
                self.without_routes += 1
                continue
            n = len(prompt) + len(completion)
            if routes.prompt_start + len(routes.rows) != n - 1:  # vLLM's rows cover positions prompt_start .. N-2
                self.misfit += 1
                continue
            self.routes[tuple(prompt) + tuple(completion)] = routes

    def lookup(self, tokens: tuple[int, ...]) -> RoutedExperts | None:
        return self.routes.get(tokens)


@dataclass
class Replay:
    """What the routers replay for the current forward's rows."""

    indices: torch.Tensor
    """(rows, num_hidden_layers, top_k) expert ids, rows = batch x positions; int16 from the table (a quarter of
    int64's memory: the whole batch's ids sit on the device through forward and backward), widened per layer."""
    mask: torch.Tensor
    """(rows,) bool: the rows that replay; the others keep the router's own choice."""


class RoutingReplay:
    """The router override of one model (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, table: RouteTable | None = None) -> None:
        self.table = table or RouteTable()
        self.current: Replay | None = None
        """What the routers replay, set before each forward (None = every router routes by itself); kept through its
        backward."""
        self.given: Replay | None = None
        """set()'s replay, for the forwards outside `armed` (tests, the GPU bench); None outside them in a job."""
        self.is_armed = False
        self.rows_seen = self.rows_replayed = 0
        """Sequences the armed forwards saw, and those of them found in the table (a figure: routing_replay/hit)."""
        config = getattr(model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        family = getattr(text, "model_type", "")
        if family not in ROUTERS:
            raise ValueError(f"trainer.routing_replay: no router override for model_type {family!r}; known: {', '.join(ROUTERS)}")
        self.layers = int(getattr(text, "num_hidden_layers", 0))
        self.routers = 0
        for name, module in model.named_modules():
            if type(module).__name__ == ROUTERS[family]:
                layer = _LAYER.search(name)
                assert layer is not None, f"router {name} outside a decoder layer"
                self._wrap(module, int(layer.group(1)), family in TOPK_SOFTMAX)
                self.routers += 1
        if not self.routers:
            raise ValueError(f"trainer.routing_replay: the model has no {ROUTERS[family]} module (transformers changed?)")
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _wrap(self, router: torch.nn.Module, layer: int, topk_softmax: bool) -> None:
        own = router.forward
        renormalize = bool(getattr(router, "norm_topk_prob", True))  # mixtral has no flag: it always renormalizes

        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            logits, weights, indices = own(hidden_states)
            replay = self.current
            if replay is None:
                return logits, weights, indices
            assert replay.indices.shape[0] == logits.shape[0], (replay.indices.shape, logits.shape)
            chosen = replay.indices[:, layer].long()
            if topk_softmax:
                replayed = torch.softmax(logits.gather(-1, chosen), dim=-1, dtype=logits.dtype)
            else:
                probs = torch.softmax(logits.float(), dim=-1)  # as the family's router: softmax in fp32
                replayed = probs.gather(-1, chosen)
                if renormalize:
                    replayed = replayed / replayed.sum(dim=-1, keepdim=True)
            rows = replay.mask[:, None]
            return logits, torch.where(rows, replayed.to(weights.dtype), weights), torch.where(rows, chosen, indices)

        router.forward = forward  # type: ignore[method-assign]

    def set(self, indices: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """Replay `indices` ((rows, layers, top_k)) in the forwards outside `armed` (mask: which rows; None = all);
        None = off."""
        if indices is None:
            self.given = self.current = None
            return
        rows = indices.shape[0]
        m = torch.ones(rows, dtype=torch.bool, device=indices.device) if mask is None else mask.reshape(rows).bool()
        self.given = self.current = Replay(indices, m)

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Forwards inside replay what the table holds for their rows (trainer.trl_glue.around_logprobs)."""
        self.is_armed = True
        try:
            yield
        finally:
            self.is_armed = False

    def _before_forward(self, _module: Any, args: tuple, kwargs: dict) -> None:
        if not self.is_armed:  # in a job a forward of its own (parity): the routers route by themselves
            self.current = self.given
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        assert input_ids is not None, "routing replay needs the forward's input_ids"
        self.current = self.replay_for(input_ids, kwargs.get("attention_mask"))

    def replay_for(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> Replay | None:
        """The table's routes placed at each row's positions (see the module's docstring); None when no row is found."""
        batch, length = input_ids.shape
        ids = input_ids.tolist()
        real = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).bool().tolist()
        indices: np.ndarray | None = None
        mask = np.zeros((batch, length), dtype=bool)
        for b in range(batch):
            positions = [p for p in range(length) if real[b][p]]
            self.rows_seen += 1
            routes = self.table.lookup(tuple(ids[b][p] for p in positions))
            if routes is None:
                continue
            if routes.rows.shape[1] != self.layers:
                raise ValueError(
                    f"routed_experts has {routes.rows.shape[1]} layers, the model {self.layers}: the server serves another "
                    "model than the trainer's; point vllm.model at the trainer's model, or set trainer.routing_replay: false"
                )
            self.rows_replayed += 1
            if indices is None:
                indices = np.zeros((batch, length, self.layers, routes.rows.shape[2]), dtype=np.int16)
            at = positions[routes.prompt_start : routes.prompt_start + len(routes.rows)]
            indices[b, at] = routes.rows
            mask[b, at] = True
        if indices is None:
            return None
        device = input_ids.device
        return Replay(
            torch.from_numpy(indices).to(device).reshape(batch * length, self.layers, -1),
            torch.from_numpy(mask).to(device).reshape(-1),
        )

    def attach(self, trainer) -> None:
        """Replay in the trainer's logprob forwards (trainer.trl_glue hook 17); each computation logs the share of its
        sequences found in the table as routing_replay/hit (1.0 when every sample came back with its routes)."""

        @contextmanager
        def replaying() -> Iterator[None]:
            with self.armed():
                yield
            rate = self.take_hit_rate()
            if rate is not None:
                trl_glue.log_metric(trainer, "routing_replay/hit", rate)

        trl_glue.around_logprobs(trainer, replaying)

    def take_hit_rate(self) -> float | None:
        """The share of sequences replayed since the last call (None if none was seen)."""
        seen, hit = self.rows_seen, self.rows_replayed
        self.rows_seen = self.rows_replayed = 0
        return hit / seen if seen else None
