"""Multi-turn generation: every rank is a client of its node's own server, with no collective between ranks.

TRL's tool loop (and a user's rollout_func) asks for generations a different number of times on each rank: a rank
whose episodes call tools three times makes four requests while its neighbour, done after one, makes one. The
single-turn path gathers a node's prompts on its leader (trainer.rollout.node.node_generate), a collective that would
wait forever here. So in multi-turn mode each rank sends its own requests straight to 127.0.0.1 and vLLM batches the
concurrent requests of the node's ranks itself.

Pushes stay at step boundaries: TRL calls `sync_weights` once per step on every rank, before that step's first
request, and the push is a collective over the node's ranks (the FSDP gather), so it starts only after every rank has
finished the previous step's episodes: no request of the node is in flight while weights change. The after-push parity
probe goes out beside the step's first turns; it is checked, and every node's figures gathered, at the step's end
(NodeRollout.end_step, from the callback's on_step_end on every rank), where every rank is again in step. In TRL's own
tool loop every rank's first request of a step is its whole batch's first turn, made by every rank before any
optimizer step: the trainer's side of the probe (an FSDP forward, a collective of the world) runs there, while the
server generates that turn (`forward_in_first_turn`). A user's rollout_func promises no such request: its forward
stays at the push.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer.rollout.node import MeanwhileFailed, NodeRollout, TrlAdapter, beside
from trainer.rollout.server import VllmServer


class RankGeneration(TrlAdapter):
    """What TRL builds as its generation backend in multi-turn mode (trainer.trl_glue hooks 1 and 2)."""

    def __init__(self, rollout: NodeRollout, **trl_kwargs: Any) -> None:
        super().__init__(rollout, **trl_kwargs)
        s = rollout.settings
        self.client = VllmServer(s.server_url, s.model, s.node, s.request_timeout_s)
        rollout.gather_at_step_end = True  # no collective between the ranks' turns: the figures wait for on_step_end
        self.requests = 0
        """Generation requests this rank sent since the last `take_figures` (one per turn of its batch)."""
        self.gen_s = 0.0
        self.tokens = 0
        self.before_push: Callable[[], None] | None = None
        """Waits for this rank's episodes running ahead (trainer.agents.ahead_rollout), so none straddles a push."""
        self.forward_in_first_turn = False
        """TRL's tool loop drives generate (trainer.run): each step's first call on every rank, before the optimizer
        step, runs the push's parity forward beside its request."""

    def generate(self, prompts: list[list[int]], images, num_generations: int, profiler=None):
        """One completion per prompt entry, from this rank's own request (TRL passes the prompts already repeated
        num_generations times, and later turns one history per episode)."""
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("node-local generation serves text prompts only")

        def ask():
            t0 = time.time()
            out = self.client.complete(prompts, **self.sampling, step=self.rollout.step)
            self.gen_s += time.time() - t0
            return out

        # the step's first turn: the push's parity forward (every rank, this same call) while the server generates it
        try:
            comps = beside(ask, self.rollout.probe_forward) if self.rollout.probe_forward_due else ask()
        except MeanwhileFailed as e:
            raise MeanwhileFailed(f"node {self.rollout.settings.node} rank {os.environ.get('RANK', '0')}: {e}") from e
        self.requests += 1
        self.tokens += sum(len(c) for c, _ in comps)
        return prompts, [c for c, _ in comps], [[[lp] for lp in lps] for _, lps in comps], None

    def sync_weights(self) -> None:
        """Once per step on every rank: the push (a collective: every rank of the node has finished its episodes), its
        parity probe sent beside the first turns; checked and gathered with every node's figures at the step's end. The
        node barrier after it stands where the world's figure gather used to: it keeps every turn after the push."""
        if self.before_push is not None:
            self.before_push()
        self.rollout.push(self.rollout.step, probe_in_background=True, forward_in_generation=self.forward_in_first_turn)
        # the other ranks leave the push's collectives while the leader still finishes it on the server (the last
        # bucket, finish_weight_update, the prefix reset): none may send a turn before that (vLLM's CPU worker
        # crashed on one arriving mid-update)
        dist.barrier(group=self.rollout.par.node_group)

    def take_figures(self) -> dict[str, float]:
        out = {"requests": self.requests, "gen_s": self.gen_s, "tokens": self.tokens}
        self.requests, self.gen_s, self.tokens = 0, 0.0, 0
        return out
